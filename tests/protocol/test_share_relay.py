"""The server's share path read and written a column at a time: the same bytes as the
share-by-share path, and every malformed share refused with the error that path gives."""

from __future__ import annotations

import dataclasses
import gc
import hashlib

import pytest

from secure_afl.core.errors import (
    ClientProtocolError,
    InvalidShareError,
    LocalProtocolError,
    MessageDecodeError,
)
from secure_afl.protocol import codec, shamir
from secure_afl.protocol.messages import (
    EncryptedShare,
    EncryptedShares,
    MaskedInputRequest,
    RevealedShare,
    RevealedShares,
    ShareKeys,
    UnmaskResponse,
)

from .helpers import make_federation, play, play_round

SID = bytes(range(32))

# SHA-256 of every message the server sent (then of every message either way) in three sessions,
# computed with main's share-by-share code at a9df92b (2026-12-02), before the column paths.
GOLDEN = {
    8: (
        "8320c4fb863742a21aca0e6acaed908c33e2d1203ffd849e46b83d922c8abebf",
        "5ee3b3032fe516ff7930237ccdf7ed83f49213a7a89b0e7bcbf8f702e96b6d96",
    ),
    12: (
        "2c84e031d7e40a563c32849c6e91b18b5e3218e0916fe3d275f5c80af4ebee1d",
        "7bdd7f59f9bc89ba4bb52b1e4fa8448540ce9db805bae486d25eb0e3672dc137",
    ),
    5: (
        "f76d030dbd1fa76a5548310a5430bbf477e4cbde4f94c0071832f5a036523546",
        "bb9cdd9220aa9474789fa4d0bd4bdaf48fe9ae7e97adc54f6810a8a98e758063",
    ),
}
DROPS = {8: {"R2": {"c3"}}, 12: {"R2": {"c5", "c11"}}, 5: None}


def _string(value: str) -> bytes:
    raw = value.encode("utf-8")
    return len(raw).to_bytes(2, "big") + raw


def reference_encoding(message: ShareKeys | MaskedInputRequest | UnmaskResponse) -> bytes:
    """The wire format written out field by field, independently of the codec."""
    out = [bytes([codec.PROTOCOL_VERSION])]
    if isinstance(message, ShareKeys | MaskedInputRequest):
        out += [bytes([4 if isinstance(message, ShareKeys) else 5]), message.session_id]
        if isinstance(message, ShareKeys):
            out.append(_string(message.sender))
        out.append(len(message.shares).to_bytes(4, "big"))
        for share in message.shares:
            out += [_string(share.sender), _string(share.recipient), share.nonce, share.ciphertext]
    else:
        out += [bytes([10]), message.session_id, _string(message.sender)]
        for part in (message.self_mask_shares, message.mask_key_shares):
            out.append(len(part).to_bytes(4, "big"))
            for item in part:
                out += [_string(item.owner), item.value]
    return b"".join(out)


def share_keys(sender: str, recipients: list[str]) -> ShareKeys:
    return ShareKeys(
        SID,
        sender,
        tuple(
            EncryptedShare(
                sender, r, bytes([k % 256]) * 12, hashlib.sha256(r.encode()).digest() * 4 + bytes(20)
            )
            for k, r in enumerate(recipients)
        ),
    )


def revealed(owners: list[str]) -> UnmaskResponse:
    items = tuple(RevealedShare(o, (k * 7919).to_bytes(66, "big")) for k, o in enumerate(owners))
    return UnmaskResponse(SID, "site-0000", items, items[:2])


UNIFORM = [f"site-{k:04d}" for k in range(1, 40)]
MIXED = [f"c{k}" for k in range(12)]  # c0..c9 then c10, c11: not one layout
UNICODE = ["hôpital-1", "hôpital-2", "Klinik-ß"]
SAMPLES = [
    share_keys("site-0000", UNIFORM),
    MaskedInputRequest(
        SID,
        tuple(
            dataclasses.replace(s, sender=s.recipient, recipient="site-0000")
            for s in share_keys("x", UNIFORM).shares
        ),
    ),
    share_keys("c0", MIXED),
    share_keys("hôpital-0", UNICODE),
    revealed(UNIFORM),
    revealed(MIXED),
    revealed(UNICODE),
]


