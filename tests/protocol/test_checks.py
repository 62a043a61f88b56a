"""Every active-adversary check fires, with its specific exception, and releases no secret."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from secure_afl.core import encoding
from secure_afl.core.errors import (
    BothSharesRequestedError,
    ClientProtocolError,
    DuplicateClientError,
    DuplicateParticipantError,
    EncodingOverflowError,
    GroupBelowMinimumError,
    GroupTooSmallError,
    InconsistentSurvivorsError,
    InsufficientParticipantsError,
    InvalidSessionConfigError,
    InvalidShareError,
    InvalidSignatureError,
    LocalProtocolError,
    OutOfOrderMessageError,
    RelayedSignatureError,
    RemoteProtocolError,
    ReplayedMessageError,
    ServerProtocolError,
    ShareAuthenticationError,
    SurvivorsBelowThresholdError,
    UnknownClientError,
    UnknownParticipantError,
)
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.keys.identity import IdentityKey
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.protocol import binding, crypto
from secure_afl.protocol.client import ClientSession, validate_config
from secure_afl.protocol.messages import (
    AdvertiseKeys,
    AdvertiseRequest,
    ConsistencyCheckRequest,
    GroupSpec,
    MaskedInput,
    ShareKeys,
    SurvivorSignature,
    TensorSpec,
    UnmaskRequest,
)
from secure_afl.protocol.server import ServerSession
from secure_afl.protocol.state import ClientState, ServerRound

from .helpers import make_federation, play, play_round


def assert_refuses(client, message, error) -> None:
    """The client raises ``error``, returns nothing, forgets its secrets and stays unusable."""
    with pytest.raises(error):
        client.receive(message)
    assert client.state is ClientState.FAILED
    assert client._seed == b"" and client._mask_key is None and client._held == {}
    with pytest.raises(LocalProtocolError):
        client.receive(message)


def after(fed, until: str):
    play(fed, until=until)
    return fed.requests


# --- R0: session config ---------------------------------------------------------------------------


def test_threshold_below_client_minimum_is_refused() -> None:
    fed = make_federation(4, threshold=3)
    weak = dataclasses.replace(fed.config, threshold=2)
    assert_refuses(fed.clients["c0"], AdvertiseRequest(weak), InvalidSessionConfigError)


def test_min_group_size_below_client_minimum_is_refused() -> None:
    fed = make_federation(4, min_group_size=1, client_min_group_size=2)
    assert_refuses(fed.clients["c0"], fed.server.start(), InvalidSessionConfigError)


def test_advertise_request_for_another_session_is_refused() -> None:
    fed = make_federation(3)
    from secure_afl.protocol.client import ClientSession

    client = ClientSession(
        "c0",
        fed.identities["c0"],
        fed.roster,
        fed.inputs["c0"],
        min_group_size=1,
        session_id=b"\x01" * 32,
        policy=ClientPolicy.simulator(),
        random=DeterministicRandomSource(b"s"),
    )
    assert_refuses(client, fed.server.start(), ReplayedMessageError)


def test_out_of_order_message_is_refused() -> None:
    fed = make_federation(3)
    request = UnmaskRequest(fed.config.session_id, ("c0", "c1"), (), ("c0", "c1"), ())
    assert_refuses(fed.clients["c0"], request, OutOfOrderMessageError)


def _config_with_layout(template, layout: dict[str, list[tuple[str, int]]]):
    return dataclasses.replace(
        template,
        groups=tuple(
            GroupSpec(group, tuple(TensorSpec(name, length) for name, length in tensors))
            for group, tensors in layout.items()
        ),
    )


def test_config_digest_encodes_the_layout_unambiguously() -> None:
    # Joined with NUL separators, these two layouts gave one digest: a client that signed one
    # config could be shown as having accepted the other.
    fed = make_federation(3)
    first = _config_with_layout(fed.config, {"a": [("t\0x", 5)], "a\0t": [("y", 3), ("z", 4)]})
    second = _config_with_layout(fed.config, {"a": [("t\0x", 5), ("t\0y", 3)], "a\0t": [("z", 4)]})
    assert binding.config_digest(first) != binding.config_digest(second)
    # Moving a tensor between adjacent groups, or splitting a name, changes the digest.
    third = _config_with_layout(fed.config, {"a": [("x", 5)], "b": [("y", 3)]})
    fourth = _config_with_layout(fed.config, {"a": [("x", 5), ("y", 3)], "b": []})
    assert binding.config_digest(third) != binding.config_digest(fourth)
    # And the NUL-bearing names are refused outright, by clients and by the server.
    for config in (first, second):
        assert_refuses(fed.clients["c0"], AdvertiseRequest(config), InvalidSessionConfigError)
        fed = make_federation(3)
        with pytest.raises(LocalProtocolError, match="control"):
            ServerSession(fed.roster, config)


@pytest.mark.parametrize(
    ("group", "tensor", "match"),
    [
        ("all", "x\x00y", "control"),
        ("all\n", "x", "control"),
        ("all", "x\u202ey", "control"),  # right-to-left override
        ("al\u200bl", "x", "control"),  # zero-width space
        ("", "x", "empty"),
        ("all", "", "empty"),
        ("g" * 256, "x", "more than 255"),
        ("all", "é" * 128, "more than 255"),
    ],
)
def test_bad_group_or_tensor_names_are_refused_with_a_clear_error(group, tensor, match) -> None:
    fed = make_federation(3)
    config = _config_with_layout(fed.config, {group: [(tensor, 5)]})
    with pytest.raises(InvalidSessionConfigError, match=match):
        validate_config(config, 3)
    with pytest.raises(LocalProtocolError, match=match):
        ServerSession(fed.roster, config)
    assert_refuses(fed.clients["c0"], AdvertiseRequest(config), InvalidSessionConfigError)


def test_printable_unicode_names_are_accepted() -> None:
    fed = make_federation(3)
    validate_config(_config_with_layout(fed.config, {"class: Pleural thickening / é": [("gram", 3)]}), 3)


# --- R1: advertised keys --------------------------------------------------------------------------


def test_forged_keys_are_refused() -> None:
    fed = make_federation(4)
    request = after(fed, "R0")["c0"]
    forged_key = crypto.x25519_public_bytes(crypto.new_x25519_key(DeterministicRandomSource(b"mallory")))
    adverts = tuple(
        dataclasses.replace(a, mask_public_key=forged_key) if a.client_id == "c1" else a
        for a in request.advertisements
    )
    assert_refuses(
        fed.clients["c0"], dataclasses.replace(request, advertisements=adverts), RelayedSignatureError
    )


def test_unsigned_keys_are_refused() -> None:
    fed = make_federation(4)
    request = after(fed, "R0")["c0"]
    adverts = tuple(
        dataclasses.replace(a, signature=bytes(64)) if a.client_id == "c2" else a
        for a in request.advertisements
    )
    assert_refuses(
        fed.clients["c0"], dataclasses.replace(request, advertisements=adverts), RelayedSignatureError
    )


def _advert_signed_by(identity: IdentityKey, client_id: str, template: AdvertiseKeys) -> AdvertiseKeys:
    domain, fields = binding.advertise_fields(
        template.session_id,
        client_id,
        template.encryption_public_key,
        template.mask_public_key,
        template.self_mask_commitment,
        template.config_digest,
        template.groups,
    )
    signature = crypto.sign(identity.private_key, domain, *fields)
    return dataclasses.replace(template, client_id=client_id, signature=signature)


def test_client_outside_the_roster_is_refused_by_clients_and_server() -> None:
    fed = make_federation(4)
    request = after(fed, "R0")["c0"]
    mallory = IdentityKey.generate(DeterministicRandomSource(b"mallory"))
    intruder = _advert_signed_by(mallory, "mallory", request.advertisements[1])
    tampered = dataclasses.replace(request, advertisements=(*request.advertisements, intruder))
    assert_refuses(fed.clients["c0"], tampered, UnknownParticipantError)

    fed2 = make_federation(4)
    fed2.server.start()
    with pytest.raises(UnknownClientError):
        fed2.server.receive(intruder)


def test_impersonating_a_roster_member_is_refused() -> None:
    fed = make_federation(4)
    request = after(fed, "R0")["c0"]
    mallory = IdentityKey.generate(DeterministicRandomSource(b"mallory"))
    impostor = _advert_signed_by(mallory, "c3", request.advertisements[3])
    adverts = (*request.advertisements[:3], impostor)
    assert_refuses(
        fed.clients["c0"], dataclasses.replace(request, advertisements=adverts), RelayedSignatureError
    )


def test_duplicate_id_is_refused_by_clients_and_server() -> None:
    fed = make_federation(4)
    request = after(fed, "R0")["c0"]
    doubled = dataclasses.replace(
        request, advertisements=(*request.advertisements, request.advertisements[1])
    )
    assert_refuses(fed.clients["c0"], doubled, DuplicateParticipantError)

    fed2 = make_federation(4)
    advert = fed2.clients["c1"].receive(fed2.server.start())[0]
    fed2.server.receive(advert)
    with pytest.raises(DuplicateClientError):
        fed2.server.receive(advert)


def test_messages_replayed_from_another_session_are_refused() -> None:
    fed_a = make_federation(4, seed=b"same-identities", session_id=b"A" * 32)
    fed_b = make_federation(4, seed=b"same-identities", session_id=b"B" * 32)
    assert fed_a.identities["c1"].public_key == fed_b.identities["c1"].public_key
    request_a = after(fed_a, "R0")["c0"]
    request_b = after(fed_b, "R0")["c0"]

    # The whole request from session B.
    client = make_federation(4, seed=b"same-identities", session_id=b"A" * 32)
    play_round(client, "R0")
    assert_refuses(client.clients["c0"], request_b, ReplayedMessageError)

    # One advertisement from session B inside session A's request.
    replayed = tuple(
        next(b for b in request_b.advertisements if b.client_id == "c1") if a.client_id == "c1" else a
        for a in request_a.advertisements
    )
    assert_refuses(
        fed_a.clients["c0"], dataclasses.replace(request_a, advertisements=replayed), ReplayedMessageError
    )

    # The same advertisement relabelled with session A's id: its signature binds session B.
    fed_c = make_federation(4, seed=b"same-identities", session_id=b"A" * 32)
    request_c = after(fed_c, "R0")["c0"]
    relabelled = tuple(
        dataclasses.replace(
            next(b for b in request_b.advertisements if b.client_id == "c1"), session_id=b"A" * 32
        )
        if a.client_id == "c1"
        else a
        for a in request_c.advertisements
    )
    assert_refuses(
        fed_c.clients["c0"], dataclasses.replace(request_c, advertisements=relabelled), RelayedSignatureError
    )

    # The server refuses it too.
    fed_d = make_federation(4, seed=b"same-identities", session_id=b"A" * 32)
    fed_d.server.start()
    with pytest.raises(ReplayedMessageError):
        fed_d.server.receive(request_b.advertisements[1])


def test_server_omitting_the_clients_own_advertisement_is_refused() -> None:
    fed = make_federation(4)
    request = after(fed, "R0")["c0"]
    others = tuple(a for a in request.advertisements if a.client_id != "c0")
    assert_refuses(
        fed.clients["c0"], dataclasses.replace(request, advertisements=others), ServerProtocolError
    )


def test_too_few_advertisements_are_refused() -> None:
    fed = make_federation(5, threshold=4)
    request = after(fed, "R0")["c0"]
    few = request.advertisements[:3]
    assert_refuses(
        fed.clients["c0"], dataclasses.replace(request, advertisements=few), SurvivorsBelowThresholdError
    )


# --- R2: shares -----------------------------------------------------------------------------------


def test_tampered_share_ciphertext_is_refused() -> None:
    fed = make_federation(4)
    request = after(fed, "R1")["c0"]
    first = request.shares[0]
    flipped = bytes([first.ciphertext[0] ^ 1]) + first.ciphertext[1:]
    shares = (dataclasses.replace(first, ciphertext=flipped), *request.shares[1:])
    assert_refuses(fed.clients["c0"], dataclasses.replace(request, shares=shares), ShareAuthenticationError)


def test_shares_redirected_to_another_recipient_are_refused() -> None:
    fed = make_federation(4)
    requests = after(fed, "R1")
    foreign = next(share for share in requests["c1"].shares if share.sender == "c2")  # addressed to c1
    shares = tuple(foreign if share.sender == "c2" else share for share in requests["c0"].shares)
    assert_refuses(fed.clients["c0"], dataclasses.replace(requests["c0"], shares=shares), ServerProtocolError)


def test_too_few_share_senders_are_refused() -> None:
    fed = make_federation(5, threshold=4)
    request = after(fed, "R1")["c0"]
    assert_refuses(
        fed.clients["c0"],
        dataclasses.replace(request, shares=request.shares[:2]),
        SurvivorsBelowThresholdError,
    )


# --- R3: consistency ------------------------------------------------------------------------------


def test_survivors_below_threshold_are_refused() -> None:
    fed = make_federation(5, threshold=3)
    request = after(fed, "R2")["c0"]
    assert_refuses(
        fed.clients["c0"],
        ConsistencyCheckRequest(request.session_id, ("c0", "c1")),
        SurvivorsBelowThresholdError,
    )


def test_survivor_set_without_the_client_itself_is_refused() -> None:
    fed = make_federation(5, threshold=3)
    request = after(fed, "R2")["c0"]
    assert_refuses(
        fed.clients["c0"],
        ConsistencyCheckRequest(request.session_id, ("c1", "c2", "c3")),
        InconsistentSurvivorsError,
    )


def test_group_below_minimum_size_is_refused_by_clients() -> None:
    groups = {"pair": ("c0", "c1"), "all": ("c0", "c1", "c2", "c3")}
    fed = make_federation(4, groups, threshold=3, min_group_size=2)
    request = after(fed, "R2")["c0"]
    lonely = ConsistencyCheckRequest(request.session_id, ("c0", "c2", "c3"))
    assert_refuses(fed.clients["c0"], lonely, GroupBelowMinimumError)


def test_group_below_minimum_size_aborts_an_honest_server() -> None:
    groups = {"pair": ("c0", "c1"), "all": ("c0", "c1", "c2", "c3")}
    fed = make_federation(4, groups, threshold=3, min_group_size=2)
    with pytest.raises(GroupTooSmallError, match="pair"):
        play(fed, drops={"R2": {"c1"}})
    assert fed.server.round is ServerRound.MASKED_INPUT  # nothing changed, nothing unmasked


# --- R4: unmask -----------------------------------------------------------------------------------


def test_request_for_both_shares_of_one_client_is_refused() -> None:
    fed = make_federation(5, threshold=3)
    request = after(fed, "R3")["c0"]
    both = dataclasses.replace(request, reveal_mask_key_of=("c2",))  # c2 survived: its seed is also revealed
    assert_refuses(fed.clients["c0"], both, BothSharesRequestedError)


def test_request_for_a_dropped_clients_self_mask_is_refused() -> None:
    fed = make_federation(5, threshold=3)
    play(fed, until="R3", drops={"R2": {"c4"}})
    request = fed.requests["c0"]
    assert request.reveal_mask_key_of == ("c4",)
    both = dataclasses.replace(request, reveal_self_mask_of=(*request.reveal_self_mask_of, "c4"))
    assert_refuses(fed.clients["c0"], both, BothSharesRequestedError)


def test_same_client_in_both_reveal_lists_is_refused() -> None:
    fed = make_federation(5, threshold=3)
    play(fed, until="R3", drops={"R2": {"c4"}})
    request = fed.requests["c0"]
    both = dataclasses.replace(request, reveal_self_mask_of=("c0", "c1", "c2", "c3", "c4"))
    assert_refuses(fed.clients["c0"], both, BothSharesRequestedError)


def test_clients_given_different_survivor_sets_detect_it() -> None:
    fed = make_federation(5, threshold=3)
    session_id = after(fed, "R2")["c0"].session_id
    # A malicious server shows c0 and c1 one survivor set, c2 and c3 another.
    view_one, view_two = ("c0", "c1", "c2", "c3"), ("c0", "c1", "c2", "c3", "c4")
    signatures = {}
    for cid, view in (("c0", view_one), ("c1", view_one), ("c2", view_two), ("c3", view_two)):
        (reply,) = fed.clients[cid].receive(ConsistencyCheckRequest(session_id, view))
        signatures[cid] = reply.signature
    request = UnmaskRequest(
        session_id,
        view_one,
        tuple(SurvivorSignature(cid, signatures[cid]) for cid in ("c0", "c1", "c2")),
        view_one,
        ("c4",),
    )
    assert_refuses(fed.clients["c0"], request, InconsistentSurvivorsError)


def _same_session_other_keys(n: int, threshold: int):
    """Two federations with one session id, one roster and one config, but other session keys."""
    first = make_federation(n, threshold=threshold)
    second = make_federation(n, threshold=threshold)  # same seed: same identities, config, session id
    second.clients = {
        cid: ClientSession(
            cid,
            second.identities[cid],
            second.roster,
            second.inputs[cid],
            min_threshold=threshold,
            min_group_size=1,
            random=DeterministicRandomSource(b"other keys " + cid.encode()),
            policy=ClientPolicy.simulator(),
        )
        for cid in second.clients
    }
    assert first.config == second.config and first.roster == second.roster
    return first, second


def test_r3_signature_cannot_be_replayed_into_a_session_with_the_same_id_but_other_keys() -> None:
    first, second = _same_session_other_keys(4, 3)
    first_requests, second_requests = after(first, "R2"), after(second, "R2")
    assert first_requests["c1"] == second_requests["c1"]  # same session id, same U3
    (replayed,) = first.clients["c1"].receive(first_requests["c1"])
    (genuine,) = second.clients["c1"].receive(second_requests["c1"])
    assert replayed.session_id == genuine.session_id
    # The server of the second session refuses the first session's signature...
    with pytest.raises(InvalidSignatureError, match="transcript"):
        second.server.receive(replayed)
    assert replayed.signature != genuine.signature  # over (session id, U3) alone they were equal
    second.server.receive(genuine)
    # ...and so does a client of the second session, shown it in the unmask request.
    for cid in ("c0", "c2", "c3"):
        for reply in second.clients[cid].receive(second_requests[cid]):
            second.server.receive(reply)
    request = second.server.next_round()["c0"]
    swapped = tuple(
        SurvivorSignature("c1", replayed.signature) if item.client_id == "c1" else item
        for item in request.signatures
    )
    assert_refuses(
        second.clients["c0"], dataclasses.replace(request, signatures=swapped), InconsistentSurvivorsError
    )


def test_r3_signature_over_a_different_advertisement_set_is_rejected() -> None:
    fed = make_federation(4, threshold=3)
    requests = after(fed, "R2")
    (accepted,) = (m.advertisements for d, r, cid, m in fed.log if (d, r, cid) == ("to-client", "R1", "c0"))
    survivors = requests["c0"].survivors
    digest = binding.config_digest(fed.config)
    # c1 (its real identity key) signs U3 over an advertisement set without c3: what it would sign
    # had the server shown it a different set of participants' keys.
    other = binding.advertisements_digest(fed.config.session_id, accepted[:3])
    domain, fields = binding.survivors_fields(fed.config.session_id, digest, other, survivors)
    forged = crypto.sign(fed.identities["c1"].private_key, domain, *fields)
    (genuine,) = fed.clients["c1"].receive(requests["c1"])
    with pytest.raises(InvalidSignatureError):
        fed.server.receive(dataclasses.replace(genuine, signature=forged))
    # Over the accepted set it verifies: the digest is what the signature binds.
    right = binding.advertisements_digest(fed.config.session_id, accepted)
    domain, fields = binding.survivors_fields(fed.config.session_id, digest, right, survivors)
    assert crypto.verify(fed.identities["c1"].public_key, genuine.signature, domain, *fields)
    fed.server.receive(genuine)
    for cid in ("c0", "c2", "c3"):
        for reply in fed.clients[cid].receive(requests[cid]):
            fed.server.receive(reply)
    request = fed.server.next_round()["c0"]
    swapped = tuple(
        SurvivorSignature("c1", forged) if item.client_id == "c1" else item for item in request.signatures
    )
    assert_refuses(
        fed.clients["c0"], dataclasses.replace(request, signatures=swapped), InconsistentSurvivorsError
    )


def test_unmask_with_a_different_survivor_set_than_signed_is_refused() -> None:
    fed = make_federation(5, threshold=3)
    play(fed, until="R3")
    request = fed.requests["c0"]
    changed = dataclasses.replace(request, survivors=("c0", "c1", "c2", "c3"))
    assert_refuses(fed.clients["c0"], changed, InconsistentSurvivorsError)


def test_too_few_consistency_signatures_are_refused() -> None:
    fed = make_federation(5, threshold=3)
    play(fed, until="R3")
    request = fed.requests["c0"]
    few = dataclasses.replace(request, signatures=request.signatures[:2])
    assert_refuses(fed.clients["c0"], few, SurvivorsBelowThresholdError)


# --- server-side robustness -----------------------------------------------------------------------


def test_server_rejects_malformed_masked_input_and_stays_unchanged() -> None:
    fed = make_federation(3, threshold=2)
    play(fed, until="R1")
    replies = {cid: fed.clients[cid].receive(fed.requests[cid])[0] for cid in fed.clients}
    bad = dataclasses.replace(
        replies["c0"], tensors=(dataclasses.replace(replies["c0"].tensors[0], data=bytes(8)),)
    )
    with pytest.raises(ClientProtocolError):
        fed.server.receive(bad)
    with pytest.raises(UnknownClientError):
        fed.server.receive(MaskedInput(bad.session_id, "nobody", bad.tensors))
    for reply in replies.values():
        fed.server.receive(reply)
    fed.requests = fed.server.next_round()
    play_round(fed, "R3")
    play_round(fed, "R4")
    total = fed.server.result().groups["all"].sums["x"]
    expected = sum(encoding.encode(fed.inputs[c]["all"]["x"], tensor="x", group_size=3) for c in fed.clients)
    np.testing.assert_array_equal(total, expected)


def test_server_rejects_forged_consistency_signature() -> None:
    fed = make_federation(3, threshold=2)
    requests = after(fed, "R2")
    (reply,) = fed.clients["c0"].receive(requests["c0"])
    with pytest.raises(InvalidSignatureError):
        fed.server.receive(dataclasses.replace(reply, signature=bytes(64)))


def test_server_detects_a_wrong_revealed_share() -> None:
    fed = make_federation(4, threshold=3)
    play(fed, until="R3")
    replies = {cid: fed.clients[cid].receive(fed.requests[cid])[0] for cid in sorted(fed.requests)}
    first = replies["c0"]
    wrong = dataclasses.replace(first.self_mask_shares[0], value=(1).to_bytes(66, "big"))
    fed.server.receive(dataclasses.replace(first, self_mask_shares=(wrong, *first.self_mask_shares[1:])))
    for cid in ("c1", "c2"):
        fed.server.receive(replies[cid])
    with pytest.raises(InvalidShareError):
        fed.server.next_round()


def test_server_refuses_to_proceed_below_threshold() -> None:
    fed = make_federation(4, threshold=3)
    with pytest.raises(InsufficientParticipantsError):
        play(fed, drops={"R1": {"c0", "c1"}})


def test_server_rejects_message_of_the_wrong_round() -> None:
    fed = make_federation(3)
    requests = after(fed, "R0")
    (reply,) = fed.clients["c0"].receive(requests["c0"])
    fed2 = make_federation(3)
    fed2.server.start()
    with pytest.raises(OutOfOrderMessageError):
        fed2.server.receive(reply)


# --- local errors leave the state unchanged -------------------------------------------------------


def test_overflow_is_caught_in_r1_before_any_share_is_sent() -> None:
    # 1e9 fits a group of one (bound 2^31) but not a group of 4 (bound 2^29): only the advertisements
    # tell the client its group size, and it must refuse before it sends its shares.
    fed = make_federation(4, threshold=3)
    fed.clients["c0"]._inputs["all"]["x"][0] = 1e9
    requests = after(fed, "R0")
    sent = {}
    for cid, request in sorted(requests.items()):
        if cid == "c0":
            with pytest.raises(EncodingOverflowError, match="all/x") as info:
                fed.clients[cid].receive(request)
            assert "group size 4" in str(info.value)
            assert not isinstance(info.value, RemoteProtocolError)
            continue
        (sent[cid],) = fed.clients[cid].receive(request)
        fed.server.receive(sent[cid])
    client = fed.clients["c0"]
    assert client.state is ClientState.AWAIT_SHARE_KEYS_REQUEST  # unchanged: no shares were built
    assert client._held == {}
    assert "c0" not in sent and all(isinstance(m, ShareKeys) for m in sent.values())
    # The others go on without it: c0 is simply a client that dropped before sharing keys.
    fed.requests = fed.server.next_round()
    assert "c0" not in fed.requests
    for round_name in ("R2", "R3", "R4"):
        play_round(fed, round_name, drop={"c0"})
    result = fed.server.result()
    assert result.survivors == ("c1", "c2", "c3")


def test_overflow_is_still_checked_when_encoding_in_r2() -> None:
    fed = make_federation(3, threshold=2)
    requests = after(fed, "R1")
    fed.clients["c0"]._inputs["all"]["x"][0] = 1e300  # changed behind the R1 check's back
    with pytest.raises(EncodingOverflowError, match="all/x") as info:
        fed.clients["c0"].receive(requests["c0"])
    assert "bound" in str(info.value) and "fractional bits" in str(info.value)
    assert not isinstance(info.value, RemoteProtocolError)
    assert fed.clients["c0"].state is ClientState.AWAIT_MASKED_INPUT_REQUEST


def test_inputs_not_matching_the_session_layout_are_a_local_error() -> None:
    fed = make_federation(3)
    fed.clients["c0"]._inputs["all"]["x"] = np.zeros(2)
    with pytest.raises(LocalProtocolError, match="layout"):
        fed.clients["c0"].receive(fed.server.start())
    assert fed.clients["c0"].state is ClientState.AWAIT_ADVERTISE_REQUEST


def test_non_message_is_a_local_error() -> None:
    fed = make_federation(3)
    with pytest.raises(LocalProtocolError):
        fed.clients["c0"].receive("hello")
    assert fed.clients["c0"].state is ClientState.AWAIT_ADVERTISE_REQUEST
