"""What every gradient baseline shares: configuration, the federation's tensors, feature-level
augmentation, losses written on logits, and the federated training loop over batched heads."""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from secure_afl.analytic import active_class_indices
from secure_afl.sim.baselines.engine import (
    Adam,
    Epoch,
    LinearHead,
    empty_rows_like,
    head_from_weights,
    initial_weights,
    shuffle_keys,
    shuffle_order,
    stack_clients,
    weight_gradient,
)
from secure_afl.sim.methods import REFERENCE_ROUNDS
from secure_afl.torch_threads import one_torch_thread


@dataclass(frozen=True)
class BaselineConfig:
    """Training settings shared by the seven baselines (README: each method's table row).

    ``rounds`` and ``local_epochs``: paper Table I / §IV-E (R = 50, one local epoch).  Adam with
    betas (0.9, 0.999) and ``weight_decay`` 5e-4: FedMLP's ``local_training*.py`` for every method.
    ``lr`` and ``batch_size`` are the head's (the same as this repository's FedAvg): FedMLP's
    ``base_lr`` (3e-5, "ChestXray14 = 3e-6") and batch 32 fine-tune a whole ResNet end to end; a
    linear head on frozen features barely moves from its initialisation at that rate in 50 epochs.

    Stage boundaries and ramps, which FedMLP's code counts in its 500 rounds (``rounds_warmup``),
    scale by ``rounds / 500`` (:attr:`stage_scale`): at ``schedule`` ``"paper"`` (R = 50) FedMLP's
    stage 1 ends after round 5 instead of 50, CBAFed's warm-up after 5, FedIRM's supervised stage
    after 2, FedNoRo's distillation ramp runs from round 1 to 49.9 instead of 10 to 499; at
    ``"reference"`` (R = 500) they are the released code's own.  ``schedule`` only names the choice
    (results.json records it); ``rounds`` sets the scale.
    """

    rounds: int = 50
    local_epochs: int = 1
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 5e-4
    seed: int = 0
    schedule: str = "paper"

    @property
    def stage_scale(self) -> float:
        return self.rounds / REFERENCE_ROUNDS


@dataclass
class Federation:
    """The clients' cached features and partial labels, as tensors with a leading client axis.

    ``y`` holds the labels of each client's active classes and 0 elsewhere (what a client without
    an annotation for a class has); ``active`` says which entries are real labels.
    """

    x: torch.Tensor  # K × N × (d+1), ones column last
    y: torch.Tensor  # K × N × C in {0, 1}
    active: torch.Tensor  # K × C bool
    pos_weight: torch.Tensor  # K × C: N / N⁺ on active classes with positives, else 1

    @property
    def n_clients(self) -> int:
        return self.x.shape[0]

    @property
    def n_classes(self) -> int:
        return self.y.shape[2]

    @property
    def dim(self) -> int:
        return self.x.shape[2] - 1

    @classmethod
    def build(
        cls,
        features: Sequence[np.ndarray],
        labels: Sequence[np.ndarray],
        active: Sequence[Sequence[int] | Sequence[bool] | np.ndarray],
    ) -> Federation:
        """``features[k]`` rows × d, ``labels[k]`` rows × C (true 0/1), ``active[k]`` its classes."""
        if not (len(features) == len(labels) == len(active)) or not features:
            raise ValueError(
                "features, labels and active classes must list the same, non-zero number of clients"
            )
        return cls.from_stacked(stack_clients(features), labels, active)

    @classmethod
    def from_stacked(
        cls,
        x: torch.Tensor,
        labels: Sequence[np.ndarray] | np.ndarray,
        active: Sequence[Sequence[int] | Sequence[bool] | np.ndarray],
    ) -> Federation:
        """As :meth:`build`, from features already stacked by :func:`stack_clients` (shared, not
        copied: several methods can train on one tensor)."""
        if not (x.shape[0] == len(labels) == len(active)):
            raise ValueError(
                "features, labels and active classes must list the same, non-zero number of clients"
            )
        n_classes = np.asarray(labels[0]).shape[1]
        mask = np.zeros((len(labels), n_classes), dtype=bool)
        for k, classes in enumerate(active):
            mask[k, active_class_indices(classes, n_classes)] = True
        observed = np.stack([np.asarray(y, dtype=np.float32) for y in labels]) * mask[:, None, :]
        n = observed.shape[1]
        positives = observed.sum(axis=1)
        # FedMLP's pos_weight N/N_c (BCEWithLogitsLoss), from what the client observes: a missing
        # class has no observed positive and weight 1 (FedMLP's code reads the true counts there).
        pos_weight = np.where(mask & (positives > 0), n / np.maximum(positives, 1), 1.0)
        return cls(
            x=x,
            y=torch.as_tensor(observed),
            active=torch.as_tensor(mask),
            pos_weight=torch.as_tensor(pos_weight, dtype=torch.float32),
        )


