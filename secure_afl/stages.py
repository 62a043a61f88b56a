"""The stages every driver walks: what one client computes from its own rows, in one order.

::

    round 1: [the patient cap] → statistics → privatize → (the wire plan) → layout
    round 2: the teacher's pseudo-labels (statistics of round 2) → privatize → layout

The drivers: the simulator's mechanisms (``sim/mechanism.PaperMechanism``,
``sim/private.PrivateMechanism``, which ``sim/runner.walk`` walks), the rehearsal's
``StudyMechanism`` (``deploy local``'s reference) and the deployed node (``deploy/client.py``,
through :func:`node_round1` and :func:`node_round2`).  Each stage is one function here, called by
every driver that needs it; deploy/ keeps transport and checks, and computes no statistics, noise or
pseudo-labels of its own.  A stage takes public parameters (the study's method, its DP
configuration, the noise plan, the layout), never a driver's objects: this module sits below both
sim/ and deploy/ (pyproject's import-linter layers).

Statistics are numpy (``secure_afl.statistics``, ``secure_afl.privacy.dp``): a node's round 1
imports no torch.  Round 2's pseudo-labels score with torch (:mod:`secure_afl.analytic`, imported
when called).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from secure_afl.privacy import dp as private
from secure_afl.statistics import ClientStatistics, client_statistics

if TYPE_CHECKING:
    from secure_afl.analytic import PseudoLabelConfig, PseudoLabelReport, PseudoScoreRule
    from secure_afl.core.randomness import RandomSource
    from secure_afl.privacy.dp import NoisePlan, PrivateStatistics
    from secure_afl.privacy.dp_config import DpConfig

Contributions = dict[str, dict[str, np.ndarray]]  # group -> tensor -> values (analytic's form)
Flat = dict[str, dict[str, np.ndarray]]  # group -> tensor -> the layout's flat float64 vector
ActiveClasses = Sequence[int] | Sequence[bool] | np.ndarray

# --- the patient cap ------------------------------------------------------------------------------


def unit_rows(dp: DpConfig, n_rows: int, patient_ids: Sequence[object] | None) -> np.ndarray:
    """The rows a client may use under DP (a boolean mask): every row for the image unit; for the
    patient unit each patient's first ``max_images_per_patient`` rows (the sensitivities assume it)."""
    return private.rows_of_units(dp, n_rows, patient_ids)


# --- statistics -----------------------------------------------------------------------------------


def clear_statistics(features: np.ndarray, labels: np.ndarray, *, device: str = "auto") -> ClientStatistics:
    """A client's sufficient statistics in the clear: its Gram and class projections (Eq. 9's sums)."""
    return client_statistics(features, labels, device=device)


def dp_statistics(
    features: np.ndarray,
    labels: np.ndarray,
    dp: DpConfig,
    *,
    projection: np.ndarray | None = None,
    device: str = "auto",
    active: ActiveClasses | None = None,
) -> PrivateStatistics:
    """A client's DP statistics: its rows projected (``projection``, the study's public map) and
    clipped to ``dp.clip``, then summed (:func:`secure_afl.privacy.dp.private_statistics`)."""
    return private.private_statistics(
        features, labels, dp.clip, projection=projection, device=device, active=active
    )


def dp_rows(features: np.ndarray, dp: DpConfig, projection: np.ndarray | None = None) -> np.ndarray:
    """The rows round 2's DP pseudo-label sums are made of: projected and clipped as in round 1."""
    return private.private_rows(features, dp.clip, projection)[0]


# --- privatize ------------------------------------------------------------------------------------


def clear_contributions(
    stats: ClientStatistics, active: ActiveClasses, *, balance: str, gram: str, include_global_gram: bool
) -> Contributions:
    """One method's round-1 tensors in the clear (its balance and Gram scope; the global Gram too
    where round 2 needs it): nothing is added, the protection hides them."""
    return stats.contributions(active, balance=balance, gram=gram, include_global_gram=include_global_gram)


