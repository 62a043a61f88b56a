"""``secure-afl deploy local`` as a library: plan a rehearsal, run it, compare it with the simulation.

A rehearsal brings a whole federation up on this machine (:func:`secure_afl.deploy.local.run_local`)
over the embedded cohort partitioned as ``secure-afl sim`` partitions it, then fits the same
federation in process (:func:`reference_classifier`: the simulator's secure aggregation and the same
solve) and compares the two classifiers: bit for bit under masking, within CKKS's precision under
CKKS, and (a federation that grows) each session against the centralised fit.

This module and the command layer are the only ones that import both the simulator and the
deployment (which never imports ``sim``).  The command parses its options into
:class:`RehearsalOptions`, calls :func:`plan_rehearsal` and :func:`rehearse`, and renders the
:class:`RehearsalReport`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from secure_afl.deploy.errors import ConfigurationError
from secure_afl.deploy.study import (
    Method,
    Study,
    StudyDp,
    deployment_threshold,
    parse_colluders,
    pseudo_group,
    pseudo_members,
    round2_classes,
    round2_min_group_size,
)
from secure_afl.privacy.dp_config import DEFAULT_CENTRED_CLIP, DEFAULT_CLIP, default_ridge

if TYPE_CHECKING:  # the simulator loads only when a rehearsal computes its reference
    from secure_afl.analytic import AnalyticClassifier, ClientStatistics, Contributions
    from secure_afl.deploy.solve import StudySolver
    from secure_afl.sim.mechanism import Fitted
    from secure_afl.sim.partial import LabelAssignment
    from secure_afl.sim.setting import Aggregate

__all__ = [
    "CKKS_METRIC_TOLERANCE",
    "CKKS_RELATIVE_WEIGHT_TOLERANCE",
    "GROWTH_TOLERANCE",
    "Reference",
    "RehearsalError",
    "RehearsalFailed",
    "RehearsalOptions",
    "RehearsalPlan",
    "RehearsalReport",
    "parse_drops",
    "plan_rehearsal",
    "reference_classifier",
    "reference_dropouts",
    "rehearse",
    "synthetic_image_digests",
]

Say = Callable[[str], None]
ClientData = tuple[np.ndarray, np.ndarray, tuple[int, ...]]  # features, labels, active classes
# ``deploy local --protection ckks`` against the masked simulation: CKKS rounds every decrypted sum to
# 2^-24, so the weights are equal only within a tolerance.  Measured (4 clients, missing 1):
# max |Δw| / max |w| = 1.0e-7 at d = 32 (fraction 0.08) and 3.6e-7 at d = 1024 (full data), metrics
# equal within 1e-7.  The check allows 1e-4 of the largest weight and 1e-3 on BACC, AUC and mAP.
CKKS_RELATIVE_WEIGHT_TOLERANCE = 1e-4
CKKS_METRIC_TOLERANCE = 1e-3
GROWTH_TOLERANCE = 1e-9  # a grown federation's classifier equals the centralised fit to 1e-9


class RehearsalError(ValueError):
    """Options that cannot make a rehearsal; ``option`` names the one to change (or None: several)."""

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


class RehearsalFailed(RuntimeError):
    """The rehearsal ran but its check failed: the deployment and the simulation disagree, or the
    abort rehearsal did not abort."""


@dataclass(frozen=True)
class Reference:
    """The in-process simulation of the same federation: its classifier and its survivors."""

    coef: np.ndarray
    survivors: tuple[str, ...]
    seconds: float


class StudyMechanism:
    """The pipeline's stages (:mod:`secure_afl.sim.mechanism`) for the one method a study fixes,
    over the institutions' own rows: what the deployment's nodes and server compute, in process
    (each client's stage is the node's own function of :mod:`secure_afl.stages`).

    Statistics: each institution's Gram and class projections.  Privatize: the study's layout
    (its balance and Gram scope; the global Gram too when there is a round 2).  Solve: the study's
    classifier.  Round 2: the pseudo-label sums of the groups the server's rule keeps
    (``round2_groups``), and the refinement.
    """

    privatize_phase = "statistics"
    compares_gradient_methods = False
    methods = ("study",)

    def __init__(
        self, clients: Mapping[str, ClientData], study: Study, round2_groups: Collection[str], device: str
    ) -> None:
        self.clients, self.study, self.method, self.device = clients, study, study.method, device
        self.round2_groups = frozenset(round2_groups)
        self.model: AnalyticClassifier | None = None
        self.solver: StudySolver | None = None

    def statistics(
        self, clients: Collection[str], assignment: LabelAssignment
    ) -> dict[str, ClientStatistics]:
        from secure_afl import stages

        return {
            cid: stages.clear_statistics(self.clients[cid][0], self.clients[cid][1], device=self.device)
            for cid in clients
        }

    def undefined_balance(
        self, stats: Mapping[str, ClientStatistics], clients: Collection[str], assignment: LabelAssignment
    ) -> tuple[tuple[str, int, str], ...]:
        return ()

    def privatize(
        self, stats: Mapping[str, ClientStatistics], clients: Collection[str], assignment: LabelAssignment
    ) -> dict[str, Contributions]:
        from secure_afl import stages

        method = self.method
        return {
            cid: stages.clear_contributions(
                stats[cid],
                self.clients[cid][2],
                balance=method.balance,
                gram=method.gram,
                include_global_gram=method.rounds == 2,
            )
            for cid in clients
        }

    def solve(self, agg: Aggregate) -> Fitted:
        from secure_afl.deploy.solve import StudySolver
        from secure_afl.sim.mechanism import Fitted

        self.solver = StudySolver(self.study)  # the Flower server's solve
        self.model = self.solver.fit(agg.sums)
        return Fitted({"study": self.model})

    def teacher(self, agg: Aggregate) -> dict[str, np.ndarray]:
        assert self.model is not None and self.model.coef_ is not None, "solve() comes first"
        return {"coef": self.model.coef_}

    def round2_statistics(
        self, live: Collection[str], assignment: LabelAssignment
    ) -> dict[str, Contributions]:
        from secure_afl import stages
        from secure_afl.deploy.study import recipe

        assert self.model is not None and self.model.coef_ is not None, "solve() comes first"
        config = recipe(self.study, len(self.clients), "2").pseudo  # the nodes' rule, from the study
        assert config is not None
        out = {}
        for cid in live:
            features, _, active = self.clients[cid]
            out[cid] = stages.pseudo_labels(
                features, self.model.coef_, active, config, device=self.device, groups=self.round2_groups
            )
        return out

    def privatize_round2(
        self, stats: Mapping[str, Contributions], live: Collection[str], assignment: LabelAssignment
    ) -> dict[str, Contributions]:
        return dict(stats)

    def refine(self, agg: Aggregate, agg2: Aggregate) -> Fitted:
        from secure_afl.sim.mechanism import Fitted

        assert self.model is not None and self.solver is not None, "solve() comes first"
        return Fitted({"study": self.solver.refine(self.model, agg2.sums, {})})

    def pseudo_labels(self) -> tuple[tuple[()], tuple[()]]:
        return (), ()

    def method_uploads(self) -> dict[str, None]:
        return {"study": None}

    def privacy(self) -> None:
        return None


def reference_classifier(
    clients: Mapping[str, ClientData],
    study: Study,
    *,
    roster_size: int,
    dropouts: Mapping[str, Collection[str]],
    device: str = "auto",
    colluders: str = "n-t",
) -> Reference:
    """The deployment's classifier computed in process: the simulator's pipeline
    (:func:`secure_afl.sim.runner.walk`) over :class:`StudyMechanism`, through the simulator's
    secure aggregation at the study's precision.

    Same statistics, same fixed-point encoding, same survivors: the sums are the same integers, so
    the classifier must be the deployment's bit for bit.  Round 2 goes on without every client that
    dropped in round 1, over the pseudo-label groups the deployment's rule keeps.
    """
    from secure_afl.sim.partial import LabelAssignment
    from secure_afl.sim.runner import walk
    from secure_afl.sim.setting import SimConfig, protection

    started = time.perf_counter()
    method, threshold = study.method, study.threshold_for(roster_size)
    cids = sorted(clients)
    dropped = {c for ids in dropouts.values() for c in ids}
    live = [cid for cid in cids if cid not in dropped]
    kept: set[str] = set()
    if method.rounds == 2:
        members = pseudo_members({cid: clients[cid][2] for cid in live}, live, study.n_classes)
        minimum = round2_min_group_size(study, roster_size, colluders)  # the server's rule
        kept = {pseudo_group(c) for c in round2_classes(members, minimum)}
    config = SimConfig(
        n_clients=len(cids), secure="mask", threshold=threshold, min_group_size=study.min_group_size
    )

    assignment = LabelAssignment(
        missing=0, n_classes=study.n_classes, active=tuple(tuple(clients[cid][2]) for cid in cids)
    )
    walked = walk(
        StudyMechanism(clients, study, kept, device),
        cids,
        assignment,
        protection(config, dropouts, frac_bits=study.frac_bits),
        rounds=2 if kept else 1,
        dropped=dropped,
    )
    survivors = tuple(sorted({c for ids in walked.agg.method.survivors.values() for c in ids}))
    coef = walked.fitted.models["study"].coef_
    return Reference(np.array(coef), survivors, time.perf_counter() - started)


# --- the plan ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RehearsalOptions:
    """What ``secure-afl deploy local`` is asked for (its options, with the same defaults)."""

    clients: int = 5
    sessions: int = 1
    tls: bool = False
    drops: tuple[str, ...] = ()
    secure: str = "mask"
    ckks_degree: int = 8192
    missing: int = 1
    rounds: int = 1
    gram: str = "global"
    balance: str | None = None
    gamma: float = 1.0
    seed: int = 0
    fraction: float = 1.0
    dim: int = 1024
    round_timeout: float = 30.0
    colluders: str = "n-t"
    coordinator: str = "active"  # every node's node config `coordinator` (round 2 needs honest-but-curious)
    rehearse_abort: bool = False
    keep: bool = False
    dp_epsilon: float | None = None
    dp_delta: float = 1e-6
    clip: float | None = None
    dp_unit: str = "image"
    dp_max_images_per_patient: int = 1
    dp_dim: int | None = None
    dp_projection_seed: int = 0
    dp_ridge: str | None = None
    dp_class_sums: str | None = None
    dp_row_centre: bool = False
    metrics: tuple[str, int] | None = None  # where the coordinator's metrics are served (host, port)


@dataclass(frozen=True)
class RehearsalPlan:
    """Everything decided before any process starts: the study, who labels what, who drops when."""

    options: RehearsalOptions
    study: Study
    client_ids: tuple[str, ...]
    assignment: Any  # sim.partial.LabelAssignment
    drops: Mapping[str, str]  # client -> the round at which its SuperNode is killed
    assumed_colluders: int


def parse_drops(
    values: Collection[str], client_ids: Collection[str], protection: str = "mask"
) -> dict[str, str]:
    """``CLIENT@ROUND`` values as {client: round}."""
    from secure_afl.deploy.local import DROP_ROUNDS_BY_PROTECTION

    ids = list(client_ids)
    rounds = DROP_ROUNDS_BY_PROTECTION[protection]
    drops: dict[str, str] = {}
    for value in values:
        cid, sep, round_name = value.partition("@")
        if not sep or cid not in ids or round_name not in rounds:
            raise RehearsalError(
                f"{value!r}: expected CLIENT@ROUND with CLIENT in {ids[0]}..{ids[-1]} and "
                f"ROUND one of {', '.join(rounds)} with --protection {protection} (e.g. client-2@R2)",
                "--drop",
            )
        if cid in drops:
            raise RehearsalError(f"{cid} is dropped twice", "--drop")
        drops[cid] = round_name
    return drops


def plan_rehearsal(options: RehearsalOptions) -> RehearsalPlan:
    """Check ``options`` and decide the study; raises :class:`RehearsalError` naming what to change.

    A layout that the nodes' own checks would refuse (a class group that the assumed colluders
    reduce to one honest member, sums that isolate one institution's value) is refused here,
    before any process starts: such a run is known to abort.
    """
    from secure_afl.deploy.client import COORDINATOR_HONEST, check_coordinator_choices
    from secure_afl.deploy.errors import CoordinatorChoiceRefusedError
    from secure_afl.deploy.local import exposing_layout_refusal
    from secure_afl.sim.data import CLASSES
    from secure_afl.sim.partial import PartialLabelError, assign_partial_labels

    o = options
    client_ids = tuple(f"client-{k}" for k in range(o.clients))
    drops = parse_drops(o.drops, client_ids, o.secure)
    private = o.dp_epsilon is not None
    if private and (o.balance == "client" or o.gram == "class"):
        raise RehearsalError(
            "--dp-epsilon needs --balance global and --gram global (plain sums and counts with clean "
            "sensitivities, SECURITY.md §9)"
        )
    balance = o.balance or ("global" if private or o.sessions > 1 else "client")
    if o.sessions > 1 and (balance != "global" or o.rounds != 1 or o.drops or o.rehearse_abort):
        raise RehearsalError(
            "--sessions > 1 (a federation that grows) needs --balance global and --rounds 1, without "
            "--drop or --rehearse-abort: the paper's per-client balance and round 2 do not add across "
            "sessions (a federation that grows, docs)"
        )
    try:
        assignment = assign_partial_labels(o.clients, len(CLASSES), o.missing, seed=o.seed)
    except PartialLabelError as exc:
        raise RehearsalError(str(exc), "--missing") from None
    try:
        study = Study(
            classes=CLASSES,
            dim=o.dim,
            backbone={
                "name": "embedded-synthetic",
                "weights_id": f"synthetic-seed-{o.seed}-dim-{o.dim}-fraction-{o.fraction}",
                "preprocessing": "none (synthetic features of the embedded ChestXray14 cohort)",
            },
            method=Method(gamma=o.gamma, balance=balance, gram=o.gram, rounds=o.rounds),
            protection=o.secure,
            ckks_degree=int(o.ckks_degree),
            dp=None
            if not private
            else StudyDp(
                epsilon=o.dp_epsilon,  # type: ignore[arg-type]
                delta=o.dp_delta,
                clip=o.clip
                if o.clip is not None
                else (DEFAULT_CENTRED_CLIP if o.dp_row_centre else DEFAULT_CLIP),
                unit=o.dp_unit,
                max_images_per_patient=o.dp_max_images_per_patient,
                # the class lists are public under DP: every client sizes its noise from them
                class_lists={cid: tuple(assignment.active[k]) for k, cid in enumerate(client_ids)},
                projection_dim=o.dp_dim,
                projection_seed=o.dp_projection_seed,
                ridge=default_ridge(o.dp_ridge, o.dp_dim),
                class_sums=o.dp_class_sums or "split",
                row_centre=o.dp_row_centre,
            ),
        )
    except ConfigurationError as exc:
        raise RehearsalError(str(exc), "") from None
    try:  # each node's own rule (SECURITY.md §3.6): refused here, before any process starts
        check_coordinator_choices(study, o.coordinator)
    except CoordinatorChoiceRefusedError as exc:
        raise RehearsalError(
            f"{exc}. deploy local: --coordinator {COORDINATOR_HONEST} writes that declaration into every "
            "node's config",
            "--coordinator",
        ) from None
    live = [k for k, cid in enumerate(client_ids) if cid not in drops]
    # A client dropped after its upload (R3, R4) is still in the sums: only R1/R2 drops shrink a group.
    summed = [k for k, cid in enumerate(client_ids) if drops.get(cid) not in ("R1", "R2")]
    threshold = deployment_threshold(o.clients)
    if o.secure == "mask" and len(live) < threshold:
        raise RehearsalError(
            f"{len(live)} of {o.clients} institutions would remain, fewer than the threshold t={threshold} "
            f"(⌊2n/3⌋+1): drop fewer"
        )
    try:
        assumed = parse_colluders(o.colluders, o.clients, threshold)
    except ConfigurationError:
        raise RehearsalError(
            f'{o.colluders!r}: give "n-t" or a number of institutions', "--colluders"
        ) from None
    # Each node refuses a class group that its assumed colluders would reduce to one honest member
    # (SECURITY.md §3): such a run is known to abort, so it is refused here.
    needed = max(study.min_group_size, assumed + 2)
    for c, name in enumerate(CLASSES):
        labelling = [client_ids[k] for k in summed if c in assignment.active[k]]
        if len(labelling) < needed:
            why = (
                f"the minimum group size {study.min_group_size}"
                if needed == study.min_group_size
                else f"the {needed} that each institution's exposure check needs with {assumed} "
                f"colluder(s) assumed (--colluders {o.colluders})"
            )
            raise RehearsalError(
                f"class {name} would be labelled by {len(labelling)} surviving institution(s) "
                f"{labelling}, fewer than {why}: use more --clients, a lower --missing, another --seed "
                "or another --drop"
            )
    refusal = exposing_layout_refusal(study, assignment.active, list(client_ids), summed, assumed)
    if refusal:
        raise RehearsalError(refusal)
    return RehearsalPlan(o, study, client_ids, assignment, drops, assumed)


# --- the run -------------------------------------------------------------------------------------


@dataclass
class RehearsalReport:
    """What a rehearsal found; :func:`rehearse` raises :class:`RehearsalFailed` when ``agree`` is
    false (after writing everything)."""

    plan: RehearsalPlan
    result: Any  # deploy.local.LocalResult
    data_seconds: float
    growth: list[dict[str, Any]] = field(default_factory=list)  # a federation that grows: per session
    reference: Reference | None = None
    deployed: Mapping[str, float] = field(default_factory=dict)  # macro BACC, AUC, mAP on the test rows
    simulated: Mapping[str, float] = field(default_factory=dict)
    dropouts: Mapping[str, list[str]] = field(default_factory=dict)
    identical: bool = False  # the weights bit for bit
    weight_error: float = 0.0  # max |Δw|
    relative_error: float = 0.0  # of max |w|
    metric_error: float = 0.0  # max |Δ metric|
    same_survivors: bool = False
    copies: Mapping[str, bool] = field(default_factory=dict)  # node -> its classifier.json is the same file
    weights_digest: str = ""

    def failure(self) -> str | None:
        """Why the rehearsal failed its check (None: it passed).  A federation that grows is
        checked as it runs (:func:`report_growth` raises)."""
        rehearsal = self.result.abort_rehearsal
        if rehearsal is not None:
            moved = [p for p in rehearsal.moved if p.name.startswith("classifier.")]
            if rehearsal.ok or not moved or rehearsal.classifier_path.exists():
                return (
                    "the abort rehearsal did not fail as it must (the coordinator's command would have "
                    f"exited 0 or left a classifier.json); see {rehearsal.log_path}"
                )
        if self.growth or self.reference is None:
            return None
        if not self.agree:
            return "the deployed classifier differs from the simulation's over the same survivors"
        return None

    @property
    def within_ckks_precision(self) -> bool:
        """The weights and metrics within CKKS's tolerances of the simulation's (CKKS rounds every
        decrypted sum, so they are not equal bit for bit)."""
        return (
            self.relative_error <= CKKS_RELATIVE_WEIGHT_TOLERANCE
            and self.metric_error <= CKKS_METRIC_TOLERANCE
        )

    @property
    def agree(self) -> bool:
        """The deployment's classifier is the simulation's: bit for bit (mask), within CKKS's
        precision (ckks); under DP the sums are noisy, so only the survivors are compared."""
        study = self.plan.study
        if study.dp is not None:
            same = True
        elif study.protection == "mask":
            same = self.identical
        else:
            same = self.within_ckks_precision
        return same and self.same_survivors


def synthetic_image_digests(names: np.ndarray, of: str = "image") -> list[str]:
    """The embedded cohort's stand-in for each row's image-file digest (``of="image"``) or pixel
    digest (``of="pixels"``; its features are synthetic): SHA-256 of the image's name, so a rerun of
    `deploy local` names the same images."""
    return [hashlib.sha256(f"secure-afl/synthetic-{of}\x00{n}".encode()).hexdigest() for n in names]


def reference_dropouts(report: Mapping, participants: Collection[str]) -> dict[str, list[str]]:
    """From the server's report: the first round of session 1 each participant failed to answer."""
    first: dict[str, str] = {}
    events = [*report["dropouts"], *report["refusals"], *report["rejections"]]
    for event in sorted(events, key=lambda e: e["at"]):
        who = event.get("client", event.get("from"))
        if not event["at"].startswith("session 1 ") or who not in participants:
            continue
        first.setdefault(who, event["at"].split()[-1])
    dropouts: dict[str, list[str]] = {}
    for cid, round_name in first.items():
        dropouts.setdefault(round_name, []).append(cid)
    return dropouts


