"""`secure-afl sim --client-policy`: the threat model, what each client saw, what deployed clients refuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from secure_afl.cli import main

SMALL = ["--fraction", "0.06", "--dim", "48", "--fedavg-rounds", "2", "--missing", "1,7", "--rounds", "1"]


def _run(tmp_path: Path, *args: str) -> dict:
    result = CliRunner().invoke(main, ["sim", *SMALL, "--out", str(tmp_path), *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "Threat model these parameters defend: honest-but-curious server (t = 5 of 8" in result.output
    return json.loads((tmp_path / "results.json").read_text())


@pytest.fixture(scope="module")
def default(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("default"))


def test_deployment_policy_reports_refused_layouts_and_leaves_metrics_unchanged(
    tmp_path: Path, default
) -> None:
    deployed = _run(tmp_path / "deployed", "--client-policy", "deployment")
    for before, after in zip(default["settings"], deployed["settings"], strict=True):
        assert before["metrics"] == after["metrics"]  # the option only adds the verdicts
        assert before["deployed_client_refusals"] == {}
    one, seven = (s["deployed_client_refusals"] for s in deployed["settings"])
    # Missing 1: the per-class Gram groups isolate Grams, so clients refuse in R1 (before sharing);
    # with one all-clients Gram group they take part.
    assert one["AFL (1 round)"] and all(r["round"] == "R1" for r in one["AFL (1 round)"])
    assert any("'gram'" in r["reason"] for r in one["AFL (1 round)"])
    assert one["AFL (global balance)"]  # feat_sum and n travel to every class group: exposed the same way
    assert one["AFL (global Gram)"] == []
    # Missing 7: every class group has one member, below a deployed client's minimum of 2.
    for method, refusals in seven.items():
        assert {r["client"] for r in refusals} == {f"client-{k}" for k in range(8)}, method
        assert all("below the minimum group size 2" in r["reason"] for r in refusals)
    assert "### Layouts a deployed client refuses" in (tmp_path / "deployed" / "report.md").read_text()


def test_each_exposure_in_the_audit_was_seen_by_the_exposed_client(default) -> None:
    audit = default["settings"][0]["privacy_audit"]  # missing 1
    seen = audit["seen_by_clients"]
    assert audit["individually_exposed"]["gram"]
    for tensor, clients in audit["individually_exposed"].items():
        for client in clients:
            # The client's own check (R3, then R4) found its value of that tensor determined.
            assert any(
                f"{tensor!r} for" in line and client in line.split(" for ")[-1] for line in seen[client]
            )


def test_the_in_process_driver_honours_the_deployment_policy() -> None:
    """secure_aggregate under ClientPolicy.deployment(): clients refuse an exposing layout themselves."""
    import numpy as np

    from secure_afl.core.errors import ExposureRefusedError, InvalidSessionConfigError
    from secure_afl.core.randomness import DeterministicRandomSource
    from secure_afl.privacy.policy import ClientPolicy
    from secure_afl.sim.secure import secure_aggregate

    rng = np.random.default_rng(3)
    ids = [f"c{i}" for i in range(6)]
    # Leave-one-out groups over 6 clients: with everyone alive the 6 sums isolate every value.
    contributions = {
        c: {f"g{k}": {"x": v} for k in range(6) if ids[k] != c}
        for c, v in ((c, rng.normal(size=3)) for c in ids)
    }
    with pytest.raises(ExposureRefusedError, match="'x'"):
        secure_aggregate(
            contributions, threshold=5, min_group_size=2, client_policy=ClientPolicy.deployment(),
            random=DeterministicRandomSource(b"dep"),
        )  # fmt: skip
    with pytest.raises(InvalidSessionConfigError, match="below this client's minimum 5"):
        secure_aggregate(contributions, threshold=4, client_policy=ClientPolicy.deployment())
    result = secure_aggregate(contributions, threshold=4, random=DeterministicRandomSource(b"sim"))
    assert set(result.exposed["x"]) == set(ids)  # the simulator goes on, and its clients say so
    assert set(result.audit.seen_by_clients()) == set(ids)
