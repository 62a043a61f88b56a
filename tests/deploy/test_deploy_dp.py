"""Differential privacy in the deployment: the server and clients of secure_afl.deploy in one process.

The Flower processes are not started here (see the module docstring of test_deploy_local.py for
those); the apps' own code paths (run config, envelopes in Flower records) are.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import chi2

from secure_afl.aggregation.backend import CkksBackend
from secure_afl.deploy.apps import study_from_run_config
from secure_afl.deploy.classifier import Classifier
from secure_afl.deploy.client import NodeSettings
from secure_afl.deploy.errors import ConfigurationError, FederationAbortedError
from secure_afl.deploy.server import FederationServer
from secure_afl.deploy.study import (
    Method,
    Study,
    StudyDp,
    format_class_lists,
    noise_plan,
    parse_class_lists,
    round1_layout,
    round2_layout,
)
from secure_afl.deploy.wire import Envelope
from secure_afl.features.file import save_feature_file

from .helpers import InProcessTransport, check_study, make_federation, pixel_digests, row_digests, run_server

EPSILON = 1.0
CLIP = 8.0  # toy features: gamma(2, 1) rows of 40 values have norms near 14, so most rows are clipped
# Round 2 needs two live clients that miss one class: pseudo/0 holds client-0 and client-1.
ACTIVE = {
    "client-0": (1, 2),
    "client-1": (1, 2),
    "client-2": (0, 1, 2),
    "client-3": (0, 1, 2),
    "client-4": (0, 2),
}


def _private_federation(tmp_path: Path, *, rounds: int = 1, active=None, n_clients: int = 5, **dp):
    method = Method(balance="global", rounds=rounds, min_pos=1, min_neg=1, tau=0.5)
    federation = make_federation(tmp_path, n_clients=n_clients, active=active, method=method)
    lists = {cid: tuple(data[2]) for cid, data in federation.data.items()}
    settings = {"epsilon": EPSILON, "clip": CLIP, **dp}
    federation.study = dataclasses.replace(federation.study, dp=StudyDp(class_lists=lists, **settings))
    return federation


class Capturing(InProcessTransport):
    """Keeps each node's protocol inputs (its noisy upload) as saved after a session's first round."""

    def __init__(self, federation) -> None:
        super().__init__(federation)
        self.uploads: dict[str, dict[str, dict[str, np.ndarray]]] = {}

    def exchange(self, outgoing, group, timeout):
        replies = super().exchange(outgoing, group, timeout)
        if group.endswith("-R0"):
            label = group[1:].split("-")[0]
            for node in self.federation.nodes.values():
                saved = node.state.records.get(label)
                if saved and "inputs" in saved:
                    self.uploads.setdefault(label, {})[node.client_id] = saved["inputs"]
        return replies


def _contributions(flat: dict[str, np.ndarray], layout) -> dict[str, dict[str, np.ndarray]]:
    out: dict[str, dict[str, np.ndarray]] = {}
    for key, values in flat.items():
        group, tensor = key.split("|", 1)
        out.setdefault(group, {})[tensor] = layout.unflatten(tensor, np.asarray(values))
    return out


@pytest.mark.parametrize("rounds", [1, 2])
def test_a_private_deployment_solves_the_noisy_uploads_as_the_simulator_does(
    tmp_path: Path, rounds: int
) -> None:
    from secure_afl.privacy.dp import private_statistics
    from secure_afl.privacy.dp_solve import fit_private, pseudo_count_noise_std, refine_private
    from secure_afl.sim.secure import secure_aggregate

    federation = _private_federation(tmp_path, rounds=rounds, active=ACTIVE)
    federation.nodes[1002].dead_from = "s1-R1"  # client-2 draws its noise, advertises, then is killed
    transport = Capturing(federation)
    server, classifier, _ = run_server(federation, transport)
    study = federation.study
    plan = noise_plan(study, len(federation.roster))
    assert server.report.sessions[0].survivors == ("client-0", "client-1", "client-3", "client-4")

    # The reference: the simulator's secure aggregation of the same noisy uploads, the same DP solve.
    layout1 = round1_layout(study)
    uploads1 = {cid: _contributions(flat, layout1) for cid, flat in transport.uploads["1"].items()}
    assert sorted(uploads1) == sorted(ACTIVE)
    round1 = secure_aggregate(
        uploads1, threshold=study.threshold_for(5), min_group_size=study.min_group_size,
        dropouts={"R1": ["client-2"]}, frac_bits=study.frac_bits,
    )  # fmt: skip
    model, solve, converted = fit_private(
        round1.sums, plan, n_classes=3, gamma=study.method.gamma, gram_survivors=len(round1.survivors["all"])
    )
    if rounds == 2:
        assert [g["name"] for g in server.report.sessions[1].groups] == ["pseudo/0"]
        layout2 = round2_layout(study, [0])
        participants = server.report.sessions[1].participants
        assert participants == ("client-0", "client-1", "client-3", "client-4")
        captured = transport.uploads["2"]
        uploads2 = {cid: _contributions(captured.get(cid, {}), layout2) for cid in participants}
        # the live clients that miss class 0 (the others take part with no group)
        assert sorted(cid for cid, groups in uploads2.items() if groups) == ["client-0", "client-1"]
        round2 = secure_aggregate(uploads2, threshold=study.threshold_for(5), min_group_size=2)
        count_std = pseudo_count_noise_std(plan, {g: len(ids) for g, ids in round2.survivors.items()})
        model, _ = refine_private(
            model,
            converted,
            round2.sums,
            solve,
            n_classes=3,
            config=_pseudo(study),
            count_noise_std=count_std,
        )
    assert classifier.weights.tobytes() == np.asarray(model.coef_, dtype=np.float64).tobytes()

    # Each upload is the client's clipped statistics plus its own share of the noise, no more, no less:
    # the noise over its planned share's std is standard normal, so its mean square is χ²_n / n.  The
    # band is the χ² interval with a 1e-9 false-alarm rate (the OS draws the noise: a fixed ±15 % band
    # on 44 values failed by chance about once in three runs); zero noise or u shares fall outside it.
    features, labels, active = federation.data["client-0"]
    clean = private_statistics(features, labels, CLIP, device="cpu").round1(active)
    standardised, sizes = [], []
    for group, kind, tensor in (("all", "gram", "gram"), ("class/1", "sums", "pos_sum/1")):
        block = plan.blocks[(group, kind)]
        noise = uploads1["client-0"][group][tensor] - clean[group][tensor]
        values = noise[np.triu_indices(noise.shape[0])] if tensor == "gram" else noise
        standardised.append(values / block.group_std(1))
        sizes.append((values.size, block.fewest))
    z = np.concatenate(standardised)
    low, high = chi2.ppf([0.5e-9, 1 - 0.5e-9], z.size) / z.size
    assert low <= np.mean(z**2) <= high, (np.mean(z**2), low, high, sizes)
    # and the band tells one share from the whole noise (what a client that did not split it would add)
    whole = sum(size * fewest for size, fewest in sizes) / z.size  # its mean square
    assert whole > high, (whole, high, sizes)
    # The classifier's record: ε per institution within the target, and calibrated to it.
    privacy = classifier.privacy
    assert privacy is not None and privacy["epsilon_target"] == EPSILON and privacy["clip"] == CLIP
    spent = privacy["epsilon_spent"]
    assert sorted(spent) == sorted(ACTIVE)
    assert all(0 < eps <= EPSILON for eps in spent.values())
    assert max(spent.values()) >= 0.97 * EPSILON
    assert privacy["gram_noise_std"] == pytest.approx(plan.blocks[("all", "gram")].group_std(4))


def _pseudo(study: Study):
    from secure_afl.analytic import PseudoLabelConfig

    m = study.method
    return PseudoLabelConfig(tau=m.tau, alpha=m.alpha, min_pos=m.min_pos, min_neg=m.min_neg)


def test_every_group_sum_keeps_the_target_variance_at_the_survivors_the_session_allows(
    tmp_path: Path,
) -> None:
    federation = _private_federation(tmp_path, active=ACTIVE)
    federation.nodes[1004].dead_from = "s1-R2"  # client-4 advertises and shares keys, then is killed
    server, classifier, _ = run_server(federation)
    plan = noise_plan(federation.study, 5)
    # n = 5, t = 4, minimum group 2: the Gram group of 5 may lose one member (u = 4); class/0 (3
    # labellers) may lose one (u = 2); class/1 (4 labellers) u = 3.
    assert {g: b.fewest for (g, k), b in plan.blocks.items() if k != "counts"} == {
        "all": 4, "class/0": 2, "class/1": 3, "class/2": 4,
    }  # fmt: skip
    for block in plan.blocks.values():
        assert block.fewest * block.client_variance >= block.target_variance_steps
    for group in server.report.sessions[0].groups:
        for kind in ("gram",) if group["name"] == "all" else ("sums", "counts"):
            block = plan.blocks[(group["name"], kind)]
            assert len(group["survivors"]) >= block.fewest  # the session never goes below the plan
            assert len(group["survivors"]) * block.client_variance >= block.target_variance_steps
    blocks = {(b["group"], b["block"]): b for b in classifier.privacy["blocks"]}
    assert blocks[("class/0", "sums")]["fewest_survivors"] == 2


def test_the_classifier_file_records_dp_and_predict_prints_it(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from secure_afl.cli import main

    federation = _private_federation(tmp_path / "f", n_clients=4)
    server, classifier, _ = run_server(federation)
    path = tmp_path / "classifier.json"
    classifier.save(path, federation.signer)
    document = json.loads(path.read_text())
    assert document["differential_privacy"]["delta"] == 1e-6
    assert Classifier.load(path, roster=federation.roster).privacy == classifier.privacy
    for cid in server.report.acknowledged:  # every institution stored the same record
        stored = tmp_path / "f" / f"out-{cid}" / "classifier.json"
        assert Classifier.load(stored, roster=federation.roster).privacy == classifier.privacy
    features = tmp_path / "new.npz"
    save_feature_file(
        features, np.ones((3, 40)), classes=("A", "B", "C"), backbone="toy", weights_id="sha256:00",
        preprocessing="none",
    )  # fmt: skip
    result = CliRunner().invoke(
        main,
        ["predict", "--model", str(path), "--roster", str(tmp_path / "f" / "roster.json"),
         "--features", str(features), "--out", str(tmp_path / "p.csv")],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "differentially private: ε = 1, δ = 1e-06 for one image" in result.output
    assert "ε spent per institution: client-0" in result.output


def test_without_dp_the_study_and_classifier_documents_are_todays(tmp_path: Path) -> None:
    federation = make_federation(tmp_path)
    assert set(json.loads(federation.study.to_json())) == {
        "backbone", "classes", "dim", "frac_bits", "method", "min_group_size", "threshold",
    }  # fmt: skip
    server, classifier, _ = run_server(federation)
    assert classifier.privacy is None and "differential_privacy" not in classifier.to_json()
    assert all("study-nonce" not in envelope.meta for _, _, envelope in server.transport.sent)
    # DP on: the study document changes, so its digest does (the session ids commit to it).
    private = dataclasses.replace(
        federation.study,
        method=Method(balance="global"),
        dp=StudyDp(epsilon=1.0, class_lists={cid: tuple(d[2]) for cid, d in federation.data.items()}),
    )
    assert Study.from_json(private.to_json()) == private
    assert (
        private.digest()
        != dataclasses.replace(private, dp=dataclasses.replace(private.dp, epsilon=2.0)).digest()
    )


def _node_setting(federation, node_id: int, **changes) -> None:
    node = federation.nodes[node_id]
    node.settings = dataclasses.replace(node.settings, **changes)


@pytest.mark.parametrize(
    ("node_dp", "study_dp", "message"),
    [
        ({"dp_epsilon": 0.5}, {}, "the study's DP ε = 1 exceeds this institution's dp-epsilon 0.5"),
        ({"dp_epsilon": 2.0, "dp_delta": 1e-8}, {}, "the study's DP δ = 1e-06 exceeds this institution's"),
        ({"dp_epsilon": 2.0, "dp_unit": "patient"}, {}, "this institution's dp-unit asks for one patient"),
        ({"dp_epsilon": 1.0}, None, "takes part only under differential privacy"),
    ],
)
def test_a_client_whose_own_dp_settings_the_study_does_not_meet_refuses_it(
    tmp_path: Path, node_dp, study_dp, message
) -> None:
    federation = (
        _private_federation(tmp_path, n_clients=4) if study_dp is not None else make_federation(tmp_path)
    )
    _node_setting(federation, 1001, **node_dp)
    server, classifier, transport = run_server(federation)
    assert [(r["from"], r["error"]) for r in server.report.refusals] == [("client-1", "StudyMismatchError")]
    assert message in server.report.refusals[0]["message"]
    assert [r.kind for n, _, r in transport.received if n == 1001] == ["refused"]  # nothing else left it
    assert classifier.sessions[0]["participants"] == ["client-0", "client-2", "client-3"]


def test_a_study_that_lists_other_classes_for_a_client_is_refused_by_that_client(tmp_path: Path) -> None:
    federation = _private_federation(tmp_path, n_clients=4)
    lists = dict(federation.study.dp.class_lists)
    lists["client-1"] = (0, 1, 2)  # client-1's feature file labels (0, 2)
    federation.study = dataclasses.replace(
        federation.study, dp=dataclasses.replace(federation.study.dp, class_lists=lists)
    )
    server, _, _ = run_server(federation)
    assert [(r["from"], r["error"]) for r in server.report.refusals] == [("client-1", "StudyMismatchError")]
    assert (
        "the study lists classes [0, 1, 2] for client-1, this feature file labels [0, 2]"
        in (server.report.refusals[0]["message"])
    )


def test_a_client_refuses_a_patient_study_without_patient_ids(tmp_path: Path) -> None:
    federation = _private_federation(tmp_path, n_clients=4, unit="patient", max_images_per_patient=2)
    server = FederationServer(
        InProcessTransport(federation),
        federation.roster,
        federation.study,
        round_timeout=1,
        log=lambda s: None,
    )
    with pytest.raises(FederationAbortedError, match="aborted after R0"):
        server.run()
    assert [r["error"] for r in server.report.refusals] == ["StudyMismatchError"] * 4
    assert "has no patient_ids" in server.report.refusals[0]["message"]


def test_the_patient_unit_caps_each_patients_images_at_each_institution(tmp_path: Path, capsys) -> None:
    federation = _private_federation(tmp_path, n_clients=4, unit="patient", max_images_per_patient=2)
    for cid, (features, labels, active) in federation.data.items():
        node = next(n for n in federation.nodes.values() if n.client_id == cid)
        save_feature_file(
            node.settings.features, features, labels=labels, active=active, classes=("A", "B", "C"),
            backbone="toy", weights_id="sha256:00", preprocessing="none",
            patient_ids=[f"{cid}-patient-{i // 3}" for i in range(len(features))],  # 3 images each
            image_sha256=row_digests(f"patients/{cid}", len(features)),
            pixel_sha256=pixel_digests(row_digests(f"patients/{cid}", len(features))),
        )  # fmt: skip
    _, classifier, _ = run_server(federation)
    logged = capsys.readouterr().err
    assert logged.count("rows clipped to norm 8") == 4
    assert "of 40 rows clipped" in logged and "of 60 rows" not in logged  # 20 patients × 2 images
    privacy = classifier.privacy
    assert (privacy["unit"], privacy["max_images_per_patient"]) == ("patient", 2)
    sums = next(b for b in privacy["blocks"] if b["block"] == "sums")
    assert sums["sensitivity"] == 2 * CLIP  # a patient moves a sum by up to cap × clip
    assert all(eps <= EPSILON for eps in privacy["epsilon_spent"].values())


def test_a_client_sent_another_study_than_its_peers_refuses_the_session(tmp_path: Path) -> None:
    """The session id commits to the study: a server cannot give one client a weaker plan."""
    federation = _private_federation(tmp_path, n_clients=4)
    looser = dataclasses.replace(federation.study, dp=dataclasses.replace(federation.study.dp, epsilon=8.0))

    def tamper(node_id: int, group: str, envelope: Envelope) -> Envelope:
        if node_id == 1001 and envelope.kind == "advertise":
            return Envelope(envelope.kind, {**envelope.meta, "study": looser.to_json()}, envelope.payload)
        return envelope

    # Node 1001 checked the looser study (else its check pin alone refuses it: test_study_pinning.py);
    # the session id, which commits to the study its peers received, still gives it away.
    check_study(federation, looser, nodes=[1001])
    server, _, _ = run_server(federation, InProcessTransport(federation, tamper=tamper))
    assert [(r["from"], r["error"]) for r in server.report.refusals] == [("client-1", "StudyMismatchError")]
    assert "does not commit to the study" in server.report.refusals[0]["message"]


def test_a_session_id_that_does_not_commit_to_the_study_is_refused_by_every_client(tmp_path: Path) -> None:
    federation = _private_federation(tmp_path, n_clients=4)

    def tamper(node_id: int, group: str, envelope: Envelope) -> Envelope:
        if envelope.kind == "advertise":
            return Envelope(envelope.kind, {**envelope.meta, "study-nonce": "00" * 32}, envelope.payload)
        return envelope

    with pytest.raises(FederationAbortedError, match="aborted after R0"):
        run_server(federation, InProcessTransport(federation, tamper=tamper))


def test_dp_with_ckks_is_refused_by_the_study_the_server_and_the_clients(tmp_path: Path) -> None:
    federation = _private_federation(tmp_path, n_clients=4)
    with pytest.raises(ConfigurationError, match="only with the masking protocol"):
        dataclasses.replace(federation.study, protection="ckks")
    with pytest.raises(ConfigurationError, match="the server was given the 'ckks' backend"):
        FederationServer(
            InProcessTransport(federation), federation.roster, federation.study, backend=CkksBackend()
        )
    # A server that says "ckks" to the clients anyway is refused by each of them.

    def tamper(node_id: int, group: str, envelope: Envelope) -> Envelope:
        return Envelope(
            envelope.kind, {**envelope.meta, "backend": "ckks"}, envelope.payload, envelope.arrays
        )

    transport = InProcessTransport(federation, tamper=tamper)
    server = FederationServer(
        transport, federation.roster, federation.study, round_timeout=1, log=lambda s: None
    )
    with pytest.raises(FederationAbortedError, match="aborted after R0"):
        server.run()
    assert {(r["error"]) for r in server.report.refusals} == {"StudyMismatchError"}
    assert len(server.report.refusals) == 4
    assert all(
        "the session runs the 'ckks' protection, but the study says 'mask'" in r["message"]
        for r in server.report.refusals
    )


def test_bad_dp_studies_are_refused_with_what_to_fix(tmp_path: Path) -> None:
    base = make_federation(tmp_path).study
    lists = {"a": (0,), "b": (1, 2)}
    with pytest.raises(ConfigurationError, match="balance='global' and gram='global'"):
        dataclasses.replace(base, dp=StudyDp(epsilon=1.0, class_lists=lists))
    glob = dataclasses.replace(base, method=Method(balance="global"))
    with pytest.raises(ConfigurationError, match="--dp-epsilon must be a positive"):
        dataclasses.replace(glob, dp=StudyDp(epsilon=0.0, class_lists=lists))
    with pytest.raises(ConfigurationError, match=r"no institution labels \['C'\]"):
        dataclasses.replace(glob, dp=StudyDp(epsilon=1.0, class_lists={"a": (0,), "b": (1,)}))
    with pytest.raises(ConfigurationError, match="class list of 'b'"):
        dataclasses.replace(glob, dp=StudyDp(epsilon=1.0, class_lists={"a": (0, 1, 2), "b": (3,)}))
    study = dataclasses.replace(glob, dp=StudyDp(epsilon=1.0, class_lists=lists))
    with pytest.raises(ConfigurationError, match="name 2 institutions, the roster 3"):
        noise_plan(study, 3)
    federation = make_federation(tmp_path / "f", n_clients=3)
    with pytest.raises(ConfigurationError, match="class lists name"):
        FederationServer(InProcessTransport(federation), federation.roster, study)


def test_the_run_config_and_node_config_carry_the_dp_settings() -> None:
    config = {
        "classes": "A,B,C", "dim": 8, "backbone": "toy", "weights-id": "sha256:00", "preprocessing": "none",
        "dp-epsilon": 2.0, "dp-delta": 1e-7, "clip": 4.0, "dp-unit": "patient",
        "dp-max-images-per-patient": 3, "class-lists": "h-a=0,1; h-b=2,1",
    }  # fmt: skip
    study = study_from_run_config(config)
    assert study.method.balance == "global"  # DP's default
    assert study.dp == StudyDp(
        epsilon=2.0, delta=1e-7, clip=4.0, unit="patient", max_images_per_patient=3,
        class_lists={"h-a": (0, 1), "h-b": (1, 2)},
    )  # fmt: skip
    assert parse_class_lists(format_class_lists(study.dp.class_lists)) == study.dp.class_lists
    with pytest.raises(ConfigurationError, match="needs class-lists"):
        study_from_run_config({k: v for k, v in config.items() if k != "class-lists"})
    with pytest.raises(ConfigurationError, match="expected INSTITUTION=i,j"):
        study_from_run_config({**config, "class-lists": "h-a=0;h-a=1"})
    plain = study_from_run_config(
        {k: config[k] for k in ("classes", "dim", "backbone", "weights-id", "preprocessing")}
    )
    assert plain.dp is None and plain.method.balance == "client"
    node = {**{k: "/x" for k in NodeSettings.KEYS}, "passphrase-file": "/x"}
    settings = NodeSettings.from_node_config({**node, "dp-epsilon": "1", "dp-unit": "patient"})
    assert (settings.dp_epsilon, settings.dp_delta, settings.dp_unit) == (1.0, None, "patient")
    with pytest.raises(ConfigurationError, match="without dp-epsilon"):
        NodeSettings.from_node_config({**node, "dp-delta": "1e-6"})


def test_deploy_local_refuses_bad_dp_options_before_starting_anything(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from secure_afl.cli import main

    runner = CliRunner()
    out = ["--out", str(tmp_path / "out")]
    result = runner.invoke(main, ["deploy", "local", "--dp-epsilon", "1", "--balance", "client", *out])
    assert result.exit_code == 2 and "--dp-epsilon needs --balance global and --gram global" in result.output
    result = runner.invoke(main, ["deploy", "local", "--dp-epsilon", "-1", *out])
    assert result.exit_code == 2 and "--dp-epsilon must be a positive finite number" in result.output
    result = runner.invoke(main, ["deploy", "local", "--dp-epsilon", "1", "--dp-delta", "2", *out])
    assert result.exit_code == 2 and "--dp-delta must lie strictly between 0 and 1" in result.output
    assert not (tmp_path / "out").exists()


class CapturingReleases(Capturing):
    """Also keeps each node's round-1 release (the digests of its clean values, for its ledger)."""

    def __init__(self, federation) -> None:
        super().__init__(federation)
        self.releases: dict[str, object] = {}

    def exchange(self, outgoing, group, timeout):
        replies = super().exchange(outgoing, group, timeout)
        if group == "s1-R0":
            for node in self.federation.nodes.values():
                saved = node.state.records.get("1")
                if saved and "release" in saved:
                    self.releases[node.client_id] = saved["release"]
        return replies


