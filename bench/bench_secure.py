"""Costs of secure aggregation by pairwise masking against plaintext sums.

Prints markdown tables:

1. per protocol round R0..R4, client and server seconds and bytes sent/received per client, masking
   against plaintext, for d=1024 and 8 clients at missing 1 and missing 7;
2. scaling with the number of clients (8, 16, 32, 64 at d=256, missing 1 and missing 7);
3. scaling with the dimension (256, 1024, 2048 at 8 clients, missing 7);
4. the end-to-end ratio: ``secure-afl sim --missing 1 --dropout 2 --dropout-stage R2``
   with ``--protection mask`` against ``--protection none``, (statistics + aggregation + solve) from
   ``run_experiment``'s phase timer, full embedded data, one FedAvg round (FedAvg is not in the ratio);
5. with ``--flower``: Flower's SecAgg+ utilities (quantisation, numpy Mersenne-Twister masks, Shamir
   shares, share encryption, unmasking) driven directly on the same vectors as ours, in another
   interpreter (``--flower-python``, default ../flwr-venv/bin/python): any Python that imports flwr
   1.42 and numpy, such as this project's own with the ``deploy`` extra installed.

Synthetic federations: every client holds ``--rows`` random non-negative features (exponential) and
random labels (prevalence 0.1); its statistics come from :func:`secure_afl.analytic.client_statistics`
and its upload from ``contributions(active, include_global_gram=True)``: per labelled class a group
``class/<c>`` with ``gram`` (d×d, symmetric, sent as its upper triangle) and ``b/<c>`` (d), and the
``all`` group with ``gram``; labelled classes from ``assign_partial_labels(n, 8, m, seed=0)``.

Plaintext cost = statistics + ``sum_contributions`` + solve.  Secure cost = statistics +
``secure_aggregate`` (every client and the server in one process, real wire encoding) + solve.
Client seconds are the median over clients, then over ``--repeats`` repetitions; server seconds the
median over repetitions.

Run from the repository root: ``python bench/bench_secure.py [--quick] [--flower]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from secure_afl.analytic import (
    AnalyticClassifier,
    ClientStatistics,
    Contributions,
    client_statistics,
    sum_contributions,
)
from secure_afl.core import encoding
from secure_afl.core.randomness import OsRandomSource
from secure_afl.protocol import crypto, prg, shamir
from secure_afl.sim.partial import assign_partial_labels
from secure_afl.sim.secure import ROUNDS, default_threshold, secure_aggregate

N_CLASSES = 8
ROWS_PER_CLIENT = 5889  # a ChestXray14 client of the paper's protocol (47,117 training rows / 8)
SYMMETRIC = ("gram",)
DEFAULT_FLOWER_PYTHON = "../flwr-venv/bin/python"


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def fmt_s(seconds: float) -> str:
    if seconds == 0:
        return "0"
    if seconds < 0.01:
        return f"{seconds * 1000:.2f} ms"
    return f"{seconds:.3f} s" if seconds < 10 else f"{seconds:.1f} s"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Synthetic federations
# ----------------------------------------------------------------------------------------------


def client_data(k: int, d: int, rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Client k's random non-negative features and multi-hot labels (regenerated, never stored)."""
    rng = np.random.default_rng([seed, k, d])
    return rng.exponential(size=(rows, d)), (rng.random((rows, N_CLASSES)) < 0.1).astype(np.int8)


def timed_statistics(
    n_clients: int, d: int, rows: int, seed: int
) -> tuple[list[ClientStatistics], list[float]]:
    stats, seconds = [], []
    for k in range(n_clients):
        features, labels = client_data(k, d, rows, seed)
        start = time.perf_counter()
        stats.append(client_statistics(features, labels, device="cpu"))
        seconds.append(time.perf_counter() - start)
    return stats, seconds


def round1(stats: Sequence[ClientStatistics], missing: int) -> dict[str, Contributions]:
    assignment = assign_partial_labels(len(stats), N_CLASSES, missing, seed=0)
    return {
        f"client-{k:02d}": s.contributions(assignment.active[k], include_global_gram=True)
        for k, s in enumerate(stats)
    }


def plaintext_bytes(contribution: Contributions) -> int:
    """What a client uploads in the clear: float64 values, the Gram as its upper triangle."""
    total = 0
    for tensors in contribution.values():
        for name, value in tensors.items():
            n = encoding.upper_triangle_length(value.shape[0]) if name in SYMMETRIC else value.size
            total += 8 * n
    return total


