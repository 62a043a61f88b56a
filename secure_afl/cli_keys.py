"""``secure-afl keys ...``: identity keys, the roster and the ledger, as each institution's IT team uses them.

An institution runs ``keys init`` once: it writes ``DIR/identity.key`` (the encrypted key file of
:mod:`secure_afl.keys.files`, mode 0600) and ``DIR/identity.pub.json`` (its roster entry: id, name,
public key, fingerprint), which it sends to the coordinator.  Everyone compares fingerprints out of
band (read aloud on a call), the coordinator builds the roster with ``keys roster add``, and every
institution pins the same roster file and checks it with ``keys roster show`` / ``verify``.
"""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import click

from secure_afl.cli_options import DeprecatedOption, LibraryErrorsGroup, key_dir_option, split_pair
from secure_afl.keys.files import KeyFileError, load_identity_key, save_identity_key
from secure_afl.keys.identity import IdentityKey, fingerprint
from secure_afl.keys.recognition import Recognition
from secure_afl.keys.roster import Roster, RosterEntry, RosterError
from secure_afl.keys.store import (
    KEY_FILE,
    PUBLIC_FILE,
    PUBLIC_FORMAT,
    check_local_key_in,
    check_new_passphrase,
    decode_public_key,
    default_key_dir,
    load_public_entry,
    load_roster_file,
    read_entry_file,
    read_passphrase,
    write_roster_file,
    write_roster_file_text,
)


def _passphrase(
    passphrase_file: Path | None, *, confirm: bool, passphrase_env: str | None = None, new: bool = False
) -> bytes:
    if passphrase_file is not None and passphrase_env is not None:
        raise click.UsageError("give --passphrase-file or --passphrase-env, not both")
    if passphrase_file is not None or passphrase_env is not None:
        passphrase = read_passphrase(passphrase_file, passphrase_env)
    else:
        text = click.prompt("Passphrase", hide_input=True, confirmation_prompt=confirm)
        if not text:
            raise click.ClickException("an empty passphrase cannot protect a private key")
        passphrase = text.encode("utf-8")
    return check_new_passphrase(passphrase) if new else passphrase


def load_key(directory: Path, passphrase_file: Path | None, passphrase_env: str | None = None) -> IdentityKey:
    """Decrypt ``DIR/identity.key``; every key-file error becomes a message that names the cause."""
    path = directory / KEY_FILE
    if not path.exists():
        raise click.ClickException(f"{path}: no identity key here; create one with `secure-afl keys init`")
    try:
        return load_identity_key(
            path, _passphrase(passphrase_file, confirm=False, passphrase_env=passphrase_env)
        )
    except KeyFileError as exc:
        raise click.ClickException(str(exc)) from None


def normalise_fingerprint(text: str, option: str = "--expect") -> str:
    """``SHA256:ab12 cd34 ...`` from any spacing or case, with or without the ``SHA256:`` prefix
    (:func:`secure_afl.keys.recognition.parse_fingerprint`); a malformed one is ``option``'s error."""
    from secure_afl.keys.recognition import FingerprintSyntaxError, parse_fingerprint

    try:
        return parse_fingerprint(text)
    except FingerprintSyntaxError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from None


EXPECT_EXAMPLE = "hospital-a='SHA256:ab12 cd34 ...' (quote it)"


def expected_fingerprint(item: str) -> tuple[str, str]:
    """One ``--expect ID=FINGERPRINT`` item: the id and the normalised fingerprint heard out of band."""
    client_id, text = split_pair(item, "--expect", "ID=FINGERPRINT", EXPECT_EXAMPLE)
    return client_id, normalise_fingerprint(text)


def old_fingerprint_option():  # type: ignore[no-untyped-def]
    """The hidden ``--fingerprint FP`` of ``keys roster add``, ``verify`` and ``rotate``, before
    ``--expect ID=FINGERPRINT`` (the spelling of every command that checks a fingerprint heard out of
    band): the command reads it as ``--expect`` with the id it already knows."""
    return click.option(
        "--fingerprint", "fingerprint", cls=DeprecatedOption, replacement="--expect", default=None,
        hint=lambda value: f"--expect ID='{value}'",
    )  # fmt: skip


def _heard(expected: str | None, fingerprint: str | None, client_id: str) -> str | None:
    """The fingerprint heard for ``client_id``: from ``--expect ID=FINGERPRINT`` (its id must be
    ``client_id``), or from the old ``--fingerprint``; None when neither is given."""
    if expected is not None and fingerprint is not None:
        raise click.UsageError("--expect and --fingerprint name one fingerprint: give --expect only")
    if fingerprint is not None:
        return normalise_fingerprint(fingerprint, "--fingerprint")
    if expected is None:
        return None
    heard_id, heard = expected_fingerprint(expected)
    if heard_id != client_id:
        raise click.ClickException(
            f"--expect names {heard_id!r}, but this key belongs to {client_id!r}: a fingerprint is heard for "
            f"one institution; give --expect {client_id}=FINGERPRINT as {client_id} read it to you"
        )
    return heard


