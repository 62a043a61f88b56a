"""The experiment: cohort → features → clients → statistics → aggregation → solve → metrics.

Every missing setting uses the same split, clients and features; only the label assignment
changes.  The AFL variants of one setting share one aggregation: each client's statistics are
computed once (they do not depend on the labels' balancing) and every variant's tensors are summed
together, in the clear (``secure="none"``), through the masking protocol (``secure="mask"``), CKKS
encryption (``secure="ckks"``) or both (``secure="mask,ckks"``: the first backend's sums fit the
reported models, the second's are fitted too and its costs sit beside the first's).
"""

from __future__ import annotations

import hashlib
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
from threadpoolctl import threadpool_limits

from secure_afl.analytic import (
    ALL_GROUP,
    PSEUDO_TENSOR,
    PSEUDO_TENSOR_RESCALED,
    AnalyticClassifier,
    ClientStatistics,
    Contributions,
    GramFactors,
    PseudoLabelConfig,
    PseudoLabelReport,
    PseudoScoreRule,
    StatisticsError,
    UndefinedBalanceWarning,
    class_group,
    client_statistics,
    fit_together,
    pseudo_label_rounds,
    sum_contributions,
    uploaded_by,
)
from secure_afl.privacy.dp import DpConfig, check_pseudo_label_threshold
from secure_afl.privacy.policy import ClientPolicy, LayoutRefusal, layout_refusals
from secure_afl.sim.audit import PrivacyAudit, audit_groups, restrict
from secure_afl.sim.baselines import BASELINES as TABLE2_BASELINES
from secure_afl.sim.baselines import BaselineConfig
from secure_afl.sim.data import CLASSES, N_CLIENTS, SplitBy
from secure_afl.sim.datasets import DataRequest, ImageSource, PreparedData, PreparingData, Progress
from secure_afl.sim.fedavg import FedAvgConfig
from secure_afl.sim.gradient import GradientMethods
from secure_afl.sim.methods import FEDAVG, FEDNCA
from secure_afl.sim.metrics import Metrics, evaluate
from secure_afl.sim.partial import LabelAssignment, Missing1Draw, PartialLabelError, assign_partial_labels
from secure_afl.torch_threads import one_torch_thread

Secure = Literal["none", "mask", "ckks", "mask,ckks"]
SECURE_CHOICES = ("none", "mask", "ckks", "mask,ckks")
DropoutStage = Literal["R1", "R2", "R3"]
SYMMETRIC_TENSORS = ("gram",)

AFL_1 = "AFL (1 round)"
AFL_2 = "AFL (2 rounds)"
AFL_2_RESCALED = "AFL (2 rounds, rescaled τ)"
AFL_GLOBAL_BALANCE = "AFL (global balance)"
AFL_GLOBAL_GRAM = "AFL (global Gram)"
BASELINES = (*TABLE2_BASELINES, FEDNCA)  # the extra gradient methods --baselines can add
METHOD_UPLOADS = {
    AFL_1: uploaded_by(),
    AFL_2: uploaded_by(round2=True),
    # the rescaled τ also needs the class groups' positive and row counts and feature sums
    AFL_2_RESCALED: lambda group, tensor: (
        uploaded_by(round2=True, pseudo_tensor=PSEUDO_TENSOR_RESCALED)(group, tensor)
        or uploaded_by(balance="global")(group, tensor)
    ),
    AFL_GLOBAL_BALANCE: uploaded_by(balance="global"),
    AFL_GLOBAL_GRAM: uploaded_by(gram="global"),
}

SYNTHETIC_NOTICE = (
    "FEATURES ARE SYNTHETIC: the embedded dataset pairs the real ChestXray14 labels and patient ids "
    "with seeded synthetic features (secure_afl/sim/synthetic.py). The numbers show how the methods "
    "behave on the real label structure, not how well chest X-rays can be classified."
)


class ExperimentError(ValueError):
    """A configuration the experiment cannot run (e.g. a class with no surviving annotator)."""


def client_id(k: int) -> str:
    return f"client-{k}"


