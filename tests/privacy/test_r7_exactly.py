"""R7 (one contribution per value) refuses exactly what SECURITY.md says, and passes what §10.11 lists.

Every case runs through a client's ExposureGate and ledger, as a deployed client's session does: a
first session releases values (R0, then the release point), and a second session's R0 refuses or
passes.  A change that starts refusing a kind listed as passing must move it in SECURITY.md too.
"""

from __future__ import annotations

import numpy as np
import pytest

from secure_afl.core.errors import ValueAlreadyReleasedError
from secure_afl.keys.identity import IdentityKey
from secure_afl.privacy.ledger import LedgerOwner, MemoryLedger
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.privacy.release import ANCHOR_WORDS, Release
from secure_afl.protocol.exposure_gate import ExposureGate

FIRST, SECOND = b"\x01" * 32, b"\x02" * 32
OWNER = LedgerOwner("a", IdentityKey.generate())
RNG = np.random.default_rng(7)
X = RNG.normal(size=12)  # the released value (12 words: 4-word anchors at both ends, 4 interior words)
Y = RNG.normal(size=12)  # a second released value
Z = RNG.normal(size=5)  # words never released

BY_CONTENT = "already released in session"
BY_ANCHOR = "start or end like a value"
WITHIN = "would be sent beside the values they are parts of"


def _gate(ledger, inputs, release: Release | None = None) -> ExposureGate:
    return ExposureGate(OWNER.client_id, OWNER.identity, inputs, ClientPolicy.deployment(), ledger, release)


def _release(ledger, inputs, session_id: bytes, release: Release | None = None) -> None:
    """R0 then the release point, as a session that completes."""
    gate = _gate(ledger, inputs, release)
    gate.start(session_id)
    groups = {g: (("a", "b", "c"), tuple(tensors)) for g, tensors in inputs.items()}
    gate.check("R3", "sign", groups, session_id=session_id, colluders=0, release_survivors=("a", "b", "c"))


def _ledger_with(*values: np.ndarray) -> MemoryLedger:
    ledger = MemoryLedger()
    _release(ledger, {"g": {f"v{k}": v for k, v in enumerate(values)}}, FIRST)
    return ledger


def test_the_anchor_length_is_what_the_document_says() -> None:
    assert ANCHOR_WORDS == 4  # SECURITY.md R7 and §10.11 say 4 words


# --- refused across sessions ---------------------------------------------------------------------


def test_equal_content_under_another_name_group_and_input_dtype_is_refused_by_its_id() -> None:
    x32 = RNG.normal(size=12).astype(np.float32)
    ledger = _ledger_with(x32.astype(np.float64))
    with pytest.raises(ValueAlreadyReleasedError, match=BY_CONTENT) as caught:
        _gate(ledger, {"other": {"renamed": x32}}).start(SECOND)
    assert caught.value.values == ("other/renamed",) and caught.value.session_id == FIRST


def test_the_same_value_with_fresh_dp_noise_is_refused_since_the_release_is_made_before_noise() -> None:
    ledger = _ledger_with(X)
    noisy = {"g": {"v0": X + RNG.normal(size=12)}}
    with pytest.raises(ValueAlreadyReleasedError, match=BY_CONTENT):
        _gate(ledger, noisy, Release.of({"g": {"v0": X}})).start(SECOND)


STARTS_LIKE_X = {
    "prefix of 4 words": X[:4],
    "prefix of 7 words": X[:7],
    "X extended": np.concatenate([X, Z]),
    "another value with X's first 4 words": np.concatenate([X[:4], Z]),
    "X with interior words swapped": X[[0, 1, 2, 3, 5, 4, 6, 7, 8, 9, 10, 11]],
    "X reshaped": X.reshape(3, 4),
}
ENDS_LIKE_X = {
    "suffix of 4 words": X[-4:],
    "suffix of 9 words": X[3:],
    "X after other words": np.concatenate([Z, X]),
    "another value with X's last 4 words": np.concatenate([Z, X[-4:]]),
}
SHARES_AN_ANCHOR = {**STARTS_LIKE_X, **ENDS_LIKE_X}


@pytest.mark.parametrize("value", list(SHARES_AN_ANCHOR.values()), ids=list(SHARES_AN_ANCHOR))
def test_sharing_the_first_or_last_4_words_is_refused(value) -> None:
    ledger = _ledger_with(X)
    with pytest.raises(ValueAlreadyReleasedError, match=BY_ANCHOR) as caught:
        _gate(ledger, {"h": {"w": value}}).start(SECOND)
    assert caught.value.values == ("h/w",)


