"""FedAvg's forked training process (sim/gradient.py): it sees the parent wait, and it never outlives
a failure, a stall or its parent.

A child is forked from this test process, so a job replaced here with monkeypatch is the job the child
runs.  Every wait is bounded.
"""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from secure_afl.sim import gradient
from secure_afl.sim.baselines.engine import LinearHead
from secure_afl.sim.fedavg import FedAvgConfig
from secure_afl.sim.gradient import GradientMethods, TrainingProcessError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the forked mode is Linux's")


def _inputs(n_clients: int = 2, rows: int = 16, dim: int = 6):
    rng = np.random.default_rng(0)
    features = [rng.normal(size=(rows, dim)).astype(np.float32) for _ in range(n_clients)]
    labels = [(rng.random((rows, 3)) < 0.4).astype(int) for _ in range(n_clients)]
    active = {7: [[k % 3] for k in range(n_clients)]}
    return features, labels, active


def _head(*values: float) -> LinearHead:
    return LinearHead(coef=np.zeros((6, 3)), bias=np.array(values, dtype=np.float64))


def _gone(pid: int) -> bool:
    """Exited (or a zombie nobody reaped yet: it runs nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_the_child_takes_every_core_while_the_parent_waits(monkeypatch) -> None:
    monkeypatch.setattr(gradient, "available_cores", lambda: 4)

    def waits_for_the_parent(inputs, missing, name, threads, progress=None):
        first = threads()
        deadline = time.monotonic() + 30
        while threads() != 4 and time.monotonic() < deadline:  # bounded: 30 s
            time.sleep(0.01)
        return _head(first, threads()), 0.1

    monkeypatch.setattr(gradient, "_train_job", waits_for_the_parent)
    with GradientMethods(*_inputs(), fedavg=FedAvgConfig(rounds=1), workers="fork") as jobs:
        assert jobs.mode == "fork" and jobs.statistics_threads == 3
        assert jobs.fedavg_threads() == 3
        heads, _ = jobs.collect(7)
        assert jobs.fedavg_threads() == 3  # the wait is over
    first, during_wait = heads["FedAvg"].bias
    assert during_wait == 4, "the child never saw the parent waiting"
    assert first in (3, 4)  # 3 unless the parent was already waiting


def test_a_failure_in_the_child_is_raised_in_the_parent_with_its_traceback(monkeypatch) -> None:
    def fails(inputs, missing, name, threads, progress=None):
        raise ValueError("boom in the child")

    monkeypatch.setattr(gradient, "_train_job", fails)
    with GradientMethods(*_inputs(), fedavg=FedAvgConfig(rounds=1), workers="fork") as jobs:
        process = jobs.forked.process
        with pytest.raises(TrainingProcessError, match="ValueError: boom in the child") as raised:
            jobs.collect(7)
        assert "Traceback" in str(raised.value) and "fails" in str(raised.value)
    assert not process.is_alive() and process.exitcode == 1


def test_a_child_that_dies_is_an_error_not_a_hang(monkeypatch) -> None:
    def dies(inputs, missing, name, threads, progress=None):
        os._exit(3)

    monkeypatch.setattr(gradient, "_train_job", dies)
    expected = r"ended \(exit code 3\) before sending the head of FedAvg"
    with (
        GradientMethods(*_inputs(), fedavg=FedAvgConfig(rounds=1), workers="fork") as jobs,
        pytest.raises(TrainingProcessError, match=expected),
    ):
        jobs.collect(7)


def test_a_stalled_child_is_stopped(monkeypatch) -> None:
    def stalls(inputs, missing, name, threads, progress=None):
        time.sleep(60)  # longer than the test waits; the parent stops it
        return _head(0, 0, 0), 60.0

    monkeypatch.setattr(gradient, "_train_job", stalls)
    with GradientMethods(*_inputs(), fedavg=FedAvgConfig(rounds=1), workers="fork") as jobs:
        forked = jobs.forked
        started = time.monotonic()
        with pytest.raises(TrainingProcessError, match=r"reported nothing for 1 s.*=thread"):
            forked.result((7, "FedAvg"), stall_seconds=1)
        assert not forked.process.is_alive() and time.monotonic() - started < 20


def test_closing_early_stops_a_running_child(monkeypatch) -> None:
    def long_job(inputs, missing, name, threads, progress=None):
        for _ in range(600):  # bounded: 60 s
            progress(1)
            time.sleep(0.1)
        return _head(0, 0, 0), 60.0

    monkeypatch.setattr(gradient, "_train_job", long_job)
    jobs = GradientMethods(*_inputs(), fedavg=FedAvgConfig(rounds=1), workers="fork")
    process = jobs.forked.process
    assert process.is_alive()
    started = time.monotonic()
    jobs.close()  # what an error in the AFL pipeline does
    assert not process.is_alive() and time.monotonic() - started < 15
    assert process.exitcode == -15  # terminated (SIGTERM)


def test_the_child_stops_once_its_parent_is_gone(fresh_python, tmp_path) -> None:
    # The parent is a separate Python that forks the child and exits at once, without closing it.
    script = textwrap.dedent(
        """
        import os, time
        import numpy as np
        from secure_afl.sim import gradient
        from secure_afl.sim.fedavg import FedAvgConfig

        def endless(inputs, missing, name, threads, progress=None):
            for _ in range(600):  # bounded: 60 s; threads() ends it once the parent is gone
                threads()
                time.sleep(0.1)
            os._exit(7)

        gradient._train_job = endless
        features = [np.ones((8, 4), np.float32)] * 2
        labels = [np.zeros((8, 3), int)] * 2
        jobs = gradient.GradientMethods(features, labels, {7: [[0], [1]]}, fedavg=FedAvgConfig(rounds=1),
                                        workers="fork")
        print(jobs.forked.process.pid, flush=True)
        os._exit(0)
        """
    )
    child = int(fresh_python(script, timeout=120, cwd=tmp_path).stdout.strip())
    deadline = time.monotonic() + 30
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert _gone(child), "the orphaned child kept training"
    finally:
        if not _gone(child):
            os.kill(child, 9)
