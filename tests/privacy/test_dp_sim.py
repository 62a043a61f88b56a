"""DP in the simulator: the masking protocol carries noised values, ε ≤ target, DP off unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from secure_afl.analytic import AnalyticClassifier, client_statistics, sum_contributions
from secure_afl.cli import main
from secure_afl.privacy.dp import DpConfig
from secure_afl.sim.datasets import prepare
from secure_afl.sim.dp_run import AFL_DP_1, AFL_DP_2, run_dp_sweep, write_sweep
from secure_afl.sim.fedavg import FedAvgConfig
from secure_afl.sim.metrics import evaluate
from secure_afl.sim.partial import assign_partial_labels
from secure_afl.sim.runner import AFL_GLOBAL_BALANCE, SimConfig, run_experiment

SMALL = ["--fraction", "0.05", "--dim", "24", "--fedavg-rounds", "1"]


def _run(args: list[str]):
    return CliRunner().invoke(main, ["sim", *args], catch_exceptions=False)


def test_sim_dp_missing7_runs_with_masking_and_spends_at_most_epsilon(tmp_path: Path) -> None:
    result = _run(
        ["--missing", "7", "--dp-epsilon", "1", "--dp-delta", "1e-6", "--out", str(tmp_path), *SMALL]
    )
    assert result.exit_code == 0, result.output
    assert "ε spent per institution" in result.output
    data = json.loads((tmp_path / "results.json").read_text())
    setting = data["settings"][0]
    assert data["config"]["secure"] == "mask"
    assert setting["protocol_costs"]["round1"]["bytes_sent"]  # the masking protocol ran
    assert set(setting["metrics"]) == {AFL_DP_1, AFL_DP_2}  # only the private method is released
    dp = setting["differential_privacy"]
    assert set(dp["epsilon_spent"]) == {f"client-{k}" for k in range(8)}
    assert all(0.9 < e <= 1.0 for e in dp["epsilon_spent"].values())
    # at missing 7 each class group has one member: it carries the whole noise
    sums = [b for b in dp["blocks"] if b["block"] == "sums" and b["group"].startswith("class/")]
    assert all(b["fewest_survivors"] == 1 for b in sums)
    gram = next(b for b in dp["blocks"] if b["block"] == "gram")
    assert gram["fewest_survivors"] == 5  # threshold 5 of 8: at most 3 members can be missing
    assert sum(dp["rows_clipped"].values()) >= 0 and dp["ridge"] > 0
    assert "Differential privacy" in (tmp_path / "report.md").read_text()


def test_sim_dp_patient_unit_and_bad_options(tmp_path: Path) -> None:
    result = _run(
        [
            "--missing",
            "1",
            "--rounds",
            "1",
            "--dp-epsilon",
            "4",
            "--dp-unit",
            "patient",
            "--dp-max-images-per-patient",
            "2",
            "--secure",
            "none",
            "--out",
            str(tmp_path),
            *SMALL,
        ]
    )
    assert result.exit_code == 0, result.output
    dp = json.loads((tmp_path / "results.json").read_text())["settings"][0]["differential_privacy"]
    assert dp["unit"] == "patient" and dp["max_images_per_patient"] == 2
    assert all(b["fewest_survivors"] == 1 for b in dp["blocks"])  # no masking: each input seen alone
    assert all(e <= 4 for e in dp["epsilon_spent"].values())
    bad = _run(["--dp-epsilon", "-1", "--out", str(tmp_path), *SMALL])
    assert bad.exit_code != 0 and "dp-epsilon" in bad.output


def test_dp_off_reproduces_the_non_private_pipeline() -> None:
    config = SimConfig(
        missing=(3,),
        rounds=1,
        fraction=0.05,
        dim=24,
        secure="none",
        fedavg=FedAvgConfig(rounds=1),
        device="cpu",
    )
    assert config.dp is None
    result = run_experiment(config)
    data = prepare(None, fraction=0.05, dim=24, seed=0, n_clients=8, split="image")
    assignment = assign_partial_labels(8, 8, 3, seed=0)
    uploads = [
        client_statistics(data.features[r], data.cohort.labels[r], device="cpu").contributions(
            assignment.active[k], balance="global"
        )
        for k, r in enumerate(data.split.clients)
    ]
    model = AnalyticClassifier(8, gamma=1.0, balance="global").fit(sum_contributions(uploads))
    expected = evaluate(
        data.cohort.labels[data.split.test],
        model.decision_function(data.features[data.split.test]),
        kind="logits",
    )
    got = result.settings[0].metrics[AFL_GLOBAL_BALANCE]
    assert got.macro == expected.macro
    assert result.settings[0].privacy is None


def test_epsilon_sweep_writes_the_figure(tmp_path: Path) -> None:
    config = SimConfig(
        missing=(1, 7), rounds=1, fraction=0.05, dim=16, secure="none", device="cpu", dp=DpConfig(epsilon=1.0)
    )
    sweep = run_dp_sweep(config, epsilons=(1.0, float("inf")))
    points = sweep["points"]
    assert {(p["missing"], p["epsilon"]) for p in points} == {(1, 1.0), (1, None), (7, 1.0), (7, None)}
    assert all(0 <= p["auc"] <= 1 for p in points)
    json_path, png_path = write_sweep(sweep, tmp_path)
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(json_path.read_text())["points"] == json.loads(json.dumps(points))
    assert np.isfinite([p["bacc"] for p in points]).all()
