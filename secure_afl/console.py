"""The ``secure-afl`` console script: process settings, the click command, then a prompt exit.

Kept apart from :mod:`secure_afl.cli` so that tests and other callers of the click command in a
running interpreter get neither the settings nor the exit.

- ``OPENBLAS_THREAD_TIMEOUT=4`` (unless set): OpenBLAS's idle threads otherwise spin for about
  2^28 cycles after every product, and on two cores the spinning takes a core from the work beside
  it (about 0.7 CPU-seconds in ``sim``'s synthetic features).  It changes when idle threads sleep,
  not how a product is split, so every result is the same.  OpenBLAS reads it when numpy is first
  imported, hence before any import here.
- ``_SECURE_AFL_FRESH_PROCESS`` (this process's pid): no torch work has run here yet, so ``sim`` may
  train FedAvg in a forked child (see :mod:`secure_afl.sim.gradient`); children, which have
  other pids, ignore it.
- The exit: once the command has returned, its threads have ended and the ``atexit`` handlers have
  run (temporary files removed, logs flushed), the process ends with ``os._exit`` instead of
  tearing the interpreter down, which takes torch most of a second.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
# This process has run no torch work yet: `sim` may fork FedAvg's trainer (sim/gradient.py).
os.environ["_SECURE_AFL_FRESH_PROCESS"] = str(os.getpid())


def run() -> None:
    """The console script's entry point."""
    from secure_afl.cli import main

    try:
        main()  # standalone mode: ends by raising SystemExit with the exit status
    except SystemExit as exc:
        status = _exit_status(exc.code)
    else:
        status = 0
    exit_now(status)


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # what sys.exit("message") prints
    return 1


def exit_now(status: int) -> None:
    """End the process without the interpreter's teardown, after what a normal exit must do."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # the handlers a normal exit runs
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more can be written
            stream.flush()
    os._exit(status)
