"""Recognising a roster's entries: the human step behind a co-signature, made a check.

A co-signature (:mod:`secure_afl.keys.cosign`) proves that an institution signed this exact roster;
it cannot prove that the institution looked at it.  What stops a coordinator from listing an entry
with a key of its own making is that every institution recognises **every** entry (its id and the
fingerprint heard from that institution itself, read aloud, never only by e-mail) before it signs;
the coordinator, likewise, before it provisions a roster from the identity files it received.

:class:`Recognition` is how the caller says it recognised the entries, one of:

- **expected fingerprints** (``deploy join --expect ID=FINGERPRINT``, ``deploy provision
  --expect ID=FINGERPRINT``): every entry must be named, each with its own fingerprint; an entry
  named with another fingerprint, an entry not named, or a name that is not an entry is refused
  (:class:`RosterNotRecognisedError`), listing every problem at once;
- **a confirmation** (a terminal prompt): the caller has shown every entry to a person, who answers;
  a refusal is a :class:`RosterNotRecognisedError`;
- **assumed** (``--yes``): the caller says the entries were checked another way (a script that
  compared the fingerprints itself).

With none of the three the entries are refused: nothing is co-signed or provisioned silently.
Entries the caller has verified otherwise (``known``: a hospital's own entry, whose key it holds;
the coordinator's own key at provisioning) need no expected fingerprint, but one given is checked.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .roster import RosterEntry, RosterError

__all__ = [
    "FingerprintSyntaxError",
    "Recognition",
    "RecognitionModeError",
    "RosterNotRecognisedError",
    "parse_expected",
    "parse_fingerprint",
    "unrecognised",
]

FINGERPRINT_HEX_DIGITS = 64


class FingerprintSyntaxError(ValueError):
    """An expected fingerprint (or ``ID=FINGERPRINT`` pair) that cannot be read."""


class RecognitionModeError(ValueError):
    """Two ways of recognising the entries given at once (expected fingerprints and ``--yes``)."""


class RosterNotRecognisedError(RosterError):
    """Entries not recognised: a fingerprint that differs from the expected one, an entry no
    expectation names, an expectation that names no entry, a confirmation refused, or no way of
    recognising the entries at all."""


def parse_fingerprint(text: str) -> str:
    """``SHA256:ab12 cd34 ...`` from any spacing or case, with or without the ``SHA256:`` prefix.

    The whole fingerprint (64 hex digits) is required: a prefix would match keys made to share it.
    """
    compact = text.strip()
    if compact.upper().startswith("SHA256:"):
        compact = compact[7:]
    compact = "".join(compact.split()).lower()
    if len(compact) != FINGERPRINT_HEX_DIGITS or any(c not in "0123456789abcdef" for c in compact):
        raise FingerprintSyntaxError(
            f"{text!r} is not a fingerprint: expected {FINGERPRINT_HEX_DIGITS} hex digits (spaces and the "
            "SHA256: prefix optional), as `secure-afl keys show` prints them"
        )
    return "SHA256:" + " ".join(compact[i : i + 4] for i in range(0, FINGERPRINT_HEX_DIGITS, 4))


def parse_expected(items: Iterable[str]) -> dict[str, str]:
    """``ID=FINGERPRINT`` pairs as {id: fingerprint}; an id given twice is refused."""
    expected: dict[str, str] = {}
    for item in items:
        client_id, sep, text = item.partition("=")
        client_id = client_id.strip()
        if not sep or not client_id:
            raise FingerprintSyntaxError(
                f"{item!r}: expected ID=FINGERPRINT, e.g. hospital-a='SHA256:ab12 cd34 ...' (quote it: "
                "the fingerprint holds spaces)"
            )
        if client_id in expected:
            raise FingerprintSyntaxError(f"{client_id!r} is given twice: give one fingerprint per id")
        expected[client_id] = parse_fingerprint(text)
    return expected


def unrecognised(
    entries: Sequence[RosterEntry], expected: Mapping[str, str], known: Collection[str] = ()
) -> list[str]:
    """What keeps ``entries`` from being recognised by ``expected`` (empty: every entry is).

    Every entry must be named with its own fingerprint, except those in ``known`` (verified
    otherwise), which are checked only when named; every name must be an entry.
    """
    problems = []
    ids = {entry.client_id for entry in entries}
    for entry in entries:
        want = expected.get(entry.client_id)
        if want is None:
            if entry.client_id not in known:
                problems.append(
                    f"{entry.client_id!r} ({entry.fingerprint}) is not expected: give its fingerprint, "
                    "heard from it, or do not take part"
                )
        elif parse_fingerprint(want) != entry.fingerprint:
            problems.append(
                f"FINGERPRINT MISMATCH for {entry.client_id!r}: the roster holds {entry.fingerprint}, "
                f"you expected {parse_fingerprint(want)}"
            )
    problems += [
        f"{client_id!r} is expected but is not in the roster" for client_id in sorted(set(expected) - ids)
    ]
    return problems


@dataclass(frozen=True)
class Recognition:
    """How the caller recognises a roster's entries: see the module's docstring.

    ``confirm`` is shown the entries (the caller has listed them to the person) and answers whether
    that person recognises every one.  It is consulted only when neither ``expected`` nor
    ``assume_recognised`` is given.
    """

    expected: Mapping[str, str] | None = None
    confirm: Callable[[Sequence[RosterEntry]], bool] | None = field(default=None, compare=False)
    assume_recognised: bool = False

    def __post_init__(self) -> None:
        if self.expected is not None and self.assume_recognised:
            raise RecognitionModeError(
                "give expected fingerprints or assume the entries recognised (--yes), not both: --yes "
                "would skip nothing the fingerprints check"
            )
        if self.expected is not None and not self.expected:
            raise RecognitionModeError("no expected fingerprint given: name every entry, ID=FINGERPRINT")

    @classmethod
    def from_options(
        cls,
        expected: Iterable[str] = (),
        *,
        assume_recognised: bool = False,
        confirm: Callable[[Sequence[RosterEntry]], bool] | None = None,
    ) -> Recognition:
        """From a command's options: ``ID=FINGERPRINT`` items (none: not used), ``--yes``, and a
        confirmation where a person can answer (None where nobody can: no terminal)."""
        items = tuple(expected)
        return cls(
            expected=parse_expected(items) if items else None,
            confirm=confirm,
            assume_recognised=assume_recognised,
        )

    def verify(self, entries: Sequence[RosterEntry], *, known: Collection[str] = (), what: str) -> str:
        """Refuse (:class:`RosterNotRecognisedError`) unless every entry is recognised; return how it
        was, for the caller to say.  ``what``: the roster in words, for the messages."""
        if self.expected is not None:
            problems = unrecognised(entries, self.expected, known)
            if problems:
                raise RosterNotRecognisedError(
                    f"{what}: not every entry is the one you expected, so nothing was signed or written:\n  "
                    + "\n  ".join(problems)
                    + "\nCompare the fingerprints with each institution again (read aloud, not by e-mail)"
                )
            return f"every entry matches the fingerprint you expected ({len(self.expected)} given)"
        if self.assume_recognised:
            return "entries not compared here (--yes): you say you recognised each one"
        if self.confirm is None:
            raise RosterNotRecognisedError(
                f"{what}: nobody can confirm the entries here (no terminal), so nothing was signed or "
                "written: give each entry's fingerprint, heard from that institution, with "
                "--expect ID=FINGERPRINT (deploy join, deploy provision, keys roster sign), or --yes if "
                "you compared them another way"
            )
        if not self.confirm(entries):
            raise RosterNotRecognisedError(
                f"{what}: you did not confirm every entry, so nothing was signed or written; ask the "
                "coordinator (or the institution) about the entry you do not recognise"
            )
        return "you confirmed every entry"
