"""CKKS decryptors shown different survivor sets, to recover one upload as the difference of two
sums, as a scripted hostile server.

Before R4 every survivor signs, once per session, the view (every upload that counts, by sender and
upload digest); a decryptor decrypts only under the view it signed, and only with at least t of the
roster's survivors' signatures over it (t its own floor: floor(2n/3) + 1 under the deployment
policy, a majority under the simulator's).  Any two views with t honest signers share one, who signs
once, so all decryptions of a session are over one survivor set.

The hostile server runs R0..R2 honestly (the :class:`Federation` helper, through the codec), then
scripts R3 and R4 by hand: the recovery (decrypt ``all`` over every member, and again over every
member but the victim: the difference is the victim's upload) and other ways to show two views.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from secure_afl.core.errors import (
    ConflictingAnswerError,
    DuplicateClientError,
    GroupBelowMinimumError,
    InconsistentSurvivorsError,
    InvalidSignatureError,
    OutOfOrderMessageError,
    ProtocolError,
    ReplayedMessageError,
    ServerProtocolError,
    UnknownClientError,
)
from secure_afl.privacy.ledger import MemoryLedger
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.protocol import crypto
from secure_afl.protocol.ckks import binding, codec
from secure_afl.protocol.ckks.errors import UnsignedViewError, ViewQuorumError
from secure_afl.protocol.ckks.messages import (
    CkksDecryption,
    CkksDecryptRequest,
    CkksInputRequest,
    CkksViewRequest,
    CkksViewSignature,
    GroupUploads,
)
from secure_afl.protocol.ckks.state import CkksClientState

from .helpers import D, Federation, decrypted_tensors, plain_sums

LIMIT = 1 << 30  # the hostile server's own codec bound: it is not the party under test
# The deployment policy (t = floor(2n/3) + 1, refuse exposure, one answer per round in the ledger),
# with no colluders assumed: the recovery needs none.
POLICY = dataclasses.replace(ClientPolicy.deployment(), max_colluders=0)


def _contributions(n: int, groups: tuple[str, ...] = ("all",)) -> dict:
    """Per client a Gram and a row count in each of ``groups`` (the same values in every group)."""
    rng = np.random.default_rng(27)
    out = {}
    for k in range(n):
        h = rng.random((40 + k, D)) * 10
        out[f"c{k}"] = {g: {"gram": h.T @ h, "rows": np.array([40.0 + k])} for g in groups}
    return out


def _federation(n: int = 4, groups: tuple[str, ...] = ("all",), policy: ClientPolicy = POLICY) -> Federation:
    ledgers = {f"c{k}": MemoryLedger() for k in range(n)}
    fed = Federation(_contributions(n, groups), policy=policy, min_group_size=2, ledgers=ledgers)
    fed.run(until="R3")  # R0..R2 honestly; the server has every upload and the honest view
    return fed


def _deliver(fed: Federation, cid: str, message: object) -> list:
    """The client's decoded replies through the codec; a refusal raises."""
    data = codec.encode(message, max_message_bytes=LIMIT)
    return [codec.decode(r, max_message_bytes=LIMIT) for r in fed.clients[cid].receive_bytes(data)]


def _views(fed: Federation, victim: str) -> tuple[CkksViewRequest, CkksViewRequest]:
    """The honest view (every upload) and the one without the victim's upload."""
    honest = next(iter(fed.requests_by_round["R3"].values()))
    assert isinstance(honest, CkksViewRequest) and len(honest.uploads) == len(fed.ids)
    cut = dataclasses.replace(honest, uploads=tuple(e for e in honest.uploads if e.sender != victim))
    return honest, cut


def _sign(fed: Federation, plan: dict[str, CkksViewRequest]) -> dict[bytes, list[CkksViewSignature]]:
    """Show each client its view; the signatures per view (keyed by the view's first digest set)."""
    out: dict[bytes, list[CkksViewSignature]] = {}
    for cid, view in sorted(plan.items()):
        (signature,) = _deliver(fed, cid, view)
        assert isinstance(signature, CkksViewSignature) and signature.sender == cid
        out.setdefault(_key(view), []).append(signature)
    return out


def _key(view: CkksViewRequest) -> bytes:
    return b"".join(e.sender.encode() + e.digest for e in view.uploads)