@dataclass(frozen=True)
class SimConfig:
    missing: tuple[int, ...] = (7,)
    rounds: int = 2
    seed: int = 0
    gamma: float = 1.0
    n_clients: int = N_CLIENTS
    split: SplitBy = "image"
    missing1: Missing1Draw = "permutation"  # "random": the draw used before (|S_c| 3..8 at missing 1)
    fraction: float = 1.0
    dim: int = 1024
    secure: Secure = "mask"
    dropout: int = 0
    dropout_stage: DropoutStage = "R2"
    threshold: int | None = None
    min_group_size: int = 1
    # Whose refusals the report shows: "deployment" adds, per method, what clients under
    # ClientPolicy.deployment() would refuse; the run's own clients always use the simulator's policy.
    client_policy: str = "simulator"
    ckks_poly_degree: int = 8192  # CKKS ring degree N (8192 or 16384)
    device: str = "auto"
    images: ImageSource | None = None  # None: the embedded dataset (synthetic features)
    dp: DpConfig | None = None  # differential privacy (secure_afl/sim/dp_run.py); None: off
    pseudo: PseudoLabelConfig = field(default_factory=PseudoLabelConfig)
    fedavg: FedAvgConfig = field(default_factory=FedAvgConfig)
    baselines: tuple[str, ...] = ()  # names from BASELINES, trained after FedAvg
    baseline: BaselineConfig = field(default_factory=BaselineConfig)  # Table II baselines' settings

    def validate(self) -> None:
        for m in self.missing:
            if not isinstance(m, int) or not 0 <= m < len(CLASSES):
                raise PartialLabelError(
                    f"unknown missing level {m!r}: use 1, 3, 5, 7 or 'all' "
                    f"(any integer 0..{len(CLASSES) - 1})"
                )
        if self.missing1 not in ("permutation", "random"):
            raise ExperimentError(f"missing1 must be 'permutation' or 'random', got {self.missing1!r}")
        if self.rounds not in (1, 2):
            raise ExperimentError(f"rounds must be 1 or 2, got {self.rounds}")
        if not 0 < self.fraction <= 1:
            raise ExperimentError(f"fraction must lie in (0, 1], got {self.fraction}")
        if self.secure not in SECURE_CHOICES:
            raise ExperimentError(f"secure must be one of {', '.join(SECURE_CHOICES)}, got {self.secure!r}")
        if self.ckks_poly_degree not in (8192, 16384):
            raise ExperimentError(f"the CKKS ring degree must be 8192 or 16384, got {self.ckks_poly_degree}")
        if not 0 <= self.dropout < self.n_clients:
            raise ExperimentError(f"dropout must be from 0 to {self.n_clients - 1}, got {self.dropout}")
        if self.threshold is not None and not 1 <= self.threshold <= self.n_clients:
            raise ExperimentError(
                f"threshold must be from 1 to {self.n_clients} (the clients), got {self.threshold}"
            )
        if self.min_group_size < 1:
            raise ExperimentError(f"min_group_size must be at least 1, got {self.min_group_size}")
        if self.client_policy not in ("simulator", "deployment"):
            raise ExperimentError(
                f"client policy must be simulator or deployment, got {self.client_policy!r}"
            )
        unknown = [b for b in self.baselines if b not in BASELINES]
        if unknown:
            raise ExperimentError(f"unknown baselines {unknown}: choose from {', '.join(BASELINES)}")
        if self.dropout_stage not in ("R1", "R2", "R3"):
            raise ExperimentError(f"dropout stage must be R1, R2 or R3, got {self.dropout_stage!r}")
        if self.dp is not None:
            self.dp.validate()
            if self.rounds == 2:  # the noise's sensitivity needs disjoint pseudo-label sets
                check_pseudo_label_threshold(self.pseudo.tau)
            if self.secure not in ("none", "mask"):
                raise ExperimentError(
                    f"differential privacy adds its noise inside the masking protocol (or in the clear), "
                    f"not under --secure {self.secure}; use --secure mask or none with it"
                )


