"""The wire codec: round trips, and strict rejection of anything malformed (property-based)."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_afl.core.errors import LocalProtocolError, MessageDecodeError
from secure_afl.protocol import codec, shamir
from secure_afl.protocol.messages import (
    AdvertiseKeys,
    AdvertiseRequest,
    ConsistencyCheckRequest,
    ConsistencyResponse,
    EncryptedShare,
    GroupSpec,
    MaskedInput,
    MaskedInputRequest,
    MaskedTensor,
    RevealedShare,
    SessionConfig,
    ShareKeys,
    ShareKeysRequest,
    SurvivorSignature,
    TensorSpec,
    UnmaskRequest,
    UnmaskResponse,
)

from .helpers import make_federation, play


@functools.cache
def session_messages() -> tuple:
    """One real message of every type, from a session with a dropout."""
    fed = make_federation(4, {"a": ("c0", "c1", "c2"), "all": ("c0", "c1", "c2", "c3")}, threshold=3)
    play(fed, drops={"R2": {"c3"}})
    return tuple(message for _, _, _, message in fed.log)


def fixed(n: int):
    return st.binary(min_size=n, max_size=n)


names = st.text(min_size=1, max_size=12)
name_tuples = st.lists(names, max_size=4).map(tuple)
u32 = st.integers(min_value=0, max_value=2**32 - 1)
session_ids = fixed(32)

configs = st.builds(
    SessionConfig,
    session_ids,
    u32,
    u32,
    st.integers(min_value=0, max_value=255),
    st.lists(
        st.builds(GroupSpec, names, st.lists(st.builds(TensorSpec, names, u32), max_size=3).map(tuple)),
        max_size=3,
    ).map(tuple),
)
adverts = st.builds(
    AdvertiseKeys, session_ids, names, fixed(32), fixed(32), fixed(32), fixed(32), name_tuples, fixed(64)
)
encrypted = st.builds(EncryptedShare, names, names, fixed(12), fixed(codec.SHARE_CIPHERTEXT_BYTES))
revealed = st.lists(st.builds(RevealedShare, names, fixed(shamir.VALUE_BYTES)), max_size=3).map(tuple)
messages = st.one_of(
    st.builds(AdvertiseRequest, configs),
    adverts,
    st.builds(ShareKeysRequest, session_ids, st.lists(adverts, max_size=3).map(tuple)),
    st.builds(ShareKeys, session_ids, names, st.lists(encrypted, max_size=3).map(tuple)),
    st.builds(MaskedInputRequest, session_ids, st.lists(encrypted, max_size=3).map(tuple)),
    st.builds(
        MaskedInput,
        session_ids,
        names,
        st.lists(
            st.builds(MaskedTensor, names, names, st.integers(0, 8).flatmap(lambda n: fixed(8 * n))),
            max_size=3,
        ).map(tuple),
    ),
    st.builds(ConsistencyCheckRequest, session_ids, name_tuples),
    st.builds(ConsistencyResponse, session_ids, names, fixed(64)),
    st.builds(
        UnmaskRequest,
        session_ids,
        name_tuples,
        st.lists(st.builds(SurvivorSignature, names, fixed(64)), max_size=3).map(tuple),
        name_tuples,
        name_tuples,
    ),
    st.builds(UnmaskResponse, session_ids, names, revealed, revealed),
)


def test_every_message_type_of_a_real_session_round_trips() -> None:
    seen = set()
    for message in session_messages():
        assert codec.decode(codec.encode(message)) == message
        seen.add(type(message))
    assert len(seen) == 10


@settings(max_examples=300, deadline=None)
@given(messages)
def test_generated_messages_round_trip(message) -> None:
    data = codec.encode(message)
    assert codec.decode(data) == message
    assert codec.encode(codec.decode(data)) == data


@settings(max_examples=300, deadline=None)
@given(messages, st.data())
def test_truncated_messages_are_rejected(message, data) -> None:
    encoded = codec.encode(message)
    cut = data.draw(st.integers(min_value=0, max_value=len(encoded) - 1))
    with pytest.raises(MessageDecodeError):
        codec.decode(encoded[:cut])


@settings(max_examples=300, deadline=None)
@given(messages, st.binary(min_size=1, max_size=64))
def test_extended_messages_are_rejected(message, extra) -> None:
    with pytest.raises(MessageDecodeError):
        codec.decode(codec.encode(message) + extra)


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_are_rejected_or_canonical(data) -> None:
    try:
        message = codec.decode(data)
    except MessageDecodeError:
        return
    assert codec.encode(message) == data  # only exact, canonical encodings are ever accepted


@settings(max_examples=300, deadline=None)
@given(
    st.integers(min_value=0, max_value=255), st.integers(min_value=0, max_value=255), st.binary(max_size=300)
)
def test_random_bodies_after_any_header_are_rejected_or_canonical(version, tag, body) -> None:
    data = bytes([version, tag]) + body
    try:
        message = codec.decode(data)
    except MessageDecodeError:
        return
    assert version == codec.PROTOCOL_VERSION and codec.encode(message) == data


def test_real_messages_truncated_at_every_length_are_rejected() -> None:
    for message in session_messages():
        encoded = codec.encode(message)
        for cut in range(0, len(encoded), max(1, len(encoded) // 200)):
            with pytest.raises(MessageDecodeError):
                codec.decode(encoded[:cut])


def test_oversized_messages_are_rejected() -> None:
    masked = next(m for m in session_messages() if isinstance(m, MaskedInput))
    encoded = codec.encode(masked)
    with pytest.raises(MessageDecodeError, match="exceeds"):
        codec.decode(encoded, max_message_bytes=len(encoded) - 1)
    with pytest.raises(LocalProtocolError, match="exceeds"):
        codec.encode(masked, max_message_bytes=len(encoded) - 1)
    assert codec.decode(encoded, max_message_bytes=len(encoded)) == masked


def test_unknown_version_and_type_are_rejected() -> None:
    encoded = codec.encode(session_messages()[0])
    with pytest.raises(MessageDecodeError, match="version"):
        codec.decode(bytes([2]) + encoded[1:])
    with pytest.raises(MessageDecodeError, match="unknown masking protocol message type"):
        codec.decode(encoded[:1] + bytes([99]) + encoded[2:])


def test_huge_sequence_counts_are_rejected_before_allocation() -> None:
    data = bytes([codec.PROTOCOL_VERSION, 7]) + bytes(32) + (2**32 - 1).to_bytes(4, "big")
    with pytest.raises(MessageDecodeError, match="cannot fit"):
        codec.decode(data)


def test_invalid_utf8_and_empty_strings_are_rejected() -> None:
    good = codec.encode(ConsistencyResponse(bytes(32), "c0", bytes(64)))
    bad_utf8 = good[:34] + (2).to_bytes(2, "big") + b"\xff\xfe" + good[38:]
    with pytest.raises(MessageDecodeError, match="UTF-8"):
        codec.decode(bad_utf8)
    empty = good[:34] + (0).to_bytes(2, "big") + good[38:]
    with pytest.raises(MessageDecodeError):
        codec.decode(empty)


def test_share_sequences_refuse_a_bad_name_or_a_cut_inside_any_item() -> None:
    """The share and revealed-share sequences are read in one loop (n² items at n = 1,000): a bad
    name or a cut in the second item raises the field readers' errors."""
    shares = tuple(EncryptedShare("a", f"r{k}", bytes(12), bytes(148)) for k in range(3))
    encoded = codec.encode(ShareKeys(bytes(32), "a", shares))
    second = encoded.index(b"r1") - 2  # the second share's recipient
    bad_utf8 = encoded[:second] + (2).to_bytes(2, "big") + b"\xff\xfe" + encoded[second + 4 :]
    with pytest.raises(MessageDecodeError, match="UTF-8"):
        codec.decode(bad_utf8)
    empty = encoded[:second] + (0).to_bytes(2, "big") + encoded[second + 4 :]
    with pytest.raises(MessageDecodeError):
        codec.decode(empty)
    revealed = UnmaskResponse(bytes(32), "a", tuple(RevealedShare(f"o{k}", bytes(66)) for k in range(3)), ())
    data = codec.encode(revealed)
    owner = data.index(b"o1") - 2
    with pytest.raises(MessageDecodeError, match="UTF-8"):
        codec.decode(data[:owner] + (2).to_bytes(2, "big") + b"\xff\xfe" + data[owner + 4 :])
    for message in (ShareKeys(bytes(32), "a", shares), revealed):
        data = codec.encode(message)
        assert codec.decode(data) == message
        for cut in range(len(data) - 1, 0, -7):
            with pytest.raises(MessageDecodeError):
                codec.decode(data[:cut])
    for bad in (
        EncryptedShare("a", "r", bytes(11), bytes(148)),
        EncryptedShare("a", "", bytes(12), bytes(148)),
        EncryptedShare("a", "x" * 256, bytes(12), bytes(148)),
    ):
        with pytest.raises(LocalProtocolError):
            codec.encode(ShareKeys(bytes(32), "a", (shares[0], bad)))