def stdin_is_terminal() -> bool:
    """Whether a person can answer a prompt here (standard input is a terminal)."""
    return sys.stdin is not None and sys.stdin.isatty()


def recognition_from_options(expected: Sequence[str], yes: bool, option: str, question: str) -> Recognition:
    """A command's way of recognising a roster's entries (:mod:`secure_afl.keys.recognition`): the
    expected ``ID=FINGERPRINT`` items of ``option``, ``--yes``, or else a prompt asking ``question``
    where a person can answer one (where nobody can, none: the entries are then refused)."""
    from secure_afl.keys.recognition import FingerprintSyntaxError, RecognitionModeError

    def confirm(entries: Sequence[RosterEntry]) -> bool:
        return click.confirm(
            f"{question} Answer y only if each of these {len(entries)} ids and fingerprints is one you heard "
            "from that institution itself",
            default=False,
        )

    for item in expected:  # the syntax as every KEY=VALUE option checks it; the fingerprints below
        split_pair(item, option, "ID=FINGERPRINT", EXPECT_EXAMPLE)
    try:
        return Recognition.from_options(
            expected, assume_recognised=yes, confirm=confirm if stdin_is_terminal() else None
        )
    except FingerprintSyntaxError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from None
    except RecognitionModeError as exc:
        raise click.UsageError(f"{option} and --yes: {exc}") from None


_dir_option = key_dir_option(
    "This institution's key directory (default: $SECURE_AFL_HOME or ~/.secure-afl).",
    old_names=("--dir",),
    dest="directory",
)


def _passphrase_option(function):  # type: ignore[no-untyped-def]
    function = click.option(
        "--passphrase-env",
        metavar="VAR",
        default=None,
        help="Read the passphrase from the environment variable VAR instead of prompting.",
    )(function)
    return click.option(
        "--passphrase-file",
        type=click.Path(path_type=Path, dir_okay=False),
        default=None,
        help="Read the passphrase from this file's first line instead of prompting. The file holds the "
        "passphrase in the clear: mode 0600 (refused otherwise), on the key's machine only.",
    )(function)


_roster_option = click.option(
    "--roster",
    "roster_path",
    type=click.Path(path_type=Path, dir_okay=False),
    required=True,
    help="The roster file (JSON) that every institution pins.",
)


@click.group(cls=LibraryErrorsGroup)
def keys() -> None:
    """Identity keys and the roster of institutions."""


@keys.command()
@click.option(
    "--id", "client_id", required=True, help="This institution's id in the roster (e.g. hospital-a)."
)
@click.option("--name", default=None, help="Display name (default: the id).")
@_passphrase_option
@_dir_option
@click.option("--force", is_flag=True, help="Replace an existing key (the old one is lost).")
def init(
    client_id: str,
    name: str | None,
    passphrase_file: Path | None,
    passphrase_env: str | None,
    directory: Path | None,
    force: bool,
) -> None:
    """Create this institution's Ed25519 identity key, encrypted under a passphrase.

    \b
    Writes KEY_DIR/identity.key (the encrypted key, 0600) and KEY_DIR/identity.pub.json (the roster
    entry to send to the coordinator).  The passphrase (prompted, or --passphrase-file/--passphrase-env)
    must have at least 12 characters.
    """
    directory = directory or default_key_dir()
    try:
        entry_check = RosterEntry(client_id, name or client_id, bytes(32))
    except RosterError as exc:
        raise click.BadParameter(str(exc), param_hint="--id/--name") from None
    key_path = directory / KEY_FILE
    if key_path.exists() and not force:
        raise click.ClickException(f"{key_path}: a key already exists (use --force to replace it)")
    passphrase = _passphrase(passphrase_file, confirm=True, passphrase_env=passphrase_env, new=True)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = IdentityKey.generate()
    try:
        save_identity_key(key_path, key, passphrase, overwrite=force)
    except KeyFileError as exc:
        raise click.ClickException(str(exc)) from None
    entry = RosterEntry(entry_check.client_id, entry_check.name, key.public_key)
    _write_public_entry(directory, entry)
    click.echo(f"wrote {key_path} (private, 0600) and {directory / PUBLIC_FILE} (send it to the coordinator)")
    click.echo(f"id:          {entry.client_id}")
    click.echo(f"fingerprint: {entry.fingerprint}")


@keys.command()
@_passphrase_option
@_dir_option
def show(passphrase_file: Path | None, passphrase_env: str | None, directory: Path | None) -> None:
    """Print the public key and its fingerprint (decrypting the key proves the passphrase)."""
    directory = directory or default_key_dir()
    key = load_key(directory, passphrase_file, passphrase_env)
    entry = load_public_entry(directory)
    if entry.public_key != key.public_key:
        raise click.ClickException(
            f"{directory / PUBLIC_FILE} does not belong to {directory / KEY_FILE} "
            f"({entry.fingerprint} vs {key.fingerprint}); run `keys init` again"
        )
    click.echo(f"id:          {entry.client_id}")
    click.echo(f"name:        {entry.name}")
    click.echo(f"public key:  {base64.b64encode(key.public_key).decode('ascii')}")
    click.echo(f"fingerprint: {key.fingerprint}")
    click.echo(
        "Compare the fingerprint with the roster's out of band (read it aloud), never by e-mail alone."
    )


