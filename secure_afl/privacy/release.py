"""What a client releases in a session, identified by content: the unit of the one-contribution rule.

The paper's method needs one aggregation per input, so a client releases each value it holds in at
most one completed session (the ledger keeps which).  A value is named by what it *is*, not by what
the server calls it:

- its **value id**: SHA-256 of its shape and float64 bytes before any randomisation (DP noise),
  independent of its tensor name, group, study or session; so the same Gram sent under another
  name, in another study, or with fresh noise is the same value;
- its **anchors**: digests of its first and of its last :data:`ANCHOR_WORDS` words (values of at
  least ``ANCHOR_WORDS`` words; constant windows such as runs of zeros are none).  Constant values
  (scalars, zero vectors) have no value id: equal counts or empty sums in two rounds are not one
  value; the caller's source ids spend them (the deployment's do).  A value that starts or ends
  like a released one is a part of it (the halves attack: ``x`` released whole, then ``x[:k]`` and
  ``x[k:]`` under other names);
- **source ids** the caller may add: what the values are computed from;
- **images** (the deployment's unit): each row's image by every name it has
  (:func:`image_keys`): the SHA-256 of its file, of its decoded pixels, and its DICOM SOP Instance
  UID where it has one; two rows are one image when **any** of these names agree.  With the scope
  they are released under (the study's digest and round) and the one scope whose images the
  release may use again (round 2: its own round 1).  Two studies over the same images (another
  balance, backbone or protection, a re-extracted file, an image re-exported losslessly: other
  bytes, the same pixels) are then one release.  A release lists each image once
  (:func:`first_repeat`); a lossy copy is another image to every exact name (SECURITY.md).
  Which rows of a file a release may take is :func:`select_rows`' decision: rows that repeat an
  image or a UID of the file, or name a released image, are withheld, each with its reason.

Within one session, an input that is a contiguous part of another input is refused outright
(:func:`contained_parts`).  What is *not* recognised (SECURITY.md): parts shorter than
``ANCHOR_WORDS`` words or interior windows released across sessions, constant values (counts)
at the protocol level, and other linear maps of a
released value (scaled, permuted) computed by the caller; the deployment's clients compute their
inputs themselves from the study's fixed layout, so a server cannot ask them for such parts, and
name their images, which no layout changes.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

ANCHOR_WORDS = 4
_CONSTANT_HEAD = 64  # words is_constant reads first
_VALUE_DOMAIN = b"secure-afl/v2/value\x00"
_PREFIX_DOMAIN = b"secure-afl/v2/value-prefix\x00"
_SUFFIX_DOMAIN = b"secure-afl/v2/value-suffix\x00"
_SOURCE_DOMAIN = b"secure-afl/v2/source\x00"
_PIXELS_DOMAIN = b"secure-afl/v2/image-pixels\x00"
_SOP_INSTANCE_DOMAIN = b"secure-afl/v2/image-sop-instance\x00"
IMAGE_DIGEST_BYTES = 32  # SHA-256 of an image file's bytes (and the size of every image key)


def _words(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float64).astype("<f8", copy=False)


def value_id(values: np.ndarray) -> str:
    """Hex SHA-256 of a value's shape and little-endian float64 bytes."""
    array = _words(values)
    digest = hashlib.sha256(_VALUE_DOMAIN)
    digest.update(repr(array.shape).encode())
    digest.update(array.reshape(-1))  # the buffer itself: the bytes tobytes() would copy
    return digest.hexdigest()


def is_constant(values: np.ndarray) -> bool:
    """A value whose words are all equal (a scalar, a zero vector): it has no identity of its own.

    Two statistics that are both zero (a class without positives in two rounds) are not one value
    released twice; a caller that must spend such values too names their source (:func:`source_id`).
    """
    flat = _words(values).reshape(-1)
    if flat.size == 0:
        return True
    # A value that is not constant almost always shows it in its first words: decide there when
    # they are neither all equal nor all NaN (then the whole is neither), without a pass over a Gram.
    head = flat[:_CONSTANT_HEAD]
    if not ((head == head[0]).all() or np.isnan(head).all()):
        return False
    return bool((flat == flat[0]).all() or np.isnan(flat).all())


