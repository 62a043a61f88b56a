"""The server's ``may_be_empty`` groups (a difference plan's complements): one that loses every
member is summed as zero and the session finishes; one left with 1..min-1 live members, and any
other group left empty, still abort before anything is unmasked."""

from __future__ import annotations

import numpy as np
import pytest

from secure_afl.core import encoding
from secure_afl.core.errors import GroupTooSmallError, LocalProtocolError
from secure_afl.protocol.server import ServerSession

from .helpers import make_federation, play

GROUPS = {
    "big": ("c0", "c1", "c2", "c3", "c4", "c5"),
    "pair": ("c0", "c1"),
    "other": ("c2", "c3"),
}


def _federation(may_be_empty: tuple[str, ...]):
    fed = make_federation(6, GROUPS, threshold=3, min_group_size=2)
    fed.server = ServerSession(fed.roster, fed.config, may_be_empty=may_be_empty)
    return fed


@pytest.mark.parametrize("stage", ["R1", "R2"])
def test_a_may_be_empty_group_that_loses_every_member_sums_to_zero(stage) -> None:
    fed = _federation(("pair",))
    play(fed, drops={stage: {"c0", "c1"}})
    result = fed.server.result()
    assert result.groups["pair"].survivors == ()
    for tensor, words in result.groups["pair"].sums.items():
        assert not words.any(), tensor
    live = ("c2", "c3", "c4", "c5")
    assert result.groups["big"].survivors == live
    for tensor, words in result.groups["big"].sums.items():
        expected = sum(
            encoding.encode(fed.inputs[cid]["big"][tensor], tensor=tensor, frac_bits=32, group_size=6)
            for cid in live
        )
        assert np.array_equal(words, expected), tensor


def test_a_may_be_empty_group_with_one_live_member_aborts() -> None:
    fed = _federation(("pair",))
    with pytest.raises(GroupTooSmallError, match="'pair' has 1 live member"):
        play(fed, drops={"R2": {"c0"}})


def test_any_other_group_left_empty_aborts() -> None:
    fed = _federation(("pair",))
    with pytest.raises(GroupTooSmallError, match="'other' has 0 live member"):
        play(fed, drops={"R1": {"c2", "c3"}})
    fed = _federation(())
    with pytest.raises(GroupTooSmallError, match="'pair' has 0 live member"):
        play(fed, drops={"R1": {"c0", "c1"}})


def test_may_be_empty_names_only_the_sessions_groups() -> None:
    fed = make_federation(6, GROUPS, threshold=3, min_group_size=2)
    with pytest.raises(LocalProtocolError, match="others/class/9"):
        ServerSession(fed.roster, fed.config, may_be_empty=("others/class/9",))