@keys.group()
def roster() -> None:
    """Build, inspect and verify the roster every institution pins."""


@roster.command("add")
@_roster_option
@click.option(
    "--entry",
    "entry_file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="An institution's identity.pub.json.",
)
@click.option("--id", "client_id", default=None, help="Id (with --public-key, instead of --entry).")
@click.option("--name", default=None, help="Display name (with --public-key).")
@click.option("--public-key", default=None, help="Base64 Ed25519 public key (with --id).")
@click.option(
    "--expect",
    "expected",
    default=None,
    metavar="ID=FINGERPRINT",
    help="The entry's id and fingerprint as you heard them from that institution (quote it): the entry "
    "must match both, or nothing is added.",
)
@old_fingerprint_option()
@click.option(
    "--coordinator",
    is_flag=True,
    help="Add this key as the roster's coordinator (it signs the classifier file), not as an institution.",
)
def roster_add(
    roster_path: Path,
    entry_file: Path | None,
    client_id: str | None,
    name: str | None,
    public_key: str | None,
    expected: str | None,
    fingerprint: str | None,
    coordinator: bool,
) -> None:
    """Add an institution, or with --coordinator the coordinator (creates the roster if needed).

    The coordinator runs the server and signs the classifier file; it creates its key with
    `secure-afl keys init --id coordinator` in its own key directory and its identity.pub.json is
    added here with --coordinator.  Every institution verifies the classifier against this key.
    """
    if (entry_file is None) == (public_key is None):
        raise click.UsageError("give either --entry FILE or --id ID --public-key KEY")
    if entry_file is not None:
        entry = read_entry_file(entry_file)
    else:
        if client_id is None:
            raise click.UsageError("--public-key needs --id")
        try:
            entry = RosterEntry(client_id, name or client_id, decode_public_key(public_key))
        except RosterError as exc:
            raise click.BadParameter(str(exc), param_hint="--id/--public-key") from None
    heard = _heard(expected, fingerprint, entry.client_id)
    if heard is not None and heard != entry.fingerprint:
        raise click.ClickException(
            f"fingerprint mismatch for {entry.client_id!r}: the key's is {entry.fingerprint}, "
            f"you were given {heard}; do not add this key"
        )
    current = load_roster_file(roster_path) if roster_path.exists() else Roster(())
    if entry.client_id in current:
        raise click.ClickException(
            f"{roster_path}: {entry.client_id!r} is already in the roster; remove it first to replace its key"
        )
    if coordinator and current.coordinator is not None:
        raise click.ClickException(
            f"{roster_path}: the roster already names the coordinator {current.coordinator.client_id!r}; "
            f"remove it first (keys roster remove --id {current.coordinator.client_id}) to replace it"
        )
    try:
        if coordinator:
            updated = current.replace(coordinator=entry)
        else:
            updated = current.replace(entries=(*current.entries, entry))
    except RosterError as exc:
        raise click.ClickException(f"{roster_path}: {exc}") from None
    write_roster_file(roster_path, updated)
    role = " as the coordinator" if coordinator else ""
    click.echo(
        f"added {entry.client_id}{role} ({entry.fingerprint}); the roster has {len(updated)} institution(s)"
    )


@roster.command("remove")
@_roster_option
@click.option("--id", "client_id", required=True, help="The institution (or the coordinator) to remove.")
def roster_remove(roster_path: Path, client_id: str) -> None:
    """Remove an institution, or the coordinator."""
    current = load_roster_file(roster_path)
    if current.coordinator is not None and client_id == current.coordinator.client_id:
        write_roster_file(roster_path, current.replace(coordinator=None))
        click.echo(f"removed the coordinator {client_id}; the roster names no coordinator now")
        return
    if client_id not in current:
        raise click.ClickException(f"{roster_path}: {client_id!r} is not in the roster")
    updated = current.replace(entries=tuple(e for e in current.entries if e.client_id != client_id))
    write_roster_file(roster_path, updated)
    click.echo(f"removed {client_id}; the roster has {len(current) - 1} institution(s)")


def _local_entry(directory: Path | None) -> RosterEntry | None:
    directory = directory or default_key_dir()
    return load_public_entry(directory) if (directory / PUBLIC_FILE).exists() else None