def anchors(values: np.ndarray) -> tuple[str, ...]:
    """The prefix and suffix anchors of a value of at least :data:`ANCHOR_WORDS` words (a constant
    window, such as a run of zeros, is no anchor)."""
    flat = _words(values).reshape(-1)
    if flat.size < ANCHOR_WORDS:
        return ()
    out = []
    for domain, window in ((_PREFIX_DOMAIN, flat[:ANCHOR_WORDS]), (_SUFFIX_DOMAIN, flat[-ANCHOR_WORDS:])):
        if not is_constant(window):
            out.append(hashlib.sha256(domain + window.tobytes()).hexdigest())
    return tuple(out)


def source_id(*parts: str) -> str:
    """A caller's name for what values are computed from (e.g. a feature file's digest and a round)."""
    digest = hashlib.sha256(_SOURCE_DOMAIN)
    for part in parts:
        raw = part.encode("utf-8")
        digest.update(len(raw).to_bytes(4, "big") + raw)
    return "source:" + digest.hexdigest()


@dataclass(frozen=True, slots=True)
class Release:
    """Everything one session would release of one client: value ids (per group and tensor), the
    anchors of those values, and the caller's source ids."""

    values: Mapping[tuple[str, str], str | None]  # (group, tensor) -> value id (None: constant)
    value_anchors: Mapping[tuple[str, str], tuple[str, ...]]  # (group, tensor) -> its anchors
    sources: frozenset[str]
    parts: tuple[tuple[str, str], ...] = ()  # (part, whole) inside this release (contained_parts)
    # One contribution per image: the 32-byte SHA-256 of each row's image file, sorted (one per row);
    # empty where the caller names no images.
    images: tuple[bytes, ...] = ()
    scope: str = ""  # what the images are released under: "study:<digest>/round:<r>"
    reuses: str = ""  # the one scope whose images this release may use again (round 2: its round 1)
    # Under DP, what this release spends at this institution (a NodeSpend's canonical JSON; "" for
    # none): kept in the signed ledger with the release, so a node's dp-epsilon can bound the
    # composition of everything it released (secure_afl.deploy.client).
    spend: str = ""
    # Per row of ``images`` (in its order): the image's further names (image_keys after the file's
    # digest: its decoded pixels, its SOP Instance UID); empty where the caller names none.
    aliases: tuple[tuple[bytes, ...], ...] = ()
    # The file's rows this release leaves out, with their reasons (RowSelection.record: canonical
    # JSON, bounded; "" for none): kept in the signed ledger with the release, for the DPO.
    withheld: str = ""

    @classmethod
    def of(
        cls,
        inputs: Mapping[str, Mapping[str, np.ndarray]],
        *,
        sources: Iterable[str] = (),
        images: Iterable[str | bytes] = (),
        scope: str = "",
        reuses: str = "",
        aliases: Iterable[Iterable[bytes]] | None = None,
    ) -> Release:
        """The release of ``inputs`` (the statistics *before* randomisation) plus ``sources``, over
        ``images`` (each row's image-file digest, hex or 32 bytes) released under ``scope``;
        ``aliases``: per row of ``images``, in the same order, its further names (:func:`image_keys`
        after the first).  A row that names an image an earlier row names raises
        :class:`RepeatedImageError` (one image in two rows would count twice in the sums).

        Each distinct value is read once (:class:`_Distinct`): a Gram that several groups carry is
        hashed once and searched for parts once, whatever the number of groups.
        """
        return cls._of(
            _Distinct(inputs), sources=sources, images=images, scope=scope, reuses=reuses, aliases=aliases
        )

    @classmethod
    def _of(
        cls,
        distinct: _Distinct,
        *,
        sources: Iterable[str],
        images: Iterable[str | bytes],
        scope: str,
        reuses: str,
        aliases: Iterable[Iterable[bytes]] | None,
    ) -> Release:
        values = {key: distinct.value_id(key) for key in distinct.keys}
        found = {key: distinct.anchors(key) for key in distinct.keys}
        parts = distinct.contained_parts()
        files = [_digest_bytes(item) for item in images]
        named = [() for _ in files] if aliases is None else [tuple(map(bytes, a)) for a in aliases]
        if len(named) != len(files):
            raise ValueError(f"{len(named)} rows of aliases for {len(files)} images: one per image")
        rows = [(file, *more) for file, more in zip(files, named, strict=True)]
        repeat = first_repeat(rows)
        if repeat is not None:
            raise RepeatedImageError(*repeat)
        rows.sort()
        kept = tuple(row[1:] for row in rows) if any(named) else ()
        return cls(
            values, found, frozenset(sources), parts, tuple(row[0] for row in rows), scope, reuses,
            aliases=kept,
        )  # fmt: skip

    @property
    def image_names(self) -> tuple[tuple[bytes, ...], ...]:
        """Per row (sorted by file digest): every name of its image, the file's digest first."""
        if not self.aliases:
            return tuple((image,) for image in self.images)
        return tuple((image, *more) for image, more in zip(self.images, self.aliases, strict=True))

    @property
    def anchors(self) -> frozenset[str]:
        return frozenset(a for found in self.value_anchors.values() for a in found)

    def to_json(self) -> dict:
        """The release as JSON (a deployed client keeps it between its per-message rebuilds)."""
        return {
            "values": [[g, t, v] for (g, t), v in sorted(self.values.items())],  # v may be null
            "anchors": [[g, t, *a] for (g, t), a in sorted(self.value_anchors.items())],
            "sources": sorted(self.sources),
            "parts": [list(p) for p in self.parts],
            "images": base64.b64encode(b"".join(self.images)).decode("ascii"),
            "scope": self.scope,
            "reuses": self.reuses,
            "spend": self.spend,
            **({"aliases": _pack_rows(self.aliases)} if self.aliases else {}),
            **({"withheld": self.withheld} if self.withheld else {}),
        }

    @classmethod
    def from_json(cls, document: dict) -> Release:
        return cls(
            {(str(g), str(t)): None if v is None else str(v) for g, t, v in document["values"]},
            {(str(item[0]), str(item[1])): tuple(map(str, item[2:])) for item in document["anchors"]},
            frozenset(map(str, document["sources"])),
            tuple((str(a), str(b)) for a, b in document["parts"]),
            split_digests(base64.b64decode(document.get("images", ""), validate=True)),
            str(document.get("scope", "")),
            str(document.get("reuses", "")),
            str(document.get("spend", "")),
            _unpack_rows(str(document.get("aliases", ""))),
            str(document.get("withheld", "")),
        )

    @property
    def ids(self) -> frozenset[str]:
        """Every identity this release spends: value ids and source ids (anchors are kept apart)."""
        return frozenset(v for v in self.values.values() if v is not None) | self.sources

    def names(self, ids: Collection[str]) -> tuple[str, ...]:
        """The tensors (``group/tensor``) or sources behind ``ids``, for an error message."""
        out = sorted(f"{g}/{t}" for (g, t), v in self.values.items() if v in ids)
        out += sorted(f"the source {s[7:23]}..." for s in self.sources if s in ids)
        out += sorted(f"{g}/{t}" for (g, t), a in self.value_anchors.items() if set(a) & set(ids))
        return tuple(dict.fromkeys(out))


