"""FedAvg and the ``--baselines``: trained in the main process, or (opt-in) in forked workers.

The gradient methods need only the clients' features, labels and each level's label assignment,
all known once the data are prepared; AFL's statistics, aggregation and solve need the main
process.  So the training jobs (FedAvg, then each baseline, per missing level, in that order) are
handed to forked workers at the start and collected level by level: on a 2-core machine FedAvg
trains on one core while AFL uses the other.  Every job runs on one torch thread with its own seeded
generator, so its head is the one a run in the main process would give (a test checks it).

Forked workers read the data from memory inherited from the parent (``_STATE``, set just before the
pool forks), never through a pipe.

**Opt-in** (``SECURE_AFL_GRADIENT_WORKERS=N``, N ≥ 1): a fork is only safe before the process has
run OpenMP-parallel code or started other threads (libgomp's thread team does not survive a fork;
a child then waits forever).  A fresh ``secure-afl sim`` forks before its first parallel product and
works; a long-lived process such as a test session that already ran torch on two threads does not.
By default (and without ``fork``) the jobs run in the main process when their level is collected.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.pool import AsyncResult, Pool

import numpy as np

from secure_afl.sim.baselines import BASELINES, BaselineConfig
from secure_afl.sim.baselines.common import Federation, train
from secure_afl.sim.baselines.engine import LinearHead
from secure_afl.sim.fedavg import FedAvgConfig, missing_as_negative, train_fedavg

FEDAVG = "FedAvg"

_STATE: dict[str, object] = {}


@dataclass(frozen=True)
class _Inputs:
    features: Sequence[np.ndarray]  # per client, rows × d
    labels: Sequence[np.ndarray]  # per client, rows × C (true 0/1)
    active: Mapping[int, Sequence[Sequence[int]]]  # missing level → per-client active classes
    fedavg: FedAvgConfig
    baseline: BaselineConfig


WORKERS_ENV = "SECURE_AFL_GRADIENT_WORKERS"


def _child_start() -> None:
    import torch

    torch.set_num_threads(1)  # before any parallel region in the child


def _train_job(missing: int, name: str) -> tuple[LinearHead, float]:
    inputs: _Inputs = _STATE["inputs"]  # type: ignore[assignment]
    start = time.perf_counter()
    active = inputs.active[missing]
    if name == FEDAVG:
        targets = [missing_as_negative(y, a) for y, a in zip(inputs.labels, active, strict=True)]
        head = train_fedavg(inputs.features, targets, inputs.fedavg)
    else:
        federation = Federation.build(inputs.features, inputs.labels, active)
        head = train(BASELINES[name](), federation, inputs.baseline)
    return head, time.perf_counter() - start


class GradientMethods:
    """Training jobs of every gradient method at every missing level; :meth:`collect` per level."""

    def __init__(
        self,
        features: Sequence[np.ndarray],
        labels: Sequence[np.ndarray],
        active: Mapping[int, Sequence[Sequence[int]]],
        *,
        fedavg: FedAvgConfig,
        baselines: Sequence[str] = (),
        baseline: BaselineConfig | None = None,
        workers: int | None = None,
    ) -> None:
        self.inputs = _Inputs(features, labels, active, fedavg, baseline or BaselineConfig())
        self.names = (FEDAVG, *baselines)
        jobs = [(m, name) for m in active for name in self.names]
        if workers is None:
            workers = _workers_from_environment(len(baselines))
        self.workers = min(workers, len(jobs))
        self.futures: dict[tuple[int, str], AsyncResult[tuple[LinearHead, float]]] = {}
        self.pool: Pool | None = None
        forkable = "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1
        if self.workers >= 1 and forkable:
            _STATE["inputs"] = self.inputs
            # multiprocessing.Pool forks every worker in its constructor, before it starts its own
            # threads (a fork while another thread holds a lock can leave the child waiting forever;
            # ProcessPoolExecutor forks lazily, after its manager thread is up)
            self.pool = multiprocessing.get_context("fork").Pool(self.workers, initializer=_child_start)
            self.futures = {job: self.pool.apply_async(_train_job, job) for job in jobs}

    def collect(
        self, missing: int, progress: Callable[[int, int], None] | None = None
    ) -> tuple[dict[str, LinearHead], dict[str, float]]:
        """Heads and wall seconds of every gradient method at one level (waits for its jobs)."""
        heads, seconds = {}, {}
        for done, name in enumerate(self.names, 1):
            future = self.futures.get((missing, name))
            if future is not None:
                heads[name], seconds[name] = future.get()
            else:
                _STATE["inputs"] = self.inputs
                heads[name], seconds[name] = _train_job(missing, name)
            if progress is not None:
                progress(done, len(self.names))
        return heads, seconds

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()  # unfinished jobs (an error elsewhere) are not waited for
            self.pool.join()
            self.pool = None
        _STATE.clear()

    def __enter__(self) -> GradientMethods:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _workers_from_environment(n_baselines: int) -> int:
    """``SECURE_AFL_GRADIENT_WORKERS``: unset or 0 trains in the main process (the default)."""
    value = os.environ.get(WORKERS_ENV, "0").strip()
    try:
        workers = int(value)
    except ValueError:
        raise ValueError(f"{WORKERS_ENV} must be a whole number of worker processes, got {value!r}") from None
    if workers < 0:
        raise ValueError(f"{WORKERS_ENV} must be 0 (main process) or more, got {workers}")
    return workers
