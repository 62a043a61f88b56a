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


def _deploy_local_module(session: pytest.Session) -> object | None:
    for item in session.items:
        if item.path.name == "test_deploy_local.py" and item.path.parent.name == "deploy":
            return getattr(item, "module", None)
    return None


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """deploy local's tests go last: their federations run from the suite's start (below), mostly waiting on
    Flower, so the other tests fill those waits instead of the suite waiting for them midway."""
    late = [
        item
        for item in items
        if item.path.name == "test_deploy_local.py" and item.path.parent.name == "deploy"
    ]
    if late:
        items[:] = [item for item in items if item not in late] + late


def pytest_collection_finish(session: pytest.Session) -> None:
    """deploy local's federations (tests/deploy/test_deploy_local.py) start as the suite starts: they
    take minutes, mostly waiting on Flower, and run beside the other tests instead of after them."""
    module = _deploy_local_module(session)
    if module is not None and not session.config.option.collectonly:
        _EARLY[:] = [(session, module)]
        module.start_early(session)  # type: ignore[attr-defined]


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    """After each test, deploy local's next federations start as earlier ones finish (two at a time)."""
    for session, module in _EARLY:
        module.advance_early(session)  # type: ignore[attr-defined]


_EARLY: list[tuple[pytest.Session, object]] = []  # the session and deploy local's module, once started


def pytest_sessionfinish(session: pytest.Session) -> None:
    module = _deploy_local_module(session)
    if module is not None:
        module.stop_early(session)  # type: ignore[attr-defined]
