"""One name per concept across the commands; the old names still work for one release, with a note.

Each renamed option is run under its old name: the value must reach the command exactly as under
the new name, standard error must carry the one-line deprecation note, and ``--help`` must list
only the new name.
"""

from __future__ import annotations

import contextlib
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
        (["keys", "roster", "add"], "--fingerprint", "--expect"),
        (["keys", "roster", "verify"], "--fingerprint", "--expect"),
        (["keys", "roster", "verify"], "--id", "--expect"),
        (["keys", "roster", "rotate"], "--fingerprint", "--expect"),
        (["deploy", "app"], "--out", "--app-dir"),
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


# --- the vocabulary across every command ------------------------------------------------------------

# One concept, one option name: the commands listed take the concept under this name, and no other
# command shows the name (it would then mean something else there).  Old names are hidden aliases.
VOCABULARY = {
    "a party's own identity key directory (identity.key, identity.pub.json)": ("--key-dir", {
        "deploy provision", "deploy collect", "deploy join", "deploy run", "deploy app", "keys init",
        "keys show", "keys rotate", "keys roster show", "keys roster sign", "keys roster update",
        "keys roster verify"}),
    "the federation directory deploy provision writes": ("--federation-dir", {
        "deploy provision", "deploy collect"}),
    "the federation's name (FLWR_HOME/config.toml's [superlink.NAME])": ("--federation", {
        "deploy provision", "deploy superlink", "deploy collect", "deploy run", "deploy app"}),
    "the protection a study or run uses": ("--protection", {
        "sim", "deploy local", "deploy provision", "deploy app"}),
    "the protections a hospital accepts (node config protection=)": ("--accept-protection", {"deploy join"}),
    "a fingerprint heard out of band, ID=FINGERPRINT": ("--expect", {
        "deploy provision", "deploy join", "keys roster add", "keys roster sign", "keys roster update",
        "keys roster verify", "keys roster rotate"}),
    # Not a fingerprint heard: the key to revoke, named by its fingerprint.
    "a key to revoke": ("--fingerprint", {"keys roster revoke"}),
    "the coordinator's Flower app directory (DIR/pyproject.toml: the run config)": ("--app-dir", {
        "deploy app", "deploy run"}),
    "a node's ledger directory": ("--ledger-dir", {
        "audit show", "audit verify", "deploy node-metrics", "keys ledger reset", "keys ledger show",
        "keys roster update", "keys rotate"}),
    "the passphrase file": ("--passphrase-file", {
        "deploy provision", "deploy collect", "deploy join", "deploy run", "deploy app", "keys init",
        "keys show", "keys rotate", "keys roster sign"}),
    "the directory deploy tls writes": ("--tls-dir", {"deploy superlink"}),
    "the Flower config directory": ("--flwr-home", {"deploy collect", "deploy run", "deploy app"}),
    "the frozen backbone": ("--backbone", {"sim", "deploy provision", "deploy app", "features extract"}),
    "the classes a hospital labels": ("--active", {"features extract"}),
}  # fmt: skip


def _commands() -> dict[str, click.Command]:
    """Every command of ``secure-afl``, by its path without the program name."""
    found: dict[str, click.Command] = {}

    def walk(command: click.Command, ctx: click.Context) -> None:
        found[ctx.command_path.removeprefix("secure-afl").strip()] = command
        if isinstance(command, click.Group):
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                assert sub is not None
                walk(sub, click.Context(sub, info_name=name, parent=ctx))

    walk(main, click.Context(main, info_name="secure-afl"))
    return found


def _shown(command: click.Command) -> list[click.Option]:
    return [p for p in command.params if isinstance(p, click.Option) and not p.hidden]


def test_every_command_is_walked() -> None:
    # The walk finds every command docs/cli.md documents (a new command joins the checks below by itself).
    reference = Path(__file__).parents[1] / "docs" / "cli.md"
    documented = {
        line.removeprefix("## secure-afl").strip()
        for line in reference.read_text(encoding="utf-8").splitlines()
        if line.startswith("## secure-afl")
    }
    assert set(_commands()) == documented and len(documented) == 39


