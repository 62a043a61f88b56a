"""Faults for ``deploy local`` to rehearse on: each node behind a :class:`~.faults.FaultProxy`, and
faults timed on the protocol's rounds (a :class:`~secure_afl.deploy.local.Network`).

``deploy local --fault-delay/--fault-reset/--fault-pause`` use it on loopback; bench/bench_faults.py
with each hospital in its own network namespace (``prefix`` and ``listen`` per node).  A round is
seen reaching a node when its SuperNode logs ``[ROUND s1-R2]`` (what ``--drop`` watches too).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .faults import FaultProxy
from .processes import descendants


@dataclass
class FaultPlan:
    """What to do to which node when.  Times are seconds; groups are Flower's (``s1-R2``)."""

    delay: float = 0.0  # each link, each way, per chunk
    jitter: float = 0.0
    rate: float = 0.0  # bytes per second per link and direction (0: no cap)
    # Reset every link's connections at once as each of these groups reaches a node: the worst case, a
    # reset may hit another node's pull in flight and Flower 1.42's pull delivers once (bench_faults.py)
    resets: tuple[str, ...] = ()
    # Reset each node's own link as each of these groups reaches it (while its ClientApp computes)
    node_resets: tuple[str, ...] = ()
    partition: tuple[str, str, float] | None = None  # (client, group, seconds): cut its link then restore
    pause: tuple[str, str, float] | None = None  # (client, group, seconds): SIGSTOP its node tree, SIGCONT
    restart_superlink: bool = False  # between the sessions of a federation that grows
    # where the nodes run: client -> argv prefix (``ip netns exec NS``) and the proxy's listen host
    prefix: Mapping[str, Sequence[str]] = field(default_factory=dict)
    listen: Mapping[str, str] = field(default_factory=dict)
    say: Callable[[str], None] = print

    def __post_init__(self) -> None:
        self.proxies: dict[str, FaultProxy] = {}
        self.events: list[str] = []
        self._started = time.monotonic()
        self._done: set[str] = set()
        self._timers: list[tuple[float, Callable[[], None]]] = []

    # --- the Network protocol -------------------------------------------------------------------

    @property
    def certificate_ips(self) -> list[str]:
        return sorted(set(self.listen.values()) - {"127.0.0.1"})

    @property
    def persistent_superlink(self) -> bool:
        return self.restart_superlink

    def node_route(self, client_id: str, superlink_port: int) -> tuple[list[str], str]:
        host = self.listen.get(client_id, "127.0.0.1")
        proxy = FaultProxy(
            ("127.0.0.1", superlink_port), listen=(host, 0), seed=len(self.proxies), name=client_id
        )
        proxy.start()
        proxy.set(delay=self.delay, jitter=self.jitter, rate=self.rate)
        self.proxies[client_id] = proxy
        address, port = proxy.address
        return list(self.prefix.get(client_id, ())), f"{address}:{port}"

    def on_poll(self, nodes: Mapping[str, Any]) -> None:
        now = time.monotonic()
        for due, action in list(self._timers):
            if now >= due:
                self._timers.remove((due, action))
                action()
        logs = {cid: None for cid in nodes}
        for group in self.resets:
            if f"reset {group}" not in self._done and any(
                self._seen(nodes, cid, group, logs) for cid in nodes
            ):
                self._done.add(f"reset {group}")
                count = sum(proxy.reset() for proxy in self.proxies.values())
                self.note(f"reset {count} connection(s) as {group} reached the nodes")
        for group in self.node_resets:
            for cid in nodes:
                key = f"reset {group} {cid}"
                if key not in self._done and self._seen(nodes, cid, group, logs):
                    self._done.add(key)
                    self.note(
                        f"reset {self.proxies[cid].reset()} connection(s) of {cid} as {group} reached it"
                    )
        if self.partition is not None and "cut" not in self._done:
            cid, group, seconds = self.partition
            if self._seen(nodes, cid, group, logs):
                self._done.add("cut")
                self.proxies[cid].partition()
                self.note(f"cut {cid}'s link as {group} reached it, for {seconds:g} s")
                self._after(
                    seconds, lambda: (self.proxies[cid].restore(), self.note(f"restored {cid}'s link"))
                )
        if self.pause is not None and "pause" not in self._done:
            cid, group, seconds = self.pause
            if self._seen(nodes, cid, group, logs):
                self._done.add("pause")
                pid = nodes[cid].process.pid
                _signal_tree(pid, signal.SIGSTOP)
                self.note(f"paused {cid}'s SuperNode and its processes (SIGSTOP) as {group} reached it")
                self._after(seconds, lambda: (_signal_tree(pid, signal.SIGCONT), self.note(f"resumed {cid}")))

    def between_sessions(self, k: int, restart_superlink: Callable[[], None]) -> None:
        if self.restart_superlink:
            self.note(f"restarting the SuperLink before session {k + 1}")
            restart_superlink()

    # --- the rest -------------------------------------------------------------------------------

    def note(self, text: str) -> None:
        self.events.append(f"{time.monotonic() - self._started:.1f} s: {text}")
        self.say(f"  fault: {text}")

    def close(self) -> None:
        """Resume a paused node, stop every proxy (the run's end, passed or failed)."""
        for _, action in list(self._timers):
            with contextlib.suppress(Exception):
                action()
        self._timers.clear()
        for proxy in self.proxies.values():
            with contextlib.suppress(Exception):
                proxy.stop()

    def _after(self, seconds: float, action: Callable[[], Any]) -> None:
        self._timers.append((time.monotonic() + seconds, action))

    @staticmethod
    def _seen(nodes: Mapping[str, Any], cid: str, group: str, logs: dict[str, Any]) -> bool:
        if logs.get(cid) is None:
            logs[cid] = nodes[cid].log.read_text(errors="replace")
        return f"ROUND {group}]" in logs[cid]


def _signal_tree(pid: int, sig: signal.Signals) -> None:
    for target in [pid, *sorted(descendants({pid}))]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, sig)
