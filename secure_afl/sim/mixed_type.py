"""FedMT's setting (mixed-type labels) on ChestXray14: a fine-labelled centre, coarse-labelled clients.

FedMT (Federated Learning with Mixed-type Labels; ``seeds/fedmt-paper-excerpt.txt``) trains one
classifier in a *desired* label space of ``K`` classes from a small "specialised centre" labelled in
that space and clients labelled in a coarser space of ``J < K`` classes, linked by the correspondence
matrix ``M ∈ [0,1]^{J×K}``, ``M_jk = P(ỹ = j | y = k)``.  It is a multi-class method, so the task here
is multi-class too:

- **Rows.** The PA images of ChestXray14 whose ``Finding Labels`` is exactly one of the 8 findings
  of the paper, or ``No Finding`` (54,587 of the 67,310).  Images with any other finding, or with
  several, are left out.  The split (70/30, image- or patient-wise) and the 8 IID clients are those
  of the main experiment restricted to these rows, so features and splits are the same ones.
- **Fine space** (``K = 9``): the 8 findings and ``No Finding``.
- **Coarse space** (``J = 5``): the groups a reading radiologist reports at the first level, taken
  from the label hierarchy of CheXpert (Irvin et al., AAAI 2019, Fig. 2 and §"Labeler": *Lung
  Opacity* is the parent of *Lung Lesion*, *Atelectasis*, *Consolidation/Pneumonia* and *Edema*;
  *Enlarged Cardiomediastinum* the parent of *Cardiomegaly*) and from the Fleischner Society
  glossary (Hansell et al., Radiology 2008), which advises "opacity" for "infiltrate" and defines a
  pneumothorax as air in the pleural space:

  ====================  =======================================
  Normal                No Finding
  Cardiomediastinal     Cardiomegaly
  Pleural               Effusion, Pneumothorax
  Lung lesion           Mass, Nodule
  Lung opacity          Atelectasis, Infiltration, Pneumonia
  ====================  =======================================

  CheXpert keeps *Lung Lesion* under *Lung Opacity*; it is a group of its own here so that the
  coarse space keeps the focal/diffuse distinction a radiologist makes first.  Every fine class has
  one coarse class, so ``M`` is 0/1 and each column sums to 1.
- **Centre.** ``n`` fine-labelled training images per fine class (a sweep, as FedMT's Table 2).  The
  centre's pool is drawn once per seed (``max(n)`` images per class, nested: the first ``n`` of the
  pool for each ``n``), and those images are removed from the clients, so the clients' data is the
  same at every ``n`` and the analytic method aggregates once for the whole sweep.
- **Clients.** The remaining single-finding training rows of the 8 clients, labelled coarse.

Methods compared (accuracy, as FedMT reports, and balanced accuracy, since 72 % of the rows are
``No Finding``):

- **Centre alone (ridge)**: the closed form on the centre's rows only, one-hot targets.
- **Centre alone (gradient)**: FedMT's *Single*: the softmax head below trained on the centre only.
- **FedMT (M known)** and **FedMT (M estimated)**: a softmax head ``f(x) = softmax(Wᵀx + b)`` on the
  frozen features, trained with FedAvg over the centre and the clients.  The centre's loss is the
  cross-entropy on its fine labels; a client's is FedMT's projected loss ``−log (M f(x))_ỹ``.
  With ``M`` estimated, each client re-estimates its own ``M̂^c`` at the start of every round from
  the global model's confident predictions (``max_k f_k(x) ≥ ξ``):
  ``M̂_jk = #{ỹ = j, ŷ = k, confident} / #{ŷ = k, confident}``; a column with no confident prediction
  stays uniform (``1/J``, no information), and a client with no confident sample sits the round out,
  as in FedMT.  ``M̂`` never leaves the client.  In round 1 the clients sit out (the centre trains
  alone): a randomly initialised head already makes "confident" predictions, and an estimate from
  them locks onto a wrong assignment of fine classes (measured on the toy case of the tests: 3 %
  accuracy instead of > 85 %).  The excerpt does not say how FedMT starts; this is the decision.
- **Analytic (soft targets)**: one round, closed form.  Each client turns its coarse labels into
  soft fine targets by Bayes' rule, ``t_ik = M_{ỹ_i k} π_k / Σ_k' M_{ỹ_i k'} π_k'``, and uploads
  ``G_k = H̃_kᵀH̃_k`` and ``B_k = H̃_kᵀT_k`` (``H̃ = [H, 1]``: features and a constant for the
  intercept) under secure aggregation, in one group of all clients.  The server adds its centre's
  ``G_s``, ``B_s`` (one-hot targets) and ``γI`` and solves ``(G + G_s + γI) W = B + B_s`` by
  Cholesky: exactly the centralised ridge regression of all rows on their (soft or one-hot)
  targets.  Two priors ``π``: the findings' **prevalence** in the public label table (a deployment
  would take the published per-finding frequencies of its population) and **uniform** within each
  coarse group (no knowledge beyond ``M``).  Prediction: ``argmax_k h̃ᵀw_k``.  72 % of the rows are
  ``No Finding``, so that argmax favours it; the **balanced decision** divides each class's score
  by the federation's soft mass of the class (``Σ_i t_ik``, which the intercept row of ``B``
  already holds), a prior correction aimed at balanced accuracy.

FedMT's training details that the excerpt does not give were fixed here, a priori: Adam (lr 1e-3,
fresh state each round) as the repository's FedAvg baseline, mini-batches of 64, per round every
participant takes as many steps as one epoch of the largest client (the centre cycles through its
few rows), and the server averages the participants with equal weights, as FedMT's risk
``R(f) = C⁻¹ Σ_c R̂_c`` weights centres equally (the centre counts as one participant).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from rich.console import Console

from secure_afl.analytic import solve_spd, sum_contributions
from secure_afl.sim.data import CLASSES, SplitBy
from secure_afl.sim.datasets import DataRequest, ImageSource, PreparedData, Progress
from secure_afl.torch_threads import one_torch_thread

FINE_CLASSES: tuple[str, ...] = (*CLASSES, "No Finding")
COARSE_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Normal", ("No Finding",)),
    ("Cardiomediastinal", ("Cardiomegaly",)),
    ("Pleural", ("Effusion", "Pneumothorax")),
    ("Lung lesion", ("Mass", "Nodule")),
    ("Lung opacity", ("Atelectasis", "Infiltration", "Pneumonia")),
)
COARSE_CLASSES: tuple[str, ...] = tuple(name for name, _ in COARSE_GROUPS)
DEFAULT_CENTRE_N: tuple[int, ...] = (5, 20, 80)
PRIORS = ("prevalence", "uniform")
ALL_GROUP = "all"

CENTRE_RIDGE = "Centre alone (ridge)"
CENTRE_GRADIENT = "Centre alone (gradient)"
FEDMT_KNOWN = "FedMT (M known)"
FEDMT_ESTIMATED = "FedMT (M estimated)"
ANALYTIC = {
    "prevalence": "Analytic (soft targets, prevalence prior)",
    "uniform": "Analytic (soft targets, uniform prior)",
}
ANALYTIC_BALANCED = "Analytic (prevalence prior, balanced decision)"
METHODS = (CENTRE_RIDGE, CENTRE_GRADIENT, FEDMT_KNOWN, FEDMT_ESTIMATED, *ANALYTIC.values(), ANALYTIC_BALANCED)


class MixedTypeError(ValueError):
    """A mixed-type configuration that cannot run (too few images of a class for the centre, ...)."""


def correspondence_matrix() -> np.ndarray:
    """``M`` (J × K, 0/1): ``M_jk = 1`` when fine class ``k`` belongs to coarse group ``j``."""
    m = np.zeros((len(COARSE_CLASSES), len(FINE_CLASSES)))
    for j, (_, members) in enumerate(COARSE_GROUPS):
        for name in members:
            m[j, FINE_CLASSES.index(name)] = 1.0
    return m


def coarse_of(fine: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The coarse label of each fine label under a 0/1 correspondence matrix (argmax of its column)."""
    return np.argmax(m[:, np.asarray(fine)], axis=0)


