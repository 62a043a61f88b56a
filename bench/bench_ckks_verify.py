"""What a CKKS decryptor pays to decrypt only sums it verified.

Since wire version 0xC2 a decryptor no longer receives one summed ciphertext per tensor from the
server: it receives every surviving member's signed upload of each group it decrypts, checks each
signature over the chunk digests, and adds the ciphertexts itself.  This prints, for one in-process
CKKS session (8 clients, d = 256 by default, the bench_ckks layout: the Gram in every class group
and in ``all``, N = 8192):

- bytes a decryptor receives in R4 (R3 before the signed view), next to what the old request
  carried (one ciphertext set per group, the size of one member's upload of it): the ratio is about
  the group's survivors;
- per group, the seconds to check and add the uploads next to the seconds to decrypt the sum,
  measured side by side in this run (a ratio, not a wall time).

Measured (2026-12-01, this 2-core host, d = 256): at missing 7 (one member per class group, 8 in
``all``) decryptors receive 1.71 times the old request's bytes (50.4 MB vs 29.5 MB) and spend 1.57
times the decryption's seconds checking and adding; at missing 1 (7 members per class group) 7.11
times the bytes (210 MB vs 29.5 MB) and 6.4 times.  The bytes scale with the group's survivors: the
price of never decrypting a ciphertext the server chose.

``--clients N`` adds, per group, what its decryptor downloads (every surviving member's
upload of the group: its chunks, the digests of all its other chunks, its signature) next to the
formula ``bytes(g) = S_g * (C_g * b + 32 * C_u + s)`` (S_g the group's survivors, C_g its chunks per
member, b the bytes of one ciphertext, C_u the chunks of a member's whole upload, s the signature and
framing), checks the formula against the measurement, and extrapolates it to d = 1024 (``--to-dim``).

Since the chunk split (SECURITY.md §7.6, wire 0xC4) the bench runs the same contributions twice in
one process: with ``max_decryptors_per_group=1`` (every group decrypted whole by one member, as
before) and with the default split (m = min(S_g, C_g) decryptors per group, each sent only its chunk
set K_j), and reports side by side the bytes each decryptor receives in R4 and its seconds to check
and add what it received (replayed outside the protocol from the R4 requests, next to the seconds to
decrypt the sums), then checks the per-decryptor formula ``Σ_items S_g * (|K_j| * b + 32 * C_u)``
plus a per-request framing against every decryptor's measured bytes.

Run from the repository root: ``python bench/bench_ckks_verify.py [--dim D] [--missing M] [--clients N]``;
the figure at n = 100: ``python bench/bench_ckks_verify.py --clients 100 --dim 8 --missing 1 --rows 200``.
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
from secure_afl.protocol.ckks.messages import CkksSessionConfig
from secure_afl.protocol.ckks.server import CkksServerSession, plan_chunk_sets


def _session(contributions, parameters, cap):  # type: ignore[no-untyped-def]
    """One in-process CKKS session with ``max_decryptors_per_group=cap``: (run, server, R4 requests)."""
    backend = CkksBackend(parameters=parameters, client_policy=ClientPolicy.simulator())
    servers: list[CkksServerSession] = []
    requests: dict[str, list] = {}

    def make_server(self, roster, layout, *, session_id, min_group_size, context=b""):  # type: ignore[no-untyped-def]
        config = CkksSessionConfig(session_id, min_group_size, parameters, layout.group_specs())
        servers.append(CkksServerSession(roster, config, context=context, max_decryptors_per_group=cap))
        return servers[-1]

    ask = CkksServerSession._ask

    def keep_requests(self, plan):  # type: ignore[no-untyped-def]
        sent = ask(self, plan)
        for decryptor, request in sent.items():
            requests.setdefault(decryptor, []).append(request)
        return sent

    original = CkksBackend.server_session
    CkksBackend.server_session = make_server  # type: ignore[method-assign]
    CkksServerSession._ask = keep_requests  # type: ignore[method-assign]
    try:
        run = run_in_process(backend, contributions, symmetric=("gram",))  # type: ignore[arg-type]
    finally:
        CkksBackend.server_session = original  # type: ignore[method-assign]
        CkksServerSession._ask = ask  # type: ignore[method-assign]
    (server,) = servers
    return run, server, requests


def _check_and_add(server, request, secret, parameters) -> tuple[float, float, list]:  # type: ignore[no-untyped-def]
    """A decryptor's own work on one R4 request, replayed: (check + add seconds, decrypt seconds,
    the chunk sums).  The checks are the client's: each member's signature over its digests, each
    chunk against the digest signed at its index, then the sum."""
    check_s = dec_s = 0.0
    sums = []
    for item in request.groups:
        layout = server._layouts[item.group]
        started = time.perf_counter()
        totals: list = []
        for upload in item.uploads:
            domain, fields = binding.input_fields_of_digests(
                server.config.session_id, server._digest, upload.sender, upload.digests
            )
            assert crypto.verify(server._roster.public_key(upload.sender), upload.signature, domain, *fields)
            listed = {d.tensor: d.chunk_digests for d in upload.digests if d.group == item.group}
            for position, (k, chunk) in enumerate(zip(item.chunks, upload.chunks, strict=True)):
                tensor, i, n = layout[k]
                assert hashlib.sha256(chunk).digest() == listed[tensor][i]
                vector = context.load_ciphertext(secret, chunk, n, parameters)
                if position < len(totals):
                    totals[position].add_(vector)
                else:
                    totals.append(vector)
        check_s += time.perf_counter() - started
        started = time.perf_counter()
        sums.extend(np.asarray(context.decrypt(secret, [v], parameters)) for v in totals)
        dec_s += time.perf_counter() - started
    return check_s, dec_s, sums


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
    runs = {}
    for label, cap in (
        ("whole group, one decryptor (m = 1, before)", 1),
        ("split by chunk (m = min(S_g, C_g))", None),
    ):
        runs[label] = _session(contributions, parameters, cap)
    n = args.clients
    print(f"#### CKKS R4 with verified sums: {n} clients, d = {args.dim}, missing {args.missing}, N = 8192")
    print(f"machine: {platform.machine()}; python {platform.python_version()}\n")
    (whole_run, whole_server, _), (split_run, split_server, _) = runs.values()
    old = 0
    for group in whole_server._requested.values():
        sizes = [sum(len(ch) for ch in u.chunks) for u in group.uploads]
        old += int(statistics.mean(sizes))
    print("| figure | " + " | ".join(runs) + " |\n|---|---|---|")
    rows: dict[str, list[str]] = {}
    for run, server, requests in runs.values():
        costs = run.costs
        received = {c: costs.bytes_received[c]["R4"] for c in requests}
        secret = next(iter(run.clients.values()))._context  # type: ignore[attr-defined]
        work = {c: [_check_and_add(server, r, secret, parameters) for r in rs] for c, rs in requests.items()}
        check = {c: sum(w[0] for w in ws) for c, ws in work.items()}
        decrypt = sum(w[1] for ws in work.values() for w in ws)
        busiest = max(received, key=lambda c: received[c])
        rows.setdefault("decryptors", []).append(str(len(requests)))
        rows.setdefault("R4 bytes received, all decryptors", []).append(fmt_bytes(sum(received.values())))
        rows.setdefault("R4 bytes received, the most loaded decryptor", []).append(
            f"{fmt_bytes(received[busiest])} ({busiest})"
        )
        rows.setdefault("R4 bytes received, mean per decryptor", []).append(
            fmt_bytes(statistics.mean(received.values()))
        )
        rows.setdefault("check + add seconds, the slowest decryptor", []).append(
            f"{max(check.values()):.3f} s"
        )
        rows.setdefault("check + add seconds, all decryptors", []).append(f"{sum(check.values()):.3f} s")
        rows.setdefault("check + add : decrypt (seconds, all decryptors)", []).append(
            f"{sum(check.values()) / decrypt:.1f} : 1"
        )
        rows.setdefault("R4 client seconds (protocol), the slowest decryptor", []).append(
            f"{max(costs.client_seconds[c]['R4'] for c in requests):.3f} s"
        )
    for name, values in rows.items():
        print(f"| {name} | " + " | ".join(values) + " |")
    print(f"\nThe old request (one summed ciphertext set per group, before 0xC2) carried {fmt_bytes(old)}.")
    # Same sums: the split and the whole-group decryption agree to the output grid.
    worst = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(split_run.outcome.sums[g][t]))))
        for g, tensors in whole_run.outcome.sums.items()
        for t, a in tensors.items()
    )
    print(f"max |split sum - whole-group sum| = {worst:.3g} (output grid 2^-{parameters.output_frac_bits})")
    framing = [
        per_decryptor_formula(label, server, run.costs, requests)
        for label, (run, server, requests) in runs.items()
    ]
    scaling(split_server, parameters, args, framing[-1])


def per_decryptor_formula(label, server, costs, requests) -> float:  # type: ignore[no-untyped-def]
    """Each decryptor's measured R4 bytes against Σ_items S_g (|K_j| b + 32 C_u); returns the rest
    per survivor sent (s: signature, names, the view and its signatures)."""
    b = _chunk_bytes(server)
    c_u = {
        u.sender: sum(len(d.chunk_digests) for d in u.digests)
        for g in server._requested.values()
        for u in g.uploads
    }
    worst = 0.0
    framing = []
    for decryptor, rs in requests.items():
        predicted = sum(
            len(item.uploads) * len(item.chunks) * b + sum(32 * c_u[u.sender] for u in item.uploads)
            for r in rs
            for item in r.groups
        )
        measured = costs.bytes_received[decryptor]["R4"]
        worst = max(worst, abs(measured / predicted - 1))
        framing.append((measured - predicted) / sum(len(item.uploads) for r in rs for item in r.groups))
    print(f"\n{label}: per-decryptor bytes vs S_g (|K_j| b + 32 C_u), b = {fmt_bytes(b)}: worst "
          f"{worst:.2%} off; the rest, s = {statistics.mean(framing):.0f} B per survivor sent "
          f"(signature, names, the view and its signatures)")  # fmt: skip
    return statistics.mean(framing)


def _chunk_bytes(server) -> float:  # type: ignore[no-untyped-def]
    return statistics.mean(len(ch) for g in server._requested.values() for u in g.uploads for ch in u.chunks)


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


def scaling(server, parameters, args, framing: float) -> None:  # type: ignore[no-untyped-def]
    """Per group: the whole-group decryptor's measured bytes against the formula; the formula at
    --to-dim, whole and split by chunk over m = min(S_g, C_g)."""
    b = _chunk_bytes(server)
    upload_chunks = {
        u.sender: sum(len(d.chunk_digests) for d in u.digests)
        for g in server._requested.values()
        for u in g.uploads
    }
    rows = []
    for name, group in sorted(server._requested.items()):
        data = sum(len(ch) for u in group.uploads for ch in u.chunks)
        digests = sum(32 * upload_chunks[u.sender] for u in group.uploads)
        rows.append((name, len(group.uploads), len(group.chunks), data, digests))
    print(f"\n#### What a group's decryption downloads, {args.clients} clients (d = {args.dim})\n")
    print(f"one ciphertext (N = {parameters.poly_modulus_degree}, {parameters.slots} slots): "
          f"b = {fmt_bytes(b)}\n")  # fmt: skip
    print("| group | survivors S_g | chunks C_g | ciphertext bytes | digest bytes |\n|---|---|---|---|---|")
    for name, survivors, c_g, data, digests in rows:
        print(f"| {name} | {survivors} | {c_g} | {fmt_bytes(data)} | {fmt_bytes(digests)} |")
    lengths = _group_lengths(args.to_dim, args.missing)
    slots = parameters.slots
    chunks = {g: sum(-(-n // slots) for n in t.values()) for g, t in lengths.items()}
    survivors_of = {name: len(group.uploads) for name, group in server._requested.items()}
    c_u = max(sum(chunks[g] for g in lengths if g in own) for own in _memberships(server))
    print(f"\n#### Extrapolated to d = {args.to_dim} (the formula; {args.clients} clients, missing "
          f"{args.missing}; C_u = {c_u} chunks in the largest upload, s = {framing:.0f} B)\n")  # fmt: skip
    # Each decryptor's whole R4 download at --to-dim, under the server's own plan (it may serve several
    # groups): every ciphertext still reaches some decryptor, so the mean is Σ_g S_g C_g b / decryptors.
    members = {name: [u.sender for u in group.uploads] for name, group in server._requested.items()}
    for label, cap in (("one decryptor per group (m = 1)", 1), ("split by chunk", None)):
        plan = plan_chunk_sets({g: (members[g], chunks[g]) for g in members}, cap, {})
        total: dict[str, float] = {}
        for group, decryptor, chunk_set in plan:
            total[decryptor] = total.get(decryptor, 0.0) + survivors_of[group] * (
                len(chunk_set) * b + 32 * c_u + framing
            )
        low, high, mean = min(total.values()), max(total.values()), statistics.mean(total.values())
        print(f"- {label}: {len(total)} decryptors; each downloads {fmt_bytes(low)} to "
              f"{fmt_bytes(high)} (mean {fmt_bytes(mean)}) in R4")  # fmt: skip
    print()
    print("| group | S_g | C_g | one decryptor (m = 1) | split by chunk over m = min(S_g, C_g) decryptors |")
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
