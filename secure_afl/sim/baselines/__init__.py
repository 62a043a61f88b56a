"""The gradient baselines of paper Table II, as heads on the same cached features as AFL.

FedAvg lives in :mod:`secure_afl.sim.fedavg` and always runs; ``--baselines`` adds the seven below
(each trained for the same 50 rounds of one local epoch, on the same split and label assignment).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from secure_afl.sim.baselines.common import BaselineConfig, Federation, Method, train
from secure_afl.sim.baselines.engine import LinearHead
from secure_afl.sim.baselines.fmll import FedMLP
from secure_afl.sim.baselines.fnll import FedLSR, FedNoRo
from secure_afl.sim.baselines.fssl import CBAFed, FedFixMatch, FedIRM, RSCFed
from secure_afl.sim.methods import TABLE2_BASELINES, BaselineError, parse_baselines

# Table II's order
BASELINES: dict[str, Callable[[], Method]] = {
    "RSCFed": RSCFed,
    "FedFixMatch": FedFixMatch,
    "FedIRM": FedIRM,
    "CBAFed": CBAFed,
    "FedLSR": FedLSR,
    "FedNoRo": FedNoRo,
    "FedMLP": FedMLP,
}
assert tuple(BASELINES) == TABLE2_BASELINES  # the names the command line parses without torch
FAMILY = {name: factory().family for name, factory in BASELINES.items()}

__all__ = [
    "BASELINES",
    "FAMILY",
    "BaselineConfig",
    "BaselineError",
    "parse_baselines",
    "train_baseline",
]


def train_baseline(
    name: str,
    features: Sequence[np.ndarray],
    labels: Sequence[np.ndarray],
    active: Sequence[Sequence[int] | Sequence[bool] | np.ndarray],
    config: BaselineConfig | None = None,
    *,
    progress: Callable[[int], None] | None = None,
) -> LinearHead:
    """Train baseline ``name``: ``features[k]``/``labels[k]`` client k's rows (true 0/1 labels;
    only the entries of ``active[k]`` are shown to the method), returns the global head."""
    if name not in BASELINES:
        raise BaselineError(f"unknown baseline {name!r}: choose from {', '.join(BASELINES)}")
    federation = Federation.build(features, labels, active)
    return train(BASELINES[name](), federation, config or BaselineConfig(), progress=progress)
