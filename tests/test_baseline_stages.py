"""Every stage of the baselines runs, and the second stages change the heads."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from secure_afl.sim.baselines import BaselineConfig
from secure_afl.sim.baselines.common import Federation, Method, train
from secure_afl.sim.baselines.engine import LinearHead
from secure_afl.sim.baselines.fmll import FedMLP
from secure_afl.sim.baselines.fnll import FedLSR, FedNoRo
from secure_afl.sim.baselines.fssl import CBAFed, FedIRM
from secure_afl.sim.methods import SCHEDULES


def _federation(
    seed: int = 0, n: int = 400, d: int = 16, n_classes: int = 4
) -> tuple[Federation, np.ndarray]:
    """Four clients, each labelling one class (missing 3): the other classes' positives look negative."""
    rng = np.random.default_rng(seed)
    signal = 2.0 * rng.normal(size=(n_classes, d))
    labels = [(rng.random((n, n_classes)) < 0.3).astype(int) for _ in range(4)]
    features = [(rng.normal(size=(n, d)) + y @ signal).astype(np.float32) for y in labels]
    return Federation.build(features, labels, [[k] for k in range(4)]), np.stack(labels)


def _train(method: Method, fed: Federation, rounds: int) -> LinearHead:
    return train(method, fed, BaselineConfig(rounds=rounds, batch_size=50, lr=1e-2))


def test_schedules_scale_every_stage_boundary_from_the_reference_rounds() -> None:
    assert SCHEDULES == {"paper": 50, "reference": 500}
    fed, _ = _federation(n=60)
    expected = {"paper": (5, 5, 2, 4.0, 1.0, 49.9), "reference": (50, 50, 20, 40.0, 10.0, 499.0)}
    for schedule, rounds in SCHEDULES.items():
        scale = BaselineConfig(rounds=rounds).stage_scale
        fedmlp, cbafed, fedirm = FedMLP(), CBAFed(), FedIRM()
        for method in (fedmlp, cbafed, fedirm):
            method.stage_scale = scale
            method.start(fed, torch.zeros(4, 17), torch.Generator())
        fedlsr, fednoro = FedLSR(), FedNoRo()
        got = (
            fedmlp.stage1,
            cbafed.warmup,
            fedirm.supervised_rounds,
            fedlsr.WARMUP_ROUNDS * scale,
            fednoro.RAMP_BEGIN * scale,
            fednoro.RAMP_END * scale,
        )
        assert got == pytest.approx(expected[schedule]), schedule


def test_fedmlp_stage2_pseudo_labels_from_prototypes_and_changes_the_head() -> None:
    fed, truth = _federation()
    method = FedMLP()
    head = _train(method, fed, rounds=10)  # R = 10: stage 1 ends after round max(1, 10/500·50) = 1
    assert method.stage1 == 1 and method.views == ("view1",)
    prototypes = method.state["prototypes"]
    assert prototypes.shape == (4, 2, 16) and torch.isfinite(prototypes).all()
    tao = method.state["tao"]
    assert tao.shape == (4,) and torch.all((tao >= 0) & (tao <= 1))
    selected = method.selected.numpy()
    assert not selected[np.arange(4), :, np.arange(4)].any()  # never on a client's own active class
    # 1 % of the negative-scored rows and 0.5 % of the rest per round: hundreds over 9 rounds
    positives = selected & (method.pseudo.numpy() == 1)
    negatives = selected & (method.pseudo.numpy() == 0)
    assert positives.sum() > 20 and negatives.sum() > 20
    # prototypes separate the classes: the pseudo-labels are mostly right, far above the 30 % base rate
    assert truth[positives].mean() > 0.9 and truth[negatives].mean() < 0.1

    class NoPseudoLabels(FedMLP):
        CLEAN_SHARE = NOISE_SHARE = 0.0  # stage 2 then trains the active classes only

    plain = NoPseudoLabels()
    without = _train(plain, fed, rounds=10)
    assert not plain.selected.any()
    # the pseudo-labels move every client's missing classes, i.e. every column of the global head
    changed = np.abs(head.coef - without.coef).max(axis=0)
    assert np.all(changed > 1e-3), changed


