"""``secure-afl sim --scenario growing`` (secure_afl/sim/growing.py): sessions of new rows, accumulated."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from secure_afl.cli import main
from secure_afl.sim.datasets import DataRequest
from secure_afl.sim.growing import EXACT_BAR, GrowingConfig, arrivals, run_growing
from secure_afl.sim.setting import ExperimentError, SimConfig

SMALL = {"fraction": 0.02, "dim": 16, "device": "cpu", "rounds": 1}


def _check_sessions(result, clients_rows):
    total = sum(len(r) for r in clients_rows)
    released = [r.released_rows for r in result.sessions]
    assert released == sorted(released) and released[-1] == total
    assert sum(sum(r.new_rows.values()) for r in result.sessions) == total
    for r in result.sessions:
        assert r.max_abs_w_vs_centralised < EXACT_BAR
        assert r.max_abs_w_vs_centralised <= 1e-9 * r.max_abs_w
        macro = r.metrics.macro
        assert all(np.isfinite(v) for v in macro.values())


@pytest.mark.parametrize(("secure", "gram", "missing"), [("mask", "global", 1), ("none", "class", 3)])
def test_every_session_equals_the_centralised_fit_on_the_rows_released_so_far(secure, gram, missing):
    config = GrowingConfig(sim=SimConfig(secure=secure, missing=(missing,), **SMALL), gram=gram)
    data = DataRequest(0.02, 16, 0, 8, "image").prepare()
    result = run_growing(config, data=data)
    assert len(result.sessions) == 3
    _check_sessions(result, data.split.clients)
    # the accumulation is what gives the equality: the classifier changes as rows arrive
    assert result.sessions[0].max_abs_w != result.sessions[-1].max_abs_w
    if secure == "mask":
        assert result.sessions[0].costs is not None and result.sessions[0].costs["protection"] == "mask"
        assert all(r.audit.protection == "mask" for r in result.sessions)


def test_ckks_sessions_accumulate_to_the_centralised_fit_within_its_approximation():
    config = GrowingConfig(sim=SimConfig(secure="ckks", missing=(7,), **SMALL), sessions=2)
    result = run_growing(config)
    for r in result.sessions:
        assert r.max_abs_w_vs_centralised <= 1e-6 * r.max_abs_w  # CKKS is approximate (scale 2^40)


def test_an_idle_member_contributes_zeros_that_the_server_knows():
    sim = SimConfig(secure="mask", missing=(0,), n_clients=2, **SMALL)
    result = run_growing(GrowingConfig(sim=sim, sessions=3, idle=((2, 0),)))
    second = result.sessions[1]
    assert second.new_rows["client-0"] == 0 and second.new_rows["client-1"] > 0
    assert second.known_zero == ("client-0",)
    assert second.max_abs_w_vs_centralised < EXACT_BAR
    # client-0 is still a member of every group it labels, and survives
    assert all("client-0" in g.survivors for g in second.audit.groups)
    # two members: the sums alone hide each one's Gram; with client-0's zero known they do not
    assert "client-1" not in second.audit.exposed.get("gram", ())
    assert second.exposed_knowing_zeros["gram"] == ("client-1",)
    assert second.exposed_knowing_zeros["pos_sum/0"] == ("client-1",)
    for other in (result.sessions[0], result.sessions[2]):
        assert other.known_zero == () and other.exposed_knowing_zeros == dict(other.audit.exposed)


def test_arrivals_partition_each_clients_rows_seeded():
    clients = [np.arange(0, 10), np.arange(10, 17), np.arange(17, 30)]
    parts = arrivals(clients, 3, [(2, 1)], seed=4)
    for k, rows in enumerate(clients):
        got = np.concatenate([parts[s][k] for s in range(3)])
        assert sorted(got.tolist()) == rows.tolist()  # every row once
        sizes = [len(parts[s][k]) for s in range(3) if not (s == 1 and k == 1)]
        assert max(sizes) - min(sizes) <= 1  # near-equal
    assert len(parts[1][1]) == 0  # idle in session 2
    again = arrivals(clients, 3, [(2, 1)], seed=4)
    other = arrivals(clients, 3, [(2, 1)], seed=5)
    assert all(np.array_equal(a, b) for s in range(3) for a, b in zip(parts[s], again[s], strict=True))
    assert any(not np.array_equal(a, b) for s in range(3) for a, b in zip(parts[s], other[s], strict=True))
    with pytest.raises(ExperimentError, match="fewer than its 3 sessions"):
        arrivals([np.arange(2)], 3, [], seed=0)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"sim": SimConfig(**{**SMALL, "rounds": 2})}, "round 1 only.*per-client mean"),
        ({"sim": SimConfig(**SMALL, missing=(1, 3))}, "one --missing level"),
        ({"sim": SimConfig(**SMALL, dropout=1)}, "--dropout"),
        ({"sim": SimConfig(**SMALL, secure="mask,ckks")}, "one of none, mask, ckks"),
        ({"idle": ((1, 0), (2, 0), (3, 0))}, "client 0 is idle in every session"),
        ({"idle": tuple((1, k) for k in range(8))}, "every client is idle in session 1"),
        ({"idle": ((4, 0),)}, "names no session 1..3"),
        ({"sessions": 0}, "at least 1"),
    ],
)
def test_configurations_a_growing_study_cannot_run_are_refused(changes, message):
    config = GrowingConfig(**{"sim": SimConfig(**SMALL), **changes})
    with pytest.raises(ExperimentError, match=message):
        config.validate()


def test_a_class_with_no_released_row_yet_is_refused():
    # missing 7: client k alone labels class k; idle in session 1, class k has no row after it
    config = GrowingConfig(sim=SimConfig(missing=(7,), **SMALL), idle=((1, 2),))
    with pytest.raises(ExperimentError, match="after session 1 class Effusion has no released row"):
        run_growing(config)


def test_the_command_writes_every_sessions_numbers(tmp_path):
    args = ["sim", "--scenario", "growing", "--fraction", "0.02", "--dim", "16", "--device", "cpu"]
    result = CliRunner().invoke(main, [*args, "--missing", "1", "--idle", "2:3", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "A growing federation: 3 sessions" in result.output
    assert "session 2: client-3 released no new rows" in result.output
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["scenario"] == "growing" and saved["layout"] == {
        "balance": "global",
        "gram": "global",
        "rounds": 1,
    }
    assert [s["session"] for s in saved["sessions"]] == [1, 2, 3]
    for s in saved["sessions"]:
        assert s["max_abs_w_vs_centralised"] < EXACT_BAR
        assert set(s["metrics"]["macro"]) == {"bacc", "auc", "map"}
    assert (
        saved["sessions"][1]["known_zero"] == ["client-3"]
        and saved["sessions"][1]["new_rows"]["client-3"] == 0
    )
    assert (tmp_path / "report.md").is_file()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--rounds", "2"], "round 1 only"),
        (["--idle", "2-3"], "is not SESSION:CLIENT"),
        (["--scenario", "partial-labels", "--idle", "2:3"], "--sessions and --idle need --scenario growing"),
        (
            ["--scenario", "partial-labels", "--sessions", "2"],
            "--sessions and --idle need --scenario growing",
        ),
    ],
)
def test_the_command_refuses_what_a_growing_study_cannot_do(tmp_path, extra, message):
    args = ["sim", "--scenario", "growing", "--fraction", "0.02", "--dim", "16", "--out", str(tmp_path)]
    result = CliRunner().invoke(main, [*args, *extra])
    assert result.exit_code != 0
    assert message in result.output