# ----------------------------------------------------------------------------------------------
# Soft targets and M's estimate (client side)
# ----------------------------------------------------------------------------------------------


def soft_targets(coarse: np.ndarray, m: np.ndarray, priors: np.ndarray) -> np.ndarray:
    """``t_ik = P(y=k | ỹ=ỹ_i) = M_{ỹ_i k} π_k / Σ_k' M_{ỹ_i k'} π_k'`` (rows × K, rows sum to 1)."""
    m = np.asarray(m, dtype=np.float64)
    priors = np.asarray(priors, dtype=np.float64)
    if priors.shape != (m.shape[1],) or (priors < 0).any():
        raise MixedTypeError(f"priors must be {m.shape[1]} non-negative numbers, got shape {priors.shape}")
    weights = m[np.asarray(coarse)] * priors
    totals = weights.sum(axis=1, keepdims=True)
    if (totals <= 0).any():
        raise MixedTypeError("a coarse label has zero prior mass on all of its fine classes")
    return weights / totals


def estimate_correspondence(
    probs: np.ndarray, coarse: np.ndarray, n_coarse: int, xi: float
) -> tuple[np.ndarray | None, int]:
    """FedMT's estimate of ``M`` from confident pseudo-labels, and the number of confident samples.

    ``M̂_jk = #{ỹ=j, ŷ=k, max f ≥ ξ} / #{ŷ=k, max f ≥ ξ}`` with ``ŷ = argmax f``.  A fine class
    never predicted confidently keeps a uniform column ``1/J``.  ``None`` when no sample is
    confident: FedMT's client then sits the round out.
    """
    if not 0 < xi < 1:
        raise MixedTypeError(f"the confidence threshold ξ must lie strictly between 0 and 1, got {xi}")
    probs = np.asarray(probs)
    confident = probs.max(axis=1) >= xi
    n_conf = int(confident.sum())
    if n_conf == 0:
        return None, 0
    n_fine = probs.shape[1]
    counts = np.zeros((n_coarse, n_fine))
    np.add.at(counts, (np.asarray(coarse)[confident], probs[confident].argmax(axis=1)), 1.0)
    column = counts.sum(axis=0)
    estimate = np.full((n_coarse, n_fine), 1.0 / n_coarse)
    seen = column > 0
    estimate[:, seen] = counts[:, seen] / column[seen]
    return estimate, n_conf


