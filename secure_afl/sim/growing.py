"""``secure-afl sim --scenario growing``: a federation that retrains as hospitals acquire images.

Each client's training rows arrive over K sessions.  **How they are split:** client k's rows are
shuffled by a generator seeded with ``(seed, 0x6057, k)`` (a simulation split, nothing secret) and
cut into near-equal consecutive parts (``numpy.array_split``), one per session in which it has new
rows; a client named idle in a session (``idle``: ``(session, client)`` pairs, sessions numbered
from 1, clients from 0) gets no part there,
so its rows are cut into as many parts as it has other sessions.  The label assignment (which
classes each client labels) is the partial-label protocol's, fixed for the study.

Every session runs through the real secure path (``secure="mask"`` by default, ``"ckks"``, or
``"none"`` in the clear) over that session's **new rows only**, in the additive layout:
``balance="global"`` (positive sums and counts, total sums and counts) with ``gram="global"`` (the
deployment's default; ``"class"`` works as well).  The server adds the session's sums to the
earlier ones (:func:`secure_afl.growth.accumulate_sums`) and solves.  Per session the result
records ``max_abs_w_vs_centralised``, the largest difference between the federated classifier and
the centralised global-balance fit computed in one plaintext pass over every row released so far
(pooled, no sessions, no protocol), and BACC/AUC/mAP on the test split.

**An idle client** is still a member of the session: it has no new rows, so it contributes zeros,
and it has committed to releasing 0 rows, so the server *knows* that zero.  Its value then hides
nothing: the session audit is computed a second time with every idle client's value known to the
server (taken out of the survivor sets, as a colluder's is), and lists what that exposes.

**Round 2 is refused in a growing study.**  Its pseudo-label projection ``b_pseudo`` is a
per-client mean difference, not a sum, so sessions do not add (the result would depend on how the
images were cut into sessions); its pseudo-labels come from a teacher that changes every session,
and re-labelling earlier rows with the new teacher would release them a second time, against the
one-contribution-per-image rule.  There is no exact round 2 of a union, so a growing study fits
round 1 only (which, with the paper's ``±1/N`` targets and τ = 0.7, is what round 2 leaves anyway).

**Under --dp-epsilon** (``--protection mask`` or ``none``; :class:`secure_afl.sim.private.PrivateGrowth`)
every client clips, rounds and noises the DP layout's statistics of its new rows under one noise
plan for the study (a client with none noises zeros: it commits nothing, so nothing is a known
zero), the server accumulates the noisy sums and solves with the chain's noise
(:mod:`secure_afl.privacy.dp_growth`: the ridge from ``√(Σ_k s_k²)``; ε the max over sessions
under the image unit, composed under the patient unit, whose cap holds per session).  The
reference of ``max_abs_w_vs_centralised`` is then the noise-free fit of the same clipped (and
projected) rows, every released row pooled; each session's record holds its ε and the chain's.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from rich import box
from rich.console import Console
from rich.table import Table

from secure_afl.analytic import (
    ALL_GROUP,
    AnalyticClassifier,
    ClientStatistics,
    Contributions,
    UndefinedBalanceWarning,
    class_group,
    client_statistics,
)
from secure_afl.core.encoding import unpack_symmetric
from secure_afl.core.randomness import OsRandomSource, RandomSource
from secure_afl.growth import accumulate_sums
from secure_afl.sim.audit import SINGLE_SURVIVOR_WARNING, PrivacyAudit, audit_groups
from secure_afl.sim.data import CLASSES
from secure_afl.sim.datasets import PreparedData, Progress
from secure_afl.sim.metrics import Metrics, evaluate
from secure_afl.sim.partial import LabelAssignment, assign_partial_labels
from secure_afl.sim.setting import SYMMETRIC_TENSORS, ExperimentError, SimConfig, aggregate, client_id
from secure_afl.torch_threads import one_torch_thread

GROWING_SECURE = ("none", "mask", "ckks")
ARRIVAL_STREAM = 0x6057
EXACT_BAR = 1e-9  # max |W − W_centralised| the exact protections (none, mask) stay under

GramScope = Literal["class", "global"]


def _no_progress(task: str, done: int, total: int) -> None:
    return None


@dataclass(frozen=True)
class GrowingConfig:
    """A growing study: the simulator's settings, the number of sessions and the idle clients."""

    sim: SimConfig = field(default_factory=lambda: SimConfig(rounds=1))
    sessions: int = 3
    idle: tuple[tuple[int, int], ...] = ()  # (session 1..K, client index): no new rows in that session
    gram: GramScope = "global"

    def validate(self) -> None:
        sim = self.sim
        sim.validate()
        if sim.rounds != 1:
            raise ExperimentError(
                "a growing study fits round 1 only: round 2's pseudo-label projection is a per-client "
                "mean, not a sum over images, and its teacher changes every session, so sessions do not "
                "add and re-labelling earlier rows would release them again; use --rounds 1"
            )
        if len(sim.missing) != 1:
            raise ExperimentError("--scenario growing runs one --missing level at a time")
        if sim.secure not in GROWING_SECURE:
            raise ExperimentError(
                f"--scenario growing protects each session with one of {', '.join(GROWING_SECURE)}, "
                f"got {sim.secure!r}"
            )
        if sim.dropout:
            raise ExperimentError(
                "--dropout is not supported with --scenario growing (a dropped client's new rows would "
                "have to be released in a later session)"
            )
        if sim.dp is not None and self.gram != "global":
            raise ExperimentError("differential privacy needs gram='global' (the DP layout's one Gram)")
        if sim.baselines:
            raise ExperimentError("--baselines are not run with --scenario growing (AFL only)")
        if self.gram not in ("class", "global"):
            raise ExperimentError(f"gram must be 'class' or 'global', got {self.gram!r}")
        if not isinstance(self.sessions, int) or self.sessions < 1:
            raise ExperimentError(f"--sessions must be at least 1, got {self.sessions!r}")
        for session, k in self.idle:
            if not 1 <= session <= self.sessions or not 0 <= k < sim.n_clients:
                raise ExperimentError(
                    f"idle {session}:{k} names no session 1..{self.sessions} or no client "
                    f"0..{sim.n_clients - 1}"
                )
        for k in range(sim.n_clients):
            if all((s, k) in self.idle for s in range(1, self.sessions + 1)):
                raise ExperimentError(f"client {k} is idle in every session: its rows would never arrive")
        for s in range(1, self.sessions + 1):
            if all((s, k) in self.idle for k in range(sim.n_clients)):
                raise ExperimentError(f"every client is idle in session {s}: it would release nothing")


