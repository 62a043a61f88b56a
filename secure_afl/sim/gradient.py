"""FedAvg and the ``--baselines``: trained beside the AFL pipeline, on a thread or in spawned workers.

The gradient methods need only the clients' features, labels and each level's label assignment,
all known once the data are prepared; AFL's statistics, aggregation and solve need the main
thread.  So the training jobs (per missing level: FedAvg, then each baseline) start as soon as the
data are ready and are collected level by level while the main thread computes AFL:

- **FedAvg alone** (the default run): one background thread trains each level's FedAvg
  (:func:`secure_afl.sim.fedavg.train_fedavg_stacked`; torch releases the GIL inside its kernels,
  where a FedAvg step spends its time).  It takes the cores the main thread leaves: all but one
  while the AFL pipeline computes, every core (its clients split over threads) while the main
  thread waits in :meth:`GradientMethods.collect`.  More busy threads than cores only take turns
  and evict each other's caches: on 2 cores, FedAvg's two threads beside the pipeline cost the
  default run 3 CPU-seconds more than one.
- **With baselines**: their steps are short autograd graphs, mostly Python under the GIL, so
  threads would take turns; the jobs go to worker processes instead, started with ``spawn`` (a
  fresh interpreter: nothing inherited from a parent that has run OpenMP code or started threads,
  which is what made forked workers hang).  The stacked features go to them through one
  memory-mapped file, not through a pipe.

Every job runs on one torch thread with its own seeded generator, so its head is the one a run in
the main thread gives (tests check each mode against it).  ``SECURE_AFL_GRADIENT_WORKERS``: unset
or ``auto`` chooses as above; ``0`` trains everything in the main thread when its level is
collected (no concurrency); ``N`` ≥ 1 uses N spawned worker processes for every job.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.pool import AsyncResult, Pool
from pathlib import Path

import numpy as np
import torch

from secure_afl.sim.baselines import BASELINES, BaselineConfig
from secure_afl.sim.baselines.common import Federation, train
from secure_afl.sim.baselines.engine import LinearHead, stack_clients
from secure_afl.sim.fedavg import FedAvgConfig, missing_as_negative, train_fedavg_stacked
from secure_afl.sim.methods import FEDAVG

WORKERS_ENV = "SECURE_AFL_GRADIENT_WORKERS"
# Rough relative cost per round (CPU seconds measured on the embedded data): the longest jobs of a
# level go to the workers first, so that the last ones to finish are short.
_COST = {
    "FedMLP": 0.84,
    "FedLSR": 0.82,
    "FedFixMatch": 0.74,
    "FedIRM": 0.73,
    "RSCFed": 0.66,
    "FedNoRo": 0.52,
    "CBAFed": 0.46,
    FEDAVG: 0.25,
}


@dataclass(frozen=True)
class _Inputs:
    x: torch.Tensor  # K × N × (d+1), stacked once for every job
    labels: np.ndarray  # K × N × C, true 0/1 labels (each job shows only its level's active classes)
    active: Mapping[int, Sequence[Sequence[int]]]
    fedavg: FedAvgConfig
    baseline: BaselineConfig


def _train_job(
    inputs: _Inputs, missing: int, name: str, fedavg_threads: int | Callable[[], int] = 1
) -> tuple[LinearHead, float]:
    start = time.perf_counter()
    active = inputs.active[missing]
    if name == FEDAVG:
        targets = np.stack([missing_as_negative(y, a) for y, a in zip(inputs.labels, active, strict=True)])
        head = train_fedavg_stacked(
            inputs.x, torch.from_numpy(targets), inputs.fedavg, threads=fedavg_threads
        )
    else:
        federation = Federation.from_stacked(inputs.x, inputs.labels, active)
        head = train(BASELINES[name](), federation, inputs.baseline)
    return head, time.perf_counter() - start


# A spawned worker's inputs, set once by its initializer.
_WORKER_INPUTS: list[_Inputs] = []


def _worker_start(
    path: str,
    shape: tuple[int, ...],
    labels: np.ndarray,
    active: Mapping[int, Sequence[Sequence[int]]],
    fedavg: FedAvgConfig,
    baseline: BaselineConfig,
) -> None:
    torch.set_num_threads(1)  # the cores are shared with the other worker and the main process
    # copy-on-write mapping: the pages are the parent's file cache, shared by every worker
    x = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="c", shape=shape))
    _WORKER_INPUTS[:] = [_Inputs(x, labels, active, fedavg, baseline)]


def _worker_job(missing: int, name: str) -> tuple[LinearHead, float]:
    return _train_job(_WORKER_INPUTS[0], missing, name)


class GradientMethods:
    """Training jobs of every gradient method at every missing level; :meth:`collect` per level."""

    def __init__(
        self,
        features: Sequence[np.ndarray] | np.ndarray,
        labels: Sequence[np.ndarray],
        active: Mapping[int, Sequence[Sequence[int]]],
        *,
        fedavg: FedAvgConfig,
        baselines: Sequence[str] = (),
        baseline: BaselineConfig | None = None,
        workers: int | str | None = None,
        client_rows: Sequence[np.ndarray] | None = None,
    ) -> None:
        """``workers``: ``"auto"`` (None: from ``SECURE_AFL_GRADIENT_WORKERS``, default auto), ``0``
        (main thread, at :meth:`collect`) or the number of spawned worker processes.

        ``features``: one array per client; or, with ``client_rows``, the whole feature matrix
        (client k's rows are ``features[client_rows[k]]``).
        """
        self.names = (FEDAVG, *baselines)
        jobs = [(m, name) for m in active for name in self.names]
        self.inputs = _Inputs(
            stack_clients(features, client_rows) if jobs else torch.empty(0),
            np.stack([np.asarray(y) for y in labels]) if jobs else np.empty(0),
            active,
            fedavg,
            baseline or BaselineConfig(),
        )
        self.cores = available_cores()
        self._main_waits = threading.Event()  # set while the main thread waits in collect()
        chosen = _workers_from_environment() if workers is None else workers
        if not jobs or chosen == 0:
            self.mode, self.workers = "inline", 0
        elif chosen == "auto" and not baselines:
            self.mode, self.workers = "thread", 1
        else:
            count = min(self.cores, len(jobs)) if chosen == "auto" else int(chosen)
            self.mode, self.workers = "processes", min(count, len(jobs))
        self.futures: dict[tuple[int, str], Future[tuple[LinearHead, float]] | AsyncResult] = {}
        self.pool: Pool | None = None
        self.thread: ThreadPoolExecutor | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if self.mode == "thread":
            self.thread = ThreadPoolExecutor(1, thread_name_prefix="fedavg")  # each level in turn
            self.futures = {
                job: self.thread.submit(_train_job, self.inputs, *job, self.fedavg_threads) for job in jobs
            }
        elif self.mode == "processes":
            self._start_processes(jobs)

    def _start_processes(self, jobs: list[tuple[int, str]]) -> None:
        # the jobs keep their level order; within a level, the costliest first
        order = {m: i for i, m in enumerate(self.inputs.active)}
        jobs = sorted(jobs, key=lambda job: (order[job[0]], -_COST.get(job[1], 1.0)))
        self._tmp = tempfile.TemporaryDirectory(prefix="secure-afl-features-")
        path = Path(self._tmp.name) / "features.f32"
        x = self.inputs.x.numpy()
        mapped = np.memmap(path, dtype=np.float32, mode="w+", shape=x.shape)
        mapped[:] = x
        mapped.flush()
        del mapped
        context = multiprocessing.get_context("spawn")
        self.pool = context.Pool(
            self.workers,
            initializer=_worker_start,
            initargs=(
                str(path),
                tuple(x.shape),
                self.inputs.labels,
                dict(self.inputs.active),
                self.inputs.fedavg,
                self.inputs.baseline,
            ),
        )
        self.futures = {job: self.pool.apply_async(_worker_job, job) for job in jobs}

    @property
    def statistics_threads(self) -> int:
        """Threads for the clients' statistics beside the training jobs.

        FedAvg on its thread: the cores it leaves.  Worker processes: every core (the statistics are
        seconds beside minutes of training; the OS shares the cores).  Inline: one (numpy's BLAS
        then uses every core itself).
        """
        if self.mode == "thread":
            return max(self.cores - 1, 1)
        return self.cores if self.mode == "processes" else 1

    def fedavg_threads(self) -> int:
        """Threads for FedAvg's next round on the background thread (see the module's docstring)."""
        return self.cores if self._main_waits.is_set() else max(self.cores - 1, 1)

    def collect(
        self, missing: int, progress: Callable[[int, int], None] | None = None
    ) -> tuple[dict[str, LinearHead], dict[str, float]]:
        """Heads and wall seconds of every gradient method at one level (waits for its jobs)."""
        heads, seconds = {}, {}
        self._main_waits.set()
        try:
            for done, name in enumerate(self.names, 1):
                future = self.futures.get((missing, name))
                if future is None:
                    heads[name], seconds[name] = _train_job(self.inputs, missing, name)
                elif isinstance(future, Future):
                    heads[name], seconds[name] = future.result()
                else:
                    heads[name], seconds[name] = future.get()
                if progress is not None:
                    progress(done, len(self.names))
        finally:
            self._main_waits.clear()
        return heads, seconds

    def close(self) -> None:
        if self.thread is not None:
            for future in self.futures.values():
                if isinstance(future, Future):
                    future.cancel()  # an error elsewhere: jobs not started are dropped
            self.thread.shutdown(wait=True)
            self.thread = None
        if self.pool is not None:
            self.pool.terminate()  # unfinished jobs (an error elsewhere) are not waited for
            self.pool.join()
            self.pool = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> GradientMethods:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return max(len(os.sched_getaffinity(0)), 1)
    return os.cpu_count() or 1


def _workers_from_environment() -> int | str:
    """``SECURE_AFL_GRADIENT_WORKERS``: unset or ``auto``, ``0`` (main thread) or N worker processes."""
    value = os.environ.get(WORKERS_ENV, "auto").strip().lower()
    if value in ("", "auto"):
        return "auto"
    try:
        workers = int(value)
    except ValueError:
        raise ValueError(
            f"{WORKERS_ENV} must be 'auto', 0 (main thread) or a number of worker processes, got {value!r}"
        ) from None
    if workers < 0:
        raise ValueError(f"{WORKERS_ENV} must be 'auto', 0 (main thread) or more, got {workers}")
    return workers
