"""What the DP mechanism takes from its caller: active-class masks, the pseudo-label threshold τ,
and the row bound that keeps every encoding inside the fixed-point range."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from secure_afl.analytic import (
    ALL_GROUP,
    MethodParameterError,
    PseudoLabelConfig,
    StatisticsError,
    class_group,
    pseudo_group,
)
from secure_afl.core import encoding
from secure_afl.core.errors import EncodingOverflowError
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.features.file import FeatureFileError, load_feature_file, save_feature_file
from secure_afl.privacy.dp import (
    DpConfig,
    DpError,
    FederationLayout,
    encodable_rows,
    plan_noise,
    private_statistics,
    pseudo_label_round,
    pseudo_label_upload,
    round1_upload,
)
from secure_afl.privacy.dp_config import DEFAULT_MAX_ROWS, PseudoLabelThresholdError

CLIP = 3.0


def _stats(n_classes: int = 4):
    rng = np.random.default_rng(0)
    x = np.abs(rng.normal(size=(30, 5)))
    y = (rng.random((30, n_classes)) < 0.5).astype(int)
    return x, y, private_statistics(x, y, CLIP, device="cpu")


# ------------------------------------------------------------------------------------------------
# Active classes: a boolean mask is a mask; anything but indices or a mask is refused
# ------------------------------------------------------------------------------------------------


def test_round1_reads_a_boolean_mask_as_a_mask() -> None:
    _, _, stats = _stats()
    for mask in (np.array([False, False, True, False]), [False, False, True, False]):
        upload = stats.round1(mask)
        assert sorted(upload) == [ALL_GROUP, class_group(2)]  # class 2, not classes 0 and 1
        assert np.array_equal(upload[class_group(2)]["pos_sum/2"], stats.pos_sum[:, 2])
    assert sorted(stats.round1(np.array([True, False, True, True]))) == sorted(stats.round1([0, 2, 3]))


@pytest.mark.parametrize(
    ("active", "message"),
    [
        ([-1], r"active classes \[-1\] are outside 0..3"),
        ([4], r"active classes \[4\] are outside 0..3"),
        ([2.0], "must be class indices"),
        ([True, 2], "mix booleans and integers"),
        (np.array([True, False]), "needs one entry per class"),
    ],
)
def test_round1_refuses_what_is_neither_indices_nor_a_mask(active, message: str) -> None:
    _, _, stats = _stats()
    with pytest.raises(StatisticsError, match=message):
        stats.round1(active)


def test_pseudo_label_round_reads_a_boolean_mask_as_a_mask() -> None:
    x, _, _ = _stats()
    coef = np.random.default_rng(1).normal(size=(5, 4))
    upload = pseudo_label_round(x, coef, np.array([False, False, True, False]))
    assert sorted(upload) == [pseudo_group(0), pseudo_group(1), pseudo_group(3)]  # every class but 2
    assert sorted(pseudo_label_round(x, coef, [1, 2])) == [pseudo_group(0), pseudo_group(3)]
    with pytest.raises(StatisticsError, match=r"outside 0\.\.3"):
        pseudo_label_round(x, coef, [-1])
    with pytest.raises(StatisticsError, match="must be class indices"):
        pseudo_label_round(x, coef, [2.0])


def test_the_noise_plans_layout_reads_masks_and_refuses_bad_classes() -> None:
    layout = FederationLayout(
        active={"a": np.array([True, False, False]), "b": [False, True, True], "c": (2, 1)},
        n_classes=3,
        dim=4,
        threshold=2,
    )
    assert dict(layout.active) == {"a": (0,), "b": (1, 2), "c": (1, 2)}
    assert (layout.members(class_group(0)), layout.members(class_group(2))) == (1, 2)
    assert layout.members(pseudo_group(0)) == 2
    for bad, message in (([-1], "outside 0..2"), ([2.0], "must be class indices")):
        with pytest.raises(DpError, match=f"institution 'b': .*{message}"):
            FederationLayout(active={"a": (0,), "b": bad}, n_classes=3, dim=4, threshold=2)


def _write(path: Path, active) -> None:
    save_feature_file(
        path, np.zeros((2, 3)), labels=np.zeros((2, 4)), active=active, classes=("A", "B", "C", "D"),
        backbone="toy", weights_id="sha256:00", preprocessing="none",
    )  # fmt: skip


def test_a_feature_file_takes_a_boolean_mask_as_a_mask(tmp_path: Path) -> None:
    _write(tmp_path / "mask.npz", np.array([False, False, True, False]))
    assert load_feature_file(tmp_path / "mask.npz").active == (2,)
    _write(tmp_path / "list.npz", [False, True, True, False])
    assert load_feature_file(tmp_path / "list.npz").active == (1, 2)
    _write(tmp_path / "indices.npz", [3, 0])
    assert load_feature_file(tmp_path / "indices.npz").active == (0, 3)


@pytest.mark.parametrize(
    ("active", "message"),
    [
        ([-1], r"active: active classes \[-1\] are outside 0..3"),
        ([2.0], "active: active classes must be class indices"),
        ([False, True], "active: a boolean mask of active classes needs one entry per class"),
    ],
)
def test_a_feature_file_refuses_bad_active_classes(tmp_path: Path, active, message: str) -> None:
    with pytest.raises(FeatureFileError, match=message):
        _write(tmp_path / "bad.npz", active)
    assert not (tmp_path / "bad.npz").exists()


# ------------------------------------------------------------------------------------------------
# Round 2's threshold τ: the noise assumes disjoint pseudo-positive and pseudo-negative sets
# ------------------------------------------------------------------------------------------------


def test_at_tau_below_one_half_an_image_would_be_in_both_sets_so_round_2_refuses_it() -> None:
    x, _, _ = _stats()
    coef = np.random.default_rng(1).normal(size=(5, 4)) * 0.05  # scores near 0: σ near 0.5
    p = 1 / (1 + np.exp(-(x @ coef[:, 0])))
    assert ((p > 0.3) & (p < 0.7)).any()  # at τ = 0.3 these rows would move both sums of pseudo/0
    for tau in (0.3, 0.49, float("nan"), 1.0):
        with pytest.raises(MethodParameterError, match=r"tau must be a number in \[0\.5, 1\)"):
            PseudoLabelConfig(tau=tau)  # the method's own rule, with or without DP
        unchecked = object.__new__(PseudoLabelConfig)  # made around that rule: the DP round still refuses
        for name, value in {"tau": tau, "alpha": 0.5, "min_pos": 5, "min_neg": 50}.items():
            object.__setattr__(unchecked, name, value)
        with pytest.raises(PseudoLabelThresholdError, match=r"tau = .* is not in \[0\.5, 1\)"):
            pseudo_label_round(x, coef, [1], unchecked)
    assert issubclass(PseudoLabelThresholdError, DpError) and issubclass(DpError, ValueError)
    upload = pseudo_label_round(x, coef, [1], PseudoLabelConfig(tau=0.5))
    for c in (0, 2, 3):  # at τ = 0.5 every row is in at most one set
        counts = upload[pseudo_group(c)]
        assert counts[f"pseudo_n_pos/{c}"][0] + counts[f"pseudo_n_neg/{c}"][0] <= len(x)
        both = np.sum(1 / (1 + np.exp(-(x @ coef[:, c]))) > 0.5) + np.sum(
            1 / (1 + np.exp(-(x @ coef[:, c]))) < 0.5
        )
        assert counts[f"pseudo_n_pos/{c}"][0] + counts[f"pseudo_n_neg/{c}"][0] == both


def test_alpha_and_the_qualification_thresholds_do_not_reach_the_clients_dp_upload() -> None:
    """α, δ⁺ and δ⁻ are the server's post-processing of noisy sums: the noise assumes nothing of them."""
    x, _, _ = _stats()
    coef = np.random.default_rng(2).normal(size=(5, 4))
    base = pseudo_label_round(x, coef, [0], PseudoLabelConfig(tau=0.7))
    other = pseudo_label_round(x, coef, [0], PseudoLabelConfig(tau=0.7, alpha=0.9, min_pos=500, min_neg=1))
    assert base.keys() == other.keys()
    for group, tensors in base.items():
        for name, values in tensors.items():
            assert np.array_equal(values, other[group][name])


