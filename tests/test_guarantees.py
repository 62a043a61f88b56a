"""What the report says about security comes from one table (privacy.guarantees) and says what
SECURITY.md §1.4 says: per backend and client policy, and round 2's teacher."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from secure_afl.aggregation.backend import CkksBackend, MaskingBackend
from secure_afl.cli import main
from secure_afl.privacy.guarantees import BACKENDS, GUARANTEES, POLICIES, ROUND_TWO, guarantee, policy_name
from secure_afl.privacy.policy import ClientPolicy

SMALL = ["--fraction", "0.06", "--dim", "48", "--fedavg-rounds", "2", "--missing", "7"]


def test_every_backend_and_policy_has_an_entry() -> None:
    assert set(BACKENDS) == {"mask", "ckks", "none"} and set(POLICIES) == {"simulator", "deployment"}
    assert set(GUARANTEES) == {(b, p) for b in BACKENDS for p in POLICIES}
    for (backend, policy), entry in GUARANTEES.items():
        assert (entry.backend, entry.policy) == (backend, policy)
        assert entry.server_learns and entry.defended_against.startswith("defended: ") and entry.colluders
        assert entry.line().startswith(f"Guarantee ({backend}, {policy} policy): ")
    with pytest.raises(ValueError, match="unknown protection 'paillier': use one of mask, ckks, none"):
        guarantee("paillier", "simulator")
    with pytest.raises(ValueError, match="unknown client policy 'strict'"):
        guarantee("mask", "strict")


def test_the_simulator_policy_claims_no_active_server_defence() -> None:
    for backend in BACKENDS:
        text = guarantee(backend, "simulator").text
        assert "defended: an active" not in text and "active-server checks" not in text
        assert "active" not in text or "not an active one" in text
    masking = guarantee("mask", "simulator")
    assert masking.defended_against == "defended: an honest-but-curious server, not an active one"
    assert "T − 1 colluding clients rebuild no honest client's mask" in masking.colluders
    assert "sums are not checked" in masking.colluders and "reported, not refused" in masking.server_learns
    deployed = guarantee("mask", "deployment")
    assert deployed.defended_against.startswith("defended: an active server")
    assert "c = n − t colluding clients, t = ⌊2n/3⌋ + 1" in deployed.colluders


def test_ckks_names_the_one_colluder_weakness_and_no_refused_attack() -> None:
    for policy in POLICIES:
        text = guarantee("ckks", policy).text
        assert "one colluding client reads every upload" in text and "no threshold decryption" in text
        # SECURITY.md §7.1 C1: a decryptor decrypts only a sum it computed from signed uploads
        assert "in place of a sum" not in text
    assert "not an active one" in guarantee("ckks", "simulator").defended_against
    assert "active server colluding with no client" in guarantee("ckks", "deployment").defended_against


def test_backends_and_policies_take_their_words_from_the_table() -> None:
    simulator, deployment = ClientPolicy.simulator(), ClientPolicy.deployment()
    masking = MaskingBackend(threshold=5, client_policy=simulator)
    assert masking.trust_model == guarantee("mask", "simulator").text
    assert MaskingBackend(threshold=6).trust_model == guarantee("mask", "deployment").text
    assert CkksBackend(client_policy=simulator).trust_model == guarantee("ckks", "simulator").text
    assert CkksBackend().trust_model == guarantee("ckks", "deployment").text
    # a node that lowers its colluders keeps the deployment's row, whose text says it then claims less
    assert "fewer where a node's config lowers its colluders" in guarantee("mask", "deployment").colluders
    assert policy_name(dataclasses.replace(deployment, max_colluders=0)) == "deployment"
    # anything short of the deployment policy's refusals claims no more than the simulator's
    assert policy_name(dataclasses.replace(deployment, threshold_rule="majority")) == "simulator"
    assert policy_name(dataclasses.replace(deployment, refuse_exposure=False)) == "simulator"


def _sim(out: Path, *args: str) -> tuple[str, str, dict]:
    result = CliRunner().invoke(main, ["sim", *SMALL, "--out", str(out), *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return (
        " ".join(result.output.split()),
        (out / "report.md").read_text(),
        json.loads((out / "results.json").read_text()),
    )


# Lines of report.md that name colluders or a kind of server without stating a backend's guarantee:
# the threat model (privacy.policy.threat_model), round 2's adversarial-teacher warning and the
# groups one member apart (what the sums determine, from the audit).
NOT_A_GUARANTEE = (
    "Threat model these parameters defend:",
    "- WARNING: a server that chose round 2's teacher W adversarially",
    "- groups one member apart",
)


def _stray_guarantees(report: str) -> list[str]:
    """Lines of report.md that name colluders or a kind of server and are not the table's."""
    table = {g.line(w) for g in GUARANTEES.values() for w in ("", "for the layouts deployed clients accept")}
    table |= {f"- trust model ({g.backend}): {g.text}" for g in GUARANTEES.values()} | {ROUND_TWO}
    words = ("colluding", "colluder", "honest-but-curious", "active")
    return [
        line
        for line in report.splitlines()
        if any(w in line for w in words) and line not in table and not line.startswith(NOT_A_GUARANTEE)
    ]


def test_the_report_prints_the_tables_text_for_masking_under_both_policies(tmp_path: Path) -> None:
    simulator, deployment = guarantee("mask", "simulator"), guarantee("mask", "deployment")
    # the default: masking, the simulator policy, two rounds
    terminal, report, results = _sim(tmp_path / "default")
    assert simulator.line() in terminal and simulator.line() in report.splitlines()
    assert deployment.text not in terminal and deployment.text not in report
    assert ROUND_TWO in terminal and ROUND_TWO in report.splitlines()
    assert results["config"]["guarantees"] == [simulator.line(), ROUND_TWO]
    assert results["settings"][0]["privacy_audit"]["trust_model"] == {"mask": simulator.text}
    assert f"- trust model (mask): {simulator.text}" in report.splitlines()
    assert results["settings"][0]["privacy_audit"]["one_member_apart"] == []  # missing 7: none
    assert _stray_guarantees(report) == []

    # --client-policy deployment, one round: the deployment's entry beside the run's, no round 2
    terminal, report, results = _sim(tmp_path / "deployed", "--client-policy", "deployment", "--rounds", "1")
    where = deployment.line("for the layouts deployed clients accept")
    assert where in terminal and where in report.splitlines() and simulator.line() in terminal
    assert ROUND_TWO not in terminal and ROUND_TWO not in report
    assert results["config"]["guarantees"] == [simulator.line(), where]
    assert _stray_guarantees(report) == []


def test_the_report_counts_and_names_the_groups_one_member_apart(tmp_path: Path) -> None:
    # missing 2 (seed 0): some class groups are another's members plus one client
    args = ["--missing", "2", "--rounds", "1", "--client-policy", "simulator"]
    result = CliRunner().invoke(
        main, ["sim", *SMALL[:-2], *args, "--out", str(tmp_path)], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    audit = json.loads((tmp_path / "results.json").read_text())["settings"][0]["privacy_audit"]
    pairs = audit["one_member_apart"]
    assert pairs and all(p["member"] and p["kinds"] for p in pairs)
    terminal = " ".join(result.output.split())
    assert f"{len(pairs)} pair(s) of groups are one member apart (report.md names them)" in terminal
    report = (tmp_path / "report.md").read_text()
    for p in pairs:
        assert f"{p['larger']} = {p['smaller']} + {p['member']} ({', '.join(p['kinds'])})" in report
