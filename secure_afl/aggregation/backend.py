"""One protection interface, two backends: pairwise masking and CKKS encryption.

A driver (the simulator's in-process driver, the Flower apps) holds a :class:`ProtectionBackend`
and asks it for a server session, client sessions, the wire codec and, at the end, the float64
group sums: it never needs to know which backend it has.  Both backends' sessions have one shape:

* server: ``start() -> message`` (broadcast), ``receive(message)``, ``next_round() -> {client: message}``
  (empty when the session is over), ``round`` (an enum whose ``value`` names the round, "R0".."R4"),
  ``max_message_bytes``;
* client: ``receive_bytes(data) -> [encoded replies]`` (maybe none; it decodes under its own
  per-message limits), ``receive(message) -> [replies]``, ``max_message_bytes``, ``exposure_findings``.

Each client runs under its own :class:`~secure_afl.privacy.policy.ClientPolicy` (refuse or report
exposing sessions, its floors) and, where given, its session ledger: both backends apply them.
Both sessions take a ``context`` (:func:`secure_afl.protocol.binding.session_context`: the study,
its round, round 2's teacher W), which both backends bind the same way: into the config digest that
every advertisement signs, so a client goes on only with advertisements that all sign its own view.

What each backend protects against is in SECURITY.md; ``trust_model`` says it in one line for audits,
from :mod:`secure_afl.privacy.guarantees` (the entry for the backend under its client policy).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from secure_afl.core.randomness import RandomSource
from secure_afl.core.workers import ONE_THREAD, Workers, for_this_process
from secure_afl.keys.identity import IdentityKey
from secure_afl.keys.roster import Roster
from secure_afl.privacy.guarantees import guarantee
from secure_afl.privacy.ledger import Ledger
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.privacy.release import Release
from secure_afl.protocol import (
    ckks,  # loads TenSEAL only when a CKKS name is first used
    encoding,
)
from secure_afl.protocol import codec as masking_codec
from secure_afl.protocol.client import ClientSession
from secure_afl.protocol.messages import SessionConfig
from secure_afl.protocol.server import ServerSession

from .layout import Layout

GroupSums = dict[str, dict[str, np.ndarray]]  # group -> tensor -> float64 array (symmetric: full, or packed)


class ServerSessionLike(Protocol):
    @property
    def max_message_bytes(self) -> int: ...
    @property
    def round(self) -> object: ...
    def start(self) -> object: ...
    def receive(self, message: object) -> None: ...
    def next_round(self) -> Mapping[str, object]: ...


class ClientSessionLike(Protocol):
    @property
    def max_message_bytes(self) -> int: ...
    @property
    def exposure_findings(self) -> tuple: ...
    def receive(self, message: object) -> list: ...
    def receive_bytes(self, data: bytes) -> list[bytes]: ...


@dataclass(frozen=True)
class SessionOutcome:
    """What a finished session gives the server: per group its members, survivors and float64 sums."""

    sums: GroupSums
    members: Mapping[str, tuple[str, ...]]
    survivors: Mapping[str, tuple[str, ...]]
    details: Mapping[str, object] = field(default_factory=dict)  # backend-specific (e.g. key holder)
    clients: tuple[str, ...] = ()  # every client whose inputs are in the sums


class ProtectionBackend(Protocol):
    """What a driver needs from a protection; see the module docstring."""

    name: str
    rounds: tuple[str, ...]  # round labels in order; a repeated last round keeps its label
    exact_sums: bool  # whether a difference plan (aggregation/difference.py) may be used
    # Threads a driver may start client sessions on, and the sessions' own for large tensors.
    workers: Workers

    @property
    def trust_model(self) -> str:
        """What this backend guarantees under its client policy, in one line (privacy.guarantees)."""
        ...

    def server_session(
        self, roster: Roster, layout: Layout, *, session_id: bytes, min_group_size: int, context: bytes = b""
    ) -> ServerSessionLike: ...

    def client_session(
        self,
        client_id: str,
        identity: IdentityKey,
        roster: Roster,
        inputs: Mapping[str, Mapping[str, np.ndarray]],
        *,
        session_id: bytes | None,
        min_group_size: int,
        random: RandomSource | None,
        release: Release | None = None,
        context: bytes = b"",
        rows: Mapping[str, int] | None = None,
        row_floors: Mapping[str, int] | None = None,
    ) -> ClientSessionLike: ...

    def encode(self, message: object, max_message_bytes: int) -> bytes: ...

    def decode(self, data: bytes, max_message_bytes: int) -> object: ...

    def outcome(self, server: ServerSessionLike, layout: Layout, *, unpack: bool = True) -> SessionOutcome:
        """The float64 sums; ``unpack=False`` leaves each symmetric tensor's sum as its packed upper
        triangle (1-D: half the memory; the solve unpacks one at a time)."""
        ...

    def sender(self, message: object) -> str:
        """The client id a client message claims (its signature is the server session's to check)."""
        ...

    def replay(self, client: ClientSessionLike, data: bytes) -> None:
        """Feed ``client`` a server message it already answered, to rebuild its state (the
        deployment's clients are rebuilt per message); the replies are not needed again."""
        ...

    def client_finished(self, client: ClientSessionLike) -> bool:
        """Whether the session needs nothing more of this client for sure (its secrets can go when
        the session ends; a later request, such as CKKS's replacement decryption, is optional)."""
        ...


def _client_floor(policy: ClientPolicy, min_group_size: int) -> int:
    """A client's minimum group size: the policy's floor, raised (never lowered) by the session's
    agreed ``min_group_size`` (a deployed client takes it from its study, not from the server)."""
    return max(policy.min_group_size, min_group_size)


def _shaped(layout: Layout, name: str, flat: np.ndarray, unpack: bool) -> np.ndarray:
    """A decoded wire sum in its tensor's shape; a symmetric one stays packed unless ``unpack``."""
    if not unpack and name in layout.symmetric:
        return flat
    return layout.unflatten(name, flat)


def _decoded(words: np.ndarray, frac_bits: int) -> np.ndarray:
    """A handed-over word sum decoded in its own memory; one that shares memory with another
    array (none does today) is decoded into a new one."""
    if words.base is None and words.flags.owndata:
        words.setflags(write=True)  # its own memory: a derived sum is returned read-only
        return encoding.decode_in_place(words, frac_bits=frac_bits)
    return encoding.decode(words, frac_bits=frac_bits)


def _sender(message: object) -> str:
    # An advertisement names its client (``client_id``); every later client message its ``sender``.
    for name in ("client_id", "sender"):
        value = getattr(message, name, None)
        if isinstance(value, str):
            return value
    raise TypeError(f"not a client message: {type(message).__name__}")


@dataclass(frozen=True)
class MaskingBackend:
    """Pairwise-masked secure aggregation (:mod:`secure_afl.protocol`), t-of-n Shamir recovery."""

    threshold: int
    frac_bits: int = encoding.DEFAULT_FRAC_BITS
    client_policy: ClientPolicy = field(default_factory=ClientPolicy.deployment)
    ledgers: Mapping[str, Ledger] = field(default_factory=dict)
    name: str = "mask"
    exact_sums: bool = True  # integer sums mod 2⁶⁴: a difference plan's derived sums are bit-exact
    rounds: tuple[str, ...] = ("R0", "R1", "R2", "R3", "R4")
    # Who masks a large tensor (a client in R2) and removes its self masks (the server in R4):
    # the same words on any count; by default this process's CPUs, at most workers.MAX_THREADS.
    workers: Workers = field(default_factory=for_this_process)

    @property
    def trust_model(self) -> str:
        return guarantee(self.name, self.client_policy).text

    def server_session(
        self, roster: Roster, layout: Layout, *, session_id: bytes, min_group_size: int, context: bytes = b""
    ) -> ServerSession:
        config = SessionConfig(
            session_id=session_id,
            threshold=self.threshold,
            min_group_size=min_group_size,
            frac_bits=self.frac_bits,
            groups=layout.group_specs(),
        )
        return ServerSession(
            roster, config, context=context, may_be_empty=layout.complement_groups, workers=self.workers
        )

    def client_session(  # type: ignore[no-untyped-def]
        self,
        client_id,
        identity,
        roster,
        inputs,
        *,
        session_id,
        min_group_size,
        random,
        release=None,
        context=b"",
        rows=None,
        row_floors=None,
    ):  # type: ignore[no-untyped-def]
        # The simulator's clients accept what the simulator's server proposes; a client under any
        # other policy keeps that policy's own floors (a deployed client never takes them from the server).
        floors = (
            {"min_threshold": self.threshold, "min_group_size": min_group_size}
            if self.client_policy == ClientPolicy.simulator()
            else {"min_group_size": _client_floor(self.client_policy, min_group_size)}
        )
        return ClientSession(
            client_id,
            identity,
            roster,
            inputs,
            **floors,  # type: ignore[arg-type]
            session_id=session_id,
            random=random,
            policy=self.client_policy,
            ledger=self.ledgers.get(client_id),
            release=release,
            context=context,
            rows=rows,
            row_floors=row_floors,
            workers=self.workers,
        )

    def encode(self, message: object, max_message_bytes: int) -> bytes:
        return masking_codec.encode(message, max_message_bytes=max_message_bytes)  # type: ignore[arg-type]

    def decode(self, data: bytes, max_message_bytes: int) -> object:
        return masking_codec.decode(data, max_message_bytes=max_message_bytes)

    def outcome(self, server: ServerSessionLike, layout: Layout, *, unpack: bool = True) -> SessionOutcome:
        # The server hands its sums over (it keeps none), so each is decoded in its own memory:
        # at d = 4096 nine Gram sums are 0.56 GiB of words, which would otherwise coexist with as
        # many decoded copies.  A difference plan's sums are derived on the words first (exact
        # mod 2⁶⁴); the wire sums that only served a derivation go with `wire`.
        result = server.take_result()  # type: ignore[attr-defined]
        # a derived group not on the wire (a partition plan's `all`) has its parts' clients
        members = layout.logical_members({g: s.members for g, s in result.groups.items()})
        survivors = layout.logical_members({g: s.survivors for g, s in result.groups.items()})
        clients = tuple(result.survivors)
        wire = {group: s.sums for group, s in result.groups.items()}
        del result
        words = layout.logical_words(wire)
        del wire
        sums: GroupSums = {}
        for group in list(words):
            tensors = words.pop(group)
            sums[group] = {}
            for name in list(tensors):
                sums[group][name] = _shaped(layout, name, _decoded(tensors.pop(name), self.frac_bits), unpack)
        return SessionOutcome(
            sums=sums,
            members=members,
            survivors=survivors,
            details={"threshold": self.threshold, "frac_bits": self.frac_bits},
            clients=clients,
        )

    def sender(self, message: object) -> str:
        return _sender(message)

    def replay(self, client: ClientSessionLike, data: bytes) -> None:
        client.receive_bytes(data)  # cheap, and deterministic from the seed

    def client_finished(self, client: ClientSessionLike) -> bool:
        # Every round of masking is needed (R3/R4 unmask the sums): finished means DONE.
        return getattr(getattr(client, "state", None), "name", "") == "DONE"


@dataclass(frozen=True)
class CkksBackend:
    """CKKS encryption (TenSEAL) under each client's :class:`ClientPolicy` (and ledger, if given)."""

    # a lambda: naming ckks.CkksParameters here would load TenSEAL when this module is imported
    parameters: ckks.CkksParameters = field(default_factory=lambda: ckks.CkksParameters())
    client_policy: ClientPolicy = field(default_factory=ClientPolicy.deployment)
    ledgers: Mapping[str, Ledger] = field(default_factory=dict)
    name: str = "ckks"
    exact_sums: bool = False  # approximate sums: no difference plan (it would scale up the noise)
    rounds: tuple[str, ...] = ("R0", "R1", "R2", "R3", "R4")
    workers: Workers = ONE_THREAD  # TenSEAL's contexts are not known to be safe across threads

    @property
    def trust_model(self) -> str:
        return guarantee(self.name, self.client_policy).text

    def server_session(
        self, roster: Roster, layout: Layout, *, session_id: bytes, min_group_size: int, context: bytes = b""
    ) -> ckks.CkksServerSession:
        config = ckks.CkksSessionConfig(session_id, min_group_size, self.parameters, layout.group_specs())
        return ckks.CkksServerSession(roster, config, context=context)

    def client_session(  # type: ignore[no-untyped-def]
        self,
        client_id,
        identity,
        roster,
        inputs,
        *,
        session_id,
        min_group_size,
        random,
        release=None,
        context=b"",
        rows=None,
        row_floors=None,
    ):  # type: ignore[no-untyped-def]
        return ckks.CkksClientSession(
            client_id,
            identity,
            roster,
            inputs,
            min_group_size=(
                min_group_size
                if self.client_policy == ClientPolicy.simulator()
                else _client_floor(self.client_policy, min_group_size)
            ),
            session_id=session_id,
            policy=self.client_policy,
            ledger=self.ledgers.get(client_id),
            random=random,
            release=release,
            context=context,
            rows=rows,
            row_floors=row_floors,
        )

    def encode(self, message: object, max_message_bytes: int) -> bytes:
        return ckks.codec.encode(message, max_message_bytes=max_message_bytes)  # type: ignore[arg-type]

    def decode(self, data: bytes, max_message_bytes: int) -> object:
        return ckks.codec.decode(data, max_message_bytes=max_message_bytes)

    def outcome(self, server: ServerSessionLike, layout: Layout, *, unpack: bool = True) -> SessionOutcome:
        if layout.derived:
            raise ValueError("CKKS sums are approximate: a difference plan is for exact sums only")
        result = server.result()  # type: ignore[attr-defined]
        sums = {
            group: {
                name: _shaped(layout, name, np.array(values), unpack)
                for name, values in group_sum.sums.items()
            }
            for group, group_sum in result.groups.items()
        }
        return SessionOutcome(
            sums=sums,
            members={g: s.members for g, s in result.groups.items()},
            survivors={g: s.survivors for g, s in result.groups.items()},
            details={
                "key_holder": result.key_holder,
                "replaced_key_holders": list(result.replaced_key_holders),
                # A group split by chunk over several decryptors names them all, comma-separated.
                "decryptors": {g: ",".join(s.decryptors) for g, s in result.groups.items()},
                "parameters": {
                    "poly_modulus_degree": self.parameters.poly_modulus_degree,
                    "coeff_mod_bit_sizes": list(self.parameters.coeff_mod_bit_sizes),
                    "scale_bits": self.parameters.scale_bits,
                    "output_frac_bits": self.parameters.output_frac_bits,
                },
            },
            clients=tuple(result.survivors),
        )

    def sender(self, message: object) -> str:
        return _sender(message)

    def replay(self, client: ClientSessionLike, data: bytes) -> None:
        client.replay_bytes(data)  # type: ignore[attr-defined]  # no new key, no re-encryption

    def client_finished(self, client: ClientSessionLike) -> bool:
        # Once its encrypted inputs are out (R2) a client owes nothing for sure: the server asks it
        # to sign the view (R3) and maybe to decrypt (R4), but any t survivors can sign, and any
        # surviving member that signed can decrypt.
        state = getattr(getattr(client, "state", None), "name", "")
        return state in ("AWAIT_VIEW_REQUEST", "AWAIT_DECRYPT_REQUEST", "DONE")
