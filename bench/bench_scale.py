"""Growth with the number of institutions: one client's protocol seconds, the server's
seconds and one client's exposure-check seconds, per layout.

Layouts (labels from ``assign_partial_labels(n, 8, missing, seed)``, 8 classes, the first seed
from 0 that gives every class at least two labellers):

- ``missing1`` .. ``missing7``: the per-class Gram layout (round 1, ``gram="class"``): per labelled
  class a group ``class/<c>`` with ``gram`` (d×d, sent as its upper triangle) and ``b/<c>``;
- ``global``: the global-Gram layout at missing 1 (``gram="global"``): ``b/<c>`` per class group,
  ``gram`` once, in ``all``.

Every layout is sent as the product's masked driver sends it: where
:func:`secure_afl.aggregation.difference.plan_wire` makes a plan (at n = 1,000 missing 1 and 3:
``all`` plus a complement group per class, 2,000 Gram copies instead of 7,000 and 4,000 instead of
5,000) the clients send the wire groups and the server derives the class sums; ``difference_plan``
records the copies of each (null: no plan).  ``--direct`` sends every group as the method names it,
to measure the plan side by side.

How it is measured.  ``--session`` runs one full masked session in process
(:func:`secure_afl.aggregation.inprocess.run_in_process`: every client and the server, real wire
encoding, t = floor(2n/3) + 1, groups of at least 2), under the deployment policy except that a
client goes on where its check finds exposure (so that the session finishes and its costs can be
read): ``client_seconds`` is the median over clients of one client's seconds in all rounds (its
exposure checks included), ``server_seconds`` the server's seconds in all rounds.  With
``--no-session`` the session is not run and those two are null.

``--one-client`` (the default above 200 clients: a full session of n clients in one process costs
n clients' work, about 1,000 CPU-s at n = 1,000) runs one real :class:`ClientSession` (the first
id) and the real :class:`ServerSession` through the wire codec against n - 1 peers whose messages
the bench builds itself (:func:`one_client_session` says exactly what a peer does differently and
why neither party's work changes).  Its figures are CPU-seconds of this process
(``time.process_time``, so other load on the host does not enter): ``client_seconds`` the client's
``receive_bytes`` in all rounds without its exposure checks (those, run inside R3 and R4, are timed
apart: ``client_with_exposure_seconds`` includes them; the cyclic collector is frozen while the
client runs, since in a deployment its process holds neither the server's state nor the peers',
whose full collections otherwise land in whichever client round they happen to fall: about 0.4 s
each while the server held its 10⁶ relayed shares as objects, before they became columns),
``server_seconds`` the server's decoding and handling of all n clients' messages, its round
closes and the encoding of every request.  Per round in ``client_round_seconds`` and
``server_round_seconds``.  ``mask_words`` counts the AES-CTR
keystream words each needs (the client: per tensor of each of its groups one self mask and one
pairwise mask per other member; the server: every survivor's self mask, no one drops) and
``mask_floor_seconds`` is 8 bytes times that over ``keystream_bytes_per_second``, measured in the
same run on prg's own path: the arithmetic floor of the masks.  Peers' contributions are drawn one
at a time (:func:`one_contribution`), so n Grams of d × d are never held at once; the exposure
check then runs on :func:`contributions_for` at d = min(d, 16) (``exposure_dim``): it reads which
tensors go to which groups, not their values.
``exposure_seconds`` is always measured: the call each client makes before it signs the survivor
set (``client_exposures`` over its groups with every member live and c = n - t colluders), for the
first client, with its verdict (``exposure_verdicts``: safe, exposed or undecided = refused at the
work bound).

Run from the repository root:
``python bench/bench_scale.py --clients N --json FILE [--dim 16] [--session | --one-client]
[--layouts ...] [--direct] [--micro]``.
``--micro`` adds CPU-seconds of the server's Shamir recovery of n owners at t = floor(2n/3) + 1
(one Lagrange basis, as the server does now, against the per-owner interpolation it did before,
the latter only up to n = 256), and the client statistics (5,889 rows, d = 1024, one thread)
against a bare numpy syrk of the same float64 shape.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import resource
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime

import numpy as np

from secure_afl.aggregation.backend import MaskingBackend
from secure_afl.aggregation.difference import WirePlan, plan_wire
from secure_afl.aggregation.inprocess import run_in_process
from secure_afl.aggregation.layout import Layout, layout_of
from secure_afl.analytic import ClientStatistics, Contributions, sum_contributions
from secure_afl.core import encoding
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.keys.identity import IdentityKey
from secure_afl.keys.roster import Roster, RosterEntry
from secure_afl.privacy import exposure
from secure_afl.privacy.policy import ClientPolicy, active_threshold
from secure_afl.protocol import binding, codec, crypto, prg, shamir
from secure_afl.protocol.messages import (
    AdvertiseKeys,
    ConsistencyResponse,
    EncryptedShare,
    MaskedInput,
    MaskedTensor,
    RevealedShare,
    ShareKeys,
    UnmaskResponse,
)
from secure_afl.sim.partial import assign_partial_labels

N_CLASSES = 8
LAYOUTS = ("missing1", "missing3", "missing5", "missing7", "global")
SESSION_DEFAULT_MAX = 200


def layout_options(layout: str) -> tuple[int, str]:
    """(missing classes, gram scope) of a layout name."""
    if layout == "global":
        return 1, "global"
    if layout.startswith("missing") and layout[7:].isdigit():
        return int(layout[7:]), "class"
    raise ValueError(f"unknown layout {layout!r}: use one of {', '.join(LAYOUTS)}")


def client_ids(n: int) -> list[str]:
    return [f"site-{k:04d}" for k in range(n)]


def contributions_for(
    n: int, d: int, layout: str, *, rows: int = 24, seed: int = 0
) -> dict[str, Contributions]:
    """Each client's round-1 upload: statistics of ``rows`` random feature rows with labels that
    have a positive and a negative in every class."""
    missing, gram = layout_options(layout)
    for draw in range(100):  # groups of at least 2: redraw a labelling that leaves a class alone
        labels = assign_partial_labels(n, N_CLASSES, missing, seed=seed + draw, missing1="random")
        if min(len(s) for s in labels.coverage()) >= 2:
            break
    else:
        raise ValueError(f"no labelling of {n} clients at missing {missing} gives every class 2 labellers")
    rng = np.random.default_rng(seed)
    out = {}
    for cid, active in zip(client_ids(n), labels.active, strict=True):
        h = rng.exponential(size=(rows, d))
        y = (rng.random((rows, N_CLASSES)) < 0.3).astype(np.float64)
        y[0], y[1] = 1.0, 0.0
        stats = ClientStatistics(
            gram=h.T @ h,
            feat_sum=h.sum(axis=0),
            pos_sum=h.T @ y,
            n=rows,
            n_pos=y.sum(axis=0).astype(np.int64),
        )
        out[cid] = stats.contributions(list(active), gram=gram)
    return out


def planned(
    contributions: Mapping[str, Contributions],
) -> tuple[dict[str, Contributions], WirePlan | None]:
    """The contributions as the product's masked sessions send them: :func:`run_in_process`'s
    plan (groups of at least 2), or unchanged where it makes none."""
    members = {g: ids for g, (ids, _) in groups_of(contributions).items()}
    plan = plan_wire(
        members, layout_of(contributions), min_group_size=2, frac_bits=encoding.DEFAULT_FRAC_BITS
    )
    if plan is None:
        return dict(contributions), None
    return {cid: plan.wire(c) for cid, c in contributions.items()}, plan


def groups_of(
    contributions: Mapping[str, Contributions],
) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """group -> (its members, its tensors): what every client sees with no one dropped."""
    members: dict[str, list[str]] = {}
    tensors: dict[str, set[str]] = {}
    for cid, groups in sorted(contributions.items()):
        for group, values in groups.items():
            members.setdefault(group, []).append(cid)
            tensors.setdefault(group, set()).update(values)
    return {g: (tuple(members[g]), tuple(sorted(tensors[g]))) for g in members}


def exposure_check(contributions: Mapping[str, Contributions], cid: str) -> tuple[float, float, str, tuple]:
    """Wall and CPU seconds of ``cid``'s pre-signature check (all members live, c = n - t), its
    verdict and findings."""
    n = len(contributions)
    colluders = ClientPolicy.deployment().colluders(n, active_threshold(n))
    own = exposure.own_value_labels(contributions[cid])
    own_tensors = {t for _, t in own}
    relevant = {g: v for g, v in groups_of(contributions).items() if own_tensors & set(v[1])}
    started, cpu = time.perf_counter(), time.process_time()
    findings = exposure.client_exposures(cid, own, relevant, round_name="R3", colluders=colluders)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    if not findings:
        verdict = "safe"
    elif all(f.undecided for f in findings):
        verdict = "undecided"
    else:
        verdict = "exposed"
    return seconds, cpu, verdict, findings


def session(contributions: Mapping[str, Contributions], *, seed: int = 0, difference: bool = True):
    """One full in-process masked session; (median client seconds, server seconds, run)."""
    n = len(contributions)
    policy = replace(ClientPolicy.deployment(), refuse_exposure=False)  # go on, so costs are read
    backend = MaskingBackend(threshold=active_threshold(n), client_policy=policy)
    run = run_in_process(
        backend,
        contributions,
        min_group_size=2,
        random=DeterministicRandomSource(f"scale{seed}".encode()),
        difference=difference,
    )
    costs = run.costs
    per_client = [sum(costs.client_seconds[cid].values()) for cid in sorted(contributions)]
    return statistics.median(per_client), costs.total_server_seconds, run


EXPOSURE_MAX_DIM = 16  # the check reads the layout, not the values: n Grams of d × d need not exist


def measure(
    n: int,
    d: int,
    layouts: Sequence[str],
    *,
    run_session: bool,
    one_client: bool = False,
    difference: bool = True,
) -> dict:
    result: dict = {
        "command": f"python bench/bench_scale.py --clients {n} --dim {d}"
        + (" --session" if run_session else "")
        + (" --one-client" if one_client else "")
        + ("" if difference else " --direct")
        + f" --layouts {','.join(layouts)}",
        "difference_plan": {},
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "host": f"{platform.machine()}, {platform.python_version()}",
        "clients": n,
        "dim": d,
        "threshold": active_threshold(n),
        "colluders": ClientPolicy.deployment().colluders(n, active_threshold(n)),
        "client_seconds": {},
        "server_seconds": {},
        "exposure_seconds": {},
        "exposure_cpu_seconds": {},
        "exposure_verdicts": {},
        "sums_match_plaintext": {},
    }
    if one_client:
        result["mode"] = "one-client"
        result["exposure_dim"] = min(d, EXPOSURE_MAX_DIM)
        result["keystream_bytes_per_second"] = keystream_bytes_per_second()
        for key in ("client_with_exposure_seconds", "client_round_seconds", "server_round_seconds"):
            result[key] = {}
        result["mask_words"], result["mask_floor_seconds"] = {}, {}
    for layout in layouts:
        contributions = contributions_for(n, min(d, EXPOSURE_MAX_DIM) if one_client else d, layout)
        first = min(contributions)
        # The client checks what it sends: the wire groups (the same span of sums as the direct ones).
        wire, plan = planned(contributions) if difference else (contributions, None)
        result["difference_plan"][layout] = None if plan is None else dict(plan.savings)
        seconds, cpu, verdict, _ = exposure_check(wire, first)
        result["exposure_seconds"][layout] = seconds
        result["exposure_cpu_seconds"][layout] = cpu
        result["exposure_verdicts"][layout] = verdict
        if one_client:
            del contributions, wire  # at d = 1024, n = 1,000 the peers are built one at a time instead
            run = one_client_session(n, d, layout, difference=difference)
            for key in (
                "client_seconds",
                "client_with_exposure_seconds",
                "client_round_seconds",
                "server_seconds",
                "server_round_seconds",
                "sums_match_plaintext",
                "mask_words",
            ):
                result[key][layout] = run[key]
            rate = result["keystream_bytes_per_second"]
            result["mask_floor_seconds"][layout] = {
                party: 8 * words / rate for party, words in run["mask_words"].items()
            }
        elif run_session:
            client_s, server_s, run = session(contributions, difference=difference)
            plain = sum_contributions(contributions.values())
            result["client_seconds"][layout] = client_s
            result["server_seconds"][layout] = server_s
            result["sums_match_plaintext"][layout] = all(
                np.allclose(run.outcome.sums[g][t], plain[g][t], rtol=1e-9, atol=1e-6)
                for g in plain
                for t in plain[g]
            )
        else:
            result["client_seconds"][layout] = None
            result["server_seconds"][layout] = None
            result["sums_match_plaintext"][layout] = None
    return result


# --- one client and the server against peers whose messages are generated once (--one-client) ---


def labelling(n: int, layout: str, *, seed: int = 0) -> list[tuple[int, ...]]:
    """Each client's labelled classes: :func:`contributions_for`'s draw (groups of at least 2)."""
    missing, _ = layout_options(layout)
    for draw in range(100):
        labels = assign_partial_labels(n, N_CLASSES, missing, seed=seed + draw, missing1="random")
        if min(len(s) for s in labels.coverage()) >= 2:
            return [tuple(active) for active in labels.active]
    raise ValueError(f"no labelling of {n} clients at missing {missing} gives every class 2 labellers")


def one_contribution(k: int, active: Sequence[int], d: int, layout: str, *, rows: int = 24) -> Contributions:
    """Client k's round-1 upload (as :func:`contributions_for`, from a per-client seed, so that
    peers are generated one at a time and n Grams of d × d are never held at once)."""
    _, gram = layout_options(layout)
    rng = np.random.default_rng([k, d])
    h = rng.exponential(size=(rows, d))
    y = (rng.random((rows, N_CLASSES)) < 0.3).astype(np.float64)
    y[0], y[1] = 1.0, 0.0
    stats = ClientStatistics(
        gram=h.T @ h, feat_sum=h.sum(axis=0), pos_sum=h.T @ y, n=rows, n_pos=y.sum(axis=0).astype(np.int64)
    )
    return stats.contributions(list(active), gram=gram)


def _flat(contribution: Contributions, layout: Layout) -> dict[str, dict[str, np.ndarray]]:
    """Wire vectors, one packing per array object (the Gram shared by the class groups)."""
    packed: dict[int, np.ndarray] = {}
    out: dict[str, dict[str, np.ndarray]] = {}
    for group, tensors in contribution.items():
        out[group] = {}
        for name, values in tensors.items():
            if id(values) not in packed:
                packed[id(values)] = layout.flatten(name, values)
            out[group][name] = packed[id(values)]
    return out


def _layout(n: int, d: int, layout: str, labels: Sequence[tuple[int, ...]]) -> tuple[Layout, dict]:
    """The session layout (every group and its tensors' shapes) and group -> sorted members."""
    groups: dict[str, dict[str, np.ndarray]] = {}
    members: dict[str, list[str]] = {}
    for cid, active in zip(client_ids(n), labels, strict=True):
        shapes = one_contribution(0, active, d, layout, rows=2)  # shapes only: cheap at any d
        for group, tensors in shapes.items():
            groups.setdefault(group, dict(tensors))
            members.setdefault(group, []).append(cid)
    return layout_of({"shapes": groups}), {g: tuple(sorted(m)) for g, m in members.items()}


def _clock() -> float:
    """CPU-seconds of this process: the measured parties' work, whatever the host's other load."""
    return time.process_time()


class _Peer:
    """A peer whose messages the bench builds itself (see :func:`one_client_session`)."""

    def __init__(self, cid: str, identity: IdentityKey, random: DeterministicRandomSource) -> None:
        self.cid = cid
        self.identity = identity
        self.encryption_key = crypto.new_x25519_key(random)
        self.mask_key = crypto.new_x25519_key(random)
        self.seed = random.token_bytes(32)
        self.held_from_me: tuple[int, int] = (0, 0)


def one_client_session(n: int, d: int, layout: str, *, seed: int = 0, difference: bool = True) -> dict:
    """One real client (the first id) and the real server; the n - 1 peers' messages built here.

    Timed, as :func:`run_in_process` times them: the measured client's ``receive_bytes`` (decode,
    every check, its replies, encode) in every round, and the server's ``receive(decode(bytes))`` of
    all n clients' messages plus its ``next_round`` and the encoding of every request it sends.
    Building the peers' messages is not timed.  What a peer does differently from a
    :class:`ClientSession`, and why that changes neither the measured client's work nor the
    server's:

    - its shares to other peers are random bytes of the right length under a real nonce: the
      server only relays them (it never decrypts a share), and no peer is measured;
    - its Shamir polynomials are s + a·g(x), with one random g of degree t - 1, g(0) = 0, for all
      peers (one evaluation of g at the n points instead of n): still of degree t - 1 with the
      peer's secret at 0, so the server's Lagrange recovery does the same work on 521-bit values;
      its shares to the measured client are encrypted for real (X25519, HKDF, AES-GCM);
    - its masked input carries its real self mask and its real pairwise mask with the measured
      client, but not the pairwise masks between two peers: those cancel in every group's sum, so
      the sums are unchanged, and the server adds bytes whose values do not change its work.

    The session ends with the sums unmasked and compared with the plaintext sums.
    """
    t = active_threshold(n)
    ids = client_ids(n)
    me = ids[0]
    labels = labelling(n, layout, seed=seed)
    session_layout, members = _layout(n, d, layout, labels)
    # The product's plan (run_in_process makes the same one): the wire's groups.
    plan = (
        plan_wire(members, session_layout, min_group_size=2, frac_bits=encoding.DEFAULT_FRAC_BITS)
        if difference
        else None
    )
    if plan is not None:
        session_layout = plan.wire_layout(session_layout)
        members = {**members, **plan.members}

    def upload(k: int) -> dict[str, dict[str, np.ndarray]]:
        contribution = one_contribution(k, labels[k], d, layout)
        return _flat(contribution if plan is None else plan.wire(contribution), session_layout)

    random = DeterministicRandomSource(f"scale-one{seed}".encode())
    session_id = random.token_bytes(32)
    identities = {cid: IdentityKey.generate(random) for cid in ids}
    roster = Roster(RosterEntry(cid, cid, identities[cid].public_key) for cid in ids)
    policy = replace(ClientPolicy.deployment(), refuse_exposure=False)
    backend = MaskingBackend(threshold=t, client_policy=policy)
    server = backend.server_session(roster, session_layout, session_id=session_id, min_group_size=2)
    config = server.config
    limit = server.max_message_bytes
    plain: dict[tuple[str, str], np.ndarray] = {}

    def add_plain(inputs: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        for group, tensors in inputs.items():
            for name, values in tensors.items():
                total = plain.setdefault((group, name), np.zeros_like(values))
                total += values

    my_inputs = upload(0)
    add_plain(my_inputs)
    client = backend.client_session(
        me, identities[me], roster, my_inputs, session_id=session_id, min_group_size=2, random=random
    )
    exposure_in_session = [0.0]
    gate_check = client._gate.check  # timed apart: the exposure check is its own figure

    def timed_check(*args, **kwargs):
        started = _clock()
        try:
            return gate_check(*args, **kwargs)
        finally:
            exposure_in_session[0] += _clock() - started

    client._gate.check = timed_check
    peers = {cid: _Peer(cid, identities[cid], random) for cid in ids[1:]}
    client_s = dict.fromkeys(backend.rounds, 0.0)
    server_s = dict.fromkeys(backend.rounds, 0.0)

    def to_server(round_name: str, message: object) -> None:
        data = codec.encode(message, max_message_bytes=limit)  # built here, decoded on the clock
        started = _clock()
        server.receive(codec.decode(data, max_message_bytes=limit))
        server_s[round_name] += _clock() - started

    def serve(round_name: str, requests: Mapping[str, object]) -> bytes:
        """Encode every request (the server's time); run the measured client on its own."""
        started = _clock()
        wire: dict[int, bytes] = {}
        for request in requests.values():
            if id(request) not in wire:
                wire[id(request)] = codec.encode(request, max_message_bytes=limit)
        server_s[round_name] += _clock() - started
        # In a deployment the client is its own process: the cyclic collector's passes over the
        # server's and the peers' state are not its cost (frozen while it runs).
        gc.freeze()
        try:
            started = _clock()
            replies = client.receive_bytes(wire[id(requests[me])])
            client_s[round_name] += _clock() - started
        finally:
            gc.unfreeze()
        for reply in replies:
            started = _clock()
            server.receive(codec.decode(reply, max_message_bytes=limit))
            server_s[round_name] += _clock() - started
        return replies[0]

    def close(round_name: str) -> Mapping[str, object]:
        started = _clock()
        requests = server.next_round()
        server_s[round_name] += _clock() - started
        return requests

    # R0: real advertisements.
    started = _clock()
    first = server.start()
    server_s["R0"] += _clock() - started
    serve("R0", dict.fromkeys(ids, first))
    digest = binding.config_digest(config)
    my_groups = {cid: tuple(sorted(g for g, ids_g in members.items() if cid in ids_g)) for cid in ids}
    for cid, peer in peers.items():
        commitment = binding.self_mask_commitment(peer.seed, session_id, cid)
        domain, fields = binding.advertise_fields(
            session_id,
            cid,
            crypto.x25519_public_bytes(peer.encryption_key),
            crypto.x25519_public_bytes(peer.mask_key),
            commitment,
            digest,
            my_groups[cid],
        )
        advert = AdvertiseKeys(
            session_id,
            cid,
            fields[2],
            fields[3],
            commitment,
            digest,
            fields[6],
            crypto.sign(peer.identity.private_key, domain, *fields),
        )
        to_server("R0", advert)
    requests = close("R0")
    adverts = {a.client_id: a for a in requests[me].advertisements}

    # R1: the measured client's real shares; the peers' as described above.
    mine = codec.decode(serve("R1", requests), max_message_bytes=limit)
    my_shares = {share.recipient: share for share in mine.shares}
    points = {cid: roster.share_point(cid) for cid in ids}
    g_coefficients = [shamir.random_field_element(random) for _ in range(t - 1)]
    g_at = {}
    for cid, x in points.items():
        value = 0
        for coefficient in reversed(g_coefficients):
            value = (value + coefficient) * x % shamir.PRIME
        g_at[cid] = value
    slopes = {
        cid: (shamir.random_field_element(random), shamir.random_field_element(random)) for cid in peers
    }
    secrets = {
        cid: (int.from_bytes(p.seed, "big"), int.from_bytes(crypto.x25519_private_bytes(p.mask_key), "big"))
        for cid, p in peers.items()
    }

    def share_of(owner: str, holder: str) -> tuple[int, int]:
        (seed_value, key_value), (a, b) = secrets[owner], slopes[owner]
        return (seed_value + a * g_at[holder]) % shamir.PRIME, (key_value + b * g_at[holder]) % shamir.PRIME

    my_encryption_public = adverts[me].encryption_public_key
    filler = random.token_bytes(n * (crypto.NONCE_BYTES + 2 * shamir.VALUE_BYTES + crypto.TAG_BYTES))
    for cid, peer in peers.items():
        # The measured client's share to this peer, decrypted with the peer's key (it reveals it in R4).
        secret = crypto.x25519_shared_secret(peer.encryption_key, my_encryption_public)
        share = my_shares[cid]
        plaintext = crypto.decrypt_share(
            crypto.share_encryption_key(secret, session_id, me, cid),
            share.nonce,
            share.ciphertext,
            crypto.share_associated_data(session_id, me, cid),
            me,
        )
        peer.held_from_me = (
            shamir.value_from_bytes(plaintext[: shamir.VALUE_BYTES]),
            shamir.value_from_bytes(plaintext[shamir.VALUE_BYTES :]),
        )
        seed_share, key_share = share_of(cid, me)
        nonce = random.token_bytes(crypto.NONCE_BYTES)
        shares = [
            EncryptedShare(
                cid,
                me,
                nonce,
                crypto.encrypt_share(
                    crypto.share_encryption_key(secret, session_id, cid, me),
                    nonce,
                    shamir.value_to_bytes(seed_share) + shamir.value_to_bytes(key_share),
                    crypto.share_associated_data(session_id, cid, me),
                ),
            )
        ]
        size = crypto.NONCE_BYTES + 2 * shamir.VALUE_BYTES + crypto.TAG_BYTES
        for k, holder in enumerate(ids[1:]):
            if holder != cid:
                chunk = filler[k * size : (k + 1) * size]
                shares.append(
                    EncryptedShare(cid, holder, chunk[: crypto.NONCE_BYTES], chunk[crypto.NONCE_BYTES :])
                )
        to_server("R1", ShareKeys(session_id, cid, tuple(shares)))
    requests = close("R1")

    # R2: real self masks and pairwise masks with the measured client.
    serve("R2", requests)
    my_mask_public = adverts[me].mask_public_key
    for k, (cid, peer) in enumerate(peers.items(), start=1):
        inputs = upload(k)
        add_plain(inputs)
        pair_secret = crypto.x25519_shared_secret(peer.mask_key, my_mask_public)
        encoded: dict[int, np.ndarray] = {}
        tensors = []
        for group in sorted(inputs):
            for name in sorted(inputs[group]):
                values = inputs[group][name]
                if id(values) not in encoded:
                    encoded[id(values)] = encoding.encode(
                        values, tensor=name, frac_bits=config.frac_bits, group_size=len(members[group])
                    )
                words = encoded[id(values)].copy()
                keys = [(prg.self_mask_key(peer.seed, session_id, group, name, cid), 1)]
                if me in members[group]:
                    keys.append(
                        (
                            prg.pair_mask_key(pair_secret, session_id, group, name, cid, me),
                            prg.pair_sign(cid, me),
                        )
                    )
                prg.add_masks(words, keys)
                tensors.append(MaskedTensor(group, name, words.tobytes()))
        to_server("R2", MaskedInput(session_id, cid, tuple(tensors)))
    requests = close("R2")

    # R3: every peer signs the survivor set over the transcript.
    serve("R3", requests)
    survivors = requests[me].survivors
    domain, fields = binding.survivors_fields(
        session_id, digest, binding.advertisements_digest(session_id, adverts.values()), survivors
    )
    for cid, peer in peers.items():
        to_server(
            "R3",
            ConsistencyResponse(session_id, cid, crypto.sign(peer.identity.private_key, domain, *fields)),
        )
    requests = close("R3")

    # R4: every peer reveals its shares of every survivor's seed.
    serve("R4", requests)
    for cid, peer in peers.items():
        revealed = tuple(
            RevealedShare(
                owner,
                shamir.value_to_bytes(peer.held_from_me[0] if owner == me else share_of(owner, cid)[0]),
            )
            for owner in survivors
        )
        to_server("R4", UnmaskResponse(session_id, cid, revealed, ()))
    close("R4")

    result = server.result()
    matches = all(
        np.allclose(
            encoding.decode(result.groups[group].sums[name], frac_bits=config.frac_bits),
            total,
            rtol=1e-9,
            atol=1e-6,
        )
        for (group, name), total in plain.items()
    )
    protocol_seconds = sum(client_s.values())
    return {
        "client_seconds": protocol_seconds - exposure_in_session[0],
        "client_with_exposure_seconds": protocol_seconds,
        "client_exposure_in_session_seconds": exposure_in_session[0],
        "client_round_seconds": client_s,
        "server_seconds": sum(server_s.values()),
        "server_round_seconds": server_s,
        "sums_match_plaintext": matches,
        "mask_words": mask_words(members, session_layout, me),
    }


def mask_words(members: Mapping[str, tuple[str, ...]], layout: Layout, me: str) -> dict[str, int]:
    """AES-CTR keystream words the protocol needs: the measured client's (its self mask and one
    pairwise mask per other member, per tensor of its groups) and the server's (every survivor's
    self mask, per tensor of its groups; no one drops, so no pairwise mask)."""
    client = sum(
        len(ids) * length
        for group, ids in members.items()
        if me in ids
        for length in layout.groups[group].values()
    )
    server = sum(
        len(ids) * length for group, ids in members.items() for length in layout.groups[group].values()
    )
    return {"client": client, "server": server}


def keystream_bytes_per_second(words: int = 524_800, keys: int = 32, repeats: int = 5) -> float:
    """AES-256-CTR keystream bytes per CPU-second on this host on the masks' own path:
    :func:`prg.add_masks` of ``keys`` keys into one uint64 tensor of ``words`` (default: the
    d = 1024 Gram's upper triangle), as a client adds its self mask and pairwise masks (one thread,
    the best of ``repeats``, the tensor's pages touched first)."""
    tensor = np.ones(words, dtype=np.uint64)
    streams = [(bytes([k]) * 32, 1 if k % 2 else -1) for k in range(keys)]
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        prg.add_masks(tensor, streams)
        best = min(best, time.process_time() - started)
    return 8 * words * keys / best


def shamir_recovery(n: int, *, textbook: bool) -> float:
    """Seconds to recover n owners' secrets from the same t = floor(2n/3) + 1 revealers: one Lagrange
    basis for all (the server now), or the textbook interpolation per owner (the server before)."""
    from secure_afl.protocol import shamir

    t = active_threshold(n)
    random = DeterministicRandomSource(b"shamir-bench")
    xs = list(range(1, t + 1))
    ys = [[shamir.random_field_element(random) for _ in xs] for _ in range(n)]
    started = time.process_time()
    if textbook:
        for values in ys:
            shares = [shamir.Share(x, y) for x, y in zip(xs, values, strict=True)]
            total = 0
            for i, share_i in enumerate(shares):
                numerator, denominator = 1, 1
                for j, share_j in enumerate(shares):
                    if i != j:
                        numerator = numerator * (0 - share_j.x) % shamir.PRIME
                        denominator = denominator * (share_i.x - share_j.x) % shamir.PRIME
                total = (total + share_i.y * numerator * pow(denominator, -1, shamir.PRIME)) % shamir.PRIME
    else:
        basis = shamir.lagrange_coefficients(xs)
        for values in ys:
            shamir.combine(basis, values)
    return time.process_time() - started


def statistics_ratio(rows: int = 5889, d: int = 1024, repeats: int = 5, memory: str = "warm") -> dict:
    """client_statistics against a bare numpy syrk of the same float64 shape, one thread, CPU-s
    (median of ``repeats``, each dtype's calls alternated with the syrk's), for float64 and
    float32 features, both timed with their memory in the same state (``memory``, see
    :func:`_statistics_ratio`).  One thread means numpy's BLAS too (threadpoolctl): torch's
    setting alone left OpenBLAS on every core, and ``process_time`` summed them."""
    import torch
    from threadpoolctl import threadpool_limits

    from secure_afl.analytic import client_statistics

    torch.set_num_threads(1)
    with threadpool_limits(limits=1):
        return _statistics_ratio(client_statistics, rows, d, repeats, memory)


# Seconds a freed page waits before this host's kernel hands it back to the hypervisor (virtio
# balloon free page reporting: 2 s after a 2 MiB block is freed), with a margin.
COLD_IDLE_SECONDS = 4.0


def _statistics_ratio(
    client_statistics: Callable[..., object], rows: int, d: int, repeats: int, memory: str = "warm"
) -> dict:
    """Each dtype in its own loop, its calls alternated with the syrk's; every timed call finds its
    memory in the same state as the one it is compared with.

    ``memory="warm"``: each timed call comes right after an untimed call of its own kind, whose
    freed buffers it lands on.  ``"cold"``: each comes after :data:`COLD_IDLE_SECONDS` idle, so
    every buffer it allocates is memory the kernel had given back (on a VM with free page
    reporting the hypervisor maps it in again on first touch: kernel time per byte).  Timing
    one call straight after the other's (the method until 2026-12-05) left the syrk on warm
    memory and the statistics on memory freed two seconds earlier: at d = 4096 their second
    128 MiB product was cold, 0.28 CPU-s of kernel time that the syrk never paid."""
    if memory not in ("warm", "cold"):
        raise ValueError(f"memory is 'warm' or 'cold', got {memory!r}")
    rng = np.random.default_rng(0)
    h32 = rng.standard_normal((rows, d)).astype(np.float32)
    h64 = h32.astype(np.float64)
    y = (rng.random((rows, N_CLASSES)) < 0.2).astype(np.float64)

    def timed(call: Callable[[], object]) -> tuple[float, float]:
        if memory == "warm":
            call()
        else:
            gc.collect()
            time.sleep(COLD_IDLE_SECONDS)
        before = resource.getrusage(resource.RUSAGE_SELF)
        call()
        after = resource.getrusage(resource.RUSAGE_SELF)
        kernel = after.ru_stime - before.ru_stime
        return after.ru_utime - before.ru_utime + kernel, kernel

    out: dict[str, object] = {"memory": memory}
    for name, h in (("float64", h64), ("float32", h32)):
        syrk: list[tuple[float, float]] = []
        stats: list[tuple[float, float]] = []
        for _ in range(repeats):
            syrk.append(timed(lambda: h64.T @ h64))
            stats.append(timed(lambda h=h: client_statistics(h, y, device="cpu")))
        floor = statistics.median(t for t, _ in syrk)
        seconds = statistics.median(t for t, _ in stats)
        out[f"syrk_cpu_seconds_beside_{name}"] = floor
        out[f"{name}_cpu_seconds"] = seconds
        out[f"{name}_over_syrk"] = seconds / floor
        # Kernel time within those: page faults, and on a VM memory mapped in again.
        out[f"syrk_kernel_seconds_beside_{name}"] = statistics.median(k for _, k in syrk)
        out[f"{name}_kernel_seconds"] = statistics.median(k for _, k in stats)
    out["syrk_cpu_seconds"] = out["syrk_cpu_seconds_beside_float64"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, required=True)
    parser.add_argument("--json", required=True, help="where to write the figures")
    parser.add_argument("--dim", type=int, default=16, help="feature dimension d (default 16)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    session_flag = parser.add_mutually_exclusive_group()
    session_flag.add_argument("--session", dest="session", action="store_true", default=None)
    session_flag.add_argument("--no-session", dest="session", action="store_false")
    session_flag.add_argument(
        "--one-client",
        action="store_true",
        help="one real client and the server against peers' messages built once (default above 200 clients)",
    )
    parser.add_argument(
        "--direct",
        action="store_true",
        help="every group as the method names it: no difference plan (to measure the plan side by side)",
    )
    parser.add_argument(
        "--micro",
        action="store_true",
        help="also: Shamir recovery (one basis vs per owner) and client statistics vs a bare syrk",
    )
    args = parser.parse_args()
    layouts = [name for name in args.layouts.split(",") if name]
    for name in layouts:
        layout_options(name)
    one_client = args.one_client or (args.session is None and args.clients > SESSION_DEFAULT_MAX)
    run_session = not one_client and (
        args.clients <= SESSION_DEFAULT_MAX if args.session is None else args.session
    )
    result = measure(
        args.clients,
        args.dim,
        layouts,
        run_session=run_session,
        one_client=one_client,
        difference=not args.direct,
    )
    if args.micro:
        result["shamir_cpu_seconds"] = {
            f"n={n}": {
                "one_basis": shamir_recovery(n, textbook=False),
                "per_owner": shamir_recovery(n, textbook=True) if n <= 256 else None,
            }
            for n in (128, 256, args.clients)
        }
        result["statistics"] = statistics_ratio()
    with open(args.json, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
