"""``secure-afl keys ledger``: look at or reset an institution's release ledger (an operator's act)."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.group()
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
def show(ledger_dir: Path, client_id: str) -> None:
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
def reset(ledger_dir: Path, client_id: str, reason: str, yes: bool) -> None:
    """Start an empty history: move the ledger aside (CLIENT.ledger.json.reset-TIME), drop its
    generation marker, and log the reset with its reason.

    Needed when the ledger is missing or older than the last one written (the node refuses to take
    part until then).  A reset forgets which values were released: the coordinator may then obtain a
    second sum of them, so reset only when you know why the ledger was lost.
    """
    from secure_afl.privacy.ledger import FileLedger

    if not yes:
        click.confirm(
            f"Reset {client_id}'s ledger in {ledger_dir}? The values it lists could then be released again",
            abort=True,
        )
    try:
        archived = FileLedger(ledger_dir).reset(client_id, reason)
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot reset the ledger in {ledger_dir}: {exc}") from None
    where = f"moved to {archived}" if archived is not None else "there was no ledger file"
    click.echo(f"reset {client_id}'s ledger ({where}); logged in {ledger_dir / 'ledger-resets.log'}")
