"""DP under growth: what a chain of growing DP sessions needs to know of each session's noise and ε.

A growing study's DP session releases noisy sums over its **new** images only (each image enters
one session: the ledger's rule), and the server adds them to the earlier sessions' noisy sums
(:func:`secure_afl.growth.accumulate_sums`).  Two things then change at the chain's solve:

- **The noise adds.**  Session k's summed Gram carries independent noise of std ``s_k`` per entry
  at its actual survivors, so the chain's Gram carries ``√(Σ_k s_k²)``; the DP ridge's
  high-probability bound (:func:`secure_afl.privacy.dp_solve.ridge_for_noise`) is sized from that,
  with one failure probability β for the chain's final solve.  Likewise the λ_min release of
  ``ridge="adassp"``: the sum over sessions of the clients' λ_min is still a lower bound on the
  union's (superadditivity over PSD matrices), with std ``√(Σ_k s_{λ,k}²)``.
- **The ε.**  Under the image unit each image enters one session, so the sessions are releases
  over disjoint sets of images (parallel composition): the chain's ε per institution is the
  **max** over its sessions.  Under the patient unit a patient's images may arrive in several
  sessions (the cap ``max_images_per_patient`` holds per session), so the sessions compose: the
  chain's ε is that of every session's (ρ, ξ) events composed in one ``RdpAccountant``, at the
  last session's δ.

A node records its own :class:`NodeSpend` of every DP release in its signed ledger (from the plan
it derives from the study itself) and refuses a session whose :func:`chain_spend` over its
recorded releases would exceed its ``dp-epsilon`` (:mod:`secure_afl.deploy.client`).

:class:`SessionNoise` is one session's record (kept in the deployment's chain entries,
:mod:`secure_afl.deploy.sums`, and in the simulator's results); :class:`ChainNoise` the chain's.
Nothing here is computed from any one institution's data: noise scales and ε are functions of the
public plans and of who survived.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from secure_afl.privacy.dp_config import DpError

PARALLEL = "parallel"  # image unit: the max over sessions
COMPOSED = "rdp"  # patient unit: the sessions' events composed in an RdpAccountant


@dataclass(frozen=True)
class SessionNoise:
    """One DP session of a growing chain: its solve-relevant noise and what it spent."""

    gram_std: float  # per entry of the session's summed Gram, at its actual survivors
    eigen_std: float | None  # the λ_min release's (ridge="adassp") at its survivors; None without
    epsilon: Mapping[str, float]  # ε spent per institution by this session, at ``delta``
    events: Mapping[str, tuple[tuple[float, float], ...]]  # per institution its (ρ, ξ) events
    unit: str  # "image" or "patient"
    delta: float
    row_map: str  # the public map of the rows (projection, centring): sessions must share it

    def __post_init__(self) -> None:
        if not (math.isfinite(self.gram_std) and self.gram_std >= 0):
            raise DpError(f"a session's Gram noise std must be finite and non-negative, got {self.gram_std}")
        if self.eigen_std is not None and not (math.isfinite(self.eigen_std) and self.eigen_std >= 0):
            raise DpError(
                f"a session's λ_min noise std must be finite and non-negative, got {self.eigen_std}"
            )
        if self.unit not in ("image", "patient"):
            raise DpError(f"a session's DP unit must be image or patient, got {self.unit!r}")
        if set(self.epsilon) != set(self.events):
            raise DpError("a session's ε and events must name the same institutions")

    @classmethod
    def of(cls, plan: Any, gram_survivors: int, *, feature_dim: int | None = None) -> SessionNoise:
        """The record of a session run under ``plan`` (a :class:`~secure_afl.privacy.dp.NoisePlan`)
        whose ``all`` group (the Gram, and the λ_min release) had ``gram_survivors`` survivors."""
        from secure_afl.analytic import ALL_GROUP

        config = plan.config
        eigen = plan.blocks.get((ALL_GROUP, "eigen"))
        return cls(
            gram_std=plan.blocks[(ALL_GROUP, "gram")].group_std(gram_survivors),
            eigen_std=None if eigen is None else eigen.group_std(gram_survivors),
            epsilon=plan.epsilons(),
            events={k: tuple((float(r), float(x)) for r, x in plan.events(k)) for k in plan.slots},
            unit=config.unit,
            delta=config.delta,
            row_map=row_map_signature(config, feature_dim),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "gram_noise_std": self.gram_std,
            "eigen_noise_std": self.eigen_std,
            "epsilon_spent": dict(self.epsilon),
            "events": {k: [list(e) for e in v] for k, v in self.events.items()},
            "unit": self.unit,
            "delta": self.delta,
            "row_map": self.row_map,
        }

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> SessionNoise:
        try:
            eigen = document["eigen_noise_std"]
            return cls(
                gram_std=float(document["gram_noise_std"]),
                eigen_std=None if eigen is None else float(eigen),
                epsilon={str(k): float(v) for k, v in document["epsilon_spent"].items()},
                events={
                    str(k): tuple((float(r), float(x)) for r, x in v) for k, v in document["events"].items()
                },
                unit=str(document["unit"]),
                delta=float(document["delta"]),
                row_map=str(document["row_map"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise DpError(f"not a DP session record: {exc!r}") from None


def row_map_signature(config: Any, feature_dim: int | None) -> str:
    """What the rows are mapped by before clipping (public): the sums of two sessions add only when
    their rows live in the same space."""
    if config.projection_dim is None:
        projection = "none"
    else:
        projection = f"K={config.projection_dim},seed={config.projection_seed},d={feature_dim}"
    return f"projection:{projection};centre:{bool(config.row_centre)}"


@dataclass(frozen=True)
class ChainNoise:
    """Every DP session of a growing chain, oldest first: the chain's noise and ε."""

    sessions: tuple[SessionNoise, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not self.sessions:
            raise DpError("a DP chain has at least one session")
        units = {s.unit for s in self.sessions}
        if len(units) > 1:
            raise DpError(
                f"the chain's sessions protect different units ({sorted(units)}): the chain's ε would "
                "mix parallel and sequential composition; keep one dp-unit for every study of a chain"
            )
        maps = {s.row_map for s in self.sessions}
        if len(maps) > 1:
            raise DpError(
                f"the chain's sessions map their rows differently ({sorted(maps)}): their sums live in "
                "different spaces and do not add; keep --dp-dim, the projection seed and the row "
                "centring of the chain's first study"
            )
        eigen = {s.eigen_std is None for s in self.sessions}
        if len(eigen) > 1:
            raise DpError(
                "some of the chain's sessions released λ_min (ridge 'adassp') and some did not: keep one "
                "ridge kind for every study of a chain"
            )

    def extended(self, session: SessionNoise) -> ChainNoise:
        return ChainNoise((*self.sessions, session))

    @property
    def unit(self) -> str:
        return self.sessions[0].unit

    @property
    def gram_std(self) -> float:
        """The accumulated Gram's noise std per entry: independent noise, variances add."""
        return math.sqrt(sum(s.gram_std**2 for s in self.sessions))

    @property
    def eigen_std(self) -> float | None:
        if self.sessions[0].eigen_std is None:
            return None
        return math.sqrt(sum(float(s.eigen_std) ** 2 for s in self.sessions))  # type: ignore[arg-type]

    @property
    def composition(self) -> str:
        return PARALLEL if self.unit == "image" else COMPOSED

    def epsilons(self) -> dict[str, float]:
        """The chain's ε per institution: the max over sessions (image unit, disjoint images), or
        every session's events composed at the last session's δ (patient unit)."""
        institutions = sorted({k for s in self.sessions for k in s.epsilon})
        delta = self.sessions[-1].delta
        return {
            k: composed_epsilon(
                self.unit,
                [(s.epsilon[k], s.events[k]) for s in self.sessions if k in s.epsilon],
                delta,
            )
            for k in institutions
        }

    def describe(self) -> str:
        if self.composition == PARALLEL:
            return (
                "parallel composition: under the image unit each image enters one session, so the chain's "
                "ε per institution is the max over its sessions"
            )
        return (
            "sequential composition: under the patient unit a patient's images may arrive in several "
            "sessions, so every session's (ρ, ξ) events are composed in one RdpAccountant (at the last "
            "session's δ)"
        )

    def record(self) -> dict[str, Any]:
        """The classifier record's ``growth`` part: every session's ε and noise, and the chain's."""
        return {
            "sessions": [
                {
                    "session": i + 1,
                    "epsilon_spent": dict(s.epsilon),
                    "delta": s.delta,
                    "gram_noise_std": s.gram_std,
                    "eigen_noise_std": s.eigen_std,
                }
                for i, s in enumerate(self.sessions)
            ],
            "epsilon_chain": self.epsilons(),
            "delta_chain": self.sessions[-1].delta,
            "composition": self.composition,
            "composition_note": self.describe(),
            "gram_noise_std_chain": self.gram_std,
            "eigen_noise_std_chain": self.eigen_std,
        }


def composed_epsilon(
    unit: str, spends: Sequence[tuple[float, Sequence[tuple[float, float]]]], delta: float
) -> float:
    """One institution's ε over a chain's sessions, each given as (its ε, its (ρ, ξ) events): the
    max of the ε's under the image unit (disjoint images), every event composed in one
    ``RdpAccountant`` at ``delta`` under the patient unit."""
    if not spends:
        raise DpError("a chain's ε needs at least one session")
    if unit == "image":
        return max(float(epsilon) for epsilon, _ in spends)
    from secure_afl.privacy.dp import epsilon_of

    return epsilon_of([e for _, events in spends for e in events], delta)


@dataclass(frozen=True)
class NodeSpend:
    """What one DP session spends at one institution, as that institution's node records it (from
    the study's plan it derived itself, never from the server's chain records)."""

    epsilon: float  # at the session's own δ
    events: tuple[tuple[float, float], ...]  # its (ρ, ξ) events
    unit: str
    delta: float

    def __post_init__(self) -> None:
        if self.unit not in ("image", "patient"):
            raise DpError(f"a session's DP unit must be image or patient, got {self.unit!r}")
        if not (math.isfinite(self.epsilon) and self.epsilon >= 0):
            raise DpError(f"a session's ε must be finite and non-negative, got {self.epsilon}")

    @classmethod
    def of(cls, plan: Any, institution: str) -> NodeSpend:
        """``institution``'s spend in a session run under ``plan`` (a
        :class:`~secure_afl.privacy.dp.NoisePlan`)."""
        return cls(
            epsilon=plan.epsilon(institution),
            events=tuple((float(r), float(x)) for r, x in plan.events(institution)),
            unit=plan.config.unit,
            delta=plan.config.delta,
        )

    def to_json(self) -> dict[str, Any]:
        return {"epsilon": self.epsilon, "events": [list(e) for e in self.events], "unit": self.unit,
                "delta": self.delta}  # fmt: skip

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> NodeSpend:
        try:
            return cls(
                epsilon=float(document["epsilon"]),
                events=tuple((float(r), float(x)) for r, x in document["events"]),
                unit=str(document["unit"]),
                delta=float(document["delta"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise DpError(f"not a DP spend record: {exc!r}") from None

    def to_text(self) -> str:
        """The canonical JSON text a release carries into the ledger (``Release.spend``)."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_text(cls, text: str) -> NodeSpend:
        try:
            document = json.loads(text)
        except ValueError as exc:
            raise DpError(f"not a DP spend record: {exc}") from None
        return cls.from_json(document)


@dataclass(frozen=True)
class ChainSpend:
    """One institution's ε over its released sessions of a chain plus the session it is asked for."""

    earlier: float | None  # the earlier sessions' ε, composed as the chain composes (None: none)
    sessions: int  # how many earlier sessions
    session: float  # the new session's ε (at ``delta``)
    total: float  # the chain's ε with the new session (at ``delta``)
    delta: float
    composition: str  # PARALLEL or COMPOSED


def chain_spend(earlier: Sequence[NodeSpend], session: NodeSpend, delta: float) -> ChainSpend:
    """What ``session`` would take one institution's ε in a chain to, after its ``earlier`` released
    sessions of that chain, at the institution's own ``delta``: the max under the image unit, the
    composition of every session's events under the patient unit (as :meth:`ChainNoise.epsilons`)."""
    units = {s.unit for s in (*earlier, session)}
    if len(units) > 1:
        raise DpError(
            f"this institution's sessions of the chain protect different units ({sorted(units)}): the "
            "chain's ε would mix parallel and sequential composition; keep one dp-unit for every study "
            "of a chain"
        )
    unit = session.unit
    spent = [(s.epsilon, s.events) for s in earlier]
    return ChainSpend(
        earlier=composed_epsilon(unit, spent, delta) if spent else None,
        sessions=len(spent),
        session=composed_epsilon(unit, [(session.epsilon, session.events)], delta),
        total=composed_epsilon(unit, [*spent, (session.epsilon, session.events)], delta),
        delta=delta,
        composition=PARALLEL if unit == "image" else COMPOSED,
    )


def chain_of(records: Sequence[Mapping[str, Any] | None]) -> ChainNoise | None:
    """The DP chain of earlier sessions' JSON records (None: no DP session yet)."""
    sessions = [SessionNoise.from_json(r) for r in records if r is not None]
    return ChainNoise(tuple(sessions)) if sessions else None
