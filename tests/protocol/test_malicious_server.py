"""A standing malicious-server suite: scripted hostile servers against ``ClientSession``'s public API.

Each attack is run twice where that shows the test has teeth: under the simulator's policy (the
clients go on and the server recovers a client's encoded input bit for bit) and under the
deployment defaults (the clients refuse, with a specific error, in a given round, and nothing
secret leaves them).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secure_afl.core import encoding
from secure_afl.core.errors import (
    BothSharesRequestedError,
    ClientProtocolError,
    ColluderExposureRefusedError,
    DifferentSessionViewError,
    DuplicateParticipantError,
    ExposureRefusedError,
    GroupBelowMinimumError,
    InconsistentSurvivorsError,
    InvalidSessionConfigError,
    LocalProtocolError,
    MessageDecodeError,
    OutOfOrderMessageError,
    RelayedSignatureError,
    RemoteProtocolError,
    ReplayedMessageError,
    ServerProtocolError,
    ShareAuthenticationError,
    SurvivorsBelowThresholdError,
    UnknownParticipantError,
    ValueAlreadyReleasedError,
)
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.keys.identity import IdentityKey
from secure_afl.privacy.ledger import MemoryLedger
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.protocol import binding, codec, crypto, prg, shamir
from secure_afl.protocol.messages import (
    AdvertiseRequest,
    ConsistencyCheckRequest,
    GroupSpec,
    MaskedInput,
    SurvivorSignature,
    TensorSpec,
    UnmaskRequest,
)
from secure_afl.protocol.server import ServerSession
from secure_afl.protocol.state import ClientState

from .hostile import Refusal, Wire, clients_for, config_for, federation, run

DEPLOYMENT = ClientPolicy.deployment()
SIMULATOR = ClientPolicy.simulator()
# The deployment policy without the colluder assumption: the checks that came before it, in isolation.
NO_COLLUDERS = dataclasses.replace(DEPLOYMENT, assume_colluders=False)


def encoded(fed, cid: str, tensor: str = "gram") -> np.ndarray:
    group = next(iter(fed.inputs[cid]))
    return encoding.encode(fed.inputs[cid][group][tensor], tensor=tensor, group_size=1)


# --- attack 1: overlapping groups plus an invented dropout ----------------------------------------

OVERLAP = {"A": ("c0", "c1", "c2", "c3"), "B": ("c1", "c2", "c3", "c4")}


def _overlap_attack(policy: ClientPolicy, threshold: int):
    fed = federation(5, OVERLAP)
    server = ServerSession(
        fed.roster, config_for(fed, threshold=threshold, min_group_size=2, session_id=b"1" * 32)
    )
    wire = Wire(clients_for(fed, policy=policy))
    run(server, wire, discard_masked_input_of={"c4"})  # the server declares c4 dropped after R2
    return fed, server, wire


def test_overlapping_groups_recover_an_input_when_clients_do_not_check() -> None:
    fed, server, wire = _overlap_attack(SIMULATOR, threshold=3)
    sums = server.result().groups
    assert sums["B"].survivors == ("c1", "c2", "c3")
    np.testing.assert_array_equal(sums["A"].sums["gram"] - sums["B"].sums["gram"], encoded(fed, "c0"))
    # The simulator's clients saw it and say so: c0 that it is exposed, c1..c3 that c0 is.
    for cid in ("c0", "c1", "c2", "c3"):
        (finding, *_) = wire.clients[cid].exposure_findings
        assert finding.clients == ("c0",) and finding.round == "R3" and finding.groups == ("A",)


def test_overlapping_groups_are_refused_in_r1_when_one_colluder_is_assumed() -> None:
    """n = 5, t = 4: c = 1 colluder.  Knowing c4's value, A - B gives c0's; knowing c0's, c4's."""
    _fed, server, wire = _overlap_attack(DEPLOYMENT, threshold=4)  # floor(2*5/3) + 1 = 4
    assert set(wire.refusals) == {"c0", "c4"}
    for cid, other in (("c0", "c4"), ("c4", "c0")):
        refusal = wire.refusals[cid]
        assert refusal.round == "R1" and type(refusal.error) is ColluderExposureRefusedError
        assert refusal.error.colluders == (other,) and f"for {cid}" in str(refusal.error)
        wire.assert_nothing_leaked(cid)
    with pytest.raises(LocalProtocolError, match="no result"):
        server.result()


def test_overlapping_groups_attack_is_refused_in_r3_without_colluders() -> None:
    _fed, server, wire = _overlap_attack(NO_COLLUDERS, threshold=4)  # floor(2*5/3) + 1 = 4
    assert set(wire.refusals) == {"c0", "c1", "c2", "c3"}
    for cid, refusal in wire.refusals.items():
        assert refusal.round == "R3"
        assert type(refusal.error) is ExposureRefusedError
        assert refusal.error.groups == ("A",) and "'gram' for c0" in str(refusal.error)
        wire.assert_nothing_leaked(cid)
    with pytest.raises(LocalProtocolError, match="no result"):  # no signature ever arrived
        server.result()


# --- attack 2: two sessions over the same inputs --------------------------------------------------


def _two_sessions(policy: ClientPolicy, ledgers):
    fed = federation(5)
    threshold = policy.min_threshold(5)
    first = ServerSession(
        fed.roster, config_for(fed, threshold=threshold, min_group_size=2, session_id=b"1" * 32)
    )
    run(first, Wire(clients_for(fed, policy=policy, ledgers=ledgers, seed=b"s1")))
    second = ServerSession(
        fed.roster, config_for(fed, threshold=threshold, min_group_size=2, session_id=b"2" * 32)
    )
    wire = Wire(clients_for(fed, policy=policy, ledgers=ledgers, ids=fed.ids[1:], seed=b"s2"))
    run(second, wire, absent={"c0"})
    return fed, first, second, wire


def test_two_sessions_recover_an_input_without_a_ledger_check() -> None:
    fed, first, second, _ = _two_sessions(SIMULATOR, ledgers=None)
    difference = first.result().groups["all"].sums["gram"] - second.result().groups["all"].sums["gram"]
    np.testing.assert_array_equal(difference, encoded(fed, "c0"))


def test_second_session_without_the_victim_is_refused_by_its_peers() -> None:
    ledgers = {f"c{i}": MemoryLedger() for i in range(5)}
    fed, first, _second, wire = _two_sessions(DEPLOYMENT, ledgers)
    assert first.result().groups["all"].survivors == fed.ids  # the first session was honest
    assert set(wire.refusals) == {"c1", "c2", "c3", "c4"}
    for cid, refusal in wire.refusals.items():
        # One contribution per value: the Gram was released in the first session; refused in R0.
        assert refusal.round == "R0"
        assert type(refusal.error) is ValueAlreadyReleasedError
        assert refusal.error.session_id == b"1" * 32 and "all/gram" in str(refusal.error)
        wire.assert_nothing_leaked(cid)
        assert wire.sent.get(cid, []) == []  # not even a key advertisement left it


# --- attack 4: a group cut down to one member -----------------------------------------------------

LONE = {"pair": ("c0", "c1"), "all": ("c0", "c1", "c2", "c3")}


def test_group_cut_to_one_member_recovers_its_input_at_min_group_size_one() -> None:
    fed = federation(4, LONE)
    server = ServerSession(fed.roster, config_for(fed, threshold=3, min_group_size=1, session_id=b"1" * 32))
    wire = Wire(clients_for(fed, policy=SIMULATOR))
    run(server, wire, discard_masked_input_of={"c1"})
    np.testing.assert_array_equal(server.result().groups["pair"].sums["gram"], encoded(fed, "c0"))


def test_min_group_size_one_is_refused_in_r0_under_deployment_defaults() -> None:
    fed = federation(4, LONE)
    server = ServerSession(fed.roster, config_for(fed, threshold=3, min_group_size=1, session_id=b"1" * 32))
    wire = Wire(clients_for(fed, policy=DEPLOYMENT))
    run(server, wire, discard_masked_input_of={"c1"})
    assert set(wire.refusals) == set(fed.ids)
    for cid, refusal in wire.refusals.items():
        assert refusal.round == "R0" and type(refusal.error) is InvalidSessionConfigError
        assert "minimum group size 1" in str(refusal.error)
        wire.assert_nothing_leaked(cid)


def test_group_cut_to_one_member_is_refused_in_r3_when_the_config_says_two() -> None:
    fed = federation(4, LONE)
    server = ServerSession(fed.roster, config_for(fed, threshold=3, min_group_size=2, session_id=b"1" * 32))
    wire = Wire(clients_for(fed, policy=NO_COLLUDERS))
    requests = run(server, wire, until="R2")  # honest so far: the R3 requests name all four
    # The hostile server declares c1 dropped, which leaves c0 alone in "pair" (an honest one aborts).
    cut = ConsistencyCheckRequest(requests["c0"].session_id, ("c0", "c2", "c3"))
    for cid in ("c0", "c2", "c3"):
        assert wire.deliver(cid, "R3", cut) == []
        assert wire.refusals[cid].round == "R3"
        assert type(wire.refusals[cid].error) is GroupBelowMinimumError
        wire.assert_nothing_leaked(cid)


def test_a_pair_group_is_refused_in_r1_under_the_colluder_bound() -> None:
    """n = 4, t = 3: one colluder.  In {c0, c1} the colluder c1 subtracts its own value from the sum:
    c0 refuses the layout before any share exists (and so does c1, symmetrically); c2 and c3 too,
    as all - pair - c3 = c2."""
    fed = federation(4, LONE)
    server = ServerSession(fed.roster, config_for(fed, threshold=3, min_group_size=2, session_id=b"1" * 32))
    wire = Wire(clients_for(fed, policy=DEPLOYMENT))
    run(server, wire)
    assert set(wire.refusals) == set(fed.ids)
    assert {cid: r.round for cid, r in wire.refusals.items()} == dict.fromkeys(fed.ids, "R1")
    assert wire.refusals["c0"].error.colluders == ("c1",)
    assert wire.refusals["c2"].error.colluders == ("c3",)
    assert type(wire.refusals["c0"].error) is ColluderExposureRefusedError
    wire.assert_nothing_leaked("c0")


# --- attack 3: split survivor views with colluders ------------------------------------------------


def _split_view_attack(n: int, threshold: int, colluders, first_half, second_half, policy):
    """The server shows ``first_half`` a survivor set with the target c0 in it (they reveal shares of
    c0's self-mask seed) and ``second_half`` one without it (they reveal shares of c0's mask key);
    the colluders sign both views and hand over what they hold.  Returns the wire, what the server
    could rebuild of c0's secrets, and c0's unmasked input if it rebuilt both."""
    fed = federation(n)
    server = ServerSession(
        fed.roster, config_for(fed, threshold=threshold, min_group_size=2, session_id=b"3" * 32)
    )
    wire = Wire(clients_for(fed, policy=policy))
    requests = run(server, wire, until="R2")
    if not requests:
        return wire, {}, None
    session_id = requests["c0"].session_id
    views = {"with": fed.ids, "without": tuple(c for c in fed.ids if c != "c0")}
    halves = {"with": first_half, "without": second_half}
    signatures: dict[str, list[SurvivorSignature]] = {view: [] for view in views}
    for view, survivors in views.items():
        for cid in halves[view]:
            for reply in wire.deliver(cid, "R3", ConsistencyCheckRequest(session_id, survivors)):
                signatures[view].append(SurvivorSignature(cid, reply.signature))
        for cid in colluders:  # a colluder signs whatever the server asks, with its identity key
            domain, fields = binding.survivors_fields(
                session_id, binding.config_digest(server.config), server._adverts_digest, survivors
            )
            signatures[view].append(
                SurvivorSignature(cid, crypto.sign(fed.identities[cid].private_key, domain, *fields))
            )
    shares: dict[str, list[shamir.Share]] = {"seed": [], "key": []}
    for view, survivors in views.items():
        request = UnmaskRequest(
            session_id,
            survivors,
            tuple(signatures[view]),
            survivors,
            () if view == "with" else ("c0",),
        )
        for cid in halves[view]:
            for reply in wire.deliver(cid, "R4", request):
                items = reply.self_mask_shares if view == "with" else reply.mask_key_shares
                value = next(item.value for item in items if item.owner == "c0")
                shares["seed" if view == "with" else "key"].append(
                    shamir.Share(fed.roster.share_point(cid), shamir.value_from_bytes(value))
                )
    for cid in colluders:
        held = wire.clients[cid]._held["c0"]  # a colluder gives the server both of its shares of c0
        shares["seed"].append(shamir.Share(fed.roster.share_point(cid), held.self_mask))
        shares["key"].append(shamir.Share(fed.roster.share_point(cid), held.mask_key))
    rebuilt = {}
    advert = server._adverts["c0"]
    if len(shares["seed"]) >= threshold:
        seed = shamir.reconstruct(shares["seed"][:threshold]).to_bytes(32, "big")
        if binding.self_mask_commitment(seed, session_id, "c0") == advert.self_mask_commitment:
            rebuilt["seed"] = seed
    if len(shares["key"]) >= threshold:
        key = X25519PrivateKey.from_private_bytes(
            shamir.reconstruct(shares["key"][:threshold]).to_bytes(32, "big")
        )
        if crypto.x25519_public_bytes(key) == advert.mask_public_key:
            rebuilt["key"] = key
    if set(rebuilt) != {"seed", "key"}:
        return wire, rebuilt, None
    masked = next(m for m in map(_decoded, wire.sent["c0"]) if isinstance(m, MaskedInput))
    (item,) = masked.tensors
    words = np.frombuffer(item.data, dtype="<u8").copy()
    prg.add_mask(words, prg.self_mask_key(rebuilt["seed"], session_id, "all", "gram", "c0"), -1)
    for peer in fed.ids[1:]:
        secret = crypto.x25519_shared_secret(rebuilt["key"], server._adverts[peer].mask_public_key)
        key = prg.pair_mask_key(secret, session_id, "all", "gram", "c0", peer)
        prg.add_mask(words, key, -prg.pair_sign("c0", peer))
    return wire, rebuilt, words


def _decoded(data: bytes):
    return codec.decode(data, max_message_bytes=1 << 30)


SPLITS = [
    # n, majority t, colluders, first half (shown c0 alive), second half (shown c0 dropped)
    (8, 5, ("c5", "c6", "c7"), ("c0", "c1"), ("c2", "c3", "c4")),
    (5, 3, ("c3", "c4"), ("c0",), ("c1", "c2")),
]


@pytest.mark.parametrize(("n", "t", "colluders", "first", "second"), SPLITS)
def test_split_views_rebuild_both_secrets_at_the_majority_threshold(n, t, colluders, first, second) -> None:
    wire, rebuilt, words = _split_view_attack(n, t, colluders, first, second, SIMULATOR)
    assert set(rebuilt) == {"seed", "key"} and wire.refusals == {}  # every check passed
    np.testing.assert_array_equal(words, encoded(federation(n), "c0"))


@pytest.mark.parametrize(("n", "t", "colluders", "first", "second"), SPLITS)
def test_split_views_at_the_majority_threshold_are_refused_in_r0_under_deployment(
    n, t, colluders, first, second
) -> None:
    wire, rebuilt, words = _split_view_attack(n, t, colluders, first, second, DEPLOYMENT)
    assert rebuilt == {} and words is None
    honest = set(first) | set(second)
    assert set(wire.refusals) >= honest
    for cid in honest:
        assert (
            wire.refusals[cid].round == "R0" and type(wire.refusals[cid].error) is InvalidSessionConfigError
        )
        assert f"below this client's minimum {DEPLOYMENT.min_threshold(n)}" in str(wire.refusals[cid].error)
        wire.assert_nothing_leaked(cid)


@pytest.mark.parametrize(
    ("n", "colluders", "first", "second"),
    [
        (8, ("c5", "c6", "c7"), ("c0", "c1"), ("c2", "c3", "c4")),
        (8, ("c5", "c6", "c7"), ("c0", "c1", "c2"), ("c3", "c4")),
        (5, ("c3", "c4"), ("c0",), ("c1", "c2")),
        (5, ("c3", "c4"), ("c0", "c1"), ("c2",)),
    ],
)
def test_split_views_fail_at_the_two_thirds_threshold(n, colluders, first, second) -> None:
    t = DEPLOYMENT.min_threshold(n)  # 6 of 8, 4 of 5: one half always lacks t signatures
    wire, rebuilt, words = _split_view_attack(n, t, colluders, first, second, DEPLOYMENT)
    assert words is None and set(rebuilt) != {"seed", "key"}
    short = first if len(first) + len(colluders) < t else second
    assert len(short) + len(colluders) < t
    for cid in short:
        assert wire.refusals[cid].round == "R4"
        assert type(wire.refusals[cid].error) is SurvivorsBelowThresholdError
        wire.assert_nothing_leaked(cid)


# --- the classes refused before this suite: each with its error, its round, and no secret out -----


def _fresh_key() -> bytes:
    return crypto.x25519_public_bytes(crypto.new_x25519_key(DeterministicRandomSource(b"mallory")))


def _sign_advert(identity, client_id: str, template):
    domain, fields = binding.advertise_fields(
        template.session_id,
        client_id,
        template.encryption_public_key,
        template.mask_public_key,
        template.self_mask_commitment,
        template.config_digest,
        template.groups,
    )
    return dataclasses.replace(
        template, client_id=client_id, signature=crypto.sign(identity.private_key, domain, *fields)
    )


def _replace_advert(request, cid, advert):
    return dataclasses.replace(
        request, advertisements=tuple(advert if a.client_id == cid else a for a in request.advertisements)
    )


def _other_session_advert(request, fed):
    """c1's advertisement from another session with the same identities."""
    other = ServerSession(fed.roster, config_for(fed, threshold=4, min_group_size=2, session_id=b"X" * 32))
    requests = run(other, Wire(clients_for(fed, policy=DEPLOYMENT, seed=b"other")), until="R0")
    replayed = next(a for a in requests["c1"].advertisements if a.client_id == "c1")
    return _replace_advert(request, "c1", replayed)


