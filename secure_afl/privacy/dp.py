"""Differential privacy for the released classifier: the distributed discrete Gaussian mechanism.

Secure aggregation hides one institution's statistics from the server, but the classifier is a
deterministic function of the data.  Here every client clips its feature rows, rounds its
statistics randomly and unbiasedly onto a fixed-point grid, and adds discrete Gaussian noise
(:mod:`secure_afl.privacy.dp_sampler`, exact, from the protocol's injected randomness) **before**
masking, so no party ever sees an un-noised sum (Kairouz, Liu, Steinke, ICML 2021).

Statistics (``balance="global"`` and ``gram="global"``, as plain sums and counts)
----------------------------------------------------------------------------------
Per client, from rows clipped to ``‖h‖₂ ≤ C``:

=============  =========================================  ====================  =====================
group          tensors                                    one image changes     ℓ2 sensitivity
=============  =========================================  ====================  =====================
``all``        ``gram`` = Σ h hᵀ (upper triangle)         by h hᵀ               ‖h‖² ≤ C² (Frobenius)
``class/c``    ``pos_sum/c``, ``neg_sum/c`` (Σ h)         one of the two by h   C
``class/c``    ``n_pos/c``, ``n_neg/c``                   one of the two by 1   1
``pseudo/c``   the same four for round 2's pseudo-labels  at most one by h, 1   C, 1
``all``        ``gram_min_eig`` = λ_min(G_k) (adassp)     by [0, ‖h‖²] (Weyl)   C²
=============  =========================================  ====================  =====================

With ``--dp-dim K`` every row is first mapped to ``Pᵀh`` by the public, data-independent matrix of
:mod:`secure_afl.privacy.projection` (``±1/√K``, derived from a public seed) and *then* clipped, so
the same sensitivities hold for the K-dimensional statistics; the noise plan, the fixed-point range
check and the accounting all run on K.  The last row is the AdaSSP-style ridge's own release
(``ridge="adassp"``, :mod:`secure_afl.privacy.dp_solve`): one number per client in ``all``, its own
ρ share (``eigen_share``), composed with the other blocks.

Splitting the feature sum into positive and negative sums (rather than ``pos_sum`` and the total
``feat_sum`` of the non-private layout) makes one image move exactly one of the two, so the block's
sensitivity is C, not √2·C; the server rebuilds ``feat_sum = pos + neg`` and ``n = n_pos + n_neg``.
No tensor is sent to two groups, so no linear combination of group sums singles out a client's
noisy value (the overlap exposure of SECURITY.md §4 does not arise).  An image at a client that
labels class c moves ``class/c``; at a client that does not, at most ``pseudo/c`` (round 2); so per
class at most one block moves.

Why not the paper's per-client balancing: ``b_{k,c} = pos/N⁺_k − neg/N⁻_k`` divides by the client's
own counts, so one image changes every entry of ``b_{k,c}`` through ``N⁺_k`` and the change grows
as ``C/N⁺_k`` for a client with few positives (one positive: ``2C``), and it is a ratio of two
private quantities.  Plain sums and counts have clean, data-independent sensitivities, and the
server divides after the noise (post-processing).  The per-class Gram (``gram="class"``) would put
the Gram in every class group: each image would move ``|classes labelled|`` Gram blocks.

Class sums: ``class_sums="positives"``
--------------------------------------
Above, an image moves one block of *every* class its institution labels (the positive or the
negative side), so the sums' ρ is divided among those classes: at missing 1 each class block gets
1/7 of it.  With ``class_sums="positives"`` a class group carries only

- ``wpos_sum/c`` = Σ_i w_ic h_i and ``wpos_n/c`` = Σ_i w_ic, with ``w_ic = y_ic / ‖y_i‖₂`` over the
  classes the client labels (0 for a row with no labelled positive),

and ``all`` carries the total ``total_sum`` = Σ h and ``n_total`` (rows).  Since ``Σ_c w_ic² ≤ 1``,
one image moves all of its institution's class blocks together by at most C (sums) and 1 (counts)
in ℓ2: one slot, whatever the number of classes, composed with the total's slot (sensitivity C and
1, ``total_share`` of the sums' and counts' ρ).  The server estimates the negatives' mean by the
federation's mean ``total_sum / n_total``: the paper's balanced target scaled by ``1 − p_c`` when the
annotators' rows are distributed as the federation's (IID clients), biased by the difference of the
annotators' and the federation's means otherwise.  Rows with several labels count ``1/√k`` towards
each of their classes' positive means.

Neighbouring relation: add or remove one image (default), or one patient with at most
``max_images_per_patient`` images (the cap is enforced before the statistics); for a patient every
sensitivity is multiplied by that cap (Frobenius of a sum of P terms ≤ P·C², sums ≤ P·C, counts
≤ P, and per class the images split over ``class/c`` and ``pseudo/c`` obey a²+b² ≤ (a+b)²).

Rounding and the grid
---------------------
Each block has a grid ``2^-g`` (the same for every client): ``g`` puts a client's noise standard
deviation near 2^24 grid steps, never finer than the protocol's fractional bits minus 10 (so that
every value the protocol can encode, at most ``2^(63−f)``, is an integer multiple of ``2^-g``
below ``2^53``, exactly representable in float64: the protocol then encodes the noisy values
exactly, bit for bit).  Randomized rounding ``R(y) = ⌊y⌋ + Bernoulli(y − ⌊y⌋)`` is unbiased; since
``|R(y) − y| < 1``, neighbouring inputs give rounded vectors at ℓ2 distance below
``Δ·2^g + 2·√D`` (D the block's coordinates), whatever the rounding randomness, and the
accounting uses that bound (Rényi divergence is quasi-convex in the shared rounding randomness).

Every client rounds its own values, so a patient whose images sit at j clients carries j clients'
rounding into a group sum.  With the rounding randomness shared by the two neighbours,
``R_U(y) = ⌈y − U⌉`` is monotone and ``|R_U(y) − R_U(y')| < |y − y'| + 1`` per coordinate: client
k's rounded change is below ``‖δ_k‖ + √D``, the group sum's below ``Σ_k ‖δ_k‖ + j·√D ≤
P·Δ·2^g + j·√D``.  The plan bounds the slack by ``max(2, j)·√D`` (:func:`rounding_slack_steps`):
the one-client bound ``2√D`` above, exact for j = 2 and j·√D beyond.  j is 1 for the image unit
(an image sits at one client) and for a patient in a deployment (a patient stays within one
institution); the simulator, whose split may spread a patient's images over clients, passes a
public bound (:attr:`FederationLayout.patient_clients`, capped at P and at the number of clients).

Noise and dropouts
------------------
Every group sum must carry the target variance even at the fewest survivors with which the
protocol still unmasks it: ``u = max(M, m − (n − t))`` capped at the group's size ``m`` (M the
session's minimum group size, n the clients, t the threshold: at least t clients survive, so at
most n − t members of a group are missing), and 1 when the server sees inputs individually
(``secure="none"``).  Each member adds ``σ²/u``, rounded *up* to an admissible integer variance
on the grid; a single-member group gets the whole noise from its member.  A server colluding with
j members subtracts their noise: the guarantee holds while u honest members survive.

Accounting (``dp-accounting``)
------------------------------
Kairouz et al., Proposition 14: the sum of n clients' ``N_Z(0, σ_c²)^D`` noise on a query of ℓ2
sensitivity Δ (grid units) satisfies ``(α, α·Δ²/(2nσ_c²) + τ·D)``-RDP for all α, with
``τ = 10·Σ_{k=1}^{n−1} exp(−2π²σ_c²·k/(k+1))``: a ``ZCDpEvent(rho=Δ²/(2nσ_c²), xi=τ·D)``.  We take
ρ at the fewest survivors u (the most that ρ can be) and τ at all m members (the most that τ can
be), so the bound holds whoever drops.  Per institution, the events of the blocks its images move
(the Gram; per class the block that class's images of its institution go to, in each round) are
composed in an ``RdpAccountant`` and turned into ε at the user's δ.  Calibration: the largest
total ρ whose ε (with the ξ terms) is at most the target, split over the blocks in the fixed,
public proportions of :class:`DpConfig` (``rho_shares``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from secure_afl.core import encoding
from secure_afl.core.randomness import RandomSource
from secure_afl.privacy.dp_config import (
    DpClassSums,
    DpConfig,
    DpError,
    DpUnit,
    PseudoLabelThresholdError,  # noqa: F401  (re-exported: round 2's refusal of τ < 0.5)
    check_pseudo_label_threshold,
)
from secure_afl.privacy.dp_sampler import admissible_variance, noise_words, sample_discrete_gaussian
from secure_afl.privacy.projection import project_rows
from secure_afl.statistics import (  # numpy: a node's DP round 1 imports no torch
    ALL_GROUP,
    ClientStatistics,
    Contributions,
    StatisticsError,
    active_class_indices,
    class_group,
    client_statistics,
    pseudo_group,
)

if TYPE_CHECKING:
    from secure_afl.analytic import PseudoLabelConfig

BlockKind = Literal["gram", "sums", "counts", "eigen", "total_sums", "total_counts"]
# ridge="adassp": each client's λ_min of its own Gram, in the ``all`` group (dp_solve)
EIGEN_TENSOR = "gram_min_eig"
# class_sums="positives": the total sum and row count in ``all``; per class the label-normalised
# positive sum and count
TOTAL_SUM = "total_sum"
TOTAL_COUNT = "n_total"
POSITIVE_SUM = "wpos_sum"
POSITIVE_COUNT = "wpos_n"
# class indices, or a boolean mask with one entry per class (analytic.active_class_indices)
ActiveClasses = Sequence[int] | Sequence[bool] | np.ndarray
_TARGET_NOISE_BITS = 24  # a client's noise std, in grid steps, is about 2^24
_REPRESENTABLE_MARGIN_BITS = 10  # 63 − 53: grid bits at most frac_bits − 10


# ----------------------------------------------------------------------------------------------
# Client side: clipping, statistics, layout
# ----------------------------------------------------------------------------------------------


def clip_rows(features: np.ndarray, clip: float) -> tuple[np.ndarray, int]:
    """Rows scaled down to L2 norm ≤ ``clip`` (others unchanged), and how many were clipped."""
    features = np.asarray(features, dtype=np.float64)
    if features.ndim != 2:
        raise DpError(f"features must be a 2-D array (samples × dim), got shape {features.shape}")
    if not np.isfinite(features).all():
        raise DpError("features contain NaN or infinite values; check the backbone output")
    norms = np.linalg.norm(features, axis=1)
    over = norms > clip
    scale = np.ones_like(norms)
    scale[over] = clip / norms[over]
    clipped = features * scale[:, None]
    # float rounding can leave a scaled row a hair above the bound: pull it in by one more ulp step
    still = np.linalg.norm(clipped, axis=1) > clip
    if still.any():
        clipped[still] *= np.nextafter(1.0, 0.0) ** 4
    return clipped, int(over.sum())


def cap_images_per_patient(patient_ids: np.ndarray, cap: int) -> np.ndarray:
    """Boolean mask keeping each patient's first ``cap`` rows (in the given order)."""
    if cap < 1:
        raise DpError(f"the cap on images per patient must be at least 1, got {cap}")
    ids = np.asarray(patient_ids)
    keep = np.zeros(len(ids), dtype=bool)
    seen: dict[object, int] = {}
    for i, pid in enumerate(ids.tolist()):
        n = seen.get(pid, 0)
        if n < cap:
            keep[i] = True
            seen[pid] = n + 1
    return keep


