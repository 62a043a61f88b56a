"""The experiment: cohort → features → clients → statistics → aggregation → solve → metrics.

Every missing setting uses the same split, clients and features; only the label assignment
changes.  The AFL variants of one setting share one aggregation: each client's statistics are
computed once (they do not depend on the labels' balancing) and every variant's tensors are summed
together, in the clear (``secure="none"``), through the masking protocol (``secure="mask"``), CKKS
encryption (``secure="ckks"``) or both (``secure="mask,ckks"``: the first backend's sums fit the
reported models, the second's are fitted too and its costs sit beside the first's).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import replace

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
    PseudoLabelReport,
    PseudoScoreRule,
    StatisticsError,
    UndefinedBalanceWarning,
    client_statistics,
    fit_together,
    pseudo_label_rounds,
)
from secure_afl.privacy.policy import ClientPolicy, layout_refusals
from secure_afl.sim.audit import audit_groups, audit_view, restrict
from secure_afl.sim.baselines import BASELINES as TABLE2_BASELINES
from secure_afl.sim.datasets import DataRequest, PreparedData, PreparingData, Progress
from secure_afl.sim.gradient import GradientMethods
from secure_afl.sim.methods import FEDAVG, FEDNCA
from secure_afl.sim.metrics import Metrics, evaluate
from secure_afl.sim.partial import LabelAssignment, assign_partial_labels
from secure_afl.sim.setting import (
    AFL_1,
    AFL_2,
    AFL_2_RESCALED,
    AFL_GLOBAL_BALANCE,
    AFL_GLOBAL_GRAM,
    BASELINES,
    METHOD_UPLOADS,
    SYNTHETIC_NOTICE,
    ExperimentError,
    ExperimentResult,
    GroupsSummed,
    PhaseTimer,
    SettingResult,
    SimConfig,
    aggregate,
    check_coverage,
    client_id,
    dropped_clients,
    named_costs,
    no_progress,
    upload_bytes,
)
from secure_afl.torch_threads import one_torch_thread


def run_setting(
    data: PreparedData,
    stats: Mapping[str, ClientStatistics],
    missing: int,
    config: SimConfig,
    timer: PhaseTimer,
    progress: Progress = no_progress,
    gradient: GradientMethods | None = None,
    *,
    assignment: LabelAssignment | None = None,
    score: Callable[[str, np.ndarray], Metrics] | None = None,
    last_use: bool = False,
) -> SettingResult:
    """One setting: the missing level's label assignment (or ``assignment``, which clients label
    which classes, when the caller has its own: a multi-site federation), round 1, round 2, the
    gradient methods and the audit.  ``score(method, logits)`` gives a method's metrics on the test
    rows (default: every test row counts for every class).  ``last_use``: no later setting needs
    ``stats`` (a dict): it is emptied once round 1's contributions are made, and the masked
    aggregation takes those over, so each client's Gram goes once the client has sent it (the
    clients' Grams and the server's sums then never all coexist: at d = 4096 each is 64 MiB)."""
    if last_use and not isinstance(stats, MutableMapping):
        raise ExperimentError(
            f"last_use=True empties the statistics: pass a dict, not a {type(stats).__name__}"
        )
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
    dropped = dropped_clients(config)
    dropouts = {config.dropout_stage: dropped} if dropped else {}
    test_y = data.cohort.labels[data.split.test]
    if score is None:

        def score(method: str, logits: np.ndarray) -> Metrics:
            return evaluate(test_y, logits, kind="logits")

    with timer.phase("statistics"), warnings.catch_warnings():
        # reported per setting (undefined_balance), not as one Python warning per client
        warnings.simplefilter("ignore", UndefinedBalanceWarning)
        round1 = _round1_contributions(stats, clients, assignment)
    upload = upload_bytes(round1)
    if last_use:
        stats.clear()  # type: ignore[attr-defined]  # round 1's contributions hold what is still needed
        audited = audit_view(round1)  # what the audit reads of round 1, without the arrays
    with timer.phase("aggregation"):
        agg = aggregate(round1, config, dropouts=dropouts, consume=last_use)
    if last_use:
        round1 = audited
    check_coverage(agg, n_classes)
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

    pseudo_reports: list[tuple[str, PseudoLabelReport]] = []
    rescaled_reports: list[tuple[str, PseudoLabelReport]] = []
    method_groups, wire_groups = agg.method, agg.wire
    sent_by_difference = dict(agg.derived)
    costs = named_costs("round1", agg.costs_by_protection) or None
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
        for name, size in upload_bytes(round2).items():
            upload[name] += size
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


def _round1_contributions(
    stats: Mapping[str, ClientStatistics], clients: list[str], assignment: LabelAssignment
) -> dict[str, Contributions]:
    """Each client's round-1 uploads: its class groups' tensors under both balances and the
    global Gram (in a function of its own: no local name outlives it holding a client's Gram)."""
    round1 = {}
    for k, name in enumerate(clients):
        mine = stats[name].contributions(assignment.active[k], balance="client", include_global_gram=True)
        balanced_globally = stats[name].contributions(assignment.active[k], balance="global")
        for group, tensors in balanced_globally.items():
            mine[group].update(tensors)
        round1[name] = mine
    return round1


def _copies(groups: GroupsSummed, tensor: str) -> float:
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
                stats = client_statistics(data.features[rows], data.cohort.labels[rows], device=config.device)
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