def without_column_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """The share-by-share path only (what main did), for comparing bytes and errors."""
    monkeypatch.setattr(codec, "_uniform_encrypted_shares", lambda *args: None)
    monkeypatch.setattr(codec, "_uniform_revealed_shares", lambda *args: None)
    monkeypatch.setattr(codec, "_PREFIXED_NAMES", _NoNames())


class _NoNames(dict):
    """A name cache that keeps nothing: every share's names are written by the field writers."""

    def __setitem__(self, key: str, value: bytes) -> None:
        pass


def decode_error(data: bytes) -> str | None:
    try:
        codec.decode(data)
    except MessageDecodeError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.mark.parametrize("n", sorted(GOLDEN))
def test_server_messages_are_byte_identical_to_mains(n: int) -> None:
    ids = tuple(f"c{i}" for i in range(n))
    fed = make_federation(n, groups={"a": ids, "b": ids[::2]}, seed=b"relay-golden")
    play(fed, drops=DROPS[n])
    sent = hashlib.sha256()
    every = hashlib.sha256()
    for direction, _, _, message in fed.log:
        data = codec.encode(message)
        every.update(data)
        if direction == "to-client":
            sent.update(data)
    assert (sent.hexdigest(), every.hexdigest()) == GOLDEN[n]
    assert sorted(fed.server.result().groups) == ["a", "b"]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_column_paths_write_and_read_the_reference_bytes(message, monkeypatch) -> None:
    data = codec.encode(message)
    assert data == reference_encoding(message)
    decoded = codec.decode(data)
    assert decoded == message
    if isinstance(message, UnmaskResponse):
        pairs = list(zip(decoded.self_mask_shares, message.self_mask_shares, strict=True))
    else:
        pairs = list(zip(decoded.shares, message.shares, strict=True))
    for item, original in pairs:  # built a column at a time: the same plain, frozen items
        assert type(item) is type(original) and item == original and hash(item) == hash(original)
        assert all(type(getattr(item, f.name)) in (str, bytes) for f in dataclasses.fields(item))
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(pairs[0][0], dataclasses.fields(pairs[0][0])[0].name, "x")
    monkeypatch.setattr(codec, "_UNPACK_ITEMS", 7)  # unpacked in chunks, the last one partial
    assert codec.decode(data) == message
    assert codec.encode(message) == data  # the names now from the cache
    monkeypatch.setattr(codec, "_PREFIXED_NAMES", {})
    monkeypatch.setattr(codec, "_PREFIXED_NAMES_MAX", 3)  # cleared again and again
    assert codec.encode(message) == data
    assert len(codec._PREFIXED_NAMES) <= 3
    without_column_paths(monkeypatch)
    assert codec.encode(message) == data
    assert codec.decode(data) == message


def _corruptions(data: bytes, names: list[str]) -> list[bytes]:
    """Truncations, a name made empty, too long, invalid UTF-8 or of another length in one item,
    a count too large, and trailing bytes."""
    out = [data[:cut] for cut in range(len(data) - 1, 30, -13)]
    for name in (names[1], names[-1]):
        at = data.index(name.encode()) - 2
        size = len(name.encode())
        out += [
            data[:at] + (0).to_bytes(2, "big") + data[at + 2 :],
            data[:at] + (256).to_bytes(2, "big") + data[at + 2 :],
            data[:at] + (size + 1).to_bytes(2, "big") + data[at + 2 :],
            data[:at] + (size - 1).to_bytes(2, "big") + data[at + 2 :],
            data[: at + 2] + b"\xff" + data[at + 3 :],
        ]
    count = data.index(len(names).to_bytes(4, "big"), 34)
    out.append(data[:count] + (len(names) + 1).to_bytes(4, "big") + data[count + 4 :])
    out.append(data + b"\x00")
    return out


