"""In-process run of the masking backend, with the simulator's privacy audit.

The generic driver (:func:`secure_afl.aggregation.inprocess.run_in_process`) runs every client and
the server of :class:`~secure_afl.aggregation.backend.MaskingBackend` in one process with the real
wire encoding; this module adds the masking-specific threshold default and the audit.  The CKKS
backend's counterpart is :mod:`secure_afl.sim.ckks`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from secure_afl.aggregation.backend import MaskingBackend
from secure_afl.aggregation.inprocess import SessionCosts, dropout_stages, run_in_process
from secure_afl.aggregation.layout import Derivation
from secure_afl.core import encoding
from secure_afl.core.randomness import RandomSource
from secure_afl.privacy.guarantees import policy_name
from secure_afl.privacy.ledger import Ledger
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.sim.audit import PrivacyAudit, audit_run, audit_view

ROUNDS = ("R0", "R1", "R2", "R3", "R4")
DROPOUT_STAGES = ("R1", "R2", "R3", "R4")
# Bytes per client per round (R0..R4), client seconds per client per round, server seconds per round.
SecureAggregationCosts = SessionCosts


@dataclass(frozen=True, slots=True)
class SecureAggregationResult:
    """The group sums the server learns, and the audit of what that reveals."""

    sums: Mapping[str, Mapping[str, np.ndarray]]  # group -> tensor -> float64 (symmetric: full, or packed)
    members: Mapping[str, tuple[str, ...]]
    survivors: Mapping[str, tuple[str, ...]]
    audit: PrivacyAudit  # per group, and what linear combinations of the sums expose
    costs: SecureAggregationCosts
    threshold: int
    frac_bits: int
    session_id: bytes
    # group -> tensor -> how it was derived from wire sums (a plan; empty without one)
    derived: Mapping[str, Mapping[str, Derivation]] = field(default_factory=dict)

    @property
    def exposed(self) -> Mapping[str, tuple[str, ...]]:
        """Tensor -> the clients whose individual value follows from linear combinations of the sums."""
        return self.audit.exposed

    @property
    def warnings(self) -> tuple[str, ...]:
        """Every loud audit line, for reports."""
        return tuple(self.audit.warnings())


def default_threshold(n_clients: int) -> int:
    """t = floor(n/2) + 1: a strict majority (1 for one client, 2 for two, 5 for eight)."""
    return n_clients // 2 + 1


def secure_aggregate(
    contributions: Mapping[str, Mapping[str, Mapping[str, np.ndarray]]],
    *,
    symmetric: Collection[str] = ("gram",),
    threshold: int | None = None,
    min_group_size: int = 1,
    dropouts: Mapping[str, Collection[str]] = MappingProxyType({}),
    frac_bits: int = encoding.DEFAULT_FRAC_BITS,
    random: RandomSource | None = None,
    session_id: bytes | None = None,
    context: bytes = b"",
    client_policy: ClientPolicy | None = None,
    ledgers: Mapping[str, Ledger] | None = None,
    difference: bool = True,
    unpack: bool = True,
    consume: bool = False,
) -> SecureAggregationResult:
    """Sum ``contributions`` (client -> group -> tensor -> float64 array) per group by secure aggregation.

    ``symmetric`` names tensors that are symmetric matrices (sent as their upper triangle).
    ``threshold`` defaults to :func:`default_threshold`.  ``dropouts`` maps a stage ("R1".."R4") to
    the clients that stop answering at that stage.  Raises :class:`GroupTooSmallError` when a group's
    survivors are fewer than ``min_group_size`` and :class:`InsufficientParticipantsError` when fewer
    than t clients answer a round.  ``client_policy`` is every client's own policy (default
    :meth:`ClientPolicy.simulator`: go on and report exposures, which the audit attributes to the
    clients that saw them); under :meth:`ClientPolicy.deployment` a client refuses an exposing
    session with :class:`~secure_afl.core.errors.ExposureRefusedError`.  ``ledgers`` gives a
    client its session ledger (none by default: each call is a fresh history).  ``context`` is the
    session context every client binds (:func:`secure_afl.protocol.binding.session_context`).
    ``difference``: send the Gram by difference where that sends fewer copies (the default; the
    same sums and the same span of them, :mod:`secure_afl.aggregation.difference`); False keeps
    every group as the contributions name it.  ``unpack=False``: the sums of symmetric tensors stay
    packed (their upper triangles, 1-D), as :meth:`~secure_afl.analytic.GramFactors` takes them.
    ``consume=True`` hands the inputs over (:func:`run_in_process`): ``contributions`` (a dict) is
    emptied, and each client's values go once it has sent them; the audit reads an
    :func:`~secure_afl.sim.audit.audit_view` of them taken before.
    """
    client_policy = ClientPolicy.simulator() if client_policy is None else client_policy
    client_ids = tuple(sorted(contributions))
    if not client_ids:
        raise ValueError("no contributions")
    n = len(client_ids)
    threshold = default_threshold(n) if threshold is None else threshold
    if not 1 <= threshold <= n:
        raise ValueError(f"threshold must be in 1..{n}, got {threshold}")
    dropout_stages(dropouts, client_ids, DROPOUT_STAGES)
    audited = audit_view(contributions) if consume else contributions
    run = run_in_process(
        MaskingBackend(
            threshold=threshold, frac_bits=frac_bits, client_policy=client_policy, ledgers=ledgers or {}
        ),
        contributions,
        symmetric=symmetric,
        min_group_size=min_group_size,
        dropouts=dropouts,
        random=random,
        session_id=session_id,
        context=context,
        # Where most clients label each class (missing 1), the Gram travels by difference: to `all`
        # and to the complement of each class a client does not label, 2 copies instead of 8 at
        # the paper's 8 clients.  The plan is made only where its sums span what the class groups'
        # would (aggregation/difference.py), so the server learns nothing more; at missing 1 the
        # complements are single clients, whose Grams the class sums determine anyway (the audit
        # says so either way).  The run's audit lists the groups as sent.
        difference=difference,
        unpack=unpack,
        consume=consume,
    )
    outcome = run.outcome
    members, survivors, audit = audit_run(
        run, audited, protection="mask", client_policy=policy_name(client_policy)
    )
    return SecureAggregationResult(
        sums=outcome.sums,
        members=members,
        survivors=survivors,
        audit=audit,
        costs=run.costs,
        threshold=threshold,
        frac_bits=frac_bits,
        session_id=run.session_id,
        derived=run.layout.derivations(),
    )
