"""`secure-afl sim` end to end on a reduced embedded dataset."""

from __future__ import annotations

import gc
import json
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from secure_afl.cli import main

SMALL = ["--fraction", "0.06", "--dim", "48", "--fedavg-rounds", "2"]
METHODS = {
    "AFL (1 round)",
    "AFL (2 rounds)",
    "AFL (2 rounds, rescaled τ)",
    "AFL (global balance)",
    "AFL (global Gram)",
    "FedAvg",
}


def _run(args: list[str]):
    return CliRunner().invoke(main, ["sim", *args], catch_exceptions=False)


def test_sim_missing_all_writes_every_method_and_setting(tmp_path: Path) -> None:
    result = _run(["--missing", "all", "--protection", "none", "--out", str(tmp_path), *SMALL])
    assert result.exit_code == 0, result.output
    assert "FEATURES ARE SYNTHETIC" in result.output
    assert "Class coverage, missing 7" in result.output
    data = json.loads((tmp_path / "results.json").read_text())
    assert [s["missing"] for s in data["settings"]] == [1, 3, 5, 7]
    for setting in data["settings"]:
        assert set(setting["metrics"]) == METHODS
        for metrics in setting["metrics"].values():
            assert 0 <= metrics["macro"]["bacc"] <= 1 and 0 <= metrics["macro"]["auc"] <= 1
        assert len(setting["coverage"]) == 8 and all(setting["coverage"])
        assert all(len(a) == 8 - setting["missing"] for a in setting["active_classes"])
        assert setting["upload_bytes"]["client-0"] > 0
    assert data["dataset"]["synthetic_features"] is True
    assert set(data["seconds_per_phase"]) >= {
        "data",
        "statistics",
        "aggregation",
        "solve",
        "gradient methods (wait)",
        "metrics",
    }
    report = (tmp_path / "report.md").read_text()
    assert "FEATURES ARE SYNTHETIC" in report and "| AFL (1 round) |" in report
    # two or more levels: the figure, as before the short report
    assert (tmp_path / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {tmp_path / 'figure.png'}" in result.output


def test_sim_one_round_leaves_out_round_two(tmp_path: Path) -> None:
    result = _run(["--missing", "3", "--rounds", "1", "--protection", "none", "--out", str(tmp_path), *SMALL])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "results.json").read_text())
    assert set(data["settings"][0]["metrics"]) == METHODS - {"AFL (2 rounds)", "AFL (2 rounds, rescaled τ)"}


@pytest.mark.parametrize("missing", ["8", "two", "0,9"])
def test_sim_rejects_unknown_missing_level(tmp_path: Path, missing: str) -> None:
    result = CliRunner().invoke(main, ["sim", "--missing", missing, "--out", str(tmp_path), *SMALL])
    assert result.exit_code == 2
    assert "missing level" in result.output
    assert not (tmp_path / "results.json").exists()  # no partial output


def test_sim_rejects_a_device_it_cannot_use(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["sim", "--device", "tpu9", "--out", str(tmp_path), *SMALL])
    assert result.exit_code == 2 and "--device" in result.output


