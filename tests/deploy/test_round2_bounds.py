"""Round 2 under the deployment policy: no lever, then bounded where a node opts in.  A scripted
hostile server over the real deployment handler (``secure_afl.deploy.client.handle``), co-signed
rosters, pinned studies and FileLedgers, at the deployment's defaults (t = floor(2n/3) + 1, c = n - t).

0. No lever (SECURITY.md §3.6): round 2's uploads are a function of the node's data that the
   coordinator picks (the teacher W).  A node that declares nothing of its coordinator refuses a
   two-round study in R0, whatever W, before its feature file is read, and writes no ledger entry;
   ``deploy check --study`` and ``deploy local --rounds 2`` refuse it the same way and say how to opt in.
Under the opt-in (node config coordinator = "honest-but-curious"), the node's own checks still run:
1. Equal teacher columns (no colluder): peers missing both classes upload one vector under two
   names, and S(pseudo/0) - S(pseudo/1) would be the victim's value; the victim refuses in R1.
2. A round 2 nobody agreed to: every node pinned a one-round study; a session labelled 2 is
   refused in R0 by every node, before anything is computed.
3. Predictable zeros: two members too small to qualify for any pseudo-label upload zeros whatever
   W; a pseudo group {victim, those two} is refused in R1.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from secure_afl.analytic import PseudoLabelConfig, pseudo_label_contributions
from secure_afl.deploy.client import handle
from secure_afl.deploy.study import Method, Study, round2_layout, round2_row_floors
from secure_afl.deploy.wire import Envelope, from_record_dict, to_record_dict
from secure_afl.features.file import save_feature_file
from secure_afl.privacy.ledger import FileLedger, LedgerOwner
from secure_afl.protocol import codec
from secure_afl.protocol.messages import ShareKeys

from .helpers import BACKBONE, CLASSES, check_study, make_federation, pixel_digests, row_digests
from .test_deploy_one_view import hostile_session

# Finding 1 (n = 9, t = 7, c = 2): the victim misses class 0 only; four peers miss classes 0 and 1
# (the members of pseudo/1, c + 2 of them); four label every class.  pseudo/0 = victim + peers.
VICTIM = "client-0"
PEERS = ("client-1", "client-2", "client-3", "client-4")
EQUAL_ACTIVE = {VICTIM: (1, 2), **dict.fromkeys(PEERS, (2,))}
EQUAL_ACTIVE.update({f"client-{k}": (0, 1, 2) for k in range(5, 9)})
METHOD = Method(rounds=2, min_pos=1, min_neg=1)


def _wired(envelope: Envelope) -> Envelope:
    return from_record_dict(to_record_dict(envelope))


def _teacher(study: Study, seed: int = 42) -> np.ndarray:
    """A teacher whose scores spread both ways over the fixture's rows (positive features with
    equal means: columns orthogonal to the all-ones direction), so every node has pseudo-positives
    and pseudo-negatives."""
    w = np.random.default_rng(seed).normal(size=(study.dim, len(study.classes)))
    return w - w.mean(axis=0, keepdims=True)


def _pseudo(federation, cid: str, w: np.ndarray) -> dict[str, np.ndarray]:
    """What node ``cid`` would upload in round 2 under teacher ``w`` (group -> its b_pseudo)."""
    features, _, active = federation.data[cid]
    m = federation.study.method
    config = PseudoLabelConfig(tau=m.tau, alpha=m.alpha, min_pos=m.min_pos, min_neg=m.min_neg)
    out, _ = pseudo_label_contributions(features, w, active, config=config, device="cpu")
    return {g: next(iter(t.values())) for g, t in out.items()}


def _assert_only_refusals(federation, r1: Mapping[str, Envelope], refusing: Mapping[str, str], label: str):
    """``refusing``: client -> the error it answers in R1; every other node goes on (its shares)."""
    ids = {node.client_id: node for node in federation.nodes.values()}
    for cid, reply in r1.items():
        if cid in refusing:
            assert reply.kind == "refused", (cid, reply.meta)
            assert reply.meta["error"] == refusing[cid] and reply.meta["round"] == "R1", reply.meta
            assert reply.payload == b""  # no encrypted share, so no masked input can follow
            assert ids[cid].state.load(label) == {"status": f"failed: {refusing[cid]}"}  # secrets gone
        else:
            assert reply.kind == "reply", (cid, reply.meta)


# --- 0: no lever -------------------------------------------------------------------------------------


def _hostile_teachers(study: Study) -> dict[str, np.ndarray]:
    """Teachers an active coordinator would send: each makes some group sum one hospital's value
    (SECURITY.md §3.6; the node refuses without looking at W, so none of them is special here)."""
    w = _teacher(study)
    equal = w.copy()
    equal[:, 1] = equal[:, 0]  # peers missing classes 0 and 1 upload one vector under two names
    rare = w.copy()
    rare[:, 2] = 1e-3 * w[:, 2]  # scores near 0.5: no pseudo-label qualifies, peers upload zeros
    cancel = w.copy()
    cancel[:, 2] = -1e4 * w[:, 0]  # round 2's class 2 is round 1's class 0 with the labels swapped
    return {"random": w, "equal columns": equal, "rare positives": rare, "negated round-1 column": cancel}


@pytest.mark.parametrize("protection", ["mask", "ckks"])
@pytest.mark.parametrize("label", ["1", "2"])
def test_a_two_round_study_is_refused_in_r0_whatever_the_teacher_by_a_node_that_declares_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, protection: str, label: str
) -> None:
    """Every node at the default (coordinator = "active"), each having pinned the two-round study:
    every hostile teacher, in round 2 or already in the study's round 1, is refused in R0 with
    CoordinatorChoiceRefusedError; no advertisement, no feature file read, no ledger session."""
    import secure_afl.features.file as feature_files

    federation = make_federation(
        tmp_path, n_clients=6, method=METHOD, protection=protection, colluders=None, coordinator="active"
    )
    check_study(federation)  # pinned directly: `deploy check --study` itself refuses it (below)
    read: list[Path] = []
    original = feature_files.load_feature_file
    monkeypatch.setattr(
        feature_files, "load_feature_file", lambda path, **kw: read.append(path) or original(path, **kw)
    )
    study = federation.study
    backend = study.backend(len(federation.roster))
    for name, w in _hostile_teachers(study).items():
        layout = round2_layout(study, [0, 1, 2])
        server = backend.server_session(
            federation.roster, layout, session_id=bytes([len(name)]) * 32, min_group_size=study.min_group_size
        )
        first = backend.encode(server.start(), server.max_message_bytes)
        for node in federation.nodes.values():
            node.state.records.clear()
            meta = {"session": label, "study": study.to_json(), "roster": federation.roster.fingerprint,
                    "backend": backend.name, "round": "R0"}  # fmt: skip
            arrays = {"coef": w} if label == "2" else {}
            reply = _wired(
                handle(_wired(Envelope("advertise", meta, first, arrays)), node.state, node.settings)
            )
            assert reply.kind == "refused", (name, reply.meta)
            assert reply.meta["error"] == "CoordinatorChoiceRefusedError" and reply.meta["round"] == "R0"
            assert 'coordinator="honest-but-curious"' in reply.meta["message"]  # how to opt in
            assert reply.payload == b""
            assert node.state.load(label) == {"status": "failed: CoordinatorChoiceRefusedError"}
            owner = LedgerOwner(node.client_id, federation.identities[node.client_id])
            assert FileLedger(node.settings.ledger_dir).load(owner).sessions == {}
    assert read == []  # refused before the node read its images' features


def test_a_round1_session_carrying_an_array_it_does_not_use_is_refused_in_r0(tmp_path: Path) -> None:
    """Another lever closed: the advertisement signs every array the server sent, so a round-1
    session with a teacher attached (or any array) is refused before anything is signed."""
    federation = make_federation(tmp_path, n_clients=4, method=Method(rounds=1))
    check_study(federation)
    study = federation.study
    backend = study.backend(len(federation.roster))
    server = backend.server_session(
        federation.roster, round2_layout(study, [0]), session_id=b"\x11" * 32, min_group_size=2
    )
    first = backend.encode(server.start(), server.max_message_bytes)
    for node in federation.nodes.values():
        meta = {"session": "1", "study": study.to_json(), "roster": federation.roster.fingerprint,
                "backend": backend.name, "round": "R0"}  # fmt: skip
        envelope = Envelope("advertise", meta, first, {"coef": _teacher(study)})
        reply = _wired(handle(_wired(envelope), node.state, node.settings))
        assert reply.kind == "refused" and reply.meta["error"] == "CoordinatorChoiceRefusedError"
        assert "['coef']" in reply.meta["message"] and reply.payload == b""
        owner = LedgerOwner(node.client_id, federation.identities[node.client_id])
        assert FileLedger(node.settings.ledger_dir).load(owner).sessions == {}


def test_deploy_check_refuses_a_two_round_study_unless_the_node_declares_an_honest_coordinator(
    tmp_path: Path,
) -> None:
    """The check a hospital runs before it pins a study is the R0 rule (one function decides both),
    and the node config's ``coordinator`` takes only the two models."""
    import dataclasses

    from secure_afl.deploy.client import NodeSettings, check_node_study
    from secure_afl.deploy.errors import ConfigurationError, CoordinatorChoiceRefusedError

    federation = make_federation(tmp_path, n_clients=4, method=METHOD, coordinator="active")
    settings = next(iter(federation.nodes.values())).settings
    with pytest.raises(CoordinatorChoiceRefusedError, match="round 2's pseudo-labels"):
        check_node_study(federation.study, settings)
    one_round = dataclasses.replace(federation.study, method=Method(rounds=1, min_pos=1, min_neg=1))
    check_node_study(one_round, settings)  # one round: nothing the coordinator chooses
    declared = dataclasses.replace(settings, coordinator="honest-but-curious")
    assert check_node_study(federation.study, declared).dim == federation.study.dim
    config = {"identity-key": "k", "passphrase-file": "p", "roster": "r", "features": "f",
              "ledger-dir": "l", "out-dir": "o"}  # fmt: skip
    assert NodeSettings.from_node_config(config).coordinator == "active"
    parsed = NodeSettings.from_node_config({**config, "coordinator": "honest-but-curious"})
    assert parsed.coordinator == "honest-but-curious"
    with pytest.raises(ConfigurationError, match="coordinator='trusted'"):
        NodeSettings.from_node_config({**config, "coordinator": "trusted"})


