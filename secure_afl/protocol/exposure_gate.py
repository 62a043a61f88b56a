"""A client's own release rules, with its ledger: one implementation for every backend.

Both protection backends' clients (masking, :mod:`secure_afl.protocol.client`; CKKS,
:mod:`secure_afl.protocol.ckks.client`) ask the same questions, written once so that the two cannot
drift apart:

- **R0, one contribution per image, then per value**: does the session release statistics over an
  image (by the digest of its file's bytes, where the release names them) that this client already
  released in another completed session under another scope than the one the release may reuse
  (round 2 of the same study)?  Does it ask for a value already released (by content, a part of
  one, or a statistic of a released source: :mod:`secure_afl.privacy.release`), or for a value that
  is a part of another in this session?
- **every round, one answer per round**: was a *different* message of this round of this session
  answered before (a forked or rebuilt client)?  The answer is recorded before the reply leaves.
- **before a step that lets the server learn sums**: would the sums over the live members determine
  a client's value, with up to c = n - t colluding peers' values known (deployment policy)?
- **committed counts**: a member that signed 0 rows for a group, or fewer than the group's
  tensors need for a non-zero value (round 2: too few rows to qualify for any pseudo-label),
  contributes a value the server knows (zero); it leaves that group's sums in the check, like a
  colluder's value, and a session whose sums come from fewer than c + 2 members with rows is
  refused (deployment policy).
- **at the release point** (masking R3, CKKS R2), atomically with the last check: record the
  release and the survivor set signed; a second survivor set for one session id is refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from secure_afl.core.errors import (
    ColluderExposureRefusedError,
    ConflictingAnswerError,
    ExposureCheckLimitError,
    ExposureRefusedError,
    ImageAlreadyReleasedError,
    IncrementTooSmallError,
    LocalProtocolError,
    ValueAlreadyReleasedError,
)
from secure_afl.keys.identity import IdentityKey
from secure_afl.privacy import exposure
from secure_afl.privacy.ledger import Ledger, LedgerOwner, LedgerState, MemoryLedger
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.privacy.release import Release

# group -> (live members, tensor names)
LiveGroups = Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]]


def message_digest(data: bytes) -> str:
    """Hex SHA-256 of a server message's bytes: what the one-answer record keeps."""
    return hashlib.sha256(b"secure-afl/v2/answered\x00" + data).hexdigest()


