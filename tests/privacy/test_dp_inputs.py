"""What the DP mechanism takes from its caller: active-class masks, the pseudo-label threshold τ,
and the row bound that keeps every encoding inside the fixed-point range (issues 21 and 23)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from secure_afl.analytic import ALL_GROUP, StatisticsError, class_group, pseudo_group
from secure_afl.features.file import FeatureFileError, load_feature_file, save_feature_file
from secure_afl.privacy.dp import (
    DpError,
    FederationLayout,
    private_statistics,
    pseudo_label_round,
)

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