@roster.command("show")
@_roster_option
@_dir_option
def roster_show(roster_path: Path, directory: Path | None) -> None:
    """List the institutions, their fingerprints and the roster's own fingerprint."""
    current = load_roster_file(roster_path)
    local = _local_entry(directory)
    for entry in current:
        mark = "  (this institution)" if local is not None and entry.client_id == local.client_id else ""
        click.echo(f"{entry.client_id:<20} {entry.fingerprint}  {entry.name}{mark}")
    if current.coordinator is not None:
        c = current.coordinator
        click.echo(f"{c.client_id:<20} {c.fingerprint}  {c.name}  (coordinator: signs the classifier)")
    else:
        click.echo("no coordinator: add one (keys roster add --coordinator) before a deployment")
    click.echo(f"roster fingerprint: {current.fingerprint}")
    if current.versioned:
        previous = current.previous.hex()[:16] + "..." if current.previous is not None else "none"
        click.echo(f"version {current.version}, after roster {previous}")
        for revoked in current.revoked:
            click.echo(f"revoked or rotated away: {revoked}")
    _show_cosignatures(roster_path)
    if local is not None:
        check_local_key_in(current, local, roster_path)


def _show_cosignatures(roster_path: Path) -> None:
    from secure_afl.keys.cosign import roster_status

    try:
        status = roster_status(roster_path.read_text(encoding="utf-8"))
    except RosterError as exc:
        raise click.ClickException(f"{roster_path}: {type(exc).__name__}: {exc}") from None
    if status.complete:
        click.echo("co-signed by every institution")
    else:
        click.echo(
            f"co-signed by {list(status.signed) or 'nobody yet'}; not yet by {list(status.missing)} (a node "
            "refuses it until every institution co-signed: keys roster sign, or deploy join)"
        )


@roster.command("sign")
@_roster_option
@_passphrase_option
@_dir_option
@click.option(
    "--expect",
    "expected",
    multiple=True,
    metavar="ID=FINGERPRINT",
    help="An entry's fingerprint as you heard it from that institution (quote it): repeat for every "
    "other institution and the coordinator. Any mismatch, an entry not named, or a name not in the "
    "roster refuses: nothing is signed.",
)
@click.option(
    "--yes",
    is_flag=True,
    help="Do not ask to confirm each entry (a script that compared the fingerprints itself). Without "
    "--expect or --yes, sign asks at the terminal, and refuses where there is none.",
)
def roster_sign(
    roster_path: Path,
    passphrase_file: Path | None,
    passphrase_env: str | None,
    directory: Path | None,
    expected: tuple[str, ...],
    yes: bool,
) -> None:
    """Co-sign the roster with this institution's key, only if you recognise every entry.

    
    Adds this institution's signature of the roster's digest to the roster file (beside the
    co-signatures already there, each verified). A node takes part only under a roster that every
    institution co-signed (secure_afl/keys/cosign.py). `secure-afl deploy join KIT` does the same
    for a provisioned kit. Signing says: every id, name and fingerprint below is one this
    institution heard from that institution itself: --expect ID=FINGERPRINT checks it, or the
    terminal prompt asks (--yes: you compared them another way).
    """
    from secure_afl.keys.cosign import (
        check_cosignatures,
        cosigned_roster_json,
        read_roster_document,
        sign_roster,
    )
    from secure_afl.keys.recognition import RosterNotRecognisedError

    recognition = recognition_from_options(expected, yes, "--expect", "Co-sign this roster?")

    try:
        current, cosignatures = read_roster_document(roster_path.read_text(encoding="utf-8"))
        check_cosignatures(current, cosignatures)
    except OSError as exc:
        raise click.ClickException(f"{roster_path}: cannot read the roster: {exc.strerror}") from None
    except RosterError as exc:
        raise click.ClickException(f"{roster_path}: {type(exc).__name__}: {exc}") from None
    directory = directory or default_key_dir()
    key = load_key(directory, passphrase_file, passphrase_env)
    try:
        client_id, signature = sign_roster(current, key)
    except RosterError as exc:
        raise click.ClickException(f"{roster_path}: {exc}") from None
    for entry in current:
        click.echo(f"{entry.client_id:<20} {entry.fingerprint}  {entry.name}")
    entries = tuple(current.entries)
    if current.coordinator is not None:
        c = current.coordinator
        click.echo(f"{c.client_id:<20} {c.fingerprint}  {c.name}  (coordinator)")
        entries += (c,)
    try:
        how = recognition.verify(
            entries, known=(client_id,), what=f"{roster_path}: the roster {current.fingerprint}"
        )
    except RosterNotRecognisedError as exc:
        raise click.ClickException(f"RosterNotRecognisedError: {exc}") from None
    click.echo(f"ok  roster entries: {how}")
    cosignatures[client_id] = signature
    write_roster_file_text(roster_path, cosigned_roster_json(current, cosignatures))
    click.echo(
        f"{client_id} co-signed the roster {current.fingerprint} ({len(current)} institutions) in "
        f"{roster_path}"
    )
    missing = [cid for cid in current.client_ids if cid not in cosignatures]
    click.echo(f"still to co-sign: {missing}" if missing else "every institution has co-signed it")


