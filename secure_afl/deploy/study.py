"""The study: what every party of a deployment agrees on before any statistic moves.

Classes, feature dimension and backbone (so that every hospital's features mean the same thing),
the method's options, the protection (pairwise masking or CKKS encryption, with its parameters)
and the protocol's parameters.  The server sends it with each session's first
message; every client compares it with its own feature file and its own policy and refuses a
mismatch (:class:`~secure_afl.deploy.errors.StudyMismatchError`).  The classifier file records it.
"""

from __future__ import annotations

import hashlib
import json
import numbers
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from secure_afl.aggregation.layout import Layout
from secure_afl.core.encoding import DEFAULT_FRAC_BITS, MAX_FRAC_BITS, upper_triangle_length
from secure_afl.privacy.dp_config import DEFAULT_MAX_ROWS, DpConfig, DpError, check_pseudo_label_threshold
from secure_afl.statistics import MethodParameterError, check_method_parameter

from .errors import ConfigurationError, StudyParameterError

if TYPE_CHECKING:
    import numpy as np

    from secure_afl.aggregation.backend import ProtectionBackend
    from secure_afl.aggregation.difference import WirePlan
    from secure_afl.privacy.dp import NoisePlan
    from secure_afl.protocol.ckks.context import CkksParameters
    from secure_afl.stages import Recipe

SYMMETRIC_TENSORS = frozenset({"gram"})
ALL_GROUP = "all"  # the same names as secure_afl.analytic (which imports torch; this module must not)
EIGEN_TENSOR = "gram_min_eig"  # secure_afl.privacy.dp.EIGEN_TENSOR (dp imports torch)
# class_sums="positives": secure_afl.privacy.dp's TOTAL_SUM, TOTAL_COUNT, POSITIVE_SUM, POSITIVE_COUNT
TOTAL_SUM, TOTAL_COUNT, POSITIVE_SUM, POSITIVE_COUNT = "total_sum", "n_total", "wpos_sum", "wpos_n"
PROTECTIONS = ("mask", "ckks")  # the backends of secure_afl.aggregation.backend


def class_group(c: int) -> str:
    return f"class/{c}"


def pseudo_group(c: int) -> str:
    return f"pseudo/{c}"


def deployment_threshold(n_clients: int) -> int:
    """t = ⌊2n/3⌋ + 1: the threshold that resists an active server (SECURITY.md §3)."""
    return (2 * n_clients) // 3 + 1


# Each parameter's run-config key (`deploy app` or `deploy provision` --set KEY=VALUE).
RUN_CONFIG_KEYS = {
    "gamma": "gamma", "tau": "tau", "alpha": "alpha", "min_pos": "min-pos", "min_neg": "min-neg",
    "rounds": "rounds", "dim": "dim", "threshold": "threshold", "min_group_size": "min-group-size",
    "frac_bits": "frac-bits",
}  # fmt: skip


def _parameter_error(
    name: str, value: object, allowed: str, why: str, where: str = ""
) -> StudyParameterError:
    """The refusal of a study parameter: its name, value and range, why, and where it is set."""
    key = RUN_CONFIG_KEYS[name]
    return StudyParameterError(
        f"the study's {where}{name} = {value!r} is not {allowed}: {why}. The coordinator sets it in the "
        f"run config ({key} = ...; `deploy app` or `deploy provision` --set {key}=VALUE)"
    )


def _study_integer(study: Study, name: str, low: int, high: int | None, why: str) -> None:
    """The study's ``name`` as an int if it is an integer (not a bool) in ``[low, high]``, else
    :class:`StudyParameterError`."""
    value = getattr(study, name)
    allowed = f"an integer ≥ {low}" if high is None else f"an integer in [{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _parameter_error(name, value, allowed, why)
    if value < low or (high is not None and value > high):
        raise _parameter_error(name, value, allowed, why)
    object.__setattr__(study, name, int(value))


@dataclass(frozen=True)
class Method:
    """The analytic method's options (paper §III; ``gram="global"`` by default in deployments)."""

    gamma: float = 1.0
    balance: str = "client"
    gram: str = "global"
    rounds: int = 1
    alpha: float = 0.5
    tau: float = 0.7
    min_pos: int = 5
    min_neg: int = 50

    def __post_init__(self) -> None:
        """γ, α, τ, δ⁺ and δ⁻ by the method's own rule (:data:`~secure_afl.statistics.METHOD_PARAMETERS`,
        which the simulator's config shares), whatever the rounds: the study document carries them
        all, and a node refuses a study out of range in R0 (:meth:`Study.from_json`) before it
        computes anything.  Numbers are stored as the method uses them (γ = 2 as 2.0), so one
        study has one digest."""
        for name in ("gamma", "alpha", "tau", "min_pos", "min_neg"):
            try:
                value = check_method_parameter(name, getattr(self, name))
            except MethodParameterError as exc:
                raise _parameter_error(name, exc.value, exc.allowed, exc.why, "method.") from None
            object.__setattr__(self, name, value)
        if self.balance not in ("client", "global"):
            raise ConfigurationError(f"balance must be 'client' or 'global', got {self.balance!r}")
        if self.gram not in ("class", "global"):
            raise ConfigurationError(f"gram must be 'class' or 'global', got {self.gram!r}")
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds not in (1, 2):
            raise _parameter_error(
                "rounds", self.rounds, "1 or 2", "round 2 adds the pseudo-label round (paper §III)", "method."
            )


