"""Child processes of the deployment: started in their own process groups, watched, and stopped.

A leaf module: ``deploy local`` (the rehearsal), ``deploy superlink`` and the coordinator's
``deploy run`` all start Flower's executables through it, and it imports nothing above it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from .errors import LocalDeploymentError

# Flower's SuperExec polls for tasks every second by default; a tenth keeps each round short.  That is
# the only polling Flower 1.42 lets a deployment set: a SuperNode that pulled no message sleeps 3 s
# (flwr/supernode/start_client_internal.py, a constant) and waits for its ClientApp's reply in 0.5 s
# steps, and neither flower-supernode nor flower-superlink has an option for them; the bare Flower
# app of bench/bench_flower_floor.py pays the same (bench/README.md, "bench_flower_floor.py";
# bench/history/flower-floor.md).
CHILD_ENV = {
    "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "PYTHONUNBUFFERED": "1",
}
READY_SUPERLINK = "Uvicorn running"
READY_SUPERNODE = "SuperNode ID"


def flower_bin(name: str) -> str:
    """A Flower executable from this interpreter's environment (then ``PATH``)."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise LocalDeploymentError(f"{name} not found: install Flower (pip install 'flwr>=1.42,<1.43')")
    return found


# Ports below this are left to well-known and registered services.
_PORT_FLOOR = 10000
# The kernel's default range for the local ports of outgoing connections (Linux), where it cannot
# be read.
_DEFAULT_EPHEMERAL = (32768, 60999)
_PORT_TRIES = 200


def ephemeral_ports() -> tuple[int, int]:
    """The range from which the kernel gives outgoing connections their local ports."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL
    return low, high


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now, for a child to bind, chosen outside the kernel's
    ephemeral range: a port from that range (what binding port 0 returns) may be handed to any
    process's outgoing connection between this check and the child's bind, and the child then
    fails with "address already in use" (seen: a SuperNode's HTTP API, while other SuperNodes
    were connecting).  Where no range outside it is left, the kernel's choice."""
    low, high = ephemeral_ports()
    spans = [(a, b) for a, b in ((_PORT_FLOOR, low - 1), (max(high + 1, _PORT_FLOOR), 65535)) if b >= a]
    total = sum(b - a + 1 for a, b in spans)
    for _ in range(_PORT_TRIES if total else 0):
        index = secrets.randbelow(total)  # uniform over the spans (a port is no secret)
        for a, b in spans:
            if index <= b - a:
                port = a + index
                break
            index -= b - a + 1
        with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue  # taken: another
            return port
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log: Path

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class ProcessGroups:
    """Children started in their own process groups, all stopped by :meth:`stop_all`."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self.children: list[Child] = []

    def start(
        self,
        name: str,
        argv: Sequence[str],
        log: Path,
        *,
        stdout: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Child:
        handle = open(log, "wb")  # noqa: SIM115  (the child holds its own copy of the descriptor)
        process = subprocess.Popen(
            list(argv),
            stdout=handle if stdout is None else stdout,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else self.env,
            start_new_session=True,  # its own process group: its children go down with it
        )
        handle.close()
        child = Child(name, process, log)
        self.children.append(child)
        return child

    def kill(self, child: Child) -> None:
        _kill_group(child.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.process.wait(timeout=10)

    def kill_tree(self, child: Child, grace: float = 5.0) -> None:
        """Stop ``child`` and every process it started, in whatever process group (SIGTERM, then
        SIGKILL after ``grace`` seconds)."""
        pgids = {child.process.pid}
        for pid in descendants({child.process.pid}):
            with contextlib.suppress(OSError):
                pgids.add(os.getpgid(pid))
        pgids.discard(os.getpgid(0))
        for pgid in pgids:
            _kill_group(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.process.wait(timeout=grace)
        for pgid in pgids:
            _kill_group(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.process.wait(timeout=10)

    def groups(self) -> set[int]:
        """Every process group of the children and of their descendants.

        The SuperLink starts its ``flower-superexec`` in a new session (another group), so the
        groups of descendants are collected too (from ``/proc`` where there is one).
        """
        pgids = {child.process.pid for child in self.children}
        for pid in descendants({child.process.pid for child in self.children}):
            with contextlib.suppress(OSError):
                pgids.add(os.getpgid(pid))
        pgids.discard(os.getpgid(0))  # never our own group
        return pgids

    def stop_all(self, grace: float = 5.0) -> None:
        groups = self.groups()
        for pgid in groups:
            _kill_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        groups |= self.groups()
        for pgid in groups:
            _kill_group(pgid, signal.SIGKILL)  # stragglers: superexec, app processes
        for pgid in groups:
            for _ in range(100):
                if not _group_alive(pgid):
                    break
                time.sleep(0.05)
        for child in self.children:
            if child.process.poll() is None:  # pragma: no cover
                child.process.kill()
                child.process.wait(timeout=5)
        self._stopped = groups

    def alive(self) -> list[int]:
        """Process groups (of children or their descendants) with a live process."""
        known = self.groups() | getattr(self, "_stopped", set())
        return sorted(pgid for pgid in known if _group_alive(pgid))


def descendants(roots: set[int]) -> set[int]:
    """Live descendants of ``roots`` (Linux ``/proc``; empty elsewhere)."""
    parent: dict[int, int] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return set()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parent[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = set(roots)
    for _ in range(64):  # bounded depth
        children = {pid for pid, ppid in parent.items() if ppid in frontier and pid not in found}
        if not children:
            break
        found |= children
        frontier = children
    return found


def _kill_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover
        return True
    return True


def wait_for_log(
    child: Child, marker: str, timeout: float, what: str, error: type[Exception] = LocalDeploymentError
) -> float:
    """Seconds until ``marker`` appears in ``child``'s log; ``error`` when it exits first or the
    bounded wait (count and time) ends."""
    started = time.monotonic()
    deadline = started + timeout
    for _ in range(int(timeout / 0.1) + 10):
        if marker in child.log.read_text(errors="replace"):
            return time.monotonic() - started
        if child.process.poll() is not None:
            raise error(
                f"{what} exited with code {child.process.returncode} before it was ready; its log "
                f"({child.log}) ends with:\n{child.tail()}"
            )
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    raise error(f"{what} was not ready within {timeout:.0f} s; see {child.log}:\n{child.tail()}")


def pump_lines(stream: IO[bytes] | None, log: Path, lines: queue.Queue[str | None]) -> None:
    if stream is None:
        lines.put(None)
        return
    with open(log, "ab") as handle:
        for raw in iter(stream.readline, b""):
            handle.write(raw)
            handle.flush()
            lines.put(_ANSI.sub("", raw.decode("utf-8", errors="replace")).rstrip())
    lines.put(None)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
