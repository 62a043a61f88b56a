"""TenSEAL CKKS contexts and ciphertexts: the only module of the backend that calls TenSEAL.

Why these choices:

* Symmetric-key encryption.  Every client holds the secret key anyway (TenSEAL has no threshold or
  multiparty decryption), so clients encrypt with it; the server then needs only the parameters
  to add ciphertexts, and its context holds no key material at all.
* Slot-sized chunks.  A vector longer than N/2 slots makes TenSEAL split it itself and print a
  warning to stdout that cannot be silenced, so :func:`encrypt` never passes it more than N/2 values.
* No multiplication, hence no relinearisation or Galois keys and no rescaling: a fresh ciphertext
  and every sum of fresh ciphertexts stay at the first level, whose modulus is all primes but the
  special one (140 bits for [60, 40, 40, 60]).  Values therefore have a range of about
  2^(140 - 40) at scale 2^40 and an absolute error near 1e-9 (measured; see SECURITY.md).
* Decrypted values are rounded to a grid of 2^-output_frac_bits before they leave the decryptor:
  CKKS decryption returns the message plus the encryption noise, and exact noisy outputs let a party
  who knows the ciphertexts (the server) attack the key (Li and Micciancio, Eurocrypt 2021).
  Rounding to a grid far coarser than the noise hides most of it; it is a mitigation, not a proof.

TenSEAL (Microsoft SEAL) draws its key and encryption randomness from its own CSPRNG (seeded by
the operating system); it cannot take the protocol's injected ``RandomSource``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import tenseal as ts

from .errors import InvalidParametersError

# Largest total coefficient-modulus bits at 128-bit security (HomomorphicEncryption.org standard,
# the table SEAL enforces), by ring degree.
MAX_MODULUS_BITS = {8192: 218, 16384: 438, 32768: 881}


@dataclass(frozen=True, slots=True)
class CkksParameters:
    """Ring degree N, coefficient moduli bit sizes, scale 2^scale_bits, output rounding grid."""

    poly_modulus_degree: int = 8192
    coeff_mod_bit_sizes: tuple[int, ...] = (60, 40, 40, 60)
    scale_bits: int = 40
    output_frac_bits: int = 24

    @property
    def slots(self) -> int:
        """Values per ciphertext (N/2): the chunk size."""
        return self.poly_modulus_degree // 2

    @property
    def value_bound(self) -> float:
        """|x| of a sum must stay below this (half the first level's modulus over the scale, with margin)."""
        return 2.0 ** (sum(self.coeff_mod_bit_sizes[:-1]) - self.scale_bits - 2)

    def chunks(self, length: int) -> int:
        """Ciphertexts for a vector of ``length`` values."""
        return max(1, math.ceil(length / self.slots))

    def max_ciphertext_bytes(self) -> int:
        """Upper bound on one serialised fresh ciphertext: 2 polynomials over the first level's primes,
        8 bytes per coefficient, plus framing (SEAL's compression only makes it smaller)."""
        primes = len(self.coeff_mod_bit_sizes) - 1
        return 2 * primes * self.poly_modulus_degree * 8 + 4096

    def max_context_bytes(self) -> int:
        """Upper bound on a serialised secret context (the secret key over every prime, and framing)."""
        return len(self.coeff_mod_bit_sizes) * self.poly_modulus_degree * 8 + 65536

    def validate(self) -> None:
        """Raise :class:`InvalidParametersError` unless these are parameters this code accepts."""
        n = self.poly_modulus_degree
        sizes = self.coeff_mod_bit_sizes
        if n not in MAX_MODULUS_BITS:
            raise InvalidParametersError(
                f"poly_modulus_degree must be one of {sorted(MAX_MODULUS_BITS)}, got {n}"
            )
        if not isinstance(sizes, tuple) or not 2 <= len(sizes) <= 16:
            raise InvalidParametersError("coeff_mod_bit_sizes must be a tuple of 2..16 prime sizes")
        if any(not isinstance(b, int) or not 20 <= b <= 60 for b in sizes):
            raise InvalidParametersError(f"every coefficient modulus must be 20..60 bits, got {sizes}")
        if sum(sizes) > MAX_MODULUS_BITS[n]:
            raise InvalidParametersError(
                f"coefficient moduli of {sum(sizes)} bits exceed {MAX_MODULUS_BITS[n]}, the 128-bit "
                f"security limit at N={n}; use fewer or smaller primes or a larger N"
            )
        if not 20 <= self.scale_bits <= 60 or self.scale_bits >= sum(sizes[:-1]) - 20:
            raise InvalidParametersError(
                f"scale 2^{self.scale_bits} must lie in 2^20..2^60 and leave the first level's "
                f"{sum(sizes[:-1])}-bit modulus at least 20 bits of range"
            )
        if not 0 <= self.output_frac_bits <= self.scale_bits:
            raise InvalidParametersError(
                f"output_frac_bits must be 0..scale_bits ({self.scale_bits}), got {self.output_frac_bits}"
            )


def new_secret_context(parameters: CkksParameters) -> ts.Context:
    """A fresh CKKS context with a new secret key (TenSEAL draws it from its own CSPRNG)."""
    parameters.validate()
    context = ts.context(
        ts.SCHEME_TYPE.CKKS,
        poly_modulus_degree=parameters.poly_modulus_degree,
        coeff_mod_bit_sizes=list(parameters.coeff_mod_bit_sizes),
        encryption_type=ts.ENCRYPTION_TYPE.SYMMETRIC,
        n_threads=1,
    )
    context.global_scale = 2.0**parameters.scale_bits
    return context


def secret_bytes(context: ts.Context) -> bytes:
    """The context with its secret key (for peers only, and only inside AEAD)."""
    return context.serialize(
        save_public_key=False, save_secret_key=True, save_galois_keys=False, save_relin_keys=False
    )


def public_bytes(context: ts.Context) -> bytes:
    """The context without any key: what the server holds."""
    return context.serialize(
        save_public_key=False, save_secret_key=False, save_galois_keys=False, save_relin_keys=False
    )


def load_context(data: bytes) -> ts.Context:
    """Deserialise a context; raises ``ValueError`` on bytes that are not one."""
    try:
        context = ts.context_from(bytes(data), n_threads=1)
    except Exception as exc:  # TenSEAL raises bare RuntimeError/ValueError from C++
        raise ValueError(f"not a TenSEAL context ({type(exc).__name__}: {exc})") from None
    return context


def parameters_mismatch(context: ts.Context, parameters: CkksParameters) -> str | None:
    """Why ``context`` does not have ``parameters`` (None when it has them)."""
    try:
        seal = context.seal_context().data
        key_data = seal.key_context_data()
        degree = key_data.parms().poly_modulus_degree()
        scheme = key_data.parms().scheme()
        totals = []
        data = key_data
        while data is not None:
            totals.append(data.total_coeff_modulus_bit_count())
            data = data.next_context_data()
        scale = context.global_scale
    except Exception as exc:
        return f"its parameters cannot be read ({type(exc).__name__}: {exc})"
    # SEAL's modulus chain drops the last prime at each level: the bit totals give the prime sizes.
    sizes = [totals[-1]] + [totals[i - 1] - totals[i] for i in range(len(totals) - 1, 0, -1)]
    if scheme != ts.SCHEME_TYPE.CKKS.value:
        return "it is not a CKKS context"
    if degree != parameters.poly_modulus_degree:
        return f"its ring degree is {degree}, the session's {parameters.poly_modulus_degree}"
    if tuple(sizes) != parameters.coeff_mod_bit_sizes:
        return (
            f"its coefficient moduli are {sizes} bits, the session's {list(parameters.coeff_mod_bit_sizes)}"
        )
    if scale != 2.0**parameters.scale_bits:
        return f"its scale is {scale}, the session's 2^{parameters.scale_bits}"
    return None


def encrypt(context: ts.Context, values: np.ndarray, parameters: CkksParameters) -> tuple[bytes, ...]:
    """Serialised ciphertexts of ``values`` in chunks of at most N/2 slots (never split by TenSEAL)."""
    flat = np.ascontiguousarray(values, dtype=np.float64).ravel()
    slots = parameters.slots
    return tuple(
        ts.ckks_vector(context, flat[start : start + slots].tolist()).serialize()
        for start in range(0, max(len(flat), 1), slots)
    )


def load_ciphertext(
    context: ts.Context, data: bytes, length: int, parameters: CkksParameters
) -> ts.CKKSVector:
    """A ciphertext of ``length`` values at the session's first level and scale; ``ValueError`` if not."""
    try:
        vector = ts.ckks_vector_from(context, bytes(data))
        ciphertexts = vector.ciphertext()
    except Exception as exc:
        raise ValueError(f"not a CKKS ciphertext of this session ({type(exc).__name__}: {exc})") from None
    if len(ciphertexts) != 1:
        raise ValueError(f"{len(ciphertexts)} ciphertexts in one chunk, expected 1")
    (ciphertext,) = ciphertexts
    if ciphertext.size() != 2 or ciphertext.poly_modulus_degree() != parameters.poly_modulus_degree:
        raise ValueError("ciphertext is not a fresh two-polynomial ciphertext of the session's ring")
    if ciphertext.coeff_modulus_size() != len(parameters.coeff_mod_bit_sizes) - 1:
        raise ValueError("ciphertext is not at the session's first level")
    if ciphertext.scale != 2.0**parameters.scale_bits:
        raise ValueError(f"ciphertext scale {ciphertext.scale} is not 2^{parameters.scale_bits}")
    if vector.size() != length:
        raise ValueError(f"ciphertext holds {vector.size()} values, expected {length}")
    return vector


def chunk_lengths(length: int, parameters: CkksParameters) -> list[int]:
    """The number of values in each chunk of a vector of ``length`` values."""
    slots = parameters.slots
    return [min(slots, length - start) for start in range(0, length, slots)] or [0]


def group_chunks(lengths: Mapping[str, int], parameters: CkksParameters) -> tuple[tuple[str, int, int], ...]:
    """A group's chunks, numbered by their position here, from its tensors' lengths: (tensor, chunk
    within the tensor, values in it), the tensors in name order (every upload's order) and each
    tensor's chunks in order.  The one definition of a chunk index: R4's requests, decryptions and
    signatures name chunks by it (SECURITY.md §7.6)."""
    return tuple(
        (tensor, i, n)
        for tensor in sorted(lengths)
        for i, n in enumerate(chunk_lengths(lengths[tensor], parameters))
    )


def decrypt(context: ts.Context, chunks: Sequence[ts.CKKSVector], parameters: CkksParameters) -> np.ndarray:
    """Decrypt and concatenate chunks, rounded to the output grid (see the module docstring)."""
    values = np.concatenate([np.asarray(chunk.decrypt(), dtype=np.float64) for chunk in chunks])
    grid = 2.0**parameters.output_frac_bits
    return np.round(values * grid) / grid