@dataclass(frozen=True)
class PrivateStatistics:
    """A client's statistics on clipped rows: Gram, positive and negative sums per class, counts."""

    gram: np.ndarray
    pos_sum: np.ndarray  # d × C
    neg_sum: np.ndarray  # d × C
    n_pos: np.ndarray
    n_neg: np.ndarray
    n_clipped: int
    n_rows: int
    total_sum: np.ndarray | None = None  # Σ h over every row (class_sums="positives")
    # class_sums="positives": Σ_i w_ic h_i and Σ_i w_ic with w_ic = y_ic / ‖y_i‖₂ over the classes
    # this client labels (``positive_classes``; 0 for a row with no labelled positive)
    positive_sum: np.ndarray | None = None  # d × C
    positive_n: np.ndarray | None = None
    positive_classes: tuple[int, ...] | None = None

    def min_eigenvalue(self) -> float:
        """The smallest eigenvalue of this client's Gram (floored at 0: the Gram is PSD).

        Adding or removing a row h changes it by at most ‖h‖² ≤ C² (Weyl: ``G + hhᵀ ⪰ G`` and
        ``λ_min(G + hhᵀ) ≤ λ_min(G) + ‖h‖²``), and the sum over clients is a lower bound on the
        federation Gram's (``λ_min(A + B) ≥ λ_min(A) + λ_min(B)``): a sum secure aggregation can carry.
        """
        gram = (self.gram + self.gram.T) / 2
        return max(0.0, float(np.linalg.eigvalsh(gram)[0])) if gram.size else 0.0

    def round1(
        self, active: ActiveClasses, *, eigen: bool = False, class_sums: DpClassSums = "split"
    ) -> Contributions:
        """Round-1 upload: the Gram to ``all``; per labelled class its sums and counts.

        ``active``: class indices or a boolean mask of length C (:func:`active_class_indices`).
        ``eigen``: also the Gram's smallest eigenvalue (``ridge="adassp"``), to ``all``.
        ``class_sums="positives"``: per class only the label-normalised positive sum and count, and
        the total sum and row count in ``all`` (the statistics must have been made for ``active``).
        """
        out: Contributions = {ALL_GROUP: {"gram": self.gram}}
        if eigen:
            out[ALL_GROUP][EIGEN_TENSOR] = np.array([self.min_eigenvalue()])
        classes = active_class_indices(active, self.pos_sum.shape[1])
        if class_sums == "positives":
            return self._round1_positives(out, classes)
        if class_sums != "split":
            raise DpError(f"class_sums must be 'split' or 'positives', got {class_sums!r}")
        for c in classes:
            out[class_group(c)] = {
                f"pos_sum/{c}": self.pos_sum[:, c].copy(),
                f"neg_sum/{c}": self.neg_sum[:, c].copy(),
                f"n_pos/{c}": np.array([float(self.n_pos[c])]),
                f"n_neg/{c}": np.array([float(self.n_neg[c])]),
            }
        return out

    def _round1_positives(self, out: Contributions, classes: Sequence[int]) -> Contributions:
        if self.positive_sum is None or self.positive_n is None or self.total_sum is None:
            raise DpError(
                "class_sums='positives' needs the label-normalised positive sums: make the statistics "
                "with private_statistics(..., active=<this client's classes>)"
            )
        if set(classes) != set(self.positive_classes or ()):
            raise DpError(
                f"the positive sums were normalised over the classes {list(self.positive_classes or ())}, "
                f"not over the classes uploaded now {list(classes)}: make the statistics for the classes "
                "this client labels in this session"
            )
        out[ALL_GROUP][TOTAL_SUM] = self.total_sum.copy()
        out[ALL_GROUP][TOTAL_COUNT] = np.array([float(self.n_rows)])
        for c in classes:
            out[class_group(c)] = {
                f"{POSITIVE_SUM}/{c}": self.positive_sum[:, c].copy(),
                f"{POSITIVE_COUNT}/{c}": np.array([float(self.positive_n[c])]),
            }
        return out