@pytest.mark.parametrize("message", [SAMPLES[0], SAMPLES[4]], ids=["shares", "revealed"])
def test_malformed_share_sequences_are_refused_with_the_share_by_share_error(message, monkeypatch) -> None:
    data = codec.encode(message)
    bad = _corruptions(data, UNIFORM)
    fast = [decode_error(item) for item in bad]
    without_column_paths(monkeypatch)
    slow = [decode_error(item) for item in bad]
    assert fast == slow
    assert all(error is not None and error.startswith("MessageDecodeError") for error in fast)
    assert any("UTF-8" in error for error in fast) and any("truncated" in error for error in fast)


def test_malformed_shares_are_a_local_error_when_encoding(monkeypatch) -> None:
    good = share_keys("site-0000", UNIFORM[:3])
    cases = [
        (dataclasses.replace(good.shares[1], nonce=bytes(11)), "nonce must be exactly 12 bytes"),
        (dataclasses.replace(good.shares[1], ciphertext=bytearray(148)), "share ciphertext must be"),
        (dataclasses.replace(good.shares[1], recipient=""), "must be 1..255"),
        (dataclasses.replace(good.shares[1], recipient="x" * 256), "must be 1..255"),
        (dataclasses.replace(good.shares[1], recipient="\ud800"), "UTF-8|surrogate"),
        (dataclasses.replace(good.shares[1], sender=b"site-0000"), "expected a string"),
        (RevealedShare("site-0001", bytes(66)), "expected EncryptedShare"),
    ]
    for bad, match in cases:
        message = dataclasses.replace(good, shares=(good.shares[0], bad, good.shares[2]))
        with pytest.raises((LocalProtocolError, UnicodeEncodeError), match=match):
            codec.encode(message)


def _at_r1(n: int = 5):
    fed = make_federation(n, threshold=3)
    play_round(fed, "R0")
    replies = {cid: fed.clients[cid].receive(fed.requests[cid])[0] for cid in sorted(fed.requests)}
    return fed, replies


def test_server_refuses_relayed_shares_that_are_not_one_to_every_other_client() -> None:
    """Through the wire, so the column decoder built the shares: duplicated, unknown, missing or
    misattributed shares are refused with the server's specific errors, and change nothing."""
    fed, replies = _at_r1()
    mine = replies["c0"]
    shares = mine.shares
    cases = [
        ((*shares[:-1], shares[0]), "exactly one share to every other client"),  # duplicate
        ((*shares[:-1], dataclasses.replace(shares[-1], recipient="nobody")), "exactly one share"),
        (shares[:-1], "exactly one share"),  # one missing
        ((*shares, dataclasses.replace(shares[0], recipient="c0")), "exactly one share"),  # to itself
        ((dataclasses.replace(shares[0], sender="c1"), *shares[1:]), "under another sender's name"),
    ]
    for bad, match in cases:
        message = codec.decode(codec.encode(dataclasses.replace(mine, shares=bad)))
        with pytest.raises(ClientProtocolError, match=match):
            fed.server.receive(message)
    for cid in sorted(replies):
        fed.server.receive(codec.decode(codec.encode(replies[cid])))
    requests = fed.server.next_round()
    for cid, request in requests.items():
        assert [share.sender for share in request.shares] == [c for c in sorted(replies) if c != cid]
        assert {share.recipient for share in request.shares} == {cid}
        expected = tuple(
            s for c in sorted(replies) if c != cid for s in replies[c].shares if s.recipient == cid
        )
        assert request.shares == expected


def test_relay_leaves_out_clients_that_sent_no_shares() -> None:
    fed, replies = _at_r1()
    for cid in ("c0", "c1", "c3", "c4"):  # c2 advertised but sent no shares
        fed.server.receive(codec.decode(codec.encode(replies[cid])))
    requests = fed.server.next_round()
    assert sorted(requests) == ["c0", "c1", "c3", "c4"]
    for cid, request in requests.items():
        assert [share.sender for share in request.shares] == [c for c in ("c0", "c1", "c3", "c4") if c != cid]
        assert all(share.recipient == cid for share in request.shares)