def with_intercept(features: np.ndarray) -> np.ndarray:
    """``[H, 1]`` in float64: the constant column carries the intercept of the ridge classifier."""
    features = np.asarray(features, dtype=np.float64)
    return np.hstack([features, np.ones((len(features), 1))])


def target_tensor(prior: str) -> str:
    return f"b_soft/{prior}"


def soft_target_contributions(
    features: np.ndarray, targets: Mapping[str, np.ndarray]
) -> dict[str, dict[str, np.ndarray]]:
    """One client's upload: ``{"all": {"gram": H̃ᵀH̃, "b_soft/<prior>": H̃ᵀT}}`` in float64."""
    h = with_intercept(features)
    gram = h.T @ h
    tensors = {"gram": (gram + gram.T) / 2}
    for prior, t in targets.items():
        tensors[target_tensor(prior)] = h.T @ np.asarray(t, dtype=np.float64)
    return {ALL_GROUP: tensors}


def solve_soft_ridge(gram: np.ndarray, rhs: np.ndarray, gamma: float) -> np.ndarray:
    """``W = (G + γI)⁻¹ B`` by Cholesky (never an explicit inverse); ``(d+1) × K``."""
    if not gamma > 0:
        raise MixedTypeError(f"gamma must be positive, got {gamma}")
    return solve_spd(np.asarray(gram) + gamma * np.eye(len(gram)), np.asarray(rhs), "mixed-type ridge")


def ridge_scores(coef: np.ndarray, features: np.ndarray) -> np.ndarray:
    return with_intercept(features) @ coef


# ----------------------------------------------------------------------------------------------
# FedMT: softmax head with FedAvg, projected client loss
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FedMTConfig:
    rounds: int = 20
    batch_size: int = 64
    lr: float = 1e-3
    xi: float = 0.9  # confidence threshold of M's estimate
    seed: int = 0


@dataclass(frozen=True)
class SoftmaxHead:
    coef: np.ndarray  # d × K
    bias: np.ndarray  # K

    def predict_proba(self, features: np.ndarray) -> np.ndarray:
        z = np.asarray(features, dtype=np.float64) @ self.coef + self.bias
        z -= z.max(axis=1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=1, keepdims=True)


@dataclass(frozen=True)
class FedMTTrace:
    """What the estimate of M did: per round, the clients that took part and M̂'s error."""

    participants: tuple[int, ...]
    m_error: tuple[float, ...]  # mean over clients of max |M̂ − M| (NaN where not estimated)


