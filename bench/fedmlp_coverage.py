"""How much of FedMLP's stage 2 gets pseudo-labelled under each schedule (run by hand).

FedMLP's stage 2 pseudo-labels, every round, the top 0.5 % / bottom 1 % of each client's not yet
selected rows per missing class.  On frozen features the scores and prototypes do not change
between rounds, and the selection reads nothing but them, so the coverage at the end of training
follows from the selection alone, without training any head: this runs ``FedMLP._prototypes`` and
``FedMLP._select`` on the embedded data (the simulator's split and partial labels) for every
stage-2 round of the schedule and prints the share of (row, missing class) pairs selected.

    python bench/fedmlp_coverage.py [--missing 1,7] [--rounds 50,500]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from secure_afl.sim.baselines.common import BaselineConfig, Federation
from secure_afl.sim.baselines.engine import stack_clients
from secure_afl.sim.baselines.fmll import FedMLP
from secure_afl.sim.datasets import prepare
from secure_afl.sim.partial import assign_partial_labels


def coverage(fed: Federation, rounds: int) -> tuple[int, float]:
    """Stage-2 rounds and the share of (row, missing class) pairs pseudo-labelled by the end."""
    method = FedMLP()
    method.stage_scale = BaselineConfig(rounds=rounds).stage_scale
    method.start(fed, torch.zeros(()), torch.Generator())
    method._prototypes()
    stage2 = range(method.stage1, rounds)
    for _ in stage2:
        method._select()
    missing = ~fed.active  # K × C
    pairs = int(missing.sum()) * fed.x.shape[1]
    return len(stage2), float(method.selected.sum()) / pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--missing", default="1,7")
    parser.add_argument("--rounds", default="50,500")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    args = parser.parse_args()
    data = prepare(None)
    x = stack_clients(data.features, data.split.clients)
    labels = [data.cohort.labels[rows] for rows in data.split.clients]
    report = []
    for missing in (int(m) for m in args.missing.split(",")):
        assignment = assign_partial_labels(len(labels), labels[0].shape[1], missing, seed=0)
        fed = Federation.from_stacked(x, labels, assignment.active)
        for rounds in (int(r) for r in args.rounds.split(",")):
            stage2, share = coverage(fed, rounds)
            print(
                f"missing {missing}, R = {rounds} ({stage2} stage-2 rounds): "
                f"{100 * share:.1f} % of (row, missing class) pairs pseudo-labelled"
            )
            report.append({"missing": missing, "rounds": rounds, "stage2_rounds": stage2, "share": share})
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
