"""The protocol package does no I/O and keeps no global random state (checked on its source)."""

from __future__ import annotations

import ast
from pathlib import Path

import secure_afl.protocol

PROTOCOL_DIR = Path(secure_afl.protocol.__file__).parent
FORBIDDEN_MODULES = {"socket", "time", "threading", "asyncio", "random", "secrets", "subprocess", "pathlib"}
FORBIDDEN_CALLS = {"open", "print", "input"}


def _sources():
    return sorted(PROTOCOL_DIR.glob("*.py"))


def test_no_io_clock_thread_or_global_random_imports() -> None:
    for path in _sources():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = {node.module.split(".")[0]}
            else:
                names = set()
            assert not names & FORBIDDEN_MODULES, f"{path.name} imports {names & FORBIDDEN_MODULES}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in FORBIDDEN_CALLS, f"{path.name} calls {node.func.id}()"
            if isinstance(node, ast.Attribute) and node.attr in {"random", "default_rng", "seed"}:
                assert not (isinstance(node.value, ast.Name) and node.value.id in {"np", "numpy"}), path.name


def test_only_the_default_random_source_touches_the_os() -> None:
    for path in _sources():
        text = path.read_text()
        if path.name != "randomness.py":
            assert "urandom" not in text and "import os" not in text, path.name
