"""What a CKKS decryptor pays to decrypt only sums it verified (issue 21, item 5).

Since wire version 0xC2 a decryptor no longer receives one summed ciphertext per tensor from the
server: it receives every surviving member's signed upload of each group it decrypts, checks each
signature over the chunk digests, and adds the ciphertexts itself.  This prints, for one in-process
CKKS session (8 clients, d = 256 by default, the bench_ckks layout: the Gram in every class group
and in ``all``, N = 8192):

- bytes a decryptor receives in R4 (R3 before issue 27's signed view), next to what the old request
  carried (one ciphertext set per group, the size of one member's upload of it): the ratio is about
  the group's survivors;
- per group, the seconds to check and add the uploads next to the seconds to decrypt the sum,
  measured side by side in this run (a ratio, not a wall time).

Measured (2026-12-01, this 2-core host, d = 256): at missing 7 (one member per class group, 8 in
``all``) decryptors receive 1.71 times the old request's bytes (50.4 MB vs 29.5 MB) and spend 1.57
times the decryption's seconds checking and adding; at missing 1 (7 members per class group) 7.11
times the bytes (210 MB vs 29.5 MB) and 6.4 times.  The bytes scale with the group's survivors: the
price of never decrypting a ciphertext the server chose.

``--clients N`` (issue 30) adds, per group, what its decryptor downloads (every surviving member's
upload of the group: its chunks, the digests of all its other chunks, its signature) next to the
formula ``bytes(g) = S_g * (C_g * b + 32 * C_u + s)`` (S_g the group's survivors, C_g its chunks per
member, b the bytes of one ciphertext, C_u the chunks of a member's whole upload, s the signature and
framing), checks the formula against the measurement, and extrapolates it to d = 1024 (``--to-dim``)
and to a group split across m decryptors by chunk (the bound proposed in SECURITY.md §7.6).

Run from the repository root: ``python bench/bench_ckks_verify.py [--dim D] [--missing M] [--clients N]``;
issue 30's figure: ``python bench/bench_ckks_verify.py --clients 100 --dim 8 --missing 1``.
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_secure import fmt_bytes, round1, timed_statistics

from secure_afl.aggregation.backend import CkksBackend
from secure_afl.aggregation.inprocess import run_in_process
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.protocol import crypto
from secure_afl.protocol.ckks import binding, context
from secure_afl.protocol.ckks.context import CkksParameters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256, help="feature dimension (1024 in the paper)")
    parser.add_argument("--missing", type=int, default=7)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--to-dim", type=int, default=1024, help="extrapolate the bytes to this d")
    args = parser.parse_args()
    stats, _ = timed_statistics(args.clients, args.dim, args.rows, 0)
    contributions = round1(stats, args.missing)
    parameters = CkksParameters()
    backend = CkksBackend(parameters=parameters, client_policy=ClientPolicy.simulator())
    servers = []
    make_server = CkksBackend.server_session

    def keep(self, *a, **k):  # type: ignore[no-untyped-def]
        servers.append(make_server(self, *a, **k))
        return servers[-1]

    CkksBackend.server_session = keep  # type: ignore[method-assign]
    result = run_in_process(backend, contributions, symmetric=("gram",))  # type: ignore[arg-type]
    costs = result.costs
    (server,) = servers
    decryptors = sorted(c for c in costs.bytes_received if costs.bytes_received[c].get("R4", 0))
    old = 0
    for group in server._requested.values():
        sizes = [sum(len(ch) for t in u.tensors for ch in t.chunks) for u in group.uploads]
        old += int(statistics.mean(sizes))
    new = sum(costs.bytes_received[c]["R4"] for c in decryptors)
    n = args.clients
    print(f"#### CKKS R4 with verified sums: {n} clients, d = {args.dim}, missing {args.missing}, N = 8192")
    print(f"machine: {platform.machine()}; python {platform.python_version()}\n")
    print("| figure | value |\n|---|---|")
    print(f"| decryptors | {len(decryptors)} |")
    print(f"| R4 bytes received, all decryptors (verified uploads) | {fmt_bytes(new)} |")
    print(f"| R4 ciphertext bytes the old request carried (one sum per group) | {fmt_bytes(old)} |")
    print(f"| ratio | {new / old:.2f} |")
    # Check-and-add against decrypt, per group, side by side (the decryptor's own work).
    client = next(iter(result.clients.values()))
    secret = client._context  # type: ignore[attr-defined]
    add_s = dec_s = 0.0
    for group in server._requested.values():
        spec = {t.name: t.length for t in server.config.group(group.group).tensors}
        started = time.perf_counter()
        totals: dict[str, list] = {}
        for upload in group.uploads:
            domain, fields = binding.input_fields_of_digests(
                server.config.session_id, server._digest, upload.sender, upload.digests
            )
            assert crypto.verify(server._roster.public_key(upload.sender), upload.signature, domain, *fields)
            for tensor in upload.tensors:
                assert all(hashlib.sha256(c).digest() for c in tensor.chunks)
                lengths = context.chunk_lengths(spec[tensor.tensor], parameters)
                vectors = [
                    context.load_ciphertext(secret, c, n, parameters)
                    for c, n in zip(tensor.chunks, lengths, strict=True)
                ]
                if tensor.tensor in totals:
                    for total, vector in zip(totals[tensor.tensor], vectors, strict=True):
                        total.add_(vector)
                else:
                    totals[tensor.tensor] = vectors
        add_s += time.perf_counter() - started
        started = time.perf_counter()
        for vectors in totals.values():
            np.asarray(context.decrypt(secret, vectors, parameters))
        dec_s += time.perf_counter() - started
    print(f"| check + add the uploads : decrypt the sums (seconds, same run) | {add_s / dec_s:.2f} : 1 |")
    scaling(server, costs, decryptors, parameters, args)


def _group_lengths(dim: int, missing: int) -> dict[str, dict[str, int]]:
    """Each group's tensor lengths (values sent; the Gram as its triangle) at feature dimension ``dim``."""
    stats, _ = timed_statistics(2, dim, 50, 0)
    lengths: dict[str, dict[str, int]] = {}
    for contribution in round1(stats, missing).values():
        for group, tensors in contribution.items():
            lengths[group] = {
                name: (v.shape[0] * (v.shape[0] + 1) // 2 if name == "gram" else int(np.asarray(v).size))
                for name, v in tensors.items()
            }
    return lengths


def scaling(server, costs, decryptors, parameters, args) -> None:  # type: ignore[no-untyped-def]
    """Per group: measured bytes against the formula; the formula at --to-dim; split by chunk."""
    chunk_bytes = [len(ch) for g in server._requested.values() for u in g.uploads for t in u.tensors
                   for ch in t.chunks]  # fmt: skip
    b = statistics.mean(chunk_bytes)
    upload_chunks = {u.sender: len(u.digests) for g in server._requested.values() for u in g.uploads}
    rows = []
    predicted_total = 0.0
    for name, group in sorted(server._requested.items()):
        survivors = len(group.uploads)
        c_g = sum(len(t.chunks) for t in group.uploads[0].tensors)
        data = sum(len(ch) for u in group.uploads for t in u.tensors for ch in t.chunks)
        digests = sum(32 * upload_chunks[u.sender] for u in group.uploads)
        predicted_total += data + digests
        rows.append((name, survivors, c_g, data, digests))
    measured = sum(costs.bytes_received[c]["R4"] for c in decryptors)
    framing = (measured - predicted_total) / sum(r[1] for r in rows)  # signatures, names, the view
    print(f"\n#### What each decryptor downloads, {args.clients} clients (d = {args.dim})\n")
    print(f"one ciphertext (N = {parameters.poly_modulus_degree}, {parameters.slots} slots): b = "
          f"{fmt_bytes(b)}; signature, names and the view: s = {framing:.0f} B per survivor\n")  # fmt: skip
    print("| group | survivors S_g | chunks C_g | ciphertext bytes | digest bytes |\n|---|---|---|---|---|")
    for name, survivors, c_g, data, digests in rows:
        print(f"| {name} | {survivors} | {c_g} | {fmt_bytes(data)} | {fmt_bytes(digests)} |")
    print(f"\nR4 bytes received by all decryptors: measured {fmt_bytes(measured)}, formula without s "
          f"{fmt_bytes(predicted_total)} ({measured / predicted_total - 1:+.2%})")  # fmt: skip
    lengths = _group_lengths(args.to_dim, args.missing)
    slots = parameters.slots
    chunks = {g: sum(-(-n // slots) for n in t.values()) for g, t in lengths.items()}
    survivors_of = {name: len(group.uploads) for name, group in server._requested.items()}
    c_u = max(sum(chunks[g] for g in lengths if g in own) for own in _memberships(server))
    print(f"\n#### Extrapolated to d = {args.to_dim} (the formula; {args.clients} clients, missing "
          f"{args.missing}; C_u = {c_u} chunks in the largest upload)\n")  # fmt: skip
    print("| group | S_g | C_g | one decryptor today | split by chunk over m = min(S_g, C_g) decryptors |")
    print("|---|---|---|---|---|")
    for group in sorted(survivors_of):
        s_g, c_g = survivors_of[group], chunks[group]
        today = s_g * (c_g * b + 32 * c_u + framing)
        m = min(s_g, c_g)
        split = s_g * (-(-c_g // m) * b + 32 * c_u + framing)
        print(f"| {group} | {s_g} | {c_g} | {fmt_bytes(today)} | {fmt_bytes(split)} (m = {m}) |")


def _memberships(server) -> list[set[str]]:  # type: ignore[no-untyped-def]
    members: dict[str, set[str]] = {}
    for name, group in server._requested.items():
        for upload in group.uploads:
            members.setdefault(upload.sender, set()).add(name)
    return list(members.values())


if __name__ == "__main__":
    main()
