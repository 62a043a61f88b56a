"""The ``secure-afl`` console script: its process settings, exit status and output, and a prompt exit
that still does what a normal exit must (threads finished, exit handlers run, output flushed)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from click.testing import CliRunner

from secure_afl.cli import main


def _python(code: str, **env: str | None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k not in env}
    environment.update({k: v for k, v in env.items() if v is not None})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
        check=False,
    )


def _console(*args: str) -> subprocess.CompletedProcess[str]:
    return _python(
        f"import sys; sys.argv = ['secure-afl', *{list(args)!r}]; from secure_afl.console import run; run()"
    )


def test_the_console_script_keeps_click_exit_status_and_messages() -> None:
    version = _console("--version")
    assert version.returncode == 0 and "secure-afl, version" in version.stdout
    bad = _console("sim", "--missing", "99")
    assert bad.returncode == 2 and "unknown missing level 99" in bad.stderr
    no_key = _console("keys", "show", "--key-dir", "/nonexistent/secure-afl-keys")  # a ClickException
    assert no_key.returncode == 1 and "Error:" in no_key.stderr


def test_a_prompt_exit_waits_for_threads_runs_exit_handlers_and_flushes(tmp_path: Path) -> None:
    done = _python(
        f"""
        import atexit, threading, time
        from pathlib import Path
        from secure_afl.console import exit_now
        out = Path({str(tmp_path)!r})
        atexit.register(lambda: (out / "atexit").write_text("ran"))
        def late():
            time.sleep(0.3)  # still running when exit_now is called
            (out / "thread").write_text("done")
        threading.Thread(target=late).start()
        print("buffered", end="")
        exit_now(3)
        """
    )
    assert done.returncode == 3 and done.stdout == "buffered"
    assert (tmp_path / "thread").read_text() == "done" and (tmp_path / "atexit").read_text() == "ran"


def test_openblas_idle_threads_sleep_unless_the_user_chose_otherwise() -> None:
    code = "import os, secure_afl.console; print(os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    assert _python(code, OPENBLAS_THREAD_TIMEOUT=None).stdout.strip() == "4"
    assert _python(code, OPENBLAS_THREAD_TIMEOUT="9").stdout.strip() == "9"


def test_the_deployment_and_key_commands_load_only_when_used() -> None:
    loaded = _python(
        """
        import sys, secure_afl.cli
        print('secure_afl.cli_deploy' in sys.modules, 'secure_afl.cli_keys' in sys.modules)
        """
    )
    assert loaded.stdout.split() == ["False", "False"]
    listing = CliRunner().invoke(main, ["--help"])
    assert listing.exit_code == 0
    for command in ("deploy", "keys", "predict", "sim"):
        assert f"  {command} " in listing.output
    keys = CliRunner().invoke(main, ["keys", "--help"])
    assert keys.exit_code == 0 and "Identity keys" in keys.output
    unknown = CliRunner().invoke(main, ["deplyo"])
    assert unknown.exit_code == 2 and "No such command 'deplyo'" in unknown.output