def test_sim_secure_mask_with_dropouts_reports_audit_and_costs(tmp_path: Path) -> None:
    result = _run([
        "--missing", "1", "--protection", "mask", "--dropout", "2", "--dropout-stage", "R2",
        "--out", str(tmp_path), "--verbose", *SMALL,
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    setting = json.loads((tmp_path / "results.json").read_text())["settings"][0]
    dropped = set(setting["dropped"])
    assert len(dropped) == 2
    audit = setting["privacy_audit"]
    assert audit["protection"] == "mask"
    for group in audit["groups"]:
        assert not dropped & set(group["survivors"])  # R2 dropouts are out of every sum
        assert set(group["survivors"]) <= set(group["members"])
    # the per-class Gram sums over overlapping groups isolate individual Grams: the audit says so
    assert audit["individually_exposed"]["gram"], audit["warnings"]
    assert any("gram" in line for line in audit["warnings"])
    costs = setting["protocol_costs"]["round1"]
    alive = sorted(set(costs["bytes_sent"]) - dropped)
    assert all(costs["bytes_sent"][c]["R2"] > 0 for c in alive)
    assert all(costs["bytes_sent"][c]["R2"] == 0 for c in dropped)  # dropped before sending input
    assert "Protocol costs, missing 1" in result.output
    report = (tmp_path / "report.md").read_text()
    assert "### Protocol costs per party, round1" in report
    assert all(f"| {c} |" in report for c in costs["bytes_sent"])  # every client, every round
    assert "What each method alone reveals, missing 1" in result.output


def test_sim_plaintext_audit_says_everything_is_visible(tmp_path: Path) -> None:
    result = _run(["--missing", "3", "--protection", "none", "--rounds", "1", "--out", str(tmp_path), *SMALL])
    assert result.exit_code == 0, result.output
    audit = json.loads((tmp_path / "results.json").read_text())["settings"][0]["privacy_audit"]
    assert audit["warnings"] == ["plaintext run: the server receives every client's statistics individually"]
    assert set(audit["individually_exposed"]["gram"]) == {f"client-{k}" for k in range(8)}


def test_audit_by_method_shows_what_global_gram_hides(tmp_path: Path) -> None:
    result = _run(["--missing", "1", "--rounds", "1", "--out", str(tmp_path), *SMALL])
    assert result.exit_code == 0, result.output
    by_method = json.loads((tmp_path / "results.json").read_text())["settings"][0]["privacy_by_method"]
    # the paper's per-class Gram: overlapping "all but a few" groups isolate individual Grams
    assert by_method["AFL (1 round)"]["exposed_by_overlapping_groups"].get("gram")
    # one all-clients Gram group: no Gram can be singled out
    assert "gram" not in by_method["AFL (global Gram)"]["exposed_by_overlapping_groups"]
    assert by_method["AFL (global Gram)"]["single_member_groups"] == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dim", "0"], "--dim"),
        (["--seed", "-1"], "--seed"),
        (["--fedavg-rounds", "0"], "--fedavg-rounds"),
        (["--fraction", "0"], "--fraction"),
        (["--fraction", "0.0001"], "use a larger --fraction"),
        (["--dropout", "7", "--missing", "1"], "at least t clients"),
        (["--dropout", "1", "--missing", "7"], "lower --dropout"),
    ],
)
def test_sim_bad_options_are_specific_errors(tmp_path: Path, args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["sim", *SMALL, "--out", str(tmp_path / "out"), *args])
    assert result.exit_code in (1, 2), result.output
    assert message in result.output
    assert not (tmp_path / "out" / "results.json").exists()


def test_sim_refuses_an_unwritable_out_before_running(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = CliRunner().invoke(main, ["sim", *SMALL, "--out", str(blocker / "sub")])
    assert result.exit_code == 2 and "--out" in result.output


def test_r3_dropouts_count_in_round1_but_sit_out_round2(tmp_path: Path) -> None:
    result = _run(
        ["--missing", "3", "--dropout", "1", "--dropout-stage", "R3", "--out", str(tmp_path), *SMALL]
    )
    assert result.exit_code == 0, result.output
    setting = json.loads((tmp_path / "results.json").read_text())["settings"][0]
    (dropped,) = setting["dropped"]
    groups = {g["group"]: g for g in setting["privacy_audit"]["groups"]}
    assert dropped in groups["all"]["survivors"]  # its masked input arrived before it dropped
    assert all(dropped not in g["members"] for name, g in groups.items() if name.startswith("pseudo/"))
    assert all(p["client"] != dropped for p in setting["pseudo_labels"])


def test_threshold_and_minimum_group_size_reach_the_protocol(tmp_path: Path) -> None:
    ok = _run(
        [
            "--missing",
            "3",
            "--rounds",
            "1",
            "--threshold",
            "7",
            "--min-group-size",
            "2",
            "--out",
            str(tmp_path),
            *SMALL,
        ]
    )
    assert ok.exit_code == 0, ok.output
    groups = json.loads((tmp_path / "results.json").read_text())["settings"][0]["privacy_audit"]["groups"]
    assert min(len(g["survivors"]) for g in groups) >= 2
    too_few = CliRunner().invoke(
        main,
        [
            "sim",
            "--missing",
            "3",
            "--rounds",
            "1",
            "--threshold",
            "7",
            "--dropout",
            "2",
            "--out",
            str(tmp_path),
            *SMALL,
        ],
    )
    assert too_few.exit_code == 1 and "at least t clients" in too_few.output  # 6 survivors < t = 7
    singletons = CliRunner().invoke(
        main, ["sim", "--missing", "7", "--min-group-size", "2", "--out", str(tmp_path), *SMALL]
    )
    assert singletons.exit_code == 1 and "--min-group-size 2" in singletons.output
    absurd = CliRunner().invoke(main, ["sim", "--threshold", "9", "--out", str(tmp_path), *SMALL])
    assert absurd.exit_code == 1 and "threshold must be from 1 to 8" in absurd.output


def test_imports_pause_the_collector_and_restore_it() -> None:
    from secure_afl.cli import _imports_without_gc

    assert gc.isenabled()
    with _imports_without_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ImportError), _imports_without_gc():
        import secure_afl.no_such_module  # noqa: F401
    assert gc.isenabled(), "an import that fails must not leave the collector off"
    gc.disable()
    try:
        with _imports_without_gc():
            pass
        assert not gc.isenabled(), "a collector the caller had turned off stays off"
    finally:
        gc.enable()


