"""One view (SECURITY.md): every value the server chooses that shapes a release is one
value for all honest clients, and a client holds t advertisements signed over its own digest of it
before any share leaves (R1).  Scripted hostile servers over the real codec and the real client
state machines of both backends; the deployment handler's versions are in
tests/deploy/test_deploy_one_view.py.

Attacks tested here: round 2's teacher W and study not signed, and a raised threshold that shrank
the colluder bound, then other attempts against one view.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import pytest

from secure_afl.core import encoding
from secure_afl.core.errors import (
    ClientProtocolError,
    ColluderExposureRefusedError,
    DifferentSessionViewError,
    InvalidSessionConfigError,
    LocalProtocolError,
    ReplayedMessageError,
    SurvivorsBelowThresholdError,
)
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.protocol import binding, codec
from secure_afl.protocol.client import ClientSession
from secure_afl.protocol.messages import AdvertiseRequest, ShareKeys, ShareKeysRequest
from secure_afl.protocol.server import ServerSession

from .hostile import WIRE_LIMIT, Wire, clients_for, config_for, federation, run

DEPLOYMENT = ClientPolicy.deployment()
SIMULATOR = ClientPolicy.simulator()
STUDY = {"classes": ["A", "B", "C"], "method": {"rounds": 2, "tau": 0.7, "alpha": 0.5, "min_pos": 5}}
PSEUDO = {"pseudo/0": ("c0", "c1", "c2", "c3")}  # round 2: the clients missing class 0


def study_bytes(**method) -> bytes:
    document = {**STUDY, "method": {**STUDY["method"], **method}}
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).digest()


def teacher(scale: float = 1.0) -> np.ndarray:
    return scale * np.random.default_rng(7).normal(size=(6, 3))


def round2_context(coef: np.ndarray, **method) -> bytes:
    return binding.session_context(study_bytes(**method), "2", {"coef": coef})


def relay_every_advertisement(fed, wire: Wire, config, requests=None) -> ShareKeysRequest:
    """R0 to every client (its own advertise request, if given), then the R1 request that a hostile
    server builds from every advertisement it received, whatever digest each one signs."""
    adverts = []
    for cid in fed.ids:
        request = (requests or {}).get(cid, AdvertiseRequest(config))
        adverts.extend(wire.deliver(cid, "R0", request))
    assert len(adverts) == len(fed.ids)  # R0 reveals nothing: every client advertised its keys
    return ShareKeysRequest(config.session_id, tuple(sorted(adverts, key=lambda a: a.client_id)))


def assert_refused_in_r1(wire: Wire, cids, error: type) -> None:
    for cid in cids:
        refusal = wire.refusals[cid]
        assert refusal.round == "R1" and type(refusal.error) is error, (cid, refusal)
        wire.assert_nothing_leaked(cid)
        # No encrypted share of its seed or mask key left it: the sum can never be unmasked.
        sent = [codec.decode(m, max_message_bytes=WIRE_LIMIT) for m in wire.sent[cid]]
        assert not any(isinstance(m, ShareKeys) for m in sent)


# --- round 2's teacher and study ------------------------------------------------------------------


@pytest.mark.parametrize(
    "shown",
    [
        # The victim scores with 1000 W, its peers with W = 0 (they add exact zeros).
        {
            "c0": round2_context(teacher(1000.0)),
            **{c: round2_context(teacher(0.0)) for c in ("c1", "c2", "c3")},
        },
        # The real W for all, but the peers' study asks for 10^9 pseudo-positives (none qualifies)
        # and the victim's for one.
        {
            "c0": round2_context(teacher(), min_pos=1, min_neg=1),
            **{c: round2_context(teacher(), min_pos=10**9) for c in ("c1", "c2", "c3")},
        },
    ],
    ids=["teacher", "pseudo-label parameters"],
)
def test_round2_shown_differently_to_the_victim_is_refused_in_r1_by_every_client(shown) -> None:
    fed = federation(4, PSEUDO)
    config = config_for(fed, threshold=3, min_group_size=2, session_id=b"2" * 32)
    wire = Wire(clients_for(fed, policy=DEPLOYMENT, contexts=shown))
    share_request = relay_every_advertisement(fed, wire, config)
    for cid in fed.ids:
        assert wire.deliver(cid, "R1", share_request) == []
    assert_refused_in_r1(wire, fed.ids, DifferentSessionViewError)


def test_round2_shown_alike_to_everyone_completes_with_the_true_sum() -> None:
    """The control: the same session context for all, the same script: every client goes on, and
    the server learns the group sum only."""
    fed = federation(4, PSEUDO)
    context = round2_context(teacher())
    config = config_for(fed, threshold=3, min_group_size=2, session_id=b"2" * 32)
    server = ServerSession(fed.roster, config, context=context)
    wire = Wire(clients_for(fed, policy=DEPLOYMENT, contexts=dict.fromkeys(fed.ids, context)))
    run(server, wire)
    assert wire.refusals == {}
    total = sum(
        encoding.encode(fed.inputs[c]["pseudo/0"]["gram"], tensor="gram", group_size=4) for c in fed.ids
    )
    np.testing.assert_array_equal(server.result().groups["pseudo/0"].sums["gram"], total)


def test_an_honest_server_of_another_view_refuses_the_advertisements_itself() -> None:
    """The honest server binds the context it sent: an advertisement over another one is rejected
    as that client's fault, before anything is relayed."""
    fed = federation(4, PSEUDO)
    config = config_for(fed, threshold=3, min_group_size=2, session_id=b"2" * 32)
    server = ServerSession(fed.roster, config, context=round2_context(teacher()))
    wire = Wire(clients_for(fed, policy=DEPLOYMENT, contexts={"c0": round2_context(teacher(2.0))}))
    (advert,) = wire.deliver("c0", "R0", server.start())
    with pytest.raises(ClientProtocolError, match="signed a different session config"):
        server.receive(advert)


