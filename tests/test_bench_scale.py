"""bench/bench_scale.py at n = 100 in process: the figures it writes are real results (sums equal
to plaintext, exposure verdicts that the rank test confirms), not timings."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from secure_afl.aggregation.backend import MaskingBackend
from secure_afl.aggregation.inprocess import run_in_process
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.privacy.exposure import determined
from secure_afl.privacy.policy import ClientPolicy, active_threshold

_PATH = Path(__file__).resolve().parents[1] / "bench" / "bench_scale.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_scale", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_scale"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_scale", None)


def test_exposure_verdicts_at_100_clients_are_confirmed(bench) -> None:
    for layout in bench.LAYOUTS:
        contributions = bench.contributions_for(100, 3, layout)
        me = min(contributions)
        _, _, verdict, findings = bench.exposure_check(contributions, me)
        assert verdict in ("safe", "exposed", "undecided")
        if layout == "global":
            assert verdict == "safe"  # the Gram once in `all`, b/c in groups of many
        groups = bench.groups_of(contributions)
        for finding in findings:
            if finding.undecided:
                continue
            assert finding.clients == (me,) and 0 < len(finding.colluders) <= 33
            tensor = finding.tensor
            rows = [
                {
                    (cid, "own") if cid == me else (cid, tensor)
                    for cid in members
                    if cid not in finding.colluders
                }
                for members, tensors in groups.values()
                if tensor in tensors
            ]
            assert (me, "own") in determined(rows)  # the named colluders do isolate this value


def test_a_session_at_100_clients_sums_to_the_plaintext(bench, tmp_path) -> None:
    result = bench.measure(100, 3, ["missing7"], run_session=True)
    assert result["sums_match_plaintext"] == {"missing7": True}
    assert result["threshold"] == 67 and result["colluders"] == 33
    for key in ("client_seconds", "server_seconds", "exposure_seconds"):
        assert result[key]["missing7"] > 0
    assert result["exposure_verdicts"]["missing7"] == "exposed"  # ~12 per class, 33 colluders
    path = tmp_path / "scale.json"
    path.write_text(json.dumps(result))
    assert json.loads(path.read_text())["clients"] == 100


def test_one_client_against_built_peers_at_100_clients_sums_to_the_plaintext(bench) -> None:
    """--one-client (the mode for n = 1,000): one real client and the real server against peers
    whose messages the bench builds; the unmasked sums must equal the plaintext sums."""
    result = bench.measure(100, 3, ["missing7", "global"], run_session=False, one_client=True)
    assert result["mode"] == "one-client"
    assert result["sums_match_plaintext"] == {"missing7": True, "global": True}
    for layout in ("missing7", "global"):
        assert 0 < result["client_seconds"][layout] <= result["client_with_exposure_seconds"][layout]
        assert result["server_seconds"][layout] > 0
        assert set(result["client_round_seconds"][layout]) == {"R0", "R1", "R2", "R3", "R4"}
        words = result["mask_words"][layout]
        assert 0 < words["client"] < words["server"]  # one client's groups, against every member's
    # missing 7: one class group of ~100/8 members; global: every client masks the Gram with all 99 others
    assert result["mask_words"]["missing7"]["client"] < result["mask_words"]["global"]["client"]
    assert result["keystream_bytes_per_second"] > 0


def test_one_client_sum_check_catches_masks_that_do_not_cancel(bench, monkeypatch) -> None:
    """The plaintext comparison is what makes --one-client's figures trustworthy: with pairwise
    masks that both sides add (no longer cancelling), it reports a mismatch."""
    assert bench.one_client_session(30, 3, "missing7")["sums_match_plaintext"] is True
    monkeypatch.setattr(bench.prg, "pair_sign", lambda own, peer: 1)
    assert bench.one_client_session(30, 3, "missing7")["sums_match_plaintext"] is False


def test_the_one_client_session_sends_the_difference_plan_and_still_sums_to_the_plaintext(bench) -> None:
    """At n = 100 (complements of about 37 at missing 3, 12 at missing 1) the plan is made: the
    wire groups carry fewer Gram copies, and the unmasked sums still equal the plaintext."""
    for layout in ("missing3", "missing1"):
        planned = bench.one_client_session(100, 2, layout)
        direct = bench.one_client_session(100, 2, layout, difference=False)
        assert planned["sums_match_plaintext"] and direct["sums_match_plaintext"]
        assert planned["mask_words"]["server"] < direct["mask_words"]["server"]
        plan = bench.measure(100, 2, [layout], run_session=False)["difference_plan"][layout]
        assert plan is not None and plan["wire"] < plan["direct"]
    # At missing 1 each client sends its Gram to `all` and to its one complement: 2 copies, not 7.
    assert plan == {"direct": 700, "wire": 200}
    assert (
        bench.measure(100, 2, ["missing3"], run_session=False, difference=False)["difference_plan"][
            "missing3"
        ]
        is None
    )


def test_a_session_at_100_clients_missing_1_survives_a_whole_complement_dropping(bench) -> None:
    """Missing 1 at n = 100: complements of about 12, well under the n - t = 33 dropouts a session
    tolerates.  Every member of one complement drops in R2; the planned session still finishes,
    with the direct session's class sums bit for bit."""
    contributions = bench.contributions_for(100, 3, "missing1")
    missing = {cid: {f"class/{c}" for c in range(8)} - set(groups) for cid, groups in contributions.items()}
    gone = sorted(cid for cid, classes in missing.items() if classes == {"class/0"})
    assert 2 <= len(gone) <= 100 - active_threshold(100)
    runs = {}
    for difference in (True, False):
        runs[difference] = run_in_process(
            MaskingBackend(threshold=active_threshold(100), client_policy=ClientPolicy.simulator()),
            contributions,
            min_group_size=2,
            dropouts={"R2": gone},
            random=DeterministicRandomSource(b"n100"),
            difference=difference,
        )
    planned, direct = runs[True], runs[False]
    assert "others/class/0" in planned.layout.complement_groups
    assert planned.outcome.survivors["others/class/0"] == ()
    assert planned.outcome.sums.keys() == direct.outcome.sums.keys()
    for group, tensors in direct.outcome.sums.items():
        for name, value in tensors.items():
            assert np.array_equal(planned.outcome.sums[group][name], value), (group, name)