@pytest.mark.parametrize("concept", list(VOCABULARY))
def test_one_name_per_concept_across_every_command(concept: str) -> None:
    name, expected = VOCABULARY[concept]
    having = {path for path, command in _commands().items() if any(name in p.opts for p in _shown(command))}
    assert having == expected, (concept, having ^ expected)


def test_every_shown_option_has_one_name() -> None:
    # "--x/--no-x" pairs are one flag; any other second name is an old name and is hidden.
    for path, command in _commands().items():
        for param in _shown(command):
            assert len(param.opts) == 1, (path, param.opts)


def test_no_positional_takes_a_concept_an_option_names() -> None:
    from secure_afl.cli_options import DeprecatedArgument

    shown = {
        (path, p.name)
        for path, command in _commands().items()
        for p in command.params
        if isinstance(p, click.Argument) and not isinstance(p, DeprecatedArgument)
    }
    assert shown == {("deploy join", "kit_dir"), ("deploy collect", "replies"), ("deploy node-key", "path"),
                     ("deploy status", "directory"), ("features show", "file")}  # fmt: skip


# Every old name: (command, old name, what to use instead, a value the old name takes).
ALIASES = [
    ("sim", "--secure", "--protection", "none"),
    ("sim", "--backbones", "--backbone", "resnet18"),
    ("deploy local", "--secure", "--protection", "mask"),
    ("deploy superlink", "--tls", "--tls-dir", "{dir}"),
    ("deploy superlink", "--nginx", "--front nginx --front-binary PATH", "/usr/sbin/nginx"),
    ("deploy provision", "--out", "--federation-dir", "{dir}"),
    ("deploy provision", "--coordinator-keys", "--key-dir", "{dir}"),
    ("deploy provision", "--fingerprint", "--expect", "a=SHA256:x"),
    ("deploy join", "--protection", "--accept-protection", "mask,ckks"),
    ("deploy app", "--identity-key", "--key-dir", "{key}"),
    ("deploy app", "--out", "--app-dir", "{dir}"),
    ("keys roster add", "--fingerprint", "--expect", "SHA256:x"),
    ("keys roster verify", "--fingerprint", "--expect", "SHA256:x"),
    ("keys roster verify", "--id", "--expect", "hospital-a"),
    ("keys roster rotate", "--fingerprint", "--expect", "SHA256:x"),
    ("deploy run", "--identity-key", "--key-dir", "{key}"),
    ("features extract", "--classes-labelled", "--active", "Effusion"),
    *((f"keys {c}", "--dir", "--key-dir", "{dir}") for c in
      ("init", "show", "rotate", "roster show", "roster sign", "roster update", "roster verify")),
]  # fmt: skip


def test_the_alias_table_holds_every_old_name() -> None:
    from secure_afl.cli_options import DeprecatedOption, RenamedOption

    found = set()
    for path, command in _commands().items():
        for param in command.params:
            if isinstance(param, RenamedOption):
                found |= {(path, old, param.opts[0]) for old in param.old_names}
            elif isinstance(param, DeprecatedOption):
                found.add((path, param.opts[0], param.replacement))
            else:
                assert not getattr(param, "hidden", False), (path, param.name)  # hidden: an old name only
    assert found == {(path, old, new) for path, old, new, _ in ALIASES}


