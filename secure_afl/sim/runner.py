"""The experiment: cohort → features → clients → statistics → aggregation → solve → metrics.

Every missing setting uses the same split, clients and features; only the label assignment
changes.  The AFL variants of one setting share one aggregation: each client's statistics are
computed once (they do not depend on the labels' balancing) and every variant's tensors are summed
together, in the clear (``secure="none"``), through the masking protocol (``secure="mask"``), CKKS
encryption (``secure="ckks"``) or both (``secure="mask,ckks"``: the first backend's sums fit the
reported models, the second's are fitted too and its costs sit beside the first's).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, replace

import numpy as np
from threadpoolctl import threadpool_limits

from secure_afl import stages
from secure_afl.analytic import (
    ClientStatistics,
    Contributions,
)
from secure_afl.core.randomness import OsRandomSource, RandomSource
from secure_afl.privacy.policy import ClientPolicy, layout_refusals
from secure_afl.sim.audit import PrivacyAudit, audit_groups, audit_view, restrict
from secure_afl.sim.baselines import BASELINES as TABLE2_BASELINES
from secure_afl.sim.datasets import DataRequest, PreparedData, PreparingData, Progress
from secure_afl.sim.gradient import GradientMethods
from secure_afl.sim.mechanism import Fitted, Mechanism, PaperMechanism
from secure_afl.sim.methods import FEDAVG, FEDNCA
from secure_afl.sim.metrics import Metrics, evaluate
from secure_afl.sim.partial import LabelAssignment, assign_partial_labels
from secure_afl.sim.setting import (
    BASELINES,
    SYNTHETIC_NOTICE,
    Aggregate,
    ExperimentError,
    ExperimentResult,
    GroupsSummed,
    PhaseTimer,
    Protect,
    SettingResult,
    SimConfig,
    check_coverage,
    client_id,
    dropped_clients,
    named_costs,
    no_progress,
    protection,
    upload_bytes,
)
from secure_afl.torch_threads import one_torch_thread


def mechanism_for(
    data: PreparedData,
    config: SimConfig,
    stats: Mapping[str, object],
    assignment: LabelAssignment,
    random: RandomSource | None = None,
) -> Mechanism:
    """The mechanism of ``config``'s settings: the private one under ``config.dp`` (``random``: its
    noise's randomness, the operating system's by default), else the paper's."""
    if config.dp is not None:
        from secure_afl.sim.private import PrivateMechanism

        given = dict(stats) if stats else None  # type: ignore[arg-type]
        return PrivateMechanism(
            data, config, assignment, OsRandomSource() if random is None else random, given
        )
    return PaperMechanism(data, config, stats)  # type: ignore[arg-type]


@dataclass
class Walk:
    """What walking the stages leaves: each round's uploads (round 1's as the audit reads them
    when the protection took the arrays over), the sums, the released models and the bytes sent."""

    round1: dict[str, Contributions]
    round2: dict[str, Contributions]
    agg: Aggregate
    agg2: Aggregate | None
    fitted: Fitted
    undefined: tuple[tuple[str, int, str], ...]
    upload: dict[str, int]


def walk(
    mechanism: Mechanism,
    clients: Sequence[str],
    assignment: LabelAssignment,
    protect: Protect,
    *,
    rounds: int,
    dropped: Collection[str] = (),
    timer: PhaseTimer | None = None,
    free: MutableMapping[str, object] | None = None,
) -> Walk:
    """The stages, in their one order: round 1's statistics → privatize → protect → solve, then,
    with ``rounds=2``, the server's teacher and round 2's statistics → privatize → protect → refine
    over the clients that did not drop (``dropped``).

    ``protect(contributions, round_label, teacher_arrays, consume)`` sums the groups (in the clear,
    masked or encrypted).  ``free``: the caller's statistics, emptied once round 1's uploads are made;
    the protection then takes the uploads over (``consume``), so each client's Gram goes once sent."""
    timer = PhaseTimer() if timer is None else timer
    with timer.phase("statistics"):
        mine = mechanism.statistics(clients, assignment)
        undefined = mechanism.undefined_balance(mine, clients, assignment)
    with timer.phase(mechanism.privatize_phase):
        round1 = mechanism.privatize(mine, clients, assignment)
    del mine
    upload = upload_bytes(round1)
    consume = free is not None
    if free is not None:
        free.clear()  # round 1's uploads hold what is still needed
        audited = audit_view(round1)  # what the audit reads of round 1, without the arrays
    with timer.phase("aggregation"):
        agg = protect(round1, "1", None, consume)
    if consume:
        round1 = audited
    check_coverage(agg, assignment.n_classes)
    with timer.phase("solve"):
        fitted = mechanism.solve(agg)
    round2: dict[str, Contributions] = {}
    agg2 = None
    if rounds == 2:
        live = [c for c in clients if c not in dropped]
        teacher = mechanism.teacher(agg)
        with timer.phase("statistics"):
            mine2 = mechanism.round2_statistics(live, assignment)
        with timer.phase(mechanism.privatize_phase):
            round2 = mechanism.privatize_round2(mine2, live, assignment)
        del mine2
        with timer.phase("aggregation"):
            agg2 = protect(round2, "2", teacher, False)
        with timer.phase("solve"):
            refined = mechanism.refine(agg, agg2)
        fitted.models.update(refined.models)
        fitted.other_models.update(refined.other_models)
        for name, size in upload_bytes(round2).items():
            upload[name] = upload.get(name, 0) + size
    return Walk(round1, round2, agg, agg2, fitted, undefined, upload)


