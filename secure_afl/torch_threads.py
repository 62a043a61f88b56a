"""One torch thread for a block of code, safe when several Python threads do it at once.

torch's intra-op thread count is one process-wide setting.  The simulator trains FedAvg on worker
threads while the main thread runs the AFL pipeline, and each side asks for a single torch thread
(small products, where a second OpenMP thread costs more than it saves and, on a shared machine,
waits for a busy core).  A plain save/set/restore would let the first block to finish restore the
count under the feet of another still running; here the first entry saves it and the last exit
restores it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_lock = threading.Lock()
_holders = 0
_saved = 1


def _fresh_lock_in_child() -> None:
    # A process forked while another thread held the lock (sim/gradient.py forks FedAvg's process)
    # would otherwise wait for a thread that does not exist there.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_in_child)


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run a block on one torch thread; the count before the outermost block comes back after it."""
    global _holders, _saved
    with _lock:
        if _holders == 0:
            _saved = torch.get_num_threads()
            torch.set_num_threads(1)
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                torch.set_num_threads(_saved)
