"""One view through the real deployment handler (``secure_afl.deploy.client.handle``): a scripted
hostile server shows the nodes different sessions, or raises t, or sends a weak DP study; each
recovery ends with a node refusing before anything that completes it leaves (SECURITY.md, "One
view").  The protocol-level versions are in tests/protocol/test_one_view.py.

Attacks tested here: round 2's teacher and study shown differently, a raised t against the colluder
bound, and a study's DP δ above the node's floor, each in the round, with the error class, the
node's state and its replies.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pytest

from secure_afl.deploy.client import DEFAULT_DP_DELTA_FLOOR, _check_dp_policy, handle
from secure_afl.deploy.errors import FederationAbortedError, StudyMismatchError
from secure_afl.deploy.study import Method, Study, StudyDp, round1_layout, round2_layout, session_context
from secure_afl.deploy.wire import Envelope, from_record_dict, to_record_dict
from secure_afl.protocol import codec
from secure_afl.protocol.ckks.messages import CkksAdvertise, CkksKeyRequest
from secure_afl.protocol.messages import AdvertiseKeys, ShareKeys, ShareKeysRequest

from .helpers import InProcessTransport, check_study, make_federation, run_server

# Class 0 is missing at three of four institutions: round 2's group pseudo/0 = {client-0..2}.
ACTIVE = {"client-0": (1, 2), "client-1": (1, 2), "client-2": (1, 2), "client-3": (0, 1, 2)}
VICTIM = "client-0"


def _through_records(envelope: Envelope) -> Envelope:
    return from_record_dict(to_record_dict(envelope))


def _node_ids(federation) -> dict[str, int]:
    return {node.client_id: node_id for node_id, node in federation.nodes.items()}


def hostile_session(
    federation,
    label: str,
    layout,
    *,
    study_of: Callable[[str], Study],
    arrays_of: Callable[[str], Mapping[str, np.ndarray]],
    session_id: bytes = b"\x27" * 32,
) -> tuple[dict[str, Envelope], dict[str, Envelope]]:
    """R0 to every node (its own study and arrays), then R1 with *every* advertisement it got, as a
    server that relays whatever each node signed.  Returns each node's R0 and R1 replies."""
    study = federation.study
    backend = study.backend(len(federation.roster))
    server = backend.server_session(
        federation.roster, layout, session_id=session_id, min_group_size=study.min_group_size
    )
    first = backend.encode(server.start(), server.max_message_bytes)
    # The strongest server also showed each hospital's IT, at `deploy check`, the study it shows
    # that node here: each node's pin matches what it is sent, so only the one-view rule is left.
    for node_id, node in federation.nodes.items():
        check_study(federation, study_of(node.client_id), nodes=[node_id])
    r0: dict[str, Envelope] = {}
    adverts = []
    for node in federation.nodes.values():
        meta = {
            "session": label,
            "study": study_of(node.client_id).to_json(),
            "roster": federation.roster.fingerprint,
            "backend": backend.name,
            "round": "R0",
        }
        envelope = _through_records(Envelope("advertise", meta, first, dict(arrays_of(node.client_id))))
        r0[node.client_id] = reply = _through_records(handle(envelope, node.state, node.settings))
        assert reply.kind == "reply", reply.meta  # R0 reveals nothing: every node advertises its keys
        advert = backend.decode(reply.payload, server.max_message_bytes)
        assert isinstance(advert, (AdvertiseKeys, CkksAdvertise))
        adverts.append(advert)
    relayed = tuple(sorted(adverts, key=lambda a: a.client_id))
    keys = ShareKeysRequest if backend.name == "mask" else CkksKeyRequest
    request = backend.encode(keys(session_id, relayed), server.max_message_bytes)
    r1 = {}
    for node in federation.nodes.values():
        envelope = _through_records(Envelope("protocol", {"session": label, "round": "R1"}, request))
        r1[node.client_id] = _through_records(handle(envelope, node.state, node.settings))
    return r0, r1


def assert_refused_in_r1(federation, r1: Mapping[str, Envelope], label: str, error: str) -> None:
    for cid, reply in r1.items():
        assert reply.kind == "refused" and reply.meta["error"] == error, (cid, reply.meta)
        assert reply.meta["round"] == "R1" and reply.payload == b""  # no encrypted share left it
        state = federation.nodes[_node_ids(federation)[cid]].state
        assert state.load(label) == {"status": f"failed: {error}"}  # its session secrets are gone


def _round2_federation(tmp_path: Path, protection: str = "mask"):
    method = Method(rounds=2, min_pos=1, min_neg=1)
    return make_federation(tmp_path, n_clients=4, active=ACTIVE, method=method, protection=protection)


def _teacher(federation) -> np.ndarray:
    return np.random.default_rng(27).normal(size=(federation.study.dim, len(federation.study.classes)))


