"""FedAvg baseline (paper Table I): a linear head on the same frozen features, missing labels as negatives.

Head: ``Linear(d, C)`` with bias, trained with binary cross-entropy on logits.  Each of the
``rounds`` rounds, every client starts from the global head, runs ``local_epochs`` epochs of Adam
(learning rate 1e-3, betas (0.9, 0.999), fresh optimiser state each round, as FedAvg clients keep no
state between rounds) over shuffled mini-batches of 64, and the server averages the heads weighted
by the clients' sample counts.  Labels of classes a client does not annotate are 0, as FedAvg treats
them in the paper.

Clients of equal size train as one batched computation (a leading client axis): Adam is element-wise
and the summed loss separates by client, so this is exactly K independent local runs, only faster.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class FedAvgConfig:
    rounds: int = 50
    local_epochs: int = 1
    batch_size: int = 64
    lr: float = 1e-3
    seed: int = 0


@dataclass(frozen=True)
class LinearHead:
    coef: np.ndarray  # d × C
    bias: np.ndarray  # C

    def predict_proba(self, features: np.ndarray) -> np.ndarray:
        logits = np.asarray(features, dtype=np.float64) @ self.coef + self.bias
        return 1.0 / (1.0 + np.exp(-logits))


class _Adam:
    """Adam (Kingma & Ba) with torch.optim.Adam's defaults, on a tensor updated in place.

    Written out because the gradient is too: autograd's overhead dominates a linear head's step.
    """

    def __init__(self, like: torch.Tensor, lr: float, betas: tuple[float, float] = (0.9, 0.999)) -> None:
        self.lr, (self.beta1, self.beta2), self.eps = lr, betas, 1e-8
        self.m = torch.zeros_like(like)
        self.v = torch.zeros_like(like)
        self.t = 0

    def step(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        self.t += 1
        self.m.mul_(self.beta1).add_(grad, alpha=1 - self.beta1)
        self.v.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
        step_size = self.lr / (1 - self.beta1**self.t)
        denom = (self.v / (1 - self.beta2**self.t)).sqrt_().add_(self.eps)
        param.addcdiv_(self.m, denom, value=-step_size)


def missing_as_negative(labels: np.ndarray, active: Sequence[int]) -> np.ndarray:
    """The FedAvg view of a client's labels: unannotated classes become 0."""
    out = np.zeros_like(labels, dtype=np.float32)
    out[:, list(active)] = labels[:, list(active)]
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
    sizes = {len(x) for x in features}
    if len(features) != len(targets) or not features:
        raise ValueError("features and targets must list the same, non-zero number of clients")
    if len(sizes) != 1:
        raise ValueError(f"FedAvg here expects clients of equal size, got sizes {sorted(sizes)}")
    n = sizes.pop()
    generator = torch.Generator().manual_seed(config.seed)
    x = torch.as_tensor(np.stack(features), dtype=torch.float32, device=device)  # K × N × d
    y = torch.as_tensor(np.stack(targets), dtype=torch.float32, device=device)  # K × N × C
    n_clients, _, dim = x.shape
    n_classes = y.shape[2]
    weights = torch.full((n_clients,), 1.0 / n_clients, device=device)  # sample-count weights, equal sizes
    init = torch.nn.Linear(dim, n_classes)
    with torch.no_grad():
        torch.nn.init.kaiming_uniform_(init.weight, a=5**0.5, generator=generator)
        init.bias.zero_()
    global_w = init.weight.detach().T.contiguous().to(device)  # d × C
    global_b = init.bias.detach().clone().to(device)
    client_axis = torch.arange(n_clients, device=device)[:, None]
    for round_ in range(config.rounds):
        w = global_w.expand(n_clients, dim, n_classes).clone()
        b = global_b.expand(n_clients, n_classes).clone()
        adam_w, adam_b = _Adam(w, config.lr), _Adam(b, config.lr)
        for _ in range(config.local_epochs):
            order = torch.argsort(torch.rand((n_clients, n), generator=generator), dim=1).to(device)
            for start in range(0, n, config.batch_size):
                idx = order[:, start : start + config.batch_size]
                xb, yb = x[client_axis, idx], y[client_axis, idx]
                # Gradient of the mean BCE-with-logits per client, written out: (σ(z) − y) / (B·C).
                grad_logits = (torch.sigmoid(torch.baddbmm(b[:, None, :], xb, w)) - yb) / (
                    yb.shape[1] * n_classes
                )
                adam_w.step(w, torch.bmm(xb.transpose(1, 2), grad_logits))
                adam_b.step(b, grad_logits.sum(dim=1))
        global_w = torch.einsum("k,kdc->dc", weights, w)
        global_b = weights @ b
        if progress is not None:
            progress(round_ + 1)
    return LinearHead(coef=global_w.cpu().double().numpy(), bias=global_b.cpu().double().numpy())