def test_sim_runs_the_experiment_with_the_collector_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import secure_afl.sim.runner as runner

    seen: list[bool] = []
    real = runner.run_experiment

    def recording(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "run_experiment", recording)
    result = _run(["--missing", "7", "--protection", "none", "--rounds", "1", "--out", str(tmp_path), *SMALL])
    assert result.exit_code == 0, result.output
    assert seen == [True]


def test_matching_the_sim_errors_imports_nothing(fresh_python) -> None:
    # The except clause that names them runs for every exception, Ctrl-C included: importing the
    # image backbones there (torchvision) cost seconds before "Aborted!".
    code = (
        "import sys, secure_afl.cli as cli\n"
        "before = set(sys.modules)\n"
        "names = [e.__name__ for e in cli._sim_errors()]\n"
        "assert set(sys.modules) == before, sorted(set(sys.modules) - before)\n"
        "assert 'torchvision' not in sys.modules and 'WeightsError' not in names, names\n"
        "import secure_afl.features.backbones\n"
        "names = [e.__name__ for e in cli._sim_errors()]\n"
        "assert {'CohortError', 'WeightsError', 'UnknownBackboneError'} <= set(names), names\n"
    )
    fresh_python(code)


def test_a_failed_client_statistic_drops_the_grams_not_yet_started(monkeypatch: pytest.MonkeyPatch) -> None:
    import secure_afl.sim.gradient as gradient
    import secure_afl.sim.runner as runner
    from secure_afl import stages
    from secure_afl.analytic import StatisticsError
    from secure_afl.sim.fedavg import FedAvgConfig

    monkeypatch.setattr(gradient, "available_cores", lambda: 2)  # one thread for the statistics
    calls: list[int] = []
    never = threading.Event()

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            # the pool's one thread is busy here while the main thread sees the first failure
            never.wait(2)
        raise StatisticsError("a client's features are broken")

    monkeypatch.setattr(stages, "clear_statistics", failing)  # the runner's statistics stage
    config = runner.SimConfig(
        missing=(7,), fraction=0.03, dim=32, secure="none", fedavg=FedAvgConfig(rounds=1)
    )
    with pytest.raises(StatisticsError, match="broken"):
        runner.run_experiment(config)
    assert 1 <= len(calls) <= 2 < config.n_clients  # the one that failed, perhaps one already started


def _without_timings(value: object) -> object:
    """results.json without the wall-clock seconds (the only facts two identical runs differ in)."""
    timings = {"seconds_per_phase", "seconds_per_method", "client_seconds", "server_seconds"}
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if k not in timings}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


