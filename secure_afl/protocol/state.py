"""State transitions of the client and the server, as tables.

Rules
-----
1. A client accepts exactly one server message per state, in this order, and answers each with one
   message:

   ==========================  ===========================  ===========================
   client state                accepts                      next state
   ==========================  ===========================  ===========================
   AWAIT_ADVERTISE_REQUEST     AdvertiseRequest             AWAIT_SHARE_KEYS_REQUEST
   AWAIT_SHARE_KEYS_REQUEST    ShareKeysRequest             AWAIT_MASKED_INPUT_REQUEST
   AWAIT_MASKED_INPUT_REQUEST  MaskedInputRequest           AWAIT_CONSISTENCY_REQUEST
   AWAIT_CONSISTENCY_REQUEST   ConsistencyCheckRequest      AWAIT_UNMASK_REQUEST
   AWAIT_UNMASK_REQUEST        UnmaskRequest                DONE
   ==========================  ===========================  ===========================

2. Any other message, or any failed check, moves the client to FAILED; a FAILED or DONE client
   accepts nothing.  The transition is committed only after every check passed and the reply was
   built, so a client is never half-updated.  A local usage error leaves the state unchanged.

3. The server collects one message type per round from distinct clients and moves on only when
   the driver calls ``next_round()`` and at least t clients answered:

   ==================  ===================  ===========================  ==================
   server round        accepts              next_round() sends           next round
   ==================  ===================  ===========================  ==================
   (start)             -                    AdvertiseRequest             ADVERTISE
   ADVERTISE           AdvertiseKeys        ShareKeysRequest             SHARE_KEYS
   SHARE_KEYS          ShareKeys            MaskedInputRequest           MASKED_INPUT
   MASKED_INPUT        MaskedInput          ConsistencyCheckRequest      CONSISTENCY
   CONSISTENCY         ConsistencyResponse  UnmaskRequest                UNMASK
   UNMASK              UnmaskResponse       (unmasks the sums)           DONE
   ==================  ===================  ===========================  ==================

4. A client message the server rejects leaves the server's state unchanged (the client is then
   treated as dropped).  A round with fewer than t answers, or a group whose live members are
   fewer than the minimum group size, raises :class:`SessionAbortedError` and changes nothing.
"""

from __future__ import annotations

import enum
from types import MappingProxyType

from .messages import (
    AdvertiseKeys,
    AdvertiseRequest,
    ConsistencyCheckRequest,
    ConsistencyResponse,
    MaskedInput,
    MaskedInputRequest,
    ShareKeys,
    ShareKeysRequest,
    UnmaskRequest,
    UnmaskResponse,
)


class ClientState(enum.Enum):
    AWAIT_ADVERTISE_REQUEST = "R0"
    AWAIT_SHARE_KEYS_REQUEST = "R1"
    AWAIT_MASKED_INPUT_REQUEST = "R2"
    AWAIT_CONSISTENCY_REQUEST = "R3"
    AWAIT_UNMASK_REQUEST = "R4"
    DONE = "done"
    FAILED = "failed"


class ServerRound(enum.Enum):
    NOT_STARTED = "not started"
    ADVERTISE = "R0"
    SHARE_KEYS = "R1"
    MASKED_INPUT = "R2"
    CONSISTENCY = "R3"
    UNMASK = "R4"
    DONE = "done"


CLIENT_TRANSITIONS = MappingProxyType(
    {
        ClientState.AWAIT_ADVERTISE_REQUEST: (AdvertiseRequest, ClientState.AWAIT_SHARE_KEYS_REQUEST),
        ClientState.AWAIT_SHARE_KEYS_REQUEST: (ShareKeysRequest, ClientState.AWAIT_MASKED_INPUT_REQUEST),
        ClientState.AWAIT_MASKED_INPUT_REQUEST: (MaskedInputRequest, ClientState.AWAIT_CONSISTENCY_REQUEST),
        ClientState.AWAIT_CONSISTENCY_REQUEST: (ConsistencyCheckRequest, ClientState.AWAIT_UNMASK_REQUEST),
        ClientState.AWAIT_UNMASK_REQUEST: (UnmaskRequest, ClientState.DONE),
    }
)

SERVER_ACCEPTS = MappingProxyType(
    {
        ServerRound.ADVERTISE: AdvertiseKeys,
        ServerRound.SHARE_KEYS: ShareKeys,
        ServerRound.MASKED_INPUT: MaskedInput,
        ServerRound.CONSISTENCY: ConsistencyResponse,
        ServerRound.UNMASK: UnmaskResponse,
    }
)

SERVER_NEXT_ROUND = MappingProxyType(
    {
        ServerRound.NOT_STARTED: ServerRound.ADVERTISE,
        ServerRound.ADVERTISE: ServerRound.SHARE_KEYS,
        ServerRound.SHARE_KEYS: ServerRound.MASKED_INPUT,
        ServerRound.MASKED_INPUT: ServerRound.CONSISTENCY,
        ServerRound.CONSISTENCY: ServerRound.UNMASK,
        ServerRound.UNMASK: ServerRound.DONE,
    }
)
