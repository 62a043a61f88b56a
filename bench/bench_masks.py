"""Adding pairwise masks: one fresh keystream per key (the code before 2026-12-02) against
:func:`secure_afl.protocol.prg.add_masks` (chunked through one reused buffer), side by side.

Both add the same words (asserted).  ``--words`` defaults to a d = 1024 Gram triangle, ``--keys``
to 8 (a client of a group of 8: its self mask and 7 pairwise masks).  CPU-seconds per call,
median of ``--repeats`` interleaved rounds of 10 calls each.

Run from the repository root: ``python bench/bench_masks.py [--words N] [--keys K]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from secure_afl.protocol import prg


def fresh_keystream_per_key(accumulator: np.ndarray, keys: list[tuple[bytes, int]]) -> None:
    """The code before: a new 8n-byte zero input and keystream output for every key."""
    for key, sign in keys:
        encryptor = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
        mask = np.frombuffer(encryptor.update(bytes(8 * accumulator.shape[0])), dtype="<u8")
        if sign > 0:
            np.add(accumulator, mask, out=accumulator)
        else:
            np.subtract(accumulator, mask, out=accumulator)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--words", type=int, default=1024 * 1025 // 2)
    parser.add_argument("--keys", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    args = parser.parse_args()
    keys = [(bytes([k + 1]) * 32, 1 if k % 2 == 0 else -1) for k in range(args.keys)]
    start = np.arange(args.words, dtype=np.uint64)
    before, after = start.copy(), start.copy()
    fresh_keystream_per_key(before, keys)
    prg.add_masks(after, keys)
    assert np.array_equal(before, after), "the two ways must add the same words"
    times: dict[str, list[float]] = {"fresh keystream per key": [], "add_masks": []}
    for _ in range(args.repeats):
        for name, run in (("fresh keystream per key", fresh_keystream_per_key), ("add_masks", prg.add_masks)):
            acc = start.copy()
            t = time.process_time()
            for _ in range(10):
                run(acc, keys)
            times[name].append((time.process_time() - t) / 10)
    old, new = (statistics.median(v) for v in times.values())
    print(
        f"{args.keys} masks over {args.words:,} words: fresh keystream per key {old * 1e3:.2f} ms, ", end=""
    )
    print(f"add_masks {new * 1e3:.2f} ms ({old / new:.1f}x); same words: yes")
    if args.json is not None:
        report = {
            "words": args.words,
            "keys": args.keys,
            "repeats": args.repeats,
            "cpu_seconds_per_call": times,
        }
        report["median_seconds"] = {name: statistics.median(v) for name, v in times.items()}
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