def every_variant(stats: ClientStatistics, active: ActiveClasses) -> Contributions:
    """The paper's AFL and the variants it is compared with in one upload: each class group's tensors
    under both balances, and the global Gram (the simulator's comparison, never a deployment's)."""
    mine = stats.contributions(active, balance="client", include_global_gram=True)
    for group, tensors in stats.contributions(active, balance="global").items():
        mine[group].update(tensors)
    return mine


def noised_round1(
    stats: PrivateStatistics, active: ActiveClasses, plan: NoisePlan, random: RandomSource
) -> tuple[Contributions, Contributions]:
    """Round 1 under DP: (the noisy tensors, the clean ones they came from): rounded and noised
    before the protection (:func:`secure_afl.privacy.dp.round1_upload`)."""
    return private.round1_upload(stats, active, plan, random)


def noised_round2(
    rows: np.ndarray,
    coef: np.ndarray,
    active: ActiveClasses,
    plan: NoisePlan,
    random: RandomSource,
    config: PseudoLabelConfig | None = None,
    *,
    groups: Collection[str] | None = None,
) -> tuple[Contributions, Contributions]:
    """Round 2 under DP: the pseudo-label sums and counts of the clipped ``rows`` (restricted to
    ``groups`` when given), rounded and noised (:func:`secure_afl.privacy.dp.pseudo_label_upload`)."""
    return private.pseudo_label_upload(rows, coef, active, plan, random, config, groups=groups)


# --- round 2's pseudo-labels ----------------------------------------------------------------------


def pseudo_labels(
    features: np.ndarray,
    coef: np.ndarray,
    active: ActiveClasses,
    config: PseudoLabelConfig,
    *,
    device: str = "auto",
    groups: Collection[str] | None = None,
) -> Contributions:
    """Round 2 in the clear: the projections of the rows the teacher ``coef`` pseudo-labels (Eq. 19),
    per class the client does not label; only ``groups`` (the session's) when given."""
    from secure_afl.analytic import pseudo_label_contributions  # round 2 scores with torch

    mine, _ = pseudo_label_contributions(features, coef, active, config=config, device=device)
    return mine if groups is None else {g: t for g, t in mine.items() if g in groups}


def pseudo_label_variants(
    features: np.ndarray,
    rules: Sequence[PseudoScoreRule],
    active: ActiveClasses,
    config: PseudoLabelConfig,
    *,
    device: str = "auto",
) -> tuple[Contributions, Mapping[str, Sequence[PseudoLabelReport]]]:
    """Round 2 under several teachers' score rules at once (the simulator's AFL and its rescaled τ),
    and each rule's per-class report."""
    from secure_afl.analytic import pseudo_label_rounds

    return pseudo_label_rounds(features, rules, active, config=config, device=device)


# --- layout ---------------------------------------------------------------------------------------


def zeros(contributions: Mapping[str, Mapping[str, np.ndarray]]) -> Contributions:
    """What a member with no rows sends: zeros of its tensors' shapes (the value its committed count
    of 0 announces)."""
    return {g: {t: np.zeros_like(v) for t, v in tensors.items()} for g, tensors in contributions.items()}


def flatten(layout: Any, contributions: Mapping[str, Mapping[str, np.ndarray]]) -> Flat:
    """The contributions in the layout's flat float64 vectors (the protocol's inputs)."""
    return {
        group: {name: layout.flatten(name, values) for name, values in tensors.items()}
        for group, tensors in contributions.items()
    }


# --- a deployed node's rounds: the stages above, in order ------------------------------------------


