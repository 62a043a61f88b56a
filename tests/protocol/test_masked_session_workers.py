"""A masked session whose clients and server split their large masks among threads gives the sums
and the messages of one thread, bit for bit, with and without dropouts."""

from __future__ import annotations

import numpy as np
import pytest

from secure_afl.aggregation.backend import MaskingBackend
from secure_afl.aggregation.inprocess import run_in_process
from secure_afl.aggregation.layout import flatten, layout_of
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.core.workers import ONE_THREAD
from secure_afl.keys.identity import IdentityKey
from secure_afl.keys.roster import Roster, RosterEntry
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.protocol import prg
from secure_afl.protocol.codec import encode

from .helpers import CountingThreads


def _contributions(d: int = 40) -> dict:
    rng = np.random.default_rng(7)
    out = {}
    for k in range(5):
        h = rng.normal(size=(12, d))
        gram = h.T @ h
        out[f"site-{k}"] = {
            "all": {"gram": gram, "feat_sum": h.sum(0)},
            f"class/{k % 2}": {"gram": gram, "b": h[:, 0] @ h},
        }
    return out


def _run(workers, dropouts):  # type: ignore[no-untyped-def]
    backend = MaskingBackend(threshold=3, client_policy=ClientPolicy.simulator(), workers=workers)
    return run_in_process(
        backend,
        _contributions(),
        min_group_size=2,
        dropouts=dropouts,
        random=DeterministicRandomSource(b"workers"),
        session_id=b"s" * 32,
        difference=False,
    )


@pytest.mark.parametrize("dropouts", [{}, {"R2": ["site-4"]}, {"R3": ["site-2"]}])
def test_split_masks_give_one_threads_sums_and_messages(monkeypatch: pytest.MonkeyPatch, dropouts) -> None:
    monkeypatch.setattr(prg, "CHUNK_WORDS", 64)
    monkeypatch.setattr(prg, "PARALLEL_MIN_WORDS", 256)  # a Gram triangle at d = 40 is 820 words
    alone = _run(ONE_THREAD, dropouts)
    workers = CountingThreads(2)
    split = _run(workers, dropouts)
    # The five client sessions started on the workers, then every large mask and sum in 2 runs.
    assert workers.splits[0] == 5 and set(workers.splits[1:]) == {2}  # type: ignore[attr-defined]
    assert split.outcome.sums.keys() == alone.outcome.sums.keys()
    for group, tensors in alone.outcome.sums.items():
        for name, value in tensors.items():
            assert np.array_equal(split.outcome.sums[group][name], value), (group, name)
    assert split.costs.bytes_sent == alone.costs.bytes_sent
    expected = sum(
        c["all"]["gram"] for cid, c in _contributions().items() if cid not in dropouts.get("R2", [])
    )
    np.testing.assert_allclose(split.outcome.sums["all"]["gram"], expected, atol=1e-6)


def test_the_backend_masks_on_this_processs_threads_by_default() -> None:
    backend = MaskingBackend(threshold=3)
    assert 1 <= backend.workers.count <= 2


class NoDraws:
    """A random source that refuses every draw."""

    def token_bytes(self, n: int) -> bytes:
        raise AssertionError(f"a draw of {n} bytes")


def test_a_client_session_draws_nothing_at_random_until_r0() -> None:
    # The in-process driver starts the sessions on several threads from one random source: were a
    # session to draw as it starts, a seeded run's draws would come in the threads' order.
    contributions = _contributions()
    seeded = DeterministicRandomSource(b"keys")
    identities = {cid: IdentityKey.generate(seeded) for cid in contributions}
    roster = Roster(RosterEntry(cid, cid, key.public_key) for cid, key in identities.items())
    backend = MaskingBackend(threshold=3, client_policy=ClientPolicy.simulator())
    session = backend.client_session(
        "site-0",
        identities["site-0"],
        roster,
        {g: {n: flatten(v, n == "gram") for n, v in t.items()} for g, t in contributions["site-0"].items()},
        session_id=b"s" * 32,
        min_group_size=2,
        random=NoDraws(),
    )
    server = backend.server_session(roster, layout_of(contributions), session_id=b"s" * 32, min_group_size=2)
    with pytest.raises(AssertionError, match="a draw of"):  # R0 is where it first draws
        session.receive_bytes(encode(server.start(), max_message_bytes=server.max_message_bytes))
