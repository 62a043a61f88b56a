"""`sim --secure mask` sends the Gram by difference where most clients label each class (missing 1).

Against the same run with every group direct (the simulator's layout before 2026-12-05), the plan
must change only what goes over the wire: the same sums bit for bit (so the same metrics), the same
exposures in the run's audit and in each method's, and each class Gram named with the wire sums it
came from.  A bug that dropped a complement, derived a class from the wrong groups or audited the
method's groups instead of the wire's would fail here.
"""

from __future__ import annotations

import pytest

from secure_afl.aggregation import inprocess
from secure_afl.aggregation.layout import Derivation
from secure_afl.sim import secure
from secure_afl.sim.fedavg import FedAvgConfig
from secure_afl.sim.report import audit_lines, cost_summary, privacy_verdict, result_dict
from secure_afl.sim.runner import run_experiment
from secure_afl.sim.setting import ExperimentError, SettingResult, SimConfig

SMALL = {"fraction": 0.05, "dim": 32, "fedavg": FedAvgConfig(rounds=1), "device": "cpu", "secure": "mask"}
CLASSES = range(8)


def _setting(monkeypatch: pytest.MonkeyPatch, *, direct: bool, **overrides: object) -> SettingResult:
    if direct:  # every group as the method names it, as the simulator ran before the plan
        plain = inprocess.run_in_process
        monkeypatch.setattr(secure, "run_in_process", lambda *a, **k: plain(*a, **{**k, "difference": False}))
    try:
        result = run_experiment(SimConfig(**{**SMALL, **overrides}))  # type: ignore[arg-type]
    finally:
        monkeypatch.undo()
    (setting,) = result.settings
    return setting


def _r2_bytes(setting: SettingResult) -> list[int]:
    return [rounds["R2"] for rounds in setting.protocol_costs["round1"]["bytes_sent"].values()]  # type: ignore[index]


@pytest.mark.parametrize(
    "overrides",
    [{}, {"dropout": 2, "dropout_stage": "R2"}, {"dropout": 2, "dropout_stage": "R1"}],
    ids=["no dropout", "two drop before R2", "two drop before R1"],
)
def test_missing_1_sends_the_gram_by_difference_and_learns_nothing_more(
    monkeypatch: pytest.MonkeyPatch, overrides: dict[str, object]
) -> None:
    planned = _setting(monkeypatch, direct=False, missing=(1,), **overrides)
    direct = _setting(monkeypatch, direct=True, missing=(1,), **overrides)

    assert planned.sent_by_difference == {
        f"class/{c}": {"gram": Derivation(("all",), (f"others/class/{c}",))} for c in CLASSES
    }
    assert direct.sent_by_difference == {}
    assert planned.gram_copies == {"method": 8.0, "sent": 2.0}
    assert direct.gram_copies == {"method": 8.0, "sent": 8.0}
    # every client sends 6 fewer Gram triangles (d = 32: 528 words of 8 bytes each), plus a few names
    saved = [d - p for d, p in zip(_r2_bytes(direct), _r2_bytes(planned), strict=True)]
    assert all(6 * 528 * 8 <= s < 6 * 528 * 8 + 2_000 for s in saved if s), saved

    # the class sums bit for bit, so every per-class figure of every method
    assert {m: v.to_dict() for m, v in planned.metrics.items()} == {
        m: v.to_dict() for m, v in direct.metrics.items()
    }
    assert planned.audit.exposed == direct.audit.exposed
    assert planned.method_audits == direct.method_audits
    wire = {g.group: g for g in planned.audit.groups}
    for c in CLASSES:
        members = wire[f"class/{c}"].members
        assert "gram" not in wire[f"class/{c}"].tensors and f"b/{c}" in wire[f"class/{c}"].tensors
        complement = wire[f"others/class/{c}"]
        assert complement.tensors == ("gram",)
        # the complement is the one client that does not label c (missing 1, 8 clients, 8 classes)
        assert set(complement.members) | set(members) == set(wire["all"].members)
        assert len(complement.members) == 1 and not set(complement.members) & set(members)
        # a dropped member leaves it empty: its survivors are the `all` group's that are not in c
        assert set(complement.survivors) == set(wire["all"].survivors) - set(wire[f"class/{c}"].survivors)
    assert planned.dropped == direct.dropped
    # a lone client in a complement is an overlap exposure (gram='global' hides it), not a group of
    # its own: the verdicts name the same single-member groups and overlaps as the direct layout's
    assert planned.audit.exposed_by_overlap() == direct.audit.exposed_by_overlap()
    assert [g.group for g in planned.audit.single_member_groups()] == [
        g.group for g in direct.audit.single_member_groups()
    ]
    carriers = [g for g in planned.audit.groups if g.group.startswith("others/") and len(g.survivors) == 1]
    assert carriers and all("by difference" in (g.warning or "") for g in carriers)
    if not planned.dropped or overrides.get("dropout_stage") == "R3":
        assert "8 complement group(s) (others/class/0 … others/class/7) carry" in privacy_verdict(planned)
    assert {g.group for g in direct.audit.groups} == {g for g in wire if not g.startswith("others/")}

    assert "the Gram: 2 copies per client, not 8" in cost_summary(planned)
    assert any(
        line.startswith("derived from the sums as sent") and "gram of class/3 = all − others/class/3" in line
        for line in audit_lines(planned)
    )


