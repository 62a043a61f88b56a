"""What the deployment needs from a secure-aggregation backend (masking today; CKKS can plug in).

The drivers in :mod:`secure_afl.deploy.server` and :mod:`secure_afl.deploy.client` only see:

- a server session: ``start() -> message``, ``receive(message)``, ``next_round() -> {client: message}``
  (empty when the session is done), ``result()``, ``max_message_bytes``;
- a client session: ``receive_bytes(data) -> [encoded replies]`` (decoding and encoding under the
  session's own per-message limits);
- a codec to and from bytes, and the sender id of a client message;
- the float64 group sums of a finished session, per group and tensor, in the layout's shapes.

A client session is rebuilt for every Flower message from a 32-byte seed (the session's only
secret, kept in the SuperNode's local state, never sent) and the server messages received so far:
the backend's state machine must be deterministic given its injected randomness.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from secure_afl.aggregation.layout import Layout
from secure_afl.keys.identity import IdentityKey
from secure_afl.keys.roster import Roster
from secure_afl.privacy.policy import DEFAULT_MAX_CONFIG_BYTES, ClientPolicy
from secure_afl.protocol import codec, encoding
from secure_afl.protocol.client import ClientSession
from secure_afl.protocol.messages import (
    AdvertiseKeys,
    ConsistencyResponse,
    MaskedInput,
    SessionConfig,
    ShareKeys,
    UnmaskResponse,
)
from secure_afl.protocol.randomness import DeterministicRandomSource
from secure_afl.protocol.server import ServerSession

from .study import Study


class Backend(Protocol):
    name: str

    def server_session(self, roster: Roster, study: Study, layout: Layout, session_id: bytes) -> Any: ...

    def client_session(
        self,
        client_id: str,
        identity: IdentityKey,
        roster: Roster,
        inputs: Mapping[str, Mapping[str, np.ndarray]],
        seed: bytes,
        *,
        min_group_size: int,
        ledger: Any,
        input_digest: bytes | None = None,
    ) -> Any: ...

    def encode(self, message: object, limit: int) -> bytes: ...

    def decode(self, data: bytes, limit: int) -> object: ...

    def sender(self, message: object) -> str: ...

    def group_sums(self, result: Any, layout: Layout, study: Study) -> dict[str, dict[str, np.ndarray]]: ...


class MaskingBackend:
    """Pairwise masking (:mod:`secure_afl.protocol`), with the deployment's client floors."""

    name = "mask"
    # A client decodes a session's first message (the config) under its policy's bound.
    first_message_limit = DEFAULT_MAX_CONFIG_BYTES

    def server_session(
        self, roster: Roster, study: Study, layout: Layout, session_id: bytes
    ) -> ServerSession:
        config = SessionConfig(
            session_id=session_id,
            threshold=study.threshold_for(len(roster)),
            min_group_size=study.min_group_size,
            frac_bits=study.frac_bits,
            groups=layout.group_specs(),
        )
        return ServerSession(roster, config)

    def client_session(
        self,
        client_id: str,
        identity: IdentityKey,
        roster: Roster,
        inputs: Mapping[str, Mapping[str, np.ndarray]],
        seed: bytes,
        *,
        min_group_size: int,
        ledger: Any,
        input_digest: bytes | None = None,
    ) -> ClientSession:
        # The deployment policy is the client's own: t >= floor(2n/3)+1, groups of at least 2, the
        # exposure check, and the ledger of its earlier sessions over the same statistics.  The
        # session's randomness is a ChaCha20 stream from the seed, so replaying the server's
        # messages rebuilds exactly the same keys, shares and masks.  ``input_digest`` (DP) keys the
        # ledger on the statistics before the noise, so a rerun with fresh noise finds its history.
        policy = ClientPolicy.deployment()
        return ClientSession(
            client_id,
            identity,
            roster,
            inputs,
            min_group_size=max(policy.min_group_size, min_group_size),
            random=DeterministicRandomSource(seed),
            policy=policy,
            ledger=ledger,
            input_digest=input_digest,
        )

    def encode(self, message: object, limit: int) -> bytes:
        return codec.encode(message, max_message_bytes=limit)  # type: ignore[arg-type]

    def decode(self, data: bytes, limit: int) -> object:
        return codec.decode(data, max_message_bytes=limit)

    def sender(self, message: object) -> str:
        if isinstance(message, AdvertiseKeys):
            return message.client_id
        if isinstance(message, ShareKeys | MaskedInput | ConsistencyResponse | UnmaskResponse):
            return message.sender
        raise TypeError(f"not a client message: {type(message).__name__}")

    def group_sums(self, result: Any, layout: Layout, study: Study) -> dict[str, dict[str, np.ndarray]]:
        sums: dict[str, dict[str, np.ndarray]] = {}
        for group, group_sum in result.groups.items():
            sums[group] = {
                name: layout.unflatten(name, encoding.decode(words, frac_bits=study.frac_bits))
                for name, words in group_sum.sums.items()
            }
        return sums


BACKENDS: dict[str, Backend] = {"mask": MaskingBackend()}
