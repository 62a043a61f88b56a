"""A small CKKS federation stepped round by round, with hooks to tamper with messages."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from secure_afl.aggregation.layout import flatten, layout_of
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.keys.identity import IdentityKey
from secure_afl.keys.roster import Roster, RosterEntry
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.protocol.ckks import codec, context
from secure_afl.protocol.ckks.client import CkksClientSession
from secure_afl.protocol.ckks.context import CkksParameters
from secure_afl.protocol.ckks.messages import CkksSessionConfig, DecryptedGroup
from secure_afl.protocol.ckks.server import CkksServerSession

D = 6  # Gram dimension of the small federation: the properties tested do not depend on it


def small_contributions(n_clients: int = 4, seed: int = 0, long_length: int = 0) -> dict:
    """Per client: its Gram in the "all" group, and ``b`` in "class/<k % 2>" (two classes of n/2).

    ``long_length`` adds a vector longer than one ciphertext's slots to the "all" group.
    """
    rng = np.random.default_rng(seed)
    out = {}
    for k in range(n_clients):
        h = rng.random((40, D)) * 10
        groups = {"all": {"gram": h.T @ h}, f"class/{k % 2}": {"b": h.sum(axis=0) - 100.0}}
        if long_length:
            groups["all"]["long"] = rng.standard_normal(long_length) * 1e3
        out[f"c{k}"] = groups
    return out


def plain_sums(contributions: Mapping, survivors: set[str] | None = None) -> dict:
    sums: dict = {}
    for cid, groups in contributions.items():
        if survivors is not None and cid not in survivors:
            continue
        for group, tensors in groups.items():
            for name, value in tensors.items():
                target = sums.setdefault(group, {})
                target[name] = target.get(name, 0) + np.asarray(value, dtype=np.float64)
    return sums


Hook = Callable[[str, object], object]  # (sender or recipient, message) -> message


class Federation:
    """Roster, client sessions and a server over ``contributions``; ``run`` steps every round.

    ``to_server(sender, message)`` and ``to_client(recipient, message)`` may replace a message;
    ``drop`` maps a round ("R1".."R3") to clients that stop answering from then on.  Every message
    travels through the codec; ``server_received`` keeps the bytes the server decoded.
    """

    def __init__(
        self,
        contributions: Mapping,
        *,
        min_group_size: int = 1,
        policy: ClientPolicy | None = None,
        ledgers: Mapping | None = None,
        parameters: CkksParameters | None = None,
        seed: bytes = b"ckks-tests",
        max_decryptors_per_group: int | None = None,
    ) -> None:
        self.policy = ClientPolicy.simulator() if policy is None else policy
        self.ledgers = ledgers or {}
        self.random = DeterministicRandomSource(seed)
        self.contributions = contributions
        self.ids = sorted(contributions)
        self.identities = {cid: IdentityKey.generate(self.random) for cid in self.ids}
        self.roster = Roster(RosterEntry(cid, cid, self.identities[cid].public_key) for cid in self.ids)
        layout = layout_of(contributions, ("gram",))
        self.layout = layout
        self.parameters = parameters or CkksParameters()
        self.config = CkksSessionConfig(
            self.random.token_bytes(32), min_group_size, self.parameters, layout.group_specs()
        )
        self.min_group_size = min_group_size
        self.clients = {cid: self.new_client(cid) for cid in self.ids}
        self.server = CkksServerSession(
            self.roster, self.config, max_decryptors_per_group=max_decryptors_per_group
        )
        self.server_received: list[bytes] = []
        self.requests_by_round: dict[str, dict[str, object]] = {}

    def rebuilt_client(self, cid: str, rounds: tuple[str, ...], limit: int = 1 << 30) -> CkksClientSession:
        """A copy of ``cid`` rebuilt as a deployed node is: a new session from its seed, with the
        server's requests of ``rounds`` to it replayed (sharing its ledger)."""
        copy = self.new_client(cid)
        for round_name in rounds:
            copy.replay_bytes(codec.encode(self.requests_by_round[round_name][cid], max_message_bytes=limit))
        return copy

    def new_client(self, cid: str) -> CkksClientSession:
        """A client session whose randomness is a stream seeded by its id (the same on every call)."""
        return CkksClientSession(
            cid,
            self.identities[cid],
            self.roster,
            {
                group: {name: flatten(v, name in self.layout.symmetric) for name, v in tensors.items()}
                for group, tensors in self.contributions[cid].items()
            },
            min_group_size=self.min_group_size,
            policy=self.policy,
            ledger=self.ledgers.get(cid),
            random=DeterministicRandomSource(b"client:" + cid.encode()),
        )

    def run(
        self,
        *,
        drop: Mapping[str, set[str]] | None = None,
        to_server: Hook | None = None,
        to_client: Hook | None = None,
        until: str | None = None,
    ) -> None:
        drop = drop or {}
        dropped: set[str] = set()
        limit = self.server.max_message_bytes
        requests = dict.fromkeys(self.ids, self.server.start())
        while requests:
            round_name = self.server.round.value
            self.requests_by_round.setdefault(round_name, {}).update(requests)
            if until == round_name:
                return
            dropped |= drop.get(round_name, set())
            for cid, request in requests.items():
                if cid in dropped:
                    continue
                if to_client is not None:
                    request = to_client(cid, request)
                client = self.clients[cid]
                message = codec.decode(
                    codec.encode(request, max_message_bytes=limit), max_message_bytes=limit
                )
                for reply in client.receive(message):
                    if to_server is not None:
                        reply = to_server(cid, reply)
                    data = codec.encode(reply, max_message_bytes=limit)
                    self.server_received.append(data)
                    self.server.receive(codec.decode(data, max_message_bytes=limit))
            requests = self.server.next_round()


def decrypted_tensors(config: CkksSessionConfig, group: DecryptedGroup) -> dict[str, np.ndarray]:
    """A decryption of every chunk of a group as its tensors (the chunks concatenated in order)."""
    layout = context.group_chunks(
        {t.name: t.length for t in config.group(group.group).tensors}, config.parameters
    )
    assert [c.index for c in group.chunks] == list(range(len(layout)))  # the whole group
    parts: dict[str, list[np.ndarray]] = {}
    for (tensor, _, _), chunk in zip(layout, group.chunks, strict=True):
        parts.setdefault(tensor, []).append(np.frombuffer(chunk.data, dtype="<f8"))
    return {tensor: np.concatenate(chunks) for tensor, chunks in parts.items()}