def arrivals(
    clients: Sequence[np.ndarray], sessions: int, idle: Sequence[tuple[int, int]], seed: int
) -> tuple[tuple[np.ndarray, ...], ...]:
    """``out[s - 1][k]``: the (sorted) rows client k releases in session s (empty where it is idle;
    ``idle`` numbers sessions from 1)."""
    idle_set = {(s - 1, k) for s, k in idle}
    per_client = []
    for k, rows in enumerate(clients):
        active = [s for s in range(sessions) if (s, k) not in idle_set]
        if len(rows) < len(active):
            raise ExperimentError(
                f"client {k} has {len(rows)} rows, fewer than its {len(active)} sessions with new rows; "
                "use a larger --fraction or fewer --sessions"
            )
        order = np.random.default_rng([seed, ARRIVAL_STREAM, k]).permutation(len(rows))
        parts = dict(zip(active, np.array_split(np.asarray(rows)[order], len(active)), strict=True))
        per_client.append([np.sort(parts.get(s, np.empty(0, dtype=np.int64))) for s in range(sessions)])
    return tuple(tuple(per_client[k][s] for k in range(len(clients))) for s in range(sessions))


@dataclass(frozen=True)
class SessionResult:
    session: int
    new_rows: Mapping[str, int]  # per client, this session
    released_rows: int  # every client, every session so far
    max_abs_w_vs_centralised: float
    max_abs_w: float  # the scale: max |W_centralised|
    metrics: Metrics
    audit: PrivacyAudit
    known_zero: tuple[str, ...]  # members with no new rows: the server knows their zero
    exposed_knowing_zeros: Mapping[str, tuple[str, ...]]  # tensor -> clients, with those zeros known
    costs: Mapping[str, object] | None
    seconds: float  # statistics, aggregation and solve (not the centralised reference)
    idle: tuple[str, ...] = ()  # members with no new rows (under DP: still adding their noise share)
    # under --dp-epsilon: secure_afl.privacy.dp_solve.privacy_record with the chain's ``growth`` part
    privacy: Mapping[str, object] | None = None
    released_sums: Contributions | None = field(default=None, repr=False, compare=False)  # this session's


