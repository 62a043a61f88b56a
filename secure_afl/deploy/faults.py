"""A small TCP fault proxy for trying a federation on bad networks (bench/bench_faults.py, the tests).

A :class:`FaultProxy` listens on one address and forwards every connection to one upstream address
(a SuperNode's link to the SuperLink), injecting what a long, loaded link does to TCP: a delay with
jitter per chunk (order kept), a throughput cap shared by the link's connections in each direction,
connection resets (RST, as a middlebox or a dropped NAT entry gives), and a blackhole (a partition:
nothing passes and new connections hang until :meth:`FaultProxy.restore`, as TCP retransmits through
a cut that heals).  Every setting can be changed at any time from another thread; the proxy runs its
own asyncio loop in a thread, optionally inside a named network namespace (``ip netns``; root).

A leaf module: the standard library only.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import random
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CHUNK = 16384  # bytes read at once: a "chunk" is what one delay applies to
QUEUE_CHUNKS = 64  # chunks held per direction before the reader waits (backpressure)
CLONE_NEWNET = 0x40000000


class FaultProxyError(RuntimeError):
    """The proxy could not start (address, namespace) or answer a command in time."""


@dataclass
class LinkStats:
    connections: int = 0  # accepted
    resets: int = 0  # connections reset by reset()
    upstream_failures: int = 0  # upstream connects that failed (the downstream was closed)
    bytes_up: int = 0  # towards upstream
    bytes_down: int = 0


@dataclass(eq=False)  # hashed by identity: the proxy keeps a set of its open pairs
class _Pair:
    downstream: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)


class _Bucket:
    """A throughput cap for one direction of the link: bytes are let through at ``rate`` per second."""

    def __init__(self) -> None:
        self.free_at = 0.0

    async def take(self, loop: asyncio.AbstractEventLoop, size: int, rate: float) -> None:
        if rate <= 0:
            return
        now = loop.time()
        start = max(now, self.free_at)
        self.free_at = start + size / rate
        if self.free_at > now:
            await asyncio.sleep(self.free_at - now)


def enter_netns(name: str) -> None:
    """Move the calling thread into network namespace ``name`` (``ip netns add NAME``; needs root)."""
    path = f"/run/netns/{name}"
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise FaultProxyError(f"network namespace {name!r}: cannot open {path} ({exc.strerror})") from None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise FaultProxyError(f"setns into {name!r} failed: {os.strerror(errno)} (root is needed)")
    finally:
        os.close(fd)


class FaultProxy:
    """Forward ``listen`` to ``upstream`` with faults; use as a context manager or start()/stop().

    ``delay`` and ``jitter`` (seconds, each direction, per chunk: uniform in delay ± jitter, never
    reordering), ``rate`` (bytes per second per direction, 0: none) may be set at any time with
    :meth:`set`; :meth:`reset` resets every open connection; :meth:`partition` and :meth:`restore`
    cut and heal the link."""

    def __init__(
        self,
        upstream: tuple[str, int],
        *,
        listen: tuple[str, int] = ("127.0.0.1", 0),
        netns: str | None = None,
        seed: int = 0,
        name: str = "proxy",
    ) -> None:
        self.upstream = upstream
        self.listen = listen
        self.netns = netns
        self.name = name
        self.delay = 0.0
        self.jitter = 0.0
        self.rate = 0.0
        self.stats = LinkStats()
        self._random = random.Random(seed)
        self._pairs: set[Any] = set()
        self._accepting: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open: asyncio.Event | None = None  # set: the link passes data; clear: a partition
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._stopping: asyncio.Event | None = None
        self._address: tuple[str, int] | None = None
        self._buckets = (_Bucket(), _Bucket())

    # --- control (any thread) ---------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        if self._address is None:
            raise FaultProxyError(f"{self.name} is not started")
        return self._address

    def set(
        self, *, delay: float | None = None, jitter: float | None = None, rate: float | None = None
    ) -> None:
        for key, value in (("delay", delay), ("jitter", jitter), ("rate", rate)):
            if value is not None and value < 0:
                raise ValueError(f"{key} must be >= 0, got {value}")
        if jitter is not None and jitter > (self.delay if delay is None else delay):
            raise ValueError("jitter must not exceed the delay (a chunk is never sent before it came)")
        if delay is not None:
            self.delay = float(delay)
        if jitter is not None:
            self.jitter = float(jitter)
        if rate is not None:
            self.rate = float(rate)

    def clear(self) -> None:
        """No delay, no cap, the link open."""
        self.set(delay=0.0, jitter=0.0, rate=0.0)
        self.restore()

    def reset(self, timeout: float = 10.0) -> int:
        """Reset (RST) every open connection now; return how many."""
        return int(self._run(self._reset_all(), timeout))

    def partition(self) -> None:
        self._call(lambda: self._open.clear())  # type: ignore[union-attr]

    def restore(self) -> None:
        self._call(lambda: self._open.set())  # type: ignore[union-attr]

    @property
    def open_connections(self) -> int:
        return len(self._pairs)

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> FaultProxy:
        self._thread = threading.Thread(target=self._main, name=f"fault-{self.name}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise FaultProxyError(f"{self.name} did not start within {timeout:.0f} s")
        if self._failure is not None:
            raise FaultProxyError(f"{self.name} could not start: {self._failure}") from self._failure
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stopping.set)  # type: ignore[union-attr]
            self._thread.join(timeout)
            if self._thread.is_alive():  # pragma: no cover
                raise FaultProxyError(f"{self.name} did not stop within {timeout:.0f} s")

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- the loop ---------------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            if self.netns is not None:
                enter_netns(self.netns)
            asyncio.run(self._serve_forever())
        except BaseException as exc:  # reported by start(), or ends the thread after a stop
            self._failure = exc
            self._ready.set()

    async def _serve_forever(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._open = asyncio.Event()
        self._open.set()
        self._stopping = asyncio.Event()
        self._server = await asyncio.start_server(self._accept, self.listen[0], self.listen[1])
        host, port = self._server.sockets[0].getsockname()[:2]
        self._address = (host, int(port))
        self._ready.set()
        await self._stopping.wait()
        self._server.close()
        self._open.set()  # release whatever waits on a partition
        await self._reset_all(count=False)
        if self._accepting:  # let each connection's handler end (a cancelled one is logged as an error)
            await asyncio.wait(self._accepting, timeout=5.0)
        await self._server.wait_closed()

    def _call(self, action: Callable[[], None], timeout: float = 10.0) -> None:
        """Run ``action`` on the proxy's loop and return once it has run (no race with later data)."""

        async def call() -> None:
            action()

        self._run(call(), timeout)

    def _run(self, coroutine: Any, timeout: float) -> Any:
        if self._loop is None:
            coroutine.close()
            raise FaultProxyError(f"{self.name} is not started")
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            raise FaultProxyError(f"{self.name} did not answer within {timeout:.0f} s") from None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        task = asyncio.current_task()
        if task is not None:
            self._accepting.add(task)
            task.add_done_callback(self._accepting.discard)
        pair = _Pair(writer)
        self._pairs.add(pair)
        try:
            await self._open.wait()  # type: ignore[union-attr]  (a partition: the SYN gets no answer yet)
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                # The upstream refused (restarting): reset the accepted connection, as the refusal's
                # RST would have, not a clean EOF (which a TLS client takes for a broken handshake).
                self.stats.upstream_failures += 1
                _abort(writer)
                return
            pair.upstream = up_writer
            pair.tasks = [
                asyncio.ensure_future(self._pump(reader, up_writer, 0)),
                asyncio.ensure_future(self._pump(up_reader, writer, 1)),
            ]
            await asyncio.gather(*pair.tasks, return_exceptions=True)
        finally:
            self._pairs.discard(pair)
            for end in (pair.downstream, pair.upstream):
                if end is not None:
                    end.close()

    def _latency(self) -> float:
        if self.jitter <= 0:
            return self.delay
        return max(0.0, self.delay + self._random.uniform(-self.jitter, self.jitter))

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, direction: int) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(QUEUE_CHUNKS)

        async def read() -> None:
            last = 0.0
            try:
                while True:
                    data = await source.read(CHUNK)
                    if not data:
                        break
                    last = max(loop.time() + self._latency(), last)  # delayed, never reordered
                    await queue.put((last, data))
            except (ConnectionError, OSError):
                pass
            await queue.put(None)

        reading = asyncio.ensure_future(read())
        try:
            while True:
                item = await queue.get()
                if item is None:
                    with contextlib.suppress(OSError, RuntimeError):
                        if sink.can_write_eof():
                            sink.write_eof()
                    break
                due, data = item
                await self._open.wait()  # type: ignore[union-attr]
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                await self._buckets[direction].take(loop, len(data), self.rate)
                await self._open.wait()  # type: ignore[union-attr]
                if direction == 0:  # counted as handed on (a reader may see the bytes before drain returns)
                    self.stats.bytes_up += len(data)
                else:
                    self.stats.bytes_down += len(data)
                sink.write(data)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reading

    async def _reset_all(self, count: bool = True) -> int:
        pairs = list(self._pairs)
        for pair in pairs:
            for end in (pair.downstream, pair.upstream):
                if end is None:
                    continue
                _abort(end)
            for task in pair.tasks:
                task.cancel()
        if count:
            self.stats.resets += len(pairs)
        await asyncio.sleep(0)
        return len(pairs)


def _abort(end: asyncio.StreamWriter) -> None:
    """Close a connection with an RST (linger 0), not a FIN."""
    sock = end.get_extra_info("socket")
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    end.transport.abort()