def _request(
    fed: Federation, view: CkksViewRequest, signatures, groups: tuple[str, ...] = ("all",)
) -> CkksDecryptRequest:
    """R4 over ``view``: each group's signed uploads of the view's senders (built as the server would)."""
    senders = {e.sender for e in view.uploads}
    items = tuple(
        GroupUploads(
            g,
            fed.server._requested[g].chunks,
            tuple(u for u in fed.server._requested[g].uploads if u.sender in senders),
        )
        for g in groups
    )
    return CkksDecryptRequest(view.session_id, view.uploads, tuple(signatures), items)


def _sign_as(fed: Federation, cid: str, view: CkksViewRequest, *, session_id: bytes | None = None):
    """A view signature made with ``cid``'s identity key (a colluder's, or one from another session)."""
    client = fed.clients[next(iter(fed.clients))]
    session = view.session_id if session_id is None else session_id
    domain, fields = binding.view_fields(session, client._config_digest, client._adverts_digest, view.uploads)
    return CkksViewSignature(
        view.session_id, cid, crypto.sign(fed.identities[cid].private_key, domain, *fields)
    )


def _refuses(
    fed: Federation, cid: str, message: object, error: type[ProtocolError], match: str | None = None
):
    """The client refuses (nothing comes back), fails and drops its secret key."""
    client = fed.clients[cid]
    with pytest.raises(error, match=match):
        _deliver(fed, cid, message)
    assert client.state is CkksClientState.FAILED and client._context is None


def test_two_decryptors_shown_two_survivor_sets_both_refuse() -> None:
    # Four clients, one group; the server shows half of them every upload (S1) and half all but the
    # victim's (S2).  Each view gets two signatures: below t = 3, so neither decryptor decrypts.
    fed = _federation(4)
    victim = "c3"
    s1, s2 = _views(fed, victim)
    signed = _sign(fed, {"c3": s1, "c0": s1, "c1": s2, "c2": s2})
    assert [len(v) for v in signed.values()] == [2, 2]
    _refuses(fed, "c0", _request(fed, s1, signed[_key(s1)]), UnsignedViewError, "fewer than t = 3")
    _refuses(fed, "c1", _request(fed, s2, signed[_key(s2)]), UnsignedViewError, "fewer than t = 3")
    # Nor would the honest server's session go on: it takes the signatures over its view only, and
    # needs a majority of them.
    for signature in signed[_key(s1)]:
        fed.server.receive(signature)
    for signature in signed[_key(s2)]:
        with pytest.raises(InvalidSignatureError):
            fed.server.receive(signature)
    with pytest.raises(ViewQuorumError, match="fewer than a majority"):
        fed.server.next_round()


def test_the_same_scripted_decryption_succeeds_with_a_quorum_over_one_view() -> None:
    # The control: the hostile server's R4 messages are well formed; only the quorum was missing.
    fed = _federation(4)
    s1, _ = _views(fed, "c3")
    (signatures,) = _sign(fed, dict.fromkeys(fed.ids, s1)).values()
    (reply,) = _deliver(fed, "c0", _request(fed, s1, signatures[:3]))
    assert isinstance(reply, CkksDecryption)
    want = plain_sums(fed.contributions)["all"]
    (group,) = reply.groups
    got = decrypted_tensors(fed.config, group)
    assert abs(got["rows"][0] - want["rows"][0]) <= 2.0**-24
    assert np.max(np.abs(got["gram"] - want["gram"][np.triu_indices(D)])) <= 2.0**-20


def test_signatures_over_the_honest_view_do_not_count_for_another() -> None:
    # Everyone signs S1; the server then asks c1 to decrypt S2 (without the victim) with them.
    fed = _federation(4)
    s1, s2 = _views(fed, "c3")
    (signatures,) = _sign(fed, dict.fromkeys(fed.ids, s1)).values()
    _refuses(fed, "c1", _request(fed, s2, signatures), InconsistentSurvivorsError, "signed in R3")
    # A decryptor that never signed a view is not asked to decrypt (it awaits R3).
    fed = _federation(4)
    s1, _ = _views(fed, "c3")
    (signatures,) = _sign(fed, {c: s1 for c in ("c1", "c2", "c3")}).values()
    _refuses(fed, "c0", _request(fed, s1, signatures), OutOfOrderMessageError)


