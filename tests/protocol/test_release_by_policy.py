"""The release (each value's SHA-256 id and its parts) is made when a session starts only under a
policy with the one-contribution rule, which reads it; without the rule (the simulator's policy) it
is made on request while the session holds its inputs.  The exposure check's own values are
labelled by equality either way (nothing hashed for them)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from secure_afl.core.encoding import decode
from secure_afl.core.errors import LocalProtocolError
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.privacy.release import Release
from secure_afl.protocol.state import ClientState

from .helpers import make_federation, play, play_round


def test_without_the_rule_no_release_is_made_until_asked_and_it_is_the_inputs_release() -> None:
    fed = make_federation(3, groups={"a": ("c0", "c1", "c2"), "b": ("c0", "c1")})
    client = fed.clients["c0"]
    assert not client.policy.one_contribution
    assert client._gate.release is None  # no value hashed when the session started
    asked = client.release
    assert asked == Release.of(fed.inputs["c0"])
    assert set(asked.values) == {("a", "x"), ("a", "y"), ("b", "x"), ("b", "y")}
    play(fed)
    result = fed.server.result()
    expected = sum(fed.inputs[cid]["a"]["x"] for cid in ("c0", "c1", "c2"))
    assert np.allclose(decode(result.groups["a"].sums["x"], frac_bits=32), expected, atol=1e-6)


def test_without_the_rule_the_release_cannot_be_made_once_the_inputs_are_gone() -> None:
    fed = make_federation(3)
    for round_name in ("R0", "R1", "R2"):
        play_round(fed, round_name)
    client = fed.clients["c0"]
    assert client.state is ClientState.AWAIT_CONSISTENCY_REQUEST
    with pytest.raises(LocalProtocolError, match=r"no release.*read the release before R2"):
        _ = client.release


def test_under_the_rule_the_release_is_made_when_the_session_starts() -> None:
    fed = make_federation(3, policy=replace(ClientPolicy.deployment(), refuse_exposure=False))
    client = fed.clients["c0"]
    assert client.policy.one_contribution
    made = client._gate.release
    assert made is not None and made == Release.of(fed.inputs["c0"])
    assert client.release is made
