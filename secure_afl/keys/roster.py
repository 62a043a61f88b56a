"""The roster: the pinned list of institutions (ids, names, Ed25519 public keys, fingerprints).

It is shared out of band; every client pins it and accepts only keys signed by a roster member.
It may also name the **coordinator** (``"coordinator": {id, name, public_key, fingerprint}``): the
party that runs the server and signs the classifier file every institution receives.  The
coordinator is not an institution: it takes no part in sessions (no share point, not counted in
``len(roster)``), and its key must differ from every institution's.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from .identity import PUBLIC_KEY_BYTES, fingerprint
from .rotation import KeyRotation, KeyRotationError

ROSTER_FORMAT = "secure-afl-roster/v1"
MAX_CLIENT_ID_LENGTH = 64
MAX_NAME_LENGTH = 256
# ASCII letters and digits, then also '.', '_' or '-': no Unicode look-alikes, spaces, control or
# bidirectional-override characters can make two ids look alike or an id look like another.
CLIENT_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
FINGERPRINT_PATTERN = re.compile(r"SHA256:[0-9a-f]{4}( [0-9a-f]{4}){15}")
# Refused in names: control (Cc), format (Cf: bidi overrides, zero-width), surrogates, line breaks.
_FORBIDDEN_NAME_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


class RosterError(ValueError):
    """A roster that is malformed, or has a duplicate id or key, or a fingerprint that does not match."""


@dataclass(frozen=True, slots=True)
class RosterEntry:
    client_id: str
    name: str
    public_key: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.client_id, str) or not CLIENT_ID_PATTERN.fullmatch(self.client_id):
            raise RosterError(
                f"invalid client id {self.client_id!r}: it must be 1..{MAX_CLIENT_ID_LENGTH} ASCII "
                f"characters, letters, digits, '.', '_' or '-', starting with a letter or digit"
            )
        if not isinstance(self.name, str):
            raise RosterError(f"client {self.client_id!r}: the name must be a string")
        if len(self.name) > MAX_NAME_LENGTH:
            raise RosterError(
                f"client {self.client_id!r}: the name is longer than {MAX_NAME_LENGTH} characters"
            )
        bad = sorted(
            {f"U+{ord(c):04X}" for c in self.name if unicodedata.category(c) in _FORBIDDEN_NAME_CATEGORIES}
        )
        if bad:
            raise RosterError(
                f"client {self.client_id!r}: the name {self.name!r} contains control or invisible "
                f"formatting characters ({', '.join(bad)})"
            )
        if not isinstance(self.public_key, bytes) or len(self.public_key) != PUBLIC_KEY_BYTES:
            raise RosterError(f"client {self.client_id!r}: public key must have {PUBLIC_KEY_BYTES} bytes")

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public_key)


@dataclass(frozen=True, slots=True)
class Roster:
    """Roster entries sorted by client id; duplicate ids or public keys are rejected.

    A roster version after the first (:mod:`secure_afl.keys.lifecycle`) also carries its ``version``,
    the digest of the roster it replaces (``previous``), every fingerprint revoked or rotated away so
    far (``revoked``: no entry may hold one) and the rotation statements of this version.
    """

    entries: tuple[RosterEntry, ...]
    coordinator: RosterEntry | None
    version: int
    previous: bytes | None
    revoked: tuple[str, ...]
    rotations: tuple[KeyRotation, ...]
    # client id -> position in ``entries``: built once (share points and look-ups at n = 1,000 peers)
    _positions: dict[str, int] = field(init=False, repr=False, compare=False)
    # the ids in order, built once: the server checks each R0 sender against them (n times)
    _client_ids: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __init__(
        self,
        entries: Iterable[RosterEntry],
        coordinator: RosterEntry | None = None,
        *,
        version: int = 1,
        previous: bytes | None = None,
        revoked: Iterable[str] = (),
        rotations: Iterable[KeyRotation] = (),
    ) -> None:
        ordered = tuple(sorted(entries, key=lambda entry: entry.client_id))
        ids = [entry.client_id for entry in ordered]
        duplicates = sorted(i for i, count in Counter(ids).items() if count > 1)
        if duplicates:
            raise RosterError(f"duplicate client ids in roster: {duplicates}")
        keys = [entry.public_key for entry in ordered]
        if len(set(keys)) != len(keys):
            raise RosterError("two roster entries share one public key")
        if coordinator is not None:
            if coordinator.client_id in ids:
                raise RosterError(
                    f"the coordinator's id {coordinator.client_id!r} is also an institution's: give the "
                    "coordinator its own id (secure-afl keys init --id coordinator)"
                )
            if coordinator.public_key in keys:
                raise RosterError(
                    "the coordinator's public key is also an institution's: the coordinator needs its own "
                    "identity key (secure-afl keys init --id coordinator in another directory)"
                )
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise RosterError(f"the roster version must be a positive integer, got {version!r}")
        if (version == 1) != (previous is None):
            raise RosterError(
                "the first roster version names no predecessor and every later one names the digest of the "
                f"roster it replaces (version {version}, "
                f"predecessor {'none' if previous is None else 'given'})"
            )
        if previous is not None and (not isinstance(previous, bytes) or len(previous) != 32):
            raise RosterError("the predecessor must be a roster digest (32 bytes)")
        revoked = tuple(sorted(set(revoked)))
        bad = [fp for fp in revoked if not isinstance(fp, str) or not FINGERPRINT_PATTERN.fullmatch(fp)]
        if bad:
            raise RosterError(f"revoked fingerprints {bad!r} are not in the form SHA256:ab12 cd34 ...")
        holders = [e.client_id for e in (*ordered, coordinator) if e is not None and e.fingerprint in revoked]
        if holders:
            raise RosterError(
                f"{holders} hold a revoked key: a revoked or rotated-away key never returns to the roster; "
                "give the institution a new key (secure-afl keys init, then keys roster add)"
            )
        object.__setattr__(self, "entries", ordered)
        object.__setattr__(self, "coordinator", coordinator)
        object.__setattr__(self, "version", version)
        object.__setattr__(self, "previous", previous)
        object.__setattr__(self, "revoked", revoked)
        object.__setattr__(self, "rotations", tuple(sorted(rotations, key=lambda r: r.client_id)))
        object.__setattr__(self, "_positions", {cid: i for i, cid in enumerate(ids)})
        object.__setattr__(self, "_client_ids", tuple(ids))

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[RosterEntry]:
        return iter(self.entries)

    def __contains__(self, client_id: object) -> bool:
        return isinstance(client_id, str) and client_id in self._positions

    @property
    def client_ids(self) -> tuple[str, ...]:
        return self._client_ids

    def entry(self, client_id: str) -> RosterEntry:
        position = self._positions.get(client_id) if isinstance(client_id, str) else None
        if position is None:
            raise KeyError(client_id)
        return self.entries[position]

    def public_key(self, client_id: str) -> bytes:
        return self.entry(client_id).public_key

    def share_point(self, client_id: str) -> int:
        """The Shamir x-coordinate of a client: 1 + its position in the roster."""
        position = self._positions.get(client_id) if isinstance(client_id, str) else None
        if position is None:
            raise ValueError(f"{client_id!r} is not in the roster")  # what tuple.index raised
        return 1 + position

    def digest(self) -> bytes:
        """SHA-256 over the roster's content (ids, names, keys in id order), length-prefixed.

        Two institutions compare it (or :attr:`fingerprint`) to know they pinned the same roster;
        the file's formatting does not enter it.  The coordinator, when the roster names one, enters
        after the institutions behind a marker (a roster without one keeps the digest it always had).
        """
        hasher = hashlib.sha256(ROSTER_FORMAT.encode("ascii"))
        for entry in self.entries:
            for part in (entry.client_id.encode("ascii"), entry.name.encode("utf-8"), entry.public_key):
                hasher.update(len(part).to_bytes(4, "big") + part)
        if self.coordinator is not None:
            hasher.update(b"\xffcoordinator")  # no id length prefix is 0xff...: cannot collide with an entry
            entry = self.coordinator
            for part in (entry.client_id.encode("ascii"), entry.name.encode("utf-8"), entry.public_key):
                hasher.update(len(part).to_bytes(4, "big") + part)
        if self.versioned:
            hasher.update(b"\xfeversion")  # after the coordinator's marker; a first roster keeps its digest
            parts = [self.version.to_bytes(8, "big"), self.previous or b""]
            parts += [fp.encode("ascii") for fp in self.revoked]
            parts.append(b"\xfdrotations")
            parts += [json.dumps(r.to_dict(), sort_keys=True).encode("ascii") for r in self.rotations]
            for part in parts:
                hasher.update(len(part).to_bytes(4, "big") + part)
        return hasher.digest()

    @property
    def versioned(self) -> bool:
        """Whether it carries lifecycle fields (a first roster without them keeps its old form)."""
        return self.version != 1 or bool(self.revoked) or bool(self.rotations)

    @property
    def fingerprint(self) -> str:
        """:meth:`digest` as ``SHA256:ab12 cd34 ...`` (the form of the key fingerprints)."""
        text = self.digest().hex()
        return "SHA256:" + " ".join(text[i : i + 4] for i in range(0, len(text), 4))

    def to_json(self) -> str:
        document: dict[str, object] = {
            "format": ROSTER_FORMAT,
            "clients": [_entry_json(entry) for entry in self.entries],
        }
        if self.coordinator is not None:
            document["coordinator"] = _entry_json(self.coordinator)
        if self.versioned:
            document["version"] = self.version
            document["previous"] = None if self.previous is None else self.previous.hex()
            document["revoked"] = list(self.revoked)
            document["rotations"] = [r.to_dict() for r in self.rotations]
        return json.dumps(document, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Roster:
        try:
            document = json.loads(text)
            if document.get("format") != ROSTER_FORMAT:
                raise RosterError(f"not a {ROSTER_FORMAT} document")
            entries = [_entry_from_json(item) for item in document["clients"]]
            coordinator = document.get("coordinator")
            coordinator_entry = None if coordinator is None else _entry_from_json(coordinator)
            version = document.get("version", 1)
            previous = document.get("previous")
            revoked = document.get("revoked", [])
            rotations = [KeyRotation.from_dict(item) for item in document.get("rotations", [])]
            if not isinstance(revoked, list) or (previous is not None and not isinstance(previous, str)):
                raise RosterError("malformed roster: revoked must be a list, previous a hex digest")
            previous_digest = None if previous is None else bytes.fromhex(previous)
        except RosterError:
            raise
        except KeyRotationError as exc:
            raise RosterError(f"malformed roster: {exc}") from exc
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RosterError(f"malformed roster: {exc}") from exc
        return cls(
            entries,
            coordinator_entry,
            version=version,
            previous=previous_digest,
            revoked=revoked,
            rotations=rotations,
        )

    def replace(self, **changes: object) -> Roster:
        """This roster with some of its fields changed (entries, coordinator, version, ...)."""
        fields: dict[str, object] = {
            "entries": self.entries,
            "coordinator": self.coordinator,
            "version": self.version,
            "previous": self.previous,
            "revoked": self.revoked,
            "rotations": self.rotations,
        }
        fields.update(changes)
        entries = fields.pop("entries")
        coordinator = fields.pop("coordinator")
        return Roster(entries, coordinator, **fields)  # type: ignore[arg-type]


def _entry_json(entry: RosterEntry) -> dict[str, str]:
    return {
        "id": entry.client_id,
        "name": entry.name,
        "public_key": base64.b64encode(entry.public_key).decode("ascii"),
        "fingerprint": entry.fingerprint,
    }


def _entry_from_json(item: dict[str, object]) -> RosterEntry:
    if not isinstance(item["id"], str) or not isinstance(item["name"], str):
        raise RosterError(f"malformed roster: id and name must be strings in {item!r}")
    if not isinstance(item["public_key"], str):
        raise RosterError(f"malformed roster: the public key of {item['id']!r} must be a base64 string")
    entry = RosterEntry(
        client_id=item["id"],
        name=item["name"],
        public_key=base64.b64decode(item["public_key"], validate=True),
    )
    if "fingerprint" in item and item["fingerprint"] != entry.fingerprint:
        raise RosterError(f"client {entry.client_id!r}: fingerprint does not match its key")
    return entry