def test_missing_7_sums_the_global_gram_from_the_class_groups_and_learns_nothing_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # missing 7 at 8 clients: each client labels one class, so the class groups partition the
    # clients and `all`'s Gram sum is theirs added (a partition plan): one Gram copy, not two
    planned = _setting(monkeypatch, direct=False, missing=(7,))
    direct = _setting(monkeypatch, direct=True, missing=(7,))
    wire = {g.group: g for g in planned.audit.groups}
    parts = tuple(sorted(g for g in wire if g.startswith("class/")))
    assert planned.sent_by_difference == {"all": {"gram": Derivation(parts)}}
    assert direct.sent_by_difference == {}
    assert planned.gram_copies == {"method": 2.0, "sent": 1.0}
    assert direct.gram_copies == {"method": 2.0, "sent": 2.0}
    saved = [d - p for d, p in zip(_r2_bytes(direct), _r2_bytes(planned), strict=True)]
    assert all(528 * 8 <= s < 528 * 8 + 1_000 for s in saved if s) and any(saved), saved
    # the same sums bit for bit (so every figure), the same exposures, nothing new on the wire
    assert {m: v.to_dict() for m, v in planned.metrics.items()} == {
        m: v.to_dict() for m, v in direct.metrics.items()
    }
    assert planned.audit.exposed == direct.audit.exposed
    assert planned.method_audits == direct.method_audits
    assert planned.dropped == direct.dropped
    assert set(wire) == {g.group for g in direct.audit.groups} - {"all"}
    assert all(wire[g].tensors == d.tensors for d in direct.audit.groups for g in [d.group] if g in wire)
    assert "the Gram: 1 copy per client, not 2" in cost_summary(planned)
    assert any(f"gram of all = {' + '.join(parts)}" in line for line in audit_lines(planned))


def test_missing_7_with_a_dropout_aborts_as_the_direct_layout_does(monkeypatch: pytest.MonkeyPatch) -> None:
    # a dropped client empties its class group: the method cannot fit that class, with or without
    # the plan, and the run says so the same way (a part never ends empty quietly)
    messages = []
    for direct in (False, True):
        with pytest.raises(ExperimentError, match="has 0 live member") as caught:
            _setting(monkeypatch, direct=direct, missing=(7,), dropout=2, dropout_stage="R2")
        messages.append(str(caught.value))
    assert messages[0] == messages[1]


def test_results_json_names_the_derivations(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()
    result = run_experiment(SimConfig(**{**SMALL, "missing": (1,), "rounds": 1}))  # type: ignore[arg-type]
    (entry,) = result_dict(result)["settings"]  # type: ignore[index]
    assert entry["sent_by_difference"]["class/0"] == {
        "gram": {"added": ["all"], "subtracted": ["others/class/0"]}
    }
    assert entry["gram_copies_per_client"] == {"method": 8.0, "sent": 2.0}


def test_missing_3_plans_the_large_classes_and_learns_nothing_more(monkeypatch: pytest.MonkeyPatch) -> None:
    planned = _setting(monkeypatch, direct=False, missing=(3,), rounds=1)
    direct = _setting(monkeypatch, direct=True, missing=(3,), rounds=1)
    members = {g.group: set(g.members) for g in direct.audit.groups}
    everyone = members["all"]
    # exactly the classes with more members than non-members travel by difference
    large = {g for g, m in members.items() if g.startswith("class/") and len(m) > len(everyone - m)}
    assert large and set(planned.sent_by_difference) == large
    assert planned.gram_copies["sent"] < planned.gram_copies["method"] == direct.gram_copies["method"]
    assert {m: v.to_dict() for m, v in planned.metrics.items()} == {
        m: v.to_dict() for m, v in direct.metrics.items()
    }
    assert planned.audit.exposed == direct.audit.exposed
    assert planned.method_audits == direct.method_audits