def test_the_simulator_refuses_a_dp_round_2_below_tau_one_half_before_running() -> None:
    from secure_afl.sim.setting import SimConfig

    dp = DpConfig(epsilon=1.0)
    SimConfig(rounds=2, dp=dp, pseudo=PseudoLabelConfig(tau=0.5)).validate()
    # Below 0.5 Eq. 19's two sets overlap with or without DP, in one round or two: the study's rule.
    for rounds, private in ((2, dp), (1, dp), (2, None)):
        with pytest.raises(MethodParameterError, match=r"tau must be a number in \[0\.5, 1\)"):
            SimConfig(rounds=rounds, dp=private, pseudo=PseudoLabelConfig(tau=0.3)).validate()


# ------------------------------------------------------------------------------------------------
# The fixed-point range: checked from the plan (clip, max_rows, group sizes), not from the data
# ------------------------------------------------------------------------------------------------

BIG_CLIP = 32.0


def _plan(max_rows: int, members: int = 8, epsilon: float = 1.0):
    layout = FederationLayout(
        active={f"c{k}": (0,) for k in range(members)},
        n_classes=1,
        dim=4,
        threshold=(2 * members) // 3 + 1,
        min_group_size=2,
    )
    return plan_noise(DpConfig(epsilon=epsilon, clip=BIG_CLIP, max_rows=max_rows), layout)