def label_weights(labels: np.ndarray, classes: Sequence[int]) -> np.ndarray:
    """``w_ic = y_ic / ‖y_i‖₂`` over ``classes`` (0 elsewhere and for a row with no positive there).

    Σ_c w_ic² ≤ 1 for every row: one image moves all of its client's positive-sum blocks together by
    at most ‖h‖ ≤ C (ℓ2), whatever its number of labels.
    """
    y = np.zeros(np.shape(labels), dtype=np.float64)
    idx = list(classes)
    y[:, idx] = np.asarray(labels, dtype=np.float64)[:, idx]
    norms = np.linalg.norm(y, axis=1)
    return y / np.maximum(norms, 1.0)[:, None]


def private_rows(
    features: np.ndarray, clip: float, projection: np.ndarray | None = None
) -> tuple[np.ndarray, int]:
    """The rows the DP statistics are made of: projected (``--dp-dim``, the public matrix of
    :mod:`secure_afl.privacy.projection`) when a projection is given, then clipped to ``clip``."""
    if projection is not None:
        features = project_rows(features, projection)
    return clip_rows(features, clip)


def private_statistics(
    features: np.ndarray,
    labels: np.ndarray,
    clip: float,
    *,
    projection: np.ndarray | None = None,
    device: str = "auto",
    active: ActiveClasses | None = None,
) -> PrivateStatistics:
    """Project (``projection``, if any) and clip every row to ``clip``, then one float64 pass
    (analytic.client_statistics) over ``[Y, 1−Y]``.

    The complement columns give the negative sums directly (not as a difference of two sums).
    ``active``: the classes this client labels; given, the statistics also hold the total sum and
    the label-normalised positive sums over those classes (``class_sums="positives"``).
    """
    clipped, n_clipped = private_rows(features, clip, projection)
    labels = np.asarray(labels)
    n_classes = labels.shape[1]
    if not len(clipped):
        # A growing study's member with no new images: zero statistics, to which it still adds its
        # noise share (its upload is then pure noise, not a value the server knows).
        d = clipped.shape[1]
        stats = ClientStatistics(
            gram=np.zeros((d, d)),
            feat_sum=np.zeros(d),
            pos_sum=np.zeros((d, 2 * n_classes)),
            n=0,
            n_pos=np.zeros(2 * n_classes, dtype=np.int64),
        )
    else:
        both = np.concatenate([labels, 1 - labels], axis=1)
        stats = client_statistics(clipped, both, device=device)
    positives: dict[str, object] = {}
    if active is not None:
        classes = tuple(active_class_indices(active, n_classes))
        weights = label_weights(labels, classes)
        positives = {
            "total_sum": clipped.sum(axis=0),
            "positive_sum": clipped.T @ weights,
            "positive_n": weights.sum(axis=0),
            "positive_classes": classes,
        }
    return PrivateStatistics(
        gram=stats.gram,
        pos_sum=stats.pos_sum[:, :n_classes],
        neg_sum=stats.pos_sum[:, n_classes:],
        n_pos=stats.n_pos[:n_classes],
        n_neg=stats.n_pos[n_classes:],
        n_clipped=n_clipped,
        n_rows=stats.n,
        **positives,  # type: ignore[arg-type]
    )


