"""Threads for one large computation, given to the code that runs it (as randomness is).

The protocol's state machines start no threads and read nothing of the machine they run on; a
driver that wants a large mask computed on several cores hands the session a :class:`Workers`
(:func:`for_this_process`), and :func:`secure_afl.protocol.prg.add_masks` splits its words among
them.  :data:`ONE_THREAD` (the sessions' default) runs everything in the caller's thread.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

# The most threads one computation gets: the most measured (bench/bench_large.py, 2 cores).
MAX_THREADS = 2


class Workers(Protocol):
    """Runs independent tasks, returning when every one has ended."""

    @property
    def count(self) -> int:
        """How many tasks run at once: the parts worth splitting a computation into."""
        ...

    def run(self, tasks: Sequence[Callable[[], None]]) -> None:
        """Run every task; when one or more raise, raise the first one's (in ``tasks``' order)
        once all have ended, so no task still runs after the call."""
        ...


@dataclass(frozen=True)
class OneThread:
    """Every task in the caller's thread, one after another (stops at the first that raises)."""

    count: int = 1

    def run(self, tasks: Sequence[Callable[[], None]]) -> None:
        for task in tasks:
            task()


ONE_THREAD = OneThread()


@dataclass(frozen=True)
class Threads:
    """``count`` threads for each call: the caller's and ``count - 1`` of a pool, each taking the
    next task not yet taken until none is left."""

    count: int

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"a thread count is an integer of at least 1, got {self.count!r}")

    def run(self, tasks: Sequence[Callable[[], None]]) -> None:
        if len(tasks) <= 1 or self.count == 1:
            ONE_THREAD.run(tasks)
            return
        errors: list[BaseException | None] = [None] * len(tasks)
        taken = itertools.count()  # next() on it is atomic under the GIL: each index taken once

        def take_tasks() -> None:
            while (index := next(taken)) < len(tasks):
                try:
                    tasks[index]()
                except BaseException as error:  # raised by run(), once every task has ended
                    errors[index] = error

        others = min(self.count, len(tasks)) - 1
        with ThreadPoolExecutor(max_workers=others) as pool:
            helpers = [pool.submit(take_tasks) for _ in range(others)]
            take_tasks()
            for helper in helpers:
                helper.result()
        for error in errors:
            if error is not None:
                raise error


def for_this_process() -> Workers:
    """Threads for the CPUs this process may run on, at most :data:`MAX_THREADS`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity outside Linux
        cpus = os.cpu_count() or 1
    count = max(1, min(MAX_THREADS, cpus))
    return ONE_THREAD if count == 1 else Threads(count)