class ExposureGate:
    """One client's release rules: its own values (by digest), its release, policy and ledger."""

    def __init__(
        self,
        client_id: str,
        identity_key: IdentityKey,
        inputs: Mapping[str, Mapping[str, np.ndarray]],
        policy: ClientPolicy,
        ledger: Ledger | None,
        release: Release | None,
    ) -> None:
        self.client_id = client_id
        self.policy = policy
        # What this client sends where, by value: its own unknowns in the exposure check (equal
        # values, equal labels; nothing hashed).
        self.own_values = exposure.own_value_labels(inputs)
        # The release (each value's SHA-256 id, its parts): what the one-contribution rule checks
        # and records.  Under a policy without that rule (the simulator's) nothing reads it, so
        # none is made here (at d = 4096 a Gram's id is 64 MiB of SHA-256 per client).
        if release is None and policy.one_contribution:
            release = Release.of(inputs)
        if release is not None:
            if not isinstance(release, Release):
                raise LocalProtocolError(f"release must be a Release, got {type(release).__name__}")
            if set(release.values) != set(self.own_values):
                raise LocalProtocolError("the release names other tensors than the inputs")
        self.release: Release | None = release
        # Without a ledger the rules hold within this object only (a fork of it is not seen):
        # deployed clients always have a FileLedger.
        self._ledger: Ledger = MemoryLedger() if ledger is None else ledger
        self._owner = LedgerOwner(client_id, identity_key)
        self._ledger.load(self._owner)  # refuse a tampered or missing ledger now, not later
        # What the checks found: went on past (simulator policy) or refused (recorded too).
        self.findings: list[exposure.ExposureFinding] = []

    def start(self, session_id: bytes) -> None:
        """R0, before anything leaves: the one-contribution rule (deployment policy)."""
        if not self.policy.one_contribution:
            return
        parts = self._rule_release().parts
        if parts:
            raise ValueAlreadyReleasedError(
                tuple(f"{part} (a part of {whole})" for part, whole in parts),
                session_id,
                how="would be sent beside the values they are parts of",
            )
        self._check_unreleased(self._ledger.load(self._owner), session_id)

    def answer(self, session_id: bytes, round_key: str, digest: str) -> None:
        """Record that this client answers ``digest`` in ``round_key``; refuse a different one."""
        if not self.policy.one_contribution:
            return

        def change(state: LedgerState) -> None:
            entry = state.entry(session_id)
            earlier = entry.answers.get(round_key)
            if earlier is not None and earlier != digest:
                raise ConflictingAnswerError(
                    f"this client already answered a different {round_key} message in session "
                    f"{session_id.hex()[:16]}... (a forked or replayed client state): one answer per round"
                )
            entry.answers[round_key] = digest

        self._ledger.update(self._owner, change)

    def check(
        self,
        round_name: str,
        action: str,
        groups: LiveGroups,
        *,
        session_id: bytes,
        colluders: int,
        release_survivors: tuple[str, ...] | None = None,
        known_zero: Mapping[str, frozenset[str]] | None = None,
    ) -> tuple[exposure.ExposureFinding, ...]:
        """The exposure check over ``groups`` (raise to refuse, else return the findings).

        ``known_zero`` (group -> members that committed 0 rows to it; None where no member committed
        counts): a known value, like a colluder's, so it leaves the sums the check reads; and a
        session whose values come from fewer than c + 2 members with rows is refused
        (:class:`IncrementTooSmallError`, deployment policy).

        With ``release_survivors`` this is the release point: in one locked ledger update the
        values must still be unreleased elsewhere, no other survivor set may have been signed in
        this session, the check must pass, and then the release is recorded.
        """
        found: list[exposure.ExposureFinding] = []
        if known_zero is not None:
            groups = {
                name: (tuple(cid for cid in live if cid not in known_zero.get(name, ())), tensors)
                for name, (live, tensors) in groups.items()
            }
            # Over the sums this client's values are in (a client in no group has none to protect).
            contributors = sorted({cid for live, _ in groups.values() for cid in live})
            if groups and self.policy.refuse_exposure and len(contributors) < colluders + 2:
                raise IncrementTooSmallError(action, contributors, colluders)

        def run_check() -> None:
            findings = exposure.client_exposures(
                self.client_id, self.own_values, groups, round_name=round_name, colluders=colluders
            )
            if findings and self.policy.refuse_exposure:
                self.findings.extend(findings)
                if all(f.undecided for f in findings):
                    raise ExposureCheckLimitError(action, findings)
                helped = [f for f in findings if f.colluders]
                if helped and len(helped) == len(findings):
                    raise ColluderExposureRefusedError(action, findings, helped[0].colluders)
                raise ExposureRefusedError(action, findings)
            found.extend(findings)

        if release_survivors is None or not self.policy.one_contribution:
            run_check()
            return tuple(found)
        survivors = tuple(sorted(release_survivors))

        def change(state: LedgerState) -> None:
            entry = state.entry(session_id)
            if entry.survivors is not None and entry.survivors != survivors:
                raise ConflictingAnswerError(
                    f"this client already signed the survivor set {list(entry.survivors)} of session "
                    f"{session_id.hex()[:16]}...; a second one ({list(survivors)}) is refused"
                )
            self._check_unreleased(state, session_id)
            run_check()
            release = self._rule_release()
            entry.survivors = survivors
            entry.released = tuple(sorted(release.ids))
            entry.anchors = tuple(sorted(release.anchors))
            entry.images = b"".join(sorted(set(release.images)))
            entry.aliases = b"".join(sorted({key for row in release.aliases for key in row}))
            entry.scope = release.scope
            entry.spend = release.spend
            entry.withheld = release.withheld

        self._ledger.update(self._owner, change)
        return tuple(found)

    def _rule_release(self) -> Release:
        """The release the one-contribution rule reads (made whenever the policy has the rule)."""
        if self.release is None:
            raise LocalProtocolError("the one-contribution rule needs a release, and none was made")
        return self.release

    def _check_unreleased(self, state: LedgerState, session_id: bytes) -> None:
        """One contribution per image (where the release names its images), then per value."""
        release = self._rule_release()
        check_images_unreleased(release, state, session_id)
        ids, anchors = state.released_in(session_id)
        spent = sorted(release.ids & set(ids))
        if spent:
            raise ValueAlreadyReleasedError(release.names(spent), bytes.fromhex(ids[spent[0]]))
        shared = sorted(release.anchors & set(anchors))
        if shared:
            raise ValueAlreadyReleasedError(
                release.names(shared),
                bytes.fromhex(anchors[shared[0]]),
                how="start or end like a value (are parts of a value) released",
            )