def test_cbafed_stage2_thresholds_pseudo_labels_and_changes_the_head() -> None:
    fed, _ = _federation(seed=1)
    method = CBAFed()
    head = _train(method, fed, rounds=20)  # warm-up max(1, 20/500·50) = 2 rounds
    assert method.warmup == 2
    assert method.tau is not None and torch.all((method.tau >= 0.55) & (method.tau <= 0.95))
    assert method.pseudo_labels > 100  # confident (row, missing class) pairs trained on
    assert method.data_counts.sum() > fed.x.shape[0] * fed.x.shape[1]  # labels + pseudo-labels counted
    # missing classes' pos_weight now the confident / pseudo-positive ratio of the last batch
    missing = ~fed.active
    assert torch.all(method.pos_weight[missing] >= 1.0)
    assert not torch.equal(method.pos_weight[missing], fed.pos_weight[missing])

    class WarmUpOnly(CBAFed):
        WARMUP_ROUNDS = 10**6

    warm = WarmUpOnly()
    without = _train(warm, fed, rounds=20)
    assert warm.pseudo_labels == 0
    changed = np.abs(head.coef - without.coef).max(axis=0)
    assert np.all(changed > 1e-3), changed


def test_fednoro_distillation_ramps_to_its_weight_by_the_last_round() -> None:
    fed, _ = _federation(seed=2)
    weights: list[float] = []

    class Recording(FedNoRo):
        def start_round(self, rnd: int, global_w: torch.Tensor, local_w: torch.Tensor) -> None:
            super().start_round(rnd, global_w, local_w)
            weights.append(self.kd_weight)

    head = _train(Recording(), fed, rounds=50)  # the paper schedule: ramp from round 1 to 49.9
    assert weights[0] == pytest.approx(0.8 * np.exp(-5.0)) and weights[-1] > 0.79
    assert all(b >= a for a, b in itertools.pairwise(weights))
    assert sum(w > 0.4 for w in weights) > 10  # distillation dominates the later rounds
    # the reference's own ramp (10 to 499) cut at round 50 never passes 0.0116: the old behaviour
    cut = FedNoRo()
    cut.stage_scale = 1.0
    cut.start_round(49, torch.zeros(1), torch.zeros(1))
    assert cut.kd_weight < 0.0117

    class NoDistillation(FedNoRo):
        KD_MAX = 0.0

    without = _train(NoDistillation(), fed, rounds=50)
    changed = np.abs(head.coef - without.coef).max(axis=0)
    assert np.all(changed > 1e-3), changed


def test_sim_schedule_sets_the_rounds_of_fedavg_and_the_baselines(tmp_path) -> None:
    import json

    from click.testing import CliRunner

    from secure_afl.cli import main

    common = [
        "sim",
        "--missing",
        "7",
        "--fraction",
        "0.02",
        "--dim",
        "16",
        "--protection",
        "none",
        "--rounds",
        "1",
    ]
    runs = {"paper": [], "custom": ["--fedavg-rounds", "3"]}
    for name, extra in runs.items():
        out = tmp_path / name
        result = CliRunner().invoke(
            main, [*common, "--baselines", "CBAFed", *extra, "--out", str(out)], catch_exceptions=False
        )
        assert result.exit_code == 0, result.output
        config = json.loads((out / "results.json").read_text())["config"]
        rounds = 50 if name == "paper" else 3
        assert config["fedavg"]["rounds"] == config["baseline"]["rounds"] == rounds
        assert config["baseline"]["schedule"] == name and config["fedavg"]["weight_decay"] == 5e-4
    bad = CliRunner().invoke(main, [*common, "--schedule", "long", "--out", str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "'long' is not one of 'paper', 'reference'" in bad.output