# --- round 2's teacher W and the study ------------------------------------------------------------


@pytest.mark.parametrize("protection", ["mask", "ckks"])
def test_round2_teacher_shown_1000_fold_to_the_victim_and_zero_to_its_peers_is_refused_in_r1(
    tmp_path: Path, protection: str
) -> None:
    federation = _round2_federation(tmp_path, protection)
    w = _teacher(federation)
    _, r1 = hostile_session(
        federation,
        "2",
        round2_layout(federation.study, [0]),
        study_of=lambda cid: federation.study,
        arrays_of=lambda cid: {"coef": 1000.0 * w if cid == VICTIM else 0.0 * w},
    )
    assert_refused_in_r1(federation, r1, "2", "DifferentSessionViewError")


def test_round2_pseudo_label_parameters_shown_differently_are_refused_in_r1(tmp_path: Path) -> None:
    federation = _round2_federation(tmp_path)
    w = _teacher(federation)
    strict = dataclasses.replace(federation.study.method, min_pos=10**9)  # no peer qualifies: zeros
    _, r1 = hostile_session(
        federation,
        "2",
        round2_layout(federation.study, [0]),
        study_of=lambda cid: (
            federation.study if cid == VICTIM else dataclasses.replace(federation.study, method=strict)
        ),
        arrays_of=lambda cid: {"coef": w},
    )
    assert_refused_in_r1(federation, r1, "2", "DifferentSessionViewError")


@pytest.mark.parametrize("protection", ["mask", "ckks"])
def test_round2_shown_alike_to_every_node_goes_on_through_the_same_script(
    tmp_path: Path, protection: str
) -> None:
    """The control: the same W and study for everyone, the same hostile script: every node goes on
    in R1 (masking: its encrypted shares; CKKS: the key holder its key, the others an empty
    answer), so the refusals above are the view's doing, nothing else."""
    federation = _round2_federation(tmp_path, protection)
    w = _teacher(federation)
    _, r1 = hostile_session(
        federation,
        "2",
        round2_layout(federation.study, [0]),
        study_of=lambda cid: federation.study,
        arrays_of=lambda cid: {"coef": w},
    )
    for cid, reply in r1.items():
        assert reply.kind == "reply", (cid, reply.meta)
        if protection == "mask":
            assert isinstance(codec.decode(reply.payload), ShareKeys)
    if protection == "ckks":
        assert sum(1 for reply in r1.values() if reply.payload) == 1  # the key holder's key


def test_the_session_context_is_the_studys_canonical_document_round_and_arrays(tmp_path: Path) -> None:
    """The server binds what it sent, each node what it received (the honest round-2 runs of
    tests/deploy/test_federation.py pass only if the two agree: the server checks every digest)."""
    federation = _round2_federation(tmp_path)
    w = _teacher(federation)
    ones = session_context(federation.study, "2", {"coef": w})
    assert ones == session_context(Study.from_json(federation.study.to_json()), "2", {"coef": w.copy()})
    assert ones != session_context(federation.study, "1", {"coef": w})
    assert ones != session_context(federation.study, "2", {"coef": w, "extra": np.zeros(1)})
    dp = _dp_study(federation)
    assert session_context(dp, "2", {"coef": w}) != session_context(
        dataclasses.replace(dp, dp=dataclasses.replace(dp.dp, delta=1e-7)), "2", {"coef": w}
    )


# --- other attempts: a different study in round 1 --------------------------------------------------


@pytest.mark.parametrize(
    "change",
    [{"alpha": 0.25}, {"gamma": 2.0}, {"rounds": 2}],
    ids=["round-2 alpha", "ridge", "rounds count"],
)
def test_a_round1_study_shown_differently_to_one_node_is_refused_in_r1(tmp_path: Path, change) -> None:
    # Nodes that declared an honest-but-curious coordinator (else the victim refuses the two-round
    # study in R0 already, SECURITY.md §3.6): one view is what refuses here.
    federation = make_federation(tmp_path, n_clients=4, coordinator="honest-but-curious")
    other = dataclasses.replace(
        federation.study, method=dataclasses.replace(federation.study.method, **change)
    )
    _, r1 = hostile_session(
        federation,
        "1",
        round1_layout(federation.study),
        study_of=lambda cid: other if cid == VICTIM else federation.study,
        arrays_of=lambda cid: {},
    )
    assert_refused_in_r1(federation, r1, "1", "DifferentSessionViewError")