@dataclass(frozen=True)
class GrowingResult:
    config: GrowingConfig
    assignment: LabelAssignment
    dataset: Mapping[str, object]
    sessions: tuple[SessionResult, ...]
    notice: str
    seconds: Mapping[str, float]
    accumulated: Contributions | None = field(default=None, repr=False, compare=False)  # every session's


def _zero_statistics(dim: int, n_classes: int) -> ClientStatistics:
    """What a member with no new rows releases: zero sums and zero counts."""
    return ClientStatistics(
        gram=np.zeros((dim, dim)),
        feat_sum=np.zeros(dim),
        pos_sum=np.zeros((dim, n_classes)),
        n=0,
        n_pos=np.zeros(n_classes, dtype=np.int64),
    )


def _rows_labelled(assignment: LabelAssignment, released: Sequence[np.ndarray], c: int) -> np.ndarray:
    members = assignment.coverage()[c]
    return np.sort(np.concatenate([released[k] for k in members])) if members else np.empty(0, np.int64)


def centralised_sums(
    data: PreparedData,
    assignment: LabelAssignment,
    released: Sequence[np.ndarray],
    gram: GramScope,
    device: str = "auto",
) -> Contributions:
    """The global-balance statistics of every released row, pooled, in one plaintext pass per class.

    ``released[k]``: every row client k has released so far.  Class c uses the rows of the clients
    that label it; ``gram="global"`` puts the Gram of all released rows in ``all``.
    """
    n_classes = data.cohort.labels.shape[1]
    out: Contributions = {}
    for c in range(n_classes):
        rows = _rows_labelled(assignment, released, c)
        if not len(rows):
            continue
        positive = data.cohort.labels[rows, c].astype(bool)
        pos_sum, feat_sum = np.zeros(data.features.shape[1]), np.zeros(data.features.shape[1])
        for start in range(0, len(rows), _CHUNK):  # float64 sums without a float64 copy of every row
            h = data.features[rows[start : start + _CHUNK]].astype(np.float64)
            feat_sum += h.sum(axis=0)
            pos_sum += h[positive[start : start + _CHUNK]].sum(axis=0)
        tensors = {
            f"pos_sum/{c}": pos_sum,
            f"n_pos/{c}": np.array([float(positive.sum())]),
            "feat_sum": feat_sum,
            "n": np.array([float(len(rows))]),
        }
        if gram == "class":
            tensors["gram"] = _gram(data, rows, device)
        out[class_group(c)] = tensors
    if gram == "global":
        out[ALL_GROUP] = {"gram": _gram(data, np.sort(np.concatenate(list(released))), device)}
    return out


_CHUNK = 8192


def _gram(data: PreparedData, rows: np.ndarray, device: str) -> np.ndarray:
    return client_statistics(data.features[rows], data.cohort.labels[rows], device=device).gram


def _fit(sums: Contributions, n_classes: int, gamma: float, gram: GramScope) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UndefinedBalanceWarning)  # the same convention on both sides
        model = AnalyticClassifier(n_classes, gamma=gamma, balance="global", gram=gram).fit(sums)
    assert model.coef_ is not None
    return model.coef_


