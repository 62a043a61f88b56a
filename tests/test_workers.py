"""core.workers: tasks on one thread or several, every one ended before the call returns."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from secure_afl.core.workers import MAX_THREADS, ONE_THREAD, Threads, for_this_process


def test_threads_run_every_task_on_their_own_threads() -> None:
    seen: list[int] = []
    barrier = threading.Barrier(3, timeout=10)  # only passes if the three tasks run at once

    def task() -> None:
        barrier.wait()
        seen.append(threading.get_ident())

    Threads(3).run([task, task, task])
    assert len(set(seen)) == 3 and threading.get_ident() in seen


def test_the_first_error_in_task_order_is_raised_after_every_task_ended() -> None:
    ended: list[str] = []
    second_started = threading.Event()

    def first() -> None:
        second_started.wait(10)
        ended.append("first")
        raise KeyError("first")

    def second() -> None:
        second_started.set()
        ended.append("second")
        raise ValueError("second")

    def third() -> None:
        ended.append("third")

    with pytest.raises(KeyError, match="first"):
        Threads(3).run([first, second, third])
    assert sorted(ended) == ["first", "second", "third"]


def test_one_thread_stops_at_the_first_error() -> None:
    ran: list[int] = []

    def failing() -> None:
        ran.append(1)
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        ONE_THREAD.run([failing, lambda: ran.append(2)])
    assert ran == [1]


@pytest.mark.parametrize("count", [0, -1, 1.5])
def test_a_thread_count_is_a_positive_integer(count: object) -> None:
    with pytest.raises(ValueError, match="thread count"):
        Threads(count)  # type: ignore[arg-type]


def test_this_process_gets_at_most_max_threads() -> None:
    workers = for_this_process()
    assert 1 <= workers.count <= MAX_THREADS
    assert Threads(2) == Threads(2) and Threads(2) != Threads(3)


def test_more_tasks_than_threads_each_run_once_shared_by_the_threads() -> None:
    runs: list[tuple[int, int]] = []
    both = threading.Barrier(2, timeout=10)  # the first two tasks only end once they run at once

    def task(index: int) -> None:
        if index < 2:
            both.wait()
        runs.append((index, threading.get_ident()))

    Threads(2).run([lambda i=i: task(i) for i in range(7)])
    assert sorted(index for index, _ in runs) == list(range(7))
    assert len({ident for _, ident in runs}) == 2


def test_a_process_held_to_one_cpu_masks_on_one_thread() -> None:
    # What an operator's CPUAffinity= (systemd) or taskset does: the CPUs a process may run on.
    code = (
        "import os\n"
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "from secure_afl.core.workers import ONE_THREAD, for_this_process\n"
        "print(for_this_process() == ONE_THREAD)\n"
    )
    command = [sys.executable, "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "True"