def test_a_view_signed_by_t_clients_but_without_the_decryptor_is_refused() -> None:
    fed = _federation(4)
    _, without_c0 = _views(fed, "c0")
    (signatures,) = _sign(fed, {c: without_c0 for c in ("c1", "c2", "c3")}).values()
    assert len(signatures) == 3  # t = 3: a quorum, but c0's own upload is not in it
    s1, _ = _views(fed, "c3")
    _deliver(fed, "c0", s1)  # c0 signed the honest view
    _refuses(fed, "c0", _request(fed, without_c0, signatures), InconsistentSurvivorsError, "own input")


def test_two_views_each_signed_by_t_need_a_client_that_signs_twice_which_none_does() -> None:
    # n = 3 under the simulator's majority (t = 2): the smallest federation where two views could
    # each have t signers if one client signed both.  The server asks c1 for both.
    for policy, n in ((POLICY, 4), (dataclasses.replace(ClientPolicy.simulator(), one_contribution=True), 3)):
        fed = _federation(n, policy=policy)
        victim = f"c{n - 1}"
        s1, s2 = _views(fed, victim)
        _deliver(fed, "c1", s1)
        _refuses(fed, "c1", s2, OutOfOrderMessageError)  # the same client signs one view
        # A copy of c1 (rebuilt from its seed and the server's messages, sharing its ledger, as a
        # deployed node forked before R3 is) refuses the second view too.
        copy = fed.rebuilt_client("c1", ("R0", "R1", "R2"), LIMIT)
        fed.clients["c1"] = copy
        _refuses(fed, "c1", s2, ConflictingAnswerError, "one answer per round")


def test_view_signatures_from_another_session_or_repeated_or_from_outside_the_view_do_not_count() -> None:
    other = bytes(32)

    def foreign(fed, view, named_as):  # c1's and c2's signatures over these uploads in another session
        return [
            dataclasses.replace(_sign_as(fed, c, view, session_id=other), session_id=named_as)
            for c in ("c1", "c2")
        ]

    cases = [
        (lambda fed, view, sigs: [sigs[0], *foreign(fed, view, other)], ReplayedMessageError),
        (lambda fed, view, sigs: [sigs[0], *foreign(fed, view, view.session_id)], UnsignedViewError),
        (lambda fed, view, sigs: [sigs[0], sigs[0], sigs[1]], DuplicateClientError),
        (
            lambda fed, view, sigs: [*sigs[:2], dataclasses.replace(sigs[2], signature=sigs[1].signature)],
            UnsignedViewError,
        ),
    ]
    for chosen, error in cases:
        fed = _federation(4)
        s1, _ = _views(fed, "c3")
        (signatures,) = _sign(fed, dict.fromkeys(fed.ids, s1)).values()
        assert len(chosen(fed, s1, signatures)) == 3  # as many as t: only their validity is wrong
        _refuses(fed, "c0", _request(fed, s1, chosen(fed, s1, signatures)), error)
    # A signature of a client outside the view (over the view: it does verify) does not count.
    fed = _federation(4)
    s1, without_c3 = _views(fed, "c3")
    (signed,) = _sign(fed, {c: without_c3 for c in ("c0", "c1")}).values()
    signed.append(_sign_as(fed, "c3", without_c3))
    _refuses(fed, "c0", _request(fed, without_c3, signed), UnsignedViewError, "has no upload in it")


def test_an_upload_other_than_the_one_the_view_names_is_refused_by_signer_and_decryptor() -> None:
    # c3 encrypts twice (a second R2 delivered to a copy of it): two valid signed uploads.
    fed = _federation(4)
    s1, _ = _views(fed, "c3")
    copy = fed.rebuilt_client("c3", ("R0", "R1"), LIMIT)
    request = fed.requests_by_round["R2"]["c3"]
    assert isinstance(request, CkksInputRequest)
    (second,) = copy.receive(request)
    digest = binding.upload_digest("c3", binding.tensor_digests(second.tensors), second.signature)
    entry = next(e for e in s1.uploads if e.sender == "c3")
    assert digest != entry.digest
    named = dataclasses.replace(
        s1,
        uploads=tuple(dataclasses.replace(e, digest=digest) if e.sender == "c3" else e for e in s1.uploads),
    )
    # c3 itself refuses to sign a view naming an upload it did not send.
    _refuses(fed, "c3", named, InconsistentSurvivorsError, "other than the one it sent")
    # The others sign it (they cannot tell); the decryptor is given c3's first upload: refused.
    (signatures,) = _sign(fed, {c: named for c in ("c0", "c1", "c2")}).values()
    _refuses(fed, "c0", _request(fed, named, signatures), InconsistentSurvivorsError, "the signed view names")


