"""Batched training of K linear heads on cached features: the engine of FedAvg and the baselines.

Every gradient baseline here trains a linear head ``logits = W·[h; 1]`` (``W`` is ``C × (d+1)``,
bias last) on the same frozen features as AFL.  Clients of equal size train as one batched
computation with a leading client axis: the heads are a ``K × C × (d+1)`` tensor, a step is two
batched matrix products (``W·xᵀ`` for the logits and ``g·x`` for the gradient, both in the
layout where the long axis is contiguous, 2–3× faster than the transposed ones on a CPU) and one
Adam update.  The summed loss separates by client and Adam is element-wise, so this is exactly K
independent local runs.

Speed on a CPU: each epoch's shuffled rows are gathered once per client (a row copy), and training
runs on one torch thread: the steps are small matrix products for which a second OpenMP thread costs
more in synchronisation than it saves, and on a shared machine a busy second core makes every step
wait.  The rows of the stacked features, of each batch and of its augmented views are padded to a
multiple of 64 bytes (:data:`ROW_ALIGN`; the tensors are views of the first ``d+1`` columns): MKL's
products read aligned rows about 1.5× faster (1025 floats: measured 160 µs instead of 260 µs per
product) and sum in the same order, so every result is bit for bit the unpadded one (tested).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

ROW_ALIGN = 16
"""Floats per 64 bytes: the stacked features' and the batches' rows start on a cache line."""


def aligned_width(width: int) -> int:
    """The row stride, in floats, of a padded row of ``width`` values."""
    return -(-width // ROW_ALIGN) * ROW_ALIGN


def padded_rows(x: torch.Tensor) -> torch.Tensor | None:
    """The ``… × P`` tensor whose first ``x.shape[-1]`` columns are ``x`` (``P`` > that, its row
    stride), if ``x`` is such a view (:func:`stack_clients`, :class:`Epoch`'s batches); else None."""
    if x.dim() < 2 or x.stride(-1) != 1 or x.stride(-2) <= x.shape[-1]:
        return None
    *outer, _ = x.shape
    strides, step = [], x.stride(-2)
    for size in reversed(outer):  # packed rows: each outer axis strides over whole padded rows
        strides.insert(0, step)
        step *= size
    if list(x.stride()[:-1]) != strides:
        return None
    if x.storage_offset() + step > x.untyped_storage().nbytes() // x.element_size():
        return None  # the last row's padding would lie outside the storage
    return x.as_strided((*outer, x.stride(-2)), (*strides, 1))


def empty_rows_like(x: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor shaped like ``x`` with ``x``'s row padding (a plain one without)."""
    padded = padded_rows(x)
    if padded is None:
        return torch.empty_like(x)
    return torch.empty(padded.shape, dtype=x.dtype, device=x.device)[..., : x.shape[-1]]


class Adam:
    """Adam (Kingma & Ba) with torch.optim.Adam's defaults, on a tensor updated in place.

    Written out because the gradient is too: autograd's overhead dominates a linear head's step.
    """

    def __init__(
        self,
        like: torch.Tensor,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
    ) -> None:
        self.lr, (self.beta1, self.beta2), self.eps = lr, betas, 1e-8
        self.weight_decay = weight_decay
        self.m = torch.zeros_like(like)
        self.v = torch.zeros_like(like)
        self._denominator = torch.empty_like(like)  # reused at every step: no allocation, a warm cache
        self.t = 0

    def step(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        self.t += 1
        if self.weight_decay:  # L2 as torch.optim.Adam's weight_decay: added to the gradient
            grad = grad.add(param, alpha=self.weight_decay)
        self.m.mul_(self.beta1).add_(grad, alpha=1 - self.beta1)
        self.v.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
        step_size = self.lr / (1 - self.beta1**self.t)
        denom = torch.div(self.v, 1 - self.beta2**self.t, out=self._denominator).sqrt_().add_(self.eps)
        param.addcdiv_(self.m, denom, value=-step_size)


@dataclass(frozen=True)
class LinearHead:
    """A trained head: ``logits = h·coef + bias``."""

    coef: np.ndarray  # d × C
    bias: np.ndarray  # C

    def decision_function(self, features: np.ndarray) -> np.ndarray:
        """The logits (metrics rank these: probabilities saturate and tie)."""
        return np.asarray(features, dtype=np.float64) @ self.coef + self.bias

    def predict_proba(self, features: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-self.decision_function(features)))

    def predict(self, features: np.ndarray) -> np.ndarray:
        """``σ(logit) > 0.5``, i.e. ``logit > 0``."""
        return (self.decision_function(features) > 0).astype(np.int8)


def head_from_weights(weights: torch.Tensor) -> LinearHead:
    """``C × (d+1)`` (bias last) → :class:`LinearHead`."""
    w = weights.detach().cpu().double()
    return LinearHead(coef=w[:, :-1].T.contiguous().numpy(), bias=w[:, -1].contiguous().numpy())


def stack_clients(
    features: Sequence[np.ndarray] | np.ndarray, rows: Sequence[np.ndarray] | None = None
) -> torch.Tensor:
    """Equal-size clients' features as one ``K × N × (d+1)`` float32 tensor with a ones column.

    ``features``: one array per client; or, with ``rows``, the whole feature matrix, client k's
    rows being ``features[rows[k]]`` (gathered straight into the tensor, without a copy per client).
    The tensor is the first ``d+1`` columns of a ``K × N × P`` one whose rows are padded with zeros
    to :func:`aligned_width` (:func:`padded_rows` gives it back).
    """
    if rows is None:
        clients: Sequence[np.ndarray] = features  # type: ignore[assignment]
        sizes = [len(x) for x in clients]
        dim = clients[0].shape[1] if len(clients) else 0
    else:
        sizes = [len(r) for r in rows]
        dim = np.shape(features)[1]
    if not sizes:
        raise ValueError("at least one client is needed")
    if len(set(sizes)) != 1:
        raise ValueError(f"the batched heads expect clients of equal size, got sizes {sorted(set(sizes))}")
    width = dim + 1
    out = torch.empty((len(sizes), sizes[0], aligned_width(width)), dtype=torch.float32)  # all written below
    target = out.numpy()
    target[:, :, dim] = 1.0
    target[:, :, width:] = 0.0  # the padding: never read by a product, zero all the same
    for k in range(len(sizes)):
        target[k, :, :dim] = np.asarray(clients[k]) if rows is None else np.asarray(features)[rows[k]]
    return out[:, :, :width]


def initial_weights(dim: int, n_classes: int, generator: torch.Generator) -> torch.Tensor:
    """``nn.Linear``'s default initialisation (Kaiming-uniform weights), bias zero: ``C × (d+1)``."""
    weight = torch.empty(n_classes, dim)
    torch.nn.init.kaiming_uniform_(weight, a=5**0.5, generator=generator)
    return torch.cat([weight, torch.zeros(n_classes, 1)], dim=1)


def epoch_order(n_clients: int, n: int, generator: torch.Generator) -> torch.Tensor:
    """One epoch's shuffle of every client's rows (``K × N``): the draw :class:`Epoch` makes."""
    return shuffle_order(shuffle_keys(n_clients, n, generator))


def shuffle_keys(n_clients: int, n: int, generator: torch.Generator) -> torch.Tensor:
    """What :func:`epoch_order` draws: a uniform key per client and row."""
    return torch.rand((n_clients, n), generator=generator)


def shuffle_order(keys: torch.Tensor) -> torch.Tensor:
    """Each client's rows in the order of their keys (:func:`epoch_order` from its draw)."""
    return torch.argsort(keys, dim=1)


class Epoch:
    """One local epoch of every client: a fresh shuffle per client, then mini-batches.

    Iterating yields ``(x, rows)``: ``x`` the batch's features (``K × B × (d+1)``), ``rows`` its row
    indices per client (``K × B``) for looking up anything else per sample with :meth:`take`
    (:meth:`with_rows` adds the flat row indices, for one ``index_select`` instead).  The batch's rows
    are gathered at each step by one ``index_select`` over the flattened clients into a reused
    buffer, so they are still in cache for the two products that read them; when ``x``'s rows are
    padded (:func:`stack_clients`), the padded rows are copied, so the batch's rows are aligned too.

    ``order`` (``K × N``, from :func:`epoch_order`) replaces the draw from ``generator``: a caller
    that trains slices of the clients on several threads draws the whole federation's shuffle first,
    in the generator's order, and gives each slice its rows.
    """

    def __init__(
        self,
        x: torch.Tensor,
        batch_size: int,
        generator: torch.Generator | None = None,
        *,
        order: torch.Tensor | None = None,
    ) -> None:
        n_clients, self.n = x.shape[0], x.shape[1]
        if order is None:
            if generator is None:
                raise ValueError("Epoch needs a generator to shuffle with, or a drawn order")
            order = epoch_order(n_clients, self.n, generator)
        self.order = order
        self.flat_order = self.order + torch.arange(n_clients)[:, None] * self.n
        padded = padded_rows(x)
        source = x if padded is None else padded
        self.width = x.shape[2]  # the batch's columns; the buffer's rows may be padded beyond them
        self.x, self.batch_size = source.reshape(n_clients * self.n, source.shape[2]), batch_size
        self.buffer = torch.empty((n_clients * batch_size, source.shape[2]), dtype=x.dtype)
        self.n_clients = n_clients

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start, size, x, _ in self._gathered(self._batch_major_rows()):
            yield x, self.order[:, start : start + size]

    def with_rows(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(x, rows, flat)``: the batches as :meth:`__iter__` gives them, and the rows' indices in the
        flattened clients (``K·B``, client-major): ``values.view(K·N, …).index_select(0, flat)``
        is :meth:`take` in one call, without the index arithmetic."""
        batch_rows = self._batch_major_rows()
        for start, size, x, offset in self._gathered(batch_rows):
            yield x, self.order[:, start : start + size], batch_rows[offset : offset + size * self.n_clients]

    def with_targets(self, targets: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches with their targets: ``for x, y in epoch.with_targets(targets)``.

        ``targets`` is ``K × N × C``; each batch's ``y`` (``K × B × C``) holds the rows' own targets
        (what :meth:`take` gives).  They are gathered once for the whole epoch, in batch order, and
        each batch reads its slice: a FedAvg step is mostly fixed costs per torch call, and this
        saves one call and the index arithmetic at every step.
        """
        if tuple(targets.shape[:2]) != (self.n_clients, self.n):
            raise ValueError(
                f"targets must be clients × rows × C with {self.n_clients} × {self.n} like the features, "
                f"got shape {tuple(targets.shape)}"
            )
        batch_rows = self._batch_major_rows()
        epoch_targets = targets.reshape(self.n_clients * self.n, -1).index_select(0, batch_rows)
        for _, size, x, offset in self._gathered(batch_rows):
            yield x, epoch_targets[offset : offset + size * self.n_clients].view(self.n_clients, size, -1)

    def _batch_major_rows(self) -> torch.Tensor:
        """Every batch's flat row indices, batch after batch (client-major within a batch)."""
        full = self.n // self.batch_size * self.batch_size
        blocks = self.flat_order[:, :full].reshape(self.n_clients, -1, self.batch_size).transpose(0, 1)
        return torch.cat([blocks.reshape(-1), self.flat_order[:, full:].reshape(-1)])

    def _gathered(self, batch_rows: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor, int]]:
        """Each batch's rows gathered into the reused buffer: ``(start, size, x, offset)``, ``offset``
        being where the batch's rows begin in ``batch_rows``."""
        views: dict[int, torch.Tensor] = {}  # the buffer's view for each batch size (two at most)
        offset = 0
        for start in range(0, self.n, self.batch_size):
            size = min(self.batch_size, self.n - start)
            rows = size * self.n_clients
            x = views.get(size)
            if x is None:
                x = views[size] = self.buffer[:rows].view(self.n_clients, size, -1)[:, :, : self.width]
            torch.index_select(self.x, 0, batch_rows[offset : offset + rows], out=self.buffer[:rows])
            yield start, size, x, offset
            offset += rows

    @staticmethod
    def take(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``values[k, rows[k]]`` for every client: ``K × N × ...`` → ``K × B × ...``."""
        return values[torch.arange(values.shape[0])[:, None], rows]


def logits_of(weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``K × C × (d+1)`` heads on ``K × B × (d+1)`` rows → logits ``K × B × C``."""
    return torch.bmm(weights, x.transpose(1, 2)).transpose(1, 2)


def weight_gradient(
    grad_logits: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``∂loss/∂W`` from ``∂loss/∂logits`` (``K × B × C``) and the rows: ``K × C × (d+1)``, into
    ``out`` when given (a buffer reused at every step)."""
    return torch.bmm(grad_logits.transpose(1, 2), x, out=out)


def bce_gradient(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Gradient of the mean BCE-with-logits per client: ``(σ(z) − y) / (B·C)`` (in place on σ(z):
    the same operations, one tensor allocated instead of three)."""
    return torch.sigmoid(logits).sub_(targets).div_(targets.shape[1] * targets.shape[2])


def weighted_average(heads: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Server aggregation: ``Σ_k a_k W_k`` over the client axis (``a`` sums to 1)."""
    return torch.einsum("k,kcd->cd", weights.to(heads.dtype), heads)


Progress = Callable[[int], None]
