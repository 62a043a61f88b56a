"""A group's decryption split by chunk over m of its survivors (SECURITY.md §7.6).

Each decryptor receives, from every surviving member, only its chunks of the group (with the
digests of all the member's chunks and its signature), checks them against the signed digests and
decrypts their sums; the server assembles the group's sum from the chunk sums.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from secure_afl.core.errors import ClientProtocolError, ConflictingAnswerError, InconsistentSurvivorsError
from secure_afl.protocol.ckks import codec, context
from secure_afl.protocol.ckks.errors import (
    ConflictingDecryptionError,
    IncompleteDecryptionError,
    InvalidChunkSetError,
    InvalidSumCiphertextError,
    RepeatedDecryptionError,
)
from secure_afl.protocol.ckks.messages import (
    CkksDecryption,
    CkksDecryptRequest,
    CkksViewRequest,
    GroupUploads,
    SignedUpload,
)
from secure_afl.protocol.ckks.server import assemble_group_sums
from secure_afl.protocol.ckks.state import CkksClientState

from .helpers import Federation, plain_sums, small_contributions
from .test_ckks_one_view import LIMIT, _deliver, _federation, _refuses, _sign, _sign_as, _views

LONG = 2 * 4096 + 17  # three ciphertexts at N = 8192: "all" has 1 (gram) + 3 (long) = 4 chunks


def _grid(fed: Federation) -> float:
    return 2.0**-fed.parameters.output_frac_bits


def _all_error(fed: Federation, contributions: dict, survivors: set[str] | None = None) -> float:
    want = plain_sums(contributions, survivors)["all"]
    got = fed.server.result().groups["all"].sums
    return max(
        float(np.max(np.abs(fed.layout.unflatten(name, np.asarray(got[name])) - want[name]))) for name in want
    )


def _chunk_request(
    fed: Federation, view: CkksViewRequest, signatures, group: str, chunks: tuple[int, ...]
) -> CkksDecryptRequest:
    """R4 over ``view`` for ``chunks`` of ``group``, built as the server slices a chunk set."""
    senders = {e.sender for e in view.uploads}
    full = fed.server._requested[group]
    uploads = tuple(
        SignedUpload(
            u.sender, u.digests, u.signature, tuple(u.chunks[k] for k in chunks if k < len(u.chunks))
        )
        for u in full.uploads
        if u.sender in senders
    )
    return CkksDecryptRequest(
        view.session_id, view.uploads, tuple(signatures), (GroupUploads(group, chunks, uploads),)
    )


def test_split_decryption_gives_the_sums_and_each_decryptor_receives_only_its_chunks() -> None:
    contributions = small_contributions(long_length=LONG)
    fed = Federation(contributions)
    fed.run()
    all_group = fed.server.result().groups["all"]
    # m = min(S_g, C_g) = min(4, 4): four decryptors, one chunk each.
    assert len(all_group.chunk_decryptors) == 4 and len(all_group.decryptors) == 4
    assert _all_error(fed, contributions) <= _grid(fed)
    requests = fed.requests_by_round["R4"]
    for cid, request in requests.items():
        item = next(g for g in request.groups if g.group == "all")
        assert len(item.chunks) == 1 and all(len(u.chunks) == 1 for u in item.uploads)
        assert all_group.chunk_decryptors[item.chunks[0]] == cid
        # Its ciphertext bytes: S_g * 1 chunk, a quarter of the group (the digests of all chunks stay).
        assert sum(len(c) for u in item.uploads for c in u.chunks) == sum(
            len(u.chunks[item.chunks[0]]) for u in fed.server._requested["all"].uploads
        )
    # The whole group decrypted by one member (the cap m = 1, as before the split): the same sums.
    whole = Federation(contributions, max_decryptors_per_group=1)
    whole.run()
    (decryptor,) = whole.server.result().groups["all"].decryptors
    item = next(g for g in whole.requests_by_round["R4"][decryptor].groups if g.group == "all")
    assert item.chunks == (0, 1, 2, 3) and all(len(u.chunks) == 4 for u in item.uploads)
    assert _all_error(whole, contributions) <= _grid(whole)
    split, one = fed.server.result().groups["all"].sums, whole.server.result().groups["all"].sums
    assert all(np.max(np.abs(split[t] - one[t])) <= 2 * _grid(fed) for t in split)


def test_a_dropped_chunk_decryptor_is_replaced_and_the_sum_is_still_complete() -> None:
    contributions = small_contributions(long_length=LONG)
    probe = Federation(contributions)
    probe.run(until="R4")
    dropped = next(cid for cid, r in probe.requests_by_round["R4"].items() if r.groups[0].group == "all")
    fed = Federation(contributions)
    fed.run(drop={"R4": {dropped}})
    all_group = fed.server.result().groups["all"]
    assert dropped not in all_group.chunk_decryptors and len(all_group.chunk_decryptors) == 4
    assert _all_error(fed, contributions) <= _grid(fed)  # its input still counts


def test_a_decryptor_refuses_a_chunk_that_is_not_the_one_the_member_signed_at_that_index() -> None:
    fed = Federation(small_contributions(long_length=LONG))
    fed.run(until="R4")
    decryptor, request = next(
        (c, r) for c, r in fed.requests_by_round["R4"].items() if r.groups[0].group == "all"
    )
    item = request.groups[0]
    (k,) = item.chunks
    victim = next(u for u in fed.server._requested["all"].uploads if u.sender != decryptor)
    other = victim.chunks[(k + 1) % 4]  # a ciphertext the member did sign, at another index
    forged = dataclasses.replace(
        item,
        uploads=tuple(
            dataclasses.replace(u, chunks=(other,)) if u.sender == victim.sender else u for u in item.uploads
        ),
    )
    client = fed.clients[decryptor]
    with pytest.raises(InvalidSumCiphertextError, match=f"not the ones it signed \\(chunk {k}"):
        client.receive(dataclasses.replace(request, groups=(forged, *request.groups[1:])))
    assert client.state is CkksClientState.FAILED and client._context is None


@pytest.mark.parametrize(
    ("chunks", "error", "match"),
    [
        ((2,), InvalidChunkSetError, r"has chunks 0\.\.1"),  # "all" has 2 chunks: gram and rows
        ((), InvalidChunkSetError, "names no chunk"),
        ((1, 0), InvalidChunkSetError, "must increase"),
        ((0, 0), RepeatedDecryptionError, "named twice"),
    ],
)
def test_a_chunk_set_outside_the_group_or_malformed_is_refused(chunks, error, match) -> None:
    fed = _federation(4)
    s1, _ = _views(fed, "c3")
    (signatures,) = _sign(fed, dict.fromkeys(fed.ids, s1)).values()
    _refuses(fed, "c0", _chunk_request(fed, s1, signatures, "all", chunks), error, match)


def test_a_chunk_is_decrypted_once_per_decryptor_under_the_one_view_and_never_under_another() -> None:
    fed = _federation(4)
    s1, s2 = _views(fed, "c3")
    (signatures,) = _sign(fed, dict.fromkeys(fed.ids, s1)).values()
    (reply,) = _deliver(fed, "c0", _chunk_request(fed, s1, signatures, "all", (0,)))
    assert isinstance(reply, CkksDecryption) and [c.index for c in reply.groups[0].chunks] == [0]
    # Another chunk of the group under the same view: answered (a replacement's chunk set).
    (reply,) = _deliver(fed, "c0", _chunk_request(fed, s1, signatures, "all", (1,)))
    assert [c.index for c in reply.groups[0].chunks] == [1]
    # Another decryptor asked for chunk 0 decrypts the same sum.
    (again,) = _deliver(fed, "c1", _chunk_request(fed, s1, signatures, "all", (0,)))
    # A chunk this decryptor decrypted already, even with a new one: refused.
    _refuses(
        fed, "c0", _chunk_request(fed, s1, signatures, "all", (0, 1)), RepeatedDecryptionError, r"\[0, 1\]"
    )
    # Under another view: c1 signed S1, so S2 is refused whatever the chunks ...
    _refuses(
        fed,
        "c1",
        _chunk_request(fed, s2, signatures, "all", (1,)),
        InconsistentSurvivorsError,
        "signed in R3",
    )
    # ... and a copy of c0 rebuilt holding S2 (its R3 replayed, which records nothing), with a
    # quorum over S2, is refused by the ledger's R4 record (the view of every chunk it decrypted).
    copy = fed.rebuilt_client("c0", ("R0", "R1", "R2"), LIMIT)
    copy.replay_bytes(codec.encode(s2, max_message_bytes=LIMIT))
    fed.clients["c0"] = copy
    quorum = [_sign_as(fed, c, s2) for c in ("c0", "c1", "c2")]
    _refuses(fed, "c0", _chunk_request(fed, s2, quorum, "all", (0,)), ConflictingAnswerError, "R4")
    assert again.groups[0].chunks[0].index == 0


def test_the_server_assembles_the_sum_and_refuses_a_missing_or_conflicting_chunk() -> None:
    parameters = Federation(small_contributions()).parameters
    layout = context.group_chunks({"b": 3, "long": parameters.slots + 2}, parameters)
    assert layout == (("b", 0, 3), ("long", 0, parameters.slots), ("long", 1, 2))
    parts = [np.arange(3.0), np.ones(parameters.slots), np.array([5.0, 6.0])]
    decrypted = [("c1", 2, parts[2]), ("c0", 0, parts[0]), ("c2", 1, parts[1])]
    sums, who = assemble_group_sums("g", layout, decrypted)
    np.testing.assert_array_equal(sums["long"], np.concatenate(parts[1:]))
    np.testing.assert_array_equal(sums["b"], parts[0])
    assert who == ("c0", "c2", "c1") and not sums["b"].flags.writeable
    # The same chunk twice with the same values (a replacement decrypts the same sum): accepted.
    assert assemble_group_sums("g", layout, [*decrypted, ("c3", 2, parts[2].copy())])[1] == who
    with pytest.raises(ConflictingDecryptionError, match="'c1' and 'c3' decrypted chunk 2"):
        assemble_group_sums("g", layout, [*decrypted, ("c3", 2, parts[2] + 2.0**-20)])
    with pytest.raises(IncompleteDecryptionError, match=r"chunk\(s\) \[1\] have no decrypted sum"):
        assemble_group_sums("g", layout, [d for d in decrypted if d[1] != 1])
    with pytest.raises(IncompleteDecryptionError, match="returned chunk 2 with 3 values"):
        assemble_group_sums("g", layout, [*decrypted[:2], ("c2", 2, np.zeros(3))])


def test_the_server_refuses_a_decryption_of_other_chunks_than_it_asked_for() -> None:
    fed = Federation(small_contributions(long_length=LONG))

    def shift(sender, message):
        if isinstance(message, CkksDecryption):
            group = message.groups[0]
            chunk = dataclasses.replace(group.chunks[0], index=(group.chunks[0].index + 1) % 4)
            return dataclasses.replace(
                message, groups=(dataclasses.replace(group, chunks=(chunk,)), *message.groups[1:])
            )
        return message

    with pytest.raises(ClientProtocolError, match="it was asked for"):
        fed.run(to_server=shift)


def test_a_decryptor_rebuilt_by_replay_remembers_the_chunks_it_decrypted() -> None:
    # The deployment rebuilds a client for every message by replaying the server's messages, its
    # earlier R4 requests included: the rebuilt client knows which chunks it already decrypted.
    fed = _federation(4)
    s1, _ = _views(fed, "c3")
    (signatures,) = _sign(fed, dict.fromkeys(fed.ids, s1)).values()
    first = _chunk_request(fed, s1, signatures, "all", (0,))
    (original,) = _deliver(fed, "c0", first)

    def rebuilt():  # type: ignore[no-untyped-def]
        copy = fed.new_client("c0")
        for message in (*(fed.requests_by_round[r]["c0"] for r in ("R0", "R1", "R2")), s1, first):
            copy.replay_bytes(codec.encode(message, max_message_bytes=LIMIT))
        fed.clients["c0"] = copy
        return copy

    rebuilt()
    (reply,) = _deliver(fed, "c0", _chunk_request(fed, s1, signatures, "all", (1,)))
    assert [c.index for c in reply.groups[0].chunks] == [1]
    rebuilt()
    _refuses(fed, "c0", first, RepeatedDecryptionError, r"chunk\(s\) \[0\]")
    assert original.groups[0].chunks[0].index == 0
