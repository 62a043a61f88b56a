"""A federation that grows: each session's sums are added to the earlier sessions' sums.

AFL's ``balance="global"`` statistics are sums over images: per class group ``class/<c>`` the
positive sums and counts ``pos_sum/<c>``, ``n_pos/<c>`` and the total sums and counts
``feat_sum``, ``n``, and the Gram ``gram`` (in every class group with ``gram="class"``, in ``all``
with ``gram="global"``).  A sum over the union of disjoint sets of images is the sum of the sums,
so when every image enters exactly one session, :func:`accumulate_sums` over the sessions gives
the sums of every released image, and ``AnalyticClassifier(balance="global")`` fitted on them is the
centralised fit on that union (to float64 rounding, whatever the partition into sessions and
clients).

What is not additive, and refused with the reason:

- **The paper's per-client balance** (``balance="client"``, tensors ``b/<c>``).  Eq. 9 gives a
  client's positives ``+1/N⁺_{k,c}`` and its negatives ``−1/N⁻_{k,c}`` with the client's *own*
  counts, so new rows change the weight of every earlier row: the union's ``b_{k,c}`` is not the sum
  of the sessions' ``b_{k,c}``, and nothing the server holds lets it re-weight them.
- **Round 2's pseudo-label projections** (``pseudo/<c>`` groups).  ``b_pseudo`` is a per-client
  mean difference (not a sum), and its pseudo-labels come from a teacher that changes every session.

The DP layout (``neg_sum/<c>``, ``n_neg/<c>``, ``wpos_sum/<c>``, ``wpos_n/<c>``, ``total_sum``,
``n_total``, ``gram_min_eig`` beside ``gram``, ``pos_sum/<c>``, ``n_pos/<c>``) is additive too:
sums over clipped rows, each client's noised before masking, so a chain's accumulated sums are the
sum of the sessions' noisy releases, exactly (the noisy values sit on a fixed-point grid the
protocol carries bit for bit).  Their noise adds as well: the DP solve of a chain sizes its ridge
from ``√(Σ_k s_k²)``, the sessions' noise stds (:mod:`secure_afl.privacy.dp_growth`).  Counts stay
noisy floats here; they are rounded and floored at 1 at the solve, after accumulation
(:func:`secure_afl.privacy.dp_solve.analytic_sums`).  ``gram_min_eig`` (the clients' summed λ_min,
``ridge="adassp"``) remains a lower bound on the union's λ_min, since λ_min is superadditive over
positive semidefinite matrices.  A chain is DP in every session or in none
(:func:`check_same_privacy`): un-noised sums added to noisy ones would be neither exact nor
covered by one noise record.  What a DP chain spends: under the image unit each image enters one
session, so the sessions release disjoint images and the chain's ε per institution is the max over
sessions; under the patient unit the sessions' ε compose (:class:`~secure_afl.privacy.dp_growth.ChainNoise`).

Both Gram scopes are additive.  With ``gram="class"`` the class group ``class/<c>`` sums, per
session, the Grams of the rows of the clients that label ``c`` then, so the accumulated class Gram
is the Gram of every released row labelled for ``c``: exactly the rows its ``pos_sum``/``feat_sum``
cover.  A class group's membership may therefore change between sessions (a hospital that starts
labelling a class contributes its *new* rows to that class from then on); a class group absent from
one session keeps its earlier sums, and a class first labelled in a later session starts there.
Rows released before a hospital labelled ``c`` are not in ``class/<c>``: labelling them later would
release them a second time, which the one-contribution-per-image rule forbids.  With
``gram="global"`` the ``all`` Gram covers every released row.  What cannot change is the layout
itself: a group present in two sessions must carry the same tensors with the same shapes, the
class groups must agree on the Gram scope, and the ``all`` group must be in every session or in
none (its Gram would otherwise cover fewer rows than the class sums).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from secure_afl.statistics import ALL_GROUP, Contributions, GroupSums, StatisticsError

ADDITIVE_TENSORS = frozenset({"gram", "feat_sum", "n"})
ADDITIVE_PREFIXES = ("pos_sum/", "n_pos/")
# The DP layout's own tensors (secure_afl.privacy.dp): sums and counts over clipped rows, noisy.
DP_TENSORS = frozenset({"total_sum", "n_total", "gram_min_eig"})
DP_PREFIXES = ("neg_sum/", "n_neg/", "wpos_sum/", "wpos_n/")
# Scalars, of shape (1,): every count, and the clients' summed λ_min
_SCALARS = frozenset({"n", "n_total", "gram_min_eig"})
_SCALAR_PREFIXES = ("n_pos/", "n_neg/", "wpos_n/")


class GrowthError(StatisticsError):
    """Sums that cannot be accumulated across sessions (a non-additive layout, or two layouts)."""


def _refusal(group: str, tensor: str) -> str | None:
    """Why ``tensor`` of ``group`` cannot be accumulated, or None when it is a sum over images."""
    where = f"tensor {tensor!r} of group {group!r}"
    if group.startswith("pseudo/"):
        return (
            f"{where} is round 2's pseudo-label projection: a per-client mean difference whose "
            "pseudo-labels come from the session's teacher, not a sum over images, so sessions do not "
            "add; a growing federation accumulates round 1 only (run it with rounds=1)"
        )
    if tensor.startswith("b/"):
        return (
            f"{where} is the paper's per-client balanced projection (balance='client'): Eq. 9 weights "
            "a client's rows by 1/N+ and 1/N- of its own counts, so rows added later re-weight its "
            "earlier rows and the sessions' sums are not the sums of the union; a growing federation "
            "needs balance='global' (pos_sum/<c>, n_pos/<c>, feat_sum and n: plain sums and counts)"
        )
    if tensor in ADDITIVE_TENSORS or tensor.startswith(ADDITIVE_PREFIXES):
        return None
    if tensor in DP_TENSORS or tensor.startswith(DP_PREFIXES):
        return None
    return (
        f"{where} is not one of the additive statistics (gram, feat_sum, n, pos_sum/<c>, n_pos/<c> of "
        "balance='global', or the DP layout's sums and counts), so it cannot be accumulated across sessions"
    )


def check_additive(layout: Mapping[str, Iterable[str]]) -> None:
    """Refuse (:class:`GrowthError`) a layout ``{group: tensor names}`` that is not additive.

    For a study that will grow, before any session releases anything.
    """
    for group, tensors in layout.items():
        for tensor in tensors:
            why = _refusal(group, tensor)
            if why is not None:
                raise GrowthError(why)


def _checked(sums: GroupSums, which: str) -> tuple[dict[str, dict[str, np.ndarray]], int | None]:
    """A float64 copy of ``sums`` with every tensor additive, finite and of a consistent shape, and
    the feature dimension (None when only counts are present)."""
    check_additive(sums)
    dim: int | None = None
    out: dict[str, dict[str, np.ndarray]] = {}
    for group, tensors in sums.items():
        out[group] = {}
        for tensor, value in tensors.items():
            array = np.array(value, dtype=np.float64, copy=True)
            if not np.isfinite(array).all():
                raise GrowthError(f"{which} sums: tensor {tensor!r} of group {group!r} is not finite")
            if tensor in _SCALARS or tensor.startswith(_SCALAR_PREFIXES):
                expected: tuple[int, ...] | None = (1,)
            else:
                length = array.shape[0] if array.ndim else 0
                dim = length if dim is None else dim
                expected = (dim, dim) if tensor == "gram" else (dim,)
            if array.shape != expected:
                raise GrowthError(
                    f"{which} sums: tensor {tensor!r} of group {group!r} has shape {array.shape}, expected "
                    f"{expected} (one feature dimension for every tensor, counts of shape (1,))"
                )
            out[group][tensor] = array
    return out, dim


def is_private(sums: Mapping[str, Mapping[str, object]]) -> bool:
    """Whether ``sums`` are the DP layout's (some tensor only the DP layout has)."""
    return any(t in DP_TENSORS or t.startswith(DP_PREFIXES) for tensors in sums.values() for t in tensors)