def test_the_plan_refuses_a_row_bound_that_could_overflow_and_says_what_to_change() -> None:
    plan = _plan(1)
    fits = min(encodable_rows(b, plan.config, plan.frac_bits) for b in plan.blocks.values())
    # 8 members, 32 fractional bits: (2^63 − 1) / 2^32 / 8 / 32² = 262,144 rows, less the noise's room
    assert 261_000 < fits < 262_144
    _plan(fits)
    with pytest.raises(
        DpError, match=rf"set --dp-max-rows \(max_rows, .*\) to at most {fits}, or lower --clip"
    ):
        _plan(fits + 1)
    with pytest.raises(DpError, match=r"in group 'all' \(8 members, 32 fractional bits\)"):
        _plan(262_300)
    with pytest.raises(DpError, match="must be a positive integer"):
        _plan(0)
    assert DpConfig(epsilon=1.0).max_rows == DEFAULT_MAX_ROWS
    _plan(DEFAULT_MAX_ROWS, members=20)  # the default fits federations of up to 20 institutions
    with pytest.raises(DpError, match="at most"):
        _plan(DEFAULT_MAX_ROWS, members=21)


def test_within_the_plans_bounds_the_encoding_check_cannot_fire() -> None:
    """The worst data the bounds allow: every row on the clip bound along one axis, all positive."""
    plan = _plan(1)
    fits = min(encodable_rows(b, plan.config, plan.frac_bits) for b in plan.blocks.values())
    plan = _plan(fits)
    x = np.zeros((fits, 4))
    x[:, 0] = BIG_CLIP  # Gram[0, 0] = rows·clip², pos_sum[0] = rows·clip, n_pos = rows
    stats = private_statistics(x, np.ones((fits, 1), dtype=int), BIG_CLIP, device="cpu")
    assert stats.gram[0, 0] == fits * BIG_CLIP**2
    for seed in range(3):
        noisy, _ = round1_upload(stats, [0], plan, DeterministicRandomSource(bytes([seed]) * 32))
        for tensors in noisy.values():
            for name, values in tensors.items():
                flat = encoding.pack_symmetric(values) if name == "gram" else np.ravel(values)
                encoding.check_encodable(flat, tensor=name, frac_bits=plan.frac_bits, group_size=8)
    # Beyond the bound the whole federation's encoding could wrap: refused before any noise is drawn.
    more = private_statistics(
        np.vstack([x, x[:1]]), np.ones((fits + 1, 1), dtype=int), BIG_CLIP, device="cpu"
    )
    with pytest.raises(DpError, match=rf"has {fits + 1} feature rows .* max_rows = {fits}: .*--dp-max-rows"):
        round1_upload(more, [0], plan, DeterministicRandomSource(b"\0" * 32))
    with pytest.raises(DpError, match=rf"max_rows = {fits}"):
        pseudo_label_upload(
            np.vstack([x, x[:1]]), np.zeros((4, 2)), [0], plan, DeterministicRandomSource(b"\0" * 32)
        )


def test_without_the_plans_bound_the_same_rows_overflow_at_encoding() -> None:
    """What the plan's check prevents: the data-dependent refusal at encode time."""
    plan = _plan(1)
    x = np.zeros((263_000, 4))
    x[:, 0] = BIG_CLIP
    stats = private_statistics(x, np.ones((len(x), 1), dtype=int), BIG_CLIP, device="cpu")
    with pytest.raises(EncodingOverflowError):
        encoding.check_encodable(
            encoding.pack_symmetric(stats.gram), tensor="gram", frac_bits=plan.frac_bits, group_size=8
        )
    with pytest.raises(DpError, match="max_rows = 1:"):
        round1_upload(stats, [0], plan, DeterministicRandomSource(b"\0" * 32))
