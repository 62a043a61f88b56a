"""The TCP fault proxy (secure_afl/deploy/faults.py) on loopback: a delayed echo, a capped link, a reset,
a blackhole then restore.  An echo server on a free port; every socket has a timeout (bounded waits),
and every thread is stopped."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from secure_afl.deploy.faults import FaultProxy, FaultProxyError

WAIT = 10.0  # seconds any single receive may wait before the test fails


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.settimeout(WAIT)
        for _ in range(10_000):
            try:
                data = self.request.recv(65536)
            except OSError:
                return
            if not data:
                return
            self.request.sendall(data)


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)  # bound and listening: ready
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.server_address[:2]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(WAIT)
        assert not thread.is_alive()


@pytest.fixture
def proxy(echo) -> Iterator[FaultProxy]:
    with FaultProxy(echo, name="test") as running:
        yield running


def _connect(proxy: FaultProxy) -> socket.socket:
    client = socket.create_connection(proxy.address, timeout=WAIT)
    client.settimeout(WAIT)
    return client


def _receive(client: socket.socket, size: int) -> bytes:
    data = b""
    for _ in range(10_000):
        if len(data) >= size:
            break
        chunk = client.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def test_a_delayed_echo_comes_back_whole_after_both_delays(proxy: FaultProxy) -> None:
    with _connect(proxy) as client:
        client.sendall(b"warm")  # the upstream connection exists before the timed exchange
        assert _receive(client, 4) == b"warm"
        proxy.set(delay=0.15, jitter=0.03)
        payload = bytes(range(256)) * 200  # several chunks each way, in order
        started = time.monotonic()
        client.sendall(payload)
        assert _receive(client, len(payload)) == payload
        assert time.monotonic() - started >= 2 * (0.15 - 0.03)  # there and back, each at least delay - jitter


def test_a_capped_link_passes_no_faster_than_its_rate(proxy: FaultProxy) -> None:
    proxy.set(rate=400_000)
    payload = b"x" * 100_000
    with _connect(proxy) as client:
        started = time.monotonic()
        client.sendall(payload)
        assert _receive(client, len(payload)) == payload
        # 100 kB each way at 400 kB/s (the two directions overlap: the echo starts on the first chunk)
        assert time.monotonic() - started >= (100_000 - 16384) / 400_000
    assert proxy.stats.bytes_up == proxy.stats.bytes_down == 100_000


def test_a_reset_resets_the_open_connection_and_the_next_one_works(proxy: FaultProxy) -> None:
    with _connect(proxy) as client:
        client.sendall(b"before")
        assert _receive(client, 6) == b"before"
        assert proxy.reset() == 1
        with pytest.raises(ConnectionResetError):
            client.sendall(b"after")
            client.recv(10)  # the RST arrives on the first read or write
    with _connect(proxy) as again:
        again.sendall(b"again")
        assert _receive(again, 5) == b"again"
    assert proxy.stats.resets == 1 and proxy.stats.connections == 2


def test_a_blackhole_passes_nothing_until_restored(proxy: FaultProxy) -> None:
    with _connect(proxy) as client:
        client.sendall(b"one")
        assert _receive(client, 3) == b"one"
        proxy.partition()
        client.sendall(b"two")
        client.settimeout(0.5)
        with pytest.raises(TimeoutError):
            client.recv(3)  # cut: nothing comes back
        with _connect(proxy) as late:  # a connection made during the cut: accepted, but nothing passes
            late.sendall(b"new")
            late.settimeout(0.3)
            with pytest.raises(TimeoutError):
                late.recv(3)
            proxy.restore()
            late.settimeout(WAIT)
            assert _receive(late, 3) == b"new"
        client.settimeout(WAIT)
        assert _receive(client, 3) == b"two"  # held through the cut, as TCP retransmits, then delivered


def test_bad_settings_and_a_taken_address_are_refused(echo) -> None:
    with FaultProxy(echo) as running:
        with pytest.raises(ValueError, match="jitter must not exceed the delay"):
            running.set(delay=0.01, jitter=0.02)
        with pytest.raises(ValueError, match="rate must be >= 0"):
            running.set(rate=-1)
        with pytest.raises(FaultProxyError, match="could not start"):
            FaultProxy(echo, listen=running.address).start()
    with pytest.raises(FaultProxyError, match="network namespace 'saf-no-such-ns'"):
        FaultProxy(echo, netns="saf-no-such-ns").start()


def test_deploy_local_refuses_a_malformed_fault_pause_before_anything_starts(tmp_path) -> None:
    from click.testing import CliRunner

    from secure_afl.cli import main

    # seed 2: a plan every node's exposure check accepts (as test_deploy_local's CKKS federation)
    common = ["deploy", "local", "--clients", "4", "--seed", "2", "--fraction", "0.08", "--dim", "32",
              "--out", str(tmp_path)]  # fmt: skip
    for value in ("client-9@R1:5", "client-1@R7:5", "client-1@R1:0", "client-1@R1:soon"):
        result = CliRunner().invoke(main, [*common, "--fault-pause", value])
        assert result.exit_code == 2, result.output
        assert "expected CLIENT@ROUND:SECONDS with CLIENT in client-0..client-3" in result.output
    assert not (tmp_path / "logs").exists()  # refused before the rehearsal wrote anything


def test_a_refused_upstream_is_a_reset_not_an_eof() -> None:
    """A SuperLink restarting behind the proxy: the node must see what a refused connect gives (an RST,
    which Flower retries), not a clean EOF (which its TLS client takes for a broken handshake and quits)."""
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        closed = placeholder.getsockname()[:2]  # nothing listens here once it is closed
    with FaultProxy(closed) as running, _connect(running) as client:
        with pytest.raises(ConnectionResetError):
            client.sendall(b"hello")
            client.recv(10)
        assert running.stats.upstream_failures == 1