class RepeatedImageError(ValueError):
    """One release lists one image in two rows (by any of its names, :func:`image_keys`): its rows
    would count twice in every sum, twice the sensitivity a DP plan is sized for.  ``first`` and
    ``second`` index the rows (in the order given), ``name`` is which name they share."""

    def __init__(self, first: int, second: int, name: str) -> None:
        self.first, self.second, self.name = first, second, name
        super().__init__(
            f"rows {first} and {second} are one image (the same {name}): each image is one row of a "
            "release; remove one of them from the labels CSV and extract again"
        )


_NAME_OF_KEY = ("image file's SHA-256", "decoded pixels' SHA-256", "DICOM SOP Instance UID")


def image_keys(file_sha256: str, pixel_sha256: str, sop_instance_uid: str = "") -> tuple[bytes, ...]:
    """One image's names as a ledger keeps them (32 bytes each), the file's digest first.

    - the SHA-256 of the image file's bytes, as it is (the name every ledger has held; a ledger
      written before the other names still matches on it);
    - the SHA-256 of its decoded pixels (:func:`secure_afl.features.images.pixel_sha256`: the 8-bit
      image the backbone reads, before any resize), under a domain tag: the same for every lossless
      encoding of the image (uncompressed, JPEG 2000 lossless, RLE, a recompressed PNG);
    - its DICOM SOP Instance UID where it has one (``""``: none), under a domain tag: the instance's
      own name, kept by a re-export that changes its pixels' encoding or its display window.

    Two rows are one image when **any** name agrees (a re-encoded copy with a new UID shares the
    pixels, a lossy copy keeping its UID shares the UID): the conservative reading, since counting
    two images as one only refuses a row, while counting one image twice gives its row to a
    difference of two sums.  A lossy copy with a new UID shares no name (SECURITY.md).
    """
    keys = [_digest_bytes(file_sha256), hashlib.sha256(_PIXELS_DOMAIN + _digest_bytes(pixel_sha256)).digest()]
    if sop_instance_uid:
        keys.append(hashlib.sha256(_SOP_INSTANCE_DOMAIN + sop_instance_uid.encode("ascii")).digest())
    return tuple(keys)


