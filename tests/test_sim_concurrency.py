"""The simulator trains FedAvg beside the AFL pipeline (a background thread here; a forked process in
a fresh console-script process), its clients split over threads: the report is the one of a run
that trains everything in the main thread."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from secure_afl.sim import runner
from secure_afl.sim.fedavg import FedAvgConfig
from secure_afl.sim.gradient import WORKERS_ENV, GradientMethods
from secure_afl.sim.runner import run_experiment
from secure_afl.sim.setting import SimConfig


def test_default_run_with_fedavg_in_the_background_equals_the_main_thread_run(monkeypatch) -> None:
    modes: list[str] = []
    fork_ok: list[bool] = []

    class Recording(GradientMethods):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            modes.append(self.mode)
            fork_ok.append(kwargs["fork_ok"])

    monkeypatch.setattr(runner, "GradientMethods", Recording)
    config = SimConfig(missing=(1, 7), fraction=0.04, dim=48, secure="none", fedavg=FedAvgConfig(rounds=3))
    monkeypatch.delenv(WORKERS_ENV, raising=False)
    threaded = run_experiment(config)
    monkeypatch.setenv(WORKERS_ENV, "0")
    inline = run_experiment(config)
    assert modes == ["thread", "inline"]  # this test process is not a fresh console process
    assert fork_ok == [True, True]  # the embedded data ran no torch work before
    for a, b in zip(threaded.settings, inline.settings, strict=True):
        assert list(a.metrics) == list(b.metrics) and "FedAvg" in a.metrics
        for name in a.metrics:
            for field in ("bacc", "auc", "ap"):
                np.testing.assert_array_equal(
                    getattr(a.metrics[name], field), getattr(b.metrics[name], field)
                )
    fedavg = [s.metrics["FedAvg"].macro["auc"] for s in threaded.settings]
    assert fedavg[0] != fedavg[1]  # two levels, two different FedAvg heads


def test_data_prepared_on_a_thread_are_the_runs_own(monkeypatch) -> None:
    from secure_afl.sim.datasets import DataRequest, PreparingData
    from secure_afl.sim.runner import data_request
    from secure_afl.sim.setting import ExperimentError

    config = SimConfig(missing=(3,), fraction=0.03, dim=32, secure="none", fedavg=FedAvgConfig(rounds=2))
    request = data_request(config)
    assert request == DataRequest(0.03, 32, 0, 8, "image")
    early = run_experiment(config, preparing=PreparingData(request))
    late = run_experiment(config)
    assert early.seconds["data"] > 0
    for name, metrics in late.settings[0].metrics.items():
        np.testing.assert_array_equal(early.settings[0].metrics[name].auc, metrics.auc)
    other = PreparingData(DataRequest(0.03, 32, 1, 8, "image"))  # another seed
    with pytest.raises(ExperimentError, match="not this configuration's"):
        run_experiment(config, preparing=other)


def test_waiting_for_the_cohort_does_not_wait_for_the_features(monkeypatch) -> None:
    import secure_afl.sim.datasets as datasets

    release = threading.Event()
    real = datasets.synthetic_features

    def held_features(*args, **kwargs):
        assert release.wait(30), "the test never released the features"
        return real(*args, **kwargs)

    monkeypatch.setattr(datasets, "synthetic_features", held_features)
    preparing = datasets.PreparingData(datasets.DataRequest(0.03, 32, 0, 8, "image"))
    try:
        waiter = threading.Thread(target=preparing.wait_for_cohort, daemon=True)
        waiter.start()
        waiter.join(timeout=30)
        assert not waiter.is_alive(), "wait_for_cohort waited for the features"
        assert not preparing._future.done()
    finally:
        release.set()
    data, _ = preparing.result()
    assert data.features.shape[1] == 32


def test_a_failure_before_the_cohort_releases_its_waiters(monkeypatch) -> None:
    import secure_afl.sim.datasets as datasets
    from secure_afl.sim.data import CohortError

    def unreadable(*args, **kwargs):
        raise CohortError("label table unreadable")

    monkeypatch.setattr(datasets, "load_cohort", unreadable)
    preparing = datasets.PreparingData(datasets.DataRequest(0.03, 32, 0, 8, "image"))
    waiter = threading.Thread(target=preparing.wait_for_cohort, daemon=True)
    waiter.start()
    waiter.join(timeout=30)
    assert not waiter.is_alive(), "a failed preparation left wait_for_cohort blocked"
    with pytest.raises(CohortError, match="unreadable"):
        preparing.result()


def test_cancelling_stops_the_features_at_their_next_chunk(monkeypatch) -> None:
    import time

    import secure_afl.sim.datasets as datasets

    chunks: list[int] = []

    def endless_features(labels, patient_ids, *, dim, seed, progress):
        for chunk in range(1000):  # bounded: 10 s
            chunks.append(chunk)
            progress(chunk)
            time.sleep(0.01)
        raise AssertionError("the features were never cancelled")

    monkeypatch.setattr(datasets, "synthetic_features", endless_features)
    preparing = datasets.PreparingData(datasets.DataRequest(0.03, 32, 0, 8, "image"))
    preparing.wait_for_cohort()
    deadline = time.monotonic() + 30
    while not chunks and time.monotonic() < deadline:
        time.sleep(0.01)
    preparing.cancel()
    with pytest.raises(datasets.PreparationCancelled, match="cancelled"):
        preparing.result()
    assert len(chunks) < 1000


def test_the_console_script_marks_its_own_process_as_fresh(fresh_python) -> None:
    code = (
        "import os, secure_afl.console\n"
        "from secure_afl.sim.gradient import FRESH_PROCESS_ENV, _claim_fresh_process\n"
        "assert os.environ[FRESH_PROCESS_ENV] == str(os.getpid())\n"
        "assert _claim_fresh_process() and not _claim_fresh_process()  # taken once\n"
    )
    fresh_python(code)