@dataclass
class Measurement:
    """One repetition of one configuration."""

    stats_s: list[float]  # per client
    plain_sum_s: float
    solve_s: float
    plain_bytes: list[int]  # per client
    secure_wall_s: float  # the whole secure_aggregate call (incl. packing, key generation, decoding, audit)
    secure_solve_s: float
    client_s: dict[str, list[float]]  # round -> per client
    server_s: dict[str, float]
    sent: dict[str, list[int]]  # round -> per client
    received: dict[str, list[int]]


def measure(n_clients: int, d: int, missing: int, rows: int, seed: int) -> Measurement:
    stats, stats_s = timed_statistics(n_clients, d, rows, seed)
    contributions = round1(stats, missing)

    start = time.perf_counter()
    plain = sum_contributions(contributions.values())
    plain_sum_s = time.perf_counter() - start
    start = time.perf_counter()
    AnalyticClassifier(N_CLASSES).fit(plain)
    solve_s = time.perf_counter() - start

    start = time.perf_counter()
    result = secure_aggregate(contributions, symmetric=SYMMETRIC)
    secure_wall_s = time.perf_counter() - start
    start = time.perf_counter()
    AnalyticClassifier(N_CLASSES).fit(result.sums)
    secure_solve_s = time.perf_counter() - start

    costs = result.costs
    clients = sorted(contributions)
    return Measurement(
        stats_s=stats_s,
        plain_sum_s=plain_sum_s,
        solve_s=solve_s,
        plain_bytes=[plaintext_bytes(contributions[c]) for c in clients],
        secure_wall_s=secure_wall_s,
        secure_solve_s=secure_solve_s,
        client_s={r: [costs.client_seconds[c][r] for c in clients] for r in ROUNDS},
        server_s=dict(costs.server_seconds),
        sent={r: [costs.bytes_sent[c][r] for c in clients] for r in ROUNDS},
        received={r: [costs.bytes_received[c][r] for c in clients] for r in ROUNDS},
    )


def repeat(times: int, run: Callable[[], Measurement]) -> list[Measurement]:
    return [run() for _ in range(times)]


def med_client(ms: list[Measurement], get: Callable[[Measurement], list[float]]) -> float:
    """Median over clients within a repetition, then median over repetitions."""
    return median([median(get(m)) for m in ms])


def med(ms: list[Measurement], get: Callable[[Measurement], float]) -> float:
    return median([get(m) for m in ms])


def per_round_table(ms: list[Measurement]) -> str:
    rows = [
        [
            "statistics",
            fmt_s(med_client(ms, lambda m: m.stats_s)),
            "",
            fmt_s(med_client(ms, lambda m: m.stats_s)),
            "",
            "",
            "",
            "",
        ]
    ]
    for r in ROUNDS:
        rows.append(
            [
                r,
                "",
                "",
                fmt_s(med_client(ms, lambda m, r=r: m.client_s[r])),
                fmt_s(med(ms, lambda m, r=r: m.server_s[r])),
                "",
                fmt_bytes(median(ms[0].sent[r])),
                fmt_bytes(median(ms[0].received[r])),
            ]
        )
    rows.append(["sum_contributions", "", fmt_s(med(ms, lambda m: m.plain_sum_s)), "", "", "", "", ""])
    rows.append(
        [
            "solve (Cholesky)",
            "",
            fmt_s(med(ms, lambda m: m.solve_s)),
            "",
            fmt_s(med(ms, lambda m: m.secure_solve_s)),
            "",
            "",
            "",
        ]
    )
    client_secure = med(ms, lambda m: median(m.stats_s) + sum(median(m.client_s[r]) for r in ROUNDS))
    server_secure = med(ms, lambda m: sum(m.server_s.values()) + m.secure_solve_s)
    rows.append(
        [
            "**total**",
            fmt_s(med_client(ms, lambda m: m.stats_s)),
            fmt_s(med(ms, lambda m: m.plain_sum_s + m.solve_s)),
            fmt_s(client_secure),
            fmt_s(server_secure),
            fmt_bytes(median(ms[0].plain_bytes)),
            fmt_bytes(sum(median(ms[0].sent[r]) for r in ROUNDS)),
            fmt_bytes(sum(median(ms[0].received[r]) for r in ROUNDS)),
        ]
    )
    header = [
        "step",
        "plain client",
        "plain server",
        "masked client",
        "masked server",
        "plain sent/client",
        "masked sent/client",
        "masked received/client",
    ]
    return table(header, rows)