def run_setting(
    data: PreparedData,
    stats: Mapping[str, object],
    missing: int,
    config: SimConfig,
    timer: PhaseTimer,
    progress: Progress = no_progress,
    gradient: GradientMethods | None = None,
    *,
    assignment: LabelAssignment | None = None,
    score: Callable[[str, np.ndarray], Metrics] | None = None,
    last_use: bool = False,
    random: RandomSource | None = None,
) -> SettingResult:
    """One setting, every mechanism through the same stages (:mod:`secure_afl.sim.mechanism`):
    the missing level's label assignment (or ``assignment``, which clients label which classes,
    when the caller has its own: a multi-site federation), statistics, privatize, protect, solve,
    round 2, the metrics, the audit and the gradient methods beside it.

    ``stats``: the clients' statistics for ``config``'s mechanism (the paper's: every client's,
    made once for all settings; under DP: clipped statistics to reuse, or empty).  ``score(method,
    logits)`` gives a method's metrics on the test rows (default: every test row counts for every
    class).  ``last_use``: no later setting needs ``stats`` (a dict): it is emptied once round 1's
    contributions are made, and the masked aggregation takes those over, so each client's Gram goes
    once the client has sent it (the clients' Grams and the server's sums then never all coexist:
    at d = 4096 each is 64 MiB).  ``random``: the DP noise's randomness (default: the OS's)."""
    if last_use and not isinstance(stats, MutableMapping):
        raise ExperimentError(
            f"last_use=True empties the statistics: pass a dict, not a {type(stats).__name__}"
        )
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
    mechanism = mechanism_for(data, config, stats, assignment, random)
    clients = [client_id(k) for k in range(config.n_clients)]
    dropped = dropped_clients(config)
    dropouts = {config.dropout_stage: dropped} if dropped else {}
    test_y = data.cohort.labels[data.split.test]
    if score is None:

        def score(method: str, logits: np.ndarray) -> Metrics:
            return evaluate(test_y, logits, kind="logits")

    walked = walk(
        mechanism,
        clients,
        assignment,
        protection(config, dropouts),
        rounds=config.rounds,
        dropped=dropped,
        timer=timer,
        free=stats if last_use else None,  # type: ignore[arg-type]
    )
    agg, agg2 = walked.agg, walked.agg2
    models, other_models = walked.fitted.models, walked.fitted.other_models
    method_groups, wire_groups = agg.method, agg.wire
    sent_by_difference = dict(agg.derived)
    costs = named_costs("round1", agg.costs_by_protection) or None
    findings = {c: tuple(f) for c, f in agg.client_findings.items()}
    if agg2 is not None:
        method_groups, wire_groups = method_groups.merged(agg2.method), wire_groups.merged(agg2.wire)
        sent_by_difference.update(agg2.derived)
        for client, seen in agg2.client_findings.items():
            findings[client] = findings.get(client, ()) + tuple(seen)
        if costs is not None:
            costs.update(named_costs("round2", agg2.costs_by_protection))

    with timer.phase("metrics"):
        # AUC and AP rank the scores (logits); BACC counts each method's decisions, score > 0
        # (= σ(score) > 0.5, what predict() returns).  AFL's first: the gradient methods may still train.
        test_x = data.features[data.split.test].astype(np.float64)  # once, not per method
        metrics = {name: score(name, model.decision_function(test_x)) for name, model in models.items()}
        for name, model in other_models.items():
            metrics[name] = score(name, model.decision_function(test_x))
    uploads = {c: {**groups, **walked.round2.get(c, {})} for c, groups in walked.round1.items()}
    audit, method_audits = _audits(config, uploads, wire_groups, method_groups, findings, mechanism, models)
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
    method_seconds: Mapping[str, float] = {}
    if mechanism.compares_gradient_methods:
        method_seconds = _compare_gradient_methods(
            data, config, missing, assignment, gradient, timer, progress, score, test_x, metrics
        )
    order = (*mechanism.methods, FEDAVG, *BASELINES)
    ordered = {m: metrics[m] for m in order if m in metrics}
    ordered.update({m: metrics[m] for m in sorted(other_models)})
    pseudo_labels, pseudo_labels_rescaled = mechanism.pseudo_labels()
    return SettingResult(
        missing=missing,
        assignment=assignment,
        metrics=ordered,
        dropped=dropped,
        upload_bytes=walked.upload,
        audit=audit,
        method_audits=method_audits,
        pseudo_labels=pseudo_labels,
        protocol_costs=costs,
        privacy=mechanism.privacy(),
        client_refusals=refusals,
        sent_by_difference=sent_by_difference,
        gram_copies={"method": _copies(method_groups, "gram"), "sent": _copies(wire_groups, "gram")},
        pseudo_labels_rescaled=pseudo_labels_rescaled,
        undefined_balance=walked.undefined,
        method_seconds=method_seconds,
        coefs={name: model.coef_ for name, model in models.items() if model.coef_ is not None},
    )


