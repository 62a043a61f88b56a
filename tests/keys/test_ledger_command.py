"""``secure-afl keys ledger show/reset``: an operator's view of the ledger and its explicit reset."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from secure_afl.cli import main
from secure_afl.core.errors import LedgerMissingError
from secure_afl.keys.identity import IdentityKey
from secure_afl.privacy.ledger import FileLedger, LedgerOwner


def _used_ledger(directory: Path) -> tuple[FileLedger, LedgerOwner]:
    owner = LedgerOwner("hospital-a", IdentityKey.generate())
    ledger = FileLedger(directory)

    def release(state) -> None:
        entry = state.entry(b"1" * 32)
        entry.survivors, entry.released, entry.answers["R3"] = ("hospital-a", "hospital-b"), ("v",), "d"

    ledger.update(owner, release)
    return ledger, owner


def test_a_missing_ledger_is_refused_until_reset_by_the_command(tmp_path: Path) -> None:
    ledger, owner = _used_ledger(tmp_path)
    runner = CliRunner()
    shown = runner.invoke(
        main, ["keys", "ledger", "show", "--ledger-dir", str(tmp_path), "--client-id", "hospital-a"]
    )
    assert shown.exit_code == 0, shown.output
    assert "generation 1, 1 session(s)" in shown.output and "released 1" in shown.output
    ledger.path("hospital-a").unlink()
    try:
        ledger.load(owner)
    except LedgerMissingError as exc:
        assert "secure-afl keys ledger reset" in str(exc)
    else:  # pragma: no cover - the assertion below names the failure
        raise AssertionError("a deleted ledger was taken as a first use")
    args = ["keys", "ledger", "reset", "--ledger-dir", str(tmp_path), "--client-id", "hospital-a"]
    refused = runner.invoke(main, args)  # no --reason: click says what is missing
    assert refused.exit_code != 0 and "--reason" in refused.output
    aborted = runner.invoke(main, [*args, "--reason", "disk replaced"], input="n\n")
    assert aborted.exit_code != 0 and "Reset hospital-a's ledger" in aborted.output
    done = runner.invoke(main, [*args, "--reason", "disk replaced", "--yes"])
    assert done.exit_code == 0, done.output
    assert ledger.load(owner).sessions == {}
    (line,) = (tmp_path / "ledger-resets.log").read_text().splitlines()
    assert json.loads(line)["reason"] == "disk replaced"


def test_a_reset_with_nothing_to_reset_is_refused_and_logs_nothing(tmp_path: Path) -> None:
    _used_ledger(tmp_path)  # hospital-a's ledger; the reset names another id (a typo)
    args = ["keys", "ledger", "reset", "--ledger-dir", str(tmp_path), "--client-id", "hospital-x"]
    result = CliRunner().invoke(main, [*args, "--reason", "disk replaced", "--yes"])
    assert result.exit_code == 1, result.output
    assert "nothing to reset" in result.output and "hospital-x.ledger.json" in result.output
    assert "ledgers there: hospital-a.ledger.json" in result.output
    assert not (tmp_path / "ledger-resets.log").exists()
    elsewhere = tmp_path / "no-such-dir"
    typo = CliRunner().invoke(main, ["keys", "ledger", "reset", "--ledger-dir", str(elsewhere), "--client-id",
                                     "hospital-a", "--reason", "r", "--yes"])  # fmt: skip
    assert typo.exit_code == 1 and "nothing to reset" in typo.output and not elsewhere.exists()