@pytest.mark.parametrize("ridge", ["adaptive", "adassp"])
def test_a_projected_private_deployment_solves_as_the_simulator_does_and_releases_weights_in_d(
    tmp_path: Path, ridge: str
) -> None:
    """--dp-dim in the deployment: the study carries K and the seed, each client projects its own rows
    with the matrix it derives from them, the server solves in K dimensions (round 2's coefficients
    go out as W_K) with the study's ridge, and the classifier file holds W = P W_K."""
    from secure_afl.privacy.dp import EIGEN_TENSOR, private_statistics
    from secure_afl.privacy.dp_solve import fit_private, lift, pseudo_count_noise_std, refine_private
    from secure_afl.privacy.projection import projection_digest, projection_matrix
    from secure_afl.privacy.release import Release, value_id
    from secure_afl.sim.secure import secure_aggregate

    federation = _private_federation(
        tmp_path, rounds=2, active=ACTIVE, projection_dim=8, projection_seed=5, ridge=ridge
    )
    federation.nodes[1002].dead_from = "s1-R1"
    transport = CapturingReleases(federation)
    server, classifier, _ = run_server(federation, transport)
    study = federation.study
    plan = noise_plan(study, 5)
    matrix = projection_matrix(40, 8, 5)
    eigen = ridge == "adassp"
    layout1 = round1_layout(study)
    assert dict(layout1.groups["all"]) == ({"gram": 36, EIGEN_TENSOR: 1} if eigen else {"gram": 36})
    assert dict(layout1.groups["class/0"]) == {"pos_sum/0": 8, "neg_sum/0": 8, "n_pos/0": 1, "n_neg/0": 1}

    uploads1 = {cid: _contributions(flat, layout1) for cid, flat in transport.uploads["1"].items()}
    round1 = secure_aggregate(
        uploads1, threshold=study.threshold_for(5), min_group_size=study.min_group_size,
        dropouts={"R1": ["client-2"]}, frac_bits=study.frac_bits,
    )  # fmt: skip
    model, solve, converted = fit_private(
        round1.sums, plan, n_classes=3, gamma=study.method.gamma, gram_survivors=len(round1.survivors["all"])
    )
    layout2 = round2_layout(study, [0])
    participants = server.report.sessions[1].participants
    uploads2 = {cid: _contributions(transport.uploads["2"].get(cid, {}), layout2) for cid in participants}
    round2 = secure_aggregate(uploads2, threshold=study.threshold_for(5), min_group_size=2)
    count_std = pseudo_count_noise_std(plan, {g: len(ids) for g, ids in round2.survivors.items()})
    model, _ = refine_private(
        model, converted, round2.sums, solve, n_classes=3, config=_pseudo(study), count_noise_std=count_std
    )
    assert model.coef_.shape == (8, 3) and classifier.weights.shape == (40, 3)
    assert classifier.weights.tobytes() == lift(model, matrix).coef_.tobytes()
    coefs = [e.arrays["coef"] for _, _, e in transport.sent if "coef" in e.arrays]
    assert coefs and all(c.shape == (8, 3) for c in coefs)  # round 2 scores the projected rows

    # Every client projected its rows with the study's matrix, exactly: the ledger names each clean
    # value by its digest, and each client's equals that of its own rows projected (seed 5) and
    # clipped; with another seed's matrix it would not.  Its upload is that plus one noise share.
    for cid, (features, labels, active) in federation.data.items():
        release = Release.from_json(json.loads(str(transport.releases[cid])))
        for seed, same in ((5, True), (6, False)):
            other = projection_matrix(40, 8, seed)
            clean = private_statistics(features, labels, CLIP, projection=other, device="cpu").round1(
                active, eigen=eigen
            )
            c = active[0]
            for group, tensor in (("all", "gram"), (f"class/{c}", f"pos_sum/{c}")):
                wire = layout1.flatten(tensor, clean[group][tensor])
                assert (release.values[(group, tensor)] == value_id(wire)) == same, (cid, seed, tensor)
            if same:  # the noise is one share's (scalars such as λ_min carry no digest: checked here)
                for kind, tensor in (
                    (("gram", "gram"), ("eigen", EIGEN_TENSOR)) if eigen else (("gram", "gram"),)
                ):
                    noise = uploads1[cid]["all"][tensor] - clean["all"][tensor]
                    assert np.abs(noise).max() < 12 * plan.blocks[("all", kind)].group_std(1)

    # `predict` on the d features decides as scoring the projected features with W_K
    features = np.vstack([data[0] for data in federation.data.values()])
    projected = (features.astype(np.float64) @ matrix) @ model.coef_
    assert np.array_equal(classifier.decide(classifier.decision_function(features)), projected > 0)
    privacy = classifier.privacy
    assert privacy["projection"]["dim"] == 8 and privacy["projection"]["seed"] == 5
    assert privacy["projection"]["sha256"] == projection_digest(40, 8, 5)
    assert privacy["ridge_kind"] == ridge and privacy["ridge"] == solve.ridge
    assert all(0 < eps <= EPSILON for eps in privacy["epsilon_spent"].values())
    assert any(b["block"] == "eigen" for b in privacy["blocks"]) == eigen
    printed = " ".join(classifier.privacy_lines())  # what `secure-afl predict` prints
    assert "rows projected to K = 8 by the public projection of seed 5 before clipping" in printed
    assert f"({ridge})" in printed