def check_same_privacy(earlier_private: bool, new_private: bool) -> None:
    """Refuse (:class:`GrowthError`) a chain that mixes DP and non-DP sessions.

    Exact sums added to noisy ones: the result is neither the exact union (the non-DP sessions'
    claim) nor covered by the DP sessions' noise record alone, and a non-DP session released its
    images' statistics exactly, which no later noise takes back.  A chain keeps the first study's
    choice; a change of mind starts a new chain over images not yet released.
    """
    if earlier_private == new_private:
        return
    if new_private:
        raise GrowthError(
            "a DP session cannot extend a chain of non-DP sessions: their sums are exact and the DP "
            "solve would add noisy sums to them; start a new chain with DP over images not yet released"
        )
    raise GrowthError(
        "a non-DP session cannot extend a chain of DP sessions: its exact sums would be added to noisy "
        "ones; keep the chain's differential privacy (the same dp settings in every study)"
    )


def _gram_scope(sums: Mapping[str, Mapping[str, np.ndarray]]) -> set[bool]:
    """Per class group, whether it carries the Gram (``gram="class"``)."""
    return {"gram" in tensors for group, tensors in sums.items() if group != ALL_GROUP}


def accumulate_sums(earlier: GroupSums | None, new: GroupSums) -> Contributions:
    """The sums of the earlier sessions plus a new session's sums, as a new float64 mapping.

    ``earlier`` is None for a federation's first session.  Both must be the additive
    ``balance="global"`` layout, or both the DP layout (see the module docstring); a group present
    in both must carry the same tensors with the same shapes, and every class group the same Gram
    scope.  Groups of only one side are kept as they are (a class labelled first in this session,
    or by no client with new rows).  Raises :class:`GrowthError`, leaving both inputs untouched.
    """
    if not new:
        raise GrowthError("the new session has no sums: a session must release at least one group")
    added, dim = _checked(new, "the new session's")
    if earlier is None:
        scope = _gram_scope(added)
        if len(scope) > 1:
            raise GrowthError(
                "the new session's class groups disagree on the Gram: some carry 'gram' (gram='class') "
                "and some do not (gram='global'); use one layout for every class"
            )
        return added
    total, earlier_dim = _checked(earlier, "the earlier sessions'")
    check_same_privacy(is_private(total), is_private(added))
    if (ALL_GROUP in total) != (ALL_GROUP in added):
        where = "the earlier sessions" if ALL_GROUP in total else "the new session"
        raise GrowthError(
            f"only {where} carry the {ALL_GROUP!r} group (the Gram of every row): its sum would cover "
            "some sessions' rows and the class sums all of them; a growing federation keeps its layout "
            "(the same gram option and rounds in every session)"
        )
    if None not in (dim, earlier_dim) and dim != earlier_dim:
        raise GrowthError(
            f"the new session's features have dimension {dim} and the earlier sessions' {earlier_dim}: "
            "every session must use the same backbone and feature dimension"
        )
    for group, tensors in added.items():
        if group not in total:
            continue
        if set(tensors) != set(total[group]):
            only_new = sorted(set(tensors) - set(total[group]))
            only_old = sorted(set(total[group]) - set(tensors))
            raise GrowthError(
                f"group {group!r} carries other tensors in the new session than before (only new: "
                f"{only_new}, only earlier: {only_old}): a growing federation keeps its layout "
                "(the same balance and gram options in every session)"
            )
        dims = {name: (value.shape, total[group][name].shape) for name, value in tensors.items()}
        clash = {name: shapes for name, shapes in dims.items() if shapes[0] != shapes[1]}
        if clash:
            name, (now, before) = next(iter(clash.items()))
            raise GrowthError(
                f"tensor {name!r} of group {group!r} has shape {now} in the new session and {before} "
                "before: every session must use the same backbone and feature dimension"
            )
    merged = {group: dict(tensors) for group, tensors in total.items()}
    for group, tensors in added.items():
        target = merged.setdefault(group, {})
        for name, value in tensors.items():
            target[name] = target[name] + value if name in target else value
    if len(_gram_scope(merged)) > 1:
        raise GrowthError(
            "the sessions disagree on the Gram: some class groups carry 'gram' (gram='class') and some "
            "do not (gram='global'); a growing federation keeps one layout"
        )
    return merged