class PlainGrowth:
    """The growing study's sessions without DP: each client's exact global-balance statistics of
    its new rows (an idle member's are zeros, which the server knows: it committed to 0 rows), the
    solve on the accumulated sums, and the centralised reference of every released row pooled.
    :class:`secure_afl.sim.private.PrivateGrowth` supplies the same steps under DP."""

    knows_idle_zeros = True

    def __init__(self, data: PreparedData, config: GrowingConfig, assignment: LabelAssignment) -> None:
        self.data, self.config, self.assignment, self.active = data, config, assignment, assignment.active
        self.names = [client_id(k) for k in range(len(self.active))]
        self.n_classes = int(data.cohort.labels.shape[1])

    def uploads(
        self, session: Sequence[np.ndarray], progress: Progress, label: str
    ) -> tuple[dict[str, Contributions], dict[str, Contributions]]:
        """Every client's upload over its new rows ``session[k]``, and the same values (nothing is
        noised: the reference needs no clean copy)."""
        sim, dim = self.config.sim, int(self.data.features.shape[1])
        out: dict[str, Contributions] = {}
        for k, name in enumerate(self.names):
            rows = session[k]
            stats = (
                client_statistics(self.data.features[rows], self.data.cohort.labels[rows], device=sim.device)
                if len(rows)
                else _zero_statistics(dim, self.n_classes)
            )
            out[name] = stats.contributions(self.active[k], balance="global", gram=self.config.gram)
            progress(label, k + 1, len(self.names))
        return out, out

    def solve(
        self, total: Contributions, clean: Mapping[str, Contributions], gram_survivors: int
    ) -> tuple[np.ndarray, Mapping[str, object] | None]:
        return _fit(total, self.n_classes, self.config.sim.gamma, self.config.gram), None

    def reference(self, released: Sequence[np.ndarray]) -> np.ndarray:
        """The centralised global-balance fit of every released row, pooled, in one plaintext pass."""
        sim = self.config.sim
        sums = centralised_sums(self.data, self.assignment, released, self.config.gram, sim.device)
        return _fit(sums, self.n_classes, sim.gamma, self.config.gram)


