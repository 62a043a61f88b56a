"""SECURITY.md §3.5, the inventory of server choices: a session whose own parameters are not the
pinned study's is refused in R0 by every node, through the deployment handler
(:func:`secure_afl.deploy.client.handle`) in the in-process federation of tests/deploy/helpers.py.

The study each node checked rides in the envelope unchanged; the server changes only the session:
the envelope's ``backend``, or in the session config the threshold, the minimum group size, the
fractional bits (masking) or the CKKS parameters, each to a value the protocol itself accepts
(above every node's floor).  So only the pin check (``node_backend``,
``_check_protocol_parameters``) stands between the server and an advertisement: each node answers
``StudyMismatchError`` naming both values, keeps no session, and its ledger directory holds only the
study it checked.  The control runs the same script unchanged: the nodes advertise and write their
ledgers in R0.  Last, a pinned study that the node's feature file (``classes``, ``dim``,
``backbone``) or node config (``gram = class`` without ``allow-class-gram``) does not meet."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from secure_afl.deploy.client import CHECKED_STUDY
from secure_afl.deploy.errors import FederationAbortedError
from secure_afl.deploy.server import FederationServer
from secure_afl.deploy.study import Method, StudyDp
from secure_afl.deploy.wire import Envelope
from secure_afl.keys.auditlog import AUDIT_FILE
from secure_afl.protocol.ckks.context import CkksParameters

from .helpers import BACKBONE, Federation, InProcessTransport, make_federation

LIMIT = 1 << 24
META = ("backend", "study-nonce")  # the envelope's; every other change is the session config's


def _federation(tmp_path: Path, protection: str) -> Federation:
    """Four institutions, each missing one class; "dp": masking under the study's DP."""
    federation = make_federation(tmp_path, n_clients=4, dim=6, protection=protection.removesuffix("+dp"))
    if protection.endswith("+dp"):
        lists = {cid: tuple(data[2]) for cid, data in federation.data.items()}
        federation.study = dataclasses.replace(
            federation.study, method=Method(balance="global"), dp=StudyDp(epsilon=1.0, class_lists=lists)
        )
    return federation


class R0Only(InProcessTransport):
    """Delivers R0, rewritten by ``change``, and nothing after it; records each node's ledger
    directory just after R0 (the server then aborts: nobody answers R1)."""

    def __init__(self, federation: Federation, change: dict[str, Any]):
        super().__init__(federation, tamper=self._rewrite)
        self.change = change
        self.ledger_after_r0: dict[int, list[str]] = {}

    def _rewrite(self, node_id: int, group: str, envelope: Envelope) -> Envelope:
        change = dict(self.change)
        meta = {**envelope.meta, **{key: change.pop(key) for key in META if key in change}}
        payload = envelope.payload
        if change:  # the session config's own fields
            backend = self.federation.study.backend(len(self.federation.roster))
            request = backend.decode(payload, LIMIT)
            config = dataclasses.replace(request.config, **change)  # type: ignore[attr-defined]
            payload = backend.encode(dataclasses.replace(request, config=config), LIMIT)
        return Envelope(envelope.kind, meta, payload, envelope.arrays)

    def exchange(self, outgoing, group, timeout):
        if group != "s1-R0":
            return {}
        replies = super().exchange(outgoing, group, timeout)
        for node_id, node in self.federation.nodes.items():
            self.ledger_after_r0[node_id] = sorted(p.name for p in node.settings.ledger_dir.iterdir())
        return replies


def _r0(federation: Federation, change: dict[str, Any]) -> R0Only:
    transport = R0Only(federation, change)
    server = FederationServer(
        transport, federation.roster, federation.study, round_timeout=1, log=lambda s: None,
        signer=federation.signer, colluders=0,
    )  # fmt: skip
    with pytest.raises(FederationAbortedError):
        server.run()
    assert [g for _, g, _ in transport.received] == ["s1-R0"] * len(federation.nodes)
    return transport


def _assert_refused_in_r0(federation: Federation, transport: R0Only, message: str) -> None:
    for node_id, _, reply in transport.received:
        assert reply.kind == "refused" and reply.meta["round"] == "R0", reply.meta
        assert reply.meta["error"] == "StudyMismatchError" and message in str(reply.meta["message"])
        assert reply.payload == b""  # no advertisement, no key
        assert federation.nodes[node_id].state.records == {"1": {"status": "failed: StudyMismatchError"}}
        # Nothing released or answered; the audit log records the refusal.
        assert transport.ledger_after_r0[node_id] == sorted([AUDIT_FILE, CHECKED_STUDY])