def test_deploy_local_rounds_2_says_why_and_how_to_opt_in_before_starting_anything(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from secure_afl.cli import main

    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["deploy", "local", "--rounds", "2", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert "teacher W the coordinator sends" in result.output
    assert "--coordinator honest-but-curious" in result.output
    assert not out.exists()  # nothing started, nothing written


def test_under_the_opt_in_every_session_records_the_declaration_and_the_classifier_says_so(
    tmp_path: Path,
) -> None:
    """A two-round federation of nodes that declared an honest-but-curious coordinator: each node's
    ledger keeps the declaration with both sessions (their scope), and the classifier's audit names
    the trust round 2 ran under."""
    from .helpers import run_server

    active = {"client-0": (1, 2), "client-1": (1, 2), "client-2": (0, 1, 2), "client-3": (0, 1, 2)}
    federation = make_federation(tmp_path, n_clients=4, active=active, method=METHOD)  # opts in
    _, classifier, _ = run_server(federation)
    assert [s["label"] for s in classifier.sessions] == ["1", "2"]
    for node in federation.nodes.values():
        owner = LedgerOwner(node.client_id, federation.identities[node.client_id])
        scopes = sorted(e.scope for e in FileLedger(node.settings.ledger_dir).load(owner).sessions.values())
        digest = federation.study.digest()
        assert scopes == [f"study:{digest}/round:{r}/coordinator:honest-but-curious" for r in ("1", "2")]
    assert any("honest-but-curious" in w and "round 2" in w for w in classifier.audit["warnings"])


# --- finding 1: equal teacher columns ------------------------------------------------------------


@pytest.mark.parametrize("spread", [0.0, 1e-3], ids=["equal", "0.1% apart"])
def test_equal_teacher_columns_are_refused_by_the_victim_in_r1(tmp_path: Path, spread: float) -> None:
    federation = make_federation(tmp_path, n_clients=9, active=EQUAL_ACTIVE, method=METHOD, colluders=None)
    w = _teacher(federation.study)
    w[:, 1] = w[:, 0] * (1 + spread)
    # The premise on these nodes' own rows: peers' two uploads are one vector (to 0.1 %: the same sets).
    for cid in PEERS:
        values = _pseudo(federation, cid, w)
        np.testing.assert_array_equal(values["pseudo/0"], values["pseudo/1"])
    victim = _pseudo(federation, VICTIM, w)["pseudo/0"]
    assert np.any(victim != 0)  # the victim qualified: its value is its data's
    s0 = victim + sum(_pseudo(federation, cid, w)["pseudo/0"] for cid in PEERS)
    s1 = sum(_pseudo(federation, cid, w)["pseudo/1"] for cid in PEERS)
    np.testing.assert_allclose(s0 - s1, victim, rtol=0, atol=1e-12)
    _, r1 = hostile_session(
        federation,
        "2",
        round2_layout(federation.study, [0, 1]),
        study_of=lambda cid: federation.study,
        arrays_of=lambda cid: {"coef": w},
    )
    # The victim refuses, and so does every peer: its own check sees the victim's value determined
    # (a peer's two names are one unknown; the victim's alone is in pseudo/0).  The four nodes
    # in no pseudo group send nothing of their own and go on.
    _assert_only_refusals(federation, r1, dict.fromkeys((VICTIM, *PEERS), "ExposureRefusedError"), "2")
    for k in range(5, 9):
        assert isinstance(codec.decode(r1[f"client-{k}"].payload), ShareKeys)


def test_equal_teacher_columns_under_ckks_are_refused_by_the_victim_in_r1(tmp_path: Path) -> None:
    """CKKS: the same sums to 5e-8; the victim's own check (the one exposure check) refuses in R1,
    before the key holder's key or any ciphertext of its value exists."""
    active = {VICTIM: (1, 2), "client-1": (2,), "client-2": (2,), "client-3": (2,), "client-4": (0, 1, 2)}
    federation = make_federation(
        tmp_path, n_clients=5, active=active, method=METHOD, protection="ckks", colluders=None
    )
    w = _teacher(federation.study)
    w[:, 1] = w[:, 0]
    _, r1 = hostile_session(
        federation,
        "2",
        round2_layout(federation.study, [0, 1]),
        study_of=lambda cid: federation.study,
        arrays_of=lambda cid: {"coef": w},
    )
    _assert_only_refusals(
        federation,
        r1,
        dict.fromkeys((VICTIM, "client-1", "client-2", "client-3"), "ExposureRefusedError"),
        "2",
    )


# --- finding 2: a round 2 nobody agreed to ---------------------------------------------------------


@pytest.mark.parametrize("protection", ["mask", "ckks"])
def test_a_round2_session_against_a_one_round_study_is_refused_in_r0(tmp_path: Path, protection: str) -> None:
    federation = make_federation(
        tmp_path, n_clients=4, method=Method(rounds=1, min_pos=1, min_neg=1), protection=protection
    )
    check_study(federation)  # every node pinned the one-round study
    study = federation.study
    backend = study.backend(len(federation.roster))
    server = backend.server_session(
        federation.roster, round2_layout(study, [0, 1, 2]), session_id=b"\x42" * 32,
        min_group_size=study.min_group_size,
    )  # fmt: skip
    first = backend.encode(server.start(), server.max_message_bytes)
    w = _teacher(study)
    w[:, 1] = w[:, 0]
    for node in federation.nodes.values():
        meta = {"session": "2", "study": study.to_json(), "roster": federation.roster.fingerprint,
                "backend": backend.name, "round": "R0"}  # fmt: skip
        reply = _wired(
            handle(_wired(Envelope("advertise", meta, first, {"coef": w})), node.state, node.settings)
        )
        assert reply.kind == "refused", reply.meta
        assert reply.meta["error"] == "RoundNotInStudyError" and reply.meta["round"] == "R0"
        assert reply.payload == b""  # no advertisement: nothing was computed, nothing left
        assert node.state.load("2") == {"status": "failed: RoundNotInStudyError"}
        # The node's ledger records no session at all (nothing reached the release point).
        owner = LedgerOwner(node.client_id, federation.identities[node.client_id])
        assert FileLedger(node.settings.ledger_dir).load(owner).sessions == {}


def test_an_unknown_session_label_is_refused_in_r0(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=4, method=METHOD)
    check_study(federation)
    node = next(iter(federation.nodes.values()))
    meta = {"session": "3", "study": federation.study.to_json(), "roster": federation.roster.fingerprint,
            "backend": "mask", "round": "R0"}  # fmt: skip
    reply = handle(Envelope("advertise", meta, b"", {}), node.state, node.settings)
    assert reply.kind == "refused" and reply.meta["error"] == "RoundNotInStudyError"


# --- finding 3: predictable zeros --------------------------------------------------------------------

# n = 5, t = 4, c = 1: pseudo/0 = {victim, small-1, small-2} has c + 2 members, but the two small
# members cannot qualify for a pseudo-label (fewer rows than min_pos + min_neg = 2): their zeros are
# a function of their signed counts, and the group's sum is the victim's value.
SMALL = ("client-1", "client-2")
ZERO_ACTIVE = {
    VICTIM: (1, 2),
    "client-1": (1, 2),
    "client-2": (1, 2),
    "client-3": (0, 1, 2),
    "client-4": (0, 1, 2),
}


def _shrink(federation, cid: str, rows: int) -> None:
    """Rewrite node ``cid``'s feature file with only its first ``rows`` rows."""
    node = next(n for n in federation.nodes.values() if n.client_id == cid)
    features, labels, active = federation.data[cid]
    features, labels = features[:rows], labels[:rows]
    save_feature_file(
        node.settings.features, features, labels=labels, active=active, classes=CLASSES,
        backbone=BACKBONE["name"], weights_id=BACKBONE["weights_id"], preprocessing=BACKBONE["preprocessing"],
        image_sha256=row_digests(f"small/{cid}", rows),
        pixel_sha256=pixel_digests(row_digests(f"small/{cid}", rows)),
    )  # fmt: skip
    federation.data[cid] = (features, labels, active)


@pytest.mark.parametrize("protection", ["mask", "ckks"])
def test_a_pseudo_group_completed_by_members_too_small_to_qualify_is_refused_in_r1(
    tmp_path: Path, protection: str
) -> None:
    federation = make_federation(
        tmp_path, n_clients=5, active=ZERO_ACTIVE, method=METHOD, protection=protection, colluders=None
    )
    floor = round2_row_floors(federation.study)["b_pseudo/0"]
    assert floor == 2  # min_pos + min_neg (τ = 0.7 >= 0.5: the two sets are disjoint)
    for cid in SMALL:
        _shrink(federation, cid, floor - 1)
    # The premise: whatever W, the small members upload zeros (so the sum is the victim's value).
    for seed in range(5):
        w = _teacher(federation.study, seed)
        for cid in SMALL:
            assert not np.any(_pseudo(federation, cid, w)["pseudo/0"])
    _, r1 = hostile_session(
        federation,
        "2",
        round2_layout(federation.study, [0]),
        study_of=lambda cid: federation.study,
        arrays_of=lambda cid: {"coef": _teacher(federation.study)},
    )
    # Every member of pseudo/0 refuses: with the two known zeros out, one member has rows (c + 2 = 3).
    refusing = dict.fromkeys((VICTIM, *SMALL), "IncrementTooSmallError")
    _assert_only_refusals(federation, r1, refusing, "2")


def test_members_at_the_qualifying_floor_are_not_known(tmp_path: Path) -> None:
    """The control: the same layout with the two members at exactly min_pos + min_neg rows (they may
    qualify: their value is not a function of their count) goes on."""
    federation = make_federation(tmp_path, n_clients=5, active=ZERO_ACTIVE, method=METHOD, colluders=None)
    for cid in SMALL:
        _shrink(federation, cid, round2_row_floors(federation.study)["b_pseudo/0"])
    _, r1 = hostile_session(
        federation,
        "2",
        round2_layout(federation.study, [0]),
        study_of=lambda cid: federation.study,
        arrays_of=lambda cid: {"coef": _teacher(federation.study)},
    )
    _assert_only_refusals(federation, r1, {}, "2")


def test_a_coordinators_kit_cannot_declare_the_honest_coordinator_for_a_hospital(tmp_path: Path) -> None:
    """The declaration is the hospital's alone: `deploy join` writes the node config from the
    hospital's own options, so a kit whose node-config.toml the coordinator wrote with the
    declaration still refuses a two-round study; the hospital's own `--set` opts in."""
    import shutil

    from .test_provision import HOSPITALS, _invoke, _join, _site

    sites = {cid: _site(tmp_path, cid) for cid in HOSPITALS}
    coordinator = _site(tmp_path, "coordinator")
    out = tmp_path / "coordinator" / "fed"
    code, output = _invoke(
        "provision", "--federation-dir", out, *(a for s in sites.values() for a in ("--hospital", s.keys)),
        "--key-dir", coordinator.keys, "--passphrase-file", coordinator.passfile, "--ip", "127.0.0.1",
        "--port", "9092", "--features", sites["hospital-a"].features, "--rounds", "2",
        "--set", "colluders=0", "--yes",
    )  # fmt: skip
    assert code == 0, output
    site = sites["hospital-a"]
    shutil.copytree(out / "kits" / site.client_id, site.kit)
    written = site.kit / "node-config.toml"
    assert "coordinator" not in written.read_text()  # provision never declares it
    written.write_text(written.read_text() + 'coordinator = "honest-but-curious"\n')  # the kit's author tries
    code, output = _join(site)
    assert code == 1 and "CoordinatorChoiceRefusedError" in output, output
    code, output = _join(site, "--set", "coordinator=honest-but-curious")
    assert code == 3, output  # the study is accepted; it waits for the others' co-signatures
    assert 'coordinator = "honest-but-curious"' in written.read_text()
