"""t-of-n Shamir secret sharing over the prime field GF(2^521 - 1).

A secret s (here a 32-byte key, so s < 2^256 < p) is the constant term of a random polynomial of
degree t - 1 whose other coefficients are uniform in the field, drawn from the injected
:class:`RandomSource` by rejection sampling (no modular bias).  Share i is (x_i, f(x_i)) with
distinct non-zero x_i.  Any t shares determine f and hence s by Lagrange interpolation at 0; any
t - 1 shares are consistent with every secret (perfect secrecy), which the tests check.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import mul

from secure_afl.core.errors import LocalProtocolError
from secure_afl.core.randomness import RandomSource

PRIME = 2**521 - 1
VALUE_BYTES = 66  # ceil(521 / 8)
_VALUE_MASK = (1 << 521) - 1
_SMALL = 1 << 32  # points and targets below this take lagrange_coefficients' exact-product path


@dataclass(frozen=True, slots=True)
class Share:
    """One share: the point (x, y) of the sharing polynomial."""

    x: int
    y: int


def split(secret: int, threshold: int, xs: Sequence[int], random: RandomSource) -> list[Share]:
    """Shares of ``secret`` at the points ``xs``; any ``threshold`` of them reconstruct it."""
    if not 0 <= secret < PRIME:
        raise LocalProtocolError("secret out of the field's range")
    if threshold < 1:
        raise LocalProtocolError(f"threshold must be at least 1, got {threshold}")
    if len(set(xs)) != len(xs) or any(not 0 < x < PRIME for x in xs):
        raise LocalProtocolError("share points must be distinct and non-zero")
    if threshold > len(xs):
        raise LocalProtocolError(f"threshold {threshold} exceeds the number of shares {len(xs)}")
    coefficients = [secret] + [random_field_element(random) for _ in range(threshold - 1)]
    return [Share(x, _evaluate(coefficients, x)) for x in xs]


def reconstruct(shares: Sequence[Share]) -> int:
    """The constant term of the unique polynomial of degree < len(shares) through ``shares``."""
    return interpolate(shares, 0)


def interpolate(shares: Sequence[Share], at: int) -> int:
    """Lagrange interpolation of ``shares`` evaluated at ``at``."""
    return combine(lagrange_coefficients([share.x for share in shares], at), [share.y for share in shares])


def lagrange_coefficients(xs: Sequence[int], at: int = 0) -> tuple[int, ...]:
    """The Lagrange basis at ``at`` for the points ``xs``: ``f(at) = sum(l_i * f(x_i))`` for every
    polynomial ``f`` of degree below ``len(xs)``.

    It depends on the points only, so a caller that interpolates many secrets shared at the same
    points (the server: every owner's shares come from the same revealers) computes it once and
    :func:`combine` s each secret's values with it.  One modular inverse for all the points
    (Montgomery's batch inversion).
    """
    points = [x % PRIME for x in xs]  # distinct integers may still meet in the field
    if not points or len(set(points)) != len(points):
        raise LocalProtocolError("interpolation needs at least one share and points distinct in the field")
    target = at % PRIME
    numerators = []
    denominators = []
    if target < _SMALL and max(points) < _SMALL:
        # Roster positions (x ≤ n) and the target 0: the products of the small differences are
        # exact integers of a few thousand bits, reduced once (t = 667 at n = 1,000), not per step.
        factors = [target - x for x in points]
        whole = math.prod(factors)
        for i, x_i in enumerate(points):
            # prod over j != i of (target - x_j): the whole product without its factor i, where
            # that factor is non-zero (the division is then exact).
            factor = factors[i]
            if factor:
                numerators.append(whole // factor % PRIME)
            else:
                numerators.append(math.prod(factors[:i] + factors[i + 1 :]) % PRIME)
            denominators.append(math.prod([x_i - x_j for x_j in points[:i] + points[i + 1 :]]) % PRIME)
        inverses = _batch_inverse(denominators)
        return tuple(n * inv % PRIME for n, inv in zip(numerators, inverses, strict=True))
    for i, x_i in enumerate(points):
        numerator, denominator = 1, 1
        for j, x_j in enumerate(points):
            if i != j:
                numerator = numerator * (target - x_j) % PRIME
                denominator = denominator * (x_i - x_j) % PRIME
        numerators.append(numerator)
        denominators.append(denominator)
    inverses = _batch_inverse(denominators)
    return tuple(n * inv % PRIME for n, inv in zip(numerators, inverses, strict=True))


def combine(coefficients: Sequence[int], values: Sequence[int]) -> int:
    """``sum(l_i * y_i) mod p``: the secret from its shares' values and :func:`lagrange_coefficients`."""
    if len(coefficients) != len(values):
        raise LocalProtocolError(f"{len(values)} share values for {len(coefficients)} Lagrange coefficients")
    return sum(map(mul, coefficients, values)) % PRIME


def _batch_inverse(values: Sequence[int]) -> list[int]:
    """Inverses of non-zero field elements with one modular exponentiation (prefix products)."""
    prefix = [1]
    for value in values:
        prefix.append(prefix[-1] * value % PRIME)
    inverse = pow(prefix[-1], -1, PRIME)
    out = [0] * len(values)
    for i in range(len(values) - 1, -1, -1):
        out[i] = prefix[i] * inverse % PRIME
        inverse = inverse * values[i] % PRIME
    return out


def random_field_element(random: RandomSource) -> int:
    """A uniform element of GF(p) by rejection sampling on 521-bit strings."""
    while True:
        candidate = int.from_bytes(random.token_bytes(VALUE_BYTES), "big") & _VALUE_MASK
        if candidate < PRIME:
            return candidate


def value_to_bytes(value: int) -> bytes:
    return value.to_bytes(VALUE_BYTES, "big")


def value_from_bytes(data: bytes) -> int:
    """Field element from its fixed-size encoding; values >= p are rejected by the caller's check."""
    return int.from_bytes(data, "big")


def values_from_bytes(items: Sequence[bytes]) -> list[int]:
    """:func:`value_from_bytes` of each of ``items`` (the server reads n² of them)."""
    return list(map(int.from_bytes, items, repeat("big")))


_HORNER_BLOCK = 16  # Horner steps between reductions when x is small


def _evaluate(coefficients: Sequence[int], x: int) -> int:
    """f(x) by Horner's rule.  Share points are roster positions (x ≤ n, a few bits), so each step
    adds a few bits only: reducing mod p once per :data:`_HORNER_BLOCK` steps instead of every step
    gives the same value with a third fewer big-number operations (t = 667 at n = 1,000)."""
    result = 0
    ordered = coefficients[::-1]
    if not 0 <= x < 1 << 32:
        for coefficient in ordered:
            result = (result * x + coefficient) % PRIME
        return result
    for start in range(0, len(ordered), _HORNER_BLOCK):
        for coefficient in ordered[start : start + _HORNER_BLOCK]:
            result = result * x + coefficient
        result %= PRIME
    return result
