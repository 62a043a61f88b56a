"""sim --scenario multisite on the embedded tables: sites, unknown labels, the split, overlaps, Theorem 1."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from secure_afl.cli import main
from secure_afl.sim.fedavg import FedAvgConfig
from secure_afl.sim.multisite import (
    EXACT_BAR,
    MultisiteConfig,
    MultisiteError,
    MultisiteResult,
    _class_metrics,
    cycled_rows,
    load_site_table,
    resolve_classes,
    run_multisite,
    site_shifts,
    to_json,
)
from secure_afl.sim.setting import AFL_1, SimConfig
from secure_afl.sim.synthetic import synthetic_features

PAPER = (
    "Atelectasis",
    "Cardiomegaly",
    "Effusion",
    "Infiltration",
    "Mass",
    "Nodule",
    "Pneumonia",
    "Pneumothorax",
)
# What each table labels of the paper's 8 classes (torchxrayvision's relabelling)
EXPECTED_LABELS = {
    "nih": set(PAPER),
    "chexpert": {"Atelectasis", "Cardiomegaly", "Effusion", "Pneumonia", "Pneumothorax"},
    "padchest": set(PAPER),
    "vindr": {"Atelectasis", "Cardiomegaly", "Effusion", "Infiltration", "Pneumothorax"},
    "rsna": {"Pneumonia"},
    "siim": {"Pneumothorax"},
    "google": {"Pneumothorax"},
}


@pytest.fixture(scope="module")
def result() -> MultisiteResult:
    sim = SimConfig(fraction=0.02, dim=128, fedavg=FedAvgConfig(rounds=2))
    return run_multisite(MultisiteConfig(sim=sim))


@pytest.fixture(scope="module")
def payload(result: MultisiteResult) -> dict:
    return json.loads(json.dumps(to_json(result), default=str))


def test_sites_are_listed_with_their_rows_patients_and_label_sets(
    result: MultisiteResult, payload: dict
) -> None:
    table = result.data.table
    assert [s["key"] for s in payload["sites"]] == list(EXPECTED_LABELS)
    for k, site in enumerate(payload["sites"]):
        rows = table.site == k
        assert {"name", "rows", "patients", "labelled_classes"} <= set(site)
        assert site["rows"] == int(rows.sum()) == site["train_rows"] + site["test_rows"] > 0
        assert site["patients"] == len(set(table.patients[rows])) <= site["rows"]
        assert set(site["labelled_classes"]) == EXPECTED_LABELS[site["key"]]
    by_class = {c["class"]: c for c in payload["classes"]}
    for name in PAPER:
        sites = [k for k, labels in EXPECTED_LABELS.items() if name in labels]
        assert by_class[name]["sites"] == sites and by_class[name]["S_c"] == len(sites)
    # CheXpert's blank and uncertain entries count negative in the classes it labels, and are recorded
    chexpert = payload["sites"][1]
    assert set(chexpert["unlabelled_rows_counted_negative"]) <= EXPECTED_LABELS["chexpert"]
    assert sum(chexpert["unlabelled_rows_counted_negative"].values()) > 0


def test_a_class_a_site_does_not_label_is_unknown_not_negative(result: MultisiteResult) -> None:
    table, assignment = result.data.table, result.data.assignment
    audit = result.setting.method_audits[AFL_1]
    members = {g.group: set(g.members) for g in audit.groups}
    for c, name in enumerate(table.classes):
        labelling = {f"client-{k}" for k, s in enumerate(table.sites) if name in EXPECTED_LABELS[s.key]}
        assert {f"client-{k}" for k in assignment.coverage()[c]} == labelling
        assert members[f"class/{c}"] == labelling  # no Gram, no projection from a site that does not label it
    # the test metrics skip unknown rows: scores perfect where known, inverted where unknown, give AUC 1
    known = table.known()[result.data.prepared.split.test]
    labels = result.data.prepared.cohort.labels[result.data.prepared.split.test]
    logits = np.where(known, 2.0 * labels - 1, 1.0 - 2.0 * labels)
    metrics = _class_metrics(labels, known, logits)
    assert np.allclose(metrics.auc[~np.isnan(metrics.auc)], 1.0) and not np.isnan(metrics.auc).all()


def test_patients_never_straddle_train_and_test(result: MultisiteResult) -> None:
    data = result.data
    patients = data.table.patients
    train = np.concatenate(data.prepared.split.clients)
    assert not set(patients[train]) & set(patients[data.prepared.split.test])
    assert len(train) + len(data.prepared.split.test) == len(patients)
    # NIH and Google share one patient namespace: an NIH patient is on one side at both sites
    nih, google = (data.table.site == 0), (data.table.site == 6)
    shared = set(patients[nih]) & set(patients[google])
    for p in shared:
        assert len(set(data.test[patients == p])) == 1


def test_google_relabels_are_not_counted_twice() -> None:
    table = load_site_table(PAPER, ("nih", "google"))
    nih, google = table.image_ids[table.site == 0], table.image_ids[table.site == 1]
    assert not set(nih) & set(google)
    assert len(google) == 1132 and table.overlap_removed == {"nih": 1132, "google": 0}
    assert len(nih) == 67310 - 1132
    # SIIM's table has a row per pneumothorax region: one row per image here
    siim = load_site_table(PAPER, ("siim", "rsna"))
    ids = siim.image_ids[siim.site == 0]
    assert len(ids) == len(set(ids)) == 12047


def test_theorem1_w_equals_the_centralised_fit_under_masking(result: MultisiteResult, payload: dict) -> None:
    assert result.config.sim.secure == "mask"
    assert payload["max_abs_w_vs_centralised"] <= EXACT_BAR
    assert payload["max_abs_w_vs_centralised_global_balance"] <= EXACT_BAR
    assert payload["max_abs_w_vs_centralised_scale"] > 1e3 * EXACT_BAR  # the bar is not vacuous
    assert {"AFL (1 round)", "AFL (2 rounds)", "FedAvg"} <= set(payload["metrics"])
    assert set(payload["metrics_per_site"]["FedAvg"]) == set(EXPECTED_LABELS)
    assert payload["privacy_audit"]["groups"]


def test_site_shift_adds_a_per_site_offset_and_leaves_the_rest_of_the_model() -> None:
    rng = np.random.default_rng(0)
    labels = (rng.random((50, 3)) < 0.3).astype(np.int8)
    patients = np.arange(50) // 2
    plain = synthetic_features(labels, patients, dim=16, seed=1)
    zero = synthetic_features(
        labels, patients, dim=16, seed=1, offsets=(np.zeros(50, int), np.zeros((2, 16)))
    )
    assert np.array_equal(plain, zero)
    group = np.arange(50) % 2
    shifted = synthetic_features(
        labels, patients, dim=16, seed=1, offsets=(group, site_shifts(2, 16, 0.5, 1))
    )
    pre = np.log(np.expm1(plain.astype(np.float64)))  # softplus⁻¹
    post = np.log(np.expm1(shifted.astype(np.float64)))
    delta = post - pre
    assert np.allclose(delta[group == 0], delta[group == 0][0], atol=1e-3)
    assert not np.allclose(delta[group == 0][0], delta[group == 1][0], atol=1e-2)


def test_cycled_rows_repeat_each_site_to_the_largest() -> None:
    clients = (np.arange(5), np.arange(5, 7), np.arange(7, 17))
    out = cycled_rows(clients, seed=0)
    assert [len(r) for r in out] == [10, 10, 10]
    for rows, cycled in zip(clients, out, strict=True):
        assert set(cycled) == set(rows)
        assert np.bincount(cycled).max() - np.bincount(cycled)[rows].min() <= 1


def test_bad_configurations_name_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(MultisiteError, match="unknown site 'mimic'"):
        run_multisite(MultisiteConfig(sites=("nih", "mimic")))
    with pytest.raises(MultisiteError, match="unknown classes"):
        resolve_classes("Atelectasis,Bogus")
    absent = tmp_path / "no-such-dir"
    with pytest.raises(MultisiteError, match=f"directory of site nih does not exist: {absent}"):
        load_site_table(PAPER, ("nih", "siim"), directories={"nih": absent, "siim": tmp_path})
    config = MultisiteConfig(sites=("nih", "siim"), site_dirs=(("nih", tmp_path),))
    with pytest.raises(MultisiteError, match="none for siim"):
        config.validate()
    with pytest.raises(MultisiteError, match="site shift"):
        MultisiteConfig(site_shift=-1.0).validate()


def test_all_classes_keeps_those_some_site_labels() -> None:
    table = load_site_table(resolve_classes("all"), ("rsna", "siim", "google"))
    assert set(table.classes) == {"Pneumothorax", "Pneumonia", "Lung Opacity", "Fracture"}
    assert table.labelled.any(axis=0).all()


def test_the_privacy_paragraphs_count_of_agreeing_checks_is_report_mds_list(
    result: MultisiteResult, tmp_path: Path
) -> None:
    import re

    from secure_afl.sim.multisite import summary_lines, write_multisite_reports

    _, md = write_multisite_reports(result, tmp_path)
    report = md.read_text()
    listed = re.search(r"own exposure checks against this audit \(.*?\): ([^\n]*)", report)
    assert listed is not None, report
    parts = dict(part.split(": ", 1) for part in listed.group(1).split("; "))
    counted = re.search(r"(\d+) of (\d+) clients' own exposure checks agree", " ".join(summary_lines(result)))
    assert counted is not None
    agree = parts["agree"].split(", ") if "agree" in parts else []
    assert int(counted.group(1)) == len(agree)
    assert int(counted.group(2)) == sum(len(names.split(", ")) for names in parts.values())


def test_cli_runs_the_scenario_and_refuses_its_options_elsewhere(tmp_path: Path) -> None:
    runner = CliRunner()
    refused = runner.invoke(main, ["sim", "--site-shift", "0", "--out", str(tmp_path / "x")])
    assert refused.exit_code != 0 and "need --scenario multisite" in refused.output
    done = runner.invoke(
        main,
        [
            "sim", "--scenario", "multisite", "--sites", "nih,rsna,siim", "--fraction", "0.01", "--dim", "64",
            "--fedavg-rounds", "1", "--rounds", "1", "--site-shift", "0", "--out", str(tmp_path / "run"),
        ],
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    out = json.loads((tmp_path / "run" / "results.json").read_text())
    assert [s["key"] for s in out["sites"]] == ["nih", "rsna", "siim"]
    assert out["config"]["site_shift"] == 0 and out["config"]["sim"]["secure"] == "mask"
    assert out["max_abs_w_vs_centralised"] <= EXACT_BAR
