"""The in-process driver `secure_aggregate`: sums, dropouts, audit and costs."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from secure_afl.core import encoding
from secure_afl.core.errors import GroupTooSmallError, InsufficientParticipantsError
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.sim.audit import SINGLE_SURVIVOR_WARNING
from secure_afl.sim.secure import ROUNDS, default_threshold, secure_aggregate


def make_contributions(n: int, d: int, groups: dict[str, list[str]], seed: int = 0):
    rng = np.random.default_rng(seed)
    contributions: dict[str, dict[str, dict[str, np.ndarray]]] = {}
    grams = {}
    for i in range(n):
        cid = f"client{i}"
        h = rng.normal(size=(30, d))
        grams[cid] = h.T @ h
        contributions[cid] = {}
    for group, members in groups.items():
        for cid in members:
            contributions[cid][group] = {"gram": grams[cid], "b": rng.normal(size=d)}
    return contributions


def missing_one_groups(n: int) -> dict[str, list[str]]:
    return {f"class{j}": [f"client{i}" for i in range(n) if i != j] for j in range(n)}


def plaintext_sum(contributions, group, tensor, survivors):
    return sum(contributions[cid][group][tensor] for cid in survivors)


def test_sums_match_plaintext_within_the_rounding_bound() -> None:
    groups = missing_one_groups(4)
    contributions = make_contributions(4, 6, groups)
    result = secure_aggregate(contributions, random=DeterministicRandomSource(b"t"))
    for group, members in groups.items():
        assert result.members[group] == tuple(members) == result.survivors[group]
        bound = encoding.rounding_error_bound(32, len(members))
        for tensor in ("gram", "b"):
            expected = plaintext_sum(contributions, group, tensor, members)
            assert result.sums[group][tensor].shape == expected.shape
            assert (
                np.max(np.abs(result.sums[group][tensor] - expected))
                <= bound + 1e-12 * np.abs(expected).max()
            )
        np.testing.assert_array_equal(result.sums[group]["gram"], result.sums[group]["gram"].T)


def test_sums_equal_the_decoded_sum_of_encodings_bit_for_bit() -> None:
    groups = {"a": ["client0", "client1", "client2"], "all": [f"client{i}" for i in range(5)]}
    contributions = make_contributions(5, 4, groups)
    result = secure_aggregate(
        contributions, dropouts={"R2": ["client4"]}, random=DeterministicRandomSource(b"x")
    )
    for group in groups:
        survivors = result.survivors[group]
        words = sum(
            encoding.encode(contributions[cid][group]["b"], tensor="b", group_size=len(result.members[group]))
            for cid in survivors
        )
        np.testing.assert_array_equal(result.sums[group]["b"], encoding.decode(words))
    assert "client4" not in result.survivors["all"] and "client4" in result.members["all"]


@pytest.mark.parametrize("stage", ["R1", "R2", "R3"])
def test_dropouts_at_each_stage(stage: str) -> None:
    groups = missing_one_groups(5)
    contributions = make_contributions(5, 3, groups)
    dropped = ["client1", "client3"] if stage != "R3" else ["client1"]
    result = secure_aggregate(
        contributions, dropouts={stage: dropped}, random=DeterministicRandomSource(b"d")
    )
    for group in groups:
        # A client that drops in R3 already sent its masked input: it is in the sum.
        expected_survivors = tuple(
            cid for cid in result.members[group] if stage == "R3" or cid not in dropped
        )
        assert result.survivors[group] == expected_survivors
        expected = plaintext_sum(contributions, group, "gram", expected_survivors)
        assert np.allclose(result.sums[group]["gram"], expected, atol=1e-8)
    for cid in dropped:
        assert result.costs.bytes_sent[cid][stage] == 0


def test_single_survivor_groups_get_a_loud_warning() -> None:
    groups = {"solo": ["client0"], "all": ["client0", "client1", "client2"]}
    contributions = make_contributions(3, 3, groups)
    result = secure_aggregate(contributions, random=DeterministicRandomSource(b"w"))
    assert result.audit.group("solo").warning is not None
    assert SINGLE_SURVIVOR_WARNING in result.audit.group("solo").warning
    assert result.audit.group("all").warning is None
    assert any(SINGLE_SURVIVOR_WARNING in line for line in result.warnings)
    assert result.audit.group("solo").tensors == ("b", "gram")


def test_overlapping_groups_expose_individual_grams_and_the_audit_says_so() -> None:
    n = 4
    contributions = make_contributions(n, 3, missing_one_groups(n))
    result = secure_aggregate(contributions, random=DeterministicRandomSource(b"e"))
    # The "all but one" incidence matrix has full rank: every client's Gram follows from the sums.
    assert result.exposed["gram"] == tuple(f"client{i}" for i in range(n))
    assert "b" not in result.exposed  # b differs per class, so no combination isolates a client
    assert any("gram='global'" in line for line in result.warnings)
    # Demonstrate it: client0's Gram = (sum of all groups)/(n-1) - sum of the groups client0 is not in.
    total = sum(result.sums[f"class{j}"]["gram"] for j in range(n)) / (n - 1)
    recovered = total - result.sums["class0"]["gram"]
    assert np.allclose(recovered, contributions["client0"]["class1"]["gram"], atol=1e-6)


def test_one_global_gram_group_exposes_nobody() -> None:
    n = 4
    ids = [f"client{i}" for i in range(n)]
    groups = {**missing_one_groups(n), "global": ids}
    contributions = make_contributions(n, 3, groups)
    for cid in ids:  # gram only in the global group, b per class
        for group in list(contributions[cid]):
            if group != "global":
                del contributions[cid][group]["gram"]
        del contributions[cid]["global"]["b"]
    result = secure_aggregate(contributions, random=DeterministicRandomSource(b"g"))
    assert result.exposed == {}
    assert result.warnings == ()


def test_costs_cover_every_client_and_round() -> None:
    groups = missing_one_groups(3)
    contributions = make_contributions(3, 4, groups)
    result = secure_aggregate(contributions, random=DeterministicRandomSource(b"c"))
    costs = result.costs
    for cid in contributions:
        assert tuple(costs.bytes_sent[cid]) == ROUNDS
        assert all(costs.bytes_sent[cid][r] > 0 and costs.bytes_received[cid][r] > 0 for r in ROUNDS)
        assert all(costs.client_seconds[cid][r] >= 0 for r in ROUNDS)
    # R2 carries the masked tensors: 2 groups x (10 + 4) words of 8 bytes, plus framing.
    assert costs.bytes_sent["client0"]["R2"] > 2 * 14 * 8
    assert set(costs.server_seconds) == set(ROUNDS)
    assert costs.total_server_seconds > 0


def test_group_below_min_size_raises() -> None:
    groups = {"pair": ["client0", "client1"], "all": ["client0", "client1", "client2"]}
    contributions = make_contributions(3, 3, groups)
    with pytest.raises(GroupTooSmallError, match="pair"):
        secure_aggregate(contributions, min_group_size=3, random=DeterministicRandomSource(b"m"))
    with pytest.raises(GroupTooSmallError, match="pair"):
        secure_aggregate(
            contributions,
            min_group_size=2,
            dropouts={"R2": ["client1"]},
            random=DeterministicRandomSource(b"m"),
        )


def test_too_many_dropouts_raise() -> None:
    contributions = make_contributions(4, 3, {"all": [f"client{i}" for i in range(4)]})
    with pytest.raises(InsufficientParticipantsError):
        secure_aggregate(contributions, dropouts={"R1": ["client0", "client1"]})


def test_default_threshold_and_argument_checks() -> None:
    assert [default_threshold(n) for n in (1, 2, 3, 8)] == [1, 2, 2, 5]
    contributions = make_contributions(2, 2, {"all": ["client0", "client1"]})
    with pytest.raises(ValueError):
        secure_aggregate(contributions, threshold=3)
    with pytest.raises(ValueError, match="stage"):
        secure_aggregate(contributions, dropouts={"R9": ["client0"]})
    with pytest.raises(ValueError, match="unknown client"):
        secure_aggregate(contributions, dropouts={"R2": ["nobody"]})


def test_single_client_federation() -> None:
    contributions = make_contributions(1, 2, {"all": ["client0"]})
    result = secure_aggregate(contributions)
    assert np.allclose(result.sums["all"]["b"], contributions["client0"]["all"]["b"])
    assert result.audit.group("all").warning is not None


def test_deterministic_with_a_seeded_random_source() -> None:
    contributions = make_contributions(3, 3, missing_one_groups(3))
    first = secure_aggregate(contributions, random=DeterministicRandomSource(b"r"), session_id=b"s" * 32)
    second = secure_aggregate(contributions, random=DeterministicRandomSource(b"r"), session_id=b"s" * 32)
    assert first.costs.bytes_sent == second.costs.bytes_sent
    assert first.session_id == b"s" * 32
    for group in first.sums:
        np.testing.assert_array_equal(first.sums[group]["gram"], second.sums[group]["gram"])


def test_overflow_is_reported_with_the_tensor_name() -> None:
    contributions = make_contributions(2, 2, {"all": ["client0", "client1"]})
    contributions["client0"]["all"]["b"] = np.array([1e12, 0.0])
    with pytest.raises(encoding.EncodingOverflowError, match="all/b"):
        secure_aggregate(contributions)


def test_message_size_limit_follows_the_layout(monkeypatch) -> None:
    """A scaled-down VGG session: with a small fixed cap the masked inputs would not fit."""
    from secure_afl.protocol import codec
    from secure_afl.protocol.messages import GroupSpec, SessionConfig, TensorSpec

    limits: list[int] = []
    real_encode, real_decode = codec.encode, codec.decode

    def capped(function):
        def call(value, *, max_message_bytes: int = 4096):  # a fixed cap far below the layout
            limits.append(max_message_bytes)
            return function(value, max_message_bytes=max_message_bytes)

        return call

    monkeypatch.setattr(codec, "encode", capped(real_encode))
    monkeypatch.setattr(codec, "decode", capped(real_decode))
    groups = missing_one_groups(4)
    contributions = make_contributions(4, 24, groups)  # 4 groups x (300 + 24) words: 10 kB uploads
    # every group as named (a difference plan would send other groups; its limits: test_difference_plan)
    result = secure_aggregate(contributions, random=DeterministicRandomSource(b"cap"), difference=False)
    assert max(max(rounds.values()) for rounds in result.costs.bytes_sent.values()) > 4096
    for group, members in groups.items():
        expected = plaintext_sum(contributions, group, "gram", members)
        assert np.allclose(result.sums[group]["gram"], expected, atol=1e-8)
    layout = codec.max_message_bytes(
        SessionConfig(  # the same layout as the session's
            bytes(32),
            3,
            1,
            32,
            tuple(GroupSpec(g, (TensorSpec("b", 24), TensorSpec("gram", 300))) for g in sorted(groups)),
        ),
        4,
    )
    assert layout in limits and 4096 not in limits


def test_one_array_sent_as_symmetric_and_as_plain_tensor() -> None:
    """The packing cache must key on (array, symmetric), not on the array alone."""
    rng = np.random.default_rng(7)
    contributions = {}
    for i in range(3):
        h = rng.normal(size=(10, 4))
        gram = h.T @ h
        # The same object is the symmetric "gram" of one group and a plain (full) matrix in another.
        contributions[f"client{i}"] = {"a": {"gram": gram}, "b": {"m": gram}}
    result = secure_aggregate(contributions, random=DeterministicRandomSource(b"sym"))
    expected = sum(c["a"]["gram"] for c in contributions.values())
    assert np.allclose(result.sums["a"]["gram"], expected, atol=1e-8)
    assert result.sums["b"]["m"].shape == (4, 4)
    assert np.allclose(result.sums["b"]["m"], expected, atol=1e-8)


class _FreshArrays(Mapping):
    """Tensors made on every access, as a lazy loader would: temporaries whose ids Python may reuse."""

    def __init__(self, seeds: dict[str, int], d: int) -> None:
        self._seeds, self._d = seeds, d

    def __getitem__(self, name: str) -> np.ndarray:
        h = np.random.default_rng(self._seeds[name]).normal(size=(6, self._d))
        return h.T @ h

    def __iter__(self):
        return iter(self._seeds)

    def __len__(self) -> int:
        return len(self._seeds)


def test_packing_cache_survives_recycled_array_ids() -> None:
    d = 5
    contributions = {
        f"client{i}": {f"g{j}": _FreshArrays({"gram": 100 * i + j}, d) for j in range(4)} for i in range(3)
    }
    result = secure_aggregate(contributions, random=DeterministicRandomSource(b"ids"))
    for j in range(4):
        expected = sum(contributions[cid][f"g{j}"]["gram"] for cid in contributions)
        assert np.allclose(result.sums[f"g{j}"]["gram"], expected, atol=1e-8)


def test_masking_never_loads_tenseal_and_ckks_loads_it_on_first_use(fresh_python) -> None:
    code = (
        "import sys\n"
        "import numpy as np\n"
        "from secure_afl.core.randomness import DeterministicRandomSource\n"
        "from secure_afl.sim import runner\n"
        "from secure_afl.sim.secure import secure_aggregate\n"
        "from secure_afl.protocol.ckks.errors import NoDecryptorError  # what the runner catches\n"
        "h = {f'client{i}': np.eye(3) * (i + 1) for i in range(3)}\n"
        "result = secure_aggregate({c: {'all': {'gram': g}} for c, g in h.items()},\n"
        "                          random=DeterministicRandomSource(b't'))\n"
        "assert np.allclose(result.sums['all']['gram'], np.eye(3) * 6)\n"
        "assert 'tenseal' not in sys.modules, 'a masking run loaded TenSEAL'\n"
        "from secure_afl.aggregation.backend import CkksBackend\n"
        "assert 'tenseal' not in sys.modules\n"
        "assert CkksBackend().parameters.poly_modulus_degree == 8192\n"
        "assert 'tenseal' in sys.modules\n"
        "from secure_afl.protocol.ckks import CkksServerSession, codec\n"
        "import secure_afl.protocol.ckks as ckks\n"
        "assert codec is ckks.codec and CkksServerSession is ckks.server.CkksServerSession\n"
        "try:\n"
        "    ckks.no_such_name\n"
        "except AttributeError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('an unknown name resolved')\n"
    )
    fresh_python(code)
