"""The CLI reference, generated from the click commands themselves: ``docs/cli.md``.

``python -m secure_afl.cli_reference docs/cli.md`` rewrites it; a test fails when the file is not
what the commands say now, so the reference cannot drift from ``--help``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import click

from secure_afl.cli import main

PROG = "secure-afl"
WIDTH = 100  # help is wrapped at this width, whatever the terminal generating it


def _commands(command: click.Command, ctx: click.Context) -> Iterator[tuple[click.Context, click.Command]]:
    yield ctx, command
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is None or sub.hidden:
                continue
            child = click.Context(
                sub, info_name=name, parent=ctx, terminal_width=WIDTH, max_content_width=WIDTH
            )
            yield from _commands(sub, child)


def cli_reference(root: click.Command = main) -> str:
    """Every visible command's ``--help``, in the order ``--help`` lists them, as Markdown."""
    top = click.Context(root, info_name=PROG, terminal_width=WIDTH, max_content_width=WIDTH)
    parts = [
        "# Command-line reference",
        "",
        "Generated from the commands by `python -m secure_afl.cli_reference docs/cli.md`; "
        "`tests/test_cli_reference.py` fails when it is out of date. Each section is the command's "
        "`--help`.",
        "",
    ]
    entries = list(_commands(root, top))
    for ctx, _command in entries:
        parts.append(f"- [`{ctx.command_path}`](#{ctx.command_path.replace(' ', '-')})")
    parts.append("")
    for ctx, command in entries:
        parts += [f"## {ctx.command_path}", "", "```text", command.get_help(ctx).rstrip(), "```", ""]
    return "\n".join(parts)


def write(path: Path) -> None:
    path.write_text(cli_reference(), encoding="utf-8")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m secure_afl.cli_reference docs/cli.md")
    write(Path(sys.argv[1]))