def train_fedmt(
    features: np.ndarray,
    centre_rows: np.ndarray,
    centre_fine: np.ndarray,
    client_rows: Sequence[np.ndarray],
    client_coarse: Sequence[np.ndarray],
    m: np.ndarray | None,
    config: FedMTConfig = FedMTConfig(),
    *,
    n_fine: int = len(FINE_CLASSES),
    n_coarse: int = len(COARSE_CLASSES),
    true_m: np.ndarray | None = None,
    steps_per_round: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[SoftmaxHead, FedMTTrace]:
    """FedMT with FedAvg.  ``m`` is the known ``M``, or ``None`` to estimate it on every client.

    Every row's loss is ``−log Σ_k A_ik f_k(x_i)``: ``A_i`` is one-hot for the centre's fine label
    (plain cross-entropy) and ``M_{ỹ_i ·}`` for a client's coarse label (the projected loss).  Its
    gradient in the logits is ``f − r`` with ``r = A⊙f / Σ A⊙f``, written out instead of autograd.
    No clients (``client_rows=[]``) trains the centre alone.
    """
    # one torch thread while training: the per-step matrices are tiny (64 × 1024 × 9), so thread
    # hand-offs cost more than they save (measured: 13 ms per step on one thread, 80 ms on two)
    with one_torch_thread():
        return _train_fedmt(
            features,
            centre_rows,
            centre_fine,
            client_rows,
            client_coarse,
            m,
            config,
            n_fine=n_fine,
            n_coarse=n_coarse,
            true_m=true_m,
            steps_per_round=steps_per_round,
            progress=progress,
        )


def _train_fedmt(
    features: np.ndarray,
    centre_rows: np.ndarray,
    centre_fine: np.ndarray,
    client_rows: Sequence[np.ndarray],
    client_coarse: Sequence[np.ndarray],
    m: np.ndarray | None,
    config: FedMTConfig,
    *,
    n_fine: int,
    n_coarse: int,
    true_m: np.ndarray | None,
    steps_per_round: int | None,
    progress: Callable[[int], None] | None,
) -> tuple[SoftmaxHead, FedMTTrace]:
    n_coarse = n_coarse if m is None else m.shape[0]
    x = torch.as_tensor(np.asarray(features, dtype=np.float32))
    d = x.shape[1]
    generator = np.random.default_rng([config.seed, 0xFED])
    torch_gen = torch.Generator().manual_seed(config.seed)
    rows = [np.asarray(centre_rows), *(np.asarray(r) for r in client_rows)]
    allowed = torch.zeros((len(x), n_fine), dtype=torch.float32)
    allowed[torch.as_tensor(rows[0]), torch.as_tensor(np.asarray(centre_fine))] = 1.0
    if m is not None:
        for r, c in zip(client_rows, client_coarse, strict=True):
            allowed[torch.as_tensor(r)] = torch.as_tensor(m[np.asarray(c)], dtype=torch.float32)
    init = torch.nn.Linear(d, n_fine)
    with torch.no_grad():
        torch.nn.init.kaiming_uniform_(init.weight, a=5**0.5, generator=torch_gen)
        init.bias.zero_()
    global_w = init.weight.detach().T.contiguous()
    global_b = init.bias.detach().clone()
    if steps_per_round is None:  # one epoch of the largest participant
        steps_per_round = max(1, -(-max(len(r) for r in rows) // config.batch_size))
    steps = steps_per_round
    participants_log: list[int] = []
    error_log: list[float] = []
    for round_ in range(config.rounds):
        active = [0]
        errors = []
        for k, (r, c) in enumerate(zip(client_rows, client_coarse, strict=True), start=1):
            if m is not None:
                active.append(k)
                continue
            if round_ == 0:
                continue  # the random initial model's confident predictions are arbitrary: see below
            with torch.no_grad():
                probs = torch.softmax(x[torch.as_tensor(r)] @ global_w + global_b, dim=1).numpy()
            estimate, _ = estimate_correspondence(probs, c, n_coarse, config.xi)
            if estimate is None:
                continue  # no confident sample: the client sits the round out
            allowed[torch.as_tensor(r)] = torch.as_tensor(estimate[np.asarray(c)], dtype=torch.float32)
            active.append(k)
            if true_m is not None:
                errors.append(float(np.abs(estimate - true_m).max()))
        participants_log.append(len(active) - 1)
        error_log.append(float(np.mean(errors)) if errors else float("nan"))
        # Each participant cycles through shuffled passes of its rows for `steps` mini-batches.
        needed = steps * config.batch_size
        order = np.stack(
            [
                np.concatenate([generator.permutation(rows[p]) for _ in range(-(-needed // len(rows[p])))])[
                    :needed
                ]
                for p in active
            ]
        )
        index = torch.as_tensor(order.reshape(len(active), steps, config.batch_size))
        # One parameter set per participant (a leading axis): Adam is element-wise and the summed
        # loss separates by participant, so this is exactly independent local runs, batched.
        w = global_w.expand(len(active), d, n_fine).clone().requires_grad_(True)
        b = global_b.expand(len(active), n_fine).clone().requires_grad_(True)
        w.grad, b.grad = torch.zeros_like(w), torch.zeros_like(b)
        optimiser = torch.optim.Adam([w, b], lr=config.lr)  # fresh state every round
        with torch.no_grad():
            for step in range(steps):
                idx = index[:, step]
                xb, ab = x[idx], allowed[idx]
                p = torch.softmax(torch.baddbmm(b[:, None, :], xb, w), dim=2)
                mass = (ab * p).sum(dim=2, keepdim=True)
                # rows whose allowed mass is zero (an all-zero row of M̂) carry no gradient
                r = torch.where(mass > 0, ab * p / mass.clamp_min(1e-30), p)
                grad_z = (p - r) / config.batch_size
                w.grad.copy_(torch.bmm(xb.transpose(1, 2), grad_z))
                b.grad.copy_(grad_z.sum(dim=1))
                optimiser.step()
        global_w = w.detach().mean(dim=0)
        global_b = b.detach().mean(dim=0)
        if progress is not None:
            progress(round_ + 1)
    head = SoftmaxHead(coef=global_w.double().numpy(), bias=global_b.double().numpy())
    return head, FedMTTrace(tuple(participants_log), tuple(error_log))


def client_steps_per_round(client_rows: Sequence[np.ndarray], batch_size: int) -> int:
    """Mini-batches in one epoch of the largest client: FedMT's local work per round."""
    return max(1, -(-max(len(r) for r in client_rows) // batch_size))


# ----------------------------------------------------------------------------------------------
# Data: single-finding rows, centre pool, clients, test
# ----------------------------------------------------------------------------------------------


def single_finding_labels(cohort_source: str | Path, image_names: np.ndarray) -> np.ndarray:
    """Fine label index (0..8) per image, or −1 when its ``Finding Labels`` is not exactly one of them."""
    table = pd.read_csv(cohort_source, usecols=["Image Index", "Finding Labels"])
    findings = dict(zip(table["Image Index"].astype(str), table["Finding Labels"].fillna(""), strict=True))
    index = {name: k for k, name in enumerate(FINE_CLASSES)}
    return np.array([index.get(findings.get(str(name), ""), -1) for name in image_names], dtype=np.int64)


@dataclass(frozen=True)
class MixedTypeSplit:
    """Row indices into the prepared data: the centre's nested pool per fine class, clients, test."""

    fine: np.ndarray  # per cohort row, −1 outside the task
    centre_pool: np.ndarray  # K × max(n): the centre's first n rows of each class, for every n
    clients: tuple[np.ndarray, ...]
    test: np.ndarray

    def centre_rows(self, n: int) -> np.ndarray:
        return np.sort(self.centre_pool[:, :n].ravel())


def mixed_type_split(data: PreparedData, n_max: int, seed: int) -> MixedTypeSplit:
    """The main experiment's split restricted to single-finding rows, minus the centre's pool."""
    fine = single_finding_labels(data.cohort.source, data.cohort.image_names)
    train = np.concatenate(data.split.clients)
    train = train[fine[train] >= 0]
    rng = np.random.default_rng([seed, 0x3E7])
    per_class = [train[fine[train] == k] for k in range(len(FINE_CLASSES))]
    short = {name: len(rows) for name, rows in zip(FINE_CLASSES, per_class, strict=True) if len(rows) < n_max}
    if short:
        raise MixedTypeError(
            f"the centre needs {n_max} training images per class but the split has only {short}; "
            "lower --centre-n or raise --fraction"
        )
    pool = [rng.permutation(rows)[:n_max] for rows in per_class]
    centre_pool = np.stack(pool)
    taken = set(centre_pool.ravel().tolist())
    clients = tuple(
        np.array([r for r in rows if fine[r] >= 0 and r not in taken], dtype=np.int64)
        for rows in data.split.clients
    )
    if any(len(c) == 0 for c in clients):
        raise MixedTypeError("a client has no single-finding image left; raise --fraction")
    test = data.split.test[fine[data.split.test] >= 0]
    return MixedTypeSplit(fine=fine, centre_pool=centre_pool, clients=clients, test=test)


def prevalence_priors(fine: np.ndarray) -> np.ndarray:
    """The fine classes' frequencies among the single-finding rows of the (public) label table."""
    counts = np.bincount(fine[fine >= 0], minlength=len(FINE_CLASSES)).astype(np.float64)
    return counts / counts.sum()


def uniform_priors() -> np.ndarray:
    return np.full(len(FINE_CLASSES), 1.0 / len(FINE_CLASSES))


# ----------------------------------------------------------------------------------------------
# The experiment
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MixedTypeConfig:
    centre_n: tuple[int, ...] = DEFAULT_CENTRE_N
    seed: int = 0
    gamma: float = 1.0
    n_clients: int = 8
    split: SplitBy = "image"
    fraction: float = 1.0
    dim: int = 1024
    secure: str = "mask"
    threshold: int | None = None
    min_group_size: int = 1
    images: ImageSource | None = None
    fedmt: FedMTConfig = field(default_factory=FedMTConfig)

    def validate(self) -> None:
        if not self.centre_n or any(not isinstance(n, int) or n < 1 for n in self.centre_n):
            raise MixedTypeError(f"centre sizes must be positive integers, got {self.centre_n}")
        if not 0 < self.fedmt.xi < 1:
            raise MixedTypeError(f"ξ must lie strictly between 0 and 1, got {self.fedmt.xi}")
        if self.secure not in ("none", "mask"):
            raise MixedTypeError(f"secure must be 'none' or 'mask', got {self.secure!r}")
        if not self.gamma > 0:
            raise MixedTypeError(f"gamma must be positive, got {self.gamma}")


@dataclass(frozen=True)
class MixedTypeResult:
    config: MixedTypeConfig
    dataset: Mapping[str, object]
    sizes: Mapping[str, object]  # rows of the centre pool, clients and test; class counts
    scores: Mapping[int, Mapping[str, Mapping[str, float]]]  # n -> method -> accuracy / balanced
    fedmt_estimate: Mapping[int, Mapping[str, object]]  # n -> M̂'s error and participation
    aggregation: Mapping[str, object]  # protection, audit lines, bytes
    seconds: Mapping[str, float]
    notice: str


def accuracy_scores(fine_true: np.ndarray, scores: np.ndarray) -> dict[str, float]:
    """Accuracy and balanced accuracy (mean per-class recall over the classes present) of argmax."""
    predicted = np.argmax(scores, axis=1)
    recalls = [float(np.mean(predicted[fine_true == k] == k)) for k in np.unique(fine_true)]
    return {"accuracy": float(np.mean(predicted == fine_true)), "balanced_accuracy": float(np.mean(recalls))}


def _aggregate_clients(
    contributions: dict[str, dict[str, dict[str, np.ndarray]]], config: MixedTypeConfig
) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, object]]:
    if config.secure == "none":
        return sum_contributions(contributions.values()), {"protection": "none", "warnings": []}
    from secure_afl.core.errors import ProtocolError
    from secure_afl.sim.secure import secure_aggregate

    try:
        result = secure_aggregate(
            contributions,
            symmetric=("gram",),
            threshold=config.threshold,
            min_group_size=config.min_group_size,
        )
    except (ProtocolError, ValueError) as exc:
        raise MixedTypeError(f"secure aggregation failed: {exc}") from exc
    sent = {c: sum(r.values()) for c, r in result.costs.bytes_sent.items()}
    return {g: dict(t) for g, t in result.sums.items()}, {
        "protection": "mask",
        "members": {g: list(m) for g, m in result.members.items()},
        "survivors": {g: list(s) for g, s in result.survivors.items()},
        "warnings": list(result.warnings),
        "bytes_sent_per_client": sent,
    }


def _rounds_progress(report: Progress, task: str, total: int) -> Callable[[int], None]:
    return lambda done: report(task, done, total)


def run_mixed_type(config: MixedTypeConfig, *, progress: Progress | None = None) -> MixedTypeResult:
    """Prepare the data once, aggregate the clients' soft-target statistics once, sweep the centre's n."""
    config.validate()
    report = progress or (lambda task, done, total: None)
    seconds: dict[str, float] = {}

    def timed(name: str, started: float) -> None:
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - started

    started = time.perf_counter()
    request = DataRequest(config.fraction, config.dim, config.seed, config.n_clients, config.split)
    data = request.prepare(config.images, report)
    split = mixed_type_split(data, max(config.centre_n), config.seed)
    m = correspondence_matrix()
    priors = {"prevalence": prevalence_priors(split.fine), "uniform": uniform_priors()}
    coarse_by_client = [coarse_of(split.fine[rows], m) for rows in split.clients]
    timed("data", started)

    started = time.perf_counter()
    contributions = {
        f"client-{k}": soft_target_contributions(
            data.features[rows], {p: soft_targets(coarse, m, priors[p]) for p in PRIORS}
        )
        for k, (rows, coarse) in enumerate(zip(split.clients, coarse_by_client, strict=True))
    }
    timed("statistics", started)
    started = time.perf_counter()
    sums, aggregation = _aggregate_clients(contributions, config)
    aggregation["upload_bytes_per_client_plain"] = int(
        8 * sum(v.size for v in next(iter(contributions.values()))[ALL_GROUP].values())
    )
    timed("aggregation", started)

    test_x = data.features[split.test]
    test_fine = split.fine[split.test]
    scores: dict[int, dict[str, dict[str, float]]] = {}
    estimate_log: dict[int, dict[str, object]] = {}
    steps = client_steps_per_round(split.clients, config.fedmt.batch_size)
    for n in sorted(config.centre_n):
        centre = split.centre_rows(n)
        one_hot = np.eye(len(FINE_CLASSES))[split.fine[centre]]
        centre_stats = soft_target_contributions(data.features[centre], {"one_hot": one_hot})[ALL_GROUP]
        started = time.perf_counter()
        per_method: dict[str, np.ndarray] = {}
        centre_coef = solve_soft_ridge(
            centre_stats["gram"], centre_stats[target_tensor("one_hot")], config.gamma
        )
        per_method[CENTRE_RIDGE] = ridge_scores(centre_coef, test_x)
        for prior in PRIORS:
            coef = solve_soft_ridge(
                sums[ALL_GROUP]["gram"] + centre_stats["gram"],
                sums[ALL_GROUP][target_tensor(prior)] + centre_stats[target_tensor("one_hot")],
                config.gamma,
            )
            per_method[ANALYTIC[prior]] = ridge_scores(coef, test_x)
            if prior == "prevalence":
                # B's intercept row is Σ_i t_i, the federation's soft mass per fine class (no extra
                # upload): dividing the scores by it trades accuracy for balanced accuracy.
                mass = (sums[ALL_GROUP][target_tensor(prior)] + centre_stats[target_tensor("one_hot")])[-1]
                per_method[ANALYTIC_BALANCED] = per_method[ANALYTIC[prior]] / mass
        timed("solve", started)
        started = time.perf_counter()
        fedmt = dataclasses.replace(config.fedmt, seed=config.seed + n)
        single, _ = train_fedmt(
            data.features, centre, split.fine[centre], [], [], m, fedmt, steps_per_round=steps
        )
        per_method[CENTRE_GRADIENT] = single.predict_proba(test_x)
        known, _ = train_fedmt(
            data.features,
            centre,
            split.fine[centre],
            split.clients,
            coarse_by_client,
            m,
            fedmt,
            progress=_rounds_progress(report, f"FedMT (M known), n={n}", fedmt.rounds),
        )
        per_method[FEDMT_KNOWN] = known.predict_proba(test_x)
        estimated, trace = train_fedmt(
            data.features,
            centre,
            split.fine[centre],
            split.clients,
            coarse_by_client,
            None,
            fedmt,
            true_m=m,
            progress=_rounds_progress(report, f"FedMT (M estimated), n={n}", fedmt.rounds),
        )
        per_method[FEDMT_ESTIMATED] = estimated.predict_proba(test_x)
        timed("fedmt", started)
        scores[n] = {name: accuracy_scores(test_fine, per_method[name]) for name in METHODS}
        estimate_log[n] = {
            "clients_per_round": list(trace.participants),
            "final_max_abs_error": trace.m_error[-1] if trace.m_error else float("nan"),
            "rounds_with_estimate": int(sum(p > 0 for p in trace.participants)),
        }
    notice = ""
    if data.description.get("synthetic_features"):
        from secure_afl.sim.setting import SYNTHETIC_NOTICE

        notice = SYNTHETIC_NOTICE
    counts = np.bincount(split.fine[split.fine >= 0], minlength=len(FINE_CLASSES))
    sizes = {
        "task_rows": int((split.fine >= 0).sum()),
        "class_counts": dict(zip(FINE_CLASSES, counts.tolist(), strict=True)),
        "centre_rows": {n: int(n * len(FINE_CLASSES)) for n in sorted(config.centre_n)},
        "client_rows": [len(c) for c in split.clients],
        "test_rows": len(split.test),
        "priors": {p: dict(zip(FINE_CLASSES, v.round(6).tolist(), strict=True)) for p, v in priors.items()},
    }
    return MixedTypeResult(
        config=config,
        dataset=data.description,
        sizes=sizes,
        scores=scores,
        fedmt_estimate=estimate_log,
        aggregation=aggregation,
        seconds=seconds,
        notice=notice,
    )


# ----------------------------------------------------------------------------------------------
# Reports: table, results.json, report.md, figure
# ----------------------------------------------------------------------------------------------


def results_rows(result: MixedTypeResult, metric: str = "accuracy") -> tuple[list[str], list[list[str]]]:
    ns = sorted(result.scores)
    header = ["Method", *(f"n={n}" for n in ns)]
    rows = [[name, *(f"{100 * result.scores[n][name][metric]:.2f}" for n in ns)] for name in METHODS]
    return header, rows


def grouping_rows() -> tuple[list[str], list[list[str]]]:
    return ["Coarse class (clients)", "Fine classes (centre, desired)"], [
        [name, ", ".join(members)] for name, members in COARSE_GROUPS
    ]


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def print_mixed_type_report(result: MixedTypeResult, console: Console) -> None:
    """The console report: notice, label spaces, accuracy and balanced accuracy per method and n."""
    if result.notice:
        console.print(f"[bold yellow]{result.notice}[/]")
    tables = [("Label spaces: coarse (clients) and fine (centre)", *grouping_rows())]
    for metric, title in (("accuracy", "Accuracy (%)"), ("balanced_accuracy", "Balanced accuracy (%)")):
        tables.append((f"{title} against the centre's images per class n", *results_rows(result, metric)))
    from secure_afl.sim.report import rich_table

    for title, header, rows in tables:
        console.print(rich_table(title, header, rows))
    for line in result.aggregation.get("warnings", []):
        console.print(f"[bold red]WARNING: {line}[/]")


def write_figure(result: MixedTypeResult, path: Path) -> Path:
    """Accuracy and balanced accuracy against the centre's images per class, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted(result.scores)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, label in zip(
        axes, ("accuracy", "balanced_accuracy"), ("accuracy (%)", "balanced accuracy (%)"), strict=True
    ):
        for name in METHODS:
            ax.plot(ns, [100 * result.scores[n][name][metric] for n in ns], marker="o", label=name)
        ax.set_xscale("log")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("fine-labelled images per class at the centre (n)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="lower right")
    title = "Mixed-type labels (FedMT's setting), ChestXray14 single-finding images"
    if result.notice:
        title += " — SYNTHETIC FEATURES"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def to_json(result: MixedTypeResult) -> dict[str, object]:
    config = asdict(result.config)
    config["images"] = (
        None if result.config.images is None else {k: str(v) for k, v in asdict(result.config.images).items()}
    )
    return {
        "scenario": "mixed-type",
        "notice": result.notice,
        "config": config,
        "dataset": dict(result.dataset),
        "fine_classes": list(FINE_CLASSES),
        "coarse_groups": {name: list(members) for name, members in COARSE_GROUPS},
        "correspondence_matrix": correspondence_matrix().tolist(),
        "sizes": result.sizes,
        "scores": {str(n): v for n, v in result.scores.items()},
        "fedmt_estimate": {str(n): v for n, v in result.fedmt_estimate.items()},
        "aggregation": result.aggregation,
        "seconds_per_phase": dict(result.seconds),
    }


def write_mixed_type_reports(result: MixedTypeResult, out_dir: Path) -> tuple[Path, Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps(to_json(result), indent=2, default=_json_default))
    figure = write_figure(result, out_dir / "mixed_type.png")
    lines = ["# secure-afl sim --scenario mixed-type", ""]
    if result.notice:
        lines += [f"**{result.notice}**", ""]
    lines += [
        "FedMT's setting: a centre labels n images per class in the 9 fine classes, 8 clients label "
        "their single-finding images in 5 coarse classes (grouping below; secure_afl/sim/mixed_type.py "
        "documents its source).",
        "",
        _md_table(*grouping_rows()),
        "",
        "## Accuracy (%) on the single-finding test images",
        "",
        _md_table(*results_rows(result, "accuracy")),
        "",
        "## Balanced accuracy (%, mean per-class recall)",
        "",
        _md_table(*results_rows(result, "balanced_accuracy")),
        "",
        f"![accuracy against n]({figure.name})",
        "",
        f"Rows: {result.sizes['task_rows']} single-finding images; test {result.sizes['test_rows']}; "
        f"clients {result.sizes['client_rows']}.",
        f"Client statistics protected by: {result.aggregation['protection']}.",
        *(f"WARNING: {w}" for w in result.aggregation.get("warnings", [])),
    ]
    md_path = out_dir / "report.md"
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path, figure


def _json_default(value: object) -> object:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value)}")