def committed_rows(
    rows: Mapping[str, int] | None, inputs: Mapping[str, Mapping[str, np.ndarray]]
) -> dict[str, int] | None:
    """A client's committed counts, checked: one non-negative integer for each group it joins."""
    if rows is None:
        return None
    if set(rows) != set(inputs):
        raise LocalProtocolError(
            f"committed rows name the groups {sorted(rows)}, the inputs {sorted(inputs)}: one count a group"
        )
    out = {}
    for group, count in rows.items():
        if isinstance(count, bool) or not isinstance(count, int | np.integer) or not 0 <= count < 1 << 63:
            raise LocalProtocolError(f"the committed rows of {group!r} must be a count, got {count!r}")
        if count == 0 and any(np.any(values != 0) for values in inputs[group].values()):
            raise LocalProtocolError(
                f"group {group!r}: a client committing 0 rows sends zeros there (the value every client "
                f"takes as known), but its inputs are not zero"
            )
        out[group] = int(count)
    return out


def zero_commitments(
    adverts: Iterable[Any],
    *,
    floors: Mapping[str, int] | None = None,
    tensors: Mapping[str, Iterable[str]] | None = None,
) -> dict[str, frozenset[str]] | None:
    """group -> the members whose value there is known (None: nobody committed counts), from either
    backend's advertisements (``client_id``, ``groups`` and the signed ``rows``).

    A member is known in a group when it committed 0 rows there, or fewer than the ``floors`` of
    every tensor the group carries (``tensors``: group -> its tensor names): tensor -> the count
    below which a member's value of it is a public function of its count (round 2: a member too
    small to qualify for any pseudo-label uploads zeros, :func:`~secure_afl.deploy.study.round2_row_floors`).
    Floors are keyed by tensor, so a server that renames a group changes nothing."""
    floors = floors or {}
    found: dict[str, set[str]] = {}
    committed = False
    for advert in adverts:
        if not advert.rows:
            continue
        committed = True
        for group, count in zip(advert.groups, advert.rows, strict=True):
            carried = list((tensors or {}).get(group, ()))
            below = bool(carried) and all(count < floors.get(t, 0) for t in carried)
            if count == 0 or below:
                found.setdefault(group, set()).add(advert.client_id)
    return {g: frozenset(ids) for g, ids in found.items()} if committed else None


def check_images_unreleased(release: Release, state: LedgerState, session_id: bytes = b"") -> None:
    """One contribution per image: refuse (:class:`ImageAlreadyReleasedError`) a release over an
    image that ``state`` records as released by another session, other than under the one scope the
    release may reuse (round 2: its own round 1).  An image is released when any of its names is
    (its file's digest, its decoded pixels, its SOP Instance UID).  A release naming no images passes."""
    if not release.images:
        return
    released = state.released_images(session_id, reuses=release.reuses)
    found = (next((name for name in names if name in released), None) for names in release.image_names)
    hits = [name for name in found if name is not None]  # per row: the first of its names released
    if hits:
        earlier = released[hits[0]]
        raise ImageAlreadyReleasedError(
            len(hits), len(release.images), bytes.fromhex(earlier), state.sessions[earlier].scope
        )