def rehearse(plan: RehearsalPlan, out_dir: Path, *, say: Say = print, network: Any = None) -> RehearsalReport:
    """Run the planned federation and compare it with the simulation; see the module docstring.

    ``out_dir`` gets everything worth keeping (report.json, classifier.json, roster.json, every
    process's log, test-features.npz for ``predict``), also when the run fails; keys, certificates
    and ledgers stay in a temporary directory deleted at the end (unless ``keep``), so no line
    printed names a file in it.  Raises :class:`~secure_afl.deploy.errors.DeploymentError` when the
    federation fails, :class:`RehearsalFailed` when its check does.  ``network``: where the nodes run
    and how they reach the SuperLink (:class:`~secure_afl.deploy.local.Network`; bench/bench_faults.py).
    """
    from secure_afl.deploy.local import run_local
    from secure_afl.features.file import save_feature_file
    from secure_afl.sim.data import CLASSES
    from secure_afl.sim.datasets import prepare
    from secure_afl.sim.metrics import evaluate

    o, study, assignment, client_ids = plan.options, plan.study, plan.assignment, plan.client_ids
    sessions = o.sessions
    out_dir = out_dir.resolve()
    logs_dir = out_dir / "logs"
    if logs_dir.is_dir():
        shutil.rmtree(logs_dir)  # an earlier run's logs: one run's logs only
    logs_dir.mkdir(parents=True)
    work_dir = Path(tempfile.mkdtemp(prefix="secure-afl-deploy-"))
    try:
        started = time.perf_counter()
        say(f"preparing the embedded data for {o.clients} institutions (as `secure-afl sim` partitions it)")
        data = prepare(None, fraction=o.fraction, dim=o.dim, seed=o.seed, n_clients=o.clients)
        (work_dir / "data").mkdir()
        client_data: dict[str, ClientData] = {}
        files: dict[str, Path] = {}

        def write(k: int, cid: str, arrived: int) -> None:
            """client k's feature file with its first ``arrived`` of ``sessions`` batches of rows."""
            rows = data.split.clients[k]
            rows = rows[: -(-len(rows) * arrived // sessions)]
            labels = data.cohort.labels[rows].astype(np.uint8)
            labels[:, [c for c in range(len(CLASSES)) if c not in assignment.active[k]]] = 0
            save_feature_file(
                files[cid], data.features[rows], labels=labels, active=assignment.active[k], classes=CLASSES,
                backbone=study.backbone["name"], weights_id=study.backbone["weights_id"],
                preprocessing=study.backbone["preprocessing"],
                patient_ids=[str(p) for p in data.cohort.patient_ids[rows]],
                image_sha256=synthetic_image_digests(data.cohort.image_names[rows]),
                pixel_sha256=synthetic_image_digests(data.cohort.image_names[rows], "pixels"),
            )  # fmt: skip
            client_data[cid] = (data.features[rows], labels, tuple(assignment.active[k]))

        def arrive(session: int) -> None:
            for k, cid in enumerate(client_ids):
                write(k, cid, session + 1)
            if session:
                say(f"session {session + 1}: each institution's batch {session + 1} of {sessions} arrived")

        for k, cid in enumerate(client_ids):
            files[cid] = work_dir / "data" / f"{cid}.npz"
            write(k, cid, 1 if sessions > 1 else sessions)
        test_rows = data.split.test
        test_features = out_dir / "test-features.npz"
        save_feature_file(
            test_features, data.features[test_rows], labels=data.cohort.labels[test_rows].astype(np.uint8),
            active=range(len(CLASSES)), classes=CLASSES, backbone=study.backbone["name"],
            weights_id=study.backbone["weights_id"], preprocessing=study.backbone["preprocessing"],
        )  # fmt: skip
        say(f"wrote {test_features}: the {len(test_rows)} held-out images' features, labelled (for predict)")
        data_seconds = time.perf_counter() - started
        say(
            f"  {len(data.split.test)} test rows; classes each institution labels: "
            f"{[list(a) for a in assignment.active]}"
        )
        result = run_local(
            work_dir, files, study, tls=o.tls, drops=dict(plan.drops), round_timeout=o.round_timeout, say=say,
            colluders=o.colluders, coordinator=o.coordinator, server_dir=out_dir, logs_dir=logs_dir,
            rehearse_abort=o.rehearse_abort,
            sessions=sessions, arrive=arrive if sessions > 1 else None, metrics=o.metrics,
            network=network,
        )  # fmt: skip
        report = RehearsalReport(plan, result, data_seconds)
        if sessions > 1:
            report.growth = report_growth(
                result, study, data, assignment, list(client_ids), sessions, out_dir, say
            )
            return report
        session1 = result.report["sessions"][0]
        participants = session1["participants"]
        report.dropouts = reference_dropouts(result.report, participants)
        say("computing the in-process simulation over the same survivors")
        reference = reference_classifier(
            {cid: client_data[cid] for cid in participants}, study, roster_size=o.clients,
            dropouts=report.dropouts, colluders=o.colluders,
        )  # fmt: skip
        test_x, test_y = data.features[data.split.test], data.cohort.labels[data.split.test]
        # metrics rank the scores (logits), as the simulator's do
        report.reference = reference
        report.deployed = evaluate(
            test_y, test_x.astype(np.float64) @ result.classifier.weights, kind="logits"
        ).macro
        report.simulated = evaluate(test_y, test_x.astype(np.float64) @ reference.coef, kind="logits").macro
        report.identical = result.classifier.weights.tobytes() == reference.coef.tobytes()
        report.same_survivors = tuple(session1["survivors"]) == reference.survivors
        report.weight_error = float(np.max(np.abs(result.classifier.weights - reference.coef)))
        report.relative_error = report.weight_error / max(
            float(np.max(np.abs(reference.coef))), np.finfo(float).tiny
        )
        report.metric_error = max(
            abs(report.deployed[k] - report.simulated[k]) for k in ("bacc", "auc", "map")
        )
        report.weights_digest = hashlib.sha256(result.classifier.weights.tobytes()).hexdigest()[:16]
        report.copies = {
            cid: result.classifier_path is not None
            and path.read_bytes() == result.classifier_path.read_bytes()
            for cid, path in result.node_classifiers.items()
        }
        # classifier.json is the ServerApp's own file, written in out_dir as `deploy run` leaves it
        (out_dir / "report.json").write_text(
            json.dumps({**result.report, "local_seconds": result.seconds, "killed": result.killed}, indent=1)
        )
        return report
    finally:
        roster_file = work_dir / "keys" / "roster.json"
        if roster_file.is_file():  # public; verifies the classifier's signature, also after a failure
            shutil.copyfile(roster_file, out_dir / "roster.json")
        if o.keep:
            say(f"kept {work_dir}")
        else:
            shutil.rmtree(work_dir, ignore_errors=True)


def report_growth(
    result: Any, study: Any, data: Any, assignment: Any, client_ids: list[str], sessions: int,
    out_dir: Path, say: Callable[[str], None],
) -> None:  # fmt: skip
    """Each session's classifier against the centralised fit on every image released so far (float64
    statistics of the pooled rows, no protocol), with the test metrics; raises if any is off."""
    from secure_afl.analytic import AnalyticClassifier, client_statistics, sum_contributions
    from secure_afl.sim.metrics import evaluate

    test_x, test_y = data.features[data.split.test], data.cohort.labels[data.split.test]
    method, records, private = study.method, [], study.dp is not None
    for k, (classifier, report) in enumerate(result.sessions):
        contributions = []
        for i, _ in enumerate(client_ids):
            rows = data.split.clients[i]
            rows = rows[: -(-len(rows) * (k + 1) // sessions)]
            labels = data.cohort.labels[rows].astype(np.uint8)
            stats = client_statistics(data.features[rows], labels, device="cpu")
            contributions.append(
                stats.contributions(assignment.active[i], balance="global", gram=method.gram)
            )
        centralised = AnalyticClassifier(
            len(study.classes), gamma=method.gamma, balance="global", gram=method.gram
        ).fit(sum_contributions(contributions))
        error = float(np.max(np.abs(classifier.weights - centralised.coef_)))
        metrics = evaluate(test_y, test_x.astype(np.float64) @ classifier.weights, kind="logits").macro
        records.append(
            {"session": k + 1, "study_digest": classifier.study_digest, "max_abs_w_vs_centralised": error,
             "metrics": {key: float(metrics[key]) for key in ("bacc", "auc", "map")},
             "survivors": report["sessions"][0]["survivors"]}
        )  # fmt: skip
        noisy = " (DP: noisy sums, reported, not checked)" if private else ""
        say(
            f"session {k + 1}: max |w - w_centralised| = {error:.3g} over every image released so far"
            f"{noisy}; BACC {100 * metrics['bacc']:.2f} %, AUC {100 * metrics['auc']:.2f} %, "
            f"mAP {metrics['map']:.4f}"
        )
    (out_dir / "report.json").write_text(json.dumps({**result.report, "growth": records}, indent=1))
    say(f"wrote {out_dir / 'classifier.json'} (session {sessions}'s) and {out_dir / 'report.json'}")
    if private:  # the chain's ε per institution, as its signed classifier records it
        for line in result.sessions[-1][0].privacy_lines():
            say(line)
        return
    worst = max(r["max_abs_w_vs_centralised"] for r in records)
    if not worst <= GROWTH_TOLERANCE:
        raise RehearsalFailed(
            f"a session's classifier is {worst:.3g} from the centralised fit (tolerance {GROWTH_TOLERANCE:g})"
        )
