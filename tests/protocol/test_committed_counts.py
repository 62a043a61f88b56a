"""Committed counts: a member committing 0 rows to a group is a known value.

Each member signs, in its advertisement, how many rows it releases in each group.  Every client's
exposure check removes the members that committed 0 from a group's sum (their value, zero, is known
to the server, as a colluder's), and a session whose values come from fewer than c + 2 members with
rows is refused.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from secure_afl.core import encoding
from secure_afl.core.errors import (
    ExposureRefusedError,
    IncrementTooSmallError,
    LocalProtocolError,
    ServerProtocolError,
)
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.protocol import ClientSession, binding, codec, crypto
from secure_afl.protocol.binding import advertisement_signed_by

from .helpers import make_federation, play, play_round

POLICY = dataclasses.replace(ClientPolicy.deployment(), max_colluders=1)  # c = 1 for n = 4
NO_COLLUDERS = dataclasses.replace(ClientPolicy.deployment(), max_colluders=0)


def _committed(groups, rows, *, zeros=(), policy=POLICY):
    """A federation of four whose clients commit ``rows[cid]`` rows to every group they join
    (None: no commitment); the clients in ``zeros`` send zeros (they have no rows)."""
    fed = make_federation(4, groups, threshold=3, min_group_size=2, policy=policy)
    for cid in fed.clients:
        if cid in zeros:
            fed.inputs[cid] = {
                g: {t: np.zeros_like(v) for t, v in ts.items()} for g, ts in fed.inputs[cid].items()
            }
        fed.clients[cid] = ClientSession(
            cid, fed.identities[cid], fed.roster, fed.inputs[cid], min_threshold=3, min_group_size=2,
            random=DeterministicRandomSource(cid.encode()), policy=policy,
            rows=None if rows[cid] is None else dict.fromkeys(fed.inputs[cid], rows[cid]),
        )  # fmt: skip
    return fed


def _refusals(fed, round_name: str) -> dict[str, Exception]:
    """Play R0 .. ``round_name``; the exception each client raised on the last round's message."""
    for earlier in ("R0", "R1", "R2", "R3", "R4"):
        if earlier == round_name:
            break
        play_round(fed, earlier)
    out = {}
    for cid, request in sorted(fed.requests.items()):
        try:
            fed.clients[cid].receive(codec.decode(codec.encode(request)))
        except Exception as exc:
            out[cid] = exc
    return out


LAYOUT = {"a": ("c0", "c1"), "b": ("c2", "c3")}


def test_a_member_committing_zero_rows_is_a_known_value_in_every_clients_check() -> None:
    # c0 has no rows: group a's sum is c1's value alone.  Every client refuses (each reports any
    # client the sums determine, c0 and b's members protecting c1 too).
    fed = _committed(LAYOUT, {"c0": 0, "c1": 9, "c2": 4, "c3": 7}, zeros={"c0"}, policy=NO_COLLUDERS)
    refused = _refusals(fed, "R1")
    assert {cid: type(e) for cid, e in refused.items()} == dict.fromkeys(fed.clients, ExposureRefusedError)
    assert all("value of 'x' for c1" in str(e) for e in refused.values())
    # The advertisement carries the counts under the member's signature: altered, it is refused.
    advert = next(a for a in fed.server._adverts.values() if a.client_id == "c0")
    key = fed.roster.public_key("c0")
    assert advert.rows == (0,) and advertisement_signed_by(advert, key)
    assert not advertisement_signed_by(dataclasses.replace(advert, rows=(3,)), key)
    assert not advertisement_signed_by(dataclasses.replace(advert, rows=()), key)


def test_the_same_layout_without_the_zero_goes_through() -> None:
    """The negative control: the same layout and values, c0 with rows (or nobody committing)."""
    for rows in ({"c0": 2, "c1": 9, "c2": 4, "c3": 7}, dict.fromkeys(("c0", "c1", "c2", "c3"))):
        fed = _committed(LAYOUT, rows, policy=NO_COLLUDERS)
        play(fed)
        total = fed.server.result().groups["a"].sums["x"]
        expected = sum(
            encoding.encode(fed.inputs[c]["a"]["x"], tensor="x", group_size=2) for c in ("c0", "c1")
        )
        np.testing.assert_array_equal(total, expected)


def test_an_increment_from_fewer_than_c_plus_2_members_is_refused_by_everyone() -> None:
    fed = _committed(
        {"all": ("c0", "c1", "c2", "c3")}, {"c0": 5, "c1": 7, "c2": 0, "c3": 0}, zeros={"c2", "c3"}
    )
    refused = _refusals(fed, "R1")
    assert {cid: type(e) for cid, e in refused.items()} == dict.fromkeys(fed.clients, IncrementTooSmallError)
    assert "only 2 member(s) ['c0', 'c1'] release rows" in str(refused["c2"])
    # c + 2 = 3 members with rows: the sum is released, the zeros included.
    fed = _committed({"all": ("c0", "c1", "c2", "c3")}, {"c0": 5, "c1": 7, "c2": 1, "c3": 0}, zeros={"c3"})
    play(fed)
    expected = sum(encoding.encode(fed.inputs[c]["all"]["y"], tensor="y", group_size=4) for c in fed.clients)
    np.testing.assert_array_equal(fed.server.result().groups["all"].sums["y"], expected)


def test_committed_counts_are_checked_locally_and_on_the_wire() -> None:
    fed = make_federation(4, {"all": ("c0", "c1", "c2", "c3")}, threshold=3, min_group_size=2, policy=POLICY)
    cid = "c0"
    make = lambda rows: ClientSession(  # noqa: E731
        cid, fed.identities[cid], fed.roster, fed.inputs[cid], policy=POLICY, rows=rows
    )
    with pytest.raises(LocalProtocolError, match="one count a group"):
        make({"other": 3})
    with pytest.raises(LocalProtocolError, match="inputs are not zero"):
        make({"all": 0})  # a zero commitment over values that are not zero would be a lie
    with pytest.raises(LocalProtocolError, match="must be a count"):
        make({"all": -1})
    # an advertisement whose counts do not match its groups is refused in R1
    fed = _committed({"all": ("c0", "c1", "c2", "c3")}, dict.fromkeys(("c0", "c1", "c2", "c3"), 3))
    play_round(fed, "R0")
    request = fed.requests["c1"]
    # altered, its signature fails; signed so by a broken client, the counts' shape is refused
    forged = next(a for a in request.advertisements if a.client_id == "c3")
    forged = dataclasses.replace(forged, rows=(3, 3))
    domain, fields = binding.advertise_fields(
        forged.session_id, forged.client_id, forged.encryption_public_key, forged.mask_public_key,
        forged.self_mask_commitment, forged.config_digest, forged.groups, forged.rows,
    )  # fmt: skip
    forged = dataclasses.replace(
        forged, signature=crypto.sign(fed.identities["c3"].private_key, domain, *fields)
    )
    bad = tuple(forged if a.client_id == "c3" else a for a in request.advertisements)
    with pytest.raises(ServerProtocolError, match="committed counts"):
        fed.clients["c1"].receive(dataclasses.replace(request, advertisements=bad))
