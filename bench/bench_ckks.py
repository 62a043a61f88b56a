"""Costs of CKKS encryption (TenSEAL) against pairwise masking, and CKKS precision.

Prints markdown tables for 8 clients with d = 1024 at missing 1 and missing 7: per client the
seconds to encrypt (masking: encode and mask), the server's seconds to aggregate, the seconds to
decrypt (masking: reveal shares and unmask), and the bytes each client sends and receives, for
masking and for CKKS at N = 8192 and N = 16384 (coefficient moduli [60, 40, 40, 60], scale 2^40);
then the error of the decrypted sums against float64 plaintext sums, and the one-view step's share of
the CKKS session (every survivor signs the view in R3, and each R4 request carries the
view and the signatures), measured in the same runs.

Synthetic federations as in ``bench_secure.py``: 5,889 rows of random non-negative features per
client, random labels (prevalence 0.1), its upload ``contributions(active, include_global_gram=True)``
(per labelled class a group ``class/<c>`` with ``gram`` and ``b/<c>``, plus the ``all`` group with
``gram``), labelled classes from ``assign_partial_labels(8, 8, m, seed=0)``.  Every client and the
server run in one process through :func:`secure_afl.aggregation.inprocess.run_in_process` with the
real wire encoding.  One repetition (CKKS at missing 1 encrypts 8 Grams per client).

Which protocol rounds make up each figure:

=============  ===============================  ======================================================
figure         masking                          CKKS
=============  ===============================  ======================================================
encrypt        client R2 (encode, mask)         client R2 (decrypt the key, encrypt every chunk, sign)
aggregate      server R2 (add masked words)     server R2 (verify, parse and add ciphertexts)
decrypt        client R4 + server R4 (reveal    client R4 (the decryptors: check the view's signatures,
               shares, rebuild and remove        parse, decrypt, round, sign; summed over decryptors) +
               masks)                           server R4 (verify)
view           (R3: the consistency check)      client R3 (check and sign the view) + server R3
                                                (verify the signatures), all parties
key setup      R0 + R1, all parties             R0 + R1, all parties (the key holder's context and
                                                its AEAD copies for the peers)
=============  ===============================  ======================================================

Run from the repository root: ``python bench/bench_ckks.py [--quick] [--degrees 8192,16384]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Mapping
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_secure import ROWS_PER_CLIENT, fmt_bytes, fmt_s, round1, table, timed_statistics

from secure_afl.aggregation.backend import CkksBackend, MaskingBackend
from secure_afl.aggregation.inprocess import InProcessRun, run_in_process
from secure_afl.analytic import sum_contributions
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.protocol.ckks import codec
from secure_afl.protocol.ckks.context import CkksParameters
from secure_afl.protocol.ckks.messages import CkksDecryptRequest, CkksViewSignature, UploadEntry

SYMMETRIC = ("gram",)


def run(backend: object, contributions: Mapping) -> tuple[InProcessRun, float]:
    start = time.perf_counter()
    result = run_in_process(backend, contributions, symmetric=SYMMETRIC)  # type: ignore[arg-type]
    return result, time.perf_counter() - start


def figures(result: InProcessRun, kind: str) -> dict[str, float]:
    costs = result.costs
    clients = sorted(costs.client_seconds)
    per = costs.client_seconds

    def median_client(rounds: tuple[str, ...]) -> float:
        return statistics.median(sum(per[c][r] for r in rounds) for c in clients)

    def total_clients(rounds: tuple[str, ...]) -> float:
        return sum(per[c][r] for c in clients for r in rounds)

    server = costs.server_seconds
    decrypt = total_clients(("R4",)) + server["R4"]
    everything = tuple(server)
    return {
        "view": total_clients(("R3",)) + server["R3"],
        "view_bytes": statistics.median(
            costs.bytes_sent[c]["R3"] + costs.bytes_received[c]["R3"] for c in clients
        ),
        "session": total_clients(everything) + sum(server.values()),
        "session_bytes": statistics.median(
            sum(costs.bytes_sent[c].values()) + sum(costs.bytes_received[c].values()) for c in clients
        ),
        "encrypt": median_client(("R2",)),
        "aggregate": server["R2"],
        "decrypt": decrypt,
        "setup": total_clients(("R0", "R1")) + server["R0"] + server["R1"],
        "sent": statistics.median(sum(costs.bytes_sent[c].values()) for c in clients),
        "received": statistics.median(sum(costs.bytes_received[c].values()) for c in clients),
        "received_max": max(sum(costs.bytes_received[c].values()) for c in clients),
    }


def view_in_request(clients: list[str]) -> int:
    """The bytes the view and every survivor's signature add to each R4 request (the codec's sizes)."""
    view = tuple(UploadEntry(c, bytes(32)) for c in sorted(clients))
    signatures = tuple(CkksViewSignature(bytes(32), c, bytes(64)) for c in sorted(clients))
    full = codec.encode(CkksDecryptRequest(bytes(32), view, signatures, ()), max_message_bytes=1 << 30)
    bare = codec.encode(CkksDecryptRequest(bytes(32), (), (), ()), max_message_bytes=1 << 30)
    return len(full) - len(bare)


def errors(result: InProcessRun, plain: Mapping) -> tuple[float, float, float]:
    """Max |error| over Gram entries, over the other tensors, and the largest |plain value|."""
    gram = other = largest = 0.0
    for group, tensors in plain.items():
        for name, value in tensors.items():
            error = float(np.max(np.abs(result.outcome.sums[group][name] - value)))
            largest = max(largest, float(np.max(np.abs(value))))
            if name == "gram":
                gram = max(gram, error)
            else:
                other = max(other, error)
    return gram, other, largest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="d = 128 and 500 rows (a smoke run)")
    parser.add_argument("--degrees", default="8192,16384", help="CKKS ring degrees to run (comma-separated)")
    parser.add_argument("--json", type=Path, default=None, help="also write the printed tables to this file")
    args = parser.parse_args()
    d, rows = (128, 500) if args.quick else (1024, ROWS_PER_CLIENT)
    print(f"Run on {date.today()} ({platform.python_version()}, {platform.machine()}); d = {d}, 8 clients\n")
    stats, _ = timed_statistics(8, d, rows, seed=0)
    backends = {
        "mask": MaskingBackend(threshold=5, client_policy=ClientPolicy.simulator()),
        **{
            f"CKKS N={n}": CkksBackend(CkksParameters(n), client_policy=ClientPolicy.simulator())
            for n in (int(text) for text in args.degrees.split(","))
        },
    }
    cost_rows, error_rows, view_rows = [], [], []
    for missing in (1, 7):
        contributions = round1(stats, missing)
        plain = sum_contributions(contributions.values())
        plain_bytes = statistics.median(
            sum(
                8 * (v.shape[0] * (v.shape[0] + 1) // 2 if n in SYMMETRIC else v.size)
                for t in c.values()
                for n, v in t.items()
            )
            for c in contributions.values()
        )
        cost_rows.append([f"{missing}", "plaintext", "", "", "", "", fmt_bytes(plain_bytes), "0", ""])
        for name, backend in backends.items():
            result, wall = run(backend, contributions)
            f = figures(result, "mask" if name == "mask" else "ckks")
            cost_rows.append(
                [
                    f"{missing}",
                    name,
                    fmt_s(f["encrypt"]),
                    fmt_s(f["aggregate"]),
                    fmt_s(f["decrypt"]),
                    fmt_s(f["setup"]),
                    fmt_bytes(f["sent"]),
                    f"{fmt_bytes(f['received'])} (max {fmt_bytes(f['received_max'])})",
                    fmt_s(wall),
                ]
            )
            if name != "mask":
                extra = view_in_request(sorted(contributions))
                view_rows.append(
                    [
                        f"{missing}",
                        name,
                        f"{fmt_s(f['view'])} of {fmt_s(f['session'])}",
                        f"{f['view'] / f['session']:.2g}",
                        fmt_bytes(f["view_bytes"]),
                        fmt_bytes(extra),
                        f"{fmt_bytes(f['session_bytes'])}",
                        f"{(f['view_bytes'] + extra) / f['session_bytes']:.2g}",
                    ]
                )
            gram, other, largest = errors(result, plain)
            error_rows.append([f"{missing}", name, f"{gram:.2e}", f"{other:.2e}", f"{largest:.3g}"])
            print(f"done: missing {missing}, {name} ({wall:.1f} s)", file=sys.stderr, flush=True)
    print("#### Costs per client (median client; decrypt and setup summed over all parties)\n")
    header = [
        "missing", "protection", "encrypt / client", "aggregate (server)", "decrypt", "key setup",
        "sent / client", "received / client", "wall, all parties",
    ]  # fmt: skip
    print(table(header, cost_rows))
    tables = {"costs": {"header": header, "rows": cost_rows}}
    print("\n#### Error of the decrypted sums against float64 plaintext sums\n")
    header = ["missing", "protection", "max abs error, Gram", "max abs error, other", "max abs sum"]
    print(table(header, error_rows))
    tables["errors"] = {"header": header, "rows": error_rows}
    print("\n#### The one-view step (R3) beside the whole CKKS session, in the same runs\n")
    header = [
        "missing", "protection", "R3 seconds of the session's, all parties", "ratio",
        "R3 bytes / client", "view + signatures in each R4 request", "session bytes / client",
        "(R3 + one R4's view) / session bytes",
    ]  # fmt: skip
    print(table(header, view_rows))
    tables["one_view"] = {"header": header, "rows": view_rows}
    if args.json is not None:
        report = {"date": date.today().isoformat(), "d": d, "rows_per_client": rows, "tables": tables}
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