def in_process_ratio(m: Measurement) -> float:
    """(all clients' statistics + secure_aggregate + solve) / (statistics + sum + solve), one process."""
    stats = sum(m.stats_s)
    return (stats + m.secure_wall_s + m.secure_solve_s) / (stats + m.plain_sum_s + m.solve_s)


def scaling_row(label: str, ms: list[Measurement]) -> list[str]:
    return [
        label,
        fmt_s(med_client(ms, lambda m: m.stats_s)),
        fmt_s(
            med(ms, lambda m: median([sum(m.client_s[r][i] for r in ROUNDS) for i in range(len(m.stats_s))]))
        ),
        fmt_s(med(ms, lambda m: sum(m.server_s.values()))),
        fmt_s(med(ms, lambda m: m.secure_wall_s)),
        fmt_s(med(ms, lambda m: m.plain_sum_s)),
        fmt_s(med(ms, lambda m: m.solve_s)),
        fmt_bytes(median(ms[0].plain_bytes)),
        fmt_bytes(median([sum(ms[0].sent[r][i] for r in ROUNDS) for i in range(len(ms[0].stats_s))])),
        f"{med(ms, in_process_ratio):.2f}",
    ]


SCALING_HEADER = [
    "",
    "statistics/client",
    "masked client R0–R4",
    "masked server R0–R4",
    "secure_aggregate wall (all parties)",
    "plain sum",
    "solve",
    "plain sent/client",
    "masked sent/client",
    "ratio",
]


# ----------------------------------------------------------------------------------------------
# End to end: secure-afl sim --missing 1 --dropout 2 --dropout-stage R2, mask against none
# ----------------------------------------------------------------------------------------------

E2E_PHASES = ("statistics", "aggregation", "solve")


def end_to_end(repeats: int, quick: bool) -> str:
    from secure_afl.sim.fedavg import FedAvgConfig
    from secure_afl.sim.runner import run_experiment
    from secure_afl.sim.setting import SimConfig

    options: dict[str, object] = {
        "missing": (1,),
        "dropout": 2,
        "dropout_stage": "R2",
        "fedavg": FedAvgConfig(rounds=1),
    }
    if quick:
        options.update(fraction=0.05, dim=64)
    seconds: dict[str, list[dict[str, float]]] = {"none": [], "mask": []}
    metrics: dict[str, object] = {}
    for i in range(repeats):
        for secure in ("none", "mask") if i % 2 == 0 else ("mask", "none"):
            result = run_experiment(SimConfig(secure=secure, **options))  # type: ignore[arg-type]
            seconds[secure].append(dict(result.seconds))
            metrics[secure] = {k: v.macro for k, v in result.settings[0].metrics.items()}
            dropped = result.settings[0].dropped
    ratios = [
        sum(m[p] for p in E2E_PHASES) / sum(n[p] for p in E2E_PHASES)
        for m, n in zip(seconds["mask"], seconds["none"], strict=True)
    ]
    rows = []
    for phase in (*E2E_PHASES, "data", "fedavg", "metrics"):
        rows.append(
            [
                phase + (" (in ratio)" if phase in E2E_PHASES else ""),
                fmt_s(median([s.get(phase, 0.0) for s in seconds["none"]])),
                fmt_s(median([s.get(phase, 0.0) for s in seconds["mask"]])),
            ]
        )
    total = {k: median([sum(s[p] for p in E2E_PHASES) for s in v]) for k, v in seconds.items()}
    rows.append(["**statistics + aggregation + solve**", fmt_s(total["none"]), fmt_s(total["mask"])])
    same = metrics["mask"] == metrics["none"]
    out = [
        table(["phase (median of runs)", "--protection none", "--protection mask"], rows),
        "",
        f"ratio (mask / none) of statistics + aggregation + solve, median of {repeats} paired runs: "
        f"**{median(ratios):.2f}** (runs: {', '.join(f'{r:.2f}' for r in ratios)}; "
        "goal ≤ 1.3)",
        f"dropped clients: {', '.join(dropped)}; macro metrics of every method identical between the two "
        f"paths: {'yes' if same else 'NO'}",
    ]
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# Flower SecAgg+ side by side
# ----------------------------------------------------------------------------------------------

