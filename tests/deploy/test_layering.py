"""deploy never imports sim (nor sim deploy); the Flower apps' import path stays free of torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "secure_afl"


def _imports(directory: Path) -> set[str]:
    names = set()
    for path in directory.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
    return names


def test_deploy_and_sim_do_not_import_each_other() -> None:
    assert not {m for m in _imports(PACKAGE / "deploy") if m.startswith("secure_afl.sim")}
    assert not {m for m in _imports(PACKAGE / "sim") if m.startswith("secure_afl.deploy")}
    assert not {
        m for m in _imports(PACKAGE / "features") if m.startswith(("secure_afl.sim", "secure_afl.deploy"))
    }


def test_the_flower_apps_import_neither_torch_nor_the_simulator() -> None:
    code = (
        "import sys, secure_afl.deploy.apps, secure_afl.deploy.local; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('secure_afl.sim')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_core_is_the_floor_below_protocol_and_privacy() -> None:
    # core/ (errors, fixed-point encoding, randomness) imports nothing else of secure_afl; privacy/
    # builds on core/ and never on protocol/, which builds on both.
    assert not {
        m
        for m in _imports(PACKAGE / "core")
        if m.startswith("secure_afl.") and not m.startswith("secure_afl.core")
    }
    assert not {m for m in _imports(PACKAGE / "privacy") if m.startswith("secure_afl.protocol")}
