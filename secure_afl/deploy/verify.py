"""Every survivor checks the classifier it receives against the sums it helped form (SECURITY.md §5.1).

Per class ``c`` the published weights satisfy ``Σ_k (G_{k,c} w_c − b_{k,c}) + γ w_c = 0`` up to the
float arithmetic's rounding.  Each survivor ``k`` computes its own residual terms
``v_{k,c} = G_{k,c} w_c − b_{k,c}`` (:func:`node_terms`, d values per class) from the values it
uploaded, as the masking encoded them (:func:`check_inputs`: the sums the coordinator solved are
exactly the sums of those), and the scale ``m_k`` of its statistics; the terms are summed by
:mod:`secure_afl.protocol.verify` (committed mask keys, pairwise masks, signed relay), and each
survivor accepts (:func:`decide`) iff every class's ``‖Σ_k v_{k,c} + γ w_c‖₂ ≤ ρ ((M + γ) ‖w_c‖ + M)``
with ``M = Σ_k m_k`` and ρ = 16 d 2^-53 (:func:`rho`).  Every coordinate is checked: no challenge,
nothing to predict, no probability of a wrong pass.

Messages (the deployment's envelopes; the protocol's own messages are unchanged): a node's session-1
advertisement reply carries ``verify-commit`` (its signed mask key) in its metadata; the classifier
delivery carries ``verify-commitments`` (every survivor's, relayed) and ``verify-counts``; the
node's ``ack`` carries its signed masked terms as its payload (``verify-masked``); one ``verify``
envelope of round ``verify-sums`` relays every survivor's, and the node answers ``ack`` with
``verified`` (or refuses).  The check's members are the survivor set the node signed in R3 (its
ledger), never a set the coordinator names.

Offered for one-round masking studies (:func:`not_offered` says why otherwise: CKKS, round 2, a DP
ridge no node can derive); under
``--dp-dim`` or the row centring the terms use the privacy record's W_K, once the file's W is checked
to be its lift M W_K (:func:`solved_weights`); growing chains included: a growing study's sums are
its chain's runs' uploads summed, so each node keeps its own uploads as the masking encoded them
(LEDGER_DIR/check-values/, 0600, one folded record per chain: :func:`keep_inputs`) and its terms are
over its values summed over the runs the classifier's chain record lists it in (:func:`chain_values`); a
pass means W is the ridge solution of the sums of the runs that record lists.  A node that lacks a
listed run's values (a chain begun before nodes kept them), a chain whose earlier contributor is not a
survivor now, or a record unlike the chain the node took part in leave the classifier unverified (as
does, with ``gram="class"``, a node that started labelling a class mid-chain: its class Grams then
differ).  Each class's right-hand side is the one the solve forms (:func:`rhs_parts`): client balance
``Σ b_k``; global balance ``pos/N⁺ − (feat − pos)/(N − N⁺)``; under DP the noisy sums over counts
rounded and floored at 1, and ``γ`` plus the DP ridge λ, which each node derives from the study and
the check's own sum (:func:`study_ridge`: every survivor adds its :func:`noise_share` of each run it was
in, so the sum is the noise a growing chain's sums carry too; "adassp" also its noisy λ_min), never
the file's: a file naming another λ is refused.  The "adaptive" ridge (the noisy Gram's spectrum) no
node can derive: not offered.  The coordinator sends the count
sums it divided by with the classifier; each node forms its term with them and adds its own counts to its
masked vector, and refuses unless the survivors' sums are exactly those relayed (the survivors learn the
federation's counts per class).  A Gram sent by difference is the node's one ``G_k`` in every class it
labels.  A DP solve that floored the noisy Gram's eigenvalues is no ridge solve: the node refuses it as
unverified.  A node's ``require-verified-classifier``: ``when-offered`` (default: a classifier of a
study the check covers is stored only once verified), ``true`` (also refuses, in R0, every study the
check does not cover), ``false`` (stores every classifier when received; a passing check adds the
record).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from threadpoolctl import threadpool_limits

from secure_afl.privacy.dp_config import DERIVABLE_RIDGES
from secure_afl.protocol import verify as pv

from .errors import ConfigurationError, DeploymentError
from .wire import Envelope

if TYPE_CHECKING:
    from secure_afl.keys.identity import IdentityKey
    from secure_afl.keys.roster import Roster

    from .classifier import Classifier
    from .study import Study

EIGEN_KEY = "all|gram_min_eig"  # the "adassp" ridge's noisy λ_min upload (study.EIGEN_TENSOR in ``all``)
# Under DP, a node's share of the noise variances its runs' sums carry (the Gram's, the λ_min release's):
# s_r²/m_r for each run r it was among the m_r survivors of, so the survivors' sum is Σ_r s_r², which
# sizes the ridge, whatever runs each node was in (:func:`noise_share`).
NOISE_KEYS = ("noise|gram_var", "noise|eigen_var")
# A growing DP chain's file restates every run's noise record (ε per institution, noise stds), which
# only that run's members can derive: each survivor adds 1 here if the record of a run it was in is
# not the one it derives (:func:`misstated_runs`), so every node learns that none found one.
MISSTATED_KEY = "noise|misstated_runs"
RHO_PER_DIM = 16 * 2.0**-53  # ρ = 16 d u: 16 times float64's rounding bound d·u of a d-term inner product
REQUIRE_KEY = "require-verified-classifier"
REQUIRE_VALUES = ("when-offered", "true", "false")
STATE_LABEL = "verify"  # the node's record of the check, beside its sessions' records
STATE_INPUTS = "verify-inputs"  # the values it uploaded in session 1, until it computed its terms
RECORD_SUFFIX = ".verified.json"
RECORD_FORMAT = "secure-afl-classifier-check/v2"  # v2: every coordinate of the residual, one relay
RECORD_FORMATS = (RECORD_FORMAT, "secure-afl-classifier-check/v1")  # v1: Freivalds' check, still a pass
CHECKS_DIR = "checks"  # OUT_DIR/checks/: the records of the history's files


Loaded = TypeVar("Loaded")


class UnverifiedClassifierError(DeploymentError):
    """The classifier could not be checked, and this node stores only a checked one."""


class ClassifierCheckFailedError(DeploymentError):
    """The classifier is not the solution of the session's sums (its residual is above the rounding bound)."""


def require_setting(value: object) -> str:
    text = str(value).strip().lower()
    if text not in REQUIRE_VALUES:
        raise ConfigurationError(
            f"the SuperNode's --node-config {REQUIRE_KEY}={text!r} must be one of "
            f"{', '.join(REQUIRE_VALUES)} (when-offered: the default, store a classifier of a study the "
            "check covers only once every survivor verified it; true: also refuse studies it does not "
            "cover; false: store every classifier)"
        )
    return text


def not_offered(study: Study, roster_ids: Collection[str]) -> str | None:
    """Why the check does not cover ``study`` (None: it does)."""
    if study.protection != "mask":
        return (
            "CKKS studies are not checked (CKKS sums are approximate: the solved sums differ from the "
            "survivors' values by the scheme's noise, which the check's rounding tolerance does not cover)"
        )
    if study.method.rounds != 1:
        return (
            "two-round studies are not checked (round 2 runs only under a coordinator the nodes declared "
            "honest-but-curious, and its right-hand side, pseudo-label sums over thresholds, is not modelled)"
        )
    if study.dp is not None and study.dp.ridge not in DERIVABLE_RIDGES:
        return (
            f"the DP ridge {study.dp.ridge!r} is sized from the noisy Gram's smallest eigenvalue, which no "
            "node holds: no node can derive it, so a coordinator could choose it (--dp-ridge bound or adassp "
            "are derived from public facts and checked)"
        )
    if study.extends and (study.method.balance != "global" or study.method.rounds != 1):
        # Covered: a growing study's sums are its chain's runs' uploads summed, and each node keeps
        # its own (:func:`keep_inputs`); the study itself already refuses any other method.
        return "growing studies are checked only with global balance and one round (the additive sums)"
    return None


def coverage(study: Study, roster_ids: Collection[str], require: str) -> str | None:
    """Why the check does not cover ``study`` (None: it does), after refusing such a study where this
    node requires the check (``require``: its ``require-verified-classifier``)."""
    why = not_offered(study, roster_ids)
    if why is not None and require == "true":
        raise UnverifiedClassifierError(
            f"this node stores only a verified classifier ({REQUIRE_KEY} = true), and {why}: set "
            f'{REQUIRE_KEY}="when-offered" in the node config to take part without the check'
        )
    return why