@roster.command("verify")
@_roster_option
@click.option(
    "--expect",
    "expected",
    multiple=True,
    metavar="ID=FINGERPRINT",
    help="An institution's (or the coordinator's) fingerprint as you heard it from that institution "
    "(quote it); repeat for each to check.  [required]",
)
@click.option(
    "--id", "client_id", cls=DeprecatedOption, replacement="--expect", default=None,
    hint=lambda value: f"--expect {value}=FINGERPRINT",
)  # fmt: skip
@old_fingerprint_option()
@_dir_option
def roster_verify(
    roster_path: Path,
    expected: tuple[str, ...],
    client_id: str | None,
    fingerprint: str | None,
    directory: Path | None,
) -> None:
    """Check institutions' fingerprints (and that the roster holds this institution's key)."""
    if (client_id is None) != (fingerprint is None):
        raise click.UsageError("the old --id and --fingerprint go together: give --expect ID=FINGERPRINT")
    pairs = [expected_fingerprint(item) for item in expected]
    if client_id is not None:
        if pairs:
            raise click.UsageError("--expect and --id/--fingerprint name the same check: give --expect only")
        pairs = [(client_id, normalise_fingerprint(str(fingerprint), "--fingerprint"))]
    if not pairs:
        raise click.UsageError(
            f"give --expect ID=FINGERPRINT, e.g. {EXPECT_EXAMPLE}: the fingerprint you heard from that "
            "institution"
        )
    current = load_roster_file(roster_path)
    coordinator = current.coordinator
    for heard_id, heard in pairs:
        if heard_id not in current and (coordinator is None or coordinator.client_id != heard_id):
            raise click.ClickException(f"{roster_path}: {heard_id!r} is not in the roster")
        if coordinator is not None and coordinator.client_id == heard_id:
            actual = coordinator.fingerprint
        else:
            actual = current.entry(heard_id).fingerprint
        if actual != heard:
            raise click.ClickException(
                f"FINGERPRINT MISMATCH for {heard_id!r}: the roster holds {actual}, you were given {heard}. "
                f"Do not use this roster until the institutions agree on the key."
            )
    local = _local_entry(directory)
    if local is not None:
        check_local_key_in(current, local, roster_path)
    for heard_id, heard in pairs:
        click.echo(f"{heard_id}: fingerprint matches ({heard})")


# --- roster versions and key lifecycle (secure_afl/keys/lifecycle.py) --------------------------


def _read_cosigned(path: Path, what: str) -> tuple[str, Roster]:
    from secure_afl.keys.cosign import require_cosigned, roster_status

    try:
        text = path.read_text(encoding="utf-8")
        return text, require_cosigned(roster_status(text), f"{path} ({what})")
    except OSError as exc:
        raise click.ClickException(f"{path}: cannot read the roster: {exc.strerror}") from None
    except RosterError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None


@roster.command("next")
@click.option(
    "--roster",
    "roster_path",
    type=click.Path(path_type=Path, dir_okay=False),
    required=True,
    help="The roster every institution pins now (co-signed by every institution).",
)
@click.option(
    "--out",
    "out_path",
    type=click.Path(path_type=Path, dir_okay=False),
    required=True,
    help="Where to write the draft of the next version (refused if it exists).",
)
def roster_next(roster_path: Path, out_path: Path) -> None:
    """Start the next roster version: the same entries, version + 1, the current roster's digest as
    its predecessor, its revocations kept (coordinator).

    \b
    Then change the draft with keys roster add / remove / rotate / revoke, have every institution of
    the new version co-sign it (keys roster sign), and send it to every institution, which moves to
    it with keys roster update.
    """
    from secure_afl.keys.lifecycle import next_version

    _, current = _read_cosigned(roster_path, "the current roster")
    if out_path.exists():
        raise click.ClickException(f"{out_path} already exists: choose another --out")
    draft = next_version(current)
    write_roster_file(out_path, draft)
    click.echo(
        f"wrote {out_path}: roster version {draft.version} after {current.fingerprint} (version "
        f"{current.version}), {len(draft)} institution(s), not co-signed yet"
    )