def first_repeat(rows: Iterable[Iterable[bytes]]) -> tuple[int, int, str] | None:
    """The first row that names an image an earlier row names (rows of :func:`image_keys`):
    ``(earlier row, row, which name)``, or None when every row is its own image."""
    seen: dict[bytes, tuple[int, int]] = {}
    for row, keys in enumerate(rows):
        for position, key in enumerate(keys):
            earlier = seen.get(key)
            if earlier is not None and earlier[0] != row:
                return earlier[0], row, _NAME_OF_KEY[min(position, len(_NAME_OF_KEY) - 1)]
        for position, key in enumerate(keys):
            seen.setdefault(key, (row, position))
    return None


# Why a row of a feature file is left out of a release (select_rows), by the reason's code.
WITHHELD_REASONS = {
    "listed-twice": "the same image (its file or decoded pixels) is another row of this file",
    "uid-repeated": "its DICOM SOP Instance UID is another row's, with other pixels (a faulty export or "
    "anonymiser)",
    "released": "released in an earlier session",
    "uid-released": "its DICOM SOP Instance UID was released in an earlier session with other pixels",
}
WITHHELD_LISTED = 100  # rows a release's record lists (index, reason); the counts cover them all
WITHHELD_NAMED = 200  # rows the node's log names per reason; the count covers them all


@dataclass(frozen=True, slots=True)
class WithheldRow:
    """A row left out of a release: its index in the file, the reason's code (:data:`WITHHELD_REASONS`),
    the file's other row it shares a name with (in-file reasons) or the earlier session (hex) that
    released a name of it (the ledger's reasons)."""

    row: int
    reason: str
    other: int | None = None
    session: str = ""


@dataclass(frozen=True, slots=True)
class RowSelection:
    """Which rows of a file a release takes (``kept``, in file order) and which it withholds."""

    kept: tuple[int, ...]
    withheld: tuple[WithheldRow, ...]

    @property
    def total(self) -> int:
        return len(self.kept) + len(self.withheld)

    def counts(self) -> dict[str, int]:
        """Withheld rows per reason code (codes in :data:`WITHHELD_REASONS`' order)."""
        found = [row.reason for row in self.withheld]
        return {code: found.count(code) for code in WITHHELD_REASONS if code in found}

    def record(self) -> str:
        """The withheld rows as a release keeps them (canonical JSON; "" when none): the file's row
        count, the count per reason, and the first :data:`WITHHELD_LISTED` rows as [index, reason]."""
        if not self.withheld:
            return ""
        document = {
            "rows": self.total,
            "withheld": self.counts(),
            "listed": [[row.row, row.reason] for row in self.withheld[:WITHHELD_LISTED]],
        }
        return json.dumps(document, sort_keys=True, separators=(",", ":"))

    def require_some(self, scopes: Mapping[str, str]) -> None:
        """Refuses a selection that keeps no row: :class:`ImageAlreadyReleasedError` when every row
        names a released image (``scopes``: session hex -> what it released under), otherwise
        :class:`NothingToReleaseError`."""
        if self.kept:
            return
        from secure_afl.core.errors import ImageAlreadyReleasedError

        if all(row.reason in ("released", "uid-released") for row in self.withheld):
            first, total = self.withheld[0].session, self.total
            raise ImageAlreadyReleasedError(total, total, bytes.fromhex(first), scopes.get(first, ""))
        raise NothingToReleaseError(self)

    def log_lines(self, image_ids: Sequence[str], uids: Sequence[str] | None = None) -> list[str]:
        """One line per reason: the count and each row by index, image id and SOP Instance UID (never
        a pixel value), with the row it repeats or the session that released it; at most
        :data:`WITHHELD_NAMED` rows named a line."""
        lines = []
        for code, count in self.counts().items():
            rows = [row for row in self.withheld if row.reason == code]
            named = []
            for row in rows[:WITHHELD_NAMED]:
                uid = f", UID {uids[row.row]}" if uids and uids[row.row] else ""
                how = f", as row {row.other}" if row.other is not None else ""
                how += f", session {row.session[:16]}" if row.session else ""
                named.append(f"row {row.row} ({image_ids[row.row]}{uid}{how})")
            more = f" and {count - WITHHELD_NAMED} more" if count > WITHHELD_NAMED else ""
            lines.append(
                f"withheld {count} of {self.total} rows, {WITHHELD_REASONS[code]}: {', '.join(named)}{more}"
            )
        return lines