def test_the_release_point_refuses_what_another_session_released_after_r0() -> None:
    ledger = MemoryLedger()
    late = _gate(ledger, {"h": {"w": X[:6]}})
    late.start(SECOND)  # nothing released yet
    _release(ledger, {"g": {"v0": X}}, FIRST)
    with pytest.raises(ValueAlreadyReleasedError, match=BY_ANCHOR):
        late.check("R3", "sign", {"h": (("a", "b", "c"), ("w",))}, session_id=SECOND, colluders=0,
                   release_survivors=("a", "b", "c"))  # fmt: skip


# --- refused within one session ------------------------------------------------------------------

WINDOWS = {"first 2 words": (0, 2), "interior 2 words": (5, 7), "interior 6 words": (3, 9), "last 3": (9, 12)}


@pytest.mark.parametrize("same_group", [True, False], ids=["same group", "another group"])
@pytest.mark.parametrize("window", list(WINDOWS.values()), ids=list(WINDOWS))
def test_a_part_of_2_words_or_more_within_one_session_is_refused(window, same_group) -> None:
    start, stop = window
    part = X[start:stop].copy()
    inputs = {"A": {"gram": X, "part": part}} if same_group else {"A": {"gram": X}, "B": {"part": part}}
    with pytest.raises(ValueAlreadyReleasedError, match=WITHIN) as caught:
        _gate(MemoryLedger(), inputs).start(FIRST)
    group = "A" if same_group else "B"
    assert caught.value.values == (f"{group}/part (a part of A/gram)",)


# --- what passes (SECURITY.md §10.11) --------------------------------------------------------------

PASSES_ACROSS = {
    "negated": -X,
    "scaled by 2": 2 * X,
    "scaled by 0.5": 0.5 * X,
    "reversed": X[::-1].copy(),
    "rotated by one word": np.roll(X, 1),
    "interior window of 10 words": X[1:-1],
    "interior window of 4 words": X[4:8],
    "3-word prefix": X[:3],
    "3-word suffix": X[-3:],
    "1 word": X[5:6],
    "X in the interior of another value": np.concatenate([Z, X, Z]),
    "a window across X's start": np.concatenate([Z, X[:6]]),
    "a window across X's end, starting with its last 4 words": np.concatenate([X[8:], Z]),
    "sum of two released values": X + Y,
    "difference of two released values": X - Y,
    "X re-rounded through float32": X.astype(np.float32).astype(np.float64),
    "X perturbed before the release is made": X + 1e-9 * RNG.normal(size=12),
}


@pytest.mark.parametrize("value", list(PASSES_ACROSS.values()), ids=list(PASSES_ACROSS))
def test_across_sessions_these_pass(value) -> None:
    ledger = _ledger_with(X, Y)
    _release(ledger, {"h": {"w": value}}, SECOND)  # R0 and the release point both pass
    assert ledger.load(OWNER).entry(SECOND).survivors == ("a", "b", "c")


def test_constants_and_parts_at_a_constant_end_pass() -> None:
    padded = np.concatenate([np.zeros(4), X[:4], np.zeros(4)])  # all-equal first and last 4 words
    ledger = _ledger_with(np.zeros(12), np.full(12, 3.0), np.array([7.0]), padded)
    again = {"zeros": np.zeros(12), "threes": np.full(12, 3.0), "count": np.array([7.0])}
    _release(ledger, {"h": {**again, "head": padded[:8].copy(), "tail": padded[2:].copy()}}, SECOND)
    assert ledger.load(OWNER).entry(SECOND).survivors == ("a", "b", "c")


PASSES_WITHIN = {
    "a 1-word part": {"A": {"gram": X}, "B": {"part": X[5:6].copy()}},
    "a part under the same tensor name in another group": {"A": {"gram": X}, "B": {"gram": X[:6].copy()}},
    "a negated copy": {"A": {"gram": X}, "B": {"neg": -X}},
    "a scaled part": {"A": {"gram": X}, "B": {"part": 2 * X[3:9]}},
    "a reversed part": {"A": {"gram": X}, "B": {"part": X[8:2:-1].copy()}},
    "a sum of two inputs": {"A": {"x": X, "y": Y}, "B": {"sum": X + Y}},
}


@pytest.mark.parametrize("inputs", list(PASSES_WITHIN.values()), ids=list(PASSES_WITHIN))
def test_within_one_session_these_pass(inputs) -> None:
    _gate(MemoryLedger(), inputs).start(FIRST)
    assert Release.of(inputs).parts == ()
