"""FedAvg and the ``--baselines``: trained beside the AFL pipeline, in a forked process, on a thread or
in spawned workers.

The gradient methods need only the clients' features, labels and each level's label assignment,
all known once the data are prepared; AFL's statistics, aggregation and solve need the main
thread.  So the training jobs (per missing level: FedAvg, then each baseline) start as soon as the
data are ready and are collected level by level while the main thread computes AFL:

- **FedAvg alone** (the default run) in the ``secure-afl`` command on Linux, on the embedded data:
  one forked child process trains each level's FedAvg in turn
  (:func:`secure_afl.sim.fedavg.train_fedavg_stacked`) and sends each head back through a pipe.
  A step is about twenty small torch calls, each giving up and taking back the GIL; on a thread of
  the main process they waited for the masking protocol's Python, and rounds took twice as long
  while it ran (measured: 0.4–0.5 s instead of 0.22–0.25).  A forked child shares the features
  with the parent page by page, without a copy, and has a GIL of its own.  It takes the cores the
  main thread leaves: all but one while the AFL pipeline computes, every core (its clients split
  over threads) while the main thread waits in :meth:`GradientMethods.collect`.  More busy threads
  than cores only take turns and evict each other's caches.
- **Everywhere else** (a library call, a test, a notebook, real images, a second run in one
  process, macOS, Windows): the same on a background thread of the main process (torch releases
  the GIL inside its kernels).  A fork is only safe before the process has run any MKL or OpenMP
  work: MKL's buffer allocator does not survive a fork made after it was used (seen in CI: both
  threads of a child spinning in ``mkl_serv_allocate`` for minutes).  The console script marks its
  process as fresh (:data:`FRESH_PROCESS_ENV`, its pid); the first :class:`GradientMethods` of that
  process takes the mark, and forks only if its caller says no torch work ran before
  (``fork_ok``: the embedded data are numpy only; real images ran a backbone).  Verified with
  ``MKL_VERBOSE=1``: in ``secure-afl sim --missing 7`` the first MKL call comes from the child.
- **With baselines**: their steps are short autograd graphs, mostly Python under the GIL, so
  threads would take turns; the jobs go to worker processes instead, started with ``spawn`` (a
  fresh interpreter for a pool of long-lived workers that take jobs one after another).  The
  stacked features go to them through one memory-mapped file, not through a pipe.  A baseline's
  missing levels are one job there, trained in lockstep (``train_levels``: the same heads; each
  batch and its views are made once for every level), and each level is credited an equal share of
  its seconds; FedAvg's levels stay jobs of their own.

Every job runs on one torch thread with its own seeded generator, so its head is the one a run in
the main thread gives (tests check each mode against it).  ``SECURE_AFL_GRADIENT_WORKERS``: unset
or ``auto`` chooses as above; ``fork`` or ``thread`` train every job, one after another, in one
background worker of that kind (``fork`` whatever the process has run: see above); ``0`` trains
everything in the main thread when its level is collected (no concurrency); ``N`` ≥ 1 uses N
spawned worker processes for every job.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.synchronize
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.pool import AsyncResult, Pool
from pathlib import Path

import numpy as np
import torch

from secure_afl.sim.baselines import BASELINES, BaselineConfig
from secure_afl.sim.baselines.common import Federation, train, train_levels
from secure_afl.sim.baselines.engine import LinearHead, padded_rows, stack_clients
from secure_afl.sim.fedavg import (
    FedAvgConfig,
    missing_as_negative,
    train_fedavg_stacked,
    true_count_pos_weight,
)
from secure_afl.sim.methods import FEDAVG

WORKERS_ENV = "SECURE_AFL_GRADIENT_WORKERS"
# Set by the console script to its own pid: a process that has run no torch work yet (see above).
FRESH_PROCESS_ENV = "_SECURE_AFL_FRESH_PROCESS"
# The forked trainer reports every round; this long without one, it is taken for hung (a round of
# the embedded run takes a quarter of a second).
STALL_SECONDS = 600.0
# Rough relative cost per round and level (CPU seconds measured on the embedded data): the longest
# jobs go to the workers first, so that the last ones to finish are short.
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
    inputs: _Inputs,
    missing: int,
    name: str,
    fedavg_threads: int | Callable[[], int] = 1,
    progress: Callable[[int], None] | None = None,
) -> tuple[LinearHead, float]:
    start = time.perf_counter()
    active = inputs.active[missing]
    if name == FEDAVG:
        targets = np.stack([missing_as_negative(y, a) for y, a in zip(inputs.labels, active, strict=True)])
        # FedMLP's train(): pos_weight N/N_c from the true counts
        pos_weight = torch.as_tensor(true_count_pos_weight(inputs.labels), dtype=torch.float32)
        head = train_fedavg_stacked(
            inputs.x,
            torch.from_numpy(targets),
            inputs.fedavg,
            threads=fedavg_threads,
            progress=progress,
            pos_weight=pos_weight,
        )
    else:
        federation = Federation.from_stacked(inputs.x, inputs.labels, active)
        head = train(BASELINES[name](), federation, inputs.baseline, progress=progress)
    return head, time.perf_counter() - start


def _train_levels_job(
    inputs: _Inputs, levels: Sequence[int], name: str
) -> dict[int, tuple[LinearHead, float]]:
    """Head and seconds of ``name`` at every level of ``levels``: a baseline's levels in lockstep
    (:func:`~secure_afl.sim.baselines.common.train_levels`: the same heads, the batches and their
    views made once for every level), each level credited an equal share of the seconds; FedAvg's
    one level after another."""
    if name == FEDAVG or len(levels) == 1:
        return {m: _train_job(inputs, m, name) for m in levels}
    start = time.perf_counter()
    federations = [Federation.from_stacked(inputs.x, inputs.labels, inputs.active[m]) for m in levels]
    heads = train_levels([BASELINES[name]() for _ in levels], federations, inputs.baseline)
    share = (time.perf_counter() - start) / len(levels)
    return {m: (head, share) for m, head in zip(levels, heads, strict=True)}


class TrainingProcessError(RuntimeError):
    """The forked process training the gradient methods failed, died or stalled."""


_PROCESS = "the process training the gradient methods"


class _ForkedJobs:
    """Jobs trained one after another in a forked child process; each head comes back through a pipe.

    The child reports every round, so a parent waiting for a head can tell a stalled child from a
    slow one (:data:`STALL_SECONDS`), and it stops by itself once its parent has gone.
    """

    def __init__(self, inputs: _Inputs, jobs: Sequence[tuple[int, str]], threads: Callable[[], int]) -> None:
        context = multiprocessing.get_context("fork")
        receiver, sender = context.Pipe(duplex=False)
        self.jobs = tuple(jobs)
        self.process = context.Process(
            target=_forked_main,
            args=(inputs, self.jobs, threads, sender, os.getpid()),
            name="secure-afl-fedavg",
            daemon=True,
        )
        with warnings.catch_warnings():
            # Python >= 3.12 warns on any fork of a process that has threads.  Here the others are
            # OpenBLAS's pool (which handles fork) and idle executor threads holding no lock the
            # child takes; torch_threads makes its lock anew in the child.
            warnings.filterwarnings("ignore", r".*fork\(\) may lead to deadlocks", DeprecationWarning)
            self.process.start()
        sender.close()  # the child holds the only writing end: its exit is an EOF here
        self._receiver = receiver
        self._done: dict[tuple[int, str], tuple[LinearHead, float]] = {}

    def result(self, job: tuple[int, str], stall_seconds: float = STALL_SECONDS) -> tuple[LinearHead, float]:
        """The head and seconds of ``job``, waiting for the child as long as it reports rounds."""
        while job not in self._done:
            if not self._receiver.poll(stall_seconds):
                self.close()
                raise TrainingProcessError(
                    f"{_PROCESS} reported nothing for {stall_seconds:.0f} s and was stopped; set "
                    f"{WORKERS_ENV}=thread to train on a thread of this process instead"
                )
            try:
                kind, *payload = self._receiver.recv()
            except EOFError:
                self.process.join(10)
                raise TrainingProcessError(
                    f"{_PROCESS} ended (exit code {self.process.exitcode}) before sending the head of "
                    f"{job[1]} at missing {job[0]}"
                ) from None
            if kind == "failed":
                self.process.join(10)  # it exits right after saying so
                raise TrainingProcessError(f"{payload[0]} in {_PROCESS}:\n{payload[1]}")
            if kind == "head":
                done, head, seconds = payload
                self._done[done] = (head, seconds)
        return self._done.pop(job)

    def close(self) -> None:
        """Stop the child if it still runs (an error elsewhere) and wait for it."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(10)
            if self.process.is_alive():
                self.process.kill()
        self.process.join()
        self._receiver.close()