@roster.command("rotate")
@_roster_option
@click.option(
    "--statement",
    "statement_path",
    type=click.Path(path_type=Path, dir_okay=False),
    required=True,
    help="The institution's rotation.json (written by its `secure-afl keys rotate`).",
)
@click.option(
    "--expect",
    "expected",
    default=None,
    metavar="ID=FINGERPRINT",
    help="The institution's id and new key's fingerprint as it read them aloud (quote it): the statement "
    "must match both.",
)
@old_fingerprint_option()
def roster_rotate(
    roster_path: Path, statement_path: Path, expected: str | None, fingerprint: str | None
) -> None:
    """Put an institution's new key into a draft roster version (from keys roster next).

    The statement must be signed by the key the draft lists for that institution (its current key); the
    draft then holds the new key, the statement, and the old key's fingerprint as revoked (rotated away).
    """
    from secure_afl.keys.rotation import KeyRotation, KeyRotationError

    current = load_roster_file(roster_path)
    try:
        rotation = KeyRotation.from_json(statement_path.read_text(encoding="utf-8")).verify()
    except OSError as exc:
        raise click.ClickException(f"{statement_path}: cannot read the statement: {exc.strerror}") from None
    except KeyRotationError as exc:
        raise click.ClickException(f"{statement_path}: KeyRotationError: {exc}") from None
    heard = _heard(expected, fingerprint, rotation.client_id)
    if heard is not None and heard != rotation.new_fingerprint:
        raise click.ClickException(
            f"fingerprint mismatch for {rotation.client_id!r}'s new key: the statement names "
            f"{rotation.new_fingerprint}, you were given {heard}; do not use it"
        )
    if current.version == 1:
        raise click.ClickException(
            f"{roster_path} is a first roster: start the next version with `keys roster next`, "
            "and rotate there"
        )
    coordinator = current.coordinator
    is_coordinator = coordinator is not None and coordinator.client_id == rotation.client_id
    if not is_coordinator and rotation.client_id not in current:
        raise click.ClickException(f"{roster_path}: {rotation.client_id!r} is not in the roster")
    old = coordinator if is_coordinator else current.entry(rotation.client_id)
    assert old is not None
    if old.public_key != rotation.old_public_key:
        raise click.ClickException(
            f"{statement_path}: signed by {rotation.old_fingerprint}, but the roster lists "
            f"{rotation.client_id!r} with {old.fingerprint}: the statement must be signed by the key the "
            "roster holds"
        )
    entry = RosterEntry(old.client_id, old.name, rotation.new_public_key)
    others = tuple(r for r in current.rotations if r.client_id != rotation.client_id)
    try:
        if is_coordinator:
            updated = current.replace(coordinator=entry)
        else:
            entries = tuple(entry if e.client_id == entry.client_id else e for e in current.entries)
            updated = current.replace(entries=entries)
        updated = updated.replace(
            revoked=(*current.revoked, rotation.old_fingerprint), rotations=(*others, rotation)
        )
    except RosterError as exc:
        raise click.ClickException(f"{roster_path}: {exc}") from None
    write_roster_file(roster_path, updated)
    click.echo(
        f"rotated {rotation.client_id}: {rotation.old_fingerprint} -> {rotation.new_fingerprint} (the old "
        f"key is listed as rotated away) in roster version {updated.version}; every institution co-signs "
        "it again"
    )


@roster.command("revoke")
@_roster_option
@click.option(
    "--fingerprint",
    "revoked",
    required=True,
    help="The fingerprint of the key to revoke (a key that leaked): no roster of the federation may hold it "
    "again. The entry that holds it is removed; add the institution's new key with keys roster add.",
)
def roster_revoke(roster_path: Path, revoked: str) -> None:
    """Revoke a key in a draft roster version (from keys roster next)."""
    current = load_roster_file(roster_path)
    wanted = normalise_fingerprint(revoked, "--fingerprint")
    if current.version == 1:
        raise click.ClickException(
            f"{roster_path} is a first roster: start the next version with `keys roster next`, "
            "and revoke there"
        )
    holder = next((e for e in current.entries if e.fingerprint == wanted), None)
    coordinator = current.coordinator
    if coordinator is not None and coordinator.fingerprint == wanted:
        updated = current.replace(coordinator=None, revoked=(*current.revoked, wanted))
        who = f"the coordinator {coordinator.client_id} (add its new key with keys roster add --coordinator)"
    else:
        entries = tuple(e for e in current.entries if e.fingerprint != wanted)
        updated = current.replace(entries=entries, revoked=(*current.revoked, wanted))
        who = f"{holder.client_id} (removed)" if holder is not None else "no entry of this version"
    write_roster_file(roster_path, updated)
    click.echo(f"revoked {wanted}, held by {who}, in roster version {updated.version}")


