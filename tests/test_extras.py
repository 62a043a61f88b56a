"""The install's extras: `sim` needs none of the deployment stack, and `deploy` names what is missing."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from secure_afl.cli import main
from secure_afl.deploy import requirements

ROOT = Path(__file__).resolve().parents[1]


def test_sim_runs_without_the_deployment_stack(tmp_path: Path) -> None:
    """`pip install -e .` (no deploy extra) is enough for `sim`: Flower is never imported."""
    script = (
        "import sys; sys.modules['flwr'] = None  # any `import flwr` now raises ImportError\n"
        f"sys.argv = ['secure-afl', 'sim', '--missing', '7', '--fraction', '0.06', '--dim', '48', "
        f"'--fedavg-rounds', '2', '--rounds', '1', '--out', {str(tmp_path)!r}]\n"
        "from secure_afl.console import run; run()\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            cwd=ROOT, stdin=subprocess.DEVNULL)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert json.loads((tmp_path / "results.json").read_text())["config"]["missing"] == [7]
    assert "flwr" not in result.stderr


def test_deploy_names_the_missing_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.metadata.distribution

    def without_flower(name: str) -> importlib.metadata.Distribution:
        if name == "flwr":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", without_flower)
    assert requirements.missing_deployment_packages() == ["flwr"]
    result = CliRunner().invoke(main, ["deploy", "tls", "--ip", "10.0.0.5", "--out", "unused"])
    assert result.exit_code == 1
    assert "the deployment stack is not installed (flwr missing)" in result.output
    assert "pip install -e '.[deploy]'" in result.output


def test_the_deploy_extra_is_installed_with_the_test_extra() -> None:
    assert requirements.missing_deployment_packages() == []
    extras = importlib.metadata.metadata("secure-afl").get_all("Provides-Extra") or []
    assert {"deploy", "test"} <= set(extras)