def run_growing(
    config: GrowingConfig,
    *,
    progress: Progress = _no_progress,
    data: PreparedData | None = None,
    random: RandomSource | None = None,
) -> GrowingResult:
    """The growing study; ``data``: the prepared data, when already at hand; ``random``: the DP
    noise's randomness under ``--dp-epsilon`` (the operating system's by default)."""
    config.validate()
    sim = config.sim
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    if data is None:
        from secure_afl.sim.datasets import DataRequest

        request = DataRequest(sim.fraction, sim.dim, sim.seed, sim.n_clients, sim.split)
        data = request.prepare(sim.images, progress)
    seconds["data"] = time.perf_counter() - started
    n_classes = data.cohort.labels.shape[1]
    assignment = assign_partial_labels(
        sim.n_clients, n_classes, sim.missing[0], seed=sim.seed, missing1=sim.missing1
    )
    parts = arrivals(data.split.clients, config.sessions, config.idle, sim.seed)
    names = [client_id(k) for k in range(sim.n_clients)]
    released: list[np.ndarray] = [np.empty(0, dtype=np.int64) for _ in names]
    for s, session in enumerate(parts):
        for c in range(n_classes):
            covered = sum(len(released[k]) + len(session[k]) for k in assignment.coverage()[c])
            if not covered:
                name = CLASSES[c] if c < len(CLASSES) else c
                raise ExperimentError(
                    f"after session {s + 1} class {name} has no released row "
                    "(every client that labels it is idle so far): its classifier would be undefined; "
                    "change --idle"
                )
        released = [np.concatenate([released[k], session[k]]) for k in range(len(names))]
    # One session loop; the growth mechanism supplies the uploads, the solve and the reference.
    growth: PlainGrowth | PrivateGrowth
    if sim.dp is not None:
        from secure_afl.sim.private import PrivateGrowth

        growth = PrivateGrowth(data, sim, assignment.active, OsRandomSource() if random is None else random)
    else:
        growth = PlainGrowth(data, config, assignment)
    test_x = data.features[data.split.test].astype(np.float64)
    test_y = data.cohort.labels[data.split.test]
    total: Contributions | None = None
    released = [np.empty(0, dtype=np.int64) for _ in names]
    results = []
    with one_torch_thread():
        for s, session in enumerate(parts):
            began = time.perf_counter()
            contributions, clean = growth.uploads(session, progress, f"session {s + 1} statistics")
            agg = aggregate(
                contributions, sim, dropouts={}, round_label=f"growing session {s + 1}/{config.sessions}"
            )
            total = accumulate_sums(total, _full_matrices(agg.sums))
            released = [np.concatenate([released[k], session[k]]) for k in range(len(names))]
            coef, privacy = growth.solve(total, clean, len(agg.survivors.get(ALL_GROUP, ())))
            session_seconds = time.perf_counter() - began
            began = time.perf_counter()
            reference = growth.reference(released)
            seconds["centralised reference"] = seconds.get("centralised reference", 0.0) + (
                time.perf_counter() - began
            )
            idle = tuple(name for k, name in enumerate(names) if not len(session[k]))
            # Under DP no member commits counts and an idle member's upload is its own noise: no
            # value is known to the server, so there is no second audit with known zeros.
            known = idle if growth.knows_idle_zeros else ()
            audit = audit_groups(
                protection=sim.secure,
                members=agg.members,
                survivors=agg.survivors,
                tensors=agg.tensors,
                contributions=contributions,
                client_findings=agg.client_findings,
            )
            knowing = audit_groups(
                protection=sim.secure,
                members=agg.members,
                survivors={
                    g: tuple(c for c in alive if c not in known) for g, alive in agg.survivors.items()
                },
                tensors=agg.tensors,
                contributions={c: v for c, v in contributions.items() if c not in known},
            )
            results.append(
                SessionResult(
                    session=s + 1,
                    new_rows={name: len(session[k]) for k, name in enumerate(names)},
                    released_rows=int(sum(len(r) for r in released)),
                    max_abs_w_vs_centralised=float(np.abs(coef - reference).max()),
                    max_abs_w=float(np.abs(reference).max()),
                    metrics=evaluate(test_y, test_x @ coef, kind="logits"),
                    audit=audit,
                    known_zero=known,
                    exposed_knowing_zeros=(
                        dict(knowing.exposed) if sim.secure != "none" and growth.knows_idle_zeros else {}
                    ),
                    costs=agg.costs,
                    seconds=session_seconds,
                    idle=idle,
                    privacy=privacy,
                    released_sums=_full_matrices(agg.sums),
                )
            )
    seconds["sessions"] = sum(r.seconds for r in results)
    notice = ""
    if data.description.get("synthetic_features"):
        from secure_afl.sim.setting import SYNTHETIC_NOTICE

        notice = SYNTHETIC_NOTICE
    return GrowingResult(
        config=config,
        assignment=assignment,
        dataset=data.description,
        sessions=tuple(results),
        notice=notice,
        seconds=seconds,
        accumulated=total,
    )


# ----------------------------------------------------------------------------------------------
# Reports
# ----------------------------------------------------------------------------------------------


def _growth_privacy(r: SessionResult) -> Mapping[str, object]:
    assert r.privacy is not None
    growth = r.privacy["growth"]
    assert isinstance(growth, Mapping)
    return growth


