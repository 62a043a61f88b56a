"""core/heap.py: within ``reused_pages`` a freed large buffer's pages serve the next one (glibc),
and leaving the block gives the heap's free memory back; results never depend on it."""

from __future__ import annotations

import resource
import threading

from secure_afl.core import heap

SIZE = 64 << 20  # above glibc's largest mmap threshold: mapped afresh by default


def _faults_of_a_fresh_buffer() -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = bytearray(SIZE)  # zero-filled: every page written
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del buffer
    return faults


def test_a_freed_buffer_s_pages_serve_the_next_within_the_block_only() -> None:
    pages = SIZE // resource.getpagesize()
    if not heap.available():  # not glibc: the block changes nothing, and nests
        with heap.reused_pages(), heap.reused_pages():
            assert _faults_of_a_fresh_buffer() >= 0
        return
    with heap.reused_pages():
        _faults_of_a_fresh_buffer()  # the heap grows once
        again = [_faults_of_a_fresh_buffer() for _ in range(3)]
    after = _faults_of_a_fresh_buffer()
    assert max(again) < pages // 10, (again, pages)
    # Left: the heap's free memory was given back, and a buffer this large is mapped afresh again.
    assert after > pages // 2, (after, pages)


def test_blocks_nest_and_overlap_across_threads_and_the_last_to_leave_restores() -> None:
    if not heap.available():
        with heap.reused_pages():
            pass
        return
    inside = threading.Event()
    release = threading.Event()

    def other() -> None:
        with heap.reused_pages():
            inside.set()
            release.wait(timeout=30)

    thread = threading.Thread(target=other)
    with heap.reused_pages():
        thread.start()
        assert inside.wait(timeout=30)
    # The other thread is still inside: buffers are still kept for reuse.
    _faults_of_a_fresh_buffer()
    assert _faults_of_a_fresh_buffer() < SIZE // resource.getpagesize() // 10
    release.set()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert _faults_of_a_fresh_buffer() > SIZE // resource.getpagesize() // 2
