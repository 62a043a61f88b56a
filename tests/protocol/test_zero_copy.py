"""R2 without copies: the same bytes on the wire, the same keys, the same sums.

A client masks its words straight into its message's frame (:class:`codec.MaskedInputFrame`), the
decoder hands the server read-only views of the received bytes, the server unmasks its sums in
place, and HKDF's extract step runs once per secret.  The golden digests below were computed with
``main``'s code (a9df92b, before this change) on the same deterministic federation.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_afl.core.errors import LocalProtocolError, MessageDecodeError
from secure_afl.protocol import codec, prg
from secure_afl.protocol.messages import MaskedInput, MaskedTensor

from .helpers import make_federation

# sha256 over every client's R2 bytes, and over the server's unmasked sums (main, a9df92b).
GOLDEN_R2 = "5ee34d8faf1545cb73815b64fe0a6eab526b1ab7c0b5e3128bb14d39c65d47c8"
GOLDEN_SUMS = "3ff4f68969f82a2b0cc155af7f58289d6fa692e194c99e072c724d38e16dc8e6"


def _wire_session() -> tuple[str, str, list[MaskedInput]]:
    """Every round through bytes (receive_bytes, codec.decode); c2 drops at R2, so the server
    also rebuilds pairwise masks.  The Gram of 40,000 words spans two add_masks chunks and its
    words start at an offset that is not a multiple of 8."""
    fed = make_federation(
        4,
        {"all": ("c0", "c1", "c2", "c3"), "odd-group": ("c0", "c1", "c3")},
        lengths={"gram": 40000, "b7": 3},
        seed=b"zero-copy golden",
    )
    limit = fed.server.max_message_bytes
    r2 = hashlib.sha256()
    decoded: list[MaskedInput] = []
    requests = dict.fromkeys(fed.clients, fed.server.start())
    for round_name in ("R0", "R1", "R2", "R3", "R4"):
        for cid, request in sorted(requests.items()):
            if cid == "c2" and round_name >= "R2":
                continue
            for reply in fed.clients[cid].receive_bytes(codec.encode(request, max_message_bytes=limit)):
                message = codec.decode(reply, max_message_bytes=limit)
                if round_name == "R2":
                    r2.update(reply)
                    assert isinstance(message, MaskedInput)
                    decoded.append(message)
                fed.server.receive(message)
        requests = fed.server.next_round()
    sums = hashlib.sha256()
    for _, group_sum in sorted(fed.server.result().groups.items()):
        for _, words in sorted(group_sum.sums.items()):
            sums.update(words.tobytes())
    return r2.hexdigest(), sums.hexdigest(), decoded


def test_r2_bytes_and_sums_are_mains() -> None:
    r2, sums, decoded = _wire_session()
    assert r2 == GOLDEN_R2
    assert sums == GOLDEN_SUMS
    assert len(decoded) == 3


def test_decoded_words_are_read_only_views_of_the_message() -> None:
    message = MaskedInput(bytes(32), "c0", (MaskedTensor("g", "odd", bytes(range(8)) * 5),))
    data = codec.encode(message)
    item = codec.decode(data).tensors[0]  # type: ignore[attr-defined]
    assert isinstance(item.data, memoryview) and item.data.readonly
    words = np.frombuffer(item.data, dtype="<u8")
    assert np.shares_memory(words, np.frombuffer(data, dtype=np.uint8))
    assert not words.flags.writeable
    assert item.data == message.tensors[0].data
    assert codec.encode(codec.decode(data)) == data  # a decoded message encodes to the same bytes


def test_truncated_words_keep_their_error() -> None:
    data = codec.encode(MaskedInput(bytes(32), "c0", (MaskedTensor("g", "t", bytes(16)),)))
    with pytest.raises(MessageDecodeError, match="truncated message: needed 16 bytes"):
        codec.decode(data[:-1])
    bad = bytearray(data)
    bad[-20:-16] = (12).to_bytes(4, "big")
    with pytest.raises(MessageDecodeError, match="whole number of uint64 words"):
        codec.decode(bytes(bad))


def test_encoding_refuses_words_that_are_not_whole_bytes() -> None:
    for data in (bytearray(8), np.zeros(1, dtype=np.uint64), memoryview(bytes(16))[::2], bytes(12)):
        with pytest.raises(LocalProtocolError, match="whole uint64 words"):
            codec.encode(MaskedInput(bytes(32), "c0", (MaskedTensor("g", "t", data),)))  # type: ignore[arg-type]


names = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FF), min_size=1, max_size=9)


@settings(max_examples=60, deadline=None)
@given(
    names,
    st.lists(st.tuples(names, names, st.integers(0, 40)), max_size=4),
    st.randoms(use_true_random=False),
)
def test_frame_gives_the_bytes_encode_gives(sender: str, layout: list, rnd) -> None:
    session_id = rnd.randbytes(32)
    contents = [rnd.randbytes(8 * n) for _, _, n in layout]
    frame = codec.MaskedInputFrame(session_id, sender, layout)
    for index, content in enumerate(contents):
        view = frame.words(index)
        assert view.flags.writeable and view.shape == (len(content) // 8,)
        view[:] = np.frombuffer(content, dtype="<u8")
        del view
    data, message = frame.finish()
    expected = MaskedInput(
        session_id,
        sender,
        tuple(MaskedTensor(g, t, c) for (g, t, _), c in zip(layout, contents, strict=True)),
    )
    assert data == codec.encode(expected)
    assert message == expected
    assert codec.decode(data) == expected
    with pytest.raises(LocalProtocolError, match="finished"):
        frame.finish()


def test_frame_keeps_the_encoders_checks_and_errors() -> None:
    layout = [("g", "t", 4)]
    expected = MaskedInput(bytes(32), "c0", (MaskedTensor("g", "t", bytes(32)),))
    size = len(codec.encode(expected))
    with pytest.raises(LocalProtocolError, match=f"message of {size} bytes exceeds the limit of {size - 1}"):
        codec.MaskedInputFrame(bytes(32), "c0", layout, max_message_bytes=size - 1)
    with pytest.raises(LocalProtocolError, match=f"message of {size} bytes exceeds the limit of {size - 1}"):
        codec.encode(expected, max_message_bytes=size - 1)
    with pytest.raises(LocalProtocolError, match="session id must be exactly 32 bytes"):
        codec.MaskedInputFrame(bytes(31), "c0", layout)
    with pytest.raises(LocalProtocolError, match="UTF-8 bytes"):
        codec.MaskedInputFrame(bytes(32), "c0", [("x" * 256, "t", 1)])
    with pytest.raises(LocalProtocolError, match="whole uint64 words"):
        codec.MaskedInputFrame(bytes(32), "c0", [("g", "t", -1)])
    with pytest.raises(LocalProtocolError, match="does not fit in 4 bytes"):
        codec.MaskedInputFrame(bytes(32), "c0", [("g", "t", 1 << 29)])
    # A view still alive at finish: the bytes are copied, never different.
    frame = codec.MaskedInputFrame(bytes(32), "c0", layout)
    kept = frame.words(0)
    kept[:] = 7
    data, _ = frame.finish()
    kept[:] = 9
    assert data == codec.encode(
        MaskedInput(bytes(32), "c0", (MaskedTensor("g", "t", np.full(4, 7, "<u8").tobytes()),))
    )


@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=1, max_size=64), st.binary(min_size=32, max_size=32), names, names, names, names)
def test_extract_once_gives_the_same_keys(
    secret: bytes, session_id: bytes, group: str, tensor: str, a: str, b: str
) -> None:
    prk = prg.key_prk(secret)
    assert prg.self_mask_key_from_prk(prk, session_id, group, tensor, a) == prg.self_mask_key(
        secret, session_id, group, tensor, a
    )
    for x, y in ((a, b), (b, a)):
        assert prg.pair_mask_key_from_prk(prk, session_id, group, tensor, x, y) == prg.pair_mask_key(
            secret, session_id, group, tensor, x, y
        )


@pytest.mark.parametrize("n_words", [0, 1, prg.CHUNK_WORDS - 1, prg.CHUNK_WORDS + 5])
@pytest.mark.parametrize("offset", [0, 3])
def test_add_masks_into_an_unaligned_view_from_a_base(n_words: int, offset: int) -> None:
    rng = np.random.default_rng(n_words + offset)
    base = rng.integers(0, 2**64 - 1, size=n_words, dtype=np.uint64, endpoint=True)
    keys = [(bytes([k]) * 32, 1 if k % 2 else -1) for k in range(3)]
    expected = base.copy()
    for key, sign in keys:
        mask = prg.mask_words(key, n_words)
        expected = expected + mask if sign > 0 else expected - mask
    buffer = bytearray(8 * n_words + offset)
    target = np.frombuffer(buffer, dtype="<u8", count=n_words, offset=offset)
    prg.add_masks(target, keys, base=base)
    assert target.tobytes() == expected.tobytes()
    in_place = base.copy()
    prg.add_masks(in_place, keys)
    assert in_place.tobytes() == expected.tobytes()
    plain = np.frombuffer(bytearray(8 * n_words + offset), dtype="<u8", count=n_words, offset=offset)
    prg.add_masks(plain, [], base=base)
    assert plain.tobytes() == base.tobytes()
    with pytest.raises(ValueError, match="base must be a uint64 array"):
        prg.add_masks(target, keys, base=base.astype(np.int64))
