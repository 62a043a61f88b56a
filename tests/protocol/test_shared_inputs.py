"""A client given one array object in several groups (the drivers' shared Gram) checks and copies it
once, keeps its copy apart from the caller's array, and the session's sums are unchanged."""

from __future__ import annotations

import numpy as np

from secure_afl.core import encoding
from secure_afl.protocol.client import ClientSession

from .helpers import make_federation, play


def _share_one_array(fed) -> dict[str, np.ndarray]:
    """Rebuild every client with one array object in both groups, as the drivers pass a Gram."""
    shared = {}
    for cid, client in list(fed.clients.items()):
        array = fed.inputs[cid]["a"]["x"]
        shared[cid] = array
        if "b" in fed.inputs[cid]:
            fed.inputs[cid]["b"]["x"] = array
        fed.clients[cid] = ClientSession(
            cid,
            fed.identities[cid],
            fed.roster,
            fed.inputs[cid],
            min_threshold=fed.config.threshold,
            min_group_size=1,
            random=client._random,
            policy=client.policy,
        )
    return shared


def test_a_shared_input_is_copied_once_and_the_sums_are_those_of_the_values() -> None:
    ids = ("c0", "c1", "c2", "c3")
    fed = make_federation(4, groups={"a": ids, "b": ids[:3]}, threshold=3)
    shared = _share_one_array(fed)
    expected = {
        "a": sum(fed.inputs[cid]["a"]["x"] for cid in ids),
        "b": sum(fed.inputs[cid]["b"]["x"] for cid in ids[:3]),
    }
    for cid in ids[:3]:
        inputs = fed.clients[cid]._inputs
        assert inputs["a"]["x"] is inputs["b"]["x"]  # one copy, so its digests are computed once
        assert inputs["a"]["x"] is not shared[cid]
        assert fed.clients[cid].release.values[("a", "x")] == fed.clients[cid].release.values[("b", "x")]
    for array in shared.values():
        array += 1e6  # the caller's later write reaches none of the copies
    play(fed)
    result = fed.server.result()
    for group, total in expected.items():
        decoded = encoding.decode(result.groups[group].sums["x"])
        assert np.max(np.abs(decoded - total)) <= encoding.rounding_error_bound(32, 4)
