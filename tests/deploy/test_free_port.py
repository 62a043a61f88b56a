"""Ports for the children that ``deploy local`` and the tests start: free when chosen, and outside
the kernel's ephemeral range, so no outgoing connection is handed one before the child binds it."""

from __future__ import annotations

import socket
from contextlib import closing

import pytest

from secure_afl.deploy import processes
from secure_afl.deploy.processes import ephemeral_ports, free_port


def test_ports_are_free_and_outside_the_ephemeral_range() -> None:
    low, high = ephemeral_ports()
    ports = {free_port() for _ in range(50)}
    assert len(ports) > 40  # spread, not one port handed out again and again
    for port in ports:
        assert not low <= port <= high
        assert 10000 <= port <= 65535
        with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
            sock.bind(("127.0.0.1", port))  # still free: nothing of this process holds it


def _held_port_with_a_free_neighbour() -> tuple[socket.socket, int]:
    """A listening socket on a port P whose neighbour P + 1 is free (a bounded search)."""
    for _ in range(50):
        held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        if port < 65535:
            with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as probe:
                try:
                    probe.bind(("127.0.0.1", port + 1))
                except OSError:
                    pass
                else:
                    held.listen()
                    return held, port
        held.close()
    raise AssertionError("no port with a free neighbour in 50 tries")


def test_a_taken_port_is_never_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    held, taken = _held_port_with_a_free_neighbour()
    with closing(held):
        # The only ports outside the "ephemeral" range: the taken one and its neighbour.
        monkeypatch.setattr(processes, "_PORT_FLOOR", taken)
        monkeypatch.setattr(processes, "ephemeral_ports", lambda: (taken + 2, 65535))
        assert {free_port() for _ in range(20)} == {taken + 1}


def test_without_a_range_outside_the_ephemeral_one_the_kernel_chooses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(processes, "ephemeral_ports", lambda: (1024, 65535))
    port = free_port()
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", port))