def test_the_study_carries_the_projection_and_refuses_a_bad_one(tmp_path: Path) -> None:
    federation = _private_federation(tmp_path, n_clients=4)
    study = federation.study
    projected = dataclasses.replace(
        study, dp=dataclasses.replace(study.dp, projection_dim=8, projection_seed=3, ridge="adaptive")
    )
    assert Study.from_json(projected.to_json()) == projected
    assert json.loads(projected.to_json())["dp"]["projection_dim"] == 8
    assert "projection_dim" not in json.loads(study.to_json())["dp"]  # today's study keeps its document
    reseeded = dataclasses.replace(projected, dp=dataclasses.replace(projected.dp, projection_seed=4))
    assert reseeded.digest() != projected.digest()  # the session ids commit to K and the seed
    assert noise_plan(projected, 4).blocks[("all", "gram")].dim == 36
    with pytest.raises(ConfigurationError, match="--dp-dim 41 exceeds the feature dimension 40"):
        dataclasses.replace(study, dp=dataclasses.replace(study.dp, projection_dim=41))
    with pytest.raises(ConfigurationError, match=r"--dp-dim .* must be a positive integer, got 0"):
        dataclasses.replace(study, dp=dataclasses.replace(study.dp, projection_dim=0))
    config = {
        "classes": "A,B,C", "dim": 8, "backbone": "toy", "weights-id": "sha256:00", "preprocessing": "none",
        "dp-epsilon": 2.0, "class-lists": "h-a=0,1; h-b=2,1", "dp-dim": 4, "dp-projection-seed": 9,
    }  # fmt: skip
    run_study = study_from_run_config(config)
    assert (run_study.dp.projection_dim, run_study.dp.projection_seed, run_study.dp.ridge) == (
        4,
        9,
        "adaptive",
    )
    assert study_from_run_config({**config, "dp-ridge": "adassp"}).dp.ridge == "adassp"