def test_the_ckks_client_binds_the_same_context_and_refuses_another_view_in_r1() -> None:
    from secure_afl.aggregation.backend import CkksBackend
    from secure_afl.aggregation.layout import layout_of
    from secure_afl.protocol.ckks import codec as ckks_codec
    from secure_afl.protocol.ckks.messages import CkksKeyDistribution, CkksKeyRequest

    fed = federation(4, PSEUDO)
    backend = CkksBackend()
    layout = layout_of(fed.inputs, ())
    session_id = b"K" * 32
    contexts = {
        "c0": round2_context(teacher(1000.0)),
        **{c: round2_context(teacher(0.0)) for c in fed.ids[1:]},
    }
    clients = {
        cid: backend.client_session(
            cid, fed.identities[cid], fed.roster, fed.inputs[cid], session_id=session_id, min_group_size=2,
            random=DeterministicRandomSource(cid.encode()), context=contexts[cid],
        )
        for cid in fed.ids
    }  # fmt: skip
    server = backend.server_session(fed.roster, layout, session_id=session_id, min_group_size=2)
    start = ckks_codec.encode(server.start(), max_message_bytes=WIRE_LIMIT)
    adverts = [
        ckks_codec.decode(r, max_message_bytes=WIRE_LIMIT)
        for c in clients.values()
        for r in c.receive_bytes(start)
    ]
    request = ckks_codec.encode(CkksKeyRequest(session_id, tuple(adverts)), max_message_bytes=WIRE_LIMIT)
    for client in clients.values():
        with pytest.raises(DifferentSessionViewError):
            client.receive_bytes(request)  # no key made, none sent: nothing is ever encrypted under it
        assert client.state.name == "FAILED"
    # The control: one context for all, and the key holder sends the key (R1 goes on).
    same = round2_context(teacher())
    clients = {
        cid: backend.client_session(
            cid, fed.identities[cid], fed.roster, fed.inputs[cid], session_id=session_id, min_group_size=2,
            random=DeterministicRandomSource(cid.encode()), context=same,
        )
        for cid in fed.ids
    }  # fmt: skip
    adverts = [
        ckks_codec.decode(r, max_message_bytes=WIRE_LIMIT)
        for c in clients.values()
        for r in c.receive_bytes(start)
    ]
    request = ckks_codec.encode(CkksKeyRequest(session_id, tuple(adverts)), max_message_bytes=WIRE_LIMIT)
    replies = [
        ckks_codec.decode(r, max_message_bytes=WIRE_LIMIT)
        for c in clients.values()
        for r in c.receive_bytes(request)
    ]
    assert [type(r) for r in replies] == [CkksKeyDistribution]


# --- the colluder bound from the client's own floor, not the session's t --------------------------

PAIR = {"all": ("c0", "c1", "c2", "c3"), "class/0": ("c0", "c1")}


@pytest.mark.parametrize("threshold", [3, 4])
def test_a_raised_threshold_does_not_shrink_the_colluder_bound(threshold: int) -> None:
    """n = 4: the client's floor is t = 3, so c = 1 whatever t the server proposes.  At t = 4 the
    session's n - t was 0 and {victim, colluder} passed every check; now it is refused in R1, with
    the same colluder named as at t = 3."""
    fed = federation(4, PAIR)
    config = config_for(fed, threshold=threshold, min_group_size=2, session_id=b"3" * 32)
    server = ServerSession(fed.roster, config)
    wire = Wire(clients_for(fed, policy=DEPLOYMENT))
    run(server, wire)
    assert_refused_in_r1(wire, ("c0", "c1"), ColluderExposureRefusedError)
    assert wire.refusals["c0"].error.colluders == ("c1",)
    assert wire.refusals["c1"].error.colluders == ("c0",)