# Runs under Flower's virtualenv: drives flwr's own SecAgg+ utilities, in the order its client mod
# (flwr/client/mod/secure_aggregation/secaggplus_mod.py) and server workflow
# (flwr/server/workflow/secure_aggregation/secaggplus_workflow.py) call them.
FLOWER_SCRIPT = r"""
import json, os, statistics, sys, time
import numpy as np
import flwr
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt, generate_shared_key
from flwr.common.secure_aggregation.ndarrays_arithmetic import (
    factor_combine, factor_extract, get_parameters_shape, parameters_addition, parameters_mod,
    parameters_multiply, parameters_subtraction,
)
from flwr.common.secure_aggregation.quantization import dequantize, quantize
from flwr.common.secure_aggregation.secaggplus_utils import (
    pseudo_rand_gen, share_keys_plaintext_concat, share_keys_plaintext_separate,
)
from flwr.supercore.primitives.asymmetric import (
    bytes_to_private_key, bytes_to_public_key, generate_key_pairs, private_key_to_bytes, public_key_to_bytes,
)

data = np.load(sys.argv[1])
cfg = json.loads(sys.argv[2])
vectors = [[data["gram"][k], data["b"][k]] for k in range(data["gram"].shape[0])]
n, t, dropped, repeats = len(vectors), cfg["threshold"], set(cfg["dropped"]), cfg["repeats"]
CLIP, TARGET, MOD, MAX_WEIGHT = 8.0, 2**22, 2**32, 1000.0  # SecAggPlusWorkflow defaults
nids = list(range(1, n + 1))
timings = {}

def ecdh(private_bytes, public_bytes):
    return generate_shared_key(bytes_to_private_key(private_bytes), bytes_to_public_key(public_bytes))

def add(name, seconds):
    timings.setdefault(name, []).append(seconds)

for _ in range(repeats):
    per = {}
    def clock(name, start):
        per.setdefault(name, []).append(time.perf_counter() - start)
    keys = {}
    for nid in nids:  # setup: two SECP384R1 key pairs per client
        start = time.perf_counter()
        sk1, pk1 = generate_key_pairs(); sk2, pk2 = generate_key_pairs()
        keys[nid] = (private_key_to_bytes(sk1), public_key_to_bytes(pk1))
        keys[nid] += (private_key_to_bytes(sk2), public_key_to_bytes(pk2))
        clock("key generation", start)
    seeds, shares_for = {}, {nid: {} for nid in nids}
    for nid in nids:  # share keys
        seeds[nid] = os.urandom(32)
        start = time.perf_counter()
        b_shares = create_shares(seeds[nid], t, n)
        sk1_shares = create_shares(keys[nid][0], t, n)
        clock("Shamir share creation", start)
        start = time.perf_counter()
        for idx, other in enumerate(nids):
            if other == nid:
                shares_for[nid][nid] = (b_shares[idx], sk1_shares[idx]); continue
            shared = ecdh(keys[nid][2], keys[other][3])
            ct = encrypt(shared, share_keys_plaintext_concat(nid, other, b_shares[idx], sk1_shares[idx]))
            shares_for[other][nid] = ct
        clock("share encryption", start)
    for nid in nids:  # decrypt received shares
        start = time.perf_counter()
        for src, ct in list(shares_for[nid].items()):
            if src == nid:
                continue
            shared = ecdh(keys[nid][2], keys[src][3])
            _, _, b_share, sk1_share = share_keys_plaintext_separate(decrypt(shared, ct))
            shares_for[nid][src] = (b_share, sk1_share)
        clock("share decryption", start)
    masked = {}
    clipped = 0
    for nid in nids:
        if nid in dropped:
            continue
        start = time.perf_counter()
        ratio = MAX_WEIGHT / MAX_WEIGHT  # weight 1: the server recovers the plain sum
        q_ratio = round(ratio * TARGET)
        params = parameters_multiply(vectors[nid - 1], q_ratio / TARGET)
        quantized = factor_combine(q_ratio, quantize(params, CLIP, TARGET))
        clock("quantisation", start)
        clipped += sum(int(np.count_nonzero(np.abs(p) > CLIP)) for p in params)
        start = time.perf_counter()
        dims = [a.shape for a in quantized]
        quantized = parameters_addition(quantized, pseudo_rand_gen(seeds[nid], MOD, dims))
        for other in nids:
            if other == nid:
                continue
            shared = ecdh(keys[nid][0], keys[other][1])
            mask = pseudo_rand_gen(shared, MOD, dims)
            quantized = (parameters_addition if nid > other else parameters_subtraction)(quantized, mask)
        masked[nid] = parameters_mod(quantized, MOD)
        clock("mask generation (self + pairwise)", start)
    # server: sum, reconstruct, unmask
    start = time.perf_counter()
    total = None
    for vec in masked.values():
        total = vec if total is None else parameters_addition(total, vec)
    total = parameters_mod(total, MOD)
    clock("server: sum masked vectors", start)
    recon_s = unmask_s = 0.0
    for nid in nids:
        which = 0 if nid not in dropped else 1  # b share of a survivor, sk1 share of a dropped client
        share_list = [shares_for[h][nid][which] for h in nids if h not in dropped][:t]
        start = time.perf_counter()
        secret = combine_shares(share_list)
        recon_s += time.perf_counter() - start
        start = time.perf_counter()
        if nid not in dropped:
            total = parameters_subtraction(total, pseudo_rand_gen(secret, MOD, get_parameters_shape(total)))
        else:
            for other in nids:
                if other == nid:
                    continue
                shared = ecdh(secret, keys[other][1])
                mask = pseudo_rand_gen(shared, MOD, get_parameters_shape(total))
                total = (parameters_addition if nid > other else parameters_subtraction)(total, mask)
        unmask_s += time.perf_counter() - start
    start = time.perf_counter()
    recon = parameters_mod(total, MOD)
    q_total, recon = factor_extract(recon)
    result = dequantize(recon, CLIP, TARGET)
    offset = -(len(masked) - 1) * CLIP
    for vec in result:
        vec += offset
    unmask_s += time.perf_counter() - start
    for name, values in per.items():
        add(name, statistics.median(values))
    add("server: Shamir reconstruction (all clients)", recon_s)
    add("server: unmasking (self masks, dropped clients' pairwise masks, dequantise)", unmask_s)

alive = [nid for nid in nids if nid not in dropped]
truth = [sum(vectors[nid - 1][i] for nid in alive) for i in range(2)]
errors = [float(np.max(np.abs(result[i] - truth[i]))) for i in range(2)]
total_entries = sum(a.size for a in vectors[0]) * len(alive)
print(json.dumps({
    "version": flwr.__version__,
    "timings": {k: statistics.median(v) for k, v in timings.items()},
    "max_abs_error": errors,
    "max_abs_value": [float(max(np.max(np.abs(vectors[nid - 1][i])) for nid in alive)) for i in range(2)],
    "clipped_fraction": clipped / total_entries,
}))
"""


