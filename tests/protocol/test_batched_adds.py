"""R2's inputs are added to the sums a batch at a time: the same sums whatever the
batch, the inputs held as views of their messages until then, a rejected input never queued."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from secure_afl.core.errors import ClientProtocolError
from secure_afl.protocol import codec, server
from secure_afl.protocol.messages import MaskedInput

from .helpers import make_federation, play, play_round, wire

GROUPS = {"all": tuple(f"c{i}" for i in range(7)), "odd": ("c1", "c3", "c5")}
LENGTHS = {"x": 100_003, "y": 7}  # x spans several add slices (prg.CHUNK_WORDS), the last one short


def _sums(batch_bytes: int, monkeypatch: pytest.MonkeyPatch, drops=None) -> dict:
    monkeypatch.setattr(server, "ADD_BATCH_BYTES", batch_bytes)
    fed = make_federation(7, GROUPS, threshold=4, lengths=LENGTHS, seed=b"batched")
    play(fed, drops=drops)
    result = fed.server.result()
    return {(g, t): s.copy() for g, group in result.groups.items() for t, s in group.sums.items()}


@pytest.mark.parametrize("drops", [None, {"R2": {"c3"}}])
def test_the_sums_are_the_same_whatever_the_batch(drops, monkeypatch) -> None:
    one_at_a_time = _sums(1, monkeypatch, drops)  # every input added as it arrives
    two_inputs = _sums(2 * 8 * 100_010, monkeypatch, drops)  # a batch of about two clients
    all_at_close = _sums(1 << 40, monkeypatch, drops)  # everything added when R2 closes
    assert one_at_a_time.keys() == all_at_close.keys() == two_inputs.keys()
    for key, words in one_at_a_time.items():
        assert np.array_equal(words, all_at_close[key]) and np.array_equal(words, two_inputs[key])


def test_queued_inputs_are_views_of_their_messages_and_a_rejected_one_is_never_queued(monkeypatch) -> None:
    monkeypatch.setattr(server, "ADD_BATCH_BYTES", 1 << 40)
    fed = make_federation(7, GROUPS, threshold=4, lengths=LENGTHS, seed=b"batched")
    play(fed, until="R1")
    replies = {cid: fed.clients[cid].receive(wire(fed.requests[cid]))[0] for cid in sorted(fed.requests)}
    first = replies["c1"]
    data = codec.encode(first)
    fed.server.receive(codec.decode(data))
    queued = fed.server._pending
    assert sorted(queued) == [("all", "x"), ("all", "y"), ("odd", "x"), ("odd", "y")]
    assert all(np.shares_memory(words[0], np.frombuffer(data, dtype=np.uint8)) for words in queued.values())
    assert all(not total.any() for total in fed.server._sums.values())  # nothing added yet
    short = dataclasses.replace(
        replies["c2"], tensors=tuple(dataclasses.replace(t, data=t.data[:-8]) for t in replies["c2"].tensors)
    )
    with pytest.raises(ClientProtocolError, match="wrong length"):
        fed.server.receive(wire(short))
    assert sum(map(len, fed.server._pending.values())) == 4  # c1's four tensors only
    for cid in sorted(replies):
        if cid != "c1":
            fed.server.receive(wire(replies[cid]))
    fed.requests = fed.server.next_round()  # R2 closes: every queued input is added
    assert fed.server._pending == {} and fed.server._pending_bytes == 0
    for round_name in ("R3", "R4"):
        play_round(fed, round_name)
    expected = sum(fed.inputs[cid]["odd"]["y"] for cid in ("c1", "c3", "c5"))
    decoded = fed.server.result().groups["odd"].sums["y"]
    assert isinstance(first, MaskedInput) and decoded.shape == (7,)
    assert np.allclose(decoded.view(np.int64) / 2.0**32, expected, atol=1e-6)


def test_an_input_in_a_buffer_its_sender_may_still_change_is_copied_when_queued(monkeypatch) -> None:
    """A driver handing the server a MaskedInput whose words sit in a mutable buffer, then reusing
    that buffer, does not change the sums (the codec's own inputs are immutable bytes)."""
    monkeypatch.setattr(server, "ADD_BATCH_BYTES", 1 << 40)
    fed = make_federation(7, GROUPS, threshold=4, lengths=LENGTHS, seed=b"batched")
    play(fed, until="R1")
    buffers = []
    for cid, request in sorted(fed.requests.items()):
        reply = wire(fed.clients[cid].receive(wire(request))[0])
        mutable = tuple(dataclasses.replace(t, data=bytearray(t.data)) for t in reply.tensors)
        buffers += [t.data for t in mutable]
        fed.server.receive(dataclasses.replace(reply, tensors=mutable))
    for buffer in buffers:
        buffer[:] = bytes(len(buffer))  # the driver reuses its buffers before R2 closes
    fed.requests = fed.server.next_round()
    for round_name in ("R3", "R4"):
        play_round(fed, round_name)
    expected = sum(fed.inputs[cid]["odd"]["y"] for cid in ("c1", "c3", "c5"))
    decoded = fed.server.result().groups["odd"].sums["y"]
    assert np.allclose(decoded.view(np.int64) / 2.0**32, expected, atol=1e-6)
