"""``secure-afl audit ...``: read and verify a party's audit log (:mod:`secure_afl.keys.auditlog`).

A node's log is ``LEDGER_DIR/audit.log`` (its node config's ledger-dir); the coordinator's is
``OUT_DIR/audit.log`` of ``deploy run``.  ``show`` prints it as stored; ``verify`` checks the chain
and every signature and exits 0 (valid), 1 (invalid: the first bad record is named, and why) or 2
(usage).
"""

from __future__ import annotations

from pathlib import Path

import click

from secure_afl.cli_options import LibraryErrorsGroup
from secure_afl.keys.auditlog import AUDIT_FILE, AuditLogError, read_log, summary, verify_with


@click.group(cls=LibraryErrorsGroup)
def audit() -> None:
    """A party's audit log: its sessions, refusals, releases and key, roster and study changes."""


def _log_options(function):  # type: ignore[no-untyped-def]
    function = click.option(
        "--ledger-dir",
        type=click.Path(path_type=Path, file_okay=False),
        default=None,
        help=f"A node's ledger-dir (its node config's): the log is LEDGER_DIR/{AUDIT_FILE}.",
    )(function)
    return click.option(
        "--log",
        "log_path",
        type=click.Path(path_type=Path, dir_okay=False),
        default=None,
        help=f"The audit log file (the coordinator's: deploy run's OUT_DIR/{AUDIT_FILE}).",
    )(function)


def _path(log_path: Path | None, ledger_dir: Path | None) -> Path:
    if (log_path is None) == (ledger_dir is None):
        raise click.UsageError("give exactly one of --log FILE and --ledger-dir DIR")
    return log_path if log_path is not None else ledger_dir / AUDIT_FILE  # type: ignore[operator]


@audit.command("show")
@_log_options
def show(log_path: Path | None, ledger_dir: Path | None) -> None:
    """Print the log's records, one a line (read as stored: `audit verify` checks them)."""
    path = _path(log_path, ledger_dir)
    if not path.is_file():
        raise click.ClickException(f"{path}: no audit log here (nothing recorded yet, or the path is wrong)")
    try:
        contents = read_log(path)
    except AuditLogError as exc:
        raise click.ClickException(str(exc)) from None
    records = contents.records()
    click.echo(f"{path}: {len(records)} record(s), not verified (`secure-afl audit verify` checks them)")
    for number, record in enumerate(records, start=1):
        if record is None:
            click.echo(f"  line {number}: not an audit record")
            continue
        click.echo(f"  #{record.index:<4} {record.time}  {record.party}  {record.kind}  {summary(record)}")
    if contents.unfinished:
        click.echo(f"  (an unfinished last line of {len(contents.unfinished)} bytes: a write cut short)")


@audit.command("verify")
@_log_options
@click.option(
    "--roster",
    "roster_path",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="The roster holding the party's public key. The versions kept beside it (ROSTER.vN.json, by keys "
    "roster update) give the party's earlier keys, each for the records written while it was the party's.",
)
@click.option(
    "--party", default=None, help="Whose log it is (default: the one roster party its records name)."
)
@click.option(
    "--public-key",
    "public_keys",
    multiple=True,
    metavar="BASE64",
    help="A public key the log may be signed with, on any record (repeatable; an override: a key "
    "the roster versions do not give).",
)
def verify(
    log_path: Path | None,
    ledger_dir: Path | None,
    roster_path: Path | None,
    party: str | None,
    public_keys: tuple[str, ...],
) -> None:
    """Check the chain and every record's signature; name the first bad record.

    Exit 0: every record verifies (an unfinished last line, what a crash mid-write leaves, is
    reported, not counted against the log); 1: a record fails (its line, index and why: a key used
    before it was the party's or after it was rotated away or revoked included), the log
    holds no complete record, or the log or the key cannot be read; 2: usage.  A log cut at a
    record boundary, or deleted, cannot be told from a shorter one: compare with the copy kept
    elsewhere.
    """
    path = _path(log_path, ledger_dir)
    if roster_path is None and not public_keys:
        raise click.UsageError("give --roster (with --party) or --public-key: the key the log is signed with")
    try:
        result = verify_with(path, roster_path=roster_path, party=party, public_keys=public_keys)
    except AuditLogError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(result.describe())
    if not result.ok:
        raise SystemExit(1)
    if result.records == 0:  # the first record creates the log: an empty one verifies nothing
        raise click.ClickException(
            f"{path}: nothing verified: no complete record (a log is created by its first record, so an "
            "empty one was cut to nothing or is not the log): compare with the copy kept elsewhere"
        )
