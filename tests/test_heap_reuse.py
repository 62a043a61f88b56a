"""core/heap.py: within ``reused_pages`` large buffers come from the heap and a freed one's memory
serves the next (glibc); after the block they are mapped afresh again.

Where a buffer came from is read from glibc's own accounting (``mallinfo2``, or ``mallinfo`` before
glibc 2.33), not from page faults: with transparent huge pages a fresh 64 MiB mapping can fault a
few hundred times only, as few as a reused one."""

from __future__ import annotations

import ctypes
import threading

from secure_afl.core import heap

SIZE = 64 << 20  # above glibc's largest mmap threshold: mapped afresh by default


def _accounting() -> tuple[int, int, int]:
    """glibc's (heap bytes, mmapped bytes, free bytes kept in the heap)."""
    libc = ctypes.CDLL(None)
    kind = ctypes.c_size_t if hasattr(libc, "mallinfo2") else ctypes.c_int
    names = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")

    class MallInfo(ctypes.Structure):
        _fields_ = [(name, kind) for name in (*names, "keepcost")]

    call = libc.mallinfo2 if hasattr(libc, "mallinfo2") else libc.mallinfo
    call.restype = MallInfo
    info = call()
    return int(info.arena), int(info.hblkhd), int(info.fordblks)


def _a_buffer() -> tuple[int, int]:
    """How much a fresh SIZE buffer grows the heap and the mapped memory while it lives."""
    heap_before, mapped_before, _ = _accounting()
    buffer = bytearray(SIZE)
    heap_after, mapped_after, _ = _accounting()
    del buffer
    return heap_after - heap_before, mapped_after - mapped_before


def test_a_freed_buffer_serves_the_next_within_the_block_only() -> None:
    if not heap.available():  # not glibc: the block changes nothing, and nests
        with heap.reused_pages(), heap.reused_pages():
            assert bytearray(16) == bytes(16)
        return
    with heap.reused_pages():
        grown, mapped = _a_buffer()  # from the heap (which grows, unless it already had room)
        assert mapped < SIZE, (grown, mapped)
        assert _accounting()[2] >= SIZE  # freed, and kept
        again = [_a_buffer() for _ in range(3)]
        assert all(g < SIZE and m < SIZE for g, m in again), again  # the kept memory serves them
    # Left: a buffer this large is mapped afresh again (malloc_trim's return of the heap's free
    # pages is not observable here: glibc still counts them as free bytes).
    grown, mapped = _a_buffer()
    assert mapped >= SIZE and grown < SIZE, (grown, mapped)


def test_blocks_nest_and_overlap_across_threads_and_the_last_to_leave_restores() -> None:
    if not heap.available():
        with heap.reused_pages():
            assert bytearray(16) == bytes(16)
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
    # The other thread is still inside: large buffers still come from the heap.
    assert _a_buffer()[1] < SIZE
    release.set()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert _a_buffer()[1] >= SIZE
