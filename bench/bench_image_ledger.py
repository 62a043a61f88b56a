"""The ledger's image set at 100,000 images: file size, load + signature check, and the R0 check.

Run by hand: ``PYTHONPATH=. python bench/bench_image_ledger.py [--images 100000]``.  Prints the
file size, then seconds per load (JSON parse, Ed25519 verify, base64) and per check of a release
of 1,000 new images against it (the set built from the packed digests), and the same two steps of
an empty ledger in the same run for the ratio.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from secure_afl.keys.identity import IdentityKey
from secure_afl.privacy.ledger import FileLedger, LedgerOwner
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.privacy.release import Release
from secure_afl.protocol.exposure_gate import ExposureGate


def _digests(tag: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


def _gate(ledger: FileLedger, owner: LedgerOwner, images: list[str], scope: str) -> ExposureGate:
    inputs = {"g": {"x": np.random.default_rng(len(images)).normal(size=8)}}
    release = Release.of(inputs, images=images, scope=scope)
    return ExposureGate(owner.client_id, owner.identity, inputs, ClientPolicy.deployment(), ledger, release)


def _time(step, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - started)
    return best


def _measure(count: int, new: list[str]) -> tuple[int, float, float]:
    with tempfile.TemporaryDirectory() as directory:
        owner = LedgerOwner("a", IdentityKey.generate())
        ledger = FileLedger(directory)
        if count:
            gate = _gate(ledger, owner, _digests("old", count), "study:s/round:1")
            gate.start(b"\x01" * 32)
            gate.check("R3", "sign", {"g": (("a", "b", "c"), ("x",))}, session_id=b"\x01" * 32,
                       colluders=0, release_survivors=("a", "b", "c"))  # fmt: skip
        size = ledger.path("a").stat().st_size if count else 0
        load = _time(lambda: ledger.load(owner))
        check = _gate(ledger, owner, new, "study:t/round:1")
        return size, load, _time(lambda: check.start(b"\x02" * 32))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=100_000)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    args = parser.parse_args()
    n = args.images
    rows = []
    new = _digests("new", 1_000)
    for label, count in (("empty", 0), (f"{n} images", n)):
        size, load, start = _measure(count, new)
        print(f"{label}: file {size / 1e6:.2f} MB, load {load * 1e3:.1f} ms, R0 check {start * 1e3:.1f} ms")
        rows.append({"images": count, "file_bytes": size, "load_seconds": load, "r0_check_seconds": start})
    if args.json is not None:
        args.json.write_text(json.dumps({"new_images": len(new), "ledgers": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
