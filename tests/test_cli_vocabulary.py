"""One name per concept across the commands; the old names still work for one release, with a note.

Each renamed option is run under its old name: the value must reach the command exactly as under
the new name, standard error must carry the one-line deprecation note, and ``--help`` must list
only the new name.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from secure_afl.cli import main
from secure_afl.cli_options import renamed_option, split_pair

SMALL = ["--fraction", "0.06", "--dim", "48", "--fedavg-rounds", "1", "--rounds", "1", "--missing", "7"]
PASSPHRASE = "a long test passphrase\n"


def _invoke(*args: object) -> click.testing.Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def _note(old: str, new: str) -> str:
    return f"{old} is deprecated, use {new} (the old name goes in the next release)"


def _key_dir(tmp_path: Path, name: str) -> Path:
    directory = tmp_path / name
    init = _invoke(
        "keys", "init", "--id", name, "--passphrase-file", _passfile(tmp_path), "--key-dir", directory
    )
    assert init.exit_code == 0, init.output
    return directory


def _passfile(tmp_path: Path) -> Path:
    path = tmp_path / "pass"
    path.write_text(PASSPHRASE)
    path.chmod(0o600)
    return path


def test_sim_secure_is_protection_under_its_old_name(tmp_path: Path) -> None:
    result = _invoke("sim", "--secure", "none", "--out", tmp_path, *SMALL)
    assert result.exit_code == 0, result.output
    assert _note("--secure", "--protection") in result.stderr
    assert "deprecated" not in result.stdout
    config = json.loads((tmp_path / "results.json").read_text())["config"]
    assert config["secure"] == "none"  # the run went through in the clear, as --protection none


def test_sim_without_an_old_name_prints_no_note(tmp_path: Path) -> None:
    result = _invoke("sim", "--protection", "none", "--out", tmp_path, *SMALL)
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    assert json.loads((tmp_path / "results.json").read_text())["config"]["secure"] == "none"


def test_deploy_local_secure_is_protection_under_its_old_name() -> None:
    # The rehearsal's plan refuses a round CKKS does not have, naming the protection it was given:
    # the old name's value reached the library (nothing is started before the plan).
    result = _invoke("deploy", "local", "--secure", "ckks", "--drop", "client-0@R9")
    assert result.exit_code == 2, result.output
    assert _note("--secure", "--protection") in result.stderr
    assert "with --protection ckks" in result.output


def test_deploy_superlink_tls_is_tls_dir_under_its_old_name(tmp_path: Path) -> None:
    tls = tmp_path / "tls"
    tls.mkdir()  # empty: the plan refuses it, naming the directory, before anything starts
    result = _invoke("deploy", "superlink", "--tls", tls, "--listen", "127.0.0.1:9092", "--state-dir",
                     tmp_path / "state")  # fmt: skip
    assert result.exit_code == 1, result.output
    assert _note("--tls", "--tls-dir") in result.stderr
    assert f"--tls-dir {tls.resolve()}: " in result.output and "ca.crt" in result.output
    assert not (tmp_path / "state").exists()


def test_keys_dir_is_key_dir_under_its_old_name(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    passfile = _passfile(tmp_path)
    result = _invoke("keys", "init", "--id", "hospital-a", "--passphrase-file", passfile, "--dir", directory)
    assert result.exit_code == 0, result.output
    assert _note("--dir", "--key-dir") in result.stderr
    assert (directory / "identity.key").is_file() and (directory / "identity.pub.json").is_file()
    shown = _invoke("keys", "show", "--passphrase-file", passfile, "--key-dir", directory)
    assert shown.exit_code == 0 and "hospital-a" in shown.stdout and shown.stderr == ""


def test_provision_coordinator_keys_is_key_dir_under_its_old_name(tmp_path: Path) -> None:
    hospital = _key_dir(tmp_path, "hospital-a")
    empty = tmp_path / "coordinator"
    empty.mkdir()  # no key here: the command reads this directory and says so
    result = _invoke(
        "deploy", "provision", "--out", tmp_path / "fed", "--hospital", hospital, "--coordinator-keys", empty,
        "--passphrase-file", _passfile(tmp_path), "--backbone", "resnet18", "--weights", tmp_path / "w.pt",
        "--yes",
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    assert _note("--coordinator-keys", "--key-dir") in result.stderr
    assert str(empty / "identity.pub.json") in result.output
    assert not (tmp_path / "fed").exists()


def test_provision_fingerprint_is_expect_under_its_old_name(tmp_path: Path) -> None:
    hospital = _key_dir(tmp_path, "hospital-a")
    coordinator = _key_dir(tmp_path, "coordinator")
    result = _invoke(
        "deploy", "provision", "--out", tmp_path / "fed", "--hospital", hospital, "--key-dir", coordinator,
        "--passphrase-file", _passfile(tmp_path), "--backbone", "resnet18", "--weights", tmp_path / "w.pt",
        "--fingerprint", "hospital-a=SHA256:" + "0" * 64,
    )  # fmt: skip
    assert _note("--fingerprint", "--expect") in result.stderr
    assert result.exit_code == 1, result.output  # the weights are absent: refused before anything is written
    assert not (tmp_path / "fed").exists()


@pytest.mark.parametrize(
    ("command", "old", "new"),
    [
        (["sim"], "--secure", "--protection"),
        (["deploy", "local"], "--secure", "--protection"),
        (["deploy", "superlink"], "--tls", "--tls-dir"),
        (["deploy", "provision"], "--coordinator-keys", "--key-dir"),
        (["deploy", "provision"], "--fingerprint", "--expect"),
        (["keys", "init"], "--dir", "--key-dir"),
        (["keys", "show"], "--dir", "--key-dir"),
        (["keys", "roster", "show"], "--dir", "--key-dir"),
        (["keys", "roster", "sign"], "--dir", "--key-dir"),
        (["keys", "roster", "verify"], "--dir", "--key-dir"),
    ],
)
def test_help_lists_the_new_name_only(command: list[str], old: str, new: str) -> None:
    text = _invoke(*command, "--help").stdout
    assert f"  {new} " in text and f"  {old} " not in text and f"{old}," not in text


def test_old_and_new_name_together_are_refused() -> None:
    result = _invoke("deploy", "local", "--secure", "ckks", "--protection", "mask")
    assert result.exit_code == 2 and "--protection and --secure name one option" in result.output


def test_a_renamed_multiple_option_collects_its_old_names_items() -> None:
    @click.command()
    @renamed_option("--expect", "expected", old_names=("--fingerprint",), multiple=True)
    def command(expected: tuple[str, ...]) -> None:
        click.echo(repr(expected))

    result = CliRunner().invoke(command, ["--fingerprint", "a=1", "--fingerprint", "b=2"])
    assert result.exit_code == 0 and result.stdout == "('a=1', 'b=2')\n"
    assert _note("--fingerprint", "--expect") in result.stderr


def test_every_pair_option_refuses_a_malformed_item_in_the_same_words(tmp_path: Path) -> None:
    keys = _key_dir(tmp_path, "hospital-a")
    join = ["deploy", "join", tmp_path, "--features", "f.npz", "--passphrase-env", "X", "--key-dir", keys]
    cases = [
        ([*join, "--set", "noequals"], "'noequals': expected KEY=VALUE, e.g. dp-epsilon=1", "--set"),
        ([*join, "--expect", "hospital-b"], "'hospital-b': expected ID=FINGERPRINT, e.g. hospital-a=",
         "--expect"),
        (["keys", "roster", "sign", "--roster", "r.json", "--expect", "x"], "'x': expected ID=FINGERPRINT",
         "--expect"),
        (["deploy", "local", "--drop", "client-0R1"], "'client-0R1': expected CLIENT@ROUND, e.g. client-2@R2",
         "--drop"),
        (["sim", "--scenario", "multisite", "--site-dir", "nih", "--out", tmp_path / "o"],
         "'nih': expected SITE=DIR, e.g. nih=", "--site-dir"),
        (["sim", "--dataset", "nih", "--data-dir", tmp_path, "--weights", "=w.pt", "--out", tmp_path / "o"],
         "'=w.pt': expected NAME=FILE, e.g. resnet18=resnet18.pt", "--weights"),
    ]  # fmt: skip
    for args, message, option in cases:
        result = _invoke(*args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output and f"Invalid value for {option}" in result.output, result.output


def test_split_pair_splits_at_the_metavars_separator() -> None:
    assert split_pair(" a = b ", "--set", "KEY=VALUE", "k=v") == ("a", "b")
    assert split_pair("client-1@R3", "--drop", "CLIENT@ROUND", "client-2@R2") == ("client-1", "R3")
    assert split_pair("k=", "--set", "KEY=VALUE", "k=v", value_optional=True) == ("k", "")
    for item in ("k=", "=v", "kv", "k@v"):
        with pytest.raises(click.BadParameter, match="expected KEY=VALUE"):
            split_pair(item, "--set", "KEY=VALUE", "k=v")