def test_a_decryptor_copied_after_r3_answers_one_view_per_session_its_record_is_per_round() -> None:
    # Two groups carrying the same tensor: decrypting "a" over every member and "b" over all but the
    # victim gives the victim's value.  The record was keyed per group set (R3/a, R3/b); it is R4.
    fed = _federation(4, groups=("a", "b"))
    s1, s2 = _views(fed, "c3")
    (signatures,) = _sign(fed, dict.fromkeys(fed.ids, s1)).values()
    (reply,) = _deliver(fed, "c0", _request(fed, s1, signatures, ("a",)))
    assert isinstance(reply, CkksDecryption) and [g.group for g in reply.groups] == ["a"]
    # A copy rebuilt from a state in which c0 holds S2 (its R3 replayed, which records nothing),
    # and a quorum over S2 (c1 and c2 colluding, and c0's key): only the per-round record is left.
    copy = fed.rebuilt_client("c0", ("R0", "R1", "R2"), LIMIT)
    copy.replay_bytes(codec.encode(s2, max_message_bytes=LIMIT))
    fed.clients["c0"] = copy
    quorum = [_sign_as(fed, c, s2) for c in ("c0", "c1", "c2")]
    _refuses(fed, "c0", _request(fed, s2, quorum, ("b",)), ConflictingAnswerError, "R4")
    # Under the same view, another group is answered (a replacement decryptor's request).
    copy = fed.rebuilt_client("c0", ("R0", "R1", "R2", "R3"), LIMIT)
    fed.clients["c0"] = copy
    (again,) = _deliver(fed, "c0", _request(fed, s1, signatures, ("b",)))
    assert [g.group for g in again.groups] == ["b"]


def test_the_honest_session_decrypts_once_every_survivor_signed_and_skips_those_that_did_not() -> None:
    # c0 does not answer R3: it is not asked to decrypt, and its upload still counts.
    fed = Federation(_contributions(5), policy=POLICY, min_group_size=2)
    fed.run(drop={"R3": {"c0"}})
    result = fed.server.result()
    assert result.survivors == tuple(fed.ids) and "c0" not in result.groups["all"].decryptors
    want = plain_sums(fed.contributions)["all"]["rows"][0]
    assert abs(result.groups["all"].sums["rows"][0] - want) <= 2.0**-24
    requests = fed.requests_by_round["R4"]
    assert all(
        len(r.signatures) == 4 and "c0" not in {s.sender for s in r.signatures} for r in requests.values()
    )


def test_a_malformed_view_is_not_signed() -> None:
    def duplicate(uploads):
        return (uploads[0], *uploads)

    def unsorted(uploads):
        return (*uploads[1:], uploads[0])

    def stranger(uploads):
        return (*uploads, dataclasses.replace(uploads[0], sender="mallory"))

    def pair(uploads):  # two of four: the minimum group size 2 holds
        return tuple(e for e in uploads if e.sender in ("c0", "c1"))

    def alone(uploads):
        return tuple(e for e in uploads if e.sender == "c0")

    cases = [
        (duplicate, DuplicateClientError),
        (unsorted, ServerProtocolError),
        (stranger, UnknownClientError),
        (alone, GroupBelowMinimumError),
        (pair, None),
    ]
    for change, error in cases:
        fed = _federation(4)
        s1, _ = _views(fed, "c3")
        view = dataclasses.replace(s1, uploads=change(s1.uploads))
        if error is None:  # the control: a well-formed smaller view is signed
            (signature,) = _deliver(fed, "c0", view)
            assert isinstance(signature, CkksViewSignature)
        else:
            _refuses(fed, "c0", view, error)