def session_rows(result: GrowingResult) -> tuple[list[str], list[list[str]]]:
    private = result.config.sim.dp is not None
    header = ["Session", "New", "Released", "max|ΔW|", "max|W|", "BACC", "AUC", "mAP", "Idle"]
    if private:
        header[-1:-1] = ["ε session", "ε chain"]
    rows = []
    for r in result.sessions:
        macro = r.metrics.macro
        row = [
            str(r.session),
            str(sum(r.new_rows.values())),
            str(r.released_rows),
            f"{r.max_abs_w_vs_centralised:.1e}",
            f"{r.max_abs_w:.1e}",
            f"{100 * macro['bacc']:.2f}",
            f"{100 * macro['auc']:.2f}",
            f"{macro['map']:.4f}",
            ", ".join(r.idle) or "-",
        ]
        if private:
            spent = r.privacy["epsilon_spent"]  # type: ignore[index]
            chain = _growth_privacy(r)["epsilon_chain"]
            assert isinstance(spent, Mapping) and isinstance(chain, Mapping)
            row[-1:-1] = [f"{max(spent.values()):.4f}", f"{max(chain.values()):.4f}"]
        rows.append(row)
    return header, rows


def privacy_growth_lines(result: GrowingResult) -> list[str]:
    """Under --dp-epsilon: how the chain's ε is counted, its ridge, and what idle members send."""
    if result.config.sim.dp is None or not result.sessions:
        return []
    last = result.sessions[-1]
    growth = _growth_privacy(last)
    chain = growth["epsilon_chain"]
    assert isinstance(chain, Mapping) and last.privacy is not None
    lines = [
        f"differential privacy: {growth['composition_note']}; chain ε per institution (worst) "
        f"{max(chain.values()):.4f} at δ = {growth['delta_chain']:g}",
        f"the chain's Gram noise std √(Σ s_k²) = {growth['gram_noise_std_chain']:.4g} sizes the last "
        f"solve's ridge λ = {last.privacy['ridge']:.4g} ({last.privacy['ridge_kind']})",
    ]
    if any(r.idle for r in result.sessions):
        lines.append(
            "members with no new rows commit no counts under DP and still add their noise share: the "
            "server knows no member's value (nothing is a known zero)"
        )
    return lines


def known_zero_lines(result: GrowingResult) -> list[str]:
    """One line per session with idle members: the server knows their zero, and what that exposes."""
    lines = []
    for r in result.sessions:
        if not r.known_zero:
            continue
        exposed = {t: c for t, c in r.exposed_knowing_zeros.items() if t not in r.audit.exposed}
        line = (
            f"session {r.session}: {', '.join(r.known_zero)} released no new rows and contributed zeros, "
            "which the server knows (a committed zero is a known value, like a colluder's)"
        )
        if exposed:
            shown = "; ".join(f"{t}: {', '.join(c)}" for t, c in sorted(exposed.items()))
            line += f"; with those zeros known the sums also determine {shown}"
        else:
            line += "; the sums determine no further value with those zeros known"
        lines.append(line)
    return lines


