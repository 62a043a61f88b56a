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

Run from the repository root: ``python bench/bench_ckks_verify.py [--dim D] [--missing M]``.
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
    args = parser.parse_args()
    stats, _ = timed_statistics(8, args.dim, 2000, 0)
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
    print(f"#### CKKS R4 with verified sums: 8 clients, d = {args.dim}, missing {args.missing}, N = 8192")
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


if __name__ == "__main__":
    main()
