"""A client's own exposure check with its session ledger: one implementation for every backend.

Both protection backends' clients (masking, :mod:`secure_afl.protocol.client`; CKKS,
:mod:`secure_afl.protocol.ckks.client`) ask the same question before a step that lets the server
learn sums: would the sums over the live members, with those of earlier sessions over the same input
(the ledger), determine one client's value?  Written once so that the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from secure_afl.keys.identity import IdentityKey
from secure_afl.privacy import exposure
from secure_afl.privacy.policy import ClientPolicy

from .errors import ExposureRefusedError, HistoryExposureRefusedError, LocalProtocolError

if TYPE_CHECKING:
    from secure_afl.privacy.ledger import Ledger

# group -> (live members, tensor names)
LiveGroups = Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]]


class ExposureGate:
    """One client's exposure check: its own values (by digest), its policy, its ledger."""

    def __init__(
        self,
        client_id: str,
        identity_key: IdentityKey,
        inputs: Mapping[str, Mapping[str, np.ndarray]],
        policy: ClientPolicy,
        ledger: Ledger | None,
        input_digest: bytes | None,
    ) -> None:
        self.client_id = client_id
        self.policy = policy
        # What this client sends where, by digest: its own unknowns in the exposure check.
        self.own_values = {
            (group, name): exposure.value_digest(values)
            for group, tensors in inputs.items()
            for name, values in tensors.items()
        }
        if input_digest is None:
            input_digest = exposure.input_digest(inputs)
        elif not isinstance(input_digest, bytes) or len(input_digest) != 32:
            raise LocalProtocolError("input_digest must be 32 bytes (a SHA-256 digest)")
        self.input_digest = input_digest
        self._ledger = ledger
        if ledger is not None:
            from secure_afl.privacy.ledger import LedgerOwner  # the ledger imports protocol.errors

            self._ledger_owner = LedgerOwner(client_id, identity_key)
            ledger.history(self._ledger_owner, input_digest)  # refuse a tampered ledger now, not later
        # What the checks found: went on past (simulator policy) or refused (recorded too).
        self.findings: list[exposure.ExposureFinding] = []

    def check(
        self,
        round_name: str,
        action: str,
        groups: LiveGroups,
        *,
        session_id: bytes,
        record: bool,
    ) -> tuple[exposure.ExposureFinding, ...]:
        """Check ``groups`` with the ledger's history; raise to refuse, else return the findings.

        With ``record`` the session is appended to the ledger in the same locked step as the check,
        so two sessions over one input cannot both pass before either is recorded.
        """
        found: list[exposure.ExposureFinding] = []

        def check(history: tuple[exposure.SessionRecord, ...]) -> None:
            findings = exposure.client_exposures(
                self.client_id, self.own_values, groups, round_name=round_name, history=history
            )
            if findings and self.policy.refuse_exposure:
                self.findings.extend(findings)
                error = (
                    HistoryExposureRefusedError
                    if all(f.with_history for f in findings)
                    else ExposureRefusedError
                )
                raise error(action, findings)
            found.extend(findings)

        if self._ledger is None:
            check(())
        elif not record:
            check(self._ledger.history(self._ledger_owner, self.input_digest))
        else:
            session = exposure.SessionRecord(
                session_id=session_id,
                groups=tuple(
                    exposure.GroupRecord(name, survivors, tensors)
                    for name, (survivors, tensors) in sorted(groups.items())
                ),
                own_values=tuple((g, t, d) for (g, t), d in sorted(self.own_values.items())),
            )
            self._ledger.check_and_record(self._ledger_owner, self.input_digest, session, check)
        return tuple(found)