class FeatureAugmenter:
    """Feature-level stand-ins for the image augmentations of FedMLP's pipelines.

    The heads see cached features, so image transforms cannot be applied.  Each view multiplies the
    d feature dimensions (never the bias column) by a noise vector:

    - ``weak``: ``1 + 0.1·ξ``, ξ ~ N(0, I): a mild jitter (the analogue of flips and small shifts);
    - ``strong``: ``(1 + 0.2·ξ) ⊙ m / 0.8``, m ~ Bernoulli(0.8): more jitter plus erasing a random
      20 % of the dimensions (the analogue of RandAugment plus Cutout in FixMatch).

    Noise vectors are drawn once into banks of ``BANK`` rows; each step's K·B samples (in shuffled
    order) take the consecutive rows from a random offset: drawing K·B·d fresh normals per step
    would cost more than the step itself.

    The banks are the first draws of the run's generator, the same for every method of a run (same
    seed, same dimension): they are drawn once per process and the next ones reuse them, with the
    generator moved on to where drawing them leaves it (about 0.1–0.4 s per training job saved).
    """

    BANK = 4096
    _CACHED = 4  # bank sets kept per process (32 MB each at d = 1024)
    _banks_drawn: ClassVar[OrderedDict[tuple[int, bytes], tuple[dict[str, torch.Tensor], torch.Tensor]]] = (
        OrderedDict()
    )
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, dim: int, generator: torch.Generator) -> None:
        self.generator = generator
        key = (dim, bytes(generator.get_state().numpy()))
        with self._lock:
            drawn = self._banks_drawn.get(key)
            if drawn is not None:
                self._banks_drawn.move_to_end(key)
        if drawn is None:
            noise = torch.randn((2, self.BANK, dim), generator=generator)
            keep = (torch.rand((self.BANK, dim), generator=generator) < 0.8).float() / 0.8
            banks = {"weak": 1 + 0.1 * noise[0], "strong": (1 + 0.2 * noise[1]) * keep}
            drawn = (banks, generator.get_state())
            with self._lock:
                self._banks_drawn[key] = drawn
                while len(self._banks_drawn) > self._CACHED:
                    self._banks_drawn.popitem(last=False)
        else:
            generator.set_state(drawn[1])
        self.banks = drawn[0]  # shared between the jobs of a process: only ever read

    def epoch_starts(self, n_clients: int, rows: int, batch_size: int) -> list[tuple[int, int]]:
        """``(bank offset, batch size)`` of each step of one epoch of ``n_clients`` clients, drawn
        as :meth:`__call__` draws them: a caller that trains slices of the clients on several
        threads draws them first, and each slice reads its clients' rows with :meth:`noise`."""
        sizes = [min(batch_size, rows - start) for start in range(0, rows, batch_size)]
        if n_clients * max(sizes) > self.BANK:
            raise ValueError(
                f"{n_clients * max(sizes)} samples per step exceed the noise bank of {self.BANK} rows"
            )
        draws = [
            int(torch.randint(self.BANK - n_clients * size + 1, (1,), generator=self.generator))
            for size in sizes
        ]
        return list(zip(draws, sizes, strict=True))

    def noise(self, kind: str, start: int, size: int, clients: slice) -> torch.Tensor:
        """Clients ``clients``' multipliers (``k × size × d``) of the step whose offset is ``start``."""
        first, stop = clients.start or 0, clients.stop
        return self.banks[kind][start + first * size : start + stop * size].view(stop - first, size, -1)

    def draw(self, n_clients: int, rows: int) -> int:
        """The bank offset of one view of ``n_clients × rows`` samples (what :meth:`__call__` draws)."""
        count = n_clients * rows
        if count > self.BANK:
            raise ValueError(f"{count} samples per step exceed the noise bank of {self.BANK} rows")
        return int(torch.randint(self.BANK - count + 1, (1,), generator=self.generator))

    def apply(self, kind: str, start: int, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The view of ``x`` with the multipliers at bank offset ``start``, into ``out`` (which may be
        ``x`` itself) or a new tensor with ``x``'s row padding (the products read those faster)."""
        n_clients, rows, width = x.shape
        noise = self.banks[kind][start : start + n_clients * rows].view(n_clients, rows, width - 1)
        if out is None:
            out = empty_rows_like(x)
        torch.mul(x[:, :, :-1], noise, out=out[:, :, :-1])
        out[:, :, -1] = 1.0
        return out

    def __call__(self, kind: str, x: torch.Tensor) -> torch.Tensor:
        return self.apply(kind, self.draw(x.shape[0], x.shape[1]), x)


# ---------------------------------------------------------------------------------------------
# Losses on logits (summed over clients: every client's loss depends only on its own head)
# ---------------------------------------------------------------------------------------------


def bce(logits: torch.Tensor, targets: torch.Tensor, pos_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Element-wise binary cross-entropy of ``σ(logits)`` (optionally positive-weighted), stable."""
    positive = F.softplus(-logits) * targets
    if pos_weight is not None:
        positive = positive * pos_weight
    return positive + F.softplus(logits) * (1 - targets)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, per_client_count: float) -> torch.Tensor:
    """``Σ_{entries in mask} values / count`` per client, summed over clients (``K × B × C``)."""
    return (values * mask).sum() / max(per_client_count, 1.0)


def sigmoid_rampup(current: float, begin: float, end: float) -> float:
    """Laine & Aila's ``exp(−5(1 − t)²)`` ramp from ``begin`` to ``end`` (FedIRM, FedNoRo)."""
    if end <= begin:
        return 1.0
    t = (min(max(current, begin), end) - begin) / (end - begin)
    return math.exp(-5.0 * (1.0 - t) ** 2)


@dataclass
class Batch:
    """One step's data for every client."""

    rnd: int
    views: dict[str, torch.Tensor]  # name → K × B × (d+1)
    y: torch.Tensor  # K × B × C
    active: torch.Tensor  # K × 1 × C (float 0/1)
    missing: torch.Tensor  # K × 1 × C
    pos_weight: torch.Tensor  # K × 1 × C
    teacher: dict[str, torch.Tensor] = field(default_factory=dict)  # view → teacher logits K × B × C
    rows: torch.Tensor | None = None  # K × B: each sample's row in its client's data (Epoch.take)
    flat_rows: torch.Tensor | None = None  # K·B: the same rows in the flattened clients (Epoch.with_rows)
    # (active, missing) classes per client (each client has as many), when the caller counted them
    class_counts: tuple[float, float] | None = None

    @property
    def size(self) -> int:
        return self.y.shape[1]

    @property
    def n_active(self) -> float:
        """The active classes of a client (client 0's: every client has as many)."""
        return self.class_counts[0] if self.class_counts is not None else float(self.active[0].sum())

    @property
    def n_missing(self) -> float:
        """The missing classes of a client (client 0's: every client has as many)."""
        return self.class_counts[1] if self.class_counts is not None else float(self.missing[0].sum())

    def take(self, values: torch.Tensor) -> torch.Tensor:
        """Each sample's entry of ``values`` (``K × N × C`` per client and row): ``K × B × C``."""
        if self.flat_rows is not None:  # one gather instead of Epoch.take's index arithmetic
            return take_flat(values, self.flat_rows, self.size)
        if self.rows is None:
            raise ValueError("this batch does not know its rows (Batch.rows or Batch.flat_rows)")
        return Epoch.take(values, self.rows)


def take_flat(values: torch.Tensor, flat_rows: torch.Tensor, size: int) -> torch.Tensor:
    """Each sample's entry of ``values`` (``K × N × …``) at ``flat_rows`` (``K·B`` indices into the
    flattened clients, :meth:`Epoch.with_rows`): ``K × B × …`` in one gather."""
    flat = values.reshape(values.shape[0] * values.shape[1], *values.shape[2:])
    return flat.index_select(0, flat_rows).view(values.shape[0], size, *values.shape[2:])


@dataclass
class Method:
    """One baseline: the views its loss needs, its local loss, hooks and its aggregation.

    ``loss`` gets the current heads' logits for each view in ``views`` (leaves that autograd
    differentiates: the head is linear, so ``∂loss/∂W`` follows from ``∂loss/∂logits`` by one
    product per view) and returns the loss summed over clients.  ``teachers()`` names fixed heads
    (EMA teachers, the round's global head) whose logits the loss needs on a view; they come in
    ``batch.teacher`` from the same product as the head's own logits.
    """

    name: str
    family: str
    views: tuple[str, ...] = ("plain",)
    state: dict[str, object] = field(default_factory=dict)
    stage_scale: float = 0.1  # rounds / 500, set by train() from its config

    def stage_round(self, reference_round: float) -> int:
        """A stage boundary the reference counts in its 500 rounds, at this run's scale (≥ 1, so a
        first stage always runs one round)."""
        return max(1, round(reference_round * self.stage_scale))

    def start(self, fed: Federation, init: torch.Tensor, generator: torch.Generator) -> None:
        """Before round 0."""

    def teachers(self) -> dict[str, torch.Tensor]:
        """View → ``K × C × (d+1)`` heads whose logits (no gradient) the loss needs there."""
        return {}

    def start_round(self, rnd: int, global_w: torch.Tensor, local_w: torch.Tensor) -> None:
        """Each round, before local training (``local_w`` is every client's copy of the global)."""

    def loss(self, batch: Batch, logits: dict[str, torch.Tensor], w: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def after_step(self, w: torch.Tensor) -> None:
        """After each local step (EMA teachers)."""

    def end_round(self, rnd: int, local_w: torch.Tensor) -> None:
        """After local training, before aggregation (statistics the clients send)."""

    def aggregate(self, rnd: int, local_w: torch.Tensor) -> torch.Tensor:
        """Server: the next global head from the clients' heads (default: FedAvg, equal sizes)."""
        return local_w.mean(dim=0)

    def end_training(self) -> None:
        """After the last round (statistics reported once, from the final heads)."""


def _views(
    augments: Sequence[FeatureAugmenter], x: torch.Tensor, names: Sequence[str]
) -> dict[str, torch.Tensor]:
    """The batch's views a step needs: ``"plain"`` is ``x``; ``"strong"`` the strong view; any other
    name a weak view (each view its own draw, in the order of ``names``).

    ``augments``: one augmenter per level trained in lockstep (:func:`train_levels`), each drawing from
    its level's generator; the draws must agree, and the views are made once, with the first.

    Unless ``"plain"`` is needed, the last view is made in ``x`` itself (the batch's buffer, gathered
    anew at every step): one 2 MB tensor fewer to write and read per step, the same products.
    """
    wanted = [name for name in dict.fromkeys(names) if name != "plain"]
    starts = [_agreed([a.draw(x.shape[0], x.shape[1]) for a in augments]) for _ in wanted]  # in order
    views = {"plain": x} if "plain" in names else {}
    for i, (name, start) in enumerate(zip(wanted, starts, strict=True)):
        in_place = i == len(wanted) - 1 and "plain" not in names  # after every other view read x
        kind = "strong" if name == "strong" else "weak"
        views[name] = augments[0].apply(kind, start, x, out=x if in_place else None)
    return views


class LockstepError(RuntimeError):
    """Levels trained in lockstep drew different random numbers (see :func:`train_levels`)."""


def _agreed(draws: Sequence[int] | Sequence[torch.Tensor]) -> int | torch.Tensor:
    """The levels' common draw; an error when they differ."""
    first = draws[0]
    for other in draws[1:]:
        same = torch.equal(first, other) if isinstance(first, torch.Tensor) else first == other
        if not same:
            raise LockstepError(
                "the levels trained in lockstep drew different random numbers: this method's draws "
                "depend on the labels, so train each level alone (train())"
            )
    return first


def train(
    method: Method,
    fed: Federation,
    config: BaselineConfig,
    *,
    progress: Callable[[int], None] | None = None,
) -> LinearHead:
    """Federated training of ``method`` for ``config.rounds`` rounds; returns the global head."""
    return train_levels([method], [fed], config, progress=progress)[0]


def train_levels(
    methods: Sequence[Method],
    federations: Sequence[Federation],
    config: BaselineConfig,
    *,
    progress: Callable[[int], None] | None = None,
) -> list[LinearHead]:
    """:func:`train` of ``methods[i]`` on ``federations[i]`` for every i, in lockstep: the missing
    levels of one method, on the same clients' features (one tensor), each with its labels.

    Each level has its own generator seeded as :func:`train` seeds it, and draws what it would draw
    alone.  None of the draws depends on the labels (the shuffles, the view offsets, RSCFed's groups,
    FedLSR's mixing weights), so the levels draw the same numbers: a step's rows and feature views are
    the same at every level, and are gathered and made once.  The heads' products on a view are one
    product (every level's heads stacked; MKL sums each entry in the same order whatever the number
    of rows, as the gradient's product), copied back to each level's own layout, so that every level's
    head is bit for bit the one :func:`train` gives it alone (tested).  Draws that differ between the
    levels raise :class:`LockstepError` rather than train a level on another level's numbers.
    """
    if len(methods) != len(federations) or not methods:
        raise ValueError("train_levels needs one federation per method, and at least one")
    x = federations[0].x
    for fed in federations[1:]:
        if fed.x.data_ptr() != x.data_ptr() or fed.x.shape != x.shape or fed.x.stride() != x.stride():
            raise ValueError("the levels trained in lockstep must share one feature tensor")
    levels = range(len(methods))
    n_clients, n_rows, n_classes = federations[0].n_clients, x.shape[1], federations[0].n_classes
    with one_torch_thread():
        generators = [torch.Generator().manual_seed(config.seed) for _ in levels]
        global_ws = [initial_weights(federations[0].dim, n_classes, g) for g in generators]
        augments = [FeatureAugmenter(federations[0].dim, g) for g in generators]  # the banks are shared
        active, missing, pos_weight, class_counts = [], [], [], []
        for method, fed, global_w, generator in zip(methods, federations, global_ws, generators, strict=True):
            method.stage_scale = config.stage_scale
            method.start(fed, global_w, generator)
            active.append(fed.active.float()[:, None, :])
            missing.append(1 - active[-1])
            pos_weight.append(fed.pos_weight[:, None, :])
            # every client labels as many classes (counted once, not at every step)
            class_counts.append((float(active[-1][0].sum()), float(missing[-1][0].sum())))
        for rnd in range(config.rounds):
            ws = [global_w.expand(n_clients, *global_w.shape).clone() for global_w in global_ws]
            for method, global_w, w in zip(methods, global_ws, ws, strict=True):
                method.start_round(rnd, global_w, w)
            adams = [Adam(w, config.lr, weight_decay=config.weight_decay) for w in ws]
            for _ in range(config.local_epochs):
                # epoch_order's draw at every level, sorted once
                order = shuffle_order(_agreed([shuffle_keys(n_clients, n_rows, g) for g in generators]))
                for xb, rows, flat_rows in Epoch(x, config.batch_size, order=order).with_rows():
                    teachers = [method.teachers() for method in methods]
                    names = (*methods[0].views, *teachers[0])
                    if any((*m.views, *t) != names for m, t in zip(methods, teachers, strict=True)):
                        raise LockstepError("the levels trained in lockstep need different views")
                    views = _views(augments, xb, names)
                    batches = [
                        Batch(
                            rnd,
                            views,
                            take_flat(fed.y, flat_rows, xb.shape[1]),
                            active[i],
                            missing[i],
                            pos_weight[i],
                            rows=rows,
                            flat_rows=flat_rows,
                            class_counts=class_counts[i],
                        )
                        for i, fed in enumerate(federations)
                    ]
                    leaves: list[dict[str, torch.Tensor]] = [{} for _ in levels]
                    for view, x_view in views.items():
                        # per level: its head where the view is its own, then its teacher's there
                        heads = [
                            ([w] if view in method.views else []) + ([t[view]] if view in t else [])
                            for method, w, t in zip(methods, ws, teachers, strict=True)
                        ]
                        for i, products in zip(levels, _products(heads, x_view), strict=True):
                            if products is None:
                                continue
                            both = products.transpose(1, 2)  # K × B × rows, as logits_of gives them
                            if view in teachers[i]:
                                batches[i].teacher[view] = both[:, :, -n_classes:]
                            if view in methods[i].views:
                                leaves[i][view] = both[:, :, :n_classes].requires_grad_()
                    grads = [
                        torch.autograd.grad(method.loss(batch, own, w), list(own.values()), allow_unused=True)
                        for method, batch, own, w in zip(methods, batches, leaves, ws, strict=True)
                    ]
                    steps: list[torch.Tensor | None] = [None for _ in levels]
                    for view, x_view in views.items():
                        per_level = [
                            dict(zip(own, grad, strict=True)).get(view)
                            for own, grad in zip(leaves, grads, strict=True)
                        ]
                        for i, part in zip(levels, _gradients(per_level, x_view), strict=True):
                            if part is not None:
                                steps[i] = part if steps[i] is None else steps[i].add_(part)
                    for method, adam, w, step in zip(methods, adams, ws, steps, strict=True):
                        if step is not None:
                            adam.step(w, step)
                        method.after_step(w)
            for i, method in enumerate(methods):
                method.end_round(rnd, ws[i])
                global_ws[i] = method.aggregate(rnd, ws[i])
            if progress is not None:
                progress(rnd + 1)
        for method in methods:
            method.end_training()
        return [head_from_weights(global_w) for global_w in global_ws]


def _products(heads: Sequence[Sequence[torch.Tensor]], x: torch.Tensor) -> list[torch.Tensor | None]:
    """Each level's heads (stacked along the class axis) times the view's rows: ``K × rows × B``
    contiguous per level (None where a level has none), from one product for every level."""
    stacked = [h for level in heads for h in level]
    if not stacked:
        return [None for _ in heads]
    weights = stacked[0] if len(stacked) == 1 else torch.cat(stacked, dim=1)
    product = torch.bmm(weights, x.transpose(1, 2))  # K × all rows × B
    return _split_levels(product, [sum(h.shape[1] for h in level) for level in heads])


def _gradients(grads: Sequence[torch.Tensor | None], x: torch.Tensor) -> list[torch.Tensor | None]:
    """``∂loss/∂W`` of each level from its ``∂loss/∂logits`` on the view ``x`` (None: no gradient
    there): ``K × C × (d+1)`` contiguous per level, from one product for every level."""
    present = [g for g in grads if g is not None]
    if not present:
        return [None for _ in grads]
    if len(present) == 1:
        product = weight_gradient(present[0], x)
    else:
        product = torch.bmm(torch.cat([g.transpose(1, 2) for g in present], dim=1), x)
    return _split_levels(product, [0 if g is None else g.shape[2] for g in grads])


def _split_levels(product: torch.Tensor, rows: Sequence[int]) -> list[torch.Tensor | None]:
    """``product``'s consecutive row blocks (axis 1) of the given sizes, each a contiguous copy in the
    layout a product of that level alone has (every later op sees the same strides, so takes the same
    kernel path); None for a level with no rows."""
    out: list[torch.Tensor | None] = []
    start = 0
    for count in rows:
        out.append(product[:, start : start + count].contiguous() if count else None)
        start += count
    return out