def _forged_signature(request, fed):
    signatures = tuple(
        dataclasses.replace(item, signature=bytes(64)) if item.client_id == "c1" else item
        for item in request.signatures
    )
    return dataclasses.replace(request, signatures=signatures)


def _low_order_advert(request, fed):
    """c1 itself (malicious) signs an all-zero, low-order X25519 mask key; an honest server refuses it."""
    advert = next(a for a in request.advertisements if a.client_id == "c1")
    return _sign_advert(fed.identities["c1"], "c1", dataclasses.replace(advert, mask_public_key=bytes(32)))


def _low_order_encryption_advert(request, fed):
    """As :func:`_low_order_advert`, for the key the shares are encrypted under (a point of order 8)."""
    advert = next(a for a in request.advertisements if a.client_id == "c1")
    order_8 = bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800")
    return _sign_advert(
        fed.identities["c1"], "c1", dataclasses.replace(advert, encryption_public_key=order_8)
    )


def test_the_server_refuses_a_low_order_key_so_a_relayed_one_is_its_fault() -> None:
    fed = federation(3)
    server = ServerSession(fed.roster, config_for(fed, threshold=3, min_group_size=2, session_id=b"Z" * 32))
    requests = run(server, Wire(clients_for(fed, policy=DEPLOYMENT)), until="R0")
    honest = ServerSession(fed.roster, server.config)
    honest.start()
    with pytest.raises(ClientProtocolError, match="low-order"):
        honest.receive(_low_order_advert(requests["c0"], fed))


