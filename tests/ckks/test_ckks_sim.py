"""CKKS in the simulator: the same classifier as plaintext within 1e-3, costs beside masking's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from secure_afl.aggregation.backend import CkksBackend, MaskingBackend
from secure_afl.aggregation.inprocess import run_in_process
from secure_afl.cli import main
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.sim.fedavg import FedAvgConfig
from secure_afl.sim.runner import run_experiment
from secure_afl.sim.setting import SimConfig

from .helpers import plain_sums, small_contributions


def test_one_driver_runs_either_backend_to_the_same_sums() -> None:
    contributions = small_contributions()
    want = plain_sums(contributions)
    policy = ClientPolicy.simulator()
    for backend in (MaskingBackend(threshold=3, client_policy=policy), CkksBackend(client_policy=policy)):
        run = run_in_process(backend, contributions, random=DeterministicRandomSource(b"driver"))
        assert tuple(run.costs.server_seconds) == backend.rounds
        for group, tensors in want.items():
            for name, value in tensors.items():
                np.testing.assert_allclose(run.outcome.sums[group][name], value, rtol=0, atol=1e-6)
        assert all(run.costs.bytes_sent[c]["R2"] > 0 for c in contributions)


def test_embedded_data_missing_7_ckks_metrics_equal_plaintext_within_1e_3() -> None:
    # The realistic check: the embedded data at its real dimension (1024-d Gram, 129 ciphertexts per
    # Gram at N = 8192), on a fifth of the rows to keep the test short; one AFL round.
    base = {"missing": (7,), "rounds": 1, "fraction": 0.2, "fedavg": FedAvgConfig(rounds=1), "device": "cpu"}
    plain = run_experiment(SimConfig(**base, secure="none"))  # type: ignore[arg-type]
    ckks = run_experiment(SimConfig(**base, secure="ckks"))  # type: ignore[arg-type]
    (p,), (c,) = plain.settings, ckks.settings
    assert (
        c.audit.protection == "ckks"
        and c.protocol_costs
        and c.protocol_costs["round1"]["protection"] == "ckks"
    )
    for method in ("AFL (1 round)", "AFL (global balance)", "AFL (global Gram)"):
        for metric in ("bacc", "auc", "map"):
            assert abs(c.metrics[method].macro[metric] - p.metrics[method].macro[metric]) <= 1e-3, (
                method,
                metric,
            )


def test_cli_mask_and_ckks_side_by_side(tmp_path: Path) -> None:
    args = ["sim", "--missing", "1", "--protection", "mask,ckks", "--dropout", "1", "--dropout-stage", "R3"]
    args += ["--fraction", "0.06", "--dim", "48", "--fedavg-rounds", "1", "--out", str(tmp_path)]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "Protections side by side" in result.output
    setting = json.loads((tmp_path / "results.json").read_text())["settings"][0]
    costs = setting["protocol_costs"]
    assert {costs[k]["protection"] for k in costs} == {"mask", "ckks"}
    assert set(costs) == {"round1 (mask)", "round1 (ckks)", "round2 (mask)", "round2 (ckks)"}
    assert set(costs["round1 (ckks)"]["server_seconds"]) == {"R0", "R1", "R2", "R3", "R4"}
    # The same classifier from both protections' sums.
    metrics = setting["metrics"]
    for method in ("AFL (1 round)", "AFL (2 rounds)", "AFL (global Gram)"):
        for metric in ("bacc", "auc", "map"):
            ours = metrics[method]["macro"][metric]
            assert abs(metrics[f"{method} via ckks"]["macro"][metric] - ours) <= 1e-3
    audit = setting["privacy_audit"]
    assert set(audit["trust_model"]) == {"mask", "ckks"} and "no threshold" in audit["trust_model"]["ckks"]
    report = (tmp_path / "report.md").read_text()
    assert "### Protections side by side" in report and "trust model (ckks)" in report