def pseudo_label_round(
    clipped_features: np.ndarray,
    coef: np.ndarray,
    active: ActiveClasses,
    config: PseudoLabelConfig | None = None,
) -> Contributions:
    """Round 2 under DP: for each class the client does not label, sums and counts of its rows
    pseudo-labelled positive (``σ(h·w_c) > τ``) and negative (``< 1 − τ``) by the round-1 model.

    The features must already be clipped.  Qualification (Eq. 20's δ⁺, δ⁻) moves to the server,
    which applies it to the federation's noisy counts: a per-client threshold would switch a whole
    block on or off for one image (unbounded sensitivity).
    """
    if config is None:
        from secure_afl.analytic import PseudoLabelConfig  # round 2's defaults (analytic imports torch)

        config = PseudoLabelConfig()
    check_pseudo_label_threshold(config.tau)  # the two sets must be disjoint (sensitivity C, not √2·C)
    h = np.asarray(clipped_features, dtype=np.float64)
    coef = np.asarray(coef, dtype=np.float64)
    active_set = set(active_class_indices(active, coef.shape[1]))
    out: Contributions = {}
    for c in range(coef.shape[1]):
        if c in active_set:
            continue
        p = 1.0 / (1.0 + np.exp(-(h @ coef[:, c])))
        pos = p > config.tau
        neg = p < 1 - config.tau
        out[pseudo_group(c)] = {
            f"pseudo_pos_sum/{c}": h[pos].sum(axis=0) if pos.any() else np.zeros(h.shape[1]),
            f"pseudo_neg_sum/{c}": h[neg].sum(axis=0) if neg.any() else np.zeros(h.shape[1]),
            f"pseudo_n_pos/{c}": np.array([float(pos.sum())]),
            f"pseudo_n_neg/{c}": np.array([float(neg.sum())]),
        }
    return out


def rows_of_units(config: DpConfig, n_rows: int, patient_ids: Sequence[object] | None) -> np.ndarray:
    """Boolean mask of the rows a client may use: all of them for the image unit; for the patient
    unit each patient's first ``max_images_per_patient`` (the sensitivities assume that cap)."""
    if config.unit != "patient":
        return np.ones(n_rows, dtype=bool)
    if patient_ids is None or len(patient_ids) != n_rows:
        raise DpError(
            "the patient unit needs one patient id per feature row (a feature file's patient_ids) to cap "
            f"each patient at {config.max_images_per_patient} images"
        )
    return cap_images_per_patient(np.asarray(patient_ids), config.max_images_per_patient)


def round1_upload(
    stats: PrivateStatistics, active: ActiveClasses, plan: NoisePlan, random: RandomSource
) -> tuple[Contributions, Contributions]:
    """One client's round-1 DP upload (the simulator's and the deployment's): the noisy
    contributions, and the clean ones they came from (the key of the client's ledger history)."""
    check_rows(stats.n_rows, plan.config)
    clean = stats.round1(active, eigen=plan.config.ridge == "adassp", class_sums=plan.config.class_sums)
    return privatize(clean, plan, random), clean


def pseudo_label_upload(
    clipped_features: np.ndarray,
    coef: np.ndarray,
    active: ActiveClasses,
    plan: NoisePlan,
    random: RandomSource,
    config: PseudoLabelConfig | None = None,
    *,
    groups: Collection[str] | None = None,
) -> tuple[Contributions, Contributions]:
    """One client's round-2 DP upload: :func:`pseudo_label_round` (restricted to ``groups``, the
    session's pseudo-label groups, when given) rounded and noised, and the clean contributions."""
    check_rows(len(clipped_features), plan.config)
    clean = pseudo_label_round(clipped_features, coef, active, config)
    if groups is not None:
        clean = {g: t for g, t in clean.items() if g in groups}
    return privatize(clean, plan, random), clean


def block_kind(tensor: str) -> BlockKind:
    """Which sensitivity block a DP tensor belongs to."""
    if tensor == "gram":
        return "gram"
    if tensor == EIGEN_TENSOR:
        return "eigen"
    if tensor == TOTAL_SUM:
        return "total_sums"
    if tensor == TOTAL_COUNT:
        return "total_counts"
    sums = ("pos_sum/", "neg_sum/", "pseudo_pos_sum/", "pseudo_neg_sum/", f"{POSITIVE_SUM}/")
    if tensor.startswith(sums):
        return "sums"
    if tensor.startswith(("n_pos/", "n_neg/", "pseudo_n_pos/", "pseudo_n_neg/", f"{POSITIVE_COUNT}/")):
        return "counts"
    raise DpError(
        f"tensor {tensor!r} is not part of the DP layout (gram, sums, counts, {TOTAL_SUM}, {TOTAL_COUNT}, "
        f"{EIGEN_TENSOR} only)"
    )


# ----------------------------------------------------------------------------------------------
# Noise plan: per group and block, the grid, the fewest survivors, each client's variance
# ----------------------------------------------------------------------------------------------


def fewest_survivors(
    members: int, *, n_clients: int, threshold: int, min_group_size: int, masked: bool = True
) -> int:
    """The fewest survivors with which a group of ``members`` may still be unmasked.

    At least ``threshold`` of the ``n_clients`` survive every round and no group is unmasked below
    ``min_group_size``; without masking (``masked=False``) each input is seen alone: 1.
    """
    if members < 1:
        raise DpError(f"a group needs at least one member, got {members}")
    if not masked:
        return 1
    return max(1, min(members, max(min_group_size, members - (n_clients - threshold))))


def rounding_slack_steps(dim: int, clients: int = 1) -> float:
    """ℓ2 bound (grid steps) on what ``clients`` separate randomized roundings of a ``dim``-coordinate
    block add to one protected unit's change of a group sum: ``max(2, clients)·√dim``.

    Each client's rounding adds less than ``√dim`` once the neighbours share the rounding
    randomness (``⌈y − U⌉`` is monotone); one client keeps the plan's ``2√dim`` (``|R(y) − y| < 1``
    on each side), so that one- and two-client plans stay as they were.
    """
    if clients < 1:
        raise DpError(f"a protected unit's rows sit at one client at least, got {clients}")
    return max(2, clients) * math.sqrt(dim)