def test_masked_tensor_length_must_be_whole_words() -> None:
    message = MaskedInput(bytes(32), "c0", (MaskedTensor("g", "t", bytes(8)),))
    encoded = bytearray(codec.encode(message))
    encoded[-12:-8] = (7).to_bytes(4, "big")
    with pytest.raises(MessageDecodeError, match="words"):
        codec.decode(bytes(encoded[:-1]))


@pytest.mark.parametrize(
    "message",
    [
        ConsistencyResponse(bytes(31), "c0", bytes(64)),
        ConsistencyResponse(bytes(32), "", bytes(64)),
        ConsistencyResponse(bytes(32), "x" * 256, bytes(64)),
        ConsistencyCheckRequest(bytes(32), ["c0"]),  # type: ignore[arg-type]
        MaskedInput(bytes(32), "c0", (MaskedTensor("g", "t", bytes(7)),)),
        AdvertiseRequest(SessionConfig(bytes(32), -1, 1, 32, ())),
    ],
)
def test_encoding_malformed_messages_is_a_local_error(message) -> None:
    with pytest.raises(LocalProtocolError):
        codec.encode(message)


def test_non_message_cannot_be_encoded() -> None:
    with pytest.raises(LocalProtocolError):
        codec.encode("hello")  # type: ignore[arg-type]


