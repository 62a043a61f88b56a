"""End-to-end properties of the masking protocol: exactness, dropouts, the server's view."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secure_afl.core import encoding
from secure_afl.core.errors import GroupTooSmallError, InsufficientParticipantsError
from secure_afl.protocol import shamir
from secure_afl.protocol.messages import MaskedInput, UnmaskResponse
from secure_afl.protocol.state import ClientState, ServerRound

from .helpers import make_federation, play, play_round


def expected_words(fed, group: str, tensor: str, survivors) -> np.ndarray:
    """The exact mod-2^64 sum of the survivors' fixed-point encodings."""
    size = len(fed.members[group])
    total = None
    for cid in survivors:
        words = encoding.encode(fed.inputs[cid][group][tensor], tensor=tensor, group_size=size)
        total = words.copy() if total is None else total + words
    return total


@st.composite
def scenarios(draw):
    n = draw(st.integers(min_value=2, max_value=8))
    ids = [f"c{i}" for i in range(n)]
    n_groups = draw(st.integers(min_value=1, max_value=4))
    groups = {}
    for g in range(n_groups):
        size = draw(st.integers(min_value=1, max_value=n))
        groups[f"g{g}"] = tuple(sorted(draw(st.permutations(ids))[:size]))
    threshold = draw(st.integers(min_value=n // 2 + 1, max_value=n))
    budget = n - threshold
    order = draw(st.permutations(ids))
    drops = {}
    position = 0
    for stage in ("R1", "R2", "R3"):
        k = draw(st.integers(min_value=0, max_value=budget))
        drops[stage] = set(order[position : position + k])
        position += k
        budget -= k
    seed = draw(st.binary(min_size=1, max_size=8))
    return n, groups, threshold, drops, seed


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_unmasked_sum_equals_sum_of_encodings_bit_for_bit(scenario) -> None:
    n, groups, threshold, drops, seed = scenario
    fed = make_federation(n, groups, threshold=threshold, min_group_size=1, seed=seed)
    dropped_early = drops["R1"] | drops["R2"]
    # A group whose members all dropped before R3 cannot be summed: the server must refuse it.
    empty = [g for g, m in groups.items() if not set(m) - dropped_early]
    if empty:
        with pytest.raises(GroupTooSmallError):
            play(fed, drops=drops)
        return
    play(fed, drops=drops)
    result = fed.server.result()
    survivors = set(fed.clients) - dropped_early
    assert set(result.survivors) == survivors
    for group, members in groups.items():
        group_sum = result.groups[group]
        live = [cid for cid in members if cid in survivors]
        assert group_sum.survivors == tuple(sorted(live))
        for tensor in ("x", "y"):
            np.testing.assert_array_equal(group_sum.sums[tensor], expected_words(fed, group, tensor, live))


def test_float_sums_within_documented_rounding_bound() -> None:
    fed = make_federation(5, {"a": ("c0", "c1", "c2", "c3", "c4")})
    play(fed)
    words = fed.server.result().groups["a"].sums["x"]
    exact = sum(fed.inputs[cid]["a"]["x"] for cid in fed.clients)
    bound = encoding.rounding_error_bound(32, 5)
    assert np.max(np.abs(encoding.decode(words) - exact)) <= bound + 1e-12 * np.max(np.abs(exact))


def test_all_clients_end_done_and_forget_secrets() -> None:
    fed = make_federation(3)
    play(fed)
    assert fed.server.round is ServerRound.DONE
    for client in fed.clients.values():
        assert client.state is ClientState.DONE
        assert client._seed == b"" and client._mask_key is None and client._held == {}


def _chi_square_bytes(data: bytes) -> float:
    counts = np.bincount(np.frombuffer(data, dtype=np.uint8), minlength=256)
    expected = len(data) / 256
    return float(np.sum((counts - expected) ** 2 / expected))


def test_one_masked_upload_is_statistically_uniform() -> None:
    # All-zero inputs: without the masks the upload would be all zero bytes.
    fed = make_federation(3, lengths={"x": 8192}, values="zeros")
    play(fed, until="R2")
    uploads = [
        m for direction, r, cid, m in fed.log if direction == "to-server" and isinstance(m, MaskedInput)
    ]
    data = uploads[0].tensors[0].data
    # 255 degrees of freedom: mean 255, sd ~22.6; 400 is > 6 sd, so an honest mask fails ~never.
    assert _chi_square_bytes(data) < 400
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))
    assert abs(bits.mean() - 0.5) < 0.01
    # The same statistic flags the unmasked encoding at once.
    assert _chi_square_bytes(bytes(len(data))) > 1e5


def test_each_client_upload_differs_from_its_encoding() -> None:
    fed = make_federation(3, lengths={"x": 64})
    play(fed, until="R2")
    for direction, _, cid, message in fed.log:
        if direction == "to-server" and isinstance(message, MaskedInput):
            for item in message.tensors:
                raw = encoding.encode(fed.inputs[cid][item.group][item.tensor], tensor="x", group_size=3)
                masked = np.frombuffer(item.data, dtype="<u8")
                assert not np.any(masked == raw)


def test_server_cannot_unmask_with_fewer_than_t_shares() -> None:
    fed = make_federation(5, threshold=3)
    play(fed, until="R3")
    # Only t-1 = 2 clients answer the unmask request.
    unmask_requests = dict(fed.requests)
    responses = []
    for cid in sorted(unmask_requests)[:2]:
        (reply,) = fed.clients[cid].receive(unmask_requests[cid])
        fed.server.receive(reply)
        responses.append((cid, reply))
    with pytest.raises(InsufficientParticipantsError):
        fed.server.next_round()
    assert fed.server.round is ServerRound.UNMASK  # unchanged
    # Interpolating t-1 shares of a survivor's self-mask seed does not give the seed.
    owner = "c4"
    true_seed = int.from_bytes(fed.clients[owner]._seed, "big")
    shares = [
        shamir.Share(
            fed.roster.share_point(cid),
            shamir.value_from_bytes(next(s.value for s in reply.self_mask_shares if s.owner == owner)),
        )
        for cid, reply in responses
    ]
    assert isinstance(responses[0][1], UnmaskResponse)
    assert shamir.reconstruct(shares) != true_seed


def test_session_recovers_when_a_client_drops_during_unmask() -> None:
    fed = make_federation(5, threshold=3)
    play(fed, until="R3")
    for cid in sorted(fed.requests)[:3]:  # two of five stay silent in R4
        (reply,) = fed.clients[cid].receive(fed.requests[cid])
        fed.server.receive(reply)
    fed.server.next_round()
    words = fed.server.result().groups["all"].sums["y"]
    np.testing.assert_array_equal(words, expected_words(fed, "all", "y", sorted(fed.clients)))


def test_server_round_progression() -> None:
    fed = make_federation(3)
    assert fed.server.round is ServerRound.NOT_STARTED
    for name, expected in zip(
        ("R0", "R1", "R2", "R3", "R4"),
        (
            ServerRound.SHARE_KEYS,
            ServerRound.MASKED_INPUT,
            ServerRound.CONSISTENCY,
            ServerRound.UNMASK,
            ServerRound.DONE,
        ),
        strict=True,
    ):
        play_round(fed, name)
        assert fed.server.round is expected
