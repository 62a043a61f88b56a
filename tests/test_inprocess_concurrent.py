"""The in-process driver runs masking's R2 clients on several threads (issue 30): the same
messages, in the same order, the same sums and the same errors as one client at a time."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import pytest

from secure_afl.aggregation.backend import CkksBackend, MaskingBackend
from secure_afl.aggregation.inprocess import run_in_process
from secure_afl.analytic import ClientStatistics
from secure_afl.core.errors import ProtocolError
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.privacy.ledger import MemoryLedger
from secure_afl.privacy.policy import ClientPolicy


def _contributions(n: int, *, d: int = 40, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for k in range(n):
        h = rng.exponential(size=(30, d))
        y = (rng.random((30, 4)) < 0.4).astype(np.float64)
        y[0], y[1] = 1.0, 0.0
        stats = ClientStatistics(
            gram=h.T @ h, feat_sum=h.sum(0), pos_sum=h.T @ y, n=30, n_pos=y.sum(0).astype(np.int64)
        )
        out[f"site-{k:02d}"] = stats.contributions(sorted({k % 4, (k + 1) % 4}), include_global_gram=True)
    return out


@dataclass(frozen=True)
class RecordingBackend(MaskingBackend):
    """Masking that records every client message the server decodes, and the thread that ran
    each client's R2."""

    received: list = field(default_factory=list)
    r2_threads: set = field(default_factory=set)
    r2_hook: object = None  # (client id, session) -> None, called before each client's R2

    def decode(self, data: bytes, max_message_bytes: int) -> object:
        self.received.append(bytes(data))
        return super().decode(data, max_message_bytes)

    def client_session(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        session = super().client_session(*args, **kwargs)
        threads = self.r2_threads
        original = session.receive_bytes
        backend = self

        def receive_bytes(data: bytes) -> list[bytes]:
            if session.state.name == "AWAIT_MASKED_INPUT_REQUEST":
                threads.add(threading.current_thread().name)
                if backend.r2_hook is not None:
                    backend.r2_hook(session.client_id, session)  # type: ignore[operator]
            return original(data)

        session.receive_bytes = receive_bytes  # type: ignore[method-assign]
        return session


def _run(workers: int, *, dropouts=None, policy=None, n: int = 9):
    backend = RecordingBackend(threshold=6, client_policy=policy or ClientPolicy.simulator())
    run = run_in_process(
        backend,
        _contributions(n),
        min_group_size=2,
        dropouts=dropouts or {},
        random=DeterministicRandomSource(b"concurrent"),
        session_id=bytes(32),
        workers=workers,
    )
    return backend, run


@pytest.mark.parametrize("dropouts", [{}, {"R2": ["site-04"], "R3": ["site-07"]}])
def test_concurrent_r2_gives_the_same_messages_in_the_same_order_and_the_same_sums(dropouts) -> None:
    serial_backend, serial = _run(1, dropouts=dropouts)
    backend, run = _run(4, dropouts=dropouts)
    assert backend.received == serial_backend.received  # every client message, byte for byte, in order
    for group, tensors in serial.outcome.sums.items():
        for name, values in tensors.items():
            assert np.array_equal(run.outcome.sums[group][name], values)
    assert run.outcome.survivors == serial.outcome.survivors
    assert run.costs.bytes_sent == serial.costs.bytes_sent
    assert run.costs.bytes_received == serial.costs.bytes_received
    # R2 really ran on the pool's threads, and each client's CPU seconds are counted
    assert len(backend.r2_threads) > 1 and all(t.startswith("in-process-client") for t in backend.r2_threads)
    assert serial_backend.r2_threads == {threading.main_thread().name}
    assert all(rounds["R2"] > 0 for cid, rounds in run.costs.client_seconds.items() if cid != "site-04")


def test_the_first_failing_client_in_order_raises_even_when_a_later_one_fails_first() -> None:
    """site-05's R2 fails at once; site-03's only once site-05's has (on a pool thread): the run
    raises site-03's error, as a run one client at a time does, and the clients after it that
    were not yet running never start."""
    errors = []
    for workers in (1, 4):
        later_failed = threading.Event()
        backend = RecordingBackend(threshold=6, client_policy=ClientPolicy.simulator())
        started: list[str] = []

        def fail(cid: str, session, started=started, later_failed=later_failed) -> None:  # type: ignore[no-untyped-def]
            started.append(cid)
            if cid == "site-05":
                later_failed.set()
                raise ProtocolError("site-05 fails")
            if cid == "site-03":
                if threading.current_thread() is not threading.main_thread():
                    assert later_failed.wait(timeout=30)
                raise ProtocolError("site-03 fails")

        object.__setattr__(backend, "r2_hook", fail)
        with pytest.raises(ProtocolError) as caught:
            run_in_process(
                backend,
                _contributions(20),
                min_group_size=2,
                random=DeterministicRandomSource(b"concurrent"),
                session_id=bytes(32),
                workers=workers,
            )
        errors.append(str(caught.value))
        assert "site-19" not in started  # beyond the window of 2 x workers: never started
    assert errors == ["site-03 fails", "site-03 fails"]


def test_which_rounds_run_concurrently() -> None:
    assert MaskingBackend(threshold=3).concurrent_rounds == ("R2",)
    ledger = MemoryLedger()
    own = MaskingBackend(threshold=3, ledgers={"a": ledger, "b": MemoryLedger()})
    assert own.concurrent_rounds == ("R2",)
    shared = MaskingBackend(threshold=3, ledgers={"a": ledger, "b": ledger})
    assert shared.concurrent_rounds == ()  # two clients, one ledger object: one client at a time
    assert CkksBackend().concurrent_rounds == ()
    with pytest.raises(ValueError, match="workers must be at least 1"):
        run_in_process(MaskingBackend(threshold=3), _contributions(4), workers=0)
