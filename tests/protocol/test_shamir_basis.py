"""Shamir recovery with one Lagrange basis per share-holder set, against the textbook
interpolation it replaced, and the roster's cached share points."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_afl.core.errors import LocalProtocolError
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.keys.roster import Roster, RosterEntry
from secure_afl.protocol import shamir


def _textbook(shares: list[shamir.Share], at: int) -> int:
    """The per-call interpolation the server ran before: one inverse per share, for every owner."""
    total = 0
    for i, share_i in enumerate(shares):
        numerator, denominator = 1, 1
        for j, share_j in enumerate(shares):
            if i != j:
                numerator = numerator * (at - share_j.x) % shamir.PRIME
                denominator = denominator * (share_i.x - share_j.x) % shamir.PRIME
        total = (total + share_i.y * numerator * pow(denominator, -1, shamir.PRIME)) % shamir.PRIME
    return total


@settings(max_examples=60, deadline=None)
@given(
    xs=st.lists(st.integers(1, 10**6), min_size=1, max_size=12, unique=True),
    ys=st.lists(st.integers(0, shamir.PRIME - 1), min_size=12, max_size=12),
    at=st.integers(0, 10**6),
)
def test_interpolation_equals_the_textbook_one(xs: list[int], ys: list[int], at: int) -> None:
    shares = [shamir.Share(x, y) for x, y in zip(xs, ys, strict=False)]
    assert shamir.interpolate(shares, at) == _textbook(shares, at)


def test_one_basis_recovers_every_owner_as_before() -> None:
    random = DeterministicRandomSource(b"basis")
    holders = [3, 7, 8, 11, 20, 21, 40]
    secrets = [int.from_bytes(random.token_bytes(32), "big") for _ in range(25)]
    shared = [shamir.split(s, len(holders), holders, random) for s in secrets]
    basis = shamir.lagrange_coefficients(holders)
    for secret, shares in zip(secrets, shared, strict=True):
        recovered = shamir.combine(basis, [share.y for share in shares])
        assert recovered == secret == _textbook(shares, 0) == shamir.reconstruct(shares)


def test_basis_refuses_bad_points_and_lengths() -> None:
    with pytest.raises(LocalProtocolError, match="distinct"):
        shamir.lagrange_coefficients([1, 2, 2])
    with pytest.raises(LocalProtocolError, match="distinct in the field"):
        shamir.lagrange_coefficients([1, 1 + shamir.PRIME])
    with pytest.raises(LocalProtocolError, match="at least one"):
        shamir.lagrange_coefficients([])
    with pytest.raises(LocalProtocolError, match="2 share values for 3"):
        shamir.combine((1, 2, 3), [4, 5])


def test_roster_share_points_are_positions_plus_one() -> None:
    entries = [RosterEntry(f"site-{i:03d}", f"Site {i}", bytes([i]) * 32) for i in (5, 1, 9, 3)]
    roster = Roster(entries)
    assert [roster.share_point(cid) for cid in roster.client_ids] == [1, 2, 3, 4]
    assert roster.share_point("site-009") == 1 + roster.client_ids.index("site-009")
    assert roster.entry("site-003").name == "Site 3"
    assert "site-001" in roster and "site-002" not in roster and 7 not in roster
    with pytest.raises(ValueError, match="not in the roster"):
        roster.share_point("site-002")
    with pytest.raises(KeyError):
        roster.entry("site-002")


def test_blocked_horner_equals_the_reduction_at_every_step() -> None:
    """split's evaluation reduces mod p once per block of steps at small x: the same values."""
    random = DeterministicRandomSource(b"horner")
    coefficients = [shamir.random_field_element(random) for _ in range(67)]

    def every_step(x: int) -> int:
        result = 0
        for coefficient in reversed(coefficients):
            result = (result * x + coefficient) % shamir.PRIME
        return result

    for x in (1, 2, 999, 1000, 2**32 - 1, 2**32, shamir.PRIME - 1):
        assert shamir._evaluate(coefficients, x) == every_step(x)
    assert shamir._evaluate(coefficients[:1], 5) == coefficients[0]