def test_server_refuses_revealed_shares_of_other_owners_or_out_of_the_field() -> None:
    fed = make_federation(5, threshold=3)
    play(fed, until="R3", drops={"R2": {"c4"}})
    replies = {cid: fed.clients[cid].receive(fed.requests[cid])[0] for cid in sorted(fed.requests)}
    first = replies["c0"]
    items = first.self_mask_shares
    keys = first.mask_key_shares
    assert [k.owner for k in keys] == ["c4"]
    cases = [
        (dict(self_mask_shares=items[::-1]), ClientProtocolError, "survivors' self-mask shares"),
        (dict(self_mask_shares=items[:-1]), ClientProtocolError, "survivors' self-mask shares"),
        (dict(self_mask_shares=items + items[:1]), ClientProtocolError, "survivors' self-mask shares"),
        (dict(mask_key_shares=()), ClientProtocolError, "dropped clients' key shares"),
        (
            dict(mask_key_shares=(dataclasses.replace(keys[0], value=shamir.PRIME.to_bytes(66, "big")),)),
            InvalidShareError,
            "not a field element",
        ),
    ]
    for change, error, match in cases:
        message = codec.decode(codec.encode(dataclasses.replace(first, **change)))
        with pytest.raises(error, match=match):
            fed.server.receive(message)
    for cid in sorted(replies):
        fed.server.receive(codec.decode(codec.encode(replies[cid])))
    fed.server.next_round()
    result = fed.server.result()
    assert result.survivors == ("c0", "c1", "c2", "c3")


def test_lagrange_basis_of_small_points_equals_the_textbook_one() -> None:
    p = shamir.PRIME

    def textbook(xs: list[int], at: int) -> tuple[int, ...]:
        out = []
        for i, x_i in enumerate(xs):
            num = den = 1
            for j, x_j in enumerate(xs):
                if i != j:
                    num = num * (at - x_j) % p
                    den = den * (x_i - x_j) % p
            out.append(num * pow(den, -1, p) % p)
        return tuple(out)

    for xs, at in (
        ([3, 1, 7, 2, 40], 0),
        (list(range(1, 60)), 0),
        ([5, 9, 11], 4),
        ([5, 9, 11], 9),
        ([7, 0, 3], 0),
        ([2, 3], 2**40),
    ):
        assert shamir.lagrange_coefficients(xs, at) == textbook(xs, at)
    big = [p - 1, 5, 2**300]
    assert shamir.lagrange_coefficients(big) == textbook([x % p for x in big], 0)


# --- shares held a column at a time (EncryptedShares, RevealedShares) ------------------------------


def test_share_columns_read_as_the_tuple_of_their_items() -> None:
    items = share_keys("site-0000", UNIFORM[:5]).shares
    columns = EncryptedShares.of(items)
    assert len(columns) == 5 and tuple(columns) == items
    assert columns[0] == items[0] and columns[-1] == items[-1] and columns[1:3] == items[1:3]
    assert columns == items and items == columns and hash(columns) == hash(items)
    assert columns != items[:4] and columns != items[::-1] and columns != list(items)
    assert columns.payloads[2] == items[2].nonce + items[2].ciphertext
    revealed_items = revealed(UNIFORM[:4]).self_mask_shares
    revealed_columns = RevealedShares.of(revealed_items)
    assert tuple(revealed_columns) == revealed_items == revealed_columns
    assert revealed_columns[1:] == revealed_items[1:] and hash(revealed_columns) == hash(revealed_items)
    # Built wrongly, they refuse at once rather than at the encoder.
    with pytest.raises(ValueError, match="one entry per share"):
        EncryptedShares(("a",), ("b", "c"), (bytes(160),))
    with pytest.raises(TypeError, match="must be tuples"):
        EncryptedShares(["a"], ("b",), (bytes(160),))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected EncryptedShare"):
        EncryptedShares.of([RevealedShare("a", bytes(66))])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="nonce must be exactly 12 bytes"):
        EncryptedShares.of([dataclasses.replace(items[0], nonce=bytes(11))])
    with pytest.raises(ValueError, match="one entry per share"):
        RevealedShares(("a", "b"), (bytes(66),))