def test_a_study_other_than_the_checked_one_is_refused_in_r0_by_the_pin(tmp_path: Path) -> None:
    """The layer before the one view: a node that checked the federation's study (deploy check
    --study) refuses another one in R0, before it advertises any key."""
    federation = make_federation(tmp_path, n_clients=4)
    check_study(federation)
    other = dataclasses.replace(
        federation.study, method=dataclasses.replace(federation.study.method, gamma=1000.0)
    )
    node = next(n for n in federation.nodes.values() if n.client_id == VICTIM)
    backend = other.backend(len(federation.roster))
    server = backend.server_session(
        federation.roster, round1_layout(other), session_id=b"\x28" * 32, min_group_size=other.min_group_size
    )
    meta = {"session": "1", "study": other.to_json(), "roster": federation.roster.fingerprint,
            "backend": backend.name, "round": "R0"}  # fmt: skip
    first = backend.encode(server.start(), server.max_message_bytes)
    reply = handle(_through_records(Envelope("advertise", meta, first, {})), node.state, node.settings)
    assert reply.kind == "refused" and reply.meta["error"] == "UncheckedStudyError"
    assert reply.payload == b"" and node.state.load("1") == {"status": "failed: UncheckedStudyError"}


# --- the server raises t, the colluder bound must not fall ----------------------------------------

PAIR = {"client-0": (0, 1, 2), "client-1": (0, 1, 2), "client-2": (1, 2), "client-3": (1, 2)}


@pytest.mark.parametrize("threshold", [3, 4])
def test_a_study_threshold_of_n_does_not_drop_the_colluder_bound(tmp_path: Path, threshold: int) -> None:
    """n = 4 and class 0 labelled by client-0 and client-1 only.  Each node's floor is t = 3, so it
    assumes c = 1 colluder whatever the study's t: the pair group is refused in R1 at t = 4 as at
    t = 3 (before, t = 4 gave c = 0 and the colluder subtracted its own value from the sum)."""
    federation = make_federation(tmp_path, n_clients=4, active=PAIR, colluders=None)
    federation.study = dataclasses.replace(federation.study, threshold=threshold)
    transport = InProcessTransport(federation)
    with pytest.raises(FederationAbortedError):
        run_server(federation, transport)
    ids = _node_ids(federation)
    for cid in ("client-0", "client-1"):
        replies = [(g, r) for n, g, r in transport.received if n == ids[cid]]
        assert [g for g, _ in replies] == ["s1-R0", "s1-R1"]  # nothing asked of it after
        (_, r1) = replies[1]
        assert r1.kind == "refused" and r1.meta["error"] == "ColluderExposureRefusedError"
        assert r1.payload == b""
        assert federation.nodes[ids[cid]].state.load("1") == {
            "status": "failed: ColluderExposureRefusedError"
        }


# --- DP floors ------------------------------------------------------------------------------------


def _dp_study(federation, **dp) -> Study:
    lists = {cid: tuple(d[2]) for cid, d in federation.data.items()}
    return dataclasses.replace(
        federation.study,
        method=Method(balance="global"),
        dp=StudyDp(epsilon=1.0, class_lists=lists, clip=8.0, **dp),
    )


def test_a_node_with_dp_epsilon_and_no_dp_delta_refuses_a_study_with_delta_near_one(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=4)
    federation.study = _dp_study(federation, delta=0.999999)
    node = federation.nodes[1001]
    node.settings = dataclasses.replace(node.settings, dp_epsilon=1.0)  # dp-delta unset
    transport = InProcessTransport(federation)
    with contextlib.suppress(FederationAbortedError):  # what matters is what node 1001 sent
        run_server(federation, transport)
    replies = [(g, r) for n, g, r in transport.received if n == 1001]
    assert [g for g, _ in replies] == ["s1-R0"]
    (_, reply) = replies[0]
    assert reply.kind == "refused" and reply.meta["error"] == "StudyMismatchError"
    assert "default δ floor" in str(reply.meta["message"]) and reply.payload == b""
    assert node.state.load("1") == {"status": "failed: StudyMismatchError"}


def test_the_default_delta_floor_accepts_the_studys_default_delta_and_refuses_above(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=4)
    settings = dataclasses.replace(federation.nodes[1000].settings, dp_epsilon=1.0)
    assert DEFAULT_DP_DELTA_FLOOR == StudyDp.__dataclass_fields__["delta"].default == 1e-6
    _check_dp_policy(_dp_study(federation), settings)  # δ = 1e-6: accepted
    _check_dp_policy(_dp_study(federation, delta=1e-9), settings)
    with pytest.raises(StudyMismatchError, match="default δ floor"):
        _check_dp_policy(_dp_study(federation, delta=2e-6), settings)
    with pytest.raises(StudyMismatchError, match="takes part only under differential privacy"):
        _check_dp_policy(federation.study, settings)  # a node asking for DP refuses a study without it
    explicit = dataclasses.replace(settings, dp_delta=1e-3)  # its own, looser choice, said explicitly
    _check_dp_policy(_dp_study(federation, delta=1e-4), explicit)
