"""Length-prefixed, domain-tagged encodings of the fields that are signed, hashed or key-derived.

``tagged_fields(domain, f1, f2, ...)`` is ``len(domain) || domain || len(f1) || f1 || ...`` with
4-byte big-endian lengths, so no two different field lists (or domains) share an encoding.  Every
signature, HKDF ``info`` and AEAD associated data in the protocol goes through this function.
Structured values (the group layout, a list of advertisements) are nested: each element is itself a
``tagged_fields`` encoding, and :func:`sequence` joins them with a count and length prefixes.
"""

from __future__ import annotations

from collections.abc import Iterable

Field = bytes | str | int | tuple[str, ...]


def tagged_fields(domain: bytes, *fields: Field) -> bytes:
    """Unambiguous encoding of a domain tag followed by typed fields."""
    parts = [_prefixed(domain)]
    for field in fields:
        parts.append(_prefixed(_field_bytes(field)))
    return b"".join(parts)


def sequence(items: Iterable[bytes]) -> bytes:
    """A count then each item length-prefixed: nests encodings (pass the result as a bytes field)."""
    parts = [_prefixed(item) for item in items]
    return len(parts).to_bytes(4, "big") + b"".join(parts)


def string_list(values: Iterable[str]) -> tuple[str, ...]:
    """A canonical (sorted) tuple of strings, for set-valued fields."""
    return tuple(sorted(values))


def _field_bytes(field: Field) -> bytes:
    if isinstance(field, bytes):
        return b"b" + field
    if isinstance(field, str):
        return b"s" + field.encode("utf-8")
    if isinstance(field, bool):
        raise TypeError("booleans are not signed fields")
    if isinstance(field, int):
        if not 0 <= field < 2**64:
            raise ValueError(f"integer field out of range: {field}")
        return b"i" + field.to_bytes(8, "big")
    if isinstance(field, tuple):
        return b"l" + b"".join(_prefixed(item.encode("utf-8")) for item in field)
    raise TypeError(f"unsupported field type {type(field).__name__}")


def _prefixed(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data
