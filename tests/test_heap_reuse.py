"""core/heap.py: within ``reused_pages`` large buffers come from the heap and a freed one's memory
serves the next (glibc); after the block they are mapped afresh again.

Each check runs in a fresh interpreter: a process that has run other tests may hold free heap
chunks large enough to serve a big buffer after the block too (glibc serves a request from a free
chunk before it maps one), which says nothing about the thresholds.  Where a buffer came from is
read from glibc's own accounting (``mallinfo2``, or ``mallinfo`` before glibc 2.33), not from page
faults: with transparent huge pages a fresh 64 MiB mapping can fault a few hundred times only."""

from __future__ import annotations

import subprocess
import sys

from secure_afl.core import heap

PROBE = '''
import ctypes, threading
from secure_afl.core import heap

SIZE = 64 << 20  # above glibc's largest mmap threshold: mapped afresh by default
libc = ctypes.CDLL(None)
kind = ctypes.c_size_t if hasattr(libc, "mallinfo2") else ctypes.c_int
names = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
         "keepcost")

class MallInfo(ctypes.Structure):
    _fields_ = [(name, kind) for name in names]

call = libc.mallinfo2 if hasattr(libc, "mallinfo2") else libc.mallinfo
call.restype = MallInfo

def mapped_by_a_buffer():
    """How much a fresh SIZE buffer grows glibc's mapped memory while it lives."""
    before = call().hblkhd
    buffer = bytearray(SIZE)
    grown = call().hblkhd - before
    del buffer
    return grown
'''

REUSE = """
with heap.reused_pages():
    first = mapped_by_a_buffer()
    again = [mapped_by_a_buffer() for _ in range(3)]
after = mapped_by_a_buffer()
assert first < SIZE and max(again) < SIZE, (first, again)  # from the heap, the freed memory reused
assert after >= SIZE, after  # left: a buffer this large is mapped afresh again
print("checked")
"""

NESTED = """
inside, release = threading.Event(), threading.Event()

def other():
    with heap.reused_pages():
        inside.set()
        release.wait(timeout=30)

thread = threading.Thread(target=other)
with heap.reused_pages():
    thread.start()
    assert inside.wait(timeout=30)
assert mapped_by_a_buffer() < SIZE  # the other thread is still inside: still from the heap
release.set()
thread.join(timeout=30)
assert not thread.is_alive()
assert mapped_by_a_buffer() >= SIZE  # the last to leave restored the thresholds
print("checked")
"""


def _fresh(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", PROBE + code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_freed_buffer_serves_the_next_within_the_block_only() -> None:
    if not heap.available():  # not glibc: the block changes nothing, and nests
        with heap.reused_pages(), heap.reused_pages():
            assert bytearray(16) == bytes(16)
        return
    assert _fresh(REUSE).strip() == "checked"


def test_blocks_nest_and_overlap_across_threads_and_the_last_to_leave_restores() -> None:
    if not heap.available():
        with heap.reused_pages():
            assert bytearray(16) == bytes(16)
        return
    assert _fresh(NESTED).strip() == "checked"