@roster.command("update")
@click.option(
    "--roster",
    "roster_path",
    type=click.Path(path_type=Path, dir_okay=False),
    required=True,
    help="The roster this node pins (its node config's roster file): replaced atomically.",
)
@click.option(
    "--new",
    "new_path",
    type=click.Path(path_type=Path, dir_okay=False),
    required=True,
    help="The next roster version, co-signed by every institution it lists (from the coordinator).",
)
@click.option(
    "--ledger-dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="The node's ledger-dir: records the version moved to (roster-pin.json), so the node refuses any "
    "other roster at its path from then on (an older one copied back, a fork).",
)
@_dir_option
@click.option(
    "--expect",
    "expected",
    multiple=True,
    metavar="ID=FINGERPRINT",
    help="A newcomer's fingerprint (or a replaced key's, or a new coordinator's) as you heard it from that "
    "institution (quote it); repeat for each. A mismatch, a newcomer not named, or a name not in the "
    "roster refuses: nothing is written.",
)
@click.option(
    "--yes", is_flag=True, help="Do not ask to confirm the newcomers (you compared them another way)."
)
def roster_update(
    roster_path: Path,
    new_path: Path,
    ledger_dir: Path | None,
    directory: Path | None,
    expected: tuple[str, ...],
    yes: bool,
) -> None:
    """Move this node to the next roster version, only if it follows the pinned one.

    \b
    The next version must be co-signed by every institution it lists, be the pinned version + 1 and
    name the pinned roster's digest as its predecessor (no rollback, no fork), keep every revocation,
    and change a key only by a rotation statement signed by the pinned key or after the old key's
    revocation; every newcomer must match --expect (as deploy join). The pinned roster is kept beside
    it as ROSTER.vN.json. The ledger and the DP budget carry over: a new roster is not a fresh budget.
    """
    from secure_afl.keys.lifecycle import accept_successor, write_pin
    from secure_afl.keys.recognition import RosterNotRecognisedError

    recognition = recognition_from_options(expected, yes, "--expect", "Move to this roster?")
    pinned_text, pinned = _read_cosigned(roster_path, "the pinned roster")
    try:
        next_text = new_path.read_text(encoding="utf-8")
    except OSError as exc:
        raise click.ClickException(f"{new_path}: cannot read the roster: {exc.strerror}") from None
    local = _local_entry(directory)
    try:
        succession = accept_successor(
            pinned_text, next_text, recognition,
            own_id=None if local is None else local.client_id, what=f"{new_path}: the roster",
        )  # fmt: skip
    except RosterNotRecognisedError as exc:
        raise click.ClickException(f"RosterNotRecognisedError: {exc}") from None
    except RosterError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
    following = succession.next
    archive = roster_path.with_name(f"{roster_path.stem}.v{pinned.version}{roster_path.suffix}")
    write_roster_file_text(archive, pinned_text.rstrip("\n"))
    write_roster_file_text(roster_path, next_text.rstrip("\n"))
    for line in succession.describe():
        click.echo(f"ok  {line}")
    if ledger_dir is not None:
        click.echo(f"ok  pinned version {following.version} in {write_pin(ledger_dir, following)}")
    carried = " The ledger and its DP budget carry over." if ledger_dir is not None else ""
    click.echo(
        f"{roster_path} is now roster version {following.version} ({following.fingerprint}); version "
        f"{pinned.version} kept as {archive}.{carried}"
    )
    if local is not None and local.fingerprint in following.revoked:
        click.echo(
            f"this institution's key ({local.fingerprint}) is revoked in it: the node refuses to run with it "
            "(KeyRevokedError) until its new key is in the roster"
        )
    elif local is not None and local.client_id not in following:
        click.echo(f"{local.client_id} is not in this roster version: the node takes no further part")


@keys.command()
@_passphrase_option
@_dir_option
@click.option(
    "--ledger-dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="The node's ledger-dir: its ledger moves to the new key with its history (re-signed by the new key, "
    "the rotation statement recorded in it). Give it on a node, or the node cannot open its ledger.",
)
def rotate(
    passphrase_file: Path | None, passphrase_env: str | None, directory: Path | None, ledger_dir: Path | None
) -> None:
    """Replace this institution's identity key: the old key signs the new one.

    \b
    Writes a new KEY_DIR/identity.key (same passphrase) and identity.pub.json, keeps the old key as
    KEY_DIR/identity.key.rotated-FINGERPRINT (0600; delete it once the new roster is pinned), and writes
    KEY_DIR/rotation.json: send it to the coordinator (keys roster rotate) and read the new fingerprint
    aloud. Peers accept the new key only from a roster version every institution co-signed; until
    this node pins it, the node takes no part (its key is not in its roster).
    """
    from secure_afl.keys.rotation import KeyRotation

    directory = directory or default_key_dir()
    old_key = load_key(directory, passphrase_file, passphrase_env)
    entry = load_public_entry(directory)
    if entry.public_key != old_key.public_key:
        raise click.ClickException(
            f"{directory / PUBLIC_FILE} does not belong to {directory / KEY_FILE}: run `keys show` first"
        )
    passphrase = _passphrase(passphrase_file, confirm=False, passphrase_env=passphrase_env, new=True)
    new_key = IdentityKey.generate()
    rotation = KeyRotation.make(entry.client_id, old_key, new_key.public_key)
    key_path = directory / KEY_FILE
    staged = directory / f"{KEY_FILE}.next"
    try:
        save_identity_key(staged, new_key, passphrase, overwrite=True)
    except KeyFileError as exc:
        raise click.ClickException(str(exc)) from None
    if ledger_dir is not None:
        from secure_afl.privacy.ledger import FileLedger, LedgerOwner

        try:
            state = FileLedger(ledger_dir).rotate(
                LedgerOwner(entry.client_id, old_key), LedgerOwner(entry.client_id, new_key), rotation
            )
        except Exception as exc:  # the ledger's own errors name the file and the remedy
            staged.unlink()
            raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
        click.echo(
            f"ok  moved the ledger in {ledger_dir} to the new key ({len(state.sessions)} session(s) kept)"
        )
    retired = directory / f"{KEY_FILE}.rotated-{old_key.public_key.hex()[:16]}"
    key_path.replace(retired)
    staged.replace(key_path)
    new_entry = RosterEntry(entry.client_id, entry.name, new_key.public_key)
    _write_public_entry(directory, new_entry)
    (directory / "rotation.json").write_text(rotation.to_json() + "\n", encoding="utf-8")
    click.echo(f"wrote {key_path} (new key), {directory / PUBLIC_FILE} and {directory / 'rotation.json'}")
    click.echo(f"old key kept as {retired} (delete it once the new roster is pinned)")
    click.echo(f"id:              {entry.client_id}")
    click.echo(f"old fingerprint: {old_key.fingerprint}")
    click.echo(f"fingerprint:     {new_key.fingerprint}")
    click.echo("send rotation.json to the coordinator and read the new fingerprint aloud")