def test_the_default_report_is_short_and_verbose_prints_the_full_audit(tmp_path: Path) -> None:
    args = ["--missing", "7", *SMALL]
    short = CliRunner().invoke(main, ["sim", *args, "--out", str(tmp_path / "short")], env={"COLUMNS": "200"})
    assert short.exit_code == 0, short.output
    lines = short.output.splitlines()
    assert len(lines) <= 60 and max(len(line) for line in lines) <= 80  # whatever the terminal's width
    assert lines[0].startswith("Results (BACC and AUC in %")  # the table first
    text = " ".join(short.output.split())
    # the eight single-member groups and the eight clients' checks, once each, aggregated
    assert "single surviving member" not in text and "own check saw" not in text
    assert "WARNING: every class group has one member (class/0 … class/7)" in text
    assert "the server learns each client's class statistics exactly" in text
    assert "8 of 8 clients' own exposure checks agree with this audit" in text
    assert "Threat model these parameters defend: honest-but-curious server (t = 5 of 8" in text
    assert (
        "Costs, missing 7: each client would upload" in text
        and "unprotected" in text
        and "round1" in text
        and "round2" in text
    )
    assert "report.md and results.json hold the full audit" in text and "--verbose" in text
    assert f"wrote {tmp_path / 'short' / 'report.md'}" in text

    full = CliRunner().invoke(main, ["sim", *args, "--verbose", "--out", str(tmp_path / "full")])
    assert full.exit_code == 0, full.output
    audit = json.loads((tmp_path / "full" / "results.json").read_text())["settings"][0]["privacy_audit"]
    # 8 single-member groups, and round 2's pseudo sums under the adversarial rule (a teacher W
    # chosen to link classes would let them determine each client's pseudo statistics)
    assert len(audit["warnings"]) == 9 and len(audit["seen_by_clients"]) == 8
    assert audit["warnings"][-1].startswith("a server that chose round 2's teacher W adversarially")
    for c in range(8):  # today's full output: every group's line and WARNING, every client's check
        assert f"group 'class/{c}' has a single surviving member (client-{c})" in full.output
        assert f"client-{c}'s own check saw values the sums determine" in full.output
        assert f"class/{c}: members 1, survivors 1 (client-{c})" in full.output
    for title in ("Class coverage, missing 7", "Protocol costs, missing 7, round1", "Seconds per phase"):
        assert title in full.output
    assert "What each method alone reveals, missing 7" in full.output
    # the files keep every fact, whichever the terminal shows
    for name in ("short", "full"):
        report = (tmp_path / name / "report.md").read_text()
        for warning in audit["warnings"]:
            assert f"- WARNING: {warning}" in report
        for client in audit["seen_by_clients"]:
            assert f"- {client}'s own check saw values the sums determine" in report
        assert "### Protocol costs per party, round1" in report and "## Seconds per phase" in report
    short_json, full_json = (
        json.loads((tmp_path / n / "results.json").read_text()) for n in ("short", "full")
    )
    assert _without_timings(short_json) == _without_timings(full_json)


def test_the_short_report_aggregates_overlaps_dropouts_and_refusals(tmp_path: Path) -> None:
    result = _run([
        "--missing", "1", "--rounds", "1", "--dropout", "2", "--dropout-stage", "R2",
        "--client-policy", "deployment", "--out", str(tmp_path), *SMALL,
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) <= 60 and max(len(line) for line in lines) <= 80
    text = " ".join(result.output.split())
    setting = json.loads((tmp_path / "results.json").read_text())["settings"][0]
    dropped = setting["dropped"]
    assert f"Dropped: {', '.join(dropped)}." in text
    assert "2 dropped out before theirs" in text  # they never ran their own checks
    # the per-class Gram over "all but one" groups: the audit's overlap warning, once
    exposed = setting["privacy_by_method"]["AFL (1 round)"]["exposed_by_overlapping_groups"]
    assert exposed["gram"] and "WARNING: overlapping group sums determine the individual" in text
    refused = [m for m, r in setting["deployed_client_refusals"].items() if r]
    assert f"Deployed clients (missing 1) refuse {len(refused)} of" in text
    assert "own check saw" not in text and "Protocol costs, missing 1" not in text  # --verbose only


def test_the_terminal_and_report_md_say_what_chance_is_and_name_no_local_path(tmp_path: Path) -> None:
    import sys

    import numpy as np

    from secure_afl.sim.datasets import prepare

    result = CliRunner().invoke(
        main,
        ["sim", "--missing", "7", "--rounds", "1", *SMALL, "--out", str(tmp_path)],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    data = prepare(None, fraction=0.06, dim=48, seed=0)
    test_labels = data.cohort.labels[data.split.test]
    prevalence = test_labels.mean(axis=0)[(test_labels.min(axis=0) == 0) & (test_labels.max(axis=0) == 1)]
    line = f"Chance: BACC 50, AUC 50, mAP {prevalence.mean():.4f} (the test labels' mean class prevalence)"
    assert 0.03 < prevalence.mean() < 0.12  # ChestXray14's 8 classes: about 0.07
    assert line in " ".join(result.output.split())
    report = (tmp_path / "report.md").read_text()
    assert line in report
    # the label table is named by its place in its package, not by this environment's directories
    assert '"label_source": "torchxrayvision/data/' in report
    for local in {sys.prefix, sys.base_prefix, str(Path.home()), str(tmp_path)}:
        assert local not in report
    assert "site-packages" not in report and np.isfinite(prevalence).all()
