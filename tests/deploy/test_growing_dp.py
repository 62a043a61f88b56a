"""A growing federation under differential privacy, through the deployment's handler (in process):
three DP studies, each extending the last; every session's noisy sums add, the chain's solve sizes
its ridge from every session's noise, and the classifier file records every session's ε and the
chain's."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from secure_afl.deploy.classifier import Classifier
from secure_afl.deploy.errors import ConfigurationError
from secure_afl.deploy.server import FederationServer
from secure_afl.deploy.study import Method, StudyDp
from secure_afl.deploy.sums import load_sums, save_sums
from secure_afl.privacy.dp_solve import ridge_for_noise

from .helpers import Federation, InProcessTransport, make_federation
from .test_deploy_dp import Capturing
from .test_growing import _arrive, _pin

ROWS = 60
CLIP = 8.0


def _federation(tmp_path: Path, **dp) -> tuple[Federation, dict]:
    from secure_afl.features.file import load_feature_file

    federation = make_federation(tmp_path, n_clients=4, rows=ROWS, method=Method(balance="global"))
    lists = {cid: tuple(data[2]) for cid, data in federation.data.items()}
    settings = {"epsilon": 2.0, "clip": CLIP, **dp}
    federation.study = dataclasses.replace(federation.study, dp=StudyDp(class_lists=lists, **settings))
    full = {node.client_id: load_feature_file(node.settings.features, require_labels=True) for node in
            federation.nodes.values()}  # fmt: skip
    return federation, full


def _run(federation: Federation, study, earlier=None, transport=None) -> FederationServer:
    _pin(federation, study)
    server = FederationServer(
        transport or InProcessTransport(federation), federation.roster, study, round_timeout=1,
        log=lambda s: None, signer=federation.signer, colluders=0, earlier=earlier,
    )  # fmt: skip
    classifier = server.run()
    server.deliver(classifier)
    server.classifier = classifier  # type: ignore[attr-defined]
    return server


def _inputs(saved: dict, group: str, tensor: str) -> np.ndarray:
    return np.asarray(saved[f"{group}|{tensor}"], dtype=np.float64)


def test_three_dp_sessions_accumulate_their_noisy_sums_and_record_every_epsilon(tmp_path: Path) -> None:
    federation, full = _federation(tmp_path)
    coordinator = tmp_path / "coordinator"
    study, earlier, servers, uploads = federation.study, None, [], []
    # client-3 has no new images in session 2: it still takes part, with zeros plus its noise share
    arrivals = [dict.fromkeys(full, 20), {**dict.fromkeys(full, 40), "client-3": 20}, dict.fromkeys(full, 60)]
    for k, counts in enumerate(arrivals):
        _arrive(federation, full, counts)
        if k:
            study = dataclasses.replace(federation.study, extends=servers[-1].study.digest())
        transport = Capturing(federation)
        server = _run(federation, study, earlier, transport)
        assert server.report.refusals == [] and server.report.rejections == []
        save_sums(coordinator, server.accumulated)
        earlier = load_sums(coordinator, study.digest())
        servers.append(server)
        uploads.append(transport.uploads["1"])
    idle = uploads[1]["client-3"]
    # the idle member's upload is pure noise (not a committed, known zero) ...
    assert np.any(_inputs(idle, "class/0", "pos_sum/0") != 0)
    # ... and the chain's sums are the sum of every session's noisy uploads, exactly
    for group, tensor in (("class/0", "pos_sum/0"), ("class/0", "n_neg/0"), ("class/2", "neg_sum/2")):
        want = sum(
            _inputs(u[cid], group, tensor) for u in uploads for cid in u if f"{group}|{tensor}" in u[cid]
        )
        np.testing.assert_array_equal(earlier.sums[group][tensor].ravel(), want)
    # every chain entry keeps its session's noise record; the chain's ridge uses √(Σ s_k²)
    stds = [entry["dp"]["gram_noise_std"] for entry in earlier.chain]
    assert len(stds) == 3 and all(s > 0 for s in stds)
    last = servers[-1].classifier
    privacy = last.privacy
    growth = privacy["growth"]
    assert math.isclose(growth["gram_noise_std_chain"], math.sqrt(sum(s * s for s in stds)), rel_tol=1e-12)
    assert math.isclose(privacy["gram_noise_std"], growth["gram_noise_std_chain"], rel_tol=1e-12)
    dim = federation.study.dim
    beta = federation.study.dp.config().ridge_failure_probability
    assert math.isclose(
        privacy["ridge"], ridge_for_noise(growth["gram_noise_std_chain"], dim, beta), rel_tol=1e-12
    )
    # the signed file, as every hospital stored it, carries every session's ε and the chain's (= max:
    # the image unit, each image in one session)
    stored = Classifier.from_json(
        (federation.nodes[1000].settings.out_dir / "classifier.json").read_bytes(), roster=federation.roster
    )
    growth = stored.privacy["growth"]
    assert [s["session"] for s in growth["sessions"]] == [1, 2, 3]
    for cid in full:
        per_session = [s["epsilon_spent"][cid] for s in growth["sessions"]]
        assert all(0 < e <= 2.0 for e in per_session)
        assert growth["epsilon_chain"][cid] == max(per_session)
    assert growth["composition"] == "parallel"
    assert [e["dp"]["epsilon_spent"] for e in stored.protocol["growth"]["chain"]] == [
        s["epsilon_spent"] for s in growth["sessions"]
    ]
    assert any("growing chain of 3 DP sessions" in line for line in stored.privacy_lines())


def test_a_chain_mixing_dp_and_exact_sessions_is_refused_before_any_session(tmp_path: Path) -> None:
    federation, full = _federation(tmp_path)
    exact = dataclasses.replace(federation.study, dp=None)
    _arrive(federation, full, dict.fromkeys(full, 30))
    first = _run(federation, exact)
    private = dataclasses.replace(federation.study, extends=exact.digest())
    with pytest.raises(ConfigurationError, match="DP session cannot extend a chain of non-DP"):
        FederationServer(InProcessTransport(federation), federation.roster, private, log=lambda s: None,
                         earlier=first.accumulated)  # fmt: skip
    # and the other way round
    federation2, full2 = _federation(tmp_path / "b")
    _arrive(federation2, full2, dict.fromkeys(full2, 30))
    dp_first = _run(federation2, federation2.study)
    assert "dp" in dp_first.accumulated.chain[0]
    plain = dataclasses.replace(federation2.study, dp=None, extends=federation2.study.digest())
    with pytest.raises(ConfigurationError, match="non-DP session cannot extend a chain of DP"):
        FederationServer(InProcessTransport(federation2), federation2.roster, plain, log=lambda s: None,
                         earlier=dp_first.accumulated)  # fmt: skip