@dataclass
class PhaseTimer:
    """Wall seconds per named phase, summed over the run."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


@dataclass(frozen=True)
class SettingResult:
    missing: int
    assignment: LabelAssignment
    metrics: Mapping[str, Metrics]
    dropped: tuple[str, ...]
    upload_bytes: Mapping[str, int]  # per client, all rounds
    audit: PrivacyAudit  # everything this run summed: all compared methods in one session
    method_audits: Mapping[str, PrivacyAudit]  # what each method alone would have revealed
    pseudo_labels: tuple[tuple[str, PseudoLabelReport], ...]
    protocol_costs: Mapping[str, object] | None = None
    privacy: Mapping[str, object] | None = None  # differential privacy: ε spent, noise, clipping
    # method -> what clients under the deployment policy would refuse (only with client_policy="deployment")
    client_refusals: Mapping[str, tuple[LayoutRefusal, ...]] = field(default_factory=dict)
    # the rescaled-τ variant of round 2 (same clients and classes as pseudo_labels)
    pseudo_labels_rescaled: tuple[tuple[str, PseudoLabelReport], ...] = ()
    # (client, class, "no positive" | "no negative"): Eq. 9 undefined for a labelled class at a client;
    # client "S_c" when the class has no positive (or no negative) across all its annotators
    undefined_balance: tuple[tuple[str, int, str], ...] = ()
    # wall seconds per gradient method (on its thread or in its worker process, beside AFL)
    method_seconds: Mapping[str, float] = field(default_factory=dict)
    # group -> tensor -> the wire sums it was derived from: a difference plan sent the Gram to `all`
    # and to complement groups instead of to each class group (empty without one)
    sent_by_difference: Mapping[str, Mapping[str, tuple[str, ...]]] = field(default_factory=dict)
    # the Gram copies a client sends, mean over clients: the method's groups and as sent
    gram_copies: Mapping[str, float] = field(default_factory=dict)
    # method -> its fitted W (features × classes): the analytic methods only
    coefs: Mapping[str, np.ndarray] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class ExperimentResult:
    config: SimConfig
    dataset: Mapping[str, object]
    settings: tuple[SettingResult, ...]
    seconds: Mapping[str, float]
    notice: str


def _no_progress(task: str, done: int, total: int) -> None:
    return None


def _dropped_clients(config: SimConfig) -> tuple[str, ...]:
    if not config.dropout:
        return ()
    rng = np.random.default_rng([config.seed, 0xD50])
    return tuple(client_id(k) for k in sorted(rng.choice(config.n_clients, config.dropout, replace=False)))


@dataclass(frozen=True)
class _GroupsSummed:
    """Per group: its members, its surviving members and the tensors summed over them."""

    members: Mapping[str, tuple[str, ...]]
    survivors: Mapping[str, tuple[str, ...]]
    tensors: Mapping[str, tuple[str, ...]]

    def merged(self, other: _GroupsSummed) -> _GroupsSummed:
        return _GroupsSummed(
            {**self.members, **other.members},
            {**self.survivors, **other.survivors},
            {**self.tensors, **other.tensors},
        )


@dataclass(frozen=True)
class _Aggregate:
    sums: Contributions
    method: _GroupsSummed  # the method's own groups (the contributions' names)
    wire: _GroupsSummed  # the groups the server summed: the method's, or a difference plan's
    costs: Mapping[str, object] | None  # the first protection's costs (None in the clear)
    client_findings: Mapping[str, tuple] = field(default_factory=dict)  # what each client's own check saw
    other_sums: Mapping[str, Contributions] = field(default_factory=dict)  # the other backends' sums
    costs_by_protection: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    # group -> tensor -> the wire sums it was derived from (a difference plan; empty without one)
    derived: Mapping[str, Mapping[str, tuple[str, ...]]] = field(default_factory=dict)

    # What the server summed: the audits of a run read these.
    @property
    def members(self) -> Mapping[str, tuple[str, ...]]:
        return self.wire.members

    @property
    def survivors(self) -> Mapping[str, tuple[str, ...]]:
        return self.wire.survivors

    @property
    def tensors(self) -> Mapping[str, tuple[str, ...]]:
        return self.wire.tensors


def _upload_bytes(contributions: Mapping[str, Contributions]) -> dict[str, int]:
    """Bytes each client would upload in the clear: float64 values, symmetric matrices as triangles."""
    out = {}
    for client, groups in contributions.items():
        total = 0
        for tensors in groups.values():
            for name, value in tensors.items():
                square = name in SYMMETRIC_TENSORS and value.ndim == 2  # else a triangle already
                n = value.shape[0] * (value.shape[0] + 1) // 2 if square else value.size
                total += 8 * n
        out[client] = total
    return out


def aggregate(
    contributions: Mapping[str, Contributions],
    config: SimConfig,
    *,
    dropouts: Mapping[str, tuple[str, ...]],
    round_label: str = "1",
    arrays: Mapping[str, np.ndarray] | None = None,
) -> _Aggregate:
    """Per-group sums over the surviving members, in the clear or through the masking protocol.

    Through a protocol, every client binds the session context of this run's config, the round and
    what the server sent for it (``arrays``: round 2's teacher W), as a deployed client binds its
    study's (:func:`secure_afl.protocol.binding.session_context`, the one-view rule)."""
    members: dict[str, list[str]] = {}
    tensors: dict[str, set[str]] = {}
    for client, groups in contributions.items():
        for group, named in groups.items():
            members.setdefault(group, []).append(client)
            tensors.setdefault(group, set()).update(named)
    if config.secure != "none":
        from secure_afl.sim.secure import SecureAggregationResult

        context = simulation_context(config, round_label, arrays)
        runs = {
            name: _protected_sums(name, contributions, config, dropouts, context)
            for name in config.secure.split(",")
        }
        first = next(iter(runs.values()))
        # Under a difference plan (masking, aggregation/difference.py) the Gram travels to `all` and
        # to complement groups: the run's audit lists those wire groups; each method's audit, its
        # own groups (every one stays on the wire with its other tensors and members).
        return _Aggregate(
            sums={g: dict(t) for g, t in first.sums.items()},
            method=_GroupsSummed(
                {g: tuple(m) for g, m in members.items()},
                {g: tuple(first.survivors[g]) for g in members},
                {g: tuple(sorted(t)) for g, t in tensors.items()},
            ),
            wire=_GroupsSummed(
                {g.group: g.members for g in first.audit.groups},
                {g.group: g.survivors for g in first.audit.groups},
                {g.group: g.tensors for g in first.audit.groups},
            ),
            derived=first.derived if isinstance(first, SecureAggregationResult) else {},  # CKKS: no plan
            costs=_costs_dict(first.costs, next(iter(runs))),
            client_findings=first.audit.client_findings,
            costs_by_protection={name: _costs_dict(run.costs, name) for name, run in runs.items()},
            other_sums={name: run.sums for name, run in list(runs.items())[1:]},
        )
    # Plaintext: inputs of clients that dropped before sending them (R1, R2) are absent.
    gone = {c for stage in ("R1", "R2") for c in dropouts.get(stage, ())}
    alive = {c: groups for c, groups in contributions.items() if c not in gone}
    survivors = {g: tuple(c for c in m if c not in gone) for g, m in members.items()}
    groups = _GroupsSummed(
        {g: tuple(m) for g, m in members.items()},
        survivors,
        {g: tuple(sorted(t)) for g, t in tensors.items()},
    )
    return _Aggregate(sums=sum_contributions(alive.values()), method=groups, wire=groups, costs=None)


def simulation_context(config: SimConfig, round_label: str, arrays: Mapping[str, np.ndarray] | None) -> bytes:
    """The one-view session context of a simulated round: the run config (its repr: every field,
    the pseudo-label and DP parameters included), the round and round 2's teacher arrays."""
    from secure_afl.protocol.binding import session_context

    study = hashlib.sha256(repr(config).encode("utf-8")).digest()
    return session_context(study, round_label, arrays)


def _protected_sums(
    protection: str,
    contributions: Mapping[str, Contributions],
    config: SimConfig,
    dropouts: Mapping[str, tuple[str, ...]],
    context: bytes = b"",
):  # -> SecureAggregationResult | CkksAggregationRun
    """Group sums through one protection backend ("mask" or "ckks"); aborts become ExperimentErrors."""
    from secure_afl.core.errors import (
        EncodingOverflowError,
        GroupTooSmallError,
        InsufficientParticipantsError,
        ProtocolError,
    )
    from secure_afl.protocol.ckks.errors import KeyHolderDroppedError, NoDecryptorError

    try:
        if protection == "ckks":
            from secure_afl.protocol.ckks.context import CkksParameters
            from secure_afl.sim.ckks import ckks_aggregate

            return ckks_aggregate(
                contributions,
                symmetric=SYMMETRIC_TENSORS,
                min_group_size=config.min_group_size,
                dropouts=dropouts,
                parameters=CkksParameters(poly_modulus_degree=config.ckks_poly_degree),
                context=context,
            )
        from secure_afl.sim.secure import secure_aggregate

        return secure_aggregate(
            contributions,
            symmetric=SYMMETRIC_TENSORS,
            threshold=config.threshold,
            min_group_size=config.min_group_size,
            dropouts=dropouts,
            context=context,
            unpack=False,  # the Grams' sums stay triangles: the solve unpacks one at a time
        )
    except InsufficientParticipantsError as exc:
        raise ExperimentError(
            f"secure aggregation aborted: {exc}. The protocol needs at least t clients in every round "
            f"(t = {config.threshold or 'a majority'}); lower --dropout"
        ) from exc
    except GroupTooSmallError as exc:
        remedy = (
            "lower --dropout or the missing level (at missing 7 each class has one annotating client)"
            if config.dropout
            else "lower --min-group-size or the missing level"
        )
        raise ExperimentError(
            f"secure aggregation aborted: {exc}. A group kept fewer live members than "
            f"--min-group-size {config.min_group_size}; {remedy}"
        ) from exc
    except KeyHolderDroppedError as exc:
        raise ExperimentError(
            f"CKKS aggregation aborted: {exc}. Every client chosen to generate the key dropped before "
            "sending it (each is replaced while others remain); lower --dropout or use --dropout-stage R2/R3"
        ) from exc
    except NoDecryptorError as exc:
        raise ExperimentError(f"CKKS aggregation aborted: {exc}; lower --dropout") from exc
    except EncodingOverflowError as exc:
        raise ExperimentError(f"a statistic does not fit the fixed-point encoding: {exc}") from exc
    except ProtocolError as exc:
        raise ExperimentError(f"secure aggregation failed ({protection}): {exc}") from exc


def _costs_dict(costs: object, protection: str) -> dict[str, object]:
    """Protocol costs as plain JSON-ready dicts (bytes and seconds per client and round)."""
    names = ("bytes_sent", "bytes_received", "client_seconds", "server_seconds")
    out: dict[str, object] = {
        name: {k: dict(v) if isinstance(v, Mapping) else v for k, v in getattr(costs, name).items()}
        for name in names
    }
    out["protection"] = protection
    return out


def _named_costs(stage: str, costs: Mapping[str, object] | None) -> dict[str, object]:
    """{"round1": costs} for one backend; {"round1 (mask)": ..., "round1 (ckks)": ...} for several."""
    if not costs:
        return {}
    if len(costs) == 1:
        return {stage: next(iter(costs.values()))}
    return {f"{stage} ({name})": value for name, value in costs.items()}


def _check_coverage(agg: _Aggregate, n_classes: int) -> None:
    for c in range(n_classes):
        if not agg.method.survivors.get(class_group(c)):
            raise ExperimentError(
                f"class {CLASSES[c] if c < len(CLASSES) else c} has no surviving annotating client "
                "(every client that labels it dropped out); lower --dropout or the missing level"
            )


def run_setting(
    data: PreparedData,
    stats: Mapping[str, ClientStatistics],
    missing: int,
    config: SimConfig,
    timer: PhaseTimer,
    progress: Progress = _no_progress,
    gradient: GradientMethods | None = None,
    *,
    assignment: LabelAssignment | None = None,
    score: Callable[[str, np.ndarray], Metrics] | None = None,
) -> SettingResult:
    """One setting: the missing level's label assignment (or ``assignment``, which clients label
    which classes, when the caller has its own: a multi-site federation), round 1, round 2, the
    gradient methods and the audit.  ``score(method, logits)`` gives a method's metrics on the test
    rows (default: every test row counts for every class)."""
    if config.dp is not None:
        if assignment is not None or score is not None:
            raise ExperimentError("differential privacy runs the partial-label protocol's assignment only")
        from secure_afl.sim.dp_run import run_private_setting

        return run_private_setting(data, missing, config, timer, progress)
    n_classes = data.cohort.labels.shape[1]
    if assignment is None:
        assignment = assign_partial_labels(
            config.n_clients, n_classes, missing, seed=config.seed, missing1=config.missing1
        )
    elif assignment.n_clients != config.n_clients or assignment.n_classes != n_classes:
        raise ExperimentError(
            f"the assignment covers {assignment.n_clients} clients and {assignment.n_classes} classes; "
            f"the run has {config.n_clients} clients and {n_classes} classes"
        )
    clients = [client_id(k) for k in range(config.n_clients)]
    undefined = _undefined_balance(stats, clients, assignment)
    dropped = _dropped_clients(config)
    dropouts = {config.dropout_stage: dropped} if dropped else {}
    test_y = data.cohort.labels[data.split.test]
    if score is None:

        def score(method: str, logits: np.ndarray) -> Metrics:
            return evaluate(test_y, logits, kind="logits")

    with timer.phase("statistics"), warnings.catch_warnings():
        # reported per setting (undefined_balance), not as one Python warning per client
        warnings.simplefilter("ignore", UndefinedBalanceWarning)
        round1 = {}
        for k, name in enumerate(clients):
            mine = stats[name].contributions(assignment.active[k], balance="client", include_global_gram=True)
            balanced_globally = stats[name].contributions(assignment.active[k], balance="global")
            for group, tensors in balanced_globally.items():
                mine[group].update(tensors)
            round1[name] = mine
    with timer.phase("aggregation"):
        agg = aggregate(round1, config, dropouts=dropouts)
    _check_coverage(agg, n_classes)
    with timer.phase("solve"), warnings.catch_warnings():
        warnings.simplefilter("ignore", UndefinedBalanceWarning)
        models, factors = _round1_models(agg.sums, n_classes, config.gamma, config.rounds)
    afl = models[AFL_1]
    # With several protections, the others' sums fit the same models, reported as "<method> via <name>".
    other_models: dict[str, AnalyticClassifier] = {}
    other_factors: dict[str, GramFactors] = {}
    with timer.phase("solve"):
        for name, sums in agg.other_sums.items():
            fitted, other_factors[name] = _round1_models(sums, n_classes, config.gamma, config.rounds)
            other_models.update({f"{method} via {name}": model for method, model in fitted.items()})

    upload = _upload_bytes(round1)
    pseudo_reports: list[tuple[str, PseudoLabelReport]] = []
    rescaled_reports: list[tuple[str, PseudoLabelReport]] = []
    method_groups, wire_groups = agg.method, agg.wire
    sent_by_difference = dict(agg.derived)
    costs = _named_costs("round1", agg.costs_by_protection) or None
    findings = {c: tuple(f) for c, f in agg.client_findings.items()}
    round2: dict[str, Contributions] = {}
    if config.rounds == 2:
        # A client that dropped at any stage of round 1 is offline: round 2 goes on without it.
        live = [c for c in clients if c not in dropped]
        # The rescaled-τ variant: the server sends the round-1 scores rescaled so that ±1 are the mean
        # training scores of S_c's labelled positives / negatives; clients apply Eq. 19 unchanged.
        rescaled = _rescaled_or_none(afl, agg.sums)
        rules = [PseudoScoreRule(afl.coef_, None, PSEUDO_TENSOR)]
        if rescaled is not None:
            rules.append(PseudoScoreRule(rescaled[0], rescaled[1], PSEUDO_TENSOR_RESCALED))
        with timer.phase("statistics"):
            for name in live:
                k = clients.index(name)
                round2[name], reports = pseudo_label_rounds(
                    data.features[data.split.clients[k]],
                    rules,
                    assignment.active[k],
                    config=config.pseudo,
                    device=config.device,
                )
                pseudo_reports.extend((name, r) for r in reports[PSEUDO_TENSOR])
                rescaled_reports.extend((name, r) for r in reports.get(PSEUDO_TENSOR_RESCALED, []))
        with timer.phase("aggregation"):
            teacher = {"coef": afl.coef_}
            if rescaled is not None:
                teacher.update({"rescaled/coef": rescaled[0], "rescaled/offset": rescaled[1]})
            agg2 = aggregate(round2, config, dropouts={}, round_label="2", arrays=teacher)
        with timer.phase("solve"), warnings.catch_warnings():
            warnings.simplefilter("ignore", UndefinedBalanceWarning)
            models[AFL_2] = AnalyticClassifier(n_classes, gamma=config.gamma).refine(
                agg.sums, agg2.sums, alpha=config.pseudo.alpha, pseudo_tensor=PSEUDO_TENSOR, factors=factors
            )
            for name, sums2 in agg2.other_sums.items():
                refined = AnalyticClassifier(n_classes, gamma=config.gamma)
                other_models[f"{AFL_2} via {name}"] = refined.refine(
                    agg.other_sums[name], sums2, alpha=config.pseudo.alpha, factors=other_factors[name]
                )
            if rescaled is not None:
                models[AFL_2_RESCALED] = AnalyticClassifier(n_classes, gamma=config.gamma).refine(
                    agg.sums,
                    agg2.sums,
                    alpha=config.pseudo.alpha,
                    pseudo_tensor=PSEUDO_TENSOR_RESCALED,
                    factors=factors,
                )
        for name, size in _upload_bytes(round2).items():
            upload[name] += size
        method_groups, wire_groups = method_groups.merged(agg2.method), wire_groups.merged(agg2.wire)
        sent_by_difference.update(agg2.derived)
        for client, seen in agg2.client_findings.items():
            findings[client] = findings.get(client, ()) + tuple(seen)
        if costs is not None:
            costs.update(_named_costs("round2", agg2.costs_by_protection))

    with timer.phase("metrics"):
        # AUC and AP rank the scores (logits); BACC counts each method's decisions, score > 0
        # (= σ(score) > 0.5, what predict() returns).  AFL's first: the gradient methods may still train.
        test_x = data.features[data.split.test].astype(np.float64)  # once, not per method
        metrics = {name: score(name, model.decision_function(test_x)) for name, model in models.items()}
        for name, model in other_models.items():
            metrics[name] = score(name, model.decision_function(test_x))
    uploads = {c: {**groups, **round2.get(c, {})} for c, groups in round1.items()}
    # The run's audit is of the groups the server summed; each method's, of its own groups alone
    # (a difference plan's wire sums span the same as the method's, SECURITY.md §4).
    audit = audit_groups(
        protection=config.secure,
        members=wire_groups.members,
        survivors=wire_groups.survivors,
        tensors=wire_groups.tensors,
        contributions=uploads,
        client_findings=findings,
    )
    methods_audit = (
        audit
        if wire_groups == method_groups
        else audit_groups(
            protection=config.secure,
            members=method_groups.members,
            survivors=method_groups.survivors,
            tensors=method_groups.tensors,
            contributions=uploads,
        )
    )
    method_audits = {
        method: restrict(methods_audit, keep, contributions=uploads)
        for method, keep in METHOD_UPLOADS.items()
        if method in models
    }
    refusals = {}
    if config.client_policy == "deployment":
        deployment = ClientPolicy.deployment()
        refusals = {
            method: layout_refusals(
                {g.group: g.members for g in a.groups},
                {g.group: g.tensors for g in a.groups},
                {g.group: g.survivors for g in a.groups},
                policy=deployment,
            )
            for method, a in method_audits.items()
        }
    # FedAvg and the baselines: training since the data were ready, beside AFL (sim/gradient.py), on the
    # same rows, features and label assignment
    jobs = gradient or _gradient_methods(data, config, {missing: assignment}, workers=0)
    with timer.phase("gradient methods (wait)"):
        heads, method_seconds = jobs.collect(
            missing,
            progress=lambda done, total: progress(f"gradient methods, missing {missing}", done, total),
        )
    if gradient is None:
        jobs.close()
    extra: dict[str, np.ndarray] = {}
    if FEDNCA in config.baselines:
        from secure_afl.sim.fednca import FedNCAConfig, fednca_scores

        with timer.phase("baselines"):
            nca = FedNCAConfig(rounds=config.fedavg.rounds, seed=config.seed, device=config.device)
            extra[FEDNCA] = fednca_scores(  # logits: metrics rank scores
                data,
                assignment.active,
                nca,
                progress=lambda done: progress(f"FedNCA-ML, missing {missing}", done, nca.rounds),
            )
    with timer.phase("metrics"):
        for name, trained in heads.items():
            metrics[name] = score(name, trained.decision_function(test_x))
        metrics.update({name: score(name, scores) for name, scores in extra.items()})
    order = (AFL_1, AFL_2, AFL_2_RESCALED, AFL_GLOBAL_BALANCE, AFL_GLOBAL_GRAM, FEDAVG, *BASELINES)
    ordered = {m: metrics[m] for m in order if m in metrics}
    ordered.update({m: metrics[m] for m in sorted(other_models)})
    return SettingResult(
        missing=missing,
        assignment=assignment,
        metrics=ordered,
        dropped=dropped,
        upload_bytes=upload,
        audit=audit,
        method_audits=method_audits,
        pseudo_labels=tuple(pseudo_reports),
        protocol_costs=costs,
        client_refusals=refusals,
        sent_by_difference=sent_by_difference,
        gram_copies={"method": _copies(method_groups, "gram"), "sent": _copies(wire_groups, "gram")},
        pseudo_labels_rescaled=tuple(rescaled_reports),
        undefined_balance=undefined,
        method_seconds=method_seconds,
        coefs={name: model.coef_ for name, model in models.items() if model.coef_ is not None},
    )


def _copies(groups: _GroupsSummed, tensor: str) -> float:
    """How many groups a client sends ``tensor`` to, mean over the clients in any group."""
    clients = {c for members in groups.members.values() for c in members}
    copies = sum(len(groups.members[g]) for g, tensors in groups.tensors.items() if tensor in tensors)
    return copies / max(1, len(clients))


def _round1_models(
    sums: Contributions, n_classes: int, gamma: float, rounds: int = 2
) -> tuple[dict[str, AnalyticClassifier], GramFactors]:
    """AFL and its global-balance and global-Gram variants on one set of sums, fitted one Gram at a
    time (each class's factor serves both models that use it, then goes), and the factors round
    2's refinements reuse (the global Gram's, kept only when there is a round 2)."""
    factors = GramFactors(sums, gamma, keep=(ALL_GROUP,) if rounds == 2 else ())
    models = {
        AFL_1: AnalyticClassifier(n_classes, gamma=gamma),
        AFL_GLOBAL_BALANCE: AnalyticClassifier(n_classes, gamma=gamma, balance="global"),
        AFL_GLOBAL_GRAM: AnalyticClassifier(n_classes, gamma=gamma, gram="global"),
    }
    fit_together(list(models.values()), sums, factors=factors)
    return models, factors


def _rescaled_or_none(model: AnalyticClassifier, sums: Contributions) -> tuple[np.ndarray, np.ndarray] | None:
    """The rescaled round-1 scores, or None when a class's mean training scores are undefined."""
    try:
        return model.rescaled_scores(sums)
    except StatisticsError:
        return None


def _undefined_balance(
    stats: Mapping[str, ClientStatistics], clients: list[str], assignment: LabelAssignment
) -> tuple[tuple[str, int, str], ...]:
    """Where Eq. 9 is undefined: per (client, labelled class), and per class across S_c."""
    out = []
    for k, name in enumerate(clients):
        out += [(name, c, why) for c, why in stats[name].undefined_classes(assignment.active[k]).items()]
    for c, members in enumerate(assignment.coverage()):
        n_pos = sum(int(stats[clients[k]].n_pos[c]) for k in members)
        n = sum(stats[clients[k]].n for k in members)
        if members and n_pos in (0, n):
            out.append(("S_c", c, "no positive" if n_pos == 0 else "no negative"))
    return tuple(out)


def _assignments(data: PreparedData, config: SimConfig) -> dict[int, LabelAssignment]:
    n_classes = data.cohort.labels.shape[1]
    return {
        m: assign_partial_labels(config.n_clients, n_classes, m, seed=config.seed, missing1=config.missing1)
        for m in config.missing
    }


def _gradient_methods(
    data: PreparedData,
    config: SimConfig,
    assignments: Mapping[int, LabelAssignment] | None = None,
    *,
    workers: int | None = None,
) -> GradientMethods:
    """FedAvg and the baselines of ``assignments``' levels (default: every level; none under DP)."""
    if assignments is None:
        assignments = _assignments(data, config) if config.dp is None else {}
    return GradientMethods(
        data.features,
        [data.cohort.labels[rows] for rows in data.split.clients],
        {m: a.active for m, a in assignments.items()},
        fedavg=config.fedavg,
        baselines=tuple(b for b in config.baselines if b in TABLE2_BASELINES),
        baseline=config.baseline,
        workers=workers,
        client_rows=data.split.clients,
        fork_ok=config.images is None,  # real images ran a backbone (MKL, OpenMP) in this process
    )


def data_request(config: SimConfig) -> DataRequest | None:
    """What :class:`PreparingData` needs to prepare this run's data early (None: real images)."""
    if config.images is not None:
        return None
    return _request(config)


def _request(config: SimConfig) -> DataRequest:
    return DataRequest(config.fraction, config.dim, config.seed, config.n_clients, config.split)


def run_experiment(
    config: SimConfig,
    *,
    progress: Progress = _no_progress,
    preparing: PreparingData | None = None,
) -> ExperimentResult:
    """The experiment; ``preparing``: this configuration's embedded data, already being prepared."""
    config.validate()
    if preparing is not None and preparing.request != data_request(config):
        raise ExperimentError(
            f"the data being prepared ({preparing.request}) are not this configuration's "
            f"({data_request(config)}); start PreparingData with data_request(config)"
        )
    timer = PhaseTimer()
    if preparing is not None:
        data, timer.seconds["data"] = preparing.result()
    else:
        with timer.phase("data"):
            images = config.images
            if images is not None and FEDNCA in config.baselines:
                images = replace(images, spatial=True)  # FedNCA-ML attends over the pre-pooling map
            data = _request(config).prepare(images, progress)
    # FedAvg and the baselines start training now (sim/gradient.py), beside the statistics.  Every
    # torch product of the run uses one thread (the other core trains them), and so does numpy's
    # BLAS (the Grams) while they train; results do not depend on the thread counts.
    with (
        one_torch_thread(),
        _gradient_methods(data, config) as gradient,
        threadpool_limits(1, user_api="blas") if gradient.mode != "inline" else nullcontext(),
    ):
        with timer.phase("statistics"), ThreadPoolExecutor(gradient.statistics_threads) as pool:
            # Beside the gradient methods, the clients' Grams run on the threads they leave (numpy's
            # BLAS releases the GIL; each Gram is the same computation whatever the thread).
            def statistics_of(rows: np.ndarray) -> ClientStatistics:
                # Held packed (the Gram's triangle, read-only): the full d × d goes as soon as it is made.
                stats = client_statistics(data.features[rows], data.cohort.labels[rows], device=config.device)
                return stats.packed()

            clients = data.split.clients if config.dp is None else ()  # DP: later
            jobs = [pool.submit(statistics_of, rows) for rows in clients]
            stats = {}
            try:
                for k, job in enumerate(jobs):
                    stats[client_id(k)] = job.result()
                    progress("client statistics", k + 1, config.n_clients)
            except BaseException:
                for job in jobs:  # an error or Ctrl-C: the Grams not yet started are dropped
                    job.cancel()
                raise
        settings = tuple(
            run_setting(data, stats, missing, config, timer, progress, gradient) for missing in config.missing
        )
    return ExperimentResult(
        config=config,
        dataset=data.description,
        settings=settings,
        seconds=dict(timer.seconds),
        notice=SYNTHETIC_NOTICE if data.description.get("synthetic_features") else "",
    )