# --- the size limit follows the session's layout -----------------------------------------------


def _layout_config(groups: dict[str, dict[str, int]]) -> SessionConfig:
    return SessionConfig(
        bytes(32),
        2,
        1,
        32,
        tuple(
            GroupSpec(g, tuple(TensorSpec(t, length) for t, length in tensors.items()))
            for g, tensors in groups.items()
        ),
    )


def _masked_input_for(config: SessionConfig, *, sender: str = "c0", extra_words: int = 0) -> MaskedInput:
    tensors = [
        MaskedTensor(group.name, tensor.name, bytes(8 * tensor.length))
        for group in config.groups
        for tensor in group.tensors
    ]
    if extra_words:
        last = tensors[-1]
        tensors[-1] = MaskedTensor(last.group, last.tensor, last.data + bytes(8 * extra_words))
    return MaskedInput(bytes(32), sender, tuple(tensors))


def test_every_real_message_fits_the_layout_bound() -> None:
    messages = session_messages()
    config = messages[0].config
    limit = codec.max_message_bytes(config, 4)
    assert all(len(codec.encode(m, max_message_bytes=limit)) <= limit for m in messages)


def test_the_layout_bound_is_exact_for_the_largest_masked_input() -> None:
    # Longest names everywhere: the bound is exactly the size of a MaskedInput of every tensor.
    g, t, sender = "g" * 255, "t" * 255, "c" * 255
    config = _layout_config({g: {t: 1000, "u" * 255: 7}, "h" * 255: {t: 3}})
    limit = codec.max_message_bytes(config, 4)
    message = _masked_input_for(config, sender=sender)
    assert len(codec.encode(message, max_message_bytes=limit)) == limit
    assert codec.decode(codec.encode(message, max_message_bytes=limit), max_message_bytes=limit) == message
    # One word more than the layout allows is above the bound and refused.
    too_long = _masked_input_for(config, sender=sender, extra_words=1)
    oversize = codec.encode(too_long, max_message_bytes=2 * limit)
    assert len(oversize) == limit + 8
    with pytest.raises(MessageDecodeError, match="exceeds"):
        codec.decode(oversize, max_message_bytes=limit)
    with pytest.raises(LocalProtocolError, match="exceeds"):
        codec.encode(too_long, max_message_bytes=limit)