@dataclass(frozen=True)
class StudyDp:
    """Differential privacy for the released classifier (SECURITY.md §9), as the study states it.

    ``class_lists``: every roster institution's labelled classes (indices).  They are public
    before any data moves because a client sizes its noise from the membership of every group it
    joins (the fewest survivors with which a group may be unmasked); each client checks its own
    entry against its feature file, and the session id commits to the study (see
    :func:`study_session_id`), so every participant noises from the same plan.
    """

    epsilon: float
    class_lists: Mapping[str, tuple[int, ...]]
    delta: float = 1e-6
    clip: float = 32.0
    unit: str = "image"
    max_images_per_patient: int = 4
    # The most feature rows one institution may use (after the patient cap): the plan checks from it,
    # the clip and the group sizes that no upload can overflow the fixed-point encoding; a client
    # with more rows refuses the study.
    max_rows: int = DEFAULT_MAX_ROWS
    # --dp-dim: every client projects its rows with the public matrix derived from (dim, K, seed)
    # (secure_afl/privacy/projection.py) before clipping; the server solves in K dimensions and the
    # classifier holds W = P W_K.  None: no projection.  ridge: DpConfig.ridge.
    projection_dim: int | None = None
    projection_seed: int = 0
    ridge: str = "bound"
    class_sums: str = "split"  # DpConfig.class_sums
    row_centre: bool = False  # DpConfig.row_centre

    def config(self) -> DpConfig:
        """The privacy module's config, validated (:class:`ConfigurationError` names what is wrong)."""
        config = DpConfig(
            epsilon=float(self.epsilon),
            delta=float(self.delta),
            clip=float(self.clip),
            unit=self.unit,  # type: ignore[arg-type]
            max_images_per_patient=int(self.max_images_per_patient),
            max_rows=self.max_rows,
            projection_dim=self.projection_dim,
            projection_seed=self.projection_seed,
            ridge=self.ridge,  # type: ignore[arg-type]
            class_sums=self.class_sums,  # type: ignore[arg-type]
            row_centre=self.row_centre,
        )
        try:
            config.validate()
        except DpError as exc:
            raise ConfigurationError(str(exc)) from None
        return config

    def to_dict(self) -> dict[str, Any]:
        out = {
            "epsilon": self.epsilon,
            "delta": self.delta,
            "clip": self.clip,
            "unit": self.unit,
            "max_images_per_patient": self.max_images_per_patient,
            "max_rows": self.max_rows,
            "class_lists": {k: list(v) for k, v in sorted(self.class_lists.items())},
        }
        # Today's mechanism keeps its document (and digest); the projection and ridge only when used.
        if self.projection_dim is not None:
            out["projection_dim"] = self.projection_dim
            out["projection_seed"] = self.projection_seed
        if self.ridge != "bound":
            out["ridge"] = self.ridge
        if self.class_sums != "split":
            out["class_sums"] = self.class_sums
        if self.row_centre:
            out["row_centre"] = True
        return out

    @classmethod
    def from_dict(cls, document: Mapping[str, Any]) -> StudyDp:
        k = document.get("projection_dim")
        return cls(
            epsilon=float(document["epsilon"]),
            delta=float(document["delta"]),
            clip=float(document["clip"]),
            unit=str(document["unit"]),
            max_images_per_patient=int(document["max_images_per_patient"]),
            max_rows=int(document.get("max_rows", DEFAULT_MAX_ROWS)),
            class_lists={str(k): tuple(int(c) for c in v) for k, v in document["class_lists"].items()},
            projection_dim=None if k is None else int(k),
            projection_seed=int(document.get("projection_seed", 0)),
            ridge=str(document.get("ridge", "bound")),
            class_sums=str(document.get("class_sums", "split")),
            row_centre=document.get("row_centre", False),
        )


