"""docs/cli.md is what the commands' --help says now."""

from __future__ import annotations

from pathlib import Path

from secure_afl.cli_reference import cli_reference

ROOT = Path(__file__).resolve().parents[1]


def test_the_cli_reference_is_current() -> None:
    written = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert written == cli_reference(), (
        "docs/cli.md is out of date: run `python -m secure_afl.cli_reference docs/cli.md`"
    )


def test_the_reference_covers_every_command() -> None:
    text = cli_reference()
    for path in ("secure-afl sim", "secure-afl deploy superlink", "secure-afl deploy join",
                 "secure-afl keys init", "secure-afl features extract", "secure-afl predict"):  # fmt: skip
        assert f"\n## {path}\n" in text, path
    assert "--front [caddy|nginx]" in text and "--nginx" not in text  # a hidden option stays hidden


def test_deploy_help_lists_the_walk_through_before_its_building_blocks() -> None:
    from click.testing import CliRunner

    from secure_afl.cli import main

    text = CliRunner().invoke(main, ["deploy", "--help"]).output
    walk, blocks = text.index("Walk-through"), text.index("Building blocks")
    steps = ["provision", "superlink", "join", "collect", "run", "check", "local"]
    at = [text.index(f"\n  {step} ") for step in steps]
    assert walk < at[0] and at == sorted(at) and at[-1] < blocks
    assert all(text.index(f"\n  {name} ") > blocks for name in ("tls", "node-key", "app"))