def _audits(
    config: SimConfig,
    uploads: Mapping[str, Contributions],
    wire_groups: GroupsSummed,
    method_groups: GroupsSummed,
    findings: Mapping[str, tuple],
    mechanism: Mechanism,
    models: Mapping[str, object],
) -> tuple[PrivacyAudit, dict[str, PrivacyAudit]]:
    """The run's audit, of the groups the server summed, and each method's, of its own uploads
    alone (a difference plan's wire sums span the same as the method's, SECURITY.md §4)."""
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
        method: methods_audit if keep is None else restrict(methods_audit, keep, contributions=uploads)
        for method, keep in mechanism.method_uploads().items()
        if method in models
    }
    return audit, method_audits


def _compare_gradient_methods(
    data: PreparedData,
    config: SimConfig,
    missing: int,
    assignment: LabelAssignment,
    gradient: GradientMethods | None,
    timer: PhaseTimer,
    progress: Progress,
    score: Callable[[str, np.ndarray], Metrics],
    test_x: np.ndarray,
    metrics: dict[str, Metrics],
) -> Mapping[str, float]:
    """FedAvg and the baselines on the same rows, features and label assignment, training since
    the data were ready (sim/gradient.py); their metrics go into ``metrics``, their seconds out."""
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
    return method_seconds


def _copies(groups: GroupsSummed, tensor: str) -> float:
    """How many groups a client sends ``tensor`` to, mean over the clients in any group."""
    clients = {c for members in groups.members.values() for c in members}
    copies = sum(len(groups.members[g]) for g, tensors in groups.tensors.items() if tensor in tensors)
    return copies / max(1, len(clients))


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
    progress: Progress = no_progress,
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
                stats = stages.clear_statistics(
                    data.features[rows], data.cohort.labels[rows], device=config.device
                )
                return stats.packed()

            clients = data.split.clients if config.dp is None else ()  # DP: later
            jobs = [pool.submit(statistics_of, rows) for rows in clients]
            stats = {}
            try:
                for k in range(len(jobs)):
                    stats[client_id(k)] = jobs[k].result()
                    progress("client statistics", k + 1, config.n_clients)
            except BaseException:
                for job in jobs:  # an error or Ctrl-C: the Grams not yet started are dropped
                    job.cancel()
                raise
            jobs.clear()  # a future holds its result: from here only `stats` holds the Grams
        # The last setting is the statistics' last use: each client's Gram can go once it is sent.
        settings = tuple(
            run_setting(
                data,
                stats,
                missing,
                config,
                timer,
                progress,
                gradient,
                last_use=index == len(config.missing) - 1,
            )
            for index, missing in enumerate(config.missing)
        )
    return ExperimentResult(
        config=config,
        dataset=data.description,
        settings=settings,
        seconds=dict(timer.seconds),
        notice=SYNTHETIC_NOTICE if data.description.get("synthetic_features") else "",
    )
