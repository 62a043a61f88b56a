"""Fixtures shared by the test suite."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest


@pytest.fixture
def fresh_python() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run Python code in a new interpreter, where nothing this test process imported or ran is
    present (torch's MKL state, environment marks, loaded modules); fails with its stderr."""

    def run(code: str, *, timeout: float = 300, **kwargs: object) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, **kwargs
        )
        assert done.returncode == 0, done.stderr
        return done

    return run