def test_the_layout_bound_grows_with_the_roster_for_per_client_messages() -> None:
    config = _layout_config({"g": {"t": 1}})
    small, large = codec.max_message_bytes(config, 3), codec.max_message_bytes(config, 300)
    assert large > small
    adverts = tuple(
        AdvertiseKeys(bytes(32), f"{i:0>255}", *(bytes(32),) * 4, ("g",), bytes(64)) for i in range(300)
    )
    request = codec.encode(ShareKeysRequest(bytes(32), adverts), max_message_bytes=large)
    assert len(request) <= large


def test_vgg_layout_exceeds_the_old_fixed_cap_and_the_bound_covers_it() -> None:
    # VGG features: d = 4096, one Gram triangle is 8,390,656 words (67 MB); sent to 4 class groups.
    d = 4096
    big = {f"class{c}": {"gram": d * (d + 1) // 2, "b": d} for c in range(4)}
    limit = codec.max_message_bytes(_layout_config(big), 8)
    assert limit > codec.DEFAULT_MAX_MESSAGE_BYTES
    # The exact size of the MaskedInput, extrapolated from a small one with the same names: each
    # word is 8 bytes and nothing else depends on the lengths.
    small = {g: {"gram": 3, "b": 2} for g in big}
    small_size = len(codec.encode(_masked_input_for(_layout_config(small))))
    words = {
        name: sum(sum(t.values()) for t in layout.values())
        for name, layout in (("big", big), ("small", small))
    }
    exact = small_size + 8 * (words["big"] - words["small"])
    assert exact > codec.DEFAULT_MAX_MESSAGE_BYTES
    assert exact <= limit < exact + 10_000  # framing only: names are bounded at 255 bytes


def test_sessions_expose_the_layout_bound() -> None:
    fed = make_federation(4, lengths={"x": 50})
    limit = codec.max_message_bytes(fed.config, 4)
    assert fed.server.max_message_bytes == limit
    client = fed.clients["c0"]
    assert client.max_message_bytes == client.incoming_message_limit == client.policy.max_config_bytes
    play(fed, until="R0")
    # Per message type: the share-keys request grows with clients and groups, not tensor lengths.
    limits = codec.message_limits(fed.config, 4, groups=client.groups)
    assert client.incoming_message_limit == limits[ShareKeysRequest] < limit
    assert client.max_message_bytes == max(limits.values())  # one bound for every type: own groups
    assert limit == max(codec.message_limits(fed.config, 4).values())
    assert limits[MaskedInput] == codec.message_limits(fed.config, 4)[MaskedInput]  # c0 is in every group


def test_a_tensor_too_long_for_one_field_is_refused() -> None:
    config = _layout_config({"g": {"t": codec.MAX_TENSOR_WORDS + 1}})
    with pytest.raises(LocalProtocolError, match="does not fit"):
        codec.max_message_bytes(config, 2)
