"""DP in the simulator: the masking protocol carries noised values, ε ≤ target, DP off unchanged."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from secure_afl.analytic import AnalyticClassifier, client_statistics, sum_contributions
from secure_afl.cli import main
from secure_afl.privacy.dp import DpConfig
from secure_afl.sim.datasets import prepare
from secure_afl.sim.dp_sweep import run_dp_sweep, write_sweep
from secure_afl.sim.fedavg import FedAvgConfig
from secure_afl.sim.metrics import evaluate
from secure_afl.sim.partial import assign_partial_labels
from secure_afl.sim.private import AFL_DP_1, AFL_DP_2
from secure_afl.sim.runner import run_experiment
from secure_afl.sim.setting import AFL_GLOBAL_BALANCE, SimConfig

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
    assert dp["ridge"] > 0
    # No exact per-client count that DP does not cover: only the public cap on each client's rows.
    assert not {"rows_clipped", "rows_used"} & set(dp) and dp["max_rows"] >= 1
    said = " ".join(result.output.split())  # the terminal's lines unwrapped
    assert "rows clipped:" not in said and "used or clipped is not published" in said
    # The audit and the clients' own checks in one vocabulary: the terminal's count is report.md's list.
    report = (tmp_path / "report.md").read_text()
    agreeing = re.search(r"own exposure checks against this audit \(.*?\): agree: ([^;\n]*)", report)
    assert agreeing is not None, report
    count = len(agreeing.group(1).split(", "))
    assert f"{count} of 8 clients' own exposure checks agree with this audit" in said and count == 8
    assert "pseudo_n_neg/0 + pseudo_n_neg/1" not in said and "(8 tensors)" in said  # report.md names them
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
            "--protection",
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
    # the split may spread a patient's 2 images over 2 of the 8 clients, each rounding its own values
    assert all(b["rounding_clients"] == 2 for b in dp["blocks"])
    assert all(e <= 4 for e in dp["epsilon_spent"].values())
    bad = _run(["--dp-epsilon", "-1", "--out", str(tmp_path), *SMALL])
    assert bad.exit_code != 0 and "dp-epsilon" in bad.output


def test_the_patient_cap_does_not_depend_on_a_clients_place_in_the_list() -> None:
    """Each patient keeps its first images in the cohort's order: the clients listed in another
    order keep the same rows (capped in the list's order, the last client lost a third of its rows)."""
    import dataclasses

    from secure_afl.sim.private import client_rows

    data = prepare(None, fraction=0.05, dim=8, seed=0, n_clients=8)
    dp = DpConfig(epsilon=1.0, unit="patient", max_images_per_patient=1)
    kept = client_rows(data, dp)
    split = dataclasses.replace(data.split, clients=data.split.clients[::-1])
    reversed_kept = client_rows(dataclasses.replace(data, split=split), dp)
    assert [r.tolist() for r in reversed_kept] == [r.tolist() for r in kept[::-1]]
    ids = data.cohort.patient_ids[np.concatenate(kept)]
    assert len(set(ids.tolist())) == len(ids)  # the cap holds over every client together
    assert sum(map(len, kept)) < sum(map(len, data.split.clients))  # and takes rows away


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
    dp = DpConfig(epsilon=1.0, projection_dim=8, ridge="adaptive")
    config = SimConfig(missing=(1, 7), rounds=1, fraction=0.05, dim=16, secure="none", device="cpu", dp=dp)
    sweep = run_dp_sweep(config, epsilons=(1.0, float("inf")))
    points = sweep["points"]
    # today's mechanism and the projected one, side by side, at every (missing, ε)
    assert sweep["mechanisms"] == ["d dims, bound ridge", "K = 8, adaptive ridge"]
    for mechanism, k in (("d dims, bound ridge", None), ("K = 8, adaptive ridge", 8)):
        ours = [p for p in points if p["mechanism"] == mechanism]
        assert {(p["missing"], p["epsilon"]) for p in ours} == {(1, 1.0), (1, None), (7, 1.0), (7, None)}
        assert all(p["projection_dim"] == k for p in ours)
        assert all((p["ridge"] is None) == (p["epsilon"] is None) for p in ours)
    assert all(0 <= p["auc"] <= 1 for p in points)
    json_path, png_path = write_sweep(sweep, tmp_path)
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(json_path.read_text())["points"] == json.loads(json.dumps(points))
    assert np.isfinite([p["bacc"] for p in points]).all()


def test_sim_dp_dim_runs_under_masking_and_reports_the_mechanism(tmp_path: Path) -> None:
    from secure_afl.privacy.projection import projection_digest

    result = _run(
        ["--missing", "1", "--rounds", "2", "--dp-epsilon", "4", "--dp-dim", "8", "--dp-ridge", "adassp",
         "--dp-projection-seed", "7", "--out", str(tmp_path), *SMALL]
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert (
        "mechanism: rows projected from d = 24 to K = 8 by the public random projection of seed 7" in output
    )
    assert "ridge: adassp" in output and "λ̃_min" in output and "adaptive λ = max(0, B − λ̃_min)" in output
    data = json.loads((tmp_path / "results.json").read_text())
    setting = data["settings"][0]
    assert setting["protocol_costs"]["round1"]["bytes_sent"] and setting["protocol_costs"]["round2"]
    assert set(setting["metrics"]) == {AFL_DP_1, AFL_DP_2}
    dp = setting["differential_privacy"]
    assert dp["projection"]["dim"] == 8 and dp["projection"]["seed"] == 7
    assert dp["projection"]["feature_dim"] == 24 and dp["projection"]["sha256"] == projection_digest(24, 8, 7)
    assert dp["ridge_kind"] == "adassp" and dp["eigen_share"] == 0.05
    assert 0 <= dp["ridge"] <= dp["ridge_noise_bound"] and dp["min_eigenvalue_lower_bound"] >= 0
    gram = next(b for b in dp["blocks"] if b["block"] == "gram")
    assert gram["sensitivity"] == 32.0**2  # the projected rows are clipped to the same bound
    assert [b["group"] for b in dp["blocks"] if b["block"] == "eigen"] == ["all"]
    assert all(0.9 * 4 < e <= 4 for e in dp["epsilon_spent"].values())  # the λ_min release included


def test_the_simulators_clients_project_with_the_studys_matrix() -> None:
    from secure_afl.privacy.dp import private_statistics
    from secure_afl.privacy.projection import projection_matrix
    from secure_afl.sim.private import client_private_statistics

    dp = DpConfig(epsilon=1.0, clip=20.0, projection_dim=6, projection_seed=3)
    config = SimConfig(missing=(1,), rounds=1, fraction=0.05, dim=24, device="cpu", dp=dp)
    data = prepare(None, fraction=0.05, dim=24, seed=0, n_clients=8, split="image")
    stats = client_private_statistics(data, config)
    matrix = projection_matrix(24, 6, 3)
    for k, rows in enumerate(data.split.clients):
        own = private_statistics(
            data.features[rows], data.cohort.labels[rows], 20.0, projection=matrix, device="cpu"
        )
        assert np.array_equal(stats[f"client-{k}"].gram, own.gram) and own.gram.shape == (6, 6)


def test_dp_dim_and_ridge_without_dp_or_out_of_range_are_refused(tmp_path: Path) -> None:
    out = ["--out", str(tmp_path), *SMALL]
    alone = _run(["--dp-dim", "8", *out])
    assert alone.exit_code == 2
    assert (
        "--dp-dim shapes the differential-privacy mechanism: add --dp-epsilon (or --dp-sweep)" in alone.output
    )
    ridge = _run(["--dp-ridge", "adaptive", "--dp-projection-seed", "2", *out])
    assert ridge.exit_code == 2 and "--dp-ridge and --dp-projection-seed shape the differential-privacy" in (
        " ".join(ridge.output.split())
    )
    zero = _run(["--dp-epsilon", "1", "--dp-dim", "0", *out])
    assert zero.exit_code == 2 and "must be a positive integer, got 0" in zero.output
    above = _run(["--dp-epsilon", "1", "--dp-dim", "32", *out])  # SMALL has --dim 24
    assert above.exit_code == 2 and "--dp-dim 32 exceeds the feature dimension 24" in " ".join(
        above.output.split()
    )
    assert not (tmp_path / "results.json").exists()


def test_sim_positive_class_sums_run_under_masking_with_both_rounds(tmp_path: Path) -> None:
    result = _run(
        ["--missing", "1", "--rounds", "2", "--dp-epsilon", "2", "--dp-class-sums", "positives",
         "--protection", "mask", "--out", str(tmp_path), *SMALL]
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "label-normalised positive sums + total" in " ".join(result.output.split())
    setting = json.loads((tmp_path / "results.json").read_text())["settings"][0]
    assert set(setting["metrics"]) == {AFL_DP_1, AFL_DP_2}
    dp = setting["differential_privacy"]
    assert dp["class_sums"] == "positives" and dp["total_share"] == 0.1
    kinds = {(b["group"], b["block"]) for b in dp["blocks"]}
    assert {("all", "total_sums"), ("all", "total_counts"), ("class/0", "sums")} <= kinds
    assert all(0.9 * 2 < e <= 2 for e in dp["epsilon_spent"].values())
    alone = _run(["--dp-class-sums", "positives", "--out", str(tmp_path / "x"), *SMALL])
    assert alone.exit_code == 2 and "--dp-class-sums shapes the differential-privacy" in alone.output
    centre = _run(["--dp-row-centre", "--out", str(tmp_path / "x"), *SMALL])
    assert centre.exit_code == 2 and "--dp-row-centre shapes the differential-privacy" in centre.output


def test_sim_row_centring_defaults_to_its_clip_and_releases_weights_for_the_original_rows(
    tmp_path: Path,
) -> None:
    result = _run(
        ["--missing", "7", "--rounds", "1", "--dp-epsilon", "1", "--dp-row-centre", "--dp-class-sums",
         "positives", "--out", str(tmp_path), *SMALL]
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "rows centred (own mean removed, the public map" in " ".join(result.output.split())
    dp = json.loads((tmp_path / "results.json").read_text())["settings"][0]["differential_privacy"]
    assert dp["clip"] == 20.0 and dp["row_centre"] is True
    explicit = _run(
        ["--missing", "7", "--rounds", "1", "--dp-epsilon", "1", "--dp-row-centre", "--clip", "5",
         "--out", str(tmp_path / "c"), *SMALL]
    )  # fmt: skip
    assert explicit.exit_code == 0, explicit.output
    dp = json.loads((tmp_path / "c" / "results.json").read_text())["settings"][0]["differential_privacy"]
    assert dp["clip"] == 5.0


def test_the_sweep_puts_the_positive_sums_beside_todays_mechanism(tmp_path: Path) -> None:
    dp = DpConfig(epsilon=1.0, class_sums="positives")
    config = SimConfig(missing=(1, 7), rounds=1, fraction=0.05, dim=16, secure="mask", device="cpu", dp=dp)
    sweep = run_dp_sweep(config, epsilons=(1.0, float("inf")), baseline_clip=32.0)
    assert sweep["mechanisms"] == ["d dims, bound ridge", "d dims, bound ridge, positive sums"]
    assert sweep["clips"] == {"d dims, bound ridge": 32.0, "d dims, bound ridge, positive sums": 32.0}
    ours = [p for p in sweep["points"] if p["mechanism"].endswith("positive sums")]
    assert {(p["missing"], p["epsilon"]) for p in ours} == {(1, 1.0), (1, None), (7, 1.0), (7, None)}
    assert all(0 <= p["auc"] <= 1 for p in sweep["points"])