def test_deploy_local_refuses_dp_dim_without_dp(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from secure_afl.cli import main

    out = ["--out", str(tmp_path / "out")]
    result = CliRunner().invoke(main, ["deploy", "local", "--dp-dim", "16", *out])
    assert result.exit_code == 2 and "--dp-dim shapes the differential-privacy mechanism" in result.output
    assert not (tmp_path / "out").exists()


def test_a_private_deployment_with_positive_sums_and_centred_rows_solves_as_the_simulator_does(
    tmp_path: Path,
) -> None:
    """Through the deployment's server and clients (in process): the study carries class_sums and
    row_centre, each client centres its rows and uploads the positive sums and the total, and the
    classifier equals the simulator's solve of the same noisy uploads, a client killed after its
    upload included."""
    from secure_afl.privacy.dp import POSITIVE_SUM, TOTAL_SUM
    from secure_afl.privacy.dp_solve import fit_private
    from secure_afl.sim.secure import secure_aggregate

    method = Method(balance="global", rounds=1)
    federation = make_federation(tmp_path, n_clients=5, active=ACTIVE, method=method)
    lists = {cid: tuple(data[2]) for cid, data in federation.data.items()}
    dp = StudyDp(epsilon=1.0, clip=4.0, class_lists=lists, class_sums="positives", row_centre=True)
    federation.study = dataclasses.replace(federation.study, dp=dp)
    assert StudyDp.from_dict(dp.to_dict()) == dp and dp.to_dict()["class_sums"] == "positives"
    assert dp.to_dict()["row_centre"] is True
    federation.nodes[1002].dead_from = "s1-R1"
    transport = Capturing(federation)
    server, classifier, _ = run_server(federation, transport)
    study = federation.study
    layout = round1_layout(study)
    assert TOTAL_SUM in layout.groups["all"] and f"{POSITIVE_SUM}/0" in layout.groups["class/0"]
    uploads = {cid: _contributions(flat, layout) for cid, flat in transport.uploads["1"].items()}
    reference = secure_aggregate(
        uploads, threshold=study.threshold_for(5), min_group_size=study.min_group_size,
        dropouts={"R1": ["client-2"]}, frac_bits=study.frac_bits,
    )  # fmt: skip
    plan = noise_plan(study, len(federation.roster))
    model, _, _ = fit_private(
        reference.sums, plan, n_classes=3, gamma=study.method.gamma,
        gram_survivors=len(reference.survivors["all"]),
    )  # fmt: skip
    # the released weights act on the original features: W = (I − 11ᵀ/d) W'
    from secure_afl.deploy.study import dp_projection
    from secure_afl.privacy.projection import lift_weights

    expected = lift_weights(dp_projection(study), model.coef_)
    assert classifier.weights.tobytes() == np.asarray(expected, dtype=np.float64).tobytes()
    np.testing.assert_allclose(classifier.weights.sum(axis=0), 0, atol=1e-9)  # ⊥ the all-ones direction
    assert classifier.privacy is not None and classifier.privacy["class_sums"] == "positives"
    assert classifier.privacy["row_centre"] is True
    printed = " ".join(classifier.privacy_lines())  # what `secure-afl predict` prints
    assert "each row less its own mean first" in printed and "class sums: positives" in printed
    assert max(classifier.privacy["epsilon_spent"].values()) <= 1.0
    assert server.report.sessions[0].survivors == ("client-0", "client-1", "client-3", "client-4")


def test_the_run_config_carries_the_class_sums_and_the_row_centring() -> None:
    config = {
        "classes": "A,B,C", "dim": 8, "backbone": "toy", "weights-id": "sha256:00", "preprocessing": "none",
        "dp-epsilon": 2.0, "class-lists": "h-a=0,1; h-b=2,1", "dp-class-sums": "positives",
        "dp-row-centre": "true",
    }  # fmt: skip
    dp = study_from_run_config(config).dp
    assert dp is not None and dp.class_sums == "positives" and dp.row_centre is True
    assert study_from_run_config({**config, "dp-row-centre": False}).dp.row_centre is False
    with pytest.raises(ConfigurationError, match="dp-row-centre must be true or false"):
        study_from_run_config({**config, "dp-row-centre": "maybe"})
    with pytest.raises(ConfigurationError, match="--dp-class-sums must be one of split, positives"):
        study_from_run_config({**config, "dp-class-sums": "negatives"}).dp.config()