def _write_public_entry(directory: Path, entry: RosterEntry) -> None:
    document = {
        "format": PUBLIC_FORMAT,
        "id": entry.client_id,
        "name": entry.name,
        "public_key": base64.b64encode(entry.public_key).decode("ascii"),
        "fingerprint": entry.fingerprint,
    }
    (directory / PUBLIC_FILE).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")


__all__ = ["fingerprint", "keys"]


# --- secure-afl keys ledger ------------------------------------------------------------------


@keys.group()
def ledger() -> None:
    """The ledger of released values and answered rounds (SECURITY.md, one contribution per value)."""


def _ledger_options(function):  # type: ignore[no-untyped-def]
    function = click.option(
        "--client-id", required=True, help="The institution's id in the roster (the ledger file's name)."
    )(function)
    return click.option(
        "--ledger-dir",
        type=click.Path(path_type=Path, file_okay=False),
        required=True,
        help="The node's ledger-dir (its node config's ledger-dir).",
    )(function)


@ledger.command("show")
@_ledger_options
def ledger_show(ledger_dir: Path, client_id: str) -> None:
    """Print the sessions in the ledger file (read without the key: nothing is verified or changed).

    Reads LEDGER_DIR/CLIENT.ledger.json and its generation marker.
    """
    path = ledger_dir / f"{client_id}.ledger.json"
    if not path.exists():
        raise click.ClickException(
            f"{path} does not exist (the node has not taken part yet, or it was removed)"
        )
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        sessions = document["sessions"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise click.ClickException(f"{path} is not a ledger file: {exc}") from None
    click.echo(f"{path}: generation {document.get('generation')}, {len(sessions)} session(s)")
    for sid, entry in sessions.items():
        released = "released " + str(len(entry.get("released", []))) if entry.get("survivors") else "open"
        if entry.get("survivors") and entry.get("images"):
            # base64 of 32-byte digests: 4 characters for every 3 bytes
            images = len(entry["images"]) * 3 // 4 // 32
            released += f" value id(s), {images} image(s) under {entry.get('scope') or '-'}"
        rounds = ",".join(sorted(entry.get("answers", {})))
        click.echo(f"  {sid[:16]}...  {released}  rounds answered: {rounds or '-'}")


@ledger.command("reset")
@_ledger_options
@click.option("--reason", required=True, help="Why (kept in LEDGER_DIR/ledger-resets.log).")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def ledger_reset(ledger_dir: Path, client_id: str, reason: str, yes: bool) -> None:
    """Start an empty history: move the ledger aside (CLIENT.ledger.json.reset-TIME), drop its
    generation marker, and log the reset with its reason.

    Needed when the ledger is missing or older than the last one written (the node refuses to take
    part until then).  A reset forgets which values were released: the coordinator may then obtain a
    second sum of them, so reset only when you know why the ledger was lost.
    """
    from secure_afl.privacy.ledger import FileLedger

    store = FileLedger(ledger_dir)
    if not store.path(client_id).exists() and not store.marker(client_id).exists():
        # Nothing to reset: a typo in either option would otherwise log a reset that did nothing.
        found = sorted(p.name for p in ledger_dir.glob("*.ledger.json")) if ledger_dir.is_dir() else []
        raise click.ClickException(
            f"nothing to reset: {ledger_dir} holds neither {store.path(client_id).name} nor its generation "
            f"marker; give the node config's ledger-dir and the roster id as --client-id"
            + (f" (ledgers there: {', '.join(found)})" if found else "")
        )
    if not yes:
        click.confirm(
            f"Reset {client_id}'s ledger in {ledger_dir}? The values it lists could then be released again",
            abort=True,
        )
    try:
        archived = store.reset(client_id, reason)
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot reset the ledger in {ledger_dir}: {exc}") from None
    where = f"moved to {archived}" if archived is not None else "there was no ledger file"
    click.echo(f"reset {client_id}'s ledger ({where}); logged in {ledger_dir / 'ledger-resets.log'}")