def _tau(members: int, client_variance_steps: float) -> float:
    return 10.0 * sum(
        math.exp(-2.0 * math.pi**2 * client_variance_steps * k / (k + 1)) for k in range(1, members)
    )


@dataclass(frozen=True)
class BlockNoise:
    """The noise of one block (a group's Gram, sums or counts), the same at every member."""

    group: str
    kind: BlockKind
    dim: int  # coordinates on the wire (a Gram as its upper triangle)
    sensitivity: float  # ℓ2, real units, per protected unit
    grid_bits: int  # values are integer multiples of 2^-grid_bits
    members: int
    fewest: int
    client_variance: int  # grid steps², admissible for the exact sampler
    target_rho: float  # what the calibration asked of this block (rho never exceeds it)
    rounding_clients: int = 1  # the most clients whose roundings one protected unit's change carries

    @property
    def target_variance_steps(self) -> float:
        """The variance (grid steps²) the group sum must carry at its fewest survivors."""
        return self.sensitivity_steps**2 / (2.0 * self.target_rho)

    @property
    def grid(self) -> float:
        return 2.0**-self.grid_bits

    @property
    def sensitivity_steps(self) -> float:
        """ℓ2 sensitivity on the grid after randomized rounding: ``Δ·2^g + max(2, j)·√D``, j the
        clients a protected unit's rows may sit at (:func:`rounding_slack_steps`)."""
        return self.sensitivity * 2.0**self.grid_bits + rounding_slack_steps(self.dim, self.rounding_clients)

    @property
    def rounding_slack(self) -> float:
        """The rounding's share of :attr:`sensitivity_steps`, in real units."""
        return rounding_slack_steps(self.dim, self.rounding_clients) * self.grid

    def group_std(self, survivors: int | None = None) -> float:
        """Standard deviation (real units) of the group sum's noise per coordinate."""
        n = self.fewest if survivors is None else survivors
        return math.sqrt(n * self.client_variance) * self.grid

    @property
    def rho(self) -> float:
        """ρ at the fewest survivors (the largest ρ any survivor set gives)."""
        return self.sensitivity_steps**2 / (2.0 * self.fewest * self.client_variance)

    @property
    def xi(self) -> float:
        """τ·D with τ at all members (the largest τ any survivor set gives); 0 for one member."""
        return _tau(self.members, float(self.client_variance)) * self.dim


def _grid_bits(group_std: float, fewest: int, frac_bits: int) -> int:
    client_std = group_std / math.sqrt(fewest)
    bits = _TARGET_NOISE_BITS - math.ceil(math.log2(client_std))
    return min(bits, frac_bits - _REPRESENTABLE_MARGIN_BITS)


def make_block(
    group: str,
    kind: BlockKind,
    *,
    dim: int,
    sensitivity: float,
    rho: float,
    members: int,
    fewest: int,
    frac_bits: int,
    rounding_clients: int = 1,
) -> BlockNoise:
    """The block whose group sum, at ``fewest`` survivors, gives at most ``rho`` (before ξ);
    ``rounding_clients``: the most clients whose roundings one protected unit's change carries."""
    if not rho > 0:
        raise DpError(f"a block's rho must be positive, got {rho}")
    std = sensitivity / math.sqrt(2.0 * rho)
    bits = _grid_bits(std, fewest, frac_bits)
    steps = sensitivity * 2.0**bits + rounding_slack_steps(dim, rounding_clients)
    variance = admissible_variance(steps**2 / (2.0 * rho * fewest))
    return BlockNoise(group, kind, dim, sensitivity, bits, members, fewest, variance, rho, rounding_clients)


# round-1 tensors of one class-sums layout only (round 2's pseudo-label tensors are in both)
_ONLY_IN = {
    "split": ("pos_sum/", "neg_sum/", "n_pos/", "n_neg/"),
    "positives": (f"{POSITIVE_SUM}/", f"{POSITIVE_COUNT}/", TOTAL_SUM, TOTAL_COUNT),
}


@dataclass(frozen=True)
class NoisePlan:
    """Every group's blocks, and which blocks each institution's images move."""

    config: DpConfig
    blocks: Mapping[tuple[str, BlockKind], BlockNoise]
    # institution -> per "slot" (the Gram; per class per round) the blocks that may move together
    slots: Mapping[str, tuple[tuple[tuple[str, BlockKind], ...], ...]]
    frac_bits: int
    rho_total: float  # the calibrated per-institution budget before rounding the variances up

    def block(self, group: str, tensor: str) -> BlockNoise:
        kind = block_kind(tensor)
        layout = self.config.class_sums
        if tensor.startswith(_ONLY_IN["positives" if layout == "split" else "split"]):
            raise DpError(
                f"tensor {tensor!r} belongs to the other class-sums layout than this plan's "
                f"({layout!r}): its noise and accounting were not planned; make the upload with "
                f"class_sums={layout!r}"
            )
        try:
            return self.blocks[(group, kind)]
        except KeyError:
            raise DpError(f"no noise planned for tensor {tensor!r} of group {group!r}") from None

    def events(self, institution: str) -> list[tuple[float, float]]:
        """(ρ, ξ) per slot, and every ξ of the slot's blocks.

        A slot's blocks may move together, by ``Δ_b`` with ``Σ_b Δ_b² ≤ Δ²`` (``Δ`` the blocks'
        common sensitivity: one patient's images on either side of a class, ``a² + b² ≤ (a + b)²``;
        an image's label-normalised positive sums, ``Σ_c w_c² ≤ 1``).  On the grid each moved block
        also carries its rounding slack ``r_b = max(2, j)·√D_b`` steps (j clients rounding, at most
        :attr:`BlockNoise.rounding_clients`), so the slot's ρ is
        ``Σ_b (Δ_b + r_b·2^-g_b)² / (2σ_b²) ≤ max_b 1/(2σ_b²) · (Δ + √A·max_b r_b·2^-g_b)²``
        (Minkowski) for A blocks, σ_b each group sum's noise at its fewest survivors.  For one block
        this is exactly its own ρ.
        """
        out = []
        for slot in self.slots[institution]:
            blocks = [self.blocks[key] for key in slot]
            if len(blocks) == 1:
                out.append((blocks[0].rho, blocks[0].xi))
                continue
            inverse = max(1.0 / (2.0 * b.group_std() ** 2) for b in blocks)
            slack = max(b.rounding_slack for b in blocks)
            sensitivity = max(b.sensitivity for b in blocks)
            rho = inverse * (sensitivity + math.sqrt(len(blocks)) * slack) ** 2
            out.append((rho, sum(b.xi for b in blocks)))
        return out

    def epsilon(self, institution: str) -> float:
        return epsilon_of(self.events(institution), self.config.delta)

    def epsilons(self) -> dict[str, float]:
        cache: dict[tuple[tuple[float, float], ...], float] = {}
        out = {}
        for k in self.slots:
            events = tuple(self.events(k))
            if events not in cache:
                cache[events] = epsilon_of(events, self.config.delta)
            out[k] = cache[events]
        return out