def test_the_pair_group_hands_the_victim_to_its_colluder_when_nobody_checks() -> None:
    """Why: the group {c0, c1} sums to c0's value plus the colluder c1's own (simulator's clients)."""
    fed = federation(4, PAIR)
    server = ServerSession(fed.roster, config_for(fed, threshold=4, min_group_size=2, session_id=b"3" * 32))
    wire = Wire(clients_for(fed, policy=SIMULATOR))
    run(server, wire)
    pair = server.result().groups["class/0"].sums["gram"]
    own = encoding.encode(fed.inputs["c1"]["class/0"]["gram"], tensor="gram", group_size=2)
    victim = encoding.encode(fed.inputs["c0"]["class/0"]["gram"], tensor="gram", group_size=2)
    np.testing.assert_array_equal(pair - own, victim)


def test_the_colluder_bound_follows_the_clients_own_floor_when_it_sets_one() -> None:
    """A client that asks for t >= 4 of 4 (its own floor) assumes c = 0: its choice, not the server's."""
    fed = federation(4, PAIR)
    config = config_for(fed, threshold=4, min_group_size=2, session_id=b"3" * 32)
    server = ServerSession(fed.roster, config)
    clients = {
        cid: ClientSession(
            cid, fed.identities[cid], fed.roster, fed.inputs[cid], policy=DEPLOYMENT, min_threshold=4,
            random=DeterministicRandomSource(cid.encode()),
        )
        for cid in fed.ids
    }  # fmt: skip
    wire = Wire(clients)
    run(server, wire)
    assert wire.refusals == {}


# --- other attempts against one view -------------------------------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        {"min_group_size": 3},
        {"threshold": 5},
        {"frac_bits": 20},
        {"groups": "an extra group the victim is not in"},
        {"groups": "longer tensors"},
    ],
    ids=["min group size", "threshold", "encoding", "extra group", "tensor lengths"],
)
def test_a_config_shown_differently_to_one_client_is_refused_by_everyone_in_r1(change) -> None:
    fed = federation(5, {"all": ("c0", "c1", "c2", "c3", "c4")})
    config = config_for(fed, threshold=4, min_group_size=2, session_id=b"V" * 32)
    if change.get("groups") == "an extra group the victim is not in":
        extra = dataclasses.replace(config.groups[0], name="class/9")
        other = dataclasses.replace(config, groups=(*config.groups, extra))
    elif change.get("groups") == "longer tensors":
        (group,) = config.groups
        longer = tuple(dataclasses.replace(t, length=t.length + 1) for t in group.tensors)
        other = dataclasses.replace(config, groups=(dataclasses.replace(group, tensors=longer),))
    else:
        other = dataclasses.replace(config, **change)
    wire = Wire(clients_for(fed, policy=DEPLOYMENT))
    if change.get("groups") == "longer tensors":
        # A layout that does not fit a client's inputs is refused by that client in R0 already.
        assert wire.deliver("c0", "R0", AdvertiseRequest(other)) == []
        assert type(wire.refusals["c0"].error) is LocalProtocolError
        return
    share_request = relay_every_advertisement(fed, wire, config, {"c0": AdvertiseRequest(other)})
    for cid in fed.ids:
        assert wire.deliver(cid, "R1", share_request) == []
    assert_refused_in_r1(wire, fed.ids, DifferentSessionViewError)


def test_advertisements_replayed_from_another_study_with_the_same_session_id_are_refused() -> None:
    """The server runs study A and study B under one session id; it relays A's advertisements to a
    client of B.  Each signs A's context, not B's."""
    fed = federation(4, PSEUDO)
    config = config_for(fed, threshold=3, min_group_size=2, session_id=b"S" * 32)
    a = Wire(clients_for(fed, policy=DEPLOYMENT, contexts=dict.fromkeys(fed.ids, round2_context(teacher()))))
    from_a = relay_every_advertisement(fed, a, config)
    b = Wire(
        clients_for(
            fed, policy=DEPLOYMENT, contexts=dict.fromkeys(fed.ids, round2_context(teacher(), tau=0.9))
        )
    )
    own = {advert.client_id: advert for advert in relay_every_advertisement(fed, b, config).advertisements}
    mixed = ShareKeysRequest(
        config.session_id, tuple(own["c0"] if a_.client_id == "c0" else a_ for a_ in from_a.advertisements)
    )
    assert b.deliver("c0", "R1", mixed) == []
    assert_refused_in_r1(b, ("c0",), DifferentSessionViewError)