def select_rows(rows: Sequence[Sequence[bytes]], released: Mapping[bytes, str]) -> RowSelection:
    """The rows of a file (each row's :func:`image_keys`: file digest, pixel digest, UID if any) that
    a release may take, and the others with a reason each; ``released``: key -> session that
    released it (:meth:`~secure_afl.privacy.ledger.LedgerState.released_images`).

    - a row with **any** name of a released image is withheld (one contribution per image):
      ``released`` when its file or pixels match, ``uid-released`` when only its UID does;
    - rows sharing a name with another row of the file are **all** withheld: ``listed-twice`` when
      they share the file or the pixels (one image in two rows: the rows may carry different labels
      or patients, and which is right is the hospital's to say; keeping the first would make the
      sums depend on the file's order), ``uid-repeated`` when they share only the UID (a faulty export
      or anonymiser gave one instance's UID to other pixels: which row is that instance is unknown);
    - every other row is kept: no kept row shares a name with another row or with a released image.
    """
    owners: dict[bytes, list[int]] = {}
    for index, keys in enumerate(rows):
        for key in dict.fromkeys(keys):
            owners.setdefault(key, []).append(index)
    kept: list[int] = []
    withheld: list[WithheldRow] = []
    for index, keys in enumerate(rows):
        content, uid = tuple(keys[:2]), tuple(keys[2:])
        hit = next((key for key in content if key in released), None)
        if hit is not None:
            withheld.append(WithheldRow(index, "released", session=released[hit]))
            continue
        hit = next((key for key in uid if key in released), None)
        if hit is not None:
            withheld.append(WithheldRow(index, "uid-released", session=released[hit]))
            continue
        same = sorted({other for key in content for other in owners[key]} - {index})
        if same:
            withheld.append(WithheldRow(index, "listed-twice", other=same[0]))
            continue
        same = sorted({other for key in uid for other in owners[key]} - {index})
        if same:
            withheld.append(WithheldRow(index, "uid-repeated", other=same[0]))
            continue
        kept.append(index)
    return RowSelection(tuple(kept), tuple(withheld))


class NothingToReleaseError(ValueError):
    """Every row of a node's feature file is withheld (:func:`select_rows`), some for repeating an
    image or a UID of the file: the session would release nothing, and is refused."""

    def __init__(self, selection: RowSelection, where: str = "") -> None:
        self.selection = selection
        reasons = "; ".join(f"{n} {WITHHELD_REASONS[code]}" for code, n in selection.counts().items())
        super().__init__(
            f"refusing the session: {where}every one of this feature file's {selection.total} rows is "
            f"withheld ({reasons}), so it would release nothing; the node's log names each row. Give "
            "each row's image its own DICOM UID (export it again) or remove repeated rows from the "
            "labels CSV, and extract again; images released before enter only once"
        )


def _digest_bytes(item: str | bytes) -> bytes:
    raw = bytes.fromhex(item) if isinstance(item, str) else bytes(item)
    if len(raw) != IMAGE_DIGEST_BYTES:
        raise ValueError(f"an image digest is a {IMAGE_DIGEST_BYTES}-byte SHA-256, got {len(raw)} bytes")
    return raw


