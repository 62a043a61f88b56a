"""FedAvg baseline (paper Table I): a linear head on the same frozen features, missing labels as negatives.

Head: ``Linear(d, C)`` with bias, trained with binary cross-entropy on logits.  Each of the
``rounds`` rounds, every client starts from the global head, runs ``local_epochs`` epochs of Adam
(learning rate 1e-3, betas (0.9, 0.999), fresh optimiser state each round, as FedAvg clients keep no
state between rounds) over shuffled mini-batches of 64, and the server averages the heads weighted
by the clients' sample counts.  Labels of classes a client does not annotate are 0, as FedAvg treats
them in the paper.

The K clients train as one batched computation (:mod:`secure_afl.sim.baselines.engine`): exactly K
independent local runs, only faster.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from secure_afl.analytic import active_class_indices
from secure_afl.sim.baselines.engine import (
    Adam,
    Epoch,
    LinearHead,
    bce_gradient,
    head_from_weights,
    initial_weights,
    logits_of,
    single_torch_thread,
    stack_clients,
    weight_gradient,
    weighted_average,
)

__all__ = ["FedAvgConfig", "LinearHead", "missing_as_negative", "train_fedavg"]

_Adam = Adam  # the name the tests know


@dataclass(frozen=True)
class FedAvgConfig:
    rounds: int = 50
    local_epochs: int = 1
    batch_size: int = 64
    lr: float = 1e-3
    seed: int = 0


def missing_as_negative(
    labels: np.ndarray, active: Sequence[int] | Sequence[bool] | np.ndarray
) -> np.ndarray:
    """The FedAvg view of a client's labels: unannotated classes become 0.

    ``active``: class indices or a boolean mask of length C.
    """
    labels = np.asarray(labels)
    columns = active_class_indices(active, labels.shape[1])
    out = np.zeros_like(labels, dtype=np.float32)
    out[:, columns] = labels[:, columns]
    return out


def train_fedavg(
    features: Sequence[np.ndarray],
    targets: Sequence[np.ndarray],
    config: FedAvgConfig = FedAvgConfig(),
    *,
    device: str = "cpu",
    progress: Callable[[int], None] | None = None,
) -> LinearHead:
    """Train the head; ``features[k]`` is client k's rows × d, ``targets[k]`` rows × C in {0, 1}."""
    if len(features) != len(targets) or not features:
        raise ValueError("features and targets must list the same, non-zero number of clients")
    sizes = {len(x) for x in features}
    if len(sizes) != 1:
        raise ValueError(f"FedAvg here expects clients of equal size, got sizes {sorted(sizes)}")
    with single_torch_thread():
        x = stack_clients(features).to(device)  # K × N × (d+1)
        y = torch.as_tensor(np.stack(targets), dtype=torch.float32, device=device)  # K × N × C
        n_clients, dim = x.shape[0], x.shape[2] - 1
        generator = torch.Generator().manual_seed(config.seed)
        global_w = initial_weights(dim, y.shape[2], generator).to(device)  # C × (d+1)
        share = torch.full((n_clients,), 1.0 / n_clients, device=device)  # sample-count weights, equal sizes
        for round_ in range(config.rounds):
            w = global_w.expand(n_clients, *global_w.shape).clone()
            adam = Adam(w, config.lr)
            for _ in range(config.local_epochs):
                for xb, rows in Epoch(x, config.batch_size, generator):
                    grad = bce_gradient(logits_of(w, xb), Epoch.take(y, rows))
                    adam.step(w, weight_gradient(grad, xb))
            global_w = weighted_average(w, share)
            if progress is not None:
                progress(round_ + 1)
        return head_from_weights(global_w)