def parse_class_lists(text: str) -> dict[str, tuple[int, ...]]:
    """``"a=0,1;b=2"`` -> ``{"a": (0, 1), "b": (2,)}`` (the run config's ``class-lists``)."""
    out: dict[str, tuple[int, ...]] = {}
    for item in (part.strip() for part in text.split(";")):
        if not item:
            continue
        cid, sep, classes = item.partition("=")
        try:
            indices = tuple(sorted({int(c) for c in classes.split(",") if c.strip()}))
        except ValueError:
            indices = ()
        if not sep or not cid.strip() or not indices or cid.strip() in out:
            raise ConfigurationError(
                f"class-lists entry {item!r}: expected INSTITUTION=i,j,... (class indices), each "
                "institution once"
            )
        out[cid.strip()] = indices
    return out


def format_class_lists(class_lists: Mapping[str, tuple[int, ...]]) -> str:
    return ";".join(f"{cid}={','.join(map(str, classes))}" for cid, classes in sorted(class_lists.items()))


@dataclass(frozen=True)
class Study:
    classes: tuple[str, ...]
    dim: int
    backbone: Mapping[str, str]  # name, weights_id, preprocessing
    method: Method = field(default_factory=Method)
    threshold: int = 0  # 0: deployment_threshold(roster size)
    min_group_size: int = 2
    frac_bits: int = DEFAULT_FRAC_BITS  # masking's fixed-point bits
    dp: StudyDp | None = None  # None: no noise, the sums are released exactly (today's deployment)
    protection: str = "mask"  # "mask" (pairwise masking) or "ckks" (TenSEAL CKKS encryption)
    # CKKS parameters (with protection="ckks"; the study document carries them only then)
    ckks_degree: int = 8192
    ckks_coeff_mod_bit_sizes: tuple[int, ...] = (60, 40, 40, 60)
    ckks_scale_bits: int = 40
    # A growing study: the digest of the study it extends (""; none).  Each client then releases
    # only its images not yet released (its ledger says which) and the server adds the new sums to
    # the earlier ones (README, a federation that grows).
    extends: str = ""
    # Without DP: every roster institution's labelled classes (indices), published so that round 1
    # may send the per-class Gram by difference (:func:`round1_plan`); empty: none published.  Under
    # DP the lists are the DP settings' own (``dp.class_lists``).
    class_lists: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.classes or len(set(self.classes)) != len(self.classes):
            raise ConfigurationError("the study needs distinct class names")
        _study_integer(self, "dim", 1, None, "the features' dimension (the feature file's)")
        if set(self.backbone) != {"name", "weights_id", "preprocessing"}:
            raise ConfigurationError("the backbone needs exactly name, weights_id and preprocessing")
        _study_integer(self, "threshold", 0, None, "0 means ⌊2n/3⌋ + 1 for a roster of n (SECURITY.md §3)")
        _study_integer(self, "min_group_size", 1, None, "the fewest live members a group is summed over")
        _study_integer(self, "frac_bits", 0, MAX_FRAC_BITS, "masking's fixed-point bits (core/encoding.py)")
        if self.protection not in PROTECTIONS:
            raise ConfigurationError(
                f"protection must be one of {', '.join(PROTECTIONS)}, got {self.protection!r}"
            )
        if self.protection == "ckks":
            from secure_afl.protocol.ckks.errors import InvalidParametersError

            try:
                self.ckks_parameters().validate()
            except InvalidParametersError as exc:
                raise ConfigurationError(f"CKKS parameters: {exc}") from None
        if self.dp is not None:
            self._check_dp(self.dp)
        if self.extends:
            self._check_growth()
        if self.class_lists:
            self._check_class_lists()

    def _check_class_lists(self) -> None:
        if self.dp is not None:
            raise ConfigurationError(
                "a DP study lists the institutions' classes in its DP settings (dp.class_lists), not twice"
            )
        self._check_class_indices(self.class_lists)

    def _check_class_indices(self, class_lists: Mapping[str, Sequence[int]]) -> None:
        for cid, classes in class_lists.items():
            if not classes or any(not 0 <= c < len(self.classes) for c in classes):
                raise ConfigurationError(
                    f"class list of {cid!r}: {list(classes)} must name at least one class among "
                    f"0..{len(self.classes) - 1}"
                )

    def _check_growth(self) -> None:
        """A study that extends another must be additive (global balance, one round).  DP is allowed:
        the noisy sums add, and the chain's solve sizes its ridge from every session's noise
        (secure_afl/privacy/dp_growth.py); the chain must be DP in every study or in none (the server
        checks it against the earlier sums)."""
        if len(self.extends) != 64 or any(ch not in "0123456789abcdef" for ch in self.extends):
            raise ConfigurationError(
                f"extends must be the 64-hex-digit digest of the earlier study, got {self.extends!r}"
            )
        if self.method.balance != "global":
            raise ConfigurationError(
                "a growing study needs balance='global': the paper's per-client balance weights a client's "
                "rows by its own counts (Eq. 9), so new rows re-weight the earlier ones and the sessions' "
                "sums do not add"
            )
        if self.method.rounds != 1:
            raise ConfigurationError(
                "a growing study runs round 1 only: round 2's pseudo-labels come from the session's "
                "teacher, which changes with every session, so its sums do not add"
            )

    def _check_dp(self, dp: StudyDp) -> None:
        if self.protection != "mask":
            raise ConfigurationError(
                "differential privacy runs only with the masking protocol (protection 'mask'): TenSEAL's "
                "CKKS has no threshold decryption, so one client's noise could be read alone (SECURITY.md §9)"
            )
        if self.method.balance != "global" or self.method.gram != "global":
            raise ConfigurationError(
                "differential privacy needs balance='global' and gram='global' (plain sums and counts with "
                f"clean sensitivities, SECURITY.md §9); the study has balance={self.method.balance!r}, "
                f"gram={self.method.gram!r}"
            )
        try:
            dp.config().statistics_dim(self.dim)  # --dp-dim at most the features' dimension
        except DpError as exc:
            raise ConfigurationError(str(exc)) from None
        if not dp.class_lists:
            raise ConfigurationError(
                "differential privacy needs every institution's class list in the study (class-lists): a "
                "client sizes its noise from the membership of its groups before it masks"
            )
        self._check_class_indices(dp.class_lists)
        unlabelled = [self.classes[c] for c in range(len(self.classes)) if not any(
            c in classes for classes in dp.class_lists.values()
        )]  # fmt: skip
        if unlabelled:
            raise ConfigurationError(f"no institution labels {unlabelled}: every class needs one")

    @property
    def n_classes(self) -> int:
        return len(self.classes)

    def threshold_for(self, roster_size: int) -> int:
        return self.threshold or deployment_threshold(roster_size)

    def ckks_parameters(self) -> CkksParameters:
        from secure_afl.protocol.ckks.context import CkksParameters

        return CkksParameters(
            poly_modulus_degree=self.ckks_degree,
            coeff_mod_bit_sizes=tuple(self.ckks_coeff_mod_bit_sizes),
            scale_bits=self.ckks_scale_bits,
        )

    def backend(self, roster_size: int) -> ProtectionBackend:
        """The protection backend of this study (:mod:`secure_afl.aggregation.backend`), as both the
        server and every client build it: the deployment's client policy, no ledgers (a deployed
        client passes its own)."""
        from secure_afl.aggregation.backend import CkksBackend, MaskingBackend

        if self.protection == "ckks":
            return CkksBackend(parameters=self.ckks_parameters())
        return MaskingBackend(threshold=self.threshold_for(roster_size), frac_bits=self.frac_bits)

    def describe_protection(self) -> str:
        if self.protection == "ckks":
            return (
                f"ckks (N={self.ckks_degree}, moduli {list(self.ckks_coeff_mod_bit_sizes)}, "
                f"scale 2^{self.ckks_scale_bits})"
            )
        return f"mask (frac_bits={self.frac_bits})"

    def to_json(self) -> str:
        document = asdict(self)
        document["classes"] = list(self.classes)
        document["backbone"] = dict(self.backbone)
        # Without DP the document (and its digest) is what it was before DP existed.
        del document["dp"]
        if self.dp is not None:
            document["dp"] = self.dp.to_dict()
        # Masking (the default) keeps the document of before CKKS existed: the protection and the
        # CKKS parameters are written only when the study uses CKKS.
        if self.protection == "mask":
            for key in ("protection", "ckks_degree", "ckks_coeff_mod_bit_sizes", "ckks_scale_bits"):
                del document[key]
        else:
            document["ckks_coeff_mod_bit_sizes"] = list(self.ckks_coeff_mod_bit_sizes)
        if not self.extends:  # a study that extends none keeps the document it had
            del document["extends"]
        if self.class_lists:  # likewise a study that publishes no class lists
            document["class_lists"] = {k: list(v) for k, v in sorted(self.class_lists.items())}
        else:
            del document["class_lists"]
        return json.dumps(document, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Study:
        try:
            document = json.loads(text)
            return cls(
                classes=tuple(str(c) for c in document["classes"]),
                # The numbers as sent: the study refuses a bool, a text or a value out of range by
                # name (StudyParameterError) where int() would pass it on.
                dim=document["dim"],
                backbone={k: str(v) for k, v in document["backbone"].items()},
                method=Method(**document["method"]),
                threshold=document["threshold"],
                min_group_size=document["min_group_size"],
                frac_bits=document["frac_bits"],
                dp=StudyDp.from_dict(document["dp"]) if document.get("dp") is not None else None,
                extends=str(document.get("extends", "")),
                class_lists={
                    str(k): tuple(int(c) for c in v) for k, v in document.get("class_lists", {}).items()
                },
                **_protection_fields(document),
            )
        except ConfigurationError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigurationError(f"malformed study description: {exc}") from None

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()


def _protection_fields(document: Mapping[str, Any]) -> dict[str, Any]:
    """The protection and its parameters in a study document (absent: masking)."""
    protection = str(document.get("protection", "mask"))
    if protection == "mask":
        return {"protection": protection}
    return {
        "protection": protection,
        "ckks_degree": int(document["ckks_degree"]),
        "ckks_coeff_mod_bit_sizes": tuple(int(b) for b in document["ckks_coeff_mod_bit_sizes"]),
        "ckks_scale_bits": int(document["ckks_scale_bits"]),
    }


def session_context(study: Study, label: str, arrays: Mapping[str, np.ndarray]) -> bytes:
    """The one-view digest of session ``label`` of ``study`` (SECURITY.md, "One view"): the study's
    canonical document (every field, DP parameters included, with or without DP: τ, α, δ⁺, δ⁻ among
    them), the round, and every array the server sent with it (round 2: the teacher W, ``coef``).
    The server and each client compute it from what they hold; the protocol (either backend) signs
    it in every advertisement and each client goes on only with advertisements over its own."""
    from secure_afl.protocol.binding import session_context as bind

    return bind(bytes.fromhex(study.digest()), label, arrays)


def study_session_id(study: Study, nonce: bytes) -> bytes:
    """A session id that commits to the study: SHA-256 over a domain tag, the study's digest, a nonce.

    Under DP the server sends the nonce with the study and every client recomputes the id.  The
    protocol signs the session config, session id included, in every advertisement and each client
    checks that all advertisements carry its own config's digest (R1): so every participant holds
    the same study, and noises from the same plan (a server cannot hand one client a larger ε or a
    larger group than another).
    """
    if len(nonce) != 32:
        raise ConfigurationError("the study nonce must be 32 bytes")
    return hashlib.sha256(b"secure-afl/study-session/v1\0" + bytes.fromhex(study.digest()) + nonce).digest()


def noise_plan(study: Study, roster_size: int) -> NoisePlan:
    """The DP noise plan every party derives from the study alone (server and clients alike).

    A pure function of the study's document and the roster size, calibrated by the accountant (about
    0.2 s), so it is computed once per document and size in a process (:data:`_PLANS`: a node's
    delivery needs it for the file's DP record and its noise share; in-process federations share it
    across nodes).  The plan is frozen and never changed by its readers."""
    from secure_afl.privacy.dp import FederationLayout, plan_noise

    if study.dp is None:
        raise ConfigurationError("the study asks for no differential privacy")
    if study.method.rounds == 2:
        try:
            check_pseudo_label_threshold(study.method.tau)
        except DpError as exc:
            raise ConfigurationError(f"the study's method: {exc}") from None
    if len(study.dp.class_lists) != roster_size:
        raise ConfigurationError(
            f"the study's class lists name {len(study.dp.class_lists)} institutions, the roster "
            f"{roster_size}: list every roster institution's classes"
        )
    key = (study.to_json(), roster_size)
    if key in _PLANS:
        return _PLANS[key]
    layout = FederationLayout(
        active=dict(study.dp.class_lists),
        n_classes=study.n_classes,
        dim=statistics_dim(study),
        threshold=study.threshold_for(roster_size),
        min_group_size=study.min_group_size,
        rounds=study.method.rounds,
        masked=True,  # DP runs only with the masking backend
        frac_bits=study.frac_bits,
    )
    try:
        plan = plan_noise(study.dp.config(), layout)
    except DpError as exc:
        raise ConfigurationError(str(exc)) from None
    while len(_PLANS) >= _MAX_PLANS:  # bounded: the oldest goes first
        _PLANS.pop(next(iter(_PLANS)))
    _PLANS[key] = plan
    return plan


_PLANS: dict[tuple[str, int], NoisePlan] = {}  # noise_plan's, by (study document, roster size)
_MAX_PLANS = 16


DECISION_THRESHOLD = 0.5  # every study's classifier: positive when σ(h · w_c) > 0.5 (classifier.py)


def study_protocol(study: Study, roster_size: int) -> dict[str, Any]:
    """The protocol parameters a study's classifier file records that the study decides (the server
    adds what a session decided: CKKS's key holders, a growing chain)."""
    if study.protection == "mask":
        return {
            "backend": study.protection,
            "threshold": study.threshold_for(roster_size),
            "min_group_size": study.min_group_size,
            "frac_bits": study.frac_bits,
        }
    parameters = study.ckks_parameters()
    return {
        "backend": study.protection,
        "min_group_size": study.min_group_size,
        "poly_modulus_degree": parameters.poly_modulus_degree,
        "coeff_mod_bit_sizes": list(parameters.coeff_mod_bit_sizes),
        "scale_bits": parameters.scale_bits,
        "output_frac_bits": parameters.output_frac_bits,
    }


STATISTICS_WEIGHTS = "statistics_weights"  # the privacy record's W_K under --dp-dim or the row centring


def classifier_fields(study: Study, roster_size: int) -> dict[str, Any]:
    """Every field of a study's classifier file that the study decides, not the sums: the server
    writes them (server.py) and every node checks the file it receives states them
    (:meth:`~secure_afl.deploy.classifier.Classifier.check_study_fields`), so a coordinator cannot
    relabel the classes, move the decision threshold, name another backbone or misstate the DP
    settings and ε of a file the classifier check verified."""
    fields: dict[str, Any] = {
        "study_digest": study.digest(),
        "classes": list(study.classes),
        "dim": study.dim,
        "backbone": dict(study.backbone),
        "method": {**study.method.__dict__},
        "decision_threshold": DECISION_THRESHOLD,
        "protocol": study_protocol(study, roster_size),
        "privacy": None,
    }
    # Which keys the file's protocol and DP records hold: the study's, and what the server adds
    # (CKKS's key holders, a growing chain's record, the solve's values): a key beside them would be
    # a statement no node checks in a file it stores as verified.
    protocol = [*fields["protocol"], *(["growth"] if study.extends else [])]
    if study.protection != "mask":
        protocol += ["key_holders", "trust_model"]
    fields["keys"] = {"protocol": sorted(protocol), "privacy": None}
    if study.dp is not None:
        from secure_afl.privacy.dp_solve import SOLVE_RECORD_KEYS, plan_record

        fields["privacy"] = plan_record(noise_plan(study, len(study.dp.class_lists)), feature_dim=study.dim)
        if study.method.rounds == 1:
            fields["privacy"]["round2_qualified_classes"] = None
        private = [*fields["privacy"], *SOLVE_RECORD_KEYS, *(["growth"] if study.extends else [])]
        fields["keys"]["privacy"] = sorted({*private, *([STATISTICS_WEIGHTS] if has_row_map(study) else [])})
    return fields


def recipe(study: Study, roster_size: int, label: str) -> Recipe:
    """What session ``label`` of ``study`` asks of a node's upload (:mod:`secure_afl.stages`), from
    the study alone: its method, round 2's pseudo-label rule, and under DP the noise plan and the
    public projection (every party derives them alike)."""
    from secure_afl.stages import Recipe

    m, pseudo = study.method, None
    if label == "2":
        from secure_afl.analytic import PseudoLabelConfig  # round 2 scores with torch

        pseudo = PseudoLabelConfig(tau=m.tau, alpha=m.alpha, min_pos=m.min_pos, min_neg=m.min_neg)
    dp = study.dp
    return Recipe(
        balance=m.balance, gram=m.gram, rounds=m.rounds, pseudo=pseudo, dim=study.dim,
        n_classes=study.n_classes, dp=None if dp is None else dp.config(),
        noise=None if dp is None else noise_plan(study, roster_size),
        projection=None if dp is None else dp_projection(study),
    )  # fmt: skip


def statistics_dim(study: Study) -> int:
    """The dimension of the statistics: ``--dp-dim``'s K under a projected DP study, else ``dim``."""
    if study.dp is None or study.dp.projection_dim is None:
        return study.dim
    return study.dp.projection_dim


def has_row_map(study: Study) -> bool:
    """Whether DP maps the rows (``--dp-dim`` or the row centring) before the statistics."""
    return study.dp is not None and (study.dp.projection_dim is not None or study.dp.row_centre)


def dp_projection(study: Study) -> np.ndarray | None:
    """The study's public map of the rows (the row centring, then the projection to K: ``dim × K``,
    ``dim × dim`` for the centring alone), which every party derives alike; None without either."""
    if not has_row_map(study) or study.dp is None:
        return None
    from secure_afl.privacy.projection import row_map

    dp = study.dp
    return row_map(study.dim, dp.projection_dim, dp.projection_seed, centre=dp.row_centre)


def round1_layout(study: Study) -> Layout:
    """Every class group and, where the method needs it, the ``all`` group (the names of analytic.py).

    Every class is in the layout: a class that fewer than ``min_group_size`` survivors label cannot
    be fitted without revealing a client's statistics, so the session aborts rather than drop it.
    Under DP: the names of :meth:`secure_afl.privacy.dp.PrivateStatistics.round1` (positive and
    negative sums and counts per class, the Gram in ``all``; in ``K`` dimensions under ``--dp-dim``,
    and with each client's smallest Gram eigenvalue in ``all`` under ``ridge="adassp"``).
    """
    d, method = study.dim, study.method
    if study.dp is not None:
        k = statistics_dim(study)
        everyone = {"gram": upper_triangle_length(k)}
        if study.dp.ridge == "adassp":
            everyone[EIGEN_TENSOR] = 1
        if study.dp.class_sums == "positives":
            everyone.update({TOTAL_SUM: k, TOTAL_COUNT: 1})
            layout = _dp_layout(
                {ALL_GROUP: everyone},
                {class_group(c): (POSITIVE_SUM, POSITIVE_COUNT) for c in range(study.n_classes)},
                k,
            )
            shapes = {**layout.shapes, TOTAL_SUM: (k,), TOTAL_COUNT: (1,)}
            return Layout(groups=layout.groups, shapes=shapes, symmetric=layout.symmetric)
        return _dp_layout(
            {ALL_GROUP: everyone},
            {class_group(c): ("pos_sum", "neg_sum", "n_pos", "n_neg") for c in range(study.n_classes)},
            k,
        )
    groups: dict[str, dict[str, int]] = {}
    shapes: dict[str, tuple[int, ...]] = {"gram": (d, d)}
    for c in range(study.n_classes):
        tensors: dict[str, int] = {}
        if method.gram == "class":
            tensors["gram"] = upper_triangle_length(d)
        if method.balance == "client":
            tensors[f"b/{c}"] = d
            shapes[f"b/{c}"] = (d,)
        else:
            tensors[f"pos_sum/{c}"] = d
            tensors[f"n_pos/{c}"] = 1
            tensors["feat_sum"] = d
            tensors["n"] = 1
            shapes.update({f"pos_sum/{c}": (d,), f"n_pos/{c}": (1,), "feat_sum": (d,), "n": (1,)})
        groups[class_group(c)] = tensors
    if method.gram == "global" or method.rounds == 2:
        groups[ALL_GROUP] = {"gram": upper_triangle_length(d)}
    return Layout(groups=groups, shapes=shapes, symmetric=SYMMETRIC_TENSORS)


def round1_plan(study: Study, roster_ids: Collection[str]) -> tuple[Layout, WirePlan | None]:
    """Round 1's layout as sent, and the plan that made it (None: the method's layout).

    The server and every node call this on the same public inputs (the study and the roster), so
    they agree on the wire groups without a message about them; a node applies ``plan.wire`` to its
    contributions.  Under the per-class Gram layout, a class that most institutions label has its
    Gram sum sent as the ``all`` group's minus the complement group of those that do not, and when
    each institution labels one class (the class groups partition the roster) the ``all`` group's
    Gram is not sent but summed from the class groups' (:mod:`secure_afl.aggregation.difference`:
    the same sums bit for bit, the same span of sums).
    A plan needs the study's published class lists (the complements' members must be public
    before any data moves) and exact sums (masking; CKKS's noise would grow in a difference);
    never under DP (each client's noise is sized for the method's groups).  A complement may lose
    every member and the session still finishes; one left with 1 to ``min_group_size`` - 1 live
    members aborts it, where the method's sums would have determined their sum.
    """
    layout = round1_layout(study)
    if study.dp is not None or study.protection != "mask" or not study.class_lists:
        return layout, None
    ids = sorted(roster_ids)
    if sorted(study.class_lists) != ids:
        raise ConfigurationError(
            f"the study's class lists name {sorted(study.class_lists)}, the roster {ids}: list every "
            "roster institution's classes (class-lists)"
        )
    n = len(ids)
    if not study.backend(n).exact_sums:  # pragma: no cover - masking's sums are exact
        return layout, None
    from secure_afl.aggregation.difference import plan_wire

    members: dict[str, list[str]] = {
        class_group(c): [cid for cid in ids if c in study.class_lists[cid]] for c in range(study.n_classes)
    }
    if ALL_GROUP in layout.groups:
        members[ALL_GROUP] = ids
    plan = plan_wire(members, layout, min_group_size=study.min_group_size, frac_bits=study.frac_bits)
    return (layout, None) if plan is None else (plan.wire_layout(layout), plan)


def pseudo_members(
    labelled: Mapping[str, Collection[int]], live: Collection[str], n_classes: int
) -> dict[int, tuple[str, ...]]:
    """Round 2's groups: per class, the live clients that do not label it (Eq. 21)."""
    return {c: tuple(sorted(cid for cid in live if c not in labelled[cid])) for c in range(n_classes)}


def round2_classes(members: Mapping[int, Collection[str]], min_group_size: int) -> tuple[int, ...]:
    """The classes whose pseudo-label group is summed: at least ``min_group_size`` members.

    A smaller group would hand one client's pseudo-label projection to the server; that class keeps
    its round-1 right-hand side (the simulator, told the same rule, drops the same groups).

    The pseudo groups' values are one family (the teacher W is the server's choice: every node's
    exposure check takes a peer's values under several names as one unknown and refuses when a
    combination of its own is determined, :mod:`secure_afl.privacy.exposure`).  So groups are kept
    largest first, each only if no member's own check would then refuse, with c = min_group_size - 2
    colluders (:func:`round2_min_group_size` makes the minimum at least the nodes' c + 2, so this c
    is at least theirs): two groups that differ by fewer than c + 1 members are never both formed.
    The dropped classes keep their round-1 right-hand side.
    """
    from secure_afl.privacy.exposure import client_exposures

    colluders = max(min_group_size - 2, 0)
    large = [(c, tuple(ids)) for c, ids in sorted(members.items()) if len(ids) >= max(min_group_size, 1)]
    kept: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    for c, ids in sorted(large, key=lambda item: (-len(item[1]), item[0])):
        trial = {**kept, pseudo_group(c): (ids, (f"b_pseudo/{c}",))}
        clients = sorted({cid for live, _ in trial.values() for cid in live})
        if not any(
            client_exposures(
                cid,
                {(g, t[0]): f"{cid}/{g}" for g, (live, t) in trial.items() if cid in live},
                trial,
                round_name="R1",
                colluders=colluders,
            )
            for cid in clients
        ):
            kept = trial
    return tuple(c for c, _ in large if pseudo_group(c) in kept)


def parse_colluders(value: object, roster_size: int, threshold: int) -> int:
    """How many colluding institutions a node's exposure check assumes (its ``colluders`` config):
    "n-t" (the default, the active model's bound c = n - t) or a smaller number."""
    bound = max(0, roster_size - threshold)
    text = str(value).strip()
    if text == "n-t":
        return bound
    if not text.isdigit():
        raise ConfigurationError(f'colluders={text!r} must be "n-t" or a number of institutions')
    return min(int(text), bound)


def round2_min_group_size(study: Study, roster_size: int, colluders: object = "n-t") -> int:
    """The fewest members a pseudo-label group keeps: the study's minimum, and c + 2 for the c
    colluders every node's exposure check assumes (a smaller group would be refused in R1: with c
    of its members colluding, the sum gives away the last one's projection).  c is n - t for the
    nodes' own floor t = ⌊2n/3⌋ + 1, never the study's t: a node sizes its colluders by its floor."""
    c = parse_colluders(colluders, roster_size, deployment_threshold(roster_size))
    return max(study.min_group_size, c + 2)


def round2_row_floors(study: Study) -> dict[str, int]:
    """Tensor -> the committed row count below which a member's value of it is known (zero).

    Round 2 without DP: a member with fewer rows than any class's qualification needs
    (:func:`~secure_afl.statistics.pseudo_label_fewest_rows`, from the study's min_pos, min_neg
    and τ) uploads zeros under every ``b_pseudo/<c>`` whatever the teacher, and its count is signed
    in its advertisement: every node's exposure check takes that value as known, like a
    colluder's.  Keyed by tensor name, not group name, so a server that renames a group changes
    nothing.  Under DP none (no member commits counts; each value carries its own noise), and none
    in round 1 (its values are the data's own)."""
    if study.dp is not None or study.method.rounds != 2:
        return {}
    from secure_afl.statistics import pseudo_label_fewest_rows

    m = study.method
    floor = pseudo_label_fewest_rows(m.tau, m.min_pos, m.min_neg)
    return {f"b_pseudo/{c}": floor for c in range(study.n_classes)}  # round2_layout's names


def round2_layout(study: Study, classes: Collection[int]) -> Layout:
    d = study.dim
    if study.dp is not None:  # the names of secure_afl.privacy.dp.pseudo_label_round
        prefixes = ("pseudo_pos_sum", "pseudo_neg_sum", "pseudo_n_pos", "pseudo_n_neg")
        return _dp_layout({}, {pseudo_group(c): prefixes for c in sorted(classes)}, statistics_dim(study))
    return Layout(
        groups={pseudo_group(c): {f"b_pseudo/{c}": d} for c in sorted(classes)},
        shapes={f"b_pseudo/{c}": (d,) for c in sorted(classes)},
        symmetric=SYMMETRIC_TENSORS,
    )


def _dp_layout(groups: dict[str, dict[str, int]], per_class: Mapping[str, tuple[str, ...]], d: int) -> Layout:
    shapes: dict[str, tuple[int, ...]] = {"gram": (d, d), EIGEN_TENSOR: (1,)}
    for group, prefixes in per_class.items():
        c = group.split("/")[1]
        tensors = {}
        for prefix in prefixes:
            size = 1 if prefix.endswith(("n_pos", "n_neg", POSITIVE_COUNT)) else d  # counts are scalars
            tensors[f"{prefix}/{c}"] = size
            shapes[f"{prefix}/{c}"] = (size,)
        groups[group] = tensors
    return Layout(groups=groups, shapes=shapes, symmetric=SYMMETRIC_TENSORS)