class _Orphaned(Exception):
    pass


def _forked_main(
    inputs: _Inputs,
    jobs: Sequence[tuple[int, str]],
    threads: Callable[[], int],
    sender: Connection,
    parent: int,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops this one
    # One torch thread, so no OpenMP region ever starts here: an OpenMP pool the parent may have
    # started does not survive a fork (what made forked baseline workers hang).
    torch.set_num_threads(1)

    def threads_now() -> int:  # asked at the start of every FedAvg round
        if os.getppid() != parent:
            raise _Orphaned  # nobody is left to collect the heads
        return threads()

    try:
        for job in jobs:
            head, seconds = _train_job(inputs, *job, threads_now, progress=lambda _: sender.send(("round",)))
            sender.send(("head", job, head, seconds))
    except (_Orphaned, BrokenPipeError):
        return
    except Exception as exc:
        with contextlib.suppress(OSError):  # the parent may be gone already
            sender.send(("failed", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        sys.exit(1)


# A spawned worker's inputs, set once by its initializer.
_WORKER_INPUTS: list[_Inputs] = []


def _worker_start(
    path: str,
    shape: tuple[int, ...],
    width: int,
    labels: np.ndarray,
    active: Mapping[int, Sequence[Sequence[int]]],
    fedavg: FedAvgConfig,
    baseline: BaselineConfig,
) -> None:
    torch.set_num_threads(1)  # the cores are shared with the other worker and the main process
    # copy-on-write mapping: the pages are the parent's file cache, shared by every worker
    # (``shape``: the padded rows; the features are their first ``width`` columns)
    x = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="c", shape=shape))[..., :width]
    _WORKER_INPUTS[:] = [_Inputs(x, labels, active, fedavg, baseline)]


def _worker_job(levels: tuple[int, ...], name: str) -> dict[int, tuple[LinearHead, float]]:
    return _train_levels_job(_WORKER_INPUTS[0], levels, name)


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
        fork_ok: bool = False,
    ) -> None:
        """``workers``: ``"auto"`` (None: from ``SECURE_AFL_GRADIENT_WORKERS``, default auto),
        ``"fork"`` or ``"thread"`` (one background worker of that kind trains every job in turn),
        ``0`` (main thread, at :meth:`collect`) or the number of spawned worker processes.
        ``fork_ok``: no torch work has run in this process before (auto forks only then, and only in
        a process the console script marked as fresh).

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
        fresh = _claim_fresh_process()  # the first GradientMethods of a process only
        chosen = _workers_from_environment() if workers is None else workers
        if not jobs or chosen == 0:
            self.mode, self.workers = "inline", 0
        elif chosen in ("fork", "thread"):
            self.mode, self.workers = str(chosen), 1
        elif chosen == "auto" and not baselines:
            self.mode, self.workers = ("fork" if fresh and fork_ok and _can_fork_safely() else "thread"), 1
        else:
            count = min(self.cores, len(jobs)) if chosen == "auto" else int(chosen)
            self.mode, self.workers = "processes", min(count, len(jobs))
        self.futures: dict[tuple[int, str], Future[tuple[LinearHead, float]] | AsyncResult] = {}
        self.pool: Pool | None = None
        self.thread: ThreadPoolExecutor | None = None
        self.forked: _ForkedJobs | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        # set while the main thread waits in collect(); the forked child reads it too
        self._main_waits: threading.Event | multiprocessing.synchronize.Event = (
            multiprocessing.get_context("fork").Event() if self.mode == "fork" else threading.Event()
        )
        if self.mode == "fork":
            self.forked = _ForkedJobs(self.inputs, jobs, self.fedavg_threads)
        elif self.mode == "thread":
            self.thread = ThreadPoolExecutor(1, thread_name_prefix="fedavg")  # each level in turn
            self.futures = {
                job: self.thread.submit(_train_job, self.inputs, *job, self.fedavg_threads) for job in jobs
            }
        elif self.mode == "processes":
            self._start_processes(jobs)

    def _start_processes(self, jobs: list[tuple[int, str]]) -> None:
        # A baseline's levels train in lockstep, one job (a third to a half less work than level by
        # level: each batch and view is made once, the heads' products are one); FedAvg's levels are
        # jobs of their own.  The costliest jobs first, so that the last ones to finish are short.
        levels = tuple(self.inputs.active)
        grouped = [((m,), FEDAVG) for m, name in jobs if name == FEDAVG]
        grouped += list(dict.fromkeys((levels, name) for _, name in jobs if name != FEDAVG))
        grouped.sort(key=lambda job: -_COST.get(job[1], 1.0) * len(job[0]))
        self._tmp = tempfile.TemporaryDirectory(prefix="secure-afl-features-")
        path = Path(self._tmp.name) / "features.f32"
        # the rows with their padding (stack_clients), so that the workers' rows are aligned too
        padded = padded_rows(self.inputs.x)
        x = (self.inputs.x if padded is None else padded).numpy()
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
                self.inputs.x.shape[-1],
                self.inputs.labels,
                dict(self.inputs.active),
                self.inputs.fedavg,
                self.inputs.baseline,
            ),
        )
        started = {job: self.pool.apply_async(_worker_job, job) for job in grouped}
        self.futures = {(m, name): result for (ms, name), result in started.items() for m in ms}

    @property
    def statistics_threads(self) -> int:
        """Threads for the clients' statistics beside the training jobs.

        FedAvg in its forked process or on its thread: the cores it leaves.  Worker processes: every
        core (the statistics are seconds beside minutes of training; the OS shares the cores).
        Inline: one (numpy's BLAS then uses every core itself).
        """
        if self.mode in ("fork", "thread"):
            return max(self.cores - 1, 1)
        return self.cores if self.mode == "processes" else 1

    def fedavg_threads(self) -> int:
        """Threads for FedAvg's next round in the background (see the module's docstring)."""
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
                if self.forked is not None and (missing, name) in self.forked.jobs:
                    heads[name], seconds[name] = self.forked.result((missing, name))
                elif future is None:
                    heads[name], seconds[name] = _train_job(self.inputs, missing, name)
                elif isinstance(future, Future):
                    heads[name], seconds[name] = future.result()
                else:  # a worker process's job: every level it trained
                    heads[name], seconds[name] = future.get()[missing]
                if progress is not None:
                    progress(done, len(self.names))
        finally:
            self._main_waits.clear()
        return heads, seconds

    def close(self) -> None:
        if self.forked is not None:
            self.forked.close()
            self.forked = None
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


def _can_fork_safely() -> bool:
    """Linux: macOS's system libraries are not fork-safe; Windows cannot fork."""
    return sys.platform.startswith("linux")


def _claim_fresh_process() -> bool:
    """Whether the console script marked this very process as fresh; the mark is taken (a second
    run in the same process has run torch work)."""
    return os.environ.pop(FRESH_PROCESS_ENV, None) == str(os.getpid())


def _workers_from_environment() -> int | str:
    """``SECURE_AFL_GRADIENT_WORKERS``: unset or ``auto``, ``fork``, ``thread``, ``0`` (main thread) or N
    worker processes."""
    value = os.environ.get(WORKERS_ENV, "auto").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value == "fork" and "fork" not in multiprocessing.get_all_start_methods():
        raise ValueError(f"{WORKERS_ENV}=fork: this platform cannot fork; use 'thread' or 'auto'")
    if value in ("fork", "thread"):
        return value
    try:
        workers = int(value)
    except ValueError:
        raise ValueError(
            f"{WORKERS_ENV} must be 'auto', 'fork', 'thread', 0 (main thread) or a number of worker "
            f"processes, got {value!r}"
        ) from None
    if workers < 0:
        raise ValueError(
            f"{WORKERS_ENV} must be 'auto', 'fork', 'thread', 0 (main thread) or more, got {workers}"
        )
    return workers
