"""In-process run of the CKKS backend, with the simulator's privacy audit.

The counterpart of :mod:`secure_afl.sim.secure` (masking): the same generic driver
(:func:`secure_afl.aggregation.inprocess.run_in_process`), here over
:class:`~secure_afl.aggregation.backend.CkksBackend`.  Decryptors follow the simulator's policy:
an exposing group layout is reported, not refused (``ClientPolicy.simulator()``, the default).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from secure_afl.aggregation.backend import CkksBackend
from secure_afl.aggregation.inprocess import SessionCosts, run_in_process
from secure_afl.core.randomness import RandomSource
from secure_afl.privacy.guarantees import policy_name
from secure_afl.privacy.ledger import Ledger
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.protocol.ckks.context import CkksParameters
from secure_afl.sim.audit import PrivacyAudit, audit_run

ROUNDS = CkksBackend.rounds
DROPOUT_STAGES = ROUNDS[1:]


@dataclass(frozen=True, slots=True)
class CkksAggregationRun:
    """The group sums the server learns, who held and used the key, the audit and the costs."""

    sums: Mapping[str, Mapping[str, np.ndarray]]  # group -> tensor -> float64 (full matrix if symmetric)
    members: Mapping[str, tuple[str, ...]]
    survivors: Mapping[str, tuple[str, ...]]
    audit: PrivacyAudit
    costs: SessionCosts
    key_holder: str
    decryptors: Mapping[str, str]  # group -> who decrypted it (comma-separated when split by chunk)
    exposure_findings: tuple[str, ...]  # what the decryptors found and reported (policy "report")
    parameters: CkksParameters
    session_id: bytes

    @property
    def warnings(self) -> tuple[str, ...]:
        return tuple(self.audit.warnings())


def ckks_aggregate(
    contributions: Mapping[str, Mapping[str, Mapping[str, np.ndarray]]],
    *,
    symmetric: Collection[str] = ("gram",),
    min_group_size: int = 1,
    dropouts: Mapping[str, Collection[str]] = MappingProxyType({}),
    parameters: CkksParameters | None = None,
    client_policy: ClientPolicy | None = None,
    ledgers: Mapping[str, Ledger] | None = None,
    random: RandomSource | None = None,
    session_id: bytes | None = None,
    context: bytes = b"",
) -> CkksAggregationRun:
    """Sum ``contributions`` (client -> group -> tensor -> float64 array) per group under CKKS.

    ``dropouts`` maps a stage ("R1" key distribution, "R2" encrypted inputs, "R3" the signed view,
    "R4" decryption) to the clients that stop answering from that stage on.  Raises
    :class:`~secure_afl.core.errors.GroupTooSmallError` when a group keeps fewer survivors than
    ``min_group_size``, :class:`~secure_afl.protocol.ckks.errors.KeyHolderDroppedError` when no advertised
    client is left to hold the key (a key holder that drops before sending it is replaced by a
    re-election among the others), and :class:`~secure_afl.protocol.ckks.errors.NoDecryptorError`
    when every surviving member of a group dropped before decrypting;
    :class:`~secure_afl.protocol.ckks.errors.ViewQuorumError` when fewer than a majority of the
    clients signed the view (R3).  ``context`` is the session context every client binds
    (:func:`secure_afl.protocol.binding.session_context`).
    """
    backend = CkksBackend(
        parameters=parameters or CkksParameters(),
        client_policy=ClientPolicy.simulator() if client_policy is None else client_policy,
        ledgers=ledgers or {},
    )
    run = run_in_process(
        backend,
        contributions,
        symmetric=symmetric,
        min_group_size=min_group_size,
        dropouts=dropouts,
        random=random,
        session_id=session_id,
        context=context,
    )
    outcome = run.outcome
    members, survivors, audit = audit_run(
        run, contributions, protection="ckks", client_policy=policy_name(backend.client_policy)
    )
    findings: list[str] = []
    for client in run.clients.values():
        findings.extend(f.describe() for f in client.exposure_findings if f.describe() not in findings)  # type: ignore[attr-defined]
    return CkksAggregationRun(
        sums=outcome.sums,
        members=members,
        survivors=survivors,
        audit=audit,
        costs=run.costs,
        key_holder=str(outcome.details["key_holder"]),
        decryptors=dict(outcome.details["decryptors"]),  # type: ignore[call-overload]
        exposure_findings=tuple(findings),
        parameters=backend.parameters,
        session_id=run.session_id,
    )