def test_advertisements_replayed_from_another_session_are_refused() -> None:
    fed = federation(4, PSEUDO)
    context = round2_context(teacher())
    old = Wire(clients_for(fed, policy=DEPLOYMENT, contexts=dict.fromkeys(fed.ids, context)))
    from_old = relay_every_advertisement(
        fed, old, config_for(fed, threshold=3, min_group_size=2, session_id=b"O" * 32)
    )
    config = config_for(fed, threshold=3, min_group_size=2, session_id=b"N" * 32)
    new = Wire(clients_for(fed, policy=DEPLOYMENT, contexts=dict.fromkeys(fed.ids, context), seed=b"new"))
    own = {advert.client_id: advert for advert in relay_every_advertisement(fed, new, config).advertisements}
    mixed = ShareKeysRequest(
        config.session_id, tuple(own["c0"] if a.client_id == "c0" else a for a in from_old.advertisements)
    )
    assert new.deliver("c0", "R1", mixed) == []
    assert_refused_in_r1(new, ("c0",), ReplayedMessageError)


def test_colluders_alone_cannot_make_up_a_view_for_the_victim() -> None:
    """n = 4, floor t = 3, one colluder: the colluder signs whatever the victim was shown, the honest
    peers were shown another view.  The victim's view holds its own and the colluder's advertisement,
    fewer than t: refused in R1; a session t of 2 to fit them is refused in R0."""
    fed = federation(4, PSEUDO)
    victim_view, peers_view = round2_context(teacher(1000.0)), round2_context(teacher(0.0))
    contexts = {"c0": victim_view, "c1": victim_view, "c2": peers_view, "c3": peers_view}  # c1 colludes
    config = config_for(fed, threshold=3, min_group_size=2, session_id=b"C" * 32)
    wire = Wire(clients_for(fed, policy=DEPLOYMENT, contexts=contexts))
    every = relay_every_advertisement(fed, wire, config)
    view = ShareKeysRequest(
        config.session_id, tuple(a for a in every.advertisements if a.client_id in ("c0", "c1"))
    )
    assert wire.deliver("c0", "R1", view) == []
    assert_refused_in_r1(wire, ("c0",), SurvivorsBelowThresholdError)
    fresh = Wire(clients_for(fed, policy=DEPLOYMENT, contexts=contexts, seed=b"fresh"))
    assert fresh.deliver("c0", "R0", AdvertiseRequest(dataclasses.replace(config, threshold=2))) == []
    assert fresh.refusals["c0"].round == "R0"
    assert type(fresh.refusals["c0"].error) is InvalidSessionConfigError


def test_the_session_context_covers_the_study_the_round_and_every_array() -> None:
    coef = teacher()
    base = binding.session_context(study_bytes(), "2", {"coef": coef})
    assert len(base) == 32 and base == binding.session_context(study_bytes(), "2", {"coef": coef.copy()})
    changed = coef.copy()
    changed[5, 2] = np.nextafter(changed[5, 2], np.inf)  # one ulp of one weight
    others = [
        binding.session_context(study_bytes(min_neg=49), "2", {"coef": coef}),
        binding.session_context(study_bytes(), "1", {"coef": coef}),
        binding.session_context(study_bytes(), "2", {"coef": changed}),
        binding.session_context(study_bytes(), "2", {"coef": coef.reshape(3, 6)}),
        binding.session_context(study_bytes(), "2", {"W": coef}),
        binding.session_context(study_bytes(), "2", {"coef": coef, "offset": np.zeros(3)}),
        binding.session_context(study_bytes(), "2"),
    ]
    assert len({base, *others}) == len(others) + 1
    config = config_for(federation(2), threshold=2, min_group_size=2, session_id=b"D" * 32)
    assert binding.config_digest(config, base) != binding.config_digest(config, others[0])
    assert binding.config_digest(config, base) != binding.config_digest(config)
    with pytest.raises(LocalProtocolError, match="32 bytes"):
        binding.config_digest(config, b"short")


def test_the_simulator_binds_its_round_context_through_the_same_path() -> None:
    """The in-process driver hands one context to every client and the server (the backend's
    ``client_session(..., context=)``), and the simulator's context names its config and round."""
    from secure_afl.aggregation.backend import MaskingBackend
    from secure_afl.aggregation.inprocess import run_in_process
    from secure_afl.sim.setting import SimConfig, simulation_context

    fed = federation(3)
    config = SimConfig()
    w = teacher()
    context = simulation_context(config, "2", {"coef": w})
    assert context != simulation_context(config, "1", None)
    assert context != simulation_context(
        dataclasses.replace(config, gamma=config.gamma * 2), "2", {"coef": w}
    )
    run = run_in_process(
        MaskingBackend(threshold=2, client_policy=SIMULATOR), fed.inputs, symmetric=(), context=context
    )
    assert set(run.outcome.sums) == {"all"}
    for client in run.clients.values():
        assert client._context == context  # what its advertisement signed within the config digest
