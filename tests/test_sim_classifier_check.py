"""The simulator's report says what the deployment's classifier check (SECURITY.md §5.1) would cost
beside the session (one line in report.md, results.json's ``classifier_check``): the shares
bench/bench_verify.py measured, which bench/README.md records, or why the check is not offered."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from secure_afl.privacy.dp import DpConfig
from secure_afl.sim.fedavg import FedAvgConfig
from secure_afl.sim.report import CHECK_FLOWER, CHECK_RUNS, classifier_check, write_reports
from secure_afl.sim.runner import run_experiment
from secure_afl.sim.setting import SimConfig

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"fraction": 0.05, "dim": 32, "fedavg": FedAvgConfig(rounds=1), "device": "cpu", "rounds": 1}


def _check_lines(report: str) -> list[str]:
    return [line for line in report.splitlines() if line.startswith("Classifier check")]


def test_a_masked_runs_report_has_one_line_with_the_measured_share(tmp_path: Path) -> None:
    result = run_experiment(SimConfig(**{**SMALL, "missing": (7,), "secure": "mask"}))  # type: ignore[arg-type]
    json_path, md_path = write_reports(result, tmp_path)
    (line,) = _check_lines(md_path.read_text())
    check = json.loads(json_path.read_text())["classifier_check"]
    assert check["offered"] is True and check["line"] == line
    measured = check["measured"]
    assert measured["dim"] == 1024 and "this run's d = 32 was not measured" in line
    assert all(c > 0 for c in measured["check_cpu_s"]) and all(s > 0 for s in measured["session_cpu_s"])
    low, high = (float(x) for x in re.search(r"([\d.]+)–([\d.]+) % of the session", line).groups())  # type: ignore[union-attr]
    shares = [100 * c / s for c, s in zip(measured["check_cpu_s"], measured["session_cpu_s"], strict=True)]
    assert 0 < low <= high and (low, high) == (round(min(shares), 1), round(max(shares), 1))
    assert "--dims 1024 --clients 8 --classes 8 --rows 5889" in line and "--dim 1024" in line
    # each quoted figure names its commit and date (docs/index.md's convention for figures)
    assert len(re.findall(r"`, commit [0-9a-f]{7}, 20\d\d-\d\d-\d\d", line)) == 2, line


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (SimConfig(secure="ckks"), "not offered under CKKS"),
        (SimConfig(secure="none"), "not offered without secure aggregation"),
    ],
)
def test_where_the_check_is_not_offered_the_line_says_why_and_gives_no_figure(
    config: SimConfig, reason: str
) -> None:
    check = classifier_check(config)
    assert check["offered"] is False and check["measured"] is None
    assert reason in str(check["reason"]) and str(check["line"]).startswith("Classifier check")
    assert "%" not in str(check["line"]) and " s " not in str(check["line"])


def test_a_dp_run_with_a_row_map_is_offered_the_check() -> None:
    """--dp-dim and the row centring are checked (W_K, and the lift W = M W_K: SECURITY.md §5.1)."""
    for dp in (DpConfig(epsilon=1.0, projection_dim=64), DpConfig(epsilon=1.0, row_centre=True)):
        check = classifier_check(SimConfig(dp=dp))
        assert check["offered"] is True and check["measured"] is not None


def test_a_dp_run_whose_ridge_no_hospital_can_derive_is_not_offered_the_check() -> None:
    """The adaptive ridge (--dp-dim's default) is sized from the noisy Gram's spectrum: a coordinator's
    choice no node can check, so not offered; bound and adassp are derived from public facts."""
    adaptive = DpConfig(epsilon=1.0, projection_dim=64, ridge="adaptive")
    check = classifier_check(SimConfig(dp=adaptive))
    assert check["offered"] is False and "--dp-ridge bound or adassp" in str(check["reason"])
    for ridge in ("bound", "adassp"):
        assert classifier_check(SimConfig(dp=DpConfig(epsilon=1.0, projection_dim=64, ridge=ridge)))[
            "offered"
        ]


def test_a_two_round_run_names_the_classifier_checked_and_the_measured_width() -> None:
    line = str(classifier_check(SimConfig(dim=2048, rounds=2))["line"])
    assert "AFL (1 round) only: a two-round study is not checked" in line
    assert "at d = 2048, 8 clients" in line and "was not measured" not in line
    assert f"{CHECK_FLOWER[2048][0]} s beside the session's {CHECK_FLOWER[2048][1]} s" in line


def test_the_quoted_runs_are_those_bench_readme_records() -> None:
    """Every (check, session) pair the report quotes is a row's 'after' figures in bench/README.md's
    bench_verify.py table, and every Flower pair its text."""
    readme = (ROOT / "bench" / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## bench_verify.py") :]
    section = section[: section.index("\n## ", 1)]
    for dim, runs in CHECK_RUNS.items():
        (row,) = [r for r in section.splitlines() if r.startswith(f"| {dim} |")]
        sessions, checks = (cell.split(";")[1] for cell in row.split("|")[2:4])
        assert [f"{s:.3f}" for _, s in runs] == [x.strip() for x in sessions.split(",")]
        assert [f"{c:.3f}" for c, _ in runs] == [x.strip() for x in checks.split(",")]
        check_s, session_s = CHECK_FLOWER[dim]
        assert f"{check_s} s beside" in section.replace("\n", " ") and f"{session_s} s" in section