def print_growing_report(result: GrowingResult, console: Console) -> None:
    if result.notice:
        console.print(f"[bold yellow]{result.notice}[/]")
    sim = result.config.sim
    table = Table(
        title=(
            f"A growing federation: {result.config.sessions} sessions, missing {sim.missing[0]}, "
            f"--protection {sim.secure}, balance=global, gram={result.config.gram}"
        ),
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    header, rows = session_rows(result)
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i in (0, len(header) - 1) else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    reference = (
        "the centralised global-balance fit on every row released so far (one pooled plaintext pass)"
        if sim.dp is None
        else "the noise-free fit of the same clipped rows, every row released so far pooled"
    )
    console.print(
        f"New: rows released in the session; ΔW = W − W_central, W_central {reference}; Idle: members "
        "with no new rows" + ("; ε: the worst institution's" if sim.dp is not None else "") + ".",
        markup=False,
        highlight=False,
    )
    for line in [*known_zero_lines(result), *privacy_growth_lines(result)]:
        console.print(line, markup=False, highlight=False)
    for line, sessions in audit_warnings(result).items():
        where = "every session" if len(sessions) == len(result.sessions) else f"sessions {sessions}"
        console.print(f"[bold red]WARNING ({where}):[/] {line}", highlight=False)


def audit_warnings(result: GrowingResult) -> dict[str, list[int]]:
    """Each loud audit line once, with the sessions it was raised in; the single-survivor groups of a
    session in one line."""
    out: dict[str, list[int]] = {}
    for r in result.sessions:
        alone = [g for g in r.audit.single_member_groups() if g.warning]  # none in a plaintext run
        lines = [line for line in r.audit.warnings() if line not in {g.warning for g in alone}]
        if alone:
            names = ", ".join(f"{g.group} ({g.survivors[0]})" for g in alone)
            lines.insert(0, f"single-member groups {names}: {SINGLE_SURVIVOR_WARNING}, in each")
        for line in lines:
            out.setdefault(line, []).append(r.session)
    return out


def to_json(result: GrowingResult) -> dict[str, object]:
    config = asdict(result.config)
    images = result.config.sim.images
    config["sim"]["images"] = None if images is None else {k: str(v) for k, v in asdict(images).items()}
    return {
        "scenario": "growing",
        "notice": result.notice,
        "config": config,
        "dataset": dict(result.dataset),
        "classes": list(CLASSES),
        "assignment": [list(a) for a in result.assignment.active],
        "arrivals": (
            "each client's training rows, shuffled by numpy.random.default_rng([seed, 0x6057, k]), cut "
            "into near-equal consecutive parts (numpy.array_split), one per session with new rows"
        ),
        "layout": {"balance": "global", "gram": result.config.gram, "rounds": 1},
        "reference": (
            "the centralised global-balance fit on every row released so far (one pooled plaintext pass)"
            if result.config.sim.dp is None
            else "the noise-free fit of the same clipped (and projected) rows, every released row pooled"
        ),
        "differential_privacy": (
            _growth_privacy(result.sessions[-1])
            if result.config.sim.dp is not None and result.sessions
            else None
        ),
        "sessions": [
            {
                "session": r.session,
                "new_rows": dict(r.new_rows),
                "released_rows": r.released_rows,
                "max_abs_w_vs_centralised": r.max_abs_w_vs_centralised,
                "max_abs_w": r.max_abs_w,
                "metrics": r.metrics.to_dict(),
                "known_zero": list(r.known_zero),
                "idle": list(r.idle),
                "differential_privacy": r.privacy,
                "exposed_knowing_zeros": {t: list(c) for t, c in r.exposed_knowing_zeros.items()},
                "audit": r.audit.to_dict(),
                "protocol_costs": r.costs,
                "seconds": r.seconds,
            }
            for r in result.sessions
        ],
        "seconds_per_phase": dict(result.seconds),
    }


def _json_default(value: object) -> object:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (bytes, Path)):
        return str(value)
    raise TypeError(f"cannot serialise {type(value).__name__}")


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def write_growing_reports(result: GrowingResult, out_dir: Path) -> tuple[Path, Path]:
    """results.json (every session's numbers and audit) and report.md (the table)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps(_finite(to_json(result)), indent=2, default=_json_default))
    header, rows = session_rows(result)
    lines = ["# secure-afl sim --scenario growing", ""]
    if result.notice:
        lines += [f"**{result.notice}**", ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", *known_zero_lines(result), *privacy_growth_lines(result), ""]
    md_path = out_dir / "report.md"
    md_path.write_text("\n".join(lines))
    return json_path, md_path


def _full_matrices(sums: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, dict[str, np.ndarray]]:
    """A session's sums with each symmetric tensor as its full matrix (the aggregation leaves the
    Grams as packed triangles for the solve; the accumulated sums and the growth check take them whole)."""
    return {
        group: {
            name: unpack_symmetric(v) if name in SYMMETRIC_TENSORS and np.ndim(v) == 1 else v
            for name, v in tensors.items()
        }
        for group, tensors in sums.items()
    }