def test_share_columns_encode_to_the_bytes_of_their_items_or_give_their_items_error() -> None:
    for message in (SAMPLES[0], SAMPLES[1], SAMPLES[2], SAMPLES[3]):
        columns = dataclasses.replace(message, shares=EncryptedShares.of(message.shares))
        assert codec.encode(columns) == codec.encode(message) == reference_encoding(message)
    good = EncryptedShares.of(share_keys("site-0000", UNIFORM[:3]).shares)
    bad_columns = [
        (dict(payloads=(*good.payloads[:2], bytes(159))), "share ciphertext must be"),
        (dict(payloads=(*good.payloads[:2], bytearray(160))), "nonce must be exactly 12 bytes"),
        (dict(recipients=(*good.recipients[:2], "")), "must be 1..255"),
        (dict(recipients=(*good.recipients[:2], "x" * 256)), "must be 1..255"),
        (dict(recipients=(*good.recipients[:2], "\ud800")), "UTF-8|surrogate"),
        (dict(senders=(*good.senders[:2], b"site-0000")), "expected a string"),
    ]
    for change, match in bad_columns:
        message = ShareKeys(SID, "site-0000", dataclasses.replace(good, **change))
        with pytest.raises((LocalProtocolError, UnicodeEncodeError), match=match):
            codec.encode(message)


def _tracked_below(root: object) -> int:
    """How many objects reachable from ``root`` the cyclic collector tracks (root included; classes
    are not followed)."""
    seen: set[int] = set()
    stack = [root]
    count = 0
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, type) or not gc.is_tracked(item):
            continue
        seen.add(id(item))
        count += 1
        stack.extend(gc.get_referents(item))
    return count


def test_decoded_and_relayed_shares_are_a_few_objects_the_collector_tracks() -> None:
    """n² shares pass through the server (10⁶ at n = 1,000): held as columns of strings and bytes,
    a message of 400 shares is a handful of tracked objects, not one or more per share."""
    names = [f"site-{k:04d}" for k in range(1, 401)]
    for message in (share_keys("site-0000", names), revealed(names)):
        decoded = codec.decode(codec.encode(message))
        gc.collect()  # tuples of strings and bytes are untracked at the first collection they survive
        assert _tracked_below(decoded) < 12
    fed, replies = _at_r1(6)
    for cid in sorted(replies):
        fed.server.receive(codec.decode(codec.encode(replies[cid])))
    requests = fed.server.next_round()
    gc.collect()
    assert all(type(request.shares) is EncryptedShares for request in requests.values())
    assert all(_tracked_below(request) < 12 for request in requests.values())


def test_server_takes_shares_handed_over_in_process_as_tuples_or_refuses_them_unchanged() -> None:
    fed, replies = _at_r1()
    mine = replies["c0"]
    assert type(mine.shares) is tuple  # the client builds items; the codec reads columns
    for bad in (
        (*mine.shares[:-1], RevealedShare("c4", bytes(66))),
        (*mine.shares[:-1], dataclasses.replace(mine.shares[-1], nonce=bytes(13))),
    ):
        with pytest.raises(ClientProtocolError, match="malformed shares"):
            fed.server.receive(dataclasses.replace(mine, shares=bad))
    for cid in sorted(replies):
        fed.server.receive(replies[cid])  # as tuples, not through the wire
    direct = fed.server.next_round()
    fed_wire, replies_wire = _at_r1()
    for cid in sorted(replies_wire):
        fed_wire.server.receive(codec.decode(codec.encode(replies_wire[cid])))
    wire = fed_wire.server.next_round()
    assert sorted(direct) == sorted(wire)
    assert all(codec.encode(direct[cid]) == codec.encode(wire[cid]) for cid in direct)