@pytest.mark.parametrize(("path", "old", "new", "value"), ALIASES, ids=lambda v: str(v))
def test_each_old_name_prints_what_to_use_instead(
    path: str, old: str, new: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = tmp_path / "keys" / "identity.key"
    key.parent.mkdir()
    key.write_text("{}")
    command = _commands()[path]
    given = value.format(dir=tmp_path, key=key)
    # Parse and convert only (nothing runs); a required option left out may stop it after the note.
    with contextlib.suppress(click.UsageError):
        command.make_context(path, [old, given])
    note = capsys.readouterr().err
    assert _note(old, new) in note, note
    if old == "--identity-key":
        assert f"--key-dir {key.parent}" in note  # the directory to give instead
    help_text = _invoke(*path.split(), "--help").stdout
    assert f"  {old} " not in help_text and f"{old}," not in help_text and f"{new.split()[0]} " in help_text


def test_deploy_run_takes_the_app_dir_and_federation_as_options_and_their_old_positionals_with_a_note(
    tmp_path: Path,
) -> None:
    app = tmp_path / "app"
    app.mkdir()
    nokey = tmp_path / "empty"
    nokey.mkdir()
    env = {"SECURE_AFL_HOME": str(nokey)}
    old = CliRunner().invoke(main, ["deploy", "run", str(app), "fed"], env=env)
    assert _note("the positional FEDERATION", "--federation") in old.stderr
    assert "--federation fed" in old.stderr
    # The key is looked for next, in --key-dir's default: its absence is the error, naming --key-dir.
    assert old.exit_code == 2 and f"--key-dir: {nokey}: no identity.key here" in old.output
    assert _note("the positional APP_DIR", "--app-dir") in old.stderr and f"--app-dir {app}" in old.stderr
    new = CliRunner().invoke(main, ["deploy", "run", "--app-dir", str(app), "--federation", "fed"], env=env)
    assert new.exit_code == 2 and "deprecated" not in new.stderr
    assert f"--key-dir: {nokey}: no identity.key here" in new.output  # the app directory was taken
    mixed = CliRunner().invoke(main, ["deploy", "run", "--app-dir", str(app), "fed"], env=env)
    assert mixed.exit_code == 2 and "APP_DIR (positional) and --app-dir name one value" in mixed.output
    missing = CliRunner().invoke(main, ["deploy", "run", str(tmp_path / "nosuch")], env=env)
    assert missing.exit_code == 2 and f"--app-dir: {tmp_path / 'nosuch'}: no such directory" in missing.output
    both = CliRunner().invoke(main, ["deploy", "run", str(app), "fed", "--federation", "fed"], env=env)
    assert both.exit_code == 2 and "give --federation only" in both.output
    none = CliRunner().invoke(main, ["deploy", "run", "--federation", "fed"], env=env)
    assert none.exit_code == 2 and "give --app-dir DIR" in none.output
    usage = _invoke("deploy", "run", "--help").stdout
    assert "deploy run [OPTIONS]\n" in usage and "APP_DIR" not in usage and "FEDERATION" not in usage


def test_deploy_run_key_dir_and_identity_key_name_one_key(tmp_path: Path) -> None:
    keys = _key_dir(tmp_path, "coordinator")
    app = tmp_path / "app"
    app.mkdir()
    args = ["deploy", "run", "--app-dir", app, "--key-dir", keys, "--identity-key", keys / "identity.key"]
    result = _invoke(*args)
    assert result.exit_code == 2 and "--key-dir and --identity-key name one key: give --key-dir only" in (
        result.output
    )


def test_deploy_collect_takes_the_federation_dir_as_an_option_and_its_old_positional_with_a_note(
    tmp_path: Path,
) -> None:
    federation = tmp_path / "fed"
    federation.mkdir()  # no roster: collect says which directory it wants, after the note
    old = _invoke("deploy", "collect", federation, "--no-register")
    assert _note("the positional OUT_DIR", "--federation-dir") in old.stderr
    assert old.exit_code == 1 and "give the directory `deploy provision --federation-dir` wrote" in old.output
    new = _invoke("deploy", "collect", "--federation-dir", federation, "--no-register")
    assert new.exit_code == 1 and "deprecated" not in new.stderr
    none = _invoke("deploy", "collect", "--no-register")
    assert none.exit_code == 2 and "give --federation-dir DIR" in none.output
    reply_dir = _invoke("deploy", "collect", "--federation-dir", federation, tmp_path, "--no-register")
    assert reply_dir.exit_code == 2 and "is a directory, not an ID.reply.json" in reply_dir.output


# --- a fingerprint heard out of band is --expect ID=FINGERPRINT everywhere ---------------------------


def _public_key() -> tuple[str, str]:
    """A fresh key's base64 public key (``keys roster add --public-key``) and its fingerprint."""
    import base64

    from secure_afl.keys.identity import IdentityKey

    key = IdentityKey.generate()
    return base64.b64encode(key.public_key).decode("ascii"), key.fingerprint


def test_roster_add_checks_the_id_and_fingerprint_heard_and_its_old_fingerprint_option(
    tmp_path: Path,
) -> None:
    roster = tmp_path / "roster.json"
    public, fp = _public_key()
    add = ["keys", "roster", "add", "--roster", roster, "--id", "hospital-a", "--public-key", public]
    other = _invoke(*add, "--expect", f"hospital-b={fp}")  # the right key, heard for another institution
    assert (
        other.exit_code == 1
        and "--expect names 'hospital-b', but this key belongs to 'hospital-a'" in other.output
    )
    wrong = _invoke(*add, "--expect", f"hospital-a={_public_key()[1]}")
    assert wrong.exit_code == 1 and "fingerprint mismatch for 'hospital-a'" in wrong.output
    malformed = _invoke(*add, "--expect", fp)
    assert malformed.exit_code == 2 and "expected ID=FINGERPRINT" in malformed.output
    assert not roster.exists()
    old = _invoke(*add, "--fingerprint", fp.lower())
    assert old.exit_code == 0, old.output
    assert _note("--fingerprint", "--expect") in old.stderr and f"--expect ID='{fp.lower()}'" in old.stderr
    both = _invoke(*add, "--fingerprint", fp, "--expect", f"hospital-a={fp}")
    assert both.exit_code == 2 and "give --expect only" in both.output
    public_b, fp_b = _public_key()
    new = _invoke("keys", "roster", "add", "--roster", roster, "--id", "hospital-b", "--public-key", public_b,
                  "--expect", f"hospital-b={fp_b}")  # fmt: skip
    assert new.exit_code == 0 and new.stderr == "" and "added hospital-b" in new.stdout


def test_roster_verify_takes_expect_items_and_its_old_id_and_fingerprint(tmp_path: Path) -> None:
    roster = tmp_path / "roster.json"
    prints = {}
    for cid in ("hospital-a", "hospital-b"):
        public, prints[cid] = _public_key()
        added = _invoke("keys", "roster", "add", "--roster", roster, "--id", cid, "--public-key", public)
        assert added.exit_code == 0, added.output
    verify = ["keys", "roster", "verify", "--roster", roster, "--key-dir", tmp_path / "none"]
    both = _invoke(*verify, "--expect", f"hospital-a={prints['hospital-a']}", "--expect",
                   f"hospital-b={prints['hospital-b']}")  # fmt: skip
    assert both.exit_code == 0 and both.stderr == "", both.output
    assert (
        "hospital-a: fingerprint matches" in both.stdout and "hospital-b: fingerprint matches" in both.stdout
    )
    swapped = _invoke(*verify, "--expect", f"hospital-a={prints['hospital-a']}", "--expect",
                      f"hospital-b={prints['hospital-a']}")  # fmt: skip
    assert swapped.exit_code == 1 and "FINGERPRINT MISMATCH for 'hospital-b'" in swapped.output
    old = _invoke(*verify, "--id", "hospital-b", "--fingerprint", prints["hospital-b"])
    assert old.exit_code == 0 and "hospital-b: fingerprint matches" in old.stdout, old.output
    assert _note("--id", "--expect") in old.stderr and "--expect hospital-b=FINGERPRINT" in old.stderr
    assert _note("--fingerprint", "--expect") in old.stderr
    half = _invoke(*verify, "--id", "hospital-b")
    assert half.exit_code == 2 and "give --expect ID=FINGERPRINT" in half.output
    nothing = _invoke(*verify)
    assert nothing.exit_code == 2 and "give --expect ID=FINGERPRINT" in nothing.output


# --- the node config's key: identity-key (a file), the CLI's: --key-dir (its directory) --------------


def test_the_node_config_names_the_key_file_and_its_dir_keys_are_directories_the_node_writes() -> None:
    # Decided (issue 57): the node config names each file the node reads by the file (identity-key,
    # passphrase-file, roster, features) and a -dir only for the directories it writes (as the ServerApp's
    # run config names the coordinator's identity-key); --key-dir DIR is the CLI's, whose DIR/identity.key
    # is the node config's identity-key.  A key-dir key here would be a second name for the key.
    from secure_afl.deploy.check import NODE_CONFIG_KEYS
    from secure_afl.deploy.client import NodeSettings

    assert "identity-key" in NodeSettings.KEYS and "key-dir" not in NODE_CONFIG_KEYS
    assert {key for key in NODE_CONFIG_KEYS if key.endswith("-dir")} == {"ledger-dir", "out-dir"}
    text = _invoke("deploy", "check", "--help").stdout
    assert "identity-key" in text and "key-dir" not in text