MALLORY = IdentityKey.generate(DeterministicRandomSource(b"mallory identity"))

CASES = {
    # name: (round whose request is tampered, tamper(request, fed) -> request, expected error)
    "substituted keys": (
        "R1",
        lambda r, fed: _replace_advert(
            r, "c1", dataclasses.replace(r.advertisements[1], mask_public_key=_fresh_key())
        ),
        RelayedSignatureError,
    ),
    "impersonated member": (
        "R1",
        lambda r, fed: _replace_advert(r, "c1", _sign_advert(MALLORY, "c1", r.advertisements[1])),
        RelayedSignatureError,
    ),
    "sybil id": (
        "R1",
        lambda r, fed: dataclasses.replace(
            r, advertisements=(*r.advertisements, _sign_advert(MALLORY, "mallory", r.advertisements[1]))
        ),
        UnknownParticipantError,
    ),
    "duplicate id": (
        "R1",
        lambda r, fed: dataclasses.replace(r, advertisements=(*r.advertisements, r.advertisements[1])),
        DuplicateParticipantError,
    ),
    "advertisement replayed from another session": ("R1", _other_session_advert, ReplayedMessageError),
    "low-order key signed by its owner, relayed": (
        "R1",
        lambda r, fed: _replace_advert(r, "c1", _low_order_advert(r, fed)),
        ServerProtocolError,
    ),
    "low-order encryption key signed by its owner, relayed": (
        "R1",
        lambda r, fed: _replace_advert(r, "c1", _low_order_encryption_advert(r, fed)),
        ServerProtocolError,
    ),
    "own advertisement omitted": (
        "R1",
        lambda r, fed: dataclasses.replace(r, advertisements=r.advertisements[1:]),
        ServerProtocolError,
    ),
    "fewer advertisements than t": (
        "R1",
        lambda r, fed: dataclasses.replace(r, advertisements=r.advertisements[:3]),
        SurvivorsBelowThresholdError,
    ),
    "tampered share": (
        "R2",
        lambda r, fed: dataclasses.replace(
            r,
            shares=(
                dataclasses.replace(
                    r.shares[0],
                    ciphertext=bytes([r.shares[0].ciphertext[0] ^ 1]) + r.shares[0].ciphertext[1:],
                ),
                *r.shares[1:],
            ),
        ),
        ShareAuthenticationError,
    ),
    "duplicate share sender": (
        "R2",
        lambda r, fed: dataclasses.replace(r, shares=(*r.shares, r.shares[0])),
        DuplicateParticipantError,
    ),
    "misaddressed share": (
        "R2",
        lambda r, fed: dataclasses.replace(
            r, shares=(dataclasses.replace(r.shares[0], recipient="c2"), *r.shares[1:])
        ),
        ServerProtocolError,
    ),
    "survivor set repeats a client": (
        "R3",
        lambda r, fed: dataclasses.replace(r, survivors=(*r.survivors, "c1")),
        DuplicateParticipantError,
    ),
    "survivor set without the client": (
        "R3",
        lambda r, fed: dataclasses.replace(r, survivors=r.survivors[1:]),
        InconsistentSurvivorsError,
    ),
    "survivors fewer than t": (
        "R3",
        lambda r, fed: dataclasses.replace(r, survivors=r.survivors[:3]),
        SurvivorsBelowThresholdError,
    ),
    "both shares of one client": (
        "R4",
        lambda r, fed: dataclasses.replace(r, reveal_mask_key_of=("c1",)),
        BothSharesRequestedError,
    ),
    "survivor set other than signed": (
        "R4",
        lambda r, fed: dataclasses.replace(r, survivors=r.survivors[:4], reveal_self_mask_of=r.survivors[:4]),
        InconsistentSurvivorsError,
    ),
    "forged consistency signature": ("R4", _forged_signature, InconsistentSurvivorsError),
    "too few consistency signatures": (
        "R4",
        lambda r, fed: dataclasses.replace(r, signatures=r.signatures[:3]),
        SurvivorsBelowThresholdError,
    ),
    "signature by a non-survivor": (
        "R4",
        lambda r, fed: dataclasses.replace(
            r, signatures=(*r.signatures, SurvivorSignature("mallory", bytes(64)))
        ),
        UnknownParticipantError,
    ),
}
PREVIOUS = {"R1": "R0", "R2": "R1", "R3": "R2", "R4": "R3"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_known_attack_is_refused_with_its_error_in_its_round(case) -> None:
    round_name, tamper, error = CASES[case]
    fed = federation(5)
    server = ServerSession(fed.roster, config_for(fed, threshold=4, min_group_size=2, session_id=b"K" * 32))
    wire = Wire(clients_for(fed, policy=DEPLOYMENT))
    requests = run(server, wire, until=PREVIOUS[round_name])
    assert wire.refusals == {}
    assert wire.deliver("c0", round_name, tamper(requests["c0"], fed)) == []
    refusal = wire.refusals["c0"]
    assert refusal.round == round_name and type(refusal.error) is error
    wire.assert_nothing_leaked("c0")


def test_different_configs_for_different_clients_are_refused_in_r1() -> None:
    fed = federation(5)
    config = config_for(fed, threshold=4, min_group_size=2, session_id=b"C" * 32)
    server = ServerSession(fed.roster, config)
    wire = Wire(clients_for(fed, policy=DEPLOYMENT))
    # c4 is shown a config with a higher threshold; its signed advertisement binds that config.
    other = dataclasses.replace(config, threshold=5)
    request = server.start()
    for cid in fed.ids:
        for reply in wire.deliver(cid, "R0", request if cid != "c4" else AdvertiseRequest(other)):
            if cid != "c4":
                server.receive(reply)
            else:
                c4_advert = reply
    server._adverts["c4"] = c4_advert  # the hostile server relays it anyway
    share_request = server.next_round()["c0"]
    assert wire.deliver("c0", "R1", share_request) == []
    assert wire.refusals["c0"].round == "R1"
    assert type(wire.refusals["c0"].error) is DifferentSessionViewError  # an InvalidSessionConfigError
    wire.assert_nothing_leaked("c0")


# --- codec fuzzing: whatever bytes the server sends, a client fails cleanly and leaks nothing -----


@st.composite
def _mutations(draw):
    kind = draw(st.sampled_from(["flip", "truncate", "extend", "random", "splice"]))
    return kind, draw(st.integers(min_value=0, max_value=1 << 16)), draw(st.binary(min_size=1, max_size=64))


def _mutate(data: bytes, mutation) -> bytes:
    kind, position, junk = mutation
    if kind == "flip":
        i = position % len(data)
        return data[:i] + bytes([data[i] ^ (1 << (position % 8))]) + data[i + 1 :]
    if kind == "truncate":
        return data[: position % len(data)]
    if kind == "extend":
        return data + junk
    if kind == "splice":
        i = position % len(data)
        return data[:i] + junk + data[i + len(junk) :]
    return junk


@pytest.mark.parametrize("round_name", ["R0", "R1", "R2", "R3", "R4"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutation=_mutations())
def test_mutated_server_bytes_fail_cleanly_and_leak_nothing(round_name, mutation) -> None:
    fed = federation(4, lengths={"gram": 3})
    server = ServerSession(fed.roster, config_for(fed, threshold=3, min_group_size=2, session_id=b"F" * 32))
    wire = Wire(clients_for(fed, policy=DEPLOYMENT))
    requests = (
        dict.fromkeys(fed.ids, server.start())
        if round_name == "R0"
        else run(server, wire, until=PREVIOUS[round_name])
    )
    original = codec.encode(requests["c0"], max_message_bytes=1 << 30)
    data = _mutate(original, mutation)
    client = wire.clients["c0"]
    wire._note_secrets("c0")
    try:
        replies = client.receive_bytes(data)
    except RemoteProtocolError as error:  # anything else (IndexError, KeyError, ...) is a bug
        wire.refusals["c0"] = Refusal(round_name, error)
        wire.assert_nothing_leaked("c0")
        return
    except LocalProtocolError as error:
        # Only a layout that does not fit this client's inputs (R0: a tensor length or a group name
        # changed): nothing built, nothing sent.
        assert round_name == "R0"
        assert "do not match the session layout" in str(error) or "is not in the session layout" in str(error)
        assert client.state is ClientState.AWAIT_ADVERTISE_REQUEST and "c0" not in wire.sent
        return
    # Accepted: then the bytes decoded to a message the client could not tell from a valid one.
    assert codec.decode(data, max_message_bytes=1 << 30) is not None and replies


def test_a_client_message_sent_by_the_server_fails_the_client() -> None:
    fed = federation(3)
    wire = Wire(clients_for(fed, policy=DEPLOYMENT))
    server = ServerSession(fed.roster, config_for(fed, threshold=3, min_group_size=2, session_id=b"O" * 32))
    requests = run(server, wire, until="R0")
    advert = requests["c0"].advertisements[1]  # an AdvertiseKeys, well-formed, but not a server message
    assert wire.deliver("c0", "R1", advert) == []
    assert type(wire.refusals["c0"].error) is OutOfOrderMessageError
    wire.assert_nothing_leaked("c0")


# --- resource limits ------------------------------------------------------------------------------


def test_huge_tensors_of_groups_the_client_is_not_in_do_not_raise_its_limits() -> None:
    fed = federation(4, {"mine": ("c0", "c1", "c2", "c3")})
    small = config_for(fed, threshold=3, min_group_size=2, session_id=b"L" * 32)
    huge = dataclasses.replace(
        small,
        groups=(
            *small.groups,
            GroupSpec("theirs", tuple(TensorSpec(f"big{i}", codec.MAX_TENSOR_WORDS) for i in range(4))),
        ),
    )
    assert len(codec.encode(AdvertiseRequest(huge))) < 400  # a few hundred bytes...
    assert codec.max_message_bytes(huge, 4) > 16 << 30  # ...announcing 16 GiB masked inputs
    limits = {}
    for config in (small, huge):
        wire = Wire(clients_for(fed, policy=DEPLOYMENT, ids=("c0",)))
        client = wire.clients["c0"]
        (_advert,) = wire.deliver("c0", "R0", AdvertiseRequest(config))
        limits[config is huge] = client.incoming_message_limit
    # The next message (the share-keys request) is bounded by clients and group names, not lengths.
    assert (
        limits[True] - limits[False] == 4 * codec.MAX_STRING_BYTES + 4 * 2
    )  # one more group name per advert
    assert limits[True] < 64 << 10
    # The masked input it would send covers only its own group.
    assert client.reply_limit(MaskedInput(b"", "c0", ())) < 1 << 10


def test_each_message_type_has_its_own_bound() -> None:
    fed = federation(4, lengths={"gram": 100_000})  # 800 kB masked inputs
    server = ServerSession(fed.roster, config_for(fed, threshold=3, min_group_size=2, session_id=b"M" * 32))
    wire = Wire(clients_for(fed, policy=DEPLOYMENT))
    run(server, wire, until="R2")
    client = wire.clients["c0"]
    assert client.state is ClientState.AWAIT_CONSISTENCY_REQUEST
    assert client.incoming_message_limit < 4 << 10  # the consistency request is O(n), not O(layout)
    # A consistency request padded past that bound is refused before it is parsed.
    padded = ConsistencyCheckRequest(b"M" * 32, tuple(f"c{i}" for i in range(4)) + ("x" * 200,) * 20)
    assert wire.deliver("c0", "R3", padded) == []
    assert type(wire.refusals["c0"].error) is MessageDecodeError
    wire.assert_nothing_leaked("c0")


def test_oversized_or_overfull_configs_are_refused_in_r0_with_bounded_work() -> None:
    fed = federation(3)
    base = config_for(fed, threshold=3, min_group_size=2, session_id=b"R" * 32)
    many_groups = dataclasses.replace(
        base,
        groups=tuple(GroupSpec(f"g{i}", (TensorSpec("gram", 6),)) for i in range(DEPLOYMENT.max_groups + 1)),
    )
    many_tensors = dataclasses.replace(
        base,
        groups=(
            GroupSpec("all", tuple(TensorSpec(f"t{i}", 1) for i in range(DEPLOYMENT.max_layout_tensors + 1))),
        ),
    )
    # The largest config a client decodes, filled with the smallest groups (the costliest to parse).
    n_small = DEPLOYMENT.max_config_bytes // 20
    overfull = dataclasses.replace(
        base, groups=tuple(GroupSpec(f"{i:x}", (TensorSpec("t", 1),)) for i in range(n_small))
    )
    too_big = dataclasses.replace(
        base, groups=tuple(GroupSpec(f"{i:x}", (TensorSpec("t", 1),)) for i in range(2 * n_small))
    )
    for config, error in (
        (many_groups, InvalidSessionConfigError),
        (many_tensors, InvalidSessionConfigError),
        (overfull, InvalidSessionConfigError),
        (too_big, MessageDecodeError),
    ):
        wire = Wire(clients_for(fed, policy=DEPLOYMENT, ids=("c0",)))
        started = time.perf_counter()
        assert wire.deliver("c0", "R0", AdvertiseRequest(config)) == []
        assert time.perf_counter() - started < 3.0  # about 0.3 s at worst on one core
        assert type(wire.refusals["c0"].error) is error
        wire.assert_nothing_leaked("c0")


def test_two_concurrent_sessions_over_one_input_cannot_both_pass_the_ledger() -> None:
    """Attack 2 in parallel: both sessions reach R3 before either is recorded; the ledger's check and
    record are one step, so the second survivor set (without c0) meets the first session's record."""
    fed = federation(5)
    ledgers = {cid: MemoryLedger() for cid in fed.ids}
    config = {
        sid: config_for(fed, threshold=4, min_group_size=2, session_id=sid * 32) for sid in (b"A", b"B")
    }
    first = ServerSession(fed.roster, config[b"A"])
    second = ServerSession(fed.roster, config[b"B"])
    wire_a = Wire(clients_for(fed, policy=DEPLOYMENT, ledgers=ledgers, seed=b"a"))
    wire_b = Wire(clients_for(fed, policy=DEPLOYMENT, ledgers=ledgers, seed=b"b"))
    requests_a = run(first, wire_a, until="R2")
    run(second, wire_b, until="R2", discard_masked_input_of={"c0"})  # c0 "dropped after R2" in B
    for cid, request in sorted(requests_a.items()):  # session A signs U3 = everyone: recorded
        assert wire_a.deliver(cid, "R3", request)
    without_c0 = ConsistencyCheckRequest(config[b"B"].session_id, fed.ids[1:])
    for cid in fed.ids[1:]:
        assert wire_b.deliver(cid, "R3", without_c0) == []
        assert wire_b.refusals[cid].round == "R3"
        assert type(wire_b.refusals[cid].error) is ValueAlreadyReleasedError
        wire_b.assert_nothing_leaked(cid)