# --- the linear system the solve fitted ------------------------------------------------------


def rhs_form(study: Study) -> str:
    """How the solve forms each class's right-hand side from the sums (:func:`rhs_parts`):
    ``client`` (Σ b_k), ``global`` (counts over S_c, analytic.py), ``dp-split`` / ``dp-positives``
    (the noisy sums, privacy/dp_solve.py's ``analytic_sums``)."""
    if study.dp is not None:
        return "dp-positives" if study.dp.class_sums == "positives" else "dp-split"
    return study.method.balance


def count_keys(form: str, n_classes: int) -> list[str]:
    """The count tensors (``group|tensor``) whose sums the right-hand sides divide by."""
    from secure_afl.privacy.dp import POSITIVE_COUNT, TOTAL_COUNT

    if form == "global":
        return [k for c in range(n_classes) for k in (f"class/{c}|n_pos/{c}", f"class/{c}|n")]
    if form == "dp-split":
        return [k for c in range(n_classes) for k in (f"class/{c}|n_pos/{c}", f"class/{c}|n_neg/{c}")]
    if form == "dp-positives":
        return [*(f"class/{c}|{POSITIVE_COUNT}/{c}" for c in range(n_classes)), f"all|{TOTAL_COUNT}"]
    return []


def count_claims(form: str, n_classes: int, sums: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """The coordinator's side: the count sums it solved with (each node checks them in the sum)."""
    out = {}
    for key in count_keys(form, n_classes):
        group, tensor = key.split("|", 1)
        value = sums.get(group, {}).get(tensor)
        out[key] = 0.0 if value is None else float(np.asarray(value, dtype=np.float64).ravel()[0])
    return out


def _noisy_count(value: float) -> int:
    return max(1, round(value))  # as privacy/dp_solve.py: rounded, floored at one row


def rhs_parts(form: str, c: int, counts: Mapping[str, float]) -> list[tuple[str, float]]:
    """Class ``c``'s right-hand side as ``Σ coefficient · (the sum of a tensor)``, with the
    coefficients the solve derives from the count sums ``counts``: ``(group|tensor, coefficient)``."""
    from secure_afl.privacy.dp import POSITIVE_COUNT, POSITIVE_SUM, TOTAL_COUNT, TOTAL_SUM

    group = f"class/{c}"
    if form == "client":
        return [(f"{group}|b/{c}", 1.0)]
    if form == "global":  # analytic.balanced_projection: pos/N⁺ − (feat − pos)/(N − N⁺), an empty side 0
        n_pos, n = round(counts[f"{group}|n_pos/{c}"]), round(counts[f"{group}|n"])
        a = 1.0 / n_pos if n_pos else 0.0
        b = 1.0 / (n - n_pos) if n - n_pos else 0.0
        return [(f"{group}|pos_sum/{c}", a + b), (f"{group}|feat_sum", -b)]
    if form == "dp-split":  # pos/N⁺ − neg/N⁻, each noisy count rounded and floored at 1
        n_pos, n_neg = _noisy_count(counts[f"{group}|n_pos/{c}"]), _noisy_count(counts[f"{group}|n_neg/{c}"])
        return [(f"{group}|pos_sum/{c}", 1.0 / n_pos), (f"{group}|neg_sum/{c}", -1.0 / n_neg)]
    if form == "dp-positives":  # the positives' weighted mean minus the federation's mean
        weighted = counts[f"{group}|{POSITIVE_COUNT}/{c}"]
        n_pos = _noisy_count(weighted)
        scale = n_pos / max(weighted, 1.0)
        n_total = _noisy_count(counts[f"all|{TOTAL_COUNT}"])
        return [(f"{group}|{POSITIVE_SUM}/{c}", scale / n_pos), (f"all|{TOTAL_SUM}", -1.0 / n_total)]
    raise UnverifiedClassifierError(f"unknown right-hand side form {form!r}")


# --- the residual terms ----------------------------------------------------------------------


def _encoded(values: np.ndarray, frac_bits: int) -> np.ndarray:
    """``decode(encode(x))``: the value the masking summed (rint(x·2^f)·2^-f), in one new array
    (the same operations in place: a Gram's triangle is written once, not three times)."""
    out = np.multiply(np.asarray(values, dtype=np.float64), 2.0**frac_bits)
    np.rint(out, out=out)
    out *= 2.0**-frac_bits
    return out


def _gram_times(packed: np.ndarray, x: np.ndarray, block: int = 128) -> np.ndarray:
    """``G x`` (``x``: a vector or a d×C matrix) from the packed row-major upper triangle, ``block``
    rows at a time (no d×d matrix, no index arrays of the triangle's size): rows ``i0..i1``' parts
    ``G[i, i:]`` give ``(G x)_i`` and, transposed, the mirrored entries' ``G[i, j] x_i`` for ``j ≥ i0``
    (the diagonal counted once)."""
    dim = x.shape[0]
    out = np.zeros(x.shape)
    start = 0
    for i0 in range(0, dim, block):
        i1 = min(i0 + block, dim)
        rows = np.zeros((i1 - i0, dim - i0))
        for i in range(i0, i1):
            rows[i - i0, i - i0 :] = packed[start : start + dim - i]
            start += dim - i
        out[i0:i1] += rows @ x[i0:]
        out[i0:] += rows.T @ x[i0:i1]
        diagonal = np.diagonal(rows[:, : i1 - i0])
        out[i0:i1] -= diagonal[:, None] * x[i0:i1] if x.ndim == 2 else diagonal * x[i0:i1]
    return out


def node_terms(
    inputs: Mapping[str, np.ndarray], weights: np.ndarray, *, gram: str, form: str = "client",
    counts: Mapping[str, float] | None = None, ridge: Mapping[str, Any] | None = None,
) -> np.ndarray:  # fmt: skip
    """:func:`_node_terms` on one BLAS thread: its d×C products and dots gain nothing from more,
    whose workers would only spin beside the node's other work.  Under DP (``ridge``,
    :func:`study_ridge`) the values the ridge is sized from follow: for ``"adassp"`` this node's
    noisy λ_min upload, then its :data:`NOISE_KEYS` shares."""
    with threadpool_limits(1, user_api="blas"):
        terms = _node_terms(inputs, weights, gram=gram, form=form, counts=counts)
    keys = ridge_keys(ridge)
    missing = [key for key in keys if key not in inputs]
    if missing:
        raise UnverifiedClassifierError(
            f"this node holds no {', '.join(missing)} of its runs, which the DP ridge is sized from"
        )
    return np.concatenate([terms, *(np.asarray(inputs[key], dtype=np.float64).ravel()[:1] for key in keys)])


def ridge_keys(ridge: Mapping[str, Any] | None) -> list[str]:
    """The values after the counts in a node's terms that the DP ridge is sized from, in order (none
    without DP): ``"adassp"``'s noisy λ_min upload, then the :data:`NOISE_KEYS` shares; a growing
    chain's then :data:`MISSTATED_KEY`, this node's count of misstated run records."""
    if ridge is None:
        return []
    growing = [MISSTATED_KEY] if ridge.get("growing") else []
    return ([EIGEN_KEY] if ridge["kind"] == "adassp" else []) + list(NOISE_KEYS) + growing


def _node_terms(
    inputs: Mapping[str, np.ndarray], weights: np.ndarray, *, gram: str, form: str,
    counts: Mapping[str, float] | None,
) -> np.ndarray:  # fmt: skip
    """This survivor's ``[v_0, ..., v_{C-1}, m_k, its counts...]`` (one flat array): the residual
    ``v_c = G_k w_c − b_{k,c}`` (d values per class; ``inputs``: ``"group|tensor"`` -> the values it
    uploaded as the masking encoded them, :func:`check_inputs`; ``G_k`` enters class ``c`` when the
    Gram is global or ``k`` is in ``S_c``, whatever wire groups carried it; ``b_{k,c}`` is its part of
    :func:`rhs_parts` under the relayed count sums ``counts``), its scale
    ``m_k = ‖G_k‖_F + max_c Σ_parts |coefficient| ‖x‖₂``, then its own values of :func:`count_keys`."""
    dim, n_classes = weights.shape
    counts = counts or {}
    residual = np.zeros((n_classes, dim))
    fro = 0.0
    grams = [key for key in inputs if key.split("|", 1)[1] == "gram"]
    groups = {key.split("|", 1)[0] for key in inputs}
    if grams:  # one value G_k in every group that carries it (analytic.py's name space)
        packed = np.asarray(inputs[grams[0]], dtype=np.float64)  # the row-major upper triangle
        if packed.shape != (dim * (dim + 1) // 2,):
            raise UnverifiedClassifierError(
                f"this node's {grams[0]} has {packed.size} values, not a {dim}-d Gram"
            )
        for key in grams[1:]:
            if not np.array_equal(np.asarray(inputs[key]), packed):
                raise UnverifiedClassifierError("this node's Gram differs between its groups")
        labelled = [c for c in range(n_classes) if gram == "global" or f"class/{c}" in groups]
        if labelled:
            residual[labelled] = _gram_times(packed, weights[:, labelled]).T
        starts = np.arange(dim) * dim - np.arange(dim) * (np.arange(dim) - 1) // 2  # row i's first: G[i, i]
        diagonal = packed[starts]
        fro = float(np.sqrt(max(0.0, 2 * float(packed @ packed) - float(diagonal @ diagonal))))
    b_norm = 0.0
    for c in range(n_classes):
        norm = 0.0
        for key, coefficient in rhs_parts(form, c, counts):
            if key in inputs and coefficient != 0.0:
                values = np.asarray(inputs[key], dtype=np.float64)
                if values.shape != (dim,):
                    raise UnverifiedClassifierError(f"this node's {key} has {values.size} values, not {dim}")
                residual[c] -= coefficient * values
                norm += abs(coefficient) * float(np.linalg.norm(values))
        b_norm = max(b_norm, norm)
    own_counts = [
        float(np.asarray(inputs[key]).ravel()[0]) if key in inputs else 0.0
        for key in count_keys(form, n_classes)
    ]
    return np.concatenate([residual.ravel(), [fro + b_norm], own_counts])


def rho(dim: int) -> float:
    """The tolerance's relative size: 16 d u (u = 2^-53), above the rounding of the solve's and the
    terms' d-term inner products (measured honest residuals are below 10^-3 of it: bench/bench_verify.py)."""
    return RHO_PER_DIM * dim


def decide(
    sums: np.ndarray,
    weights: np.ndarray,
    gamma: float,
    counts: Mapping[str, float] | None = None,
) -> tuple[bool, list[float]]:
    """Accept iff every class's residual ``r_c = Σ_k v_{k,c} + γ w_c`` has
    ``‖r_c‖₂ ≤ τ_c = ρ ((M + γ) ‖w_c‖₂ + M) + 2^-120`` (``M``: the summed scale; the last term the
    fixed point's truncation, 2^-128 per value and survivor) and the survivors' count sums are the
    ``counts`` the coordinator relayed; also each class's ``‖r_c‖/τ_c``."""
    dim, n_classes = weights.shape
    claimed = list((counts or {}).values())
    expected = n_classes * dim + 1 + len(claimed)
    sums = np.asarray(sums, dtype=np.float64)
    if sums.shape != (expected,):
        raise pv.VerificationError(f"the summed check has {sums.size} values, not {expected}")
    residual = sums[: n_classes * dim].reshape(n_classes, dim) + gamma * weights.T
    scale = float(sums[n_classes * dim])
    ratios = []
    for c in range(n_classes):
        bound = rho(dim) * ((scale + gamma) * float(np.linalg.norm(weights[:, c])) + scale) + 2.0**-120
        ratios.append(float(np.linalg.norm(residual[c])) / bound)
    counted = sums[n_classes * dim + 1 :].tolist()
    if any(a != b for a, b in zip(counted, claimed, strict=True)):
        raise ClassifierCheckFailedError(
            f"the counts the coordinator relayed ({claimed}) are not the survivors' sums ({counted}): the "
            "classifier was not solved with the session's counts; it is not stored as verified"
        )
    return all(r <= 1.0 for r in ratios) and scale >= 0, ratios


# --- the node --------------------------------------------------------------------------------


def commit_meta(
    label: str, study: Study, roster_ids: Collection[str], client_id: str, identity: IdentityKey,
    session_id: bytes, require: str, seed: bytes,
) -> dict[str, str]:  # fmt: skip
    """At a session's R0: refuse a study the check does not cover when this node requires it; for
    one it covers, the signed commitment to the check's secret for the advertisement reply's
    metadata.  The secret comes from ``seed``, the fresh randomness the node drew for this session
    (:meth:`~secure_afl.protocol.verify.VerifySecret.from_seed`): the session's own record keeps it,
    so a refused R0 leaves nothing, and no coordinator choice (a repeated session id) repeats it."""
    if label != "1":
        return {}
    if coverage(study, roster_ids, require) is not None:
        return {}  # no record: the classifier is stored unverified
    secret = pv.VerifySecret.from_seed(seed, client_id, session_id)
    return {"verify-commit": pv.commit(secret, client_id, session_id, identity.private_key).to_text()}


def keep_inputs(label: str, saved: Mapping[str, Any], state: Any, keep_dir: Path | None = None) -> None:
    """At the end of session 1 of a study the check covers (its R0 reply carried the commitment):
    keep the values this node uploaded for its terms (until the check), and what the terms need.
    A study whose sums a later study may extend (global balance, one round): also its uploads as
    the masking encoded them, in ``keep_dir`` on this node's host (:func:`_keep_run`), for the
    checks of the chain's later runs, whose sums contain them (this run's state is forgotten)."""
    from .study import Study
    from .sums import is_additive

    if label != "1":
        return
    study = Study.from_json(str(saved["study"]))
    if not_offered(study, ()) is not None or "verify-commit" not in saved:
        return
    session_id = bytes.fromhex(str(saved["session_id"]))
    secret = pv.VerifySecret.from_seed(bytes(saved["seed"]), str(saved["client_id"]), session_id)
    # As the masking encoded them: the values the sums hold (encoded once, for every later use).
    encoded = {
        k: _encoded(np.asarray(v, dtype=np.float64), study.frac_bits) for k, v in saved["inputs"].items()
    }
    state.save(STATE_INPUTS, {"session_id": saved["session_id"], "inputs": encoded})
    chain: dict[str, Any] = {"study_digest": study.digest(), "extends": study.extends}
    if keep_dir is not None and is_additive(study):
        _keep_run(Path(keep_dir), str(saved["client_id"]), study, str(saved["session_id"]), encoded)
        chain["keep_dir"] = str(keep_dir)
    state.save(
        STATE_LABEL,
        {"status": "committed", "session_id": saved["session_id"], "client_id": saved["client_id"],
         "key": secret.key, "commitment": str(saved["verify-commit"]),
         "gamma": study.method.gamma, "form": rhs_form(study),
         "gram": "global" if study.dp is not None else study.method.gram, "kept": True, **chain,
         **({"study": str(saved["study"])} if study.dp is not None else {})},
    )  # fmt: skip


def check_inputs(
    state: Any, record: Mapping[str, Any], classifier: Classifier,
    signed_survivors: Callable[[str], Collection[str] | None],
) -> dict[str, np.ndarray]:  # fmt: skip
    """The values this node's terms are computed over: for each ``group|tensor``, what the sums the
    coordinator solved contain of this node's uploads, as the masking encoded them
    (``decode(encode(x))``, :func:`_encoded`).  A growing study's (:func:`chain_values`): this
    node's values summed over the runs of the chain ``classifier`` records that included it, each
    run's survivors being the set this node signed in its R3 (``signed_survivors``, its ledger)."""
    kept = state.load(STATE_INPUTS) or {}
    if kept.get("session_id") != record["session_id"] or "inputs" not in kept:
        raise UnverifiedClassifierError("this node no longer holds its session-1 values to check with")
    own = {k: np.asarray(v, dtype=np.float64) for k, v in kept["inputs"].items()}  # encoded when kept
    study = _record_study(record)
    noise: dict[str, dict[str, Any]] = {}  # DP: this node's record of each run it was in, by session id
    if study is not None:  # DP: this run's noise shares (the survivors: the set this node signed)
        survivors = len(classifier.sessions[0]["survivors"])
        noise[str(record["session_id"])] = run_noise(study, survivors)
        own.update(noise_share(noise[str(record["session_id"])], survivors))
    if record.get("extends"):
        values, noise = chain_values(record, classifier, own, noise, signed_survivors)
        if study is not None:  # not folded: a statement about this file alone
            values[MISSTATED_KEY] = np.array([float(misstated_runs(classifier, noise))])
        return values
    if record.get("keep_dir"):  # a run a later study may extend: the chain's first record
        first = (str(record["study_digest"]), str(record["session_id"]), _names(classifier.sessions[0]))
        _fold(Path(record["keep_dir"]), str(record["client_id"]), [first], own, noise)
    return own


def run_noise(study: Study, survivors: int) -> dict[str, Any]:
    """One DP run's noise record (:meth:`~secure_afl.privacy.dp_growth.SessionNoise.to_json`: ε and
    events per institution, the noise stds at ``survivors`` survivors) as the study's plan gives it:
    what the server's solve records for the run (``deploy/solve.py``), derived alike by every party."""
    from secure_afl.privacy.dp_growth import SessionNoise

    from .study import noise_plan

    assert study.dp is not None
    plan = noise_plan(study, len(study.dp.class_lists))
    return SessionNoise.of(plan, survivors, feature_dim=study.dim).to_json()


def noise_share(run: Mapping[str, Any], survivors: int) -> dict[str, np.ndarray]:
    """This node's :data:`NOISE_KEYS` share of one DP run (its :func:`run_noise` record at
    ``survivors``): ``s²/m`` for the noise std s of the run's Gram sum at its m survivors (and of its
    λ_min release, 0 without)."""
    eigen_std = float(run["eigen_noise_std"] or 0.0)
    return {
        NOISE_KEYS[0]: np.array([float(run["gram_noise_std"]) ** 2 / survivors]),
        NOISE_KEYS[1]: np.array([eigen_std**2 / survivors]),
    }


def misstated_runs(classifier: Classifier, noise: Mapping[str, Mapping[str, Any]]) -> int:
    """1 if the growing classifier's chain record states, for a run this node was among the
    survivors of (``noise``: its own :func:`run_noise` records by session id), another noise record
    than the one this node derives, else 0.  Only a run's members can derive its record (its study);
    every run of a chain has a member among this session's survivors (:func:`chain_values`), so the
    survivors' sum of these counts is 0 only if no run's record is misstated."""
    chain = classifier.protocol["growth"]["chain"]
    for entry in chain:
        mine = noise.get(str(entry.get("session_id")))
        if mine is not None and not _same_record(entry.get("dp"), mine):
            return 1
    return 0


def _same_record(stated: Any, derived: Any) -> bool:
    """JSON documents equal, their numbers to 1e-9 relative (computed in another order elsewhere)."""
    if isinstance(derived, Mapping):
        return (
            isinstance(stated, Mapping)
            and set(stated) == set(derived)
            and all(_same_record(stated[k], derived[k]) for k in derived)
        )
    if isinstance(derived, (list, tuple)):
        return (
            isinstance(stated, (list, tuple))
            and len(stated) == len(derived)
            and all(_same_record(a, b) for a, b in zip(stated, derived, strict=True))
        )
    if isinstance(derived, (int, float)) and not isinstance(derived, bool):
        try:
            return abs(float(stated) - float(derived)) <= 1e-9 * max(abs(float(derived)), 1.0)
        except (TypeError, ValueError):
            return False
    return bool(stated == derived)


# --- a growing chain's values ----------------------------------------------------------------
#
# A growing study's sums are the sums of the chain it extends plus this run's uploads, and a node
# forms its term over its own part of them: its uploads of every run of the chain that included it.
# Each node keeps, in LEDGER_DIR/check-values/ (0700; each file 0600, only this node's own values,
# as the masking encoded them): a *run* record per run (``run-<session id>.npz``, written when its
# session 1 is done) and a *chain* record (``chain-<session id>.npz``): the sum of its values over
# the runs of a chain up to that run, with the chain's entries (study digest, session id, survivors)
# as the classifier recorded them.  A check folds the chain record it extends and the run records
# the chain resolves into a new chain record and deletes them: bounded, a chain costs one record of
# the size of one upload whatever its length (a Gram present in several groups is written once),
# plus the run records of runs not yet checked; at most KEPT_RECORDS records are kept, the oldest
# dropped first.  A chain that lost its record (evicted, or a fork from a record already extended)
# is then unverified, never wrongly verified.

KEPT_DIR = "check-values"  # LEDGER_DIR/check-values/
KEPT_FORMAT = "secure-afl-check-values/v1"
KEPT_RECORDS = 8
Entry = tuple[str, str, tuple[str, ...]]  # a chain entry: study digest, session id, survivors


def _names(entry: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(sorted(str(s) for s in entry["survivors"]))


def _write_kept(
    directory: Path, name: str, meta: Mapping[str, Any], values: Mapping[str, np.ndarray]
) -> None:
    """One record: ``meta`` and ``values`` (equal arrays stored once) in ``directory/name``, 0600;
    then the oldest records past KEPT_RECORDS are deleted."""
    import io

    from .tls import write_with_mode

    distinct: list[np.ndarray] = []
    index: dict[str, int] = {}
    for key, value in values.items():
        same = (i for i, d in enumerate(distinct) if d.shape == value.shape and np.array_equal(d, value))
        index[key] = next(same, len(distinct))
        if index[key] == len(distinct):
            distinct.append(np.asarray(value, dtype=np.float64))
    buffer = io.BytesIO()
    document = json.dumps({**meta, "format": KEPT_FORMAT, "index": index})
    np.savez(buffer, meta=np.array(document), **{f"v{i}": d for i, d in enumerate(distinct)})
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_with_mode(directory / name, buffer.getvalue(), 0o600)
    records = sorted(directory.glob("*.npz"), key=lambda p: (p.stat().st_mtime_ns, p.name))
    for old in records[: max(0, len(records) - KEPT_RECORDS)]:
        if old.name != name:
            old.unlink(missing_ok=True)


def _read_kept(path: Path, values: bool = True) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A record's metadata, and (``values``) its values."""
    with np.load(path, allow_pickle=False) as data:
        meta = json.loads(str(data["meta"]))
        if meta.get("format") != KEPT_FORMAT:
            raise ValueError(f"{path.name} is not a {KEPT_FORMAT} record")
        if not values:
            return meta, {}
        return meta, {key: np.array(data[f"v{i}"], dtype=np.float64) for key, i in meta["index"].items()}


def _kept(directory: Path, client_id: str, kind: str) -> list[tuple[Path, dict[str, Any]]]:
    """This node's readable records of ``kind`` (``run`` or ``chain``), with their metadata."""
    found = []
    for path in sorted(directory.glob(f"{kind}-*.npz")) if directory.is_dir() else []:
        try:
            meta, _ = _read_kept(path, values=False)
        except (OSError, ValueError, KeyError):
            continue  # unreadable: as if not kept (the check then says what is missing)
        if meta.get("kind") == kind and meta.get("client_id") == client_id:
            found.append((path, meta))
    return found


def _keep_run(
    directory: Path, client_id: str, study: Study, session_id: str, values: Mapping[str, np.ndarray]
) -> None:
    meta = {"kind": "run", "client_id": client_id, "study": study.digest(), "extends": study.extends,
            "session_id": session_id,
            **({"study_json": study.to_json()} if study.dp is not None else {})}  # fmt: skip
    _write_kept(directory, f"run-{session_id}.npz", meta, values)


def _fold(
    directory: Path, client_id: str, chain: list[Entry], values: Mapping[str, np.ndarray],
    noise: Mapping[str, Any],
) -> None:  # fmt: skip
    """The chain record of ``chain`` (this run last) holding ``values`` and, under DP, ``noise``: this
    node's :func:`run_noise` record of each of its runs, by session id; the run records it resolves
    (every run it lists) are deleted."""
    meta = {"kind": "chain", "client_id": client_id, "chain": [[e[0], e[1], list(e[2])] for e in chain],
            "noise_records": dict(noise)}  # fmt: skip
    _write_kept(directory, f"chain-{chain[-1][1]}.npz", meta, values)
    listed = {e[1] for e in chain}
    for path, run in _kept(directory, client_id, "run"):
        if run.get("session_id") in listed:
            path.unlink(missing_ok=True)


def _recorded_chain(record: Mapping[str, Any], classifier: Classifier) -> list[Entry]:
    """The chain the growing classifier records, checked against this node's own run: it ends with
    this study's session and survivors, after the study this study extends."""
    growth = classifier.protocol.get("growth")
    try:
        assert isinstance(growth, Mapping) and isinstance(growth["chain"], list)
        chain = [(str(e["study"]), str(e["session_id"]), _names(e)) for e in growth["chain"]]
    except (AssertionError, KeyError, TypeError):
        raise UnverifiedClassifierError(
            "the classifier of this growing study records no chain of the runs whose sums it solved: it "
            "cannot be checked (the coordinator's secure-afl predates the chain record)"
        ) from None
    own: Entry = (str(record["study_digest"]), str(record["session_id"]), _names(classifier.sessions[0]))
    extends = str(record["extends"])
    if len(chain) < 2 or chain[-1] != own or chain[-2][0] != extends or growth.get("extends") != extends:
        raise UnverifiedClassifierError(
            f"the classifier's chain record does not match this node's run: it must end with this study "
            f"({own[0][:16]}..., this session, its survivors) after the study it extends "
            f"({extends[:16]}...); the classifier is not verified"
        )
    if len({e[0] for e in chain}) != len(chain) or len({e[1] for e in chain}) != len(chain):
        raise UnverifiedClassifierError("the classifier's chain record lists a study or a session twice")
    return chain


def chain_values(
    record: Mapping[str, Any], classifier: Classifier, own: Mapping[str, np.ndarray],
    noise: Mapping[str, Any], signed_survivors: Callable[[str], Collection[str] | None],
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:  # fmt: skip
    """This node's values in a growing study's sums: ``own`` (this run's) plus its kept values of
    every earlier run of the chain the classifier records that lists it among the run's survivors;
    under DP also its :func:`run_noise` records of those runs, with ``noise`` (this run's).

    Fails closed (:class:`UnverifiedClassifierError`, never a wrong term): a chain record that does
    not end with this run after the study it extends, an earlier run's survivor absent from this
    session (its uploads are in the sums, its term would not be), a run that included this node
    whose values it did not keep (a chain started before nodes kept them, or a record lost), a run
    this node kept whose study extends another than the run before it in the record, a run recorded
    otherwise (session, survivors) than when this node checked its classifier.  A check that
    then passes means: W is the ridge solution of the sums of the runs the chain record lists.

    Which runs' values enter this node's terms is never the file's word alone: a run whose R3 this
    node signed (``signed_survivors``, its ledger) must be recorded with the survivor set it
    signed.  A record leaving it out of one of its runs
    (withheld that run's classifier, then omitted it) would have it drop that run's values from its
    terms while the sum holds them: the difference from the sum the coordinator knows would be this
    node's values of that run."""
    chain = _recorded_chain(record, classifier)
    client_id, survivors = str(record["client_id"]), set(chain[-1][2])
    absent = sorted({c for entry in chain[:-1] for c in entry[2]} - survivors)
    if absent:
        raise UnverifiedClassifierError(
            f"the chain's earlier runs included {', '.join(absent)}, not among this session's survivors: "
            "their earlier uploads are in the sums, but their terms would be missing from the check; the "
            "classifier is not verified (every earlier contributor must survive a later run of the chain)"
        )
    if not record.get("keep_dir"):
        raise UnverifiedClassifierError(
            "this node keeps no values across runs: it cannot check a growing study"
        )
    directory = Path(str(record["keep_dir"]))
    listed = [list(e) for e in chain]
    by_study = {e[0]: e for e in chain}
    base: tuple[int, Path | None] = (0, None)  # the longest chain record that is a prefix of the chain
    for path, meta in _kept(directory, client_id, "chain"):
        prefix = [[str(e[0]), str(e[1]), tuple(str(s) for s in e[2])] for e in meta.get("chain", [])]
        for study, session_id, included in prefix:  # a run this node checked before: recorded alike
            if by_study.get(study, (study, session_id, included)) != (study, session_id, included):
                raise UnverifiedClassifierError(
                    f"the classifier's chain record of study {study[:16]}... (its session or survivors) "
                    "differs from the one this node checked that run's classifier with: the chain is not "
                    "the one this node took part in; the classifier is not verified"
                )
        if base[0] < len(prefix) < len(chain) and listed[: len(prefix)] == prefix:
            base = (len(prefix), path)
    private = "study" in record  # DP: every run's noise share and record come with its values
    noise, values = dict(noise), {}
    if base[1] is not None:
        meta, values = _read_kept(base[1])
        if private and not meta.get("noise_records"):
            raise UnverifiedClassifierError(
                "this node's record of the chain's earlier runs holds no DP noise records (kept by an "
                "earlier release): it cannot size the chain's ridge or check its runs' ε; start a new "
                "chain to get verified classifiers"
            )
        noise.update(meta.get("noise_records") or {})
    runs = {str(meta.get("session_id")): (path, meta) for path, meta in _kept(directory, client_id, "run")}
    for study, session_id, included in chain[:-1]:
        signed = signed_survivors(session_id)
        if signed is not None and sorted(signed) != sorted(included):
            raise pv.VerificationError(
                f"the classifier's chain record states the survivors of session {session_id[:16]}... (study "
                f"{study[:16]}...) as {sorted(included)}, but this node signed {sorted(signed)} in its R3: "
                "the coordinator misstated whose values that run's sums hold; this node sends no terms"
            )
    for j in range(base[0], len(chain) - 1):
        study, session_id, included = chain[j]
        run = runs.get(session_id)
        if run is not None and (
            run[1].get("study") != study or (j and run[1].get("extends") != chain[j - 1][0])
        ):
            raise UnverifiedClassifierError(
                f"the classifier's chain record lists session {session_id[:16]}... as study {study[:16]}... "
                f"after {chain[j - 1][0][:16] if j else 'none'}..., but this node took part in it as study "
                f"{str(run[1].get('study'))[:16]}... extending {str(run[1].get('extends'))[:16] or 'none'}"
                "...: the chain is not the one this node took part in; the classifier is not verified"
            )
        if client_id not in included:
            continue
        if run is None:
            raise UnverifiedClassifierError(
                f"the chain's run {j + 1} (study {study[:16]}..., session {session_id[:16]}...) included "
                f"this node, but it keeps no values of that run in its ledger dir's {KEPT_DIR}/ (nodes keep "
                "them from this version on; a chain started before, or a lost record): it cannot form its "
                "term; start a new chain to get verified classifiers"
            )
        more = _read_kept(run[0])[1]
        if private:
            if "study_json" not in run[1]:
                raise UnverifiedClassifierError(
                    f"this node's record of the chain's run {j + 1} holds no study (kept by an earlier "
                    "release): it cannot size the chain's ridge; start a new chain for verified classifiers"
                )
            from .study import Study

            noise[session_id] = run_noise(Study.from_json(str(run[1]["study_json"])), len(included))
            more.update(noise_share(noise[session_id], len(included)))
        values = _added(values, more)
    values = _added(values, own)
    _fold(directory, client_id, chain, values, noise)
    if base[1] is not None:  # superseded: one record per chain (a fork from it is then unverified)
        base[1].unlink(missing_ok=True)
    return values, noise


def _added(total: Mapping[str, np.ndarray], more: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = dict(total)
    for key, value in more.items():
        if key in out and out[key].shape != value.shape:
            raise UnverifiedClassifierError(f"this node's kept {key} changed shape between the chain's runs")
        out[key] = out[key] + value if key in out else np.asarray(value, dtype=np.float64)
    return out


@dataclass
class Held:
    """What :func:`begin_check` decided for a classifier: hold it (store only once verified) or not;
    ``payload``: this node's signed masked terms, for the acknowledgement."""

    hold: bool
    meta: dict[str, Any] = field(default_factory=dict)
    why: str = ""
    payload: bytes = b""


def _commitments(meta: Mapping[str, Any], session_id: bytes) -> dict[str, pv.Commitment]:
    try:
        relayed = json.loads(str(meta["verify-commitments"]))
        assert isinstance(relayed, dict)
    except (KeyError, ValueError, AssertionError):
        raise pv.VerificationError("the classifier came without every survivor's commitment") from None
    return {str(cid): pv.Commitment.from_text(str(cid), session_id, text) for cid, text in relayed.items()}


def begin_check(
    classifier: Classifier, payload: bytes, meta: Mapping[str, Any], state: Any, roster: Roster,
    client_id: str, require: str, identity_of: Callable[[], tuple[str, IdentityKey]],
    signed_survivors: Callable[[str], Collection[str] | None],
) -> Held:  # fmt: skip
    """On the classifier's delivery: check every survivor's commitment (this node's own included,
    each signed by its roster key), compute this node's residual terms and answer them masked and
    signed; hold the classifier unless this node stores every classifier (``false``: a classifier
    it cannot check is then stored unverified)."""
    try:
        return _begin_check(
            classifier, payload, meta, state, roster, client_id, require, identity_of, signed_survivors
        )
    except (pv.VerificationError, UnverifiedClassifierError) as exc:
        if require != "false":
            raise  # the refusal (client.py) forgets the check's secrets too
        # Stored unverified: this node's check is over (a record it cannot write: the next run deletes it).
        with contextlib.suppress(OSError, DeploymentError):
            forget_check(state)
        return Held(False, why=f"{type(exc).__name__}: {exc}")


def ends_check(exc: BaseException) -> bool:
    """Whether refusing a classifier or check message for ``exc`` ends this node's check: a refusal
    of what the coordinator sent does; one for the node's own trouble (its disk, its passphrase file,
    its config) does not, so a copy the coordinator sends again can still be answered."""
    from .errors import ClassifierFileError, RosterMismatchError, SessionReplayError

    checks = (pv.VerificationError, UnverifiedClassifierError, ClassifierCheckFailedError)
    return isinstance(exc, (*checks, ClassifierFileError, RosterMismatchError, SessionReplayError))


def forget_check(state: Any) -> None:
    """End this node's check for the run: the values it kept for its terms and its mask key are
    deleted from its records, and a check not yet answered says ``failed`` (a later delivery is
    refused).  Called when the node refuses the classifier or a message of its check for what the
    coordinator sent (:func:`ends_check`), or stores the classifier unverified: a check that cannot
    finish keeps no secret on the node's disk until the next run.  A check already answered (its
    masked terms sent) holds no secret any more and is left as it is."""
    try:  # the values first, whatever the check's own record says
        kept = state.load(STATE_INPUTS)
        if kept is not None and "inputs" in kept:
            state.save(STATE_INPUTS, {"session_id": kept.get("session_id", "")})
    finally:
        record = state.load(STATE_LABEL)
        if record is not None and record.get("status") == "committed":
            state.save(STATE_LABEL, {"status": "failed", "session_id": record.get("session_id", "")})


def _begin_check(
    classifier: Classifier, payload: bytes, meta: Mapping[str, Any], state: Any, roster: Roster,
    client_id: str, require: str, identity_of: Callable[[], tuple[str, IdentityKey]],
    signed_survivors: Callable[[str], Collection[str] | None],
) -> Held:  # fmt: skip
    record = state.load(STATE_LABEL)
    if record is None:  # the study is not checked (no commitment was made in R0)
        return Held(False, why="not offered for this study")
    session = classifier.sessions[0]
    if record.get("status") != "committed" or record.get("session_id") != session["session_id"]:
        raise pv.VerificationError(
            "this node's check was already answered or belongs to another session: a classifier is "
            "checked once per session (run the session again)"
        )
    if not record.get("kept"):
        raise UnverifiedClassifierError("this node kept no values of session 1 to check the classifier with")
    session_id = bytes.fromhex(record["session_id"])
    survivors = [str(s) for s in session["survivors"]]
    if client_id not in survivors:
        raise pv.VerificationError(
            f"the classifier's survivors {survivors} omit {client_id}, whose masked values the session summed"
        )
    # The check's members are the survivor set this node signed in R3, whose values the sums hold:
    # a set the coordinator names instead (two members, one its colluder) would let a colluder
    # remove this node's only pad and read its residual for a classifier the coordinator chose.
    signed = signed_survivors(record["session_id"])
    if signed is None:
        raise UnverifiedClassifierError(
            "this node's ledger holds no survivor set it signed for the session: run the session again"
        )
    if sorted(signed) != sorted(survivors):
        raise pv.VerificationError(
            f"the classifier's survivors {survivors} are not the set this node signed in R3 "
            f"{sorted(signed)}: the check runs over the sum's members only"
        )
    own = pv.Commitment.from_text(client_id, session_id, str(record["commitment"]))
    commitments = _commitments(meta, session_id)
    keys = {entry.client_id: entry.public_key for entry in roster}
    pv.check_commitments(commitments, survivors, keys, own)
    form = str(record.get("form", "client"))
    counts = _relayed_counts(meta, form, classifier.weights.shape[1])
    # The transcript binds every value the coordinator sent that shapes this node's terms (the exact
    # file, the count sums): a node given others masks with other pads, which cancel with nobody's
    # (protocol/verify.py), so no sum is formed over values chosen per node, which would isolate one
    # node's statistics (counts off by one at one node shift the sum by its class sum).
    seed = pv.transcript(check_context(payload, counts), commitments)
    ridge = study_ridge(record)
    gamma = _solve_gamma(float(record["gamma"]), classifier)
    weights = solved_weights(classifier, record)  # W, or W_K once W = M W_K is checked
    inputs = check_inputs(state, record, classifier, signed_survivors)
    terms = node_terms(inputs, weights, gram=str(record["gram"]), form=form, counts=counts, ridge=ridge)
    words = pv.mask(terms, client_id, _secret(record), commitments, seed)
    signer, identity = identity_of()
    if signer != client_id:
        raise UnverifiedClassifierError("the identity key changed since the session")
    masked = pv.sign_masked(client_id, words, seed, identity.private_key)
    hold = require != "false"
    state.save(STATE_INPUTS, {"session_id": record["session_id"]})  # the values are no longer needed
    rest = {k: v for k, v in record.items() if k != "key"}  # nor is the mask key
    state.save(
        STATE_LABEL,
        {**rest, "status": "masked", "classifier": payload, "held": hold, "seed": seed,
         "masked": masked.to_bytes(), "solve_gamma": gamma, "counts": json.dumps(counts),
         "ridge": json.dumps(ridge),
         "commitments": json.dumps({c: x.to_text() for c, x in commitments.items()})},
    )  # fmt: skip
    return Held(hold, {"verify-masked": True}, payload=masked.to_bytes())


def _statistics_weights(classifier: Classifier) -> np.ndarray:
    """The privacy record's W_K (the weights before the lift W = M W_K)."""
    from .study import STATISTICS_WEIGHTS

    try:
        return np.asarray((classifier.privacy or {})[STATISTICS_WEIGHTS], dtype=np.float64)
    except (KeyError, TypeError, ValueError):
        raise UnverifiedClassifierError(
            f"the classifier's privacy record holds no {STATISTICS_WEIGHTS} (W_K before the lift W = M W_K): "
            "it cannot be checked; run the session again with a coordinator that records them"
        ) from None


def solved_weights(classifier: Classifier, record: Mapping[str, Any]) -> np.ndarray:
    """The weights the solve fitted: the file's W, or under ``--dp-dim`` or the row centring the
    privacy record's ``W_K`` once the file's W is its lift ``M W_K`` (M: the study's public row map,
    which this node derives itself) within the product's rounding: ``|W − M W_K| ≤ 2 K u |M| |W_K|``
    entrywise (u = 2^-53; any summation order, BLAS or machine)."""
    from .study import STATISTICS_WEIGHTS, dp_projection

    study = _record_study(record)
    if study is None:
        return classifier.weights
    row_map = dp_projection(study)
    if row_map is None:
        return classifier.weights
    solved = _statistics_weights(classifier)
    d, k = row_map.shape
    if solved.shape != (k, classifier.weights.shape[1]) or not np.all(np.isfinite(solved)):
        raise ClassifierCheckFailedError(
            f"the classifier's {STATISTICS_WEIGHTS} are not {k} × {classifier.weights.shape[1]} finite values"
        )
    lifted = row_map @ solved
    bound = 2 * k * 2.0**-53 * (np.abs(row_map) @ np.abs(solved))
    if classifier.weights.shape != (d, solved.shape[1]) or np.any(
        np.abs(classifier.weights - lifted) > bound
    ):
        raise ClassifierCheckFailedError(
            f"the released weights are not the lift M W_K of the classifier's {STATISTICS_WEIGHTS} (M: the "
            "study's public row map): it is not stored as verified"
        )
    return solved


def loaded_once(load: Callable[[], Loaded]) -> Callable[[], Loaded]:
    """``load`` (the node's identity: its passphrase, scrypt; its ledger), called on first use only."""
    loaded: list[Loaded] = []

    def value() -> Loaded:
        if not loaded:
            loaded.append(load())
        return loaded[0]

    return value


def _secret(record: Mapping[str, Any]) -> pv.VerifySecret:
    """The check's mask key, kept from the session's seed when session 1 was done (:func:`keep_inputs`)."""
    if "key" not in record:
        raise UnverifiedClassifierError("this node no longer holds the check's secret: run the session again")
    return pv.VerifySecret(bytes(record["key"]))


def answer_check(
    envelope: Envelope, state: Any, roster: Roster, out_dir: Path, log: Callable[[str], None]
) -> Envelope:
    """The node's answer to the ``verify-sums`` relay (every survivor's signed masked terms): the
    decision; on a pass the held classifier is stored with its record."""
    from .classifier import Classifier

    record = state.load(STATE_LABEL)
    round_name = str(envelope.meta.get("round", ""))
    if record is None or "classifier" not in record:
        raise pv.VerificationError(f"a {round_name} message, but this node holds no classifier to check")
    if round_name != "verify-sums" or record.get("status") != "masked":
        raise pv.VerificationError(f"unexpected {round_name!r} message at this point of the check")
    session_id, client_id = bytes.fromhex(record["session_id"]), str(record["client_id"])
    commitments = {
        c: pv.Commitment.from_text(c, session_id, t) for c, t in json.loads(record["commitments"]).items()
    }
    keys = {entry.client_id: entry.public_key for entry in roster}
    payload = bytes(record["classifier"])
    # Its signature was checked on delivery; the bytes held since are this node's own state.
    classifier = Classifier.from_json(payload, roster=None, source="the held classifier")
    seed = bytes(record["seed"])
    own = pv.MaskedValue.from_bytes(client_id, bytes(record["masked"]))
    try:
        ids = json.loads(envelope.text("masked-ids"))
        assert isinstance(ids, list) and all(isinstance(c, str) for c in ids)
    except (ValueError, AssertionError):
        raise pv.VerificationError("the relay's masked-ids is not a JSON list of ids") from None
    state.save(STATE_LABEL, {"status": "failed", "session_id": record["session_id"]})  # one decision
    masked = pv.unpack_relay(ids, envelope.payload, len(own.data) // pv.WORD_BYTES)
    counts = json.loads(str(record.get("counts", "{}")))
    # The scale and the counts correctly rounded: the counts are compared for equality.
    ridge = json.loads(str(record.get("ridge", "null")))
    sums = pv.unmask_sum(masked, commitments, keys, seed, own, exact=1 + len(counts) + len(ridge_keys(ridge)))
    gamma = float(record["solve_gamma"])
    if ridge is not None:  # λ from the survivors' summed noise (and adassp's noisy λ_min), as the solve
        sums, lam = _checked_ridge(ridge, classifier, sums)
        gamma += lam
    # W_K was checked against the file's W on delivery (the held bytes are this node's own state).
    solved = _statistics_weights(classifier) if _maps_rows(record) else classifier.weights
    ok, ratios = decide(sums, solved, gamma, counts)
    if not ok:
        bad = [c for c, r in enumerate(ratios) if not r <= 1.0]
        raise ClassifierCheckFailedError(
            f"the classifier is not the solution of the session's sums: classes {bad} have residuals "
            f"above the rounding bound (residual/bound {max(ratios):.3g}); it is not stored as verified"
        )
    stored_latest = _store(out_dir, payload, bool(record["held"]), log)
    document = {
        "format": RECORD_FORMAT, "classifier_sha256": hashlib.sha256(payload).hexdigest(),
        "verified": True, "transcript_sha256": seed.hex(), "survivors": sorted(commitments),
        "max_residual_over_bound": max(ratios), "rho": rho(solved.shape[0]),
        "checked": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }  # fmt: skip
    for path in stored_latest:
        _write_record(path, document)
    state.save(STATE_LABEL, {"status": "verified", "session_id": record["session_id"]})
    log(
        f"{client_id}: verified the classifier ({len(commitments)} survivors, every class's residual "
        f"at most {max(ratios):.2g} of its rounding bound)"
    )
    return Envelope("ack", {"round": round_name, "verified": True, "sha256": document["classifier_sha256"]})


def check_context(payload: bytes, counts: Mapping[str, float]) -> bytes:
    """What the check's transcript binds besides the commitments: the file's SHA-256 and the count
    sums the coordinator sent with it (each exactly, as float.hex, in key order)."""
    relayed = json.dumps([[key, float(counts[key]).hex()] for key in sorted(counts)]).encode("ascii")
    return hashlib.sha256(payload).digest() + hashlib.sha256(relayed).digest()


def _relayed_counts(meta: Mapping[str, Any], form: str, n_classes: int) -> dict[str, float]:
    """The count sums the coordinator says it solved with (checked against the survivors' sum)."""
    keys = count_keys(form, n_classes)
    if not keys:
        return {}
    try:
        relayed = json.loads(str(meta["verify-counts"]))
        return {key: float(relayed[key]) for key in keys}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise pv.VerificationError(
            f"the classifier came without the count sums the solve used ({', '.join(keys)})"
        ) from None


def study_ridge(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """Under DP, how the solve sizes its extra ridge λ, from the study this node pinned: its kind, the
    statistics' dimension and β.  The noise it is sized from comes from the check's own sum (each
    survivor's :func:`noise_share`; ``"adassp"``: also its noisy λ_min upload), never from the file:
    the file's λ would be the coordinator's choice.  None without DP."""
    from .study import statistics_dim

    study = _record_study(record)
    if study is None or study.dp is None:
        return None
    config = study.dp.config()
    if config.ridge not in DERIVABLE_RIDGES:  # not_offered refused it before the commitment
        raise UnverifiedClassifierError(f"the DP ridge {config.ridge!r} cannot be derived by a node")
    return {"kind": config.ridge, "dim": statistics_dim(study), "beta": config.ridge_failure_probability,
            "growing": bool(study.extends)}  # fmt: skip


def _checked_ridge(
    ridge: Mapping[str, Any], classifier: Classifier, sums: np.ndarray
) -> tuple[np.ndarray, float]:
    """λ as this node derives it from the check's sum (:func:`secure_afl.privacy.dp_solve.derived_ridge`
    over the summed noise variances and, for ``"adassp"``, the summed noisy λ_min), after checking
    that the file's privacy record states that λ and what it was sized from (the Gram's noise std,
    the bound, adassp's λ̃_min; a growing chain's noise), to rounding (the variances are summed in
    another order than the solve's); also ``sums`` without those values."""
    from secure_afl.privacy.dp_solve import adassp_lower, derived_ridge, ridge_for_noise

    keys = ridge_keys(ridge)
    summed = dict(zip(keys, (float(x) for x in sums[-len(keys) :]), strict=True))
    sums = sums[: -len(keys)]
    gram_var, eigen_var, eigen_sum = summed[NOISE_KEYS[0]], summed[NOISE_KEYS[1]], summed.get(EIGEN_KEY)
    kind, dim, beta = str(ridge["kind"]), int(ridge["dim"]), float(ridge["beta"])
    gram_std, eigen_std = float(np.sqrt(max(gram_var, 0.0))), float(np.sqrt(max(eigen_var, 0.0)))
    derived = derived_ridge(kind, gram_std, dim, beta, eigen_sum=eigen_sum, eigen_std=eigen_std)
    assert derived is not None
    privacy = classifier.privacy or {}
    growth = privacy.get("growth") if isinstance(privacy.get("growth"), Mapping) else {}
    expected: dict[str, tuple[Any, float | None]] = {
        "ridge": (privacy.get("ridge"), derived),
        "gram_noise_std": (privacy.get("gram_noise_std"), gram_std),
        "ridge_noise_bound": (privacy.get("ridge_noise_bound"), ridge_for_noise(gram_std, dim, beta)),
        "min_eigenvalue_lower_bound": (
            privacy.get("min_eigenvalue_lower_bound"),
            None if eigen_sum is None else adassp_lower(eigen_sum, eigen_std, beta),
        ),
    }
    if growth:
        expected["growth.gram_noise_std_chain"] = (growth.get("gram_noise_std_chain"), gram_std)
        expected["growth.eigen_noise_std_chain"] = (
            growth.get("eigen_noise_std_chain"), None if eigen_sum is None else eigen_std,
        )  # fmt: skip
    wrong = [key for key, (stated, value) in expected.items() if not _same_record(stated, value)]
    if ridge.get("growing"):
        misstated = summed[MISSTATED_KEY]
        if misstated != 0:
            raise ClassifierCheckFailedError(
                f"{misstated:g} of the survivors found the file's noise record of a run they took part in "
                "(its ε per institution, its noise stds) other than the one that run's study gives: the "
                "coordinator misstated what the chain's runs spent; it is not stored as verified"
            )
        if not _same_record(growth, chain_record(classifier)):
            wrong.append("growth (the chain's ε and noise, from its runs' records)")
    if wrong:
        raise ClassifierCheckFailedError(
            f"the classifier's DP record states {', '.join(wrong)} other than the study's (λ = {derived!r}, "
            "sized from the noise of the sums' runs at their survivors): the coordinator chose another "
            "ridge or misstated what it was sized from; it is not stored as verified"
        )
    return sums, derived


def chain_record(classifier: Classifier) -> dict[str, Any] | None:
    """The ``growth`` part of a growing DP classifier's privacy record as its chain record's run
    records give it (:meth:`~secure_afl.privacy.dp_growth.ChainNoise.record`, the solve's own
    function); None if they are not DP run records."""
    from secure_afl.privacy.dp_config import DpError
    from secure_afl.privacy.dp_growth import chain_of

    try:
        chain = chain_of([entry["dp"] for entry in classifier.protocol["growth"]["chain"]])
    except (DpError, KeyError, TypeError):
        return None
    return None if chain is None else chain.record()


def _solve_gamma(gamma: float, classifier: Classifier) -> float:
    """γ (under DP the ridge λ is added once the check's sum gives its noise: :func:`_checked_ridge`);
    a DP solve whose noisy Gram had its eigenvalues floored is no ridge solve of the sums and cannot
    be checked."""
    # Whether the file has a DP record is the study's (checked on delivery: classifier_fields).
    if (classifier.privacy or {}).get("eigenvalue_floor"):
        raise UnverifiedClassifierError(
            "the DP solve floored the noisy Gram's eigenvalues (its ridge bound failed): the classifier is "
            "not the ridge solve of the sums, so it cannot be checked; run the session again"
        )
    return gamma


def _maps_rows(record: Mapping[str, Any]) -> bool:
    from .study import has_row_map

    study = _record_study(record)
    return study is not None and has_row_map(study)


def _record_study(record: Mapping[str, Any]) -> Study | None:
    """The study a DP check's record keeps (:func:`keep_inputs`); None without DP."""
    from .study import Study

    return Study.from_json(str(record["study"])) if "study" in record else None


def _store(out_dir: Path, payload: bytes, held: bool, log: Callable[[str], None]) -> list[Path]:
    from .classifier import HISTORY_DIR, LATEST_NAME, history_name, keep_classifier

    if held:
        stored = keep_classifier(out_dir, payload)
        log(f"stored the verified classifier in {stored.latest} and {stored.kept}")
        return [stored.latest, stored.kept]
    paths = [out_dir / HISTORY_DIR / history_name(payload)]
    latest = out_dir / LATEST_NAME
    if latest.is_file() and latest.read_bytes() == payload:
        paths.append(latest)
    return paths


def record_path(classifier_path: Path) -> Path:
    """The check's record of a classifier file: ``classifier.verified.json`` beside ``classifier.json``;
    for a history file ``OUT_DIR/classifiers/X.json``, ``OUT_DIR/checks/X.verified.json``."""
    from .classifier import HISTORY_DIR

    name = classifier_path.name.removesuffix(".json") + RECORD_SUFFIX
    if classifier_path.parent.name == HISTORY_DIR:
        return classifier_path.parent.parent / CHECKS_DIR / name
    return classifier_path.with_name(name)


def _write_record(classifier_path: Path, document: Mapping[str, Any]) -> None:
    from .tls import write_with_mode

    path = record_path(classifier_path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_with_mode(path, (json.dumps(document, indent=1) + "\n").encode(), 0o600)


def verification_status(classifier_path: Path) -> str:
    """One line for ``predict``: whether this node verified the classifier file's exact bytes."""
    path = record_path(Path(classifier_path))
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        data = Path(classifier_path).read_bytes()
    except (OSError, ValueError):
        return "classifier check: NOT verified (no check record beside the file: SECURITY.md §5.1)"
    if (
        not isinstance(document, dict)
        or document.get("format") not in RECORD_FORMATS
        or document.get("classifier_sha256") != hashlib.sha256(data).hexdigest()
        or document.get("verified") is not True
    ):
        return f"classifier check: NOT verified ({path.name} is not a passing record of this file)"
    return (
        f"classifier check: verified by this node at {document.get('checked')} against the sums of "
        f"{len(document.get('survivors', []))} survivors (transcript "
        f"{str(document.get('transcript_sha256'))[:16]}...)"
    )


# --- the coordinator -------------------------------------------------------------------------


class ServerCheck:
    """The coordinator's part: keep the commitments, send them and the count sums with the
    classifier, relay every survivor's masked terms once (it computes nothing and can change
    nothing without every honest node refusing)."""

    def __init__(self, study: Study, roster_ids: Collection[str]) -> None:
        self.offered = not_offered(study, roster_ids) is None
        self.form, self.n_classes = rhs_form(study), study.n_classes
        self.commitments: dict[str, str] = {}
        self.verified: tuple[str, ...] = ()
        self.refusals: list[tuple[str, str, Envelope]] = []  # (step, client, its refusal)
        self.seconds = 0.0

    def note(self, label: str, client_id: str, meta: Mapping[str, Any]) -> None:
        if label == "1" and isinstance(meta.get("verify-commit"), str):
            self.commitments[client_id] = str(meta["verify-commit"])

    def delivery_meta(
        self, survivors: Collection[str], counts: Mapping[str, float] | None = None
    ) -> dict[str, str]:
        """The classifier's metadata: every survivor's commitment and (global balance, DP) the count
        sums the solve divided by (:func:`count_claims`)."""
        if not self.offered:
            return {}
        meta = {
            "verify-commitments": json.dumps(
                {c: self.commitments[c] for c in survivors if c in self.commitments}
            )
        }
        if counts:
            meta["verify-counts"] = json.dumps(dict(counts))
        return meta

    def run(
        self, exchange: Callable[[Mapping[int, Envelope], str, float], Mapping[int, Envelope]],
        node_of: Mapping[str, int], replies: Mapping[int, Envelope], timeout: float,
        log: Callable[[str], None],
    ) -> tuple[str, ...]:  # fmt: skip
        """The one relay after the delivery's ``replies`` (each survivor's masked terms in its
        acknowledgement's payload), sent by ``exchange``; returns who verified."""
        import time

        if not self.offered:
            return ()
        started = time.perf_counter()
        client_of = {node: cid for cid, node in node_of.items()}
        masked = {
            client_of[n]: e.payload
            for n, e in replies.items()
            if e.kind == "ack" and e.meta.get("verify-masked") and n in client_of
        }
        ids, data = pv.pack_relay(masked)
        meta = {"round": "verify-sums", "masked-ids": json.dumps(ids)}
        outgoing = {node_of[c]: Envelope("verify", meta, data) for c in ids}
        decisions = exchange(outgoing, "verify-sums", timeout)
        self.verified = tuple(
            sorted(client_of[n] for n, e in decisions.items() if e.kind == "ack" and e.meta.get("verified"))
        )
        self.refusals += [
            ("verify-sums", client_of[n], e) for n, e in sorted(decisions.items()) if e.kind == "refused"
        ]
        self.seconds = time.perf_counter() - started
        log(f"classifier check: verified by {', '.join(self.verified) or 'no node'} in {self.seconds:.2f} s")
        return self.verified