def image_digests(images: Iterable[str | bytes]) -> tuple[bytes, ...]:
    """Image digests (64 hex digits or 32 bytes each) as sorted 32-byte values; ValueError otherwise."""
    return tuple(sorted(_digest_bytes(item) for item in images))


def _pack_rows(rows: tuple[tuple[bytes, ...], ...]) -> str:
    """Per-row key lists as base64: per row, one byte (its number of keys), then its keys."""
    return base64.b64encode(b"".join(bytes([len(row)]) + b"".join(row) for row in rows)).decode("ascii")


def _unpack_rows(text: str) -> tuple[tuple[bytes, ...], ...]:
    packed = base64.b64decode(text, validate=True)
    rows, at = [], 0
    while at < len(packed):
        count = packed[at]
        end = at + 1 + count * IMAGE_DIGEST_BYTES
        if end > len(packed):
            raise ValueError("truncated image aliases")
        rows.append(split_digests(packed[at + 1 : end]))
        at = end
    return tuple(rows)


def split_digests(packed: bytes) -> tuple[bytes, ...]:
    """Concatenated 32-byte digests (as a ledger or a release stores them) back into a tuple."""
    if len(packed) % IMAGE_DIGEST_BYTES:
        raise ValueError(f"packed image digests must be a multiple of {IMAGE_DIGEST_BYTES} bytes")
    return tuple(packed[i : i + IMAGE_DIGEST_BYTES] for i in range(0, len(packed), IMAGE_DIGEST_BYTES))


def contained_parts(inputs: Mapping[str, Mapping[str, np.ndarray]]) -> tuple[tuple[str, str], ...]:
    """Pairs (part, whole) of this session's inputs where one value's bytes are a contiguous,
    word-aligned, strictly shorter part of another value of a different name (the halves attack
    inside one session).

    Values of fewer than two words are left out: a count that happens to equal an entry of a sum
    is not a part of it.  The same value under the same tensor name in several groups is the
    tensor-identity rule, not a part.  Each pair of distinct values is searched once.
    """
    return _Distinct(inputs).contained_parts()