def ours_side_by_side(
    gram: np.ndarray, b: np.ndarray, threshold: int, dropped: set[int], repeats: int
) -> tuple[dict[str, float], list[float]]:
    """The same steps with our primitives, on the same vectors (what ClientSession/ServerSession call)."""
    random = OsRandomSource()
    n = gram.shape[0]
    ids = [f"client-{k}" for k in range(n)]
    session = random.token_bytes(32)
    tensors = {"gram": gram, "b": b}
    timings: dict[str, list[float]] = {}
    for _ in range(repeats):
        per: dict[str, list[float]] = {}

        def clock(name: str, start: float, per: dict[str, list[float]] = per) -> None:
            per.setdefault(name, []).append(time.perf_counter() - start)

        share_keys, mask_keys, seeds = {}, {}, {}
        for cid in ids:
            start = time.perf_counter()
            share_keys[cid] = crypto.new_x25519_key(random)
            mask_keys[cid] = crypto.new_x25519_key(random)
            clock("key generation", start)
            seeds[cid] = random.token_bytes(32)
        public = {cid: crypto.x25519_public_bytes(mask_keys[cid]) for cid in ids}
        share_public = {cid: crypto.x25519_public_bytes(share_keys[cid]) for cid in ids}
        points = list(range(1, n + 1))
        held: dict[str, dict[str, tuple[int, int]]] = {cid: {} for cid in ids}
        inbox: dict[str, dict[str, tuple[bytes, bytes]]] = {cid: {} for cid in ids}
        for cid in ids:
            start = time.perf_counter()
            seed_shares = shamir.split(int.from_bytes(seeds[cid], "big"), threshold, points, random)
            key_int = int.from_bytes(crypto.x25519_private_bytes(mask_keys[cid]), "big")
            key_shares = shamir.split(key_int, threshold, points, random)
            clock("Shamir share creation", start)
            j = ids.index(cid)
            held[cid][cid] = (seed_shares[j].y, key_shares[j].y)
            start = time.perf_counter()
            for j, other in enumerate(ids):
                if other == cid:
                    continue
                secret = crypto.x25519_shared_secret(share_keys[cid], share_public[other])
                key = crypto.share_encryption_key(secret, session, cid, other)
                nonce = random.token_bytes(12)
                plaintext = shamir.value_to_bytes(seed_shares[j].y) + shamir.value_to_bytes(key_shares[j].y)
                ad = crypto.share_associated_data(session, cid, other)
                inbox[other][cid] = (nonce, crypto.encrypt_share(key, nonce, plaintext, ad))
            clock("share encryption", start)
        for cid in ids:
            start = time.perf_counter()
            for sender, (nonce, ct) in inbox[cid].items():
                secret = crypto.x25519_shared_secret(share_keys[cid], share_public[sender])
                key = crypto.share_encryption_key(secret, session, sender, cid)
                ad = crypto.share_associated_data(session, sender, cid)
                plaintext = crypto.decrypt_share(key, nonce, ct, ad, sender)
                held[cid][sender] = (
                    shamir.value_from_bytes(plaintext[: shamir.VALUE_BYTES]),
                    shamir.value_from_bytes(plaintext[shamir.VALUE_BYTES :]),
                )
            clock("share decryption", start)
        masked: dict[str, dict[str, np.ndarray]] = {}
        for k, cid in enumerate(ids):
            if k in dropped:
                continue
            start = time.perf_counter()
            words = {
                name: encoding.encode(values[k], tensor=name, group_size=n)
                for name, values in tensors.items()
            }
            clock("quantisation", start)
            start = time.perf_counter()
            for name, w in words.items():
                prg.add_mask(w, prg.self_mask_key(seeds[cid], session, "all", name, cid), 1)
                for other in ids:
                    if other == cid:
                        continue
                    secret = crypto.x25519_shared_secret(mask_keys[cid], public[other])
                    key = prg.pair_mask_key(secret, session, "all", name, cid, other)
                    prg.add_mask(w, key, prg.pair_sign(cid, other))
            masked[cid] = words
            clock("mask generation (self + pairwise)", start)
        start = time.perf_counter()
        total = {name: np.zeros(values.shape[1], dtype=np.uint64) for name, values in tensors.items()}
        for words in masked.values():
            for name, w in words.items():
                np.add(total[name], w, out=total[name])
        clock("server: sum masked vectors", start)
        live = [cid for k, cid in enumerate(ids) if k not in dropped]
        recon_s = unmask_s = 0.0
        for k, cid in enumerate(ids):
            start = time.perf_counter()
            which = 0 if k not in dropped else 1
            shares = [shamir.Share(1 + ids.index(h), held[h][cid][which]) for h in live][:threshold]
            value = shamir.reconstruct(shares)
            recon_s += time.perf_counter() - start
            start = time.perf_counter()
            for name, acc in total.items():
                if k not in dropped:
                    prg.add_mask(
                        acc, prg.self_mask_key(value.to_bytes(32, "big"), session, "all", name, cid), -1
                    )
                else:
                    private = X25519PrivateKey.from_private_bytes(value.to_bytes(32, "big"))
                    for v in live:
                        secret = crypto.x25519_shared_secret(private, public[v])
                        key = prg.pair_mask_key(secret, session, "all", name, v, cid)
                        prg.add_mask(acc, key, -prg.pair_sign(v, cid))
            unmask_s += time.perf_counter() - start
        start = time.perf_counter()
        result = {name: encoding.decode(acc) for name, acc in total.items()}
        unmask_s += time.perf_counter() - start
        for name, values in per.items():
            timings.setdefault(name, []).append(median(values))
        timings.setdefault("server: Shamir reconstruction (all clients)", []).append(recon_s)
        timings.setdefault(
            "server: unmasking (self masks, dropped clients' pairwise masks, dequantise)", []
        ).append(unmask_s)
    live_idx = [k for k in range(n) if k not in dropped]
    errors = [
        float(np.max(np.abs(result[name] - tensors[name][live_idx].sum(axis=0)))) for name in ("gram", "b")
    ]
    return {k: median(v) for k, v in timings.items()}, errors