MASKING = {  # n = 4: the study's t = 3 (every node's floor), minimum group size 2, 32 fractional bits
    "backend": ({"backend": "ckks"}, "the session runs the 'ckks' protection, but the study says 'mask'"),
    "threshold": (
        {"threshold": 4},
        "the session's threshold t = 4 differs from the study's t = 3 for a 4-institution roster",
    ),
    "min_group_size": (
        {"min_group_size": 3},
        "the session's minimum group size 3 differs from the study's 2",
    ),
    "frac_bits": ({"frac_bits": 30}, "the session encodes with 30 fractional bits, the study with 32"),
}


@pytest.mark.parametrize("field", sorted(MASKING))
def test_a_masking_session_other_than_the_pinned_study_is_refused_in_r0(tmp_path: Path, field: str) -> None:
    federation = make_federation(tmp_path, n_clients=4)
    assert federation.nodes[1000].settings.protections == frozenset({"mask"})
    change, message = MASKING[field]
    _assert_refused_in_r0(federation, _r0(federation, change), message)


CKKS = {
    "parameters": (
        {"parameters": CkksParameters(poly_modulus_degree=16384)},
        "the session's CKKS parameters",
    ),
    "min_group_size": (
        {"min_group_size": 3},
        "the session's minimum group size 3 differs from the study's 2",
    ),
    "backend": ({"backend": "mask"}, "the session runs the 'mask' protection, but the study says 'ckks'"),
}


@pytest.mark.parametrize("field", sorted(CKKS))
def test_a_ckks_session_other_than_the_pinned_study_is_refused_in_r0(tmp_path: Path, field: str) -> None:
    federation = _federation(tmp_path, "ckks")
    change, message = CKKS[field]
    _assert_refused_in_r0(federation, _r0(federation, change), message)


def test_a_dp_session_id_that_does_not_commit_to_the_study_and_its_nonce_is_refused_in_r0(
    tmp_path: Path,
) -> None:
    federation = _federation(tmp_path, "mask+dp")
    message = "the session id does not commit to the study this client received"
    _assert_refused_in_r0(federation, _r0(federation, {"study-nonce": "00" * 32}), message)


@pytest.mark.parametrize("protection", ["mask", "ckks", "mask+dp"])
def test_the_same_script_without_a_change_is_answered_and_written_to_the_ledger_in_r0(
    tmp_path: Path, protection: str
) -> None:
    """The control: the refusals above are the changed field's doing, and the ledger check can fail."""
    federation = _federation(tmp_path, protection)
    transport = _r0(federation, {})
    for node_id, _, reply in transport.received:
        assert reply.kind == "reply" and reply.payload, reply.meta
        assert federation.nodes[node_id].state.records["1"]["status"] == "active"
        assert len(transport.ledger_after_r0[node_id]) > 1  # the release and the R0 answer, recorded


FEATURE_FILE = {  # the study each node checked, which its feature file or node config does not meet
    "classes": ({"classes": ("A", "B", "D")}, "the study's classes ('A', 'B', 'D') differ from this feature"),
    "dim": ({"dim": 41}, "the study expects 41-d features, this feature file has 40"),
    "backbone": (
        {"backbone": {**BACKBONE, "weights_id": "sha256:01"}},
        "the study's backbone weights_id is 'sha256:01', this feature file's is 'sha256:00'",
    ),
    "gram": (
        {"method": Method(gram="class")},
        "this node refuses it unless its node config sets allow-class-gram",
    ),
}


@pytest.mark.parametrize("field", sorted(FEATURE_FILE))
def test_a_pinned_study_the_feature_file_or_node_config_does_not_meet_is_refused_in_r0(
    tmp_path: Path, field: str
) -> None:
    """The node checked (pinned) this study, so only its own file and node config can refuse it:
    ``classes``, ``dim`` and ``backbone`` against the feature file; a per-class Gram without
    ``allow-class-gram``."""
    federation = make_federation(tmp_path, n_clients=4)
    change, message = FEATURE_FILE[field]
    federation.study = dataclasses.replace(federation.study, **change)
    _assert_refused_in_r0(federation, _r0(federation, {}), message)