@dataclass(frozen=True)
class Recipe:
    """What a study asks of one client's uploads, from public inputs alone (the node derives it
    from its pinned study: ``deploy.study.recipe``).  ``dp``, ``noise`` and ``projection`` are set
    together under DP; ``dim`` and ``n_classes`` give a client without rows the layout's shapes."""

    balance: str
    gram: str
    rounds: int
    pseudo: PseudoLabelConfig | None
    dim: int
    n_classes: int
    dp: DpConfig | None = None
    noise: NoisePlan | None = None
    projection: np.ndarray | None = None


@dataclass(frozen=True)
class Upload:
    """One round's upload: the protocol's inputs, the values before any noise (what the release
    names; the inputs themselves without DP), and which of the given rows it used."""

    inputs: Flat
    clean: Flat
    rows: np.ndarray  # boolean, one per given row
    clipped: int | None = None  # under DP, round 1: how many of the used rows were clipped (the node's log)


def node_round1(
    features: np.ndarray,
    labels: np.ndarray,
    active: ActiveClasses,
    recipe: Recipe,
    *,
    layout: Any,
    wire: Any = None,
    patient_ids: Sequence[object] | None = None,
    device: str = "auto",
    random: RandomSource | None = None,
) -> Upload:
    """A node's round-1 upload: under DP the patient cap, the clipped statistics and their noise;
    else the method's statistics (zeros for a member without rows), in the wire plan's groups
    (``wire``: :class:`secure_afl.aggregation.difference.WirePlan`, or None); then the layout."""
    if recipe.dp is not None:
        assert recipe.noise is not None and random is not None, "DP needs the noise plan and randomness"
        keep = unit_rows(recipe.dp, len(features), patient_ids)
        stats = dp_statistics(
            features[keep], labels[keep], recipe.dp, projection=recipe.projection, device=device,
            active=active,
        )  # fmt: skip
        noisy, clean = noised_round1(stats, active, recipe.noise, random)
        return Upload(flatten(layout, noisy), flatten(layout, clean), keep, stats.n_clipped)
    keep = np.ones(len(features), dtype=bool)
    empty = len(features) == 0  # a growing study's member without new images
    if empty:  # a stand-in row gives the layout's shapes; its statistics are zeroed
        features, labels = np.zeros((1, recipe.dim)), np.zeros((1, recipe.n_classes), dtype=np.uint8)
    stats = clear_statistics(features, labels, device=device)
    contributions = clear_contributions(
        stats, active, balance=recipe.balance, gram=recipe.gram, include_global_gram=recipe.rounds == 2
    )
    if empty:
        contributions = zeros(contributions)
    if wire is not None:  # the wire's groups: the Gram by difference, or `all`'s from the classes
        contributions = wire.wire(contributions)
    inputs = flatten(layout, contributions)
    return Upload(inputs, inputs, keep)


def node_round2(
    features: np.ndarray,
    coef: np.ndarray,
    active: ActiveClasses,
    recipe: Recipe,
    *,
    layout: Any,
    groups: Collection[str],
    patient_ids: Sequence[object] | None = None,
    device: str = "auto",
    random: RandomSource | None = None,
) -> Upload:
    """A node's round-2 upload over the session's pseudo-label ``groups``, scored with the teacher
    ``coef``: under DP the capped, clipped rows' sums and counts, noised; else Eq. 19's projections."""
    assert recipe.pseudo is not None, "round 2 needs the study's pseudo-label configuration"
    if recipe.dp is not None:
        assert recipe.noise is not None and random is not None, "DP needs the noise plan and randomness"
        keep = unit_rows(recipe.dp, len(features), patient_ids)
        rows = dp_rows(features[keep], recipe.dp, recipe.projection)
        noisy, clean = noised_round2(rows, coef, active, recipe.noise, random, recipe.pseudo, groups=groups)
        return Upload(flatten(layout, noisy), flatten(layout, clean), keep)
    keep = np.ones(len(features), dtype=bool)
    mine = pseudo_labels(features, coef, active, recipe.pseudo, device=device, groups=groups)
    inputs = flatten(layout, mine)
    return Upload(inputs, inputs, keep)