def flower_comparison(args: argparse.Namespace) -> str:
    python = Path(args.flower_python)
    if not python.exists():
        return (
            f"Flower comparison skipped: no Python at {python}. Create it with\n"
            "`python3 -m venv ../flwr-venv && ../flwr-venv/bin/pip install 'flwr>=1.42,<1.43' numpy "
            "cryptography`,\n"
            "or pass `--flower-python` a Python that has this project's `deploy` extra installed."
        )
    probe = subprocess.run([str(python), "-c", "import flwr"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"Flower comparison skipped: `import flwr` fails under {python}: {probe.stderr.strip()[-300:]}"
    n, d = 8, args.flower_dim
    stats, _ = timed_statistics(n, d, args.rows, seed=1)
    gram = np.stack([encoding.pack_symmetric(s.gram) for s in stats])
    b = np.stack([s.balanced_projection(0) for s in stats])
    threshold = default_threshold(n)
    dropped = {1, 5}  # two clients drop after sharing keys (R2), as in the end-to-end run
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "vectors.npz"
        np.savez(path, gram=gram, b=b)
        config = {
            "threshold": threshold,
            "dropped": sorted(k + 1 for k in dropped),  # Flower node ids are 1-based
            "repeats": args.repeats,
        }
        run = subprocess.run(
            [str(python), "-c", FLOWER_SCRIPT, str(path), json.dumps(config)],
            capture_output=True,
            text=True,
        )
    if run.returncode != 0:
        return f"Flower comparison failed:\n```\n{run.stderr.strip()[-2000:]}\n```"
    flower = json.loads(run.stdout.strip().splitlines()[-1])
    ours, our_errors = ours_side_by_side(gram, b, threshold, dropped, args.repeats)
    rows = []
    for step in ours:
        f, o = flower["timings"].get(step), ours[step]
        rows.append([step, fmt_s(f) if f is not None else "–", fmt_s(o), f"{f / o:.1f}×" if f else "–"])
    per_client = [s for s in ours if not s.startswith("server")]
    f_client = sum(flower["timings"][s] for s in per_client)
    o_client = sum(ours[s] for s in per_client)
    f_server = sum(v for s, v in flower["timings"].items() if s.startswith("server"))
    o_server = sum(v for s, v in ours.items() if s.startswith("server"))
    rows.append(["**client total**", fmt_s(f_client), fmt_s(o_client), f"{f_client / o_client:.1f}×"])
    rows.append(["**server total**", fmt_s(f_server), fmt_s(o_server), f"{f_server / o_server:.1f}×"])
    entries = gram.shape[1] + b.shape[1]
    lines = [
        f"flwr {flower['version']}; {n} clients, one group, vectors = upper-triangle Gram "
        f"(d={d}, {gram.shape[1]:,} entries) + b (d), {entries:,} entries per client; t = {threshold}; "
        f"clients {sorted(dropped)} drop after sharing keys; per-client steps are the median client; "
        f"median of {args.repeats} repetition(s).",
        "",
        table(["step", "Flower SecAgg+", "secure-afl masking", "Flower / ours"], rows),
        "",
        "Accuracy of the recovered sum over the 6 survivors (max absolute error; largest |entry| of one "
        f"client: Gram {flower['max_abs_value'][0]:.4g}, b {flower['max_abs_value'][1]:.3g}):",
        "",
        table(
            ["", "Gram", "b"],
            [
                [
                    "Flower (clip ±8, 2^22 levels)",
                    f"{flower['max_abs_error'][0]:.4g}",
                    f"{flower['max_abs_error'][1]:.3g}",
                ],
                [
                    "secure-afl (2^32 fixed point)",
                    f"{our_errors[0]:.3g}",
                    f"{our_errors[1]:.3g}",
                ],
            ],
        ),
        "",
        f"Flower silently clipped {100 * flower['clipped_fraction']:.1f} % of the entries to ±8 "
        "(SPEC §8: no error, no warning); every Gram entry of these non-negative features lies far "
        "above 8, so its recovered Gram sum is meaningless without rescaling each vector into ±8 "
        "first, which costs precision: 16/2^22 ≈ 3.8e-6 per entry and client, against our 2^-33.",
        "Flower's masks come from numpy's Mersenne Twister seeded with 32 bits (the 32-byte seed or "
        "ECDH key XOR-folded to one 32-bit word), so a mask can be found by trying 2^32 seeds; its "
        "`randint(0, 2^32 - 1)` never draws 2^32 - 1 (high bound exclusive): the masks are not "
        "uniform. Its advertised keys carry no signatures, and nothing stops a server from asking "
        "for both shares of one client (SPEC §8). Ours: AES-256-CTR keystreams under HKDF-SHA256 "
        "keys bound to session, group, tensor and pair; Ed25519-signed keys; clients refuse to "
        "reveal both shares.",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one repetition (a smoke run)")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions (default 3, 1 with --quick)")
    parser.add_argument("--rows", type=int, default=None, help=f"rows per client (default {ROWS_PER_CLIENT})")
    parser.add_argument("--flower", action="store_true", help="add Flower SecAgg+ side by side")
    parser.add_argument("--flower-python", default=DEFAULT_FLOWER_PYTHON)
    parser.add_argument(
        "--only",
        default="rounds,clients,dim,e2e",
        help="comma list of sections: rounds, clients, dim, e2e (flower comes with --flower)",
    )
    args = parser.parse_args()
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.rows = args.rows or (1000 if args.quick else ROWS_PER_CLIENT)
    args.flower_dim = 128 if args.quick else 1024
    sections = set(args.only.split(","))
    main_d = 128 if args.quick else 1024
    client_counts, client_d = ((8, 16), 64) if args.quick else ((8, 16, 32, 64), 256)
    dims = (64, 128) if args.quick else (256, 1024, 2048)

    print(f"# secure-afl masking against plaintext ({date.today().isoformat()})\n")
    print(
        f"`python bench/bench_secure.py {' '.join(sys.argv[1:])}`; {platform.python_version()}, "
        f"numpy {np.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"{args.rows} rows per client, medians of {args.repeats} repetition(s).\n"
    )
    if "rounds" in sections:
        for missing in (1, 7):
            ms = repeat(args.repeats, lambda m=missing: measure(8, main_d, m, args.rows, seed=0))
            print(f"## Per round: d={main_d}, 8 clients, missing {missing}\n")
            print(per_round_table(ms))
            print(
                f"\nsecure_aggregate wall time, all parties in one process (incl. key generation, packing, "
                f"decoding and the audit): {fmt_s(med(ms, lambda m: m.secure_wall_s))}; "
                f"in-process ratio (statistics + aggregation + solve): {med(ms, in_process_ratio):.2f}\n",
                flush=True,
            )
    if "clients" in sections:
        for missing in (1, 7):
            rows = []
            for n in client_counts:
                ms = repeat(args.repeats, lambda n=n, m=missing: measure(n, client_d, m, args.rows, seed=0))
                rows.append(scaling_row(f"{n} clients", ms))
            print(f"## Scaling with clients: d={client_d}, missing {missing}\n")
            print(table(SCALING_HEADER, rows) + "\n", flush=True)
    if "dim" in sections:
        rows = []
        for d in dims:
            ms = repeat(args.repeats, lambda d=d: measure(8, d, 7, args.rows, seed=0))
            rows.append(scaling_row(f"d={d}", ms))
        print("## Scaling with d: 8 clients, missing 7\n")
        print(table(SCALING_HEADER, rows) + "\n", flush=True)
    print(
        "ratio = (all clients' statistics + secure_aggregate + solve) / (statistics + sum_contributions "
        "+ solve), one process.\n"
    )
    if "e2e" in sections:
        print(
            "## End to end: `secure-afl sim --missing 1 --dropout 2 --dropout-stage R2`, mask vs none "
            f"({'fraction 0.05, d=64' if args.quick else 'full embedded data, d=1024'}, 1 FedAvg round)\n"
        )
        print(end_to_end(args.repeats, args.quick) + "\n", flush=True)
    if args.flower:
        print("## Flower SecAgg+ side by side\n")
        print(flower_comparison(args), flush=True)


if __name__ == "__main__":
    main()
