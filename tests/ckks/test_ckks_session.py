"""The CKKS backend's sessions: sums, key custody, dropouts, and every check that must refuse."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tenseal as ts

from secure_afl.core.errors import (
    DuplicateClientError,
    ExposureRefusedError,
    GroupTooSmallError,
    InconsistentSurvivorsError,
    InvalidSignatureError,
    MessageDecodeError,
    ServerProtocolError,
    ValueAlreadyReleasedError,
)
from secure_afl.privacy.ledger import MemoryLedger
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.protocol import crypto
from secure_afl.protocol.ckks import binding, codec, context
from secure_afl.protocol.ckks.context import CkksParameters
from secure_afl.protocol.ckks.errors import (
    ExposingDecryptionError,
    InvalidCiphertextError,
    InvalidContextError,
    InvalidParametersError,
    InvalidSumCiphertextError,
    KeyHolderDroppedError,
    NoDecryptorError,
    RepeatedDecryptionError,
)
from secure_afl.protocol.ckks.messages import (
    CkksDecryption,
    CkksInput,
    CkksInputRequest,
    CkksKeyDistribution,
    DecryptedGroup,
    EncryptedTensor,
)
from secure_afl.protocol.ckks.state import CkksClientState

from .helpers import Federation, decrypted_tensors, plain_sums, small_contributions


def _result_sums(fed: Federation) -> dict:
    result = fed.server.result()
    return {
        g: {name: fed.layout.unflatten(name, np.asarray(v)) for name, v in s.sums.items()}
        for g, s in result.groups.items()
    }


def _max_error(got: dict, want: dict) -> float:
    return max(float(np.max(np.abs(got[g][t] - want[g][t]))) for g in want for t in want[g])


def test_group_sums_match_float64_within_the_output_grid_and_long_vectors_are_chunked(capfd) -> None:
    contributions = small_contributions(long_length=4096 + 17)  # two ciphertexts at N = 8192
    fed = Federation(contributions)
    chunks_seen = []

    def record(sender, message):
        if isinstance(message, CkksInput):
            chunks_seen.extend(len(t.chunks) for t in message.tensors if t.tensor == "long")
        return message

    fed.run(to_server=record)
    # |error| <= half the output grid (rounding) + CKKS noise (~1e-9, measured): below one grid step.
    assert _max_error(_result_sums(fed), plain_sums(contributions)) <= 2.0**-fed.parameters.output_frac_bits
    assert chunks_seen == [2] * 4
    # TenSEAL prints a warning to stdout when it splits a vector itself: it never had to.
    assert "does not fit" not in capfd.readouterr().out


def test_the_server_never_holds_or_receives_a_secret_key() -> None:
    fed = Federation(small_contributions())
    fed.run()
    holder = fed.clients[fed.server.key_holder]
    secret_key = holder._context.secret_key()  # the key holder's key, for the search below
    secret_context = context.secret_bytes(holder._context)
    assert fed.server.public_context and not context.load_context(fed.server.public_context).is_private()
    for data in fed.server_received:
        message = codec.decode(data, max_message_bytes=fed.server.max_message_bytes)
        if isinstance(message, CkksKeyDistribution):
            assert not context.load_context(message.public_context).is_private()
            assert len(message.public_context) < 1000  # parameters only: no key of any kind
        # Neither the serialised secret context nor any 64-byte window of it appears on the wire.
        assert secret_context[-4096:-4032] not in data
    for value in vars(fed.server).values():
        if isinstance(value, ts.Context):
            assert not value.is_private()
    assert secret_key is not None  # the key holder did hold one


def test_a_dropped_non_decryptor_does_not_stop_the_session() -> None:
    contributions = small_contributions()
    fed = Federation(contributions)
    fed.run(until="R2")
    holder = fed.server.key_holder
    victim = next(c for c in fed.ids if c != holder)
    fed = Federation(contributions)
    fed.run(drop={"R2": {victim}})
    result = fed.server.result()
    assert victim not in result.survivors
    assert all(victim not in s.decryptors for s in result.groups.values())
    survivors = set(fed.ids) - {victim}
    assert _max_error(_result_sums(fed), plain_sums(contributions, survivors)) <= 2.0**-24


def test_a_dropped_decryptor_is_replaced_by_another_survivor() -> None:
    contributions = small_contributions()
    probe = Federation(contributions)
    probe.run(until="R4")
    first = probe.requests_by_round["R4"]
    decryptor = next(cid for cid, m in first.items() if any(g.group == "all" for g in m.groups))
    fed = Federation(contributions)
    fed.run(drop={"R4": {decryptor}})
    result = fed.server.result()
    assert result.groups["all"].decryptors and decryptor not in result.groups["all"].decryptors
    assert decryptor in result.survivors  # its input was sent before it dropped and still counts
    assert _max_error(_result_sums(fed), plain_sums(contributions)) <= 2.0**-24


def test_a_client_rebuilt_by_replaying_the_server_messages_decrypts_as_the_original() -> None:
    # The deployment rebuilds a client session for every message from its seed and the server
    # messages so far.  TenSEAL keys cannot be seeded, so the key holder keeps no key: it opens its
    # own sealed copy in R2 like every peer, and a replayed R1 (a new, unused key) changes nothing.
    fed = Federation(small_contributions())
    fed.run()
    holder = fed.server.key_holder
    (decryptor,) = fed.server.result().groups["all"].decryptors
    for cid in {holder, decryptor}:
        original = fed.requests_by_round["R4"].get(cid)
        replayed = fed.new_client(cid)
        for round_name in ("R0", "R1"):
            replayed.receive(fed.requests_by_round[round_name][cid])
        for round_name in ("R2", "R3"):  # R2 received again would encrypt again: another upload
            replayed.replay_bytes(
                codec.encode(fed.requests_by_round[round_name][cid], max_message_bytes=1 << 30)
            )
        if original is None:
            continue
        (again,) = replayed.receive(original)
        for group in again.groups:
            got = fed.server.result().groups[group.group].sums
            for tensor, values in decrypted_tensors(fed.config, group).items():
                np.testing.assert_array_equal(values, got[tensor])


def test_replaying_answered_messages_makes_no_key_and_no_ciphertext_and_decrypts_as_the_original(
    monkeypatch,
) -> None:
    # replay_bytes (what the deployment's rebuilt clients use) moves the state without making the
    # replies again: no new key for a replayed R1, no encryption for a replayed R2.
    fed = Federation(small_contributions())
    fed.run()
    (decryptor,) = fed.server.result().groups["all"].decryptors
    holder = fed.server.key_holder
    limit = fed.server.max_message_bytes

    def forbidden(*args, **kwargs):
        raise AssertionError("a replayed message made a key or a ciphertext")

    for cid in {holder, decryptor}:
        client = fed.new_client(cid)
        with monkeypatch.context() as patched:
            patched.setattr(context, "new_secret_context", forbidden)
            patched.setattr(context, "encrypt", forbidden)
            for round_name in ("R0", "R1", "R2", "R3"):
                data = codec.encode(fed.requests_by_round[round_name][cid], max_message_bytes=limit)
                assert client.replay_bytes(data) is None
        assert client.state is CkksClientState.AWAIT_DECRYPT_REQUEST
        if cid != decryptor:
            continue
        (again,) = client.receive(fed.requests_by_round["R4"][cid])
        for group in again.groups:
            got = fed.server.result().groups[group.group].sums
            for tensor, values in decrypted_tensors(fed.config, group).items():
                np.testing.assert_array_equal(values, got[tensor])
    # The checks still run on a replay: a tampered R2 message fails the rebuilt client.
    client = fed.new_client(decryptor)
    for round_name in ("R0", "R1"):
        client.replay_bytes(
            codec.encode(fed.requests_by_round[round_name][decryptor], max_message_bytes=limit)
        )
    r2 = fed.requests_by_round["R2"][decryptor]
    tampered = dataclasses.replace(r2, signature=bytes(64))
    with pytest.raises(InvalidSignatureError):
        client.replay_bytes(codec.encode(tampered, max_message_bytes=limit))
    assert client.state is CkksClientState.FAILED


def test_a_group_with_no_survivor_left_to_decrypt_fails_clearly() -> None:
    fed = Federation(small_contributions())
    with pytest.raises(NoDecryptorError, match="class/0"):
        fed.run(drop={"R4": {"c0", "c2"}})  # both members of class/0


def test_a_key_holder_that_drops_before_sending_the_key_is_replaced_by_a_reelection() -> None:
    contributions = small_contributions()
    probe = Federation(contributions)
    probe.run(until="R1")
    holder = probe.server.key_holder
    fed = Federation(contributions)
    fed.run(drop={"R1": {holder}})
    result = fed.server.result()
    assert result.replaced_key_holders == (holder,)
    assert result.key_holder not in ("", holder)
    assert holder not in result.survivors and len(result.survivors) == 3
    survivors = set(fed.ids) - {holder}
    assert _max_error(_result_sums(fed), plain_sums(contributions, survivors)) <= 2.0**-24
    # The group the key holder left keeps its other member only: with a minimum group size of 2
    # the re-election itself aborts, before anything is encrypted.
    fed = Federation(contributions, min_group_size=2)
    with pytest.raises(GroupTooSmallError, match=f"without the key holder '{holder}'"):
        fed.run(drop={"R1": {holder}})
    # A single client whose key never comes: nobody is left to hold a key.
    alone = Federation({"c0": contributions["c0"]})
    with pytest.raises(KeyHolderDroppedError, match="no other advertised client is left"):
        alone.run(drop={"R1": {"c0"}})


def test_a_reelection_may_remove_the_silent_key_holder_and_nobody_else() -> None:
    fed = Federation(small_contributions())
    fed.run(until="R1")
    holder = fed.server.key_holder
    first = fed.requests_by_round["R1"]
    peers = [c for c in fed.ids if c != holder]
    for cid in peers:
        assert fed.clients[cid].receive(first[cid]) == []  # not the key holder: nothing to send
    # Removing another client than the key holder (the server choosing who holds the key) is refused.
    wrong = dataclasses.replace(
        first[peers[0]],
        advertisements=tuple(a for a in first[peers[0]].advertisements if a.client_id != peers[1]),
    )
    with pytest.raises(ServerProtocolError, match="less the key holder"):
        fed.clients[peers[0]].receive(wrong)
    assert fed.clients[peers[0]].state is CkksClientState.FAILED
    # The key holder itself is never asked again.
    assert len(fed.clients[holder].receive(first[holder])) == 1  # its key distribution
    right = dataclasses.replace(
        first[holder], advertisements=tuple(a for a in first[holder].advertisements if a.client_id != holder)
    )
    with pytest.raises(ServerProtocolError, match="not asked for a key again"):
        fed.clients[holder].receive(right)
    # Exactly the key holder removed: the remaining advertisements choose the next key holder, the
    # same one the server computes.
    replies = fed.clients[peers[1]].receive(right)
    assert fed.clients[peers[1]].state is CkksClientState.AWAIT_INPUT_REQUEST
    assert fed.clients[peers[1]]._key_holder != holder  # type: ignore[attr-defined]
    assert bool(replies) == (fed.clients[peers[1]]._key_holder == peers[1])  # type: ignore[attr-defined]


def test_corrupt_ciphertext_bytes_are_refused_by_the_server() -> None:
    fed = Federation(small_contributions())

    def corrupt(sender, message):
        if isinstance(message, CkksInput) and sender == "c1":
            tensor = message.tensors[0]
            chunk = bytearray(tensor.chunks[0])
            chunk[len(chunk) // 2] ^= 0x01
            bad = dataclasses.replace(tensor, chunks=(bytes(chunk), *tensor.chunks[1:]))
            return dataclasses.replace(message, tensors=(bad, *message.tensors[1:]))
        return message

    with pytest.raises(InvalidCiphertextError, match="c1"):
        fed.run(to_server=corrupt)


def test_a_signed_blob_that_is_no_ciphertext_is_refused() -> None:
    fed = Federation(small_contributions())

    def garbage(sender, message):
        if isinstance(message, CkksInput) and sender == "c1":
            tensors = tuple(
                EncryptedTensor(t.group, t.tensor, tuple(b"\x00" * 64 for _ in t.chunks))
                for t in message.tensors
            )
            domain, fields = binding.input_fields(
                message.session_id, fed.clients["c1"]._config_digest, "c1", tensors
            )
            signature = crypto.sign(fed.identities["c1"].private_key, domain, *fields)
            return CkksInput(message.session_id, "c1", tensors, signature)
        return message

    with pytest.raises(InvalidCiphertextError, match="not a CKKS ciphertext"):
        fed.run(to_server=garbage)


def _other_parameters(monkeypatch) -> None:
    other = CkksParameters(coeff_mod_bit_sizes=(60, 40, 60))  # a level fewer than the session's
    original = context.new_secret_context
    monkeypatch.setattr(context, "new_secret_context", lambda parameters: original(other))


def test_a_context_with_other_parameters_is_refused_by_the_server(monkeypatch) -> None:
    _other_parameters(monkeypatch)
    fed = Federation(small_contributions())
    with pytest.raises(InvalidContextError, match=r"coefficient moduli are \[60, 40, 60\]"):
        fed.run()


def test_a_context_with_other_parameters_is_refused_by_a_peer(monkeypatch) -> None:
    _other_parameters(monkeypatch)
    fed = Federation(small_contributions())
    fed.run(until="R1")
    holder = fed.server.key_holder
    (distribution,) = fed.clients[holder].receive(fed.requests_by_round["R1"][holder])
    peer = next(c for c in fed.ids if c != holder)
    fed.clients[peer].receive(fed.requests_by_round["R1"][peer])
    sealed = next(item for item in distribution.contexts if item.recipient == peer)
    request = CkksInputRequest(
        distribution.session_id,
        holder,
        distribution.public_context,
        distribution.secret_digest,
        distribution.signature,
        sealed,
    )
    with pytest.raises(InvalidContextError, match=r"coefficient moduli are \[60, 40, 60\]"):
        fed.clients[peer].receive(request)
    assert fed.clients[peer].state is CkksClientState.FAILED


def test_a_public_context_that_carries_the_secret_key_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(context, "public_bytes", context.secret_bytes)
    fed = Federation(small_contributions())
    with pytest.raises(InvalidContextError, match="secret key"):
        fed.run()
    assert fed.server.public_context == b""


def test_a_tampered_secret_context_fails_authentication_at_the_peer() -> None:
    fed = Federation(small_contributions())

    def tamper(recipient, message):
        if isinstance(message, CkksInputRequest) and message.context is not None:
            sealed = message.context
            flipped = bytes([sealed.ciphertext[0] ^ 1]) + sealed.ciphertext[1:]
            return dataclasses.replace(message, context=dataclasses.replace(sealed, ciphertext=flipped))
        return message

    with pytest.raises(InvalidContextError, match="fails authentication"):
        fed.run(to_client=tamper)


@pytest.mark.parametrize("how", ["unsigned", "other values"])
def test_an_unsigned_or_wrongly_signed_decryption_is_refused(how: str) -> None:
    fed = Federation(small_contributions())

    def forge(sender, message):
        if isinstance(message, CkksDecryption) and message.groups:
            group = message.groups[0]
            if how == "unsigned":
                group = dataclasses.replace(group, signature=bytes(64))
            else:
                chunk = group.chunks[0]
                values = np.frombuffer(chunk.data, dtype="<f8") + 1.0
                group = dataclasses.replace(
                    group, chunks=(dataclasses.replace(chunk, data=values.tobytes()), *group.chunks[1:])
                )
            return CkksDecryption(message.session_id, message.sender, (group, *message.groups[1:]))
        return message

    with pytest.raises(InvalidSignatureError, match="not signed by its decryptor"):
        fed.run(to_server=forge)


def test_a_decryptor_refuses_survivor_sets_that_isolate_a_client() -> None:
    # Groups a = {c0, c1, c3} and b = {c0, c1, c2} over one tensor isolate nobody; once c3 drops
    # before uploading, a = {c0, c1} and b - a is c2's value.  c2 itself checked before uploading
    # (nothing to see then): only the decryptor, who sees the survivors, can stop it.
    rng = np.random.default_rng(1)
    gram = {cid: (lambda h: h @ h.T)(rng.random((3, 3))) for cid in ("c0", "c1", "c2", "c3")}
    contributions = {
        "c0": {"a": {"gram": gram["c0"]}, "b": {"gram": gram["c0"]}},
        "c1": {"a": {"gram": gram["c1"]}, "b": {"gram": gram["c1"]}},
        "c2": {"b": {"gram": gram["c2"]}},
        "c3": {"a": {"gram": gram["c3"]}},
    }
    # Without the colluder bound (with it, c2 refuses in R1 already: b - a - c3 = c2 once c3 colludes).
    no_colluders = dataclasses.replace(ClientPolicy.deployment(), assume_colluders=False)
    fed = Federation(contributions, policy=no_colluders, min_group_size=2)
    with pytest.raises(ExposingDecryptionError, match="c2") as refused:
        fed.run(drop={"R2": {"c3"}})
    assert isinstance(refused.value, ExposureRefusedError)
    assert {c for f in refused.value.findings for c in f.clients} == {"c2"}
    reporting = Federation(contributions, min_group_size=1)  # the simulator's policy: go on, report
    reporting.run(drop={"R2": {"c3"}})
    findings = [
        f for client in reporting.clients.values() for f in client.exposure_findings if f.round == "R4"
    ]
    assert findings and all(f.clients == ("c2",) for f in findings)


def test_a_deployed_client_refuses_to_take_part_when_the_layout_isolates_it() -> None:
    rng = np.random.default_rng(2)
    gram = {cid: (lambda h: h @ h.T)(rng.random((3, 3))) for cid in ("c0", "c1", "c2")}
    contributions = {
        "c0": {"a": {"gram": gram["c0"]}, "b": {"gram": gram["c0"]}},
        "c1": {"a": {"gram": gram["c1"]}, "b": {"gram": gram["c1"]}},
        "c2": {"b": {"gram": gram["c2"]}},
    }
    fed = Federation(contributions, policy=ClientPolicy.deployment(), min_group_size=2)
    with pytest.raises(ExposureRefusedError, match="c2"):
        fed.run()
    # The first client to see the layout (every member checks every client's values) refused.
    assert fed.clients["c0"].state is CkksClientState.FAILED
    assert fed.server.public_context == b""  # refused before any key or input moved


def test_the_ledger_refuses_a_second_session_over_a_released_value() -> None:
    # Session 1 sums c0 + c1; session 2 asks c0 for the same Gram again (c0 + c2 and c1 + c2 would,
    # with session 1, give every value).  One contribution per value: c0 refuses in R0, before
    # anything leaves it, whatever the second layout is.
    rng = np.random.default_rng(3)
    gram = {cid: (lambda h: h @ h.T)(rng.random((3, 3))) for cid in ("c0", "c1", "c2")}
    ledger = MemoryLedger()
    no_colluders = dataclasses.replace(ClientPolicy.deployment(), assume_colluders=False)
    first = {"c0": {"a": {"gram": gram["c0"]}}, "c1": {"a": {"gram": gram["c1"]}}}
    fed = Federation(first, policy=no_colluders, min_group_size=2, ledgers={"c0": ledger})
    fed.run()
    first_session = fed.config.session_id
    second = {
        "c0": {"a": {"gram": gram["c0"]}},
        "c1": {"b": {"gram": gram["c1"]}},
        "c2": {"a": {"gram": gram["c2"]}, "b": {"gram": gram["c2"]}},
    }
    fed = Federation(second, policy=no_colluders, min_group_size=2, ledgers={"c0": ledger}, seed=b"second")
    with pytest.raises(ValueAlreadyReleasedError, match="a/gram") as refused:
        fed.run()
    assert refused.value.session_id == first_session
    # c0 answers R0 first (sorted ids): it refused before anything reached the server.
    assert fed.clients["c0"].state is CkksClientState.FAILED and fed.server_received == []


def test_a_decryptor_never_decrypts_one_group_twice() -> None:
    fed = Federation(small_contributions())
    fed.run(until="R4")
    decryptor, request = next(iter(fed.requests_by_round["R4"].items()))
    client = fed.clients[decryptor]
    client.receive(request)
    with pytest.raises(RepeatedDecryptionError):
        client.receive(request)


def test_a_decryption_request_with_foreign_bytes_is_refused() -> None:
    fed = Federation(small_contributions())
    fed.run(until="R4")
    decryptor, request = next(iter(fed.requests_by_round["R4"].items()))
    group = request.groups[0]
    upload = group.uploads[0]
    junk = dataclasses.replace(upload, chunks=(b"junk", *upload.chunks[1:]))
    bad = dataclasses.replace(group, uploads=(junk, *group.uploads[1:]))
    with pytest.raises(InvalidSumCiphertextError, match="not the ones it signed"):
        fed.clients[decryptor].receive(dataclasses.replace(request, groups=(bad,)))


@pytest.mark.parametrize("how", ["one upload alone", "one upload twice", "another group's chunks"])
def test_a_decryptor_decrypts_only_a_sum_it_computed_from_every_survivors_signed_upload(how: str) -> None:
    """The server sends one client's ciphertext in place of a group sum.  The decryptor receives
    the signed uploads and sums them itself: it refuses anything but all of them."""
    contributions = {
        cid: {"a": {"gram": np.eye(3) * (k + 1)}, "b": {"gram": np.eye(3) * (k + 1)}}
        for k, cid in enumerate(("c0", "c1", "c2"))
    }
    fed = Federation(contributions, min_group_size=2)
    fed.run(until="R4")
    decryptor, request = next(iter(fed.requests_by_round["R4"].items()))
    group = request.groups[0]
    victim = next(u for u in group.uploads if u.sender != decryptor)
    if how == "one upload alone":
        forged, error = dataclasses.replace(group, uploads=(victim,)), InconsistentSurvivorsError
    elif how == "one upload twice":
        forged, error = dataclasses.replace(group, uploads=(victim, victim, victim)), DuplicateClientError
    else:  # the victim's chunks of the other group, under this group's name: not what it signed here
        other = next(g for name, g in fed.server._requested.items() if name != group.group)
        theirs = next(u for u in other.uploads if u.sender == victim.sender)
        swapped = dataclasses.replace(victim, chunks=theirs.chunks)
        forged = dataclasses.replace(
            group, uploads=tuple(swapped if u.sender == victim.sender else u for u in group.uploads)
        )
        error = InvalidSumCiphertextError
    client = fed.clients[decryptor]
    with pytest.raises(error):
        client.receive(dataclasses.replace(request, groups=(forged,)))
    assert client.state is CkksClientState.FAILED and client._context is None  # the key is dropped


def test_a_key_holder_that_seals_another_secret_context_for_one_peer_is_caught_by_that_peer() -> None:
    """A malicious key holder gives one peer a different secret key (its public context
    and signature unchanged).  The key holder signs a digest of the secret context it seals; the
    peer checks its copy against it and refuses before encrypting anything."""
    from secure_afl.protocol.ckks.messages import CkksKeyDistribution

    fed = Federation(small_contributions())
    victims = []

    def other_context(sender, message):
        if not isinstance(message, CkksKeyDistribution):
            return message
        holder, keyholder = sender, fed.clients[sender]
        peer = next(c for c in fed.ids if c != holder)
        victims.append(peer)
        secret = context.secret_bytes(context.new_secret_context(fed.parameters))
        sealed = next(item for item in message.contexts if item.recipient == peer)
        shared = crypto.x25519_shared_secret(
            keyholder._encryption_key, keyholder._adverts[peer].encryption_public_key
        )
        key = binding.context_encryption_key(shared, message.session_id, holder, peer)
        associated = binding.context_associated_data(message.session_id, holder, peer, message.public_context)
        resealed = dataclasses.replace(
            sealed, ciphertext=crypto.encrypt_share(key, sealed.nonce, secret, associated)
        )
        return dataclasses.replace(
            message, contexts=tuple(resealed if c.recipient == peer else c for c in message.contexts)
        )

    with pytest.raises(InvalidContextError, match="not the one it committed to"):
        fed.run(to_server=other_context)
    assert fed.clients[victims[0]].state is CkksClientState.FAILED


def test_the_server_cannot_name_the_key_holder() -> None:
    fed = Federation(small_contributions())
    fed.run(until="R2")
    holder = fed.server.key_holder
    other = next(c for c in fed.ids if c != holder)
    request = fed.requests_by_round["R2"][other]
    with pytest.raises(ServerProtocolError, match="key holder"):
        fed.clients[other].receive(dataclasses.replace(request, key_holder=other))


def test_codec_round_trips_every_message_and_rejects_malformed_bytes() -> None:
    fed = Federation(small_contributions())
    fed.run()
    limit = fed.server.max_message_bytes
    messages = [codec.decode(data, max_message_bytes=limit) for data in fed.server_received]
    for round_requests in fed.requests_by_round.values():
        messages.extend(round_requests.values())
    kinds = {type(m).__name__ for m in messages}
    assert len(kinds) == 10  # every message type of the protocol
    for message in messages:
        data = codec.encode(message, max_message_bytes=limit)
        assert codec.decode(data, max_message_bytes=limit) == message
        with pytest.raises(MessageDecodeError):
            codec.decode(data[:-1], max_message_bytes=limit)
        with pytest.raises(MessageDecodeError):
            codec.decode(data + b"\x00", max_message_bytes=limit)
    masking = bytes([1]) + fed.server_received[0][1:]  # the masking codec's version byte
    with pytest.raises(MessageDecodeError, match="not a CKKS message"):
        codec.decode(masking)


@pytest.mark.parametrize(
    ("parameters", "match"),
    [
        (CkksParameters(poly_modulus_degree=4096), "poly_modulus_degree"),
        (CkksParameters(coeff_mod_bit_sizes=(60, 60, 60, 60)), "128-bit security"),
        (CkksParameters(scale_bits=90), "scale"),
    ],
)
def test_parameters_outside_the_accepted_range_are_refused(parameters: CkksParameters, match: str) -> None:
    with pytest.raises(InvalidParametersError, match=match):
        parameters.validate()


def test_group_survivors_in_decryption_signatures_bind_the_group() -> None:
    def relabel(sender, message):
        # A signature for one group presented for another is refused.
        if isinstance(message, CkksDecryption) and len(message.groups) >= 2:
            a, b = message.groups[:2]
            swapped = (
                DecryptedGroup(a.group, a.chunks, b.signature),
                DecryptedGroup(b.group, b.chunks, a.signature),
            )
            return CkksDecryption(message.session_id, message.sender, swapped + message.groups[2:])
        return message

    contributions = small_contributions(n_clients=2)  # one decryptor serves several groups
    fed = Federation(contributions)
    fed.run(until="R4")
    assert any(len(m.groups) >= 2 for m in fed.requests_by_round["R4"].values())
    fed = Federation(contributions)
    with pytest.raises(InvalidSignatureError):
        fed.run(to_server=relabel)
