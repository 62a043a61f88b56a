"""State transitions of the CKKS client and server, as tables.

Rules
-----
1. A client accepts one server message per state, in this order:

   ======================  =====================  ======================  ============================
   client state            accepts                replies                 next state
   ======================  =====================  ======================  ============================
   AWAIT_ADVERTISE_REQUEST CkksAdvertiseRequest   CkksAdvertise           AWAIT_KEY_REQUEST
   AWAIT_KEY_REQUEST       CkksKeyRequest         CkksKeyDistribution     AWAIT_INPUT_REQUEST
                                                  (key holder only)
   AWAIT_INPUT_REQUEST     CkksInputRequest       CkksInput               AWAIT_VIEW_REQUEST
   AWAIT_VIEW_REQUEST      CkksViewRequest        CkksViewSignature       AWAIT_DECRYPT_REQUEST
   AWAIT_DECRYPT_REQUEST   CkksDecryptRequest     CkksDecryption          AWAIT_DECRYPT_REQUEST
   ======================  =====================  ======================  ============================

   A decryptor has signed a view itself (R3) and decrypts only under that view, when the request
   carries at least t survivors' signatures over it.  It decrypts chunk sets of groups (SECURITY.md
   §7.6): a client stays in AWAIT_DECRYPT_REQUEST, since the server may ask it again for chunks
   whose decryptor dropped; it never decrypts one chunk of one group twice.  ``close()`` ends the
   session (DONE).
   A client in AWAIT_INPUT_REQUEST also accepts a repeated CkksKeyRequest (``CLIENT_REPEATS``):
   the key holder sent no key, and the server re-elects one among the advertisements accepted
   before, less that key holder only (the client refuses any other change); the new key holder
   replies with its CkksKeyDistribution, and the client stays in AWAIT_INPUT_REQUEST.
2. Any other message, or any failed check, moves the client to FAILED and drops its secrets; a FAILED
   or DONE client accepts nothing.  A local usage error leaves the state unchanged.
3. The server collects one message type per round and moves on when the driver calls ``next_round()``:

   ===========  ======================  ===========================  ===========================
   server       accepts                 next_round() sends           next round
   ===========  ======================  ===========================  ===========================
   (start)      -                       CkksAdvertiseRequest         ADVERTISE
   ADVERTISE    CkksAdvertise           CkksKeyRequest               KEYS
   KEYS         CkksKeyDistribution     CkksInputRequest             INPUT
   INPUT        CkksInput               CkksViewRequest              VIEW
   VIEW         CkksViewSignature       CkksDecryptRequest (with     DECRYPT
                                        every signature received)
   KEYS (no     -                       CkksKeyRequest without the   KEYS (re-election; at most
   key came)                            key holder                   once per advertised client)
   DECRYPT      CkksDecryption          CkksDecryptRequest (chunk    DECRYPT, or DONE (sends
                                        sets still without a sum, to  nothing) when every chunk
                                        another survivor)             of every group has its sum
   ===========  ======================  ===========================  ===========================

4. A client message the server rejects leaves the server's state unchanged.  A round that leaves a
   group below the minimum group size (a re-election included), no advertised client left to hold
   the key, fewer view signatures than a majority of the roster, or a group with no survivor left to
   decrypt raises :class:`~secure_afl.core.errors.SessionAbortedError`.
"""

from __future__ import annotations

import enum
from types import MappingProxyType

from .messages import (
    CkksAdvertise,
    CkksAdvertiseRequest,
    CkksDecryption,
    CkksDecryptRequest,
    CkksInput,
    CkksInputRequest,
    CkksKeyDistribution,
    CkksKeyRequest,
    CkksViewRequest,
    CkksViewSignature,
)


class CkksClientState(enum.Enum):
    AWAIT_ADVERTISE_REQUEST = "R0"
    AWAIT_KEY_REQUEST = "R1"
    AWAIT_INPUT_REQUEST = "R2"
    AWAIT_VIEW_REQUEST = "R3"
    AWAIT_DECRYPT_REQUEST = "R4"
    DONE = "done"
    FAILED = "failed"


class CkksServerRound(enum.Enum):
    NOT_STARTED = "not started"
    ADVERTISE = "R0"
    KEYS = "R1"
    INPUT = "R2"
    VIEW = "R3"
    DECRYPT = "R4"
    DONE = "done"


CLIENT_TRANSITIONS = MappingProxyType(
    {
        CkksClientState.AWAIT_ADVERTISE_REQUEST: (CkksAdvertiseRequest, CkksClientState.AWAIT_KEY_REQUEST),
        CkksClientState.AWAIT_KEY_REQUEST: (CkksKeyRequest, CkksClientState.AWAIT_INPUT_REQUEST),
        CkksClientState.AWAIT_INPUT_REQUEST: (CkksInputRequest, CkksClientState.AWAIT_VIEW_REQUEST),
        CkksClientState.AWAIT_VIEW_REQUEST: (CkksViewRequest, CkksClientState.AWAIT_DECRYPT_REQUEST),
        CkksClientState.AWAIT_DECRYPT_REQUEST: (CkksDecryptRequest, CkksClientState.AWAIT_DECRYPT_REQUEST),
    }
)

# A state that also accepts a repeat of the previous round's request: the key re-election.
CLIENT_REPEATS = MappingProxyType(
    {CkksClientState.AWAIT_INPUT_REQUEST: (CkksKeyRequest, CkksClientState.AWAIT_INPUT_REQUEST)}
)

SERVER_ACCEPTS = MappingProxyType(
    {
        CkksServerRound.ADVERTISE: CkksAdvertise,
        CkksServerRound.KEYS: CkksKeyDistribution,
        CkksServerRound.INPUT: CkksInput,
        CkksServerRound.VIEW: CkksViewSignature,
        CkksServerRound.DECRYPT: CkksDecryption,
    }
)

SERVER_NEXT_ROUND = MappingProxyType(
    {
        CkksServerRound.NOT_STARTED: CkksServerRound.ADVERTISE,
        CkksServerRound.ADVERTISE: CkksServerRound.KEYS,
        CkksServerRound.KEYS: CkksServerRound.INPUT,
        CkksServerRound.INPUT: CkksServerRound.VIEW,
        CkksServerRound.VIEW: CkksServerRound.DECRYPT,
    }
)
