"""A scripted hostile server: it drives real ``ClientSession``s over the real wire codec.

It uses the honest :class:`ServerSession` for the bookkeeping it does not subvert, and departs
from the protocol where an attack needs it (discarding a masked input, showing different survivor
sets, running a second session).  Every byte a client sends is kept, and before each delivery the
client's secrets are noted (its self-mask seed, its mask private key, the shares it holds, its
unmasked encodings), so a test can assert that none of them ever left the client.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from secure_afl.core import encoding
from secure_afl.core.errors import ProtocolError
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.keys.identity import IdentityKey
from secure_afl.keys.roster import Roster, RosterEntry
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.protocol import codec, crypto, shamir
from secure_afl.protocol.client import ClientSession
from secure_afl.protocol.messages import GroupSpec, SessionConfig, TensorSpec, UnmaskResponse
from secure_afl.protocol.server import ServerSession
from secure_afl.protocol.state import ClientState

ROUNDS = ("R0", "R1", "R2", "R3", "R4")
WIRE_LIMIT = 1 << 30  # the hostile server's own encoder/decoder: it is not the party under test


@dataclass
class Federation:
    ids: tuple[str, ...]
    roster: Roster
    identities: dict[str, IdentityKey]
    inputs: dict[str, dict[str, dict[str, np.ndarray]]]  # client -> group -> tensor -> float64
    groups: dict[str, tuple[str, ...]]
    lengths: dict[str, int]


def federation(
    n: int, groups: Mapping[str, tuple[str, ...]] | None = None, *, lengths=None, seed: bytes = b"hostile"
) -> Federation:
    """Identities, a roster and inputs: each client sends the *same* value of a tensor to all its groups."""
    random = DeterministicRandomSource(seed)
    ids = tuple(f"c{i}" for i in range(n))
    groups = {"all": ids} if groups is None else dict(groups)
    lengths = {"gram": 6} if lengths is None else dict(lengths)
    identities = {cid: IdentityKey.generate(random) for cid in ids}
    roster = Roster(RosterEntry(cid, f"Hospital {cid}", identities[cid].public_key) for cid in ids)
    rng = np.random.default_rng(int.from_bytes(random.token_bytes(4), "big"))
    values = {cid: {t: rng.normal(scale=50.0, size=k) for t, k in lengths.items()} for cid in ids}
    inputs = {
        cid: {g: {t: values[cid][t] for t in lengths} for g, members in groups.items() if cid in members}
        for cid in ids
    }
    return Federation(ids, roster, identities, inputs, groups, lengths)


def config_for(fed: Federation, *, threshold: int, min_group_size: int, session_id: bytes) -> SessionConfig:
    return SessionConfig(
        session_id=session_id,
        threshold=threshold,
        min_group_size=min_group_size,
        frac_bits=32,
        groups=tuple(
            GroupSpec(g, tuple(TensorSpec(t, k) for t, k in sorted(fed.lengths.items())))
            for g in sorted(fed.groups)
        ),
    )


def clients_for(
    fed: Federation,
    *,
    policy: ClientPolicy,
    ids=None,
    ledgers: Mapping[str, object] | None = None,
    seed: bytes = b"clients",
    contexts: Mapping[str, bytes] | None = None,
) -> dict[str, ClientSession]:
    """``contexts``: the session context each client was given (one-view tests); none by default."""
    ledgers = ledgers or {}
    contexts = contexts or {}
    return {
        cid: ClientSession(
            cid,
            fed.identities[cid],
            fed.roster,
            fed.inputs[cid],
            policy=policy,
            ledger=ledgers.get(cid),
            random=DeterministicRandomSource(seed + cid.encode()),
            context=contexts.get(cid, b""),
        )
        for cid in (fed.ids if ids is None else ids)
    }


@dataclass
class Refusal:
    round: str
    error: ProtocolError


@dataclass
class Wire:
    """Delivers server messages to clients as bytes, keeps every byte they send, notes their secrets."""

    clients: dict[str, ClientSession]
    sent: dict[str, list[bytes]] = field(default_factory=dict)
    secrets: dict[str, set[bytes]] = field(default_factory=dict)
    refusals: dict[str, Refusal] = field(default_factory=dict)

    def deliver(self, cid: str, round_name: str, message) -> list:
        """The client's decoded replies, or [] when it refuses (noted in ``refusals``)."""
        client = self.clients[cid]
        self._note_secrets(cid)
        try:
            replies = client.receive_bytes(codec.encode(message, max_message_bytes=WIRE_LIMIT))
        except ProtocolError as error:
            self.refusals[cid] = Refusal(round_name, error)
            return []
        self.sent.setdefault(cid, []).extend(replies)
        self._note_secrets(cid)
        return [codec.decode(reply, max_message_bytes=WIRE_LIMIT) for reply in replies]

    def _note_secrets(self, cid: str) -> None:
        client = self.clients[cid]
        found = self.secrets.setdefault(cid, set())
        if client._seed:
            found.add(client._seed)
        if client._mask_key is not None:
            found.add(crypto.x25519_private_bytes(client._mask_key))
        for held in client._held.values():
            found.add(shamir.value_to_bytes(held.self_mask))
            found.add(shamir.value_to_bytes(held.mask_key))
        if client._config is not None:
            for group, tensors in client._inputs.items():
                size = len(client._members.get(group, ())) or 1
                for name, values in tensors.items():
                    found.add(encoding.encode(values, tensor=name, group_size=size).tobytes())

    def assert_nothing_leaked(self, cid: str) -> None:
        """After ``cid`` refused: it is FAILED with its secrets dropped, sent no revealed share, and no
        byte it ever sent holds its seed, its mask key, a share it holds or an unmasked encoding."""
        client = self.clients[cid]
        assert cid in self.refusals, f"{cid} did not refuse"
        assert client.state is ClientState.FAILED
        assert client._seed == b"" and client._mask_key is None and client._held == {}
        sent = self.sent.get(cid, [])
        assert not any(
            isinstance(codec.decode(m, max_message_bytes=WIRE_LIMIT), UnmaskResponse) for m in sent
        )
        for secret in self.secrets.get(cid, ()):
            for message in sent:
                assert secret not in message, f"a secret of {cid} left it"


def run(
    server: ServerSession,
    wire: Wire,
    *,
    absent: set[str] = frozenset(),
    discard_masked_input_of: set[str] = frozenset(),
    until: str = "R4",
) -> dict:
    """Play the session with the honest server's bookkeeping, except: ``absent`` clients are never
    asked; the masked inputs of ``discard_masked_input_of`` are thrown away (they "dropped after R2").
    Stops when a round cannot close (returns the server's pending requests)."""
    requests = dict.fromkeys([c for c in wire.clients if c not in absent], server.start())
    for round_name in ROUNDS:
        for cid, request in sorted(requests.items()):
            for reply in wire.deliver(cid, round_name, request):
                if round_name == "R2" and cid in discard_masked_input_of:
                    continue
                server.receive(reply)
        try:
            requests = server.next_round()
        except ProtocolError:
            return {}
        if round_name == until:
            return requests
    return requests
