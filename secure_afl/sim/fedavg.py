"""FedAvg baseline (paper Table I): a linear head on the same frozen features, missing labels as negatives.

Head: ``Linear(d, C)`` with bias, trained as FedMLP's released code trains FedAvg (``train()`` of
``utils/local_training.py``): binary cross-entropy on logits with ``pos_weight`` N/N_c (the client's
rows over its true positives of class c, mean over the batch's B·C entries), Adam with weight decay
5e-4.  Each of the ``rounds`` rounds, every client starts from the global head, runs
``local_epochs`` epochs of Adam (learning rate 1e-3, betas (0.9, 0.999), fresh optimiser state each
round, as FedAvg clients keep no state between rounds) over shuffled mini-batches of 64, and the
server averages the heads weighted by the clients' sample counts.  Labels of classes a client does
not annotate are 0, as FedAvg treats them in the paper (their pos_weight then weighs nothing).

The K clients train as one batched computation (:mod:`secure_afl.sim.baselines.engine`): exactly K
independent local runs, only faster.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from secure_afl.analytic import active_class_indices
from secure_afl.sim.baselines.common import FeatureAugmenter
from secure_afl.sim.baselines.engine import (
    Adam,
    Epoch,
    LinearHead,
    bce_gradient,
    epoch_order,
    head_from_weights,
    initial_weights,
    logits_of,
    stack_clients,
    weight_gradient,
    weighted_average,
)
from secure_afl.torch_threads import one_torch_thread

__all__ = [
    "FedAvgConfig",
    "LinearHead",
    "missing_as_negative",
    "train_fedavg",
    "train_fedavg_stacked",
    "true_count_pos_weight",
]

_Adam = Adam  # the name the tests know


@dataclass(frozen=True)
class FedAvgConfig:
    rounds: int = 50
    local_epochs: int = 1
    batch_size: int = 64
    lr: float = 1e-3
    seed: int = 0
    weight_decay: float = 5e-4  # FedMLP's Adam for every method
    # FedMLP trains FedAvg on RandomAffine + flip images; on frozen features, the weak feature
    # jitter of the baselines (common.FeatureAugmenter: each feature times 1 + 0.1·N(0, 1))
    augment: bool = True


def true_count_pos_weight(labels: np.ndarray | Sequence[np.ndarray]) -> np.ndarray:
    """FedMLP's ``pos_weight`` N/N_c per client and class from the clients' *true* labels
    (``K × N × C`` → ``K × C``); 1 for a class without positives (the reference would divide by 0)."""
    stacked = np.stack([np.asarray(y, dtype=np.float64) for y in labels])
    if stacked.ndim != 3:
        raise ValueError(f"labels must be clients × rows × classes, got shape {stacked.shape}")
    positives = stacked.sum(axis=1)
    return np.where(positives > 0, stacked.shape[1] / np.maximum(positives, 1.0), 1.0)


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
    threads: int | Callable[[], int] = 1,
    pos_weight: np.ndarray | None = None,
) -> LinearHead:
    """Train the head; ``features[k]`` is client k's rows × d, ``targets[k]`` rows × C in {0, 1}.

    ``threads`` > 1 trains slices of the clients on that many threads each round (see
    :func:`train_fedavg_stacked`); the head is the same.  ``pos_weight``: ``K × C`` (FedMLP's
    N/N_c from the true labels: :func:`true_count_pos_weight`); None weighs positives 1.
    """
    if len(features) != len(targets) or not features:
        raise ValueError("features and targets must list the same, non-zero number of clients")
    sizes = {len(x) for x in features}
    if len(sizes) != 1:
        raise ValueError(f"FedAvg here expects clients of equal size, got sizes {sorted(sizes)}")
    x = stack_clients(features).to(device)  # K × N × (d+1)
    y = torch.as_tensor(np.stack(targets), dtype=torch.float32, device=device)  # K × N × C
    weights = None if pos_weight is None else torch.as_tensor(pos_weight, dtype=torch.float32, device=device)
    return train_fedavg_stacked(x, y, config, progress=progress, threads=threads, pos_weight=weights)


def train_fedavg_stacked(
    x: torch.Tensor,
    y: torch.Tensor,
    config: FedAvgConfig = FedAvgConfig(),
    *,
    progress: Callable[[int], None] | None = None,
    threads: int | Callable[[], int] = 1,
    pos_weight: torch.Tensor | None = None,
) -> LinearHead:
    """FedAvg on stacked clients: ``x`` is ``K × N × (d+1)`` (ones column last), ``y`` ``K × N × C``,
    ``pos_weight`` ``K × C`` or None (1).

    A round's K local runs are independent until the server averages them, so with ``threads`` > 1
    each thread trains a contiguous slice of the clients (its own Adam state, the shuffles drawn
    for the whole federation first, in the generator's order): every client's product and update is
    the same computation on the same numbers, so the head is identical to one thread's (tested).
    torch releases the GIL inside its kernels, which is where a step spends its time.

    ``threads`` may be a function, asked at the start of every round: the simulator gives FedAvg
    one core while the AFL pipeline runs on the other, and every core once it waits.
    """
    n_clients, dim = x.shape[0], x.shape[2] - 1
    if pos_weight is not None:
        if tuple(pos_weight.shape) != (n_clients, y.shape[2]):
            raise ValueError(
                f"pos_weight must be clients × classes = {n_clients} × {y.shape[2]}, got shape "
                f"{tuple(pos_weight.shape)}"
            )
        # the weighted BCE's gradient σ(z)·(1 + (w − 1)·y) − w·y, its two factors side by side so
        # that one gather per epoch takes both
        weighted = pos_weight[:, None, :].to(y.dtype) * y
        y = torch.cat([1 + weighted - y, weighted], dim=2)
    generator = torch.Generator().manual_seed(config.seed)
    n_classes = y.shape[2] // 2 if pos_weight is not None else y.shape[2]
    global_w = initial_weights(dim, n_classes, generator).to(x.device)  # C × (d+1)
    augment = FeatureAugmenter(dim, generator) if config.augment else None
    share = torch.full((n_clients,), 1.0 / n_clients, device=x.device)  # sample-count weights, equal sizes
    threads_now = threads if callable(threads) else (lambda: threads)
    _client_slices(n_clients, threads_now())  # a bad count fails before any training
    with one_torch_thread(), ThreadPoolExecutor(max(n_clients - 1, 1)) as pool:
        for round_ in range(config.rounds):
            slices = _client_slices(n_clients, threads_now())
            w = global_w.expand(n_clients, *global_w.shape).clone()
            orders = [epoch_order(n_clients, x.shape[1], generator) for _ in range(config.local_epochs)]
            # the augmentation's offsets for every step, drawn here in one order whatever the slices
            starts = (
                None
                if augment is None
                else [augment.epoch_starts(n_clients, x.shape[1], config.batch_size) for _ in orders]
            )
            jobs = [
                pool.submit(
                    _local_training,
                    x[part],
                    y[part],
                    w[part],
                    [o[part] for o in orders],
                    config,
                    _slice_noise(augment, starts, part),
                )
                for part in slices[1:]
            ]
            part = slices[0]  # the calling thread trains the first slice itself
            _local_training(
                x[part],
                y[part],
                w[part],
                [o[part] for o in orders],
                config,
                _slice_noise(augment, starts, part),
            )
            for job in jobs:
                job.result()
            global_w = weighted_average(w, share)
            if progress is not None:
                progress(round_ + 1)
    return head_from_weights(global_w)


def _slice_noise(
    augment: FeatureAugmenter | None, starts: Sequence[Sequence[tuple[int, int]]] | None, part: slice
) -> list[list[torch.Tensor]] | None:
    """The weak view's multipliers of the clients ``part`` at every step of the round's epochs."""
    if augment is None or starts is None:
        return None
    return [[augment.noise("weak", start, size, part) for start, size in epoch] for epoch in starts]


def _client_slices(n_clients: int, threads: int) -> list[slice]:
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    bounds = np.linspace(0, n_clients, min(threads, n_clients) + 1).round().astype(int)
    return [slice(int(lo), int(hi)) for lo, hi in itertools.pairwise(bounds)]


def _local_training(
    x: torch.Tensor,
    y: torch.Tensor,
    w: torch.Tensor,
    orders: Sequence[torch.Tensor],
    config: FedAvgConfig,
    noise: Sequence[Sequence[torch.Tensor]] | None = None,
) -> None:
    """One round's local epochs of a slice of the clients; updates ``w`` (a view of the round's heads)
    in place.  ``noise[e][s]``: the feature multipliers of epoch e's step s (augmentation), or None."""
    # Inference mode: the gradient is written out, so autograd's bookkeeping (dispatch, version
    # counters) is pure cost, about 15 % of a step's fixed cost; the kernels are the same.
    with torch.inference_mode():
        adam = Adam(w, config.lr, weight_decay=config.weight_decay)
        gradient = torch.empty_like(w)  # reused at every step (as Adam's buffers and the batches are)
        weighted = y.shape[2] != w.shape[1]  # targets carry the pos_weight factors (see above)
        for epoch, order in enumerate(orders):
            for step, (xb, yb) in enumerate(Epoch(x, config.batch_size, order=order).with_targets(y)):
                if noise is not None:  # in the gathered batch (a reused buffer), bias column untouched
                    xb[:, :, :-1].mul_(noise[epoch][step])
                logits = logits_of(w, xb)
                grad = weighted_bce_gradient(logits, yb) if weighted else bce_gradient(logits, yb)
                adam.step(w, weight_gradient(grad, xb, out=gradient))


def weighted_bce_gradient(logits: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """Gradient of the mean positive-weighted BCE-with-logits per client: ``(σ(z)·(1 + (w − 1)y) −
    w·y) / (B·C)``, ``factors`` holding ``1 + (w − 1)y`` and ``w·y`` side by side (``K × B × 2C``)."""
    n_classes = logits.shape[2]
    out = torch.sigmoid(logits).mul_(factors[:, :, :n_classes]).sub_(factors[:, :, n_classes:])
    return out.div_(logits.shape[1] * n_classes)
