"""What every setting of the experiment shares, whichever runs it (the paper's protocol, DP, the
scenarios): the configuration, the client names, the phase timer, a setting's result, and the
aggregation stage (in the clear, masked or encrypted) with its coverage check.

Below the pipeline (:mod:`secure_afl.sim.runner`) and its mechanisms (:mod:`secure_afl.sim.mechanism`,
:mod:`secure_afl.sim.private`), so that the scenarios and the mechanisms share it without importing
the runner.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from secure_afl.aggregation.layout import Derivation
from secure_afl.analytic import (
    PSEUDO_TENSOR_RESCALED,
    Contributions,
    PseudoLabelConfig,
    PseudoLabelReport,
    check_method_parameter,
    class_group,
    sum_contributions,
    uploaded_by,
)
from secure_afl.privacy.dp import DpConfig, check_pseudo_label_threshold
from secure_afl.privacy.policy import LayoutRefusal
from secure_afl.sim.audit import PrivacyAudit
from secure_afl.sim.baselines import BASELINES as TABLE2_BASELINES
from secure_afl.sim.baselines import BaselineConfig
from secure_afl.sim.data import CLASSES, N_CLIENTS, SplitBy
from secure_afl.sim.datasets import ImageSource
from secure_afl.sim.fedavg import FedAvgConfig
from secure_afl.sim.methods import FEDNCA
from secure_afl.sim.metrics import Metrics
from secure_afl.sim.partial import LabelAssignment, Missing1Draw, PartialLabelError

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
    dp: DpConfig | None = None  # differential privacy (secure_afl/sim/private.py); None: off
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
        # γ by the method's rule, as a deployment's study checks it (the pseudo-label settings are
        # checked when their PseudoLabelConfig is made): MethodParameterError names it.
        check_method_parameter("gamma", self.gamma)
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
                    f"not under --protection {self.secure}; use --protection mask or none with it "
                    "(--secure mask or none, its old name)"
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
    # group -> tensor -> how it was derived from wire sums: a difference plan sent the Gram to `all`
    # and to complement groups instead of to each class group, a partition plan derived `all`'s
    # from the class groups' (empty without a plan)
    sent_by_difference: Mapping[str, Mapping[str, Derivation]] = field(default_factory=dict)
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


def no_progress(task: str, done: int, total: int) -> None:
    return None


def dropped_clients(config: SimConfig) -> tuple[str, ...]:
    if not config.dropout:
        return ()
    rng = np.random.default_rng([config.seed, 0xD50])
    return tuple(client_id(k) for k in sorted(rng.choice(config.n_clients, config.dropout, replace=False)))


@dataclass(frozen=True)
class GroupsSummed:
    """Per group: its members, its surviving members and the tensors summed over them."""

    members: Mapping[str, tuple[str, ...]]
    survivors: Mapping[str, tuple[str, ...]]
    tensors: Mapping[str, tuple[str, ...]]

    def merged(self, other: GroupsSummed) -> GroupsSummed:
        return GroupsSummed(
            {**self.members, **other.members},
            {**self.survivors, **other.survivors},
            {**self.tensors, **other.tensors},
        )


@dataclass(frozen=True)
class Aggregate:
    sums: Contributions
    method: GroupsSummed  # the method's own groups (the contributions' names)
    wire: GroupsSummed  # the groups the server summed: the method's, or a difference plan's
    costs: Mapping[str, object] | None  # the first protection's costs (None in the clear)
    client_findings: Mapping[str, tuple] = field(default_factory=dict)  # what each client's own check saw
    other_sums: Mapping[str, Contributions] = field(default_factory=dict)  # the other backends' sums
    costs_by_protection: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    # group -> tensor -> how it was derived from wire sums (a plan; empty without one)
    derived: Mapping[str, Mapping[str, Derivation]] = field(default_factory=dict)

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


def upload_bytes(contributions: Mapping[str, Contributions]) -> dict[str, int]:
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
    consume: bool = False,
    frac_bits: int | None = None,
) -> Aggregate:
    """Per-group sums over the surviving members, in the clear or through the masking protocol.

    Through a protocol, every client binds the session context of this run's config, the round and
    what the server sent for it (``arrays``: round 2's teacher W), as a deployed client binds its
    study's (:func:`secure_afl.protocol.binding.session_context`, the one-view rule).
    ``consume=True``: the caller needs ``contributions`` (a dict) no more; when the last protection
    is masking, its run takes them over (:func:`secure_afl.sim.secure.secure_aggregate`): the dict
    is emptied and each client's values go once it has sent them.  ``frac_bits``: the masking's
    fixed-point precision (a study's; default the encoding's)."""
    members, tensors = _membership(contributions)
    if config.secure != "none":
        from secure_afl.sim.secure import SecureAggregationResult

        context = simulation_context(config, round_label, arrays)
        names = config.secure.split(",")
        runs = {
            name: _protected_sums(
                name,
                contributions,
                config,
                dropouts,
                context,
                consume=consume and index == len(names) - 1,
                frac_bits=frac_bits,
            )
            for index, name in enumerate(names)
        }
        first = next(iter(runs.values()))
        # Under a difference plan (masking, aggregation/difference.py) the Gram travels to `all` and
        # to complement groups: the run's audit lists those wire groups; each method's audit, its
        # own groups (every one stays on the wire with its other tensors and members).
        return Aggregate(
            sums={g: dict(t) for g, t in first.sums.items()},
            method=GroupsSummed(
                {g: tuple(m) for g, m in members.items()},
                {g: tuple(first.survivors[g]) for g in members},
                {g: tuple(sorted(t)) for g, t in tensors.items()},
            ),
            wire=GroupsSummed(
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
    groups = GroupsSummed(
        {g: tuple(m) for g, m in members.items()},
        survivors,
        {g: tuple(sorted(t)) for g, t in tensors.items()},
    )
    return Aggregate(sums=sum_contributions(alive.values()), method=groups, wire=groups, costs=None)


# protect(contributions, round label, round 2's teacher arrays, consume) -> the groups' sums
Protect = Callable[[dict[str, Contributions], str, Mapping[str, np.ndarray] | None, bool], Aggregate]


def protection(
    config: SimConfig, dropouts: Mapping[str, tuple[str, ...]], *, frac_bits: int | None = None
) -> Protect:
    """The pipeline's protect stage for ``config``: :func:`aggregate` with ``dropouts`` in round 1;
    round 2 goes on without every client that dropped in round 1, so nobody drops there."""

    def protect(
        contributions: dict[str, Contributions],
        round_label: str,
        arrays: Mapping[str, np.ndarray] | None,
        consume: bool,
    ) -> Aggregate:
        return aggregate(
            contributions,
            config,
            dropouts=dropouts if round_label == "1" else {},
            round_label=round_label,
            arrays=arrays,
            consume=consume,
            frac_bits=frac_bits,
        )

    return protect


def _membership(
    contributions: Mapping[str, Contributions],
) -> tuple[dict[str, list[str]], dict[str, set[str]]]:
    """Per group its members and tensor names (in a function of its own: no loop variable outlives
    it holding a client's tensors, which a consuming aggregation frees as it goes)."""
    members: dict[str, list[str]] = {}
    tensors: dict[str, set[str]] = {}
    for client, groups in contributions.items():
        for group, named in groups.items():
            members.setdefault(group, []).append(client)
            tensors.setdefault(group, set()).update(named)
    return members, tensors


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
    *,
    consume: bool = False,
    frac_bits: int | None = None,
):  # -> SecureAggregationResult | CkksAggregationRun
    """Group sums through one protection backend ("mask" or "ckks"); aborts become ExperimentErrors.
    ``consume``: masking takes ``contributions`` over (CKKS leaves them)."""
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
        from secure_afl.core.encoding import DEFAULT_FRAC_BITS
        from secure_afl.sim.secure import secure_aggregate

        return secure_aggregate(
            contributions,
            symmetric=SYMMETRIC_TENSORS,
            threshold=config.threshold,
            min_group_size=config.min_group_size,
            dropouts=dropouts,
            context=context,
            unpack=False,  # the Grams' sums stay triangles: the solve unpacks one at a time
            consume=consume,
            frac_bits=DEFAULT_FRAC_BITS if frac_bits is None else frac_bits,
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


def named_costs(stage: str, costs: Mapping[str, object] | None) -> dict[str, object]:
    """{"round1": costs} for one backend; {"round1 (mask)": ..., "round1 (ckks)": ...} for several."""
    if not costs:
        return {}
    if len(costs) == 1:
        return {stage: next(iter(costs.values()))}
    return {f"{stage} ({name})": value for name, value in costs.items()}


def check_coverage(agg: Aggregate, n_classes: int) -> None:
    for c in range(n_classes):
        if not agg.method.survivors.get(class_group(c)):
            raise ExperimentError(
                f"class {CLASSES[c] if c < len(CLASSES) else c} has no surviving annotating client "
                "(every client that labels it dropped out); lower --dropout or the missing level"
            )