class _Distinct:
    """This session's inputs by distinct value: each array object read once, each content once.

    ``keys`` keeps the inputs' (group, tensor) order.  Arrays are grouped first by object (the
    drivers pass one Gram object to every group that carries it), then by content digest (equal
    values in different objects), so that hashing, the constant test, the anchors and the part
    searches run once per distinct value.  The results are those of the per-input definitions:
    each is a function of the value's shape and words alone.
    """

    def __init__(self, inputs: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        self.keys: list[tuple[str, str]] = []
        self._of_key: dict[tuple[str, str], int] = {}  # (group, tensor) -> distinct value index
        self._flat: list[np.ndarray] = []  # per distinct value: its float64 words
        self._digests: list[str] = []  # per distinct value: value_id (also for constant values)
        self._constant: list[bool] = []
        by_object: dict[int, tuple[np.ndarray, int]] = {}  # id -> (the array, kept alive; index)
        by_digest: dict[str, int] = {}
        for group, tensors in inputs.items():
            for name, array in tensors.items():
                key = (group, name)
                self.keys.append(key)
                seen = by_object.get(id(array))
                if seen is not None and seen[0] is array:
                    self._of_key[key] = seen[1]
                    continue
                digest = value_id(array)
                index = by_digest.get(digest)
                if index is None:
                    index = len(self._flat)
                    by_digest[digest] = index
                    flat = _words(array).reshape(-1)
                    self._flat.append(flat)
                    self._digests.append(digest)
                    self._constant.append(is_constant(flat))
                by_object[id(array)] = (array, index)
                self._of_key[key] = index
        self._anchors: dict[int, tuple[str, ...]] = {}

    def value_id(self, key: tuple[str, str]) -> str | None:
        index = self._of_key[key]
        return None if self._constant[index] else self._digests[index]

    def anchors(self, key: tuple[str, str]) -> tuple[str, ...]:
        index = self._of_key[key]
        if index not in self._anchors:
            self._anchors[index] = anchors(self._flat[index])
        return self._anchors[index]

    def contained_parts(self) -> tuple[tuple[str, str], ...]:
        # As the per-pair definition always read it: inputs named "group/tensor" (a later input of
        # the same full name stands in for an earlier one), and "the same tensor name" compared on
        # what follows the full name's first "/".
        by_name: dict[str, tuple[str, str]] = {}
        for group, name in self.keys:
            by_name[f"{group}/{name}"] = (group, name)
        indices = {full: self._of_key[key] for full, key in by_name.items()}
        tensor = {full: full.split("/", 1)[1] for full in by_name}
        pairs: list[tuple[str, str, int, int]] = []
        for part, small in indices.items():
            if self._flat[small].size < 2:
                continue
            for whole, large in indices.items():
                # An equal value under another name is one unknown in the exposure check (it links
                # the tensors by the value's digest), not a part.
                if whole == part or tensor[whole] == tensor[part]:
                    continue
                # A constant whole (a member with no rows sends zeros) holds nothing a part could add.
                if self._flat[large].size <= self._flat[small].size or self._constant[large]:
                    continue
                pairs.append((part, whole, small, large))
        # Each distinct whole is read once for all the parts searched in it (a Gram holds several).
        wanted: dict[int, list[int]] = {}
        for _, _, small, large in pairs:
            if small not in wanted.setdefault(large, []):
                wanted[large].append(small)
        searched: dict[tuple[int, int], bool] = {}
        for large, smalls in wanted.items():
            found = _contains_each(self._flat[large], [self._flat[small] for small in smalls])
            searched.update(((small, large), hit) for small, hit in zip(smalls, found, strict=True))
        return tuple((part, whole) for part, whole, small, large in pairs if searched[(small, large)])


# Where a part's first word occurs more often than this in a whole, the whole is searched as bytes.
_WORD_CANDIDATES = 64


_SCAN_WORDS = 1 << 15  # words of a whole compared at a time: the slice stays in cache for every part


def _contains_each(whole: np.ndarray, parts: list[np.ndarray]) -> list[bool]:
    """For each part, whether its bytes occur in ``whole``'s at a multiple of 8 bytes (a whole
    word): the answers of :func:`_aligned_find` on their bytes, without copying ``whole`` (a
    64 MiB Gram at d = 4096), reading it once for all the parts.  The words are compared as uint64
    (bit patterns, as the bytes are: -0.0 is not 0.0).  The places where a part's first and last
    words both occur are checked one by one; where there are many (a whole of repeated words,
    such as zeros), the byte search decides."""
    haystack = whole.view(np.uint64)
    needles = [part.view(np.uint64) for part in parts]
    spans = [haystack.shape[0] - needle.shape[0] + 1 for needle in needles]
    # Where each part's first word occurs, a cache-sized slice of the whole at a time.
    hits: list[list[np.ndarray]] = [[] for _ in needles]
    searching = [k for k, needle in enumerate(needles) if needle.shape[0] and spans[k] > 0]
    for start in range(0, max((spans[k] for k in searching), default=0), _SCAN_WORDS):
        window = haystack[start : start + _SCAN_WORDS]
        for k in searching:
            if start < spans[k]:
                found = np.flatnonzero(window[: spans[k] - start] == needles[k][0])
                if found.shape[0]:
                    hits[k].append(found + start)
    out = []
    for k, needle in enumerate(needles):
        m = needle.shape[0]
        if m == 0 or spans[k] <= 0:
            out.append(m == 0)
            continue
        candidates = np.concatenate(hits[k]) if hits[k] else np.zeros(0, dtype=np.intp)
        if candidates.shape[0] > _WORD_CANDIDATES:
            candidates = candidates[haystack[candidates + (m - 1)] == needle[-1]]
        if candidates.shape[0] > _WORD_CANDIDATES:
            out.append(_aligned_find(whole.tobytes(), parts[k].tobytes()))
        else:
            out.append(any(np.array_equal(haystack[c : c + m], needle) for c in candidates.tolist()))
    return out


def _aligned_find(haystack: bytes, needle: bytes) -> bool:
    """Whether ``needle`` occurs in ``haystack`` at a multiple of 8 bytes (a whole word)."""
    start = haystack.find(needle)
    while start != -1:
        if start % 8 == 0:
            return True
        start = haystack.find(needle, start + 1)
    return False