def epsilon_of(events: Sequence[tuple[float, float]], delta: float) -> float:
    """ε at ``delta`` of the composition of ``ZCDpEvent(rho, xi)`` events, by ``RdpAccountant``."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    accountant = RdpAccountant()
    for rho, xi in events:
        accountant.compose(dp_accounting.ZCDpEvent(rho=float(rho), xi=float(xi)))
    return float(accountant.get_epsilon(delta))


def rho_for_epsilon(epsilon: float, delta: float) -> float:
    """The largest ρ (bisection, relative 1e-6) whose ρ-zCDP gives ε ≤ ``epsilon`` at ``delta``."""
    lo, hi = 0.0, 1.0
    while epsilon_of([(hi, 0.0)], delta) < epsilon:
        lo, hi = hi, hi * 2
    while hi - lo > 1e-6 * hi:
        mid = (lo + hi) / 2
        if epsilon_of([(mid, 0.0)], delta) <= epsilon:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class FederationLayout:
    """What the noise plan needs to know about the session, all public before any data moves."""

    active: Mapping[str, ActiveClasses]  # institution -> classes it labels (indices or a mask)
    n_classes: int
    dim: int
    threshold: int
    min_group_size: int = 1
    rounds: int = 1
    masked: bool = True
    frac_bits: int = encoding.DEFAULT_FRAC_BITS
    # The most institutions one patient's images may sit at (the patient unit; each rounds its own
    # values): 1 in a deployment, where a patient stays within one institution; the simulator's
    # split may spread a patient's images, and it passes a public bound (the number of clients).
    patient_clients: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.patient_clients, bool) or not isinstance(self.patient_clients, int):
            raise DpError(f"patient_clients must be an integer, got {self.patient_clients!r}")
        if not 1 <= self.patient_clients <= max(1, len(self.active)):
            raise DpError(
                f"patient_clients must be in 1..{len(self.active)} (the institutions), got "
                f"{self.patient_clients}"
            )
        # Each institution's classes as sorted indices: a boolean mask is read as a mask, never as
        # the classes 0 and 1; indices outside 0..C−1 and non-integers are refused.
        active: dict[str, tuple[int, ...]] = {}
        for inst, classes in self.active.items():
            try:
                active[inst] = tuple(active_class_indices(classes, self.n_classes))
            except StatisticsError as exc:
                raise DpError(f"institution {inst!r}: {exc}") from None
        object.__setattr__(self, "active", active)

    def members(self, group: str) -> int:
        if group == ALL_GROUP:
            return len(self.active)
        kind, _, c = group.partition("/")
        labelled = sum(int(c) in set(map(int, a)) for a in self.active.values())
        return labelled if kind == "class" else len(self.active) - labelled

    def groups(self) -> list[str]:
        out = [ALL_GROUP]
        for c in range(self.n_classes):
            out.append(class_group(c))
            if self.rounds == 2 and self.members(pseudo_group(c)) > 0:
                out.append(pseudo_group(c))
        return out


def plan_noise(config: DpConfig, layout: FederationLayout) -> NoisePlan:
    """Calibrate the noise to (ε, δ): the largest budget whose worst institution spends at most ε."""
    config.validate()
    if layout.rounds not in (1, 2):
        raise DpError(f"rounds must be 1 or 2, got {layout.rounds}")
    n_clients = len(layout.active)
    if not 1 <= layout.threshold <= n_clients:
        raise DpError(f"threshold must be in 1..{n_clients}, got {layout.threshold}")
    for c in range(layout.n_classes):
        if layout.members(class_group(c)) == 0:
            raise DpError(f"class {c} has no annotating client: every class needs one")
    p = config.unit_multiplier
    c2 = config.clip
    positives = config.class_sums == "positives"
    # "eigen" (ridge="adassp"): a client's λ_min moves by at most ‖h‖² ≤ C² per image (Weyl)
    sensitivities = {
        "gram": p * c2 * c2,
        "sums": p * c2,
        "counts": float(p),
        "eigen": p * c2 * c2,
        "total_sums": p * c2,
        "total_counts": float(p),
    }

    def block_dim(group: str, kind: BlockKind) -> int:
        # a class group's sums and counts have a positive and a negative side, except positive sums
        sides = 1 if positives and group.startswith("class/") else 2
        return {
            "gram": encoding.upper_triangle_length(layout.dim),
            "sums": sides * layout.dim,
            "counts": sides,
            "eigen": 1,
            "total_sums": layout.dim,
            "total_counts": 1,
        }[kind]

    eigen = config.ridge == "adassp"
    slots = _slots(layout, config.unit, eigen=eigen, positives=positives)
    # the clients whose roundings one protected unit's change carries: an image sits at one; a
    # patient's at most P images at no more than P of the layout's bound
    rounding_clients = 1 if config.unit == "image" else min(layout.patient_clients, p)
    # class slots per protected unit: an image moves one block per class it meets (its client's
    # labelled classes in round 1; every class once both rounds run); a patient may span clients.
    # With positive sums, all of round 1's class blocks are one slot (their joint ℓ2 change ≤ C).
    class_slots = max(sum(1 for slot in own if slot[0][1] == "sums") for own in slots.values())

    def build(rho_total: float) -> NoisePlan:
        share_gram, share_sums, share_counts = config.rho_shares
        # ridge="adassp": the λ_min release takes eigen_share of the total first
        rest = rho_total * (1.0 - config.eigen_share) if eigen else rho_total
        # class_sums="positives": the total sum and count take total_share of the sums' and counts'
        classes = 1.0 - config.total_share if positives else 1.0
        per_kind = {
            "gram": share_gram * rest,
            "sums": share_sums * rest * classes / class_slots,
            "counts": share_counts * rest * classes / class_slots,
            "eigen": config.eigen_share * rho_total,
            "total_sums": share_sums * rest * config.total_share,
            "total_counts": share_counts * rest * config.total_share,
        }
        blocks: dict[tuple[str, BlockKind], BlockNoise] = {}
        for group in layout.groups():
            members = layout.members(group)
            fewest = fewest_survivors(
                members,
                n_clients=n_clients,
                threshold=layout.threshold,
                min_group_size=layout.min_group_size,
                masked=layout.masked,
            )
            kinds: tuple[BlockKind, ...] = ("sums", "counts")
            if group == ALL_GROUP:
                kinds = ("gram", "eigen") if eigen else ("gram",)
                kinds += ("total_sums", "total_counts") if positives else ()
            for kind in kinds:
                blocks[(group, kind)] = make_block(
                    group,
                    kind,
                    dim=block_dim(group, kind),
                    sensitivity=sensitivities[kind],
                    rho=per_kind[kind],
                    members=members,
                    fewest=fewest,
                    frac_bits=layout.frac_bits,
                    rounding_clients=rounding_clients,
                )
        return NoisePlan(config, blocks, slots, layout.frac_bits, rho_total)

    rho = rho_for_epsilon(config.epsilon, config.delta)
    for _ in range(200):  # the ξ terms (τ·D) may push ε up: shrink until the worst fits
        plan = build(rho)
        if max(plan.epsilons().values()) <= config.epsilon:
            check_plan_encodable(plan, masked=layout.masked)
            return plan
        rho *= 0.98
    raise DpError(
        f"cannot reach epsilon {config.epsilon} at delta {config.delta}: the discrete noise's τ term "
        "stays too large; use more fractional bits or a larger epsilon"
    )


# ----------------------------------------------------------------------------------------------
# The fixed-point range, checked from the plan alone (no data)
# ----------------------------------------------------------------------------------------------

_FLOAT_MARGIN = 1e-6  # relative: float64 rounding of a sum of at most max_rows clipped rows
_NOISE_TAIL_BITS = 128  # a client's noise exceeds the bound below with probability < 2^-128 per block
_PER_ROW = {
    "gram": "clip²",
    "sums": "clip",
    "counts": "1",
    "eigen": "clip²",
    "total_sums": "clip",
    "total_counts": "1",
}


def noise_tail_multiple(dim: int) -> float:
    """k such that, over ``dim`` draws of ``N_Z(0, σ²)``, ``P(max |X| > kσ) < 2^-128``.

    The discrete Gaussian is σ-sub-Gaussian (Canonne, Kamath, Steinke 2020, Cor. 9):
    ``P(|X| ≥ kσ) ≤ 2·exp(−k²/2)``; a union bound over the coordinates gives
    ``k = √(2·(ln(2·dim) + 128·ln 2))``, about 14.3 for a 1024-d Gram's 524,800 coordinates.
    """
    return math.sqrt(2.0 * (math.log(2.0 * max(dim, 1)) + _NOISE_TAIL_BITS * math.log(2.0)))


def _block_limit_steps(block: BlockNoise, frac_bits: int, *, masked: bool) -> int:
    """The largest |value| (grid steps) a member of ``block``'s group may upload: below 2^53 (exact
    in float64) and, masked, its fixed-point word ``steps·2^(f−g)`` at most ``(2^63 − 1) // m``."""
    limit = 2**53 - 1
    if masked:
        limit = min(limit, ((2**63 - 1) // block.members) >> (frac_bits - block.grid_bits))
    return limit


def encodable_rows(block: BlockNoise, config: DpConfig, frac_bits: int, *, masked: bool = True) -> int:
    """The most rows a client may hold so that its value of ``block``, rounded and noised, always
    encodes (noise beyond :func:`noise_tail_multiple` standard deviations: probability < 2^-128).

    A coordinate of the Gram is at most ``rows·clip²`` (Cauchy–Schwarz), of a sum ``rows·clip``, a
    count ``rows``, the Gram's smallest eigenvalue ``rows·clip²`` (at most its trace over K);
    randomized rounding adds at most one step.  Data-independent: the plan's grid, noise and group
    size, the clip and ``frac_bits``.  The dimension enters through the noise's tail
    (:func:`noise_tail_multiple` of the block's coordinates: K(K+1)/2 for a projected Gram).
    """
    per_row = {
        "gram": config.clip**2,
        "sums": config.clip,
        "counts": 1.0,
        "eigen": config.clip**2,
        "total_sums": config.clip,
        "total_counts": 1.0,
    }[block.kind]
    noise = math.ceil(noise_tail_multiple(block.dim) * math.sqrt(block.client_variance))
    room = _block_limit_steps(block, frac_bits, masked=masked) - 1 - noise
    if room <= 0:
        return 0
    return int(room / (per_row * (1.0 + _FLOAT_MARGIN) * 2.0**block.grid_bits))


def check_plan_encodable(plan: NoisePlan, *, masked: bool = True) -> None:
    """Refuse a plan under which a client within its bounds (``max_rows`` rows clipped to ``clip``)
    could overflow the fixed-point encoding, naming the parameter to change."""
    config = plan.config
    worst = min(plan.blocks.values(), key=lambda b: encodable_rows(b, config, plan.frac_bits, masked=masked))
    fits = encodable_rows(worst, config, plan.frac_bits, masked=masked)
    if config.max_rows <= fits:
        return
    where = f"group {worst.group!r} ({worst.members} members, {plan.frac_bits} fractional bits)"
    if fits == 0:
        raise DpError(
            f"the fixed-point encoding can overflow: in {where} the {worst.kind} noise alone may exceed "
            "the encodable range; use fewer fractional bits or a larger epsilon"
        )
    per_row = {
        "gram": f"{config.clip:g}²",
        "sums": f"{config.clip:g}",
        "counts": "1",
        "eigen": f"{config.clip:g}²",
        "total_sums": f"{config.clip:g}",
        "total_counts": "1",
    }[worst.kind]
    raise DpError(
        f"the fixed-point encoding can overflow: in {where} a client's {worst.kind} may reach max_rows "
        f"× {_PER_ROW[worst.kind]} = {config.max_rows} × {per_row} plus its noise, more than "
        f"{worst.members} members' values can sum to; set --dp-max-rows (max_rows, the most rows per "
        f"client) to at most {fits}, or lower --clip, or use fewer fractional bits"
    )


def check_rows(n_rows: int, config: DpConfig) -> None:
    """Refuse a client holding more rows than the plan's bound (its encoding was checked for that)."""
    if n_rows > config.max_rows:
        raise DpError(
            f"this client has {n_rows} feature rows (after the patient cap), more than the plan's bound "
            f"max_rows = {config.max_rows}: the noise plan checked the fixed-point range for that many; "
            "raise --dp-max-rows (the plan refuses a bound that could overflow) or use fewer rows"
        )


def _slots(
    layout: FederationLayout, unit: DpUnit, *, eigen: bool = False, positives: bool = False
) -> dict[str, tuple[tuple[tuple[str, BlockKind], ...], ...]]:
    """Per institution: the Gram (and, ``eigen``, the λ_min release); per class and kind, the
    blocks its protected unit may move.

    ``positives`` (class_sums="positives"): the total sum and count in ``all``, and round 1's class
    blocks as one slot per kind (every class an image's client labels, every class for a patient,
    whose images may sit at any client); round 2's pseudo-label blocks keep a slot per class.
    """
    out = {}
    for inst, active in layout.active.items():
        labelled = set(map(int, active))
        slots: list[tuple[tuple[str, BlockKind], ...]] = [((ALL_GROUP, "gram"),)]
        if eigen:
            slots.append(((ALL_GROUP, "eigen"),))
        if positives:
            slots += [((ALL_GROUP, "total_sums"),), ((ALL_GROUP, "total_counts"),)]
            reached = range(layout.n_classes) if unit == "patient" else sorted(labelled)
            if reached:
                slots += [tuple((class_group(c), kind) for c in reached) for kind in ("sums", "counts")]
            for c in range(layout.n_classes):
                pseudo = layout.rounds == 2 and layout.members(pseudo_group(c)) > 0
                if pseudo and (unit == "patient" or c not in labelled):
                    slots += [((pseudo_group(c), "sums"),), ((pseudo_group(c), "counts"),)]
            out[inst] = tuple(slots)
            continue
        for c in range(layout.n_classes):
            if unit == "patient":  # a patient's images may sit at clients on either side
                groups = [class_group(c)] + (
                    [pseudo_group(c)] if layout.rounds == 2 and layout.members(pseudo_group(c)) else []
                )
            elif c in labelled:
                groups = [class_group(c)]
            elif layout.rounds == 2:
                groups = [pseudo_group(c)]
            else:
                continue
            for kind in ("sums", "counts"):
                slots.append(tuple((g, kind) for g in groups))
        out[inst] = tuple(slots)
    return out


# ----------------------------------------------------------------------------------------------
# Client side: rounding and noise
# ----------------------------------------------------------------------------------------------


def randomized_round(scaled: np.ndarray, words_source: RandomSource) -> np.ndarray:
    """Unbiased rounding of ``scaled`` (already in grid steps) to int64: ``⌊y⌋ + [U < y − ⌊y⌋]``.

    ``U`` is a 53-bit uniform fraction from the injected source (bias below 2^-53 of a step).
    """
    y = np.asarray(scaled, dtype=np.float64)
    if not np.isfinite(y).all():
        raise DpError("a statistic is NaN or infinite; it cannot be put on the grid")
    if y.size and float(np.max(np.abs(y))) >= 2.0**53:
        raise DpError(
            f"a statistic reaches {float(np.max(np.abs(y))):.3g} grid steps, beyond float64's exact "
            "integers (2^53); lower --clip or use fewer fractional bits"
        )
    floor = np.floor(y)
    frac = y - floor
    words = noise_words(words_source).take(y.size) >> np.uint64(11)
    up = words.astype(np.float64) < frac * 2.0**53
    return floor.astype(np.int64) + up.astype(np.int64)


def privatize(
    contributions: Contributions,
    plan: NoisePlan,
    random: RandomSource,
    *,
    symmetric: Sequence[str] = ("gram",),
) -> Contributions:
    """One client's DP upload: every tensor rounded onto its block's grid, plus its noise share.

    The values returned are integer multiples of ``2^-g`` below ``2^53`` steps: float64 holds them
    exactly and the protocol's fixed-point encoding (``frac_bits ≥ g``) is exact on them.
    Symmetric tensors are noised on their upper triangle (what travels) and returned symmetric.
    """
    # Round every tensor first, then draw each variance's noise in one call (the sampler's loops
    # cost per call, and a client's counts are many one-value tensors).
    pending: list[tuple[str, str, np.ndarray, BlockNoise, tuple[int, ...], bool]] = []
    for group, tensors in contributions.items():
        for name, values in tensors.items():
            block = plan.block(group, name)
            array = np.asarray(values, dtype=np.float64)
            is_symmetric = name in symmetric
            flat = encoding.pack_symmetric(array) if is_symmetric else array.ravel()
            steps = randomized_round(flat * 2.0**block.grid_bits, random)
            pending.append((group, name, steps, block, array.shape, is_symmetric))
    by_variance: dict[int, list[int]] = {}
    for i, entry in enumerate(pending):
        by_variance.setdefault(entry[3].client_variance, []).append(i)
    noise: dict[int, np.ndarray] = {}
    for variance, indices in by_variance.items():
        sizes = [pending[i][2].size for i in indices]
        draws = sample_discrete_gaussian(variance, sum(sizes), random)
        for i, part in zip(indices, np.split(draws, np.cumsum(sizes)[:-1]), strict=True):
            noise[i] = part
    out: Contributions = {group: {} for group in contributions}
    for i, (group, name, steps, block, shape, is_symmetric) in enumerate(pending):
        total = steps + noise[i]
        if total.size and int(np.max(np.abs(total))) >= 2**53:
            raise DpError(f"tensor {name!r}: noisy value beyond float64's exact range; lower --clip")
        noisy = total.astype(np.float64) * block.grid
        out[group][name] = encoding.unpack_symmetric(noisy) if is_symmetric else noisy.reshape(shape)
    return out
