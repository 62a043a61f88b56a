"""Large buffers made and freed one after another, served again from the same pages (glibc only).

The masked aggregation's in-process driver builds one client's message at a time (at d = 4096
128 MiB: two Gram triangles and the rest), hands it to the server and lets it go before the next
client builds its own.  Left to its defaults, glibc maps every allocation above its mmap threshold
(at most 32 MiB) afresh and unmaps it when it is freed, so each message's pages are faulted in and
zeroed by the kernel again: on the host of ``bench/bench_large.py`` 1.1 of the 3.1 CPU-seconds of
the masked aggregation at d = 4096 (a VM whose kernel reports freed memory to its hypervisor
adds more: the hypervisor maps memory freed seconds ago in again, bench/README.md's
bench_statistics section).  Within :func:`reused_pages`, large allocations come from the
heap and the heap keeps what is freed, so the next message of the same size lands on pages already
mapped; on leaving, the heap's free memory goes back to the system (``malloc_trim``), so what was
kept for reuse outlives the block in no process's peak beyond the one message it held.

Nothing computed depends on it: only where memory comes from.  Elsewhere than glibc (macOS, musl)
the block does nothing.  The settings are process-wide: nested or concurrent blocks are counted,
and the first to enter and the last to leave change them.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
from collections.abc import Iterator

_M_TRIM_THRESHOLD = -1  # mallopt's parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
# Within a block: buffers up to this size come from the heap, which keeps up to this much free.
_KEPT_BYTES = 1 << 30
# On leaving: glibc's own ceiling for its dynamic mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX on
# 64-bit) and the trim threshold it pairs with it, where a process that has freed buffers of that
# size settles.  (A threshold once set stays fixed: glibc offers no way back to adjusting it.)
_SETTLED_MMAP_THRESHOLD = 32 << 20
_SETTLED_TRIM_THRESHOLD = 2 * _SETTLED_MMAP_THRESHOLD

_lock = threading.Lock()
_depth = 0


def _glibc() -> ctypes.CDLL | None:
    """The process's C library where it is glibc (it has ``mallopt`` and ``malloc_trim``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if not all(hasattr(libc, name) for name in ("gnu_get_libc_version", "mallopt", "malloc_trim")):
        return None
    return libc


_LIBC = _glibc()


def available() -> bool:
    """Whether :func:`reused_pages` changes anything here (glibc)."""
    return _LIBC is not None


@contextlib.contextmanager
def reused_pages() -> Iterator[None]:
    """Within the block, large buffers come from the heap and freed ones are kept for the next
    (see the module docstring); on leaving, the heap's free memory is given back."""
    global _depth
    libc = _LIBC
    if libc is None:
        yield
        return
    with _lock:
        _depth += 1
        if _depth == 1:
            libc.mallopt(_M_MMAP_THRESHOLD, _KEPT_BYTES)
            libc.mallopt(_M_TRIM_THRESHOLD, _KEPT_BYTES)
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                libc.mallopt(_M_MMAP_THRESHOLD, _SETTLED_MMAP_THRESHOLD)
                libc.mallopt(_M_TRIM_THRESHOLD, _SETTLED_TRIM_THRESHOLD)
                libc.malloc_trim(0)
