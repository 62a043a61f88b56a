"""The classifier file and the predictions ``secure-afl predict`` makes with it.

One JSON document (``secure-afl-classifier/v2``), nothing executable, no pickle::

    {
      "format": "secure-afl-classifier/v2",
      "classes": ["Atelectasis", ...],                    # column order of the weights
      "weights": {"dtype": "<f8", "shape": [d, C],         # w_c as columns, little-endian float64
                  "data": base64, "sha256": hex},          # exact bits, and their digest
      "decision_threshold": 0.5,                           # positive when sigmoid(h . w_c) > 0.5,
                                                           # i.e. h . w_c > 0: a rule, not a risk
      "backbone": {"name", "weights_id", "preprocessing"}, # what the features must come from
      "preprocessing": "...",                              # the same description, for readers
      "method": {"gamma", "balance", "gram", "rounds", "alpha", "tau", "min_pos", "min_neg"},
      "protocol": {"backend", "threshold", "min_group_size", "frac_bits"},
      "sessions": [{"label", "session_id" (hex), "participants", "survivors"}],
      "roster_fingerprint": "SHA256:...",
      "audit": {"groups": [{"session", "name", "members", "survivors", "tensors"}],
                "warnings": [...], "refusals": [...], "dropouts": [...]},
      "study_digest": hex,
      "created": ISO 8601 time,
      "differential_privacy": {...},                       # only under DP: ε target and spent per
                                                           # institution, δ, clip, unit, noise per block
      "content_sha256": hex,                               # SHA-256 of the canonical content
      "signature": {"algorithm": "ed25519", "signer", "fingerprint", "value": base64}
    }

**The content** is every field but ``content_sha256`` and ``signature`` (unknown extra fields
included), as canonical JSON (:func:`canonical_content`: keys sorted, no spaces, UTF-8), so the
digest covers everything that changes a prediction: the weights, the threshold, the classes, the
backbone and preprocessing, the method, the DP record, the sessions and the roster fingerprint.
**The signature** is the coordinator's Ed25519 signature (its key is the roster's ``coordinator``
entry, :class:`~secure_afl.keys.roster.Roster`) over :data:`SIGNATURE_CONTEXT`, the signer's id
and the content digest.  The server signs the file; every participant verifies the signature against
its pinned roster, and checks the roster fingerprint and the session ids against its own, before
saving the exact bytes it received; ``secure-afl predict --roster`` verifies it again.  A reader
that cannot check (``roster=None``) still checks the digest; only the signature authenticates.
Files of the unsigned ``secure-afl-classifier/v1`` are refused.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import datetime
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from secure_afl.keys.identity import IdentityKey
from secure_afl.keys.roster import Roster

from .errors import (
    ClassifierAuditMisstatedError,
    ClassifierFileError,
    ClassifierNotOfStudyError,
    ClassifierSignatureError,
    ClassifierTamperedError,
    ConfigurationError,
    ModelMismatchError,
    RosterMismatchError,
    UnsignedClassifierError,
)


def _canonical(value: Any) -> str:
    """A JSON value as compared with another: keys sorted, a tuple and a list alike."""
    return json.dumps(value, sort_keys=True, default=str)


SESSION_FIELDS = ("label", "session_id", "participants", "survivors")  # a session's record in the file
AUDIT_PARTS = ("groups", "warnings", "refusals", "rejections", "dropouts")  # the file's audit
CLASSIFIER_FORMAT = "secure-afl-classifier/v2"
UNSIGNED_FORMATS = ("secure-afl-classifier/v1",)
MAX_CLASSIFIER_BYTES = 512 * 1024 * 1024
SIGNATURE_CONTEXT = b"secure-afl classifier signature/v2\x00"
UNCOVERED = ("content_sha256", "signature")  # the fields the content digest cannot cover


def canonical_content(document: Mapping[str, Any]) -> bytes:
    """Every field but ``content_sha256`` and ``signature``, as canonical JSON (UTF-8 bytes).

    Keys sorted, no whitespace, floats as Python's shortest round-trip form: parsing a file and
    canonicalising it gives the same bytes as canonicalising what the server wrote.
    """
    content = {key: value for key, value in document.items() if key not in UNCOVERED}
    return json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def content_digest(document: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical_content(document)).hexdigest()


def _signed_message(signer: str, digest_hex: str) -> bytes:
    return SIGNATURE_CONTEXT + signer.encode("ascii") + b"\x00" + bytes.fromhex(digest_hex)


@dataclass(frozen=True)
class ClassifierSigner:
    """The coordinator's identity: the roster's ``coordinator`` entry and its private key."""

    coordinator_id: str
    key: IdentityKey

    @classmethod
    def for_roster(cls, roster: Roster, key: IdentityKey) -> ClassifierSigner:
        """Refuse a key that is not the roster's coordinator (before any session starts)."""
        coordinator = roster.coordinator
        if coordinator is None:
            raise ConfigurationError(
                f"the roster ({roster.fingerprint}) names no coordinator, so no institution could verify the "
                "classifier: add the coordinator's identity.pub.json with `secure-afl keys roster add "
                "--coordinator --entry FILE` and give every institution the new roster"
            )
        if coordinator.public_key != key.public_key:
            raise ConfigurationError(
                f"the coordinator's identity key ({key.fingerprint}) is not the roster's coordinator "
                f"{coordinator.client_id!r} ({coordinator.fingerprint}): set the run config's identity-key "
                "and passphrase-file to the key the roster names"
            )
        return cls(coordinator.client_id, key)

    def sign(self, document: Mapping[str, Any]) -> dict[str, str]:
        digest = content_digest(document)
        value = self.key.private_key.sign(_signed_message(self.coordinator_id, digest))
        return {
            "algorithm": "ed25519",
            "signer": self.coordinator_id,
            "fingerprint": self.key.fingerprint,
            "value": base64.b64encode(value).decode("ascii"),
        }


def verify_signature(document: Mapping[str, Any], roster: Roster, *, source: str = "classifier") -> str:
    """Check ``document``'s signature against ``roster``'s coordinator; return the signer's id.

    The content digest must already have been checked (:meth:`Classifier.from_json` does).
    """
    coordinator = roster.coordinator
    if coordinator is None:
        raise ClassifierSignatureError(
            f"{source}: the roster ({roster.fingerprint}) names no coordinator, so the classifier's "
            "signature cannot be checked: pin the roster that names the coordinator (the coordinator adds "
            "itself with `secure-afl keys roster add --coordinator`)"
        )
    signature = document.get("signature")
    if signature is None:
        raise UnsignedClassifierError(
            f"{source}: the classifier is not signed, so nothing shows that the coordinator made it: ask "
            f"the coordinator ({coordinator.client_id}, {coordinator.fingerprint}) for the signed file its "
            "run wrote"
        )
    try:
        if signature["algorithm"] != "ed25519":
            raise ClassifierSignatureError(
                f"{source}: unknown signature algorithm {signature['algorithm']!r} (expected ed25519)"
            )
        signer = str(signature["signer"])
        value = base64.b64decode(signature["value"], validate=True)
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise ClassifierSignatureError(f"{source}: malformed signature: {exc}") from None
    if signer != coordinator.client_id:
        raise ClassifierSignatureError(
            f"{source}: signed by {signer!r} ({signature.get('fingerprint', '?')}), not by the roster's "
            f"coordinator {coordinator.client_id!r} ({coordinator.fingerprint}): do not use this file; ask "
            "the coordinator for the file it signed, or check that you pinned the right roster"
        )
    try:
        Ed25519PublicKey.from_public_bytes(coordinator.public_key).verify(
            value, _signed_message(signer, str(document["content_sha256"]))
        )
    except (InvalidSignature, ValueError):
        raise ClassifierSignatureError(
            f"{source}: the signature does not verify with the key of the roster's coordinator "
            f"{coordinator.client_id!r} ({coordinator.fingerprint}): the file was changed after it was "
            "signed, or signed with another key; do not use it, ask the coordinator for the file again"
        ) from None
    if document.get("roster_fingerprint") != roster.fingerprint:
        raise RosterMismatchError(
            f"{source}: the classifier was made with roster {document.get('roster_fingerprint')}, not "
            f"with the roster you gave ({roster.fingerprint}): verify it with the roster of the run that "
            "made it"
        )
    return signer


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    duplicates = sorted({key for key in keys if keys.count(key) > 1})
    if duplicates:
        # Two readers could take different copies of one field; the digest covers only one of them.
        raise ClassifierTamperedError(f"duplicate field(s) {duplicates} in the classifier file")
    return dict(pairs)


@dataclass(frozen=True)
class Classifier:
    weights: np.ndarray  # d × C float64
    classes: tuple[str, ...]
    backbone: Mapping[str, str]
    method: Mapping[str, Any]
    protocol: Mapping[str, Any]
    sessions: tuple[Mapping[str, Any], ...]
    roster_fingerprint: str
    audit: Mapping[str, Any]
    study_digest: str
    created: str
    decision_threshold: float = 0.5
    privacy: Mapping[str, Any] | None = None  # secure_afl.privacy.dp_solve.privacy_record, under DP
    signer: str | None = field(default=None, compare=False)  # who signed the file it was read from
    content_sha256: str | None = field(default=None, compare=False)  # the digest of the file it was read from

    def check_study_fields(self, expected: Mapping[str, Any], source: str = "the classifier") -> None:
        """Refuse a file whose study-decided fields are not ``expected``
        (:func:`~secure_afl.deploy.study.classifier_fields` of the study this node took part in):
        its classes, dimension, backbone, method, decision threshold, the study's protocol
        parameters, the plan-decided part of its DP record and its study digest."""
        privacy = expected.get("privacy")
        mine = self.privacy
        stated = {
            "study_digest": self.study_digest,
            "classes": list(self.classes),
            "dim": int(self.weights.shape[0]),
            "backbone": dict(self.backbone),
            "method": dict(self.method),
            "decision_threshold": self.decision_threshold,
            "protocol": {k: self.protocol.get(k) for k in expected["protocol"]},
            "keys": {"protocol": sorted(self.protocol), "privacy": None if mine is None else sorted(mine)},
            # A record where the study has none states itself whole: it differs from None.
            "privacy": None if mine is None else {k: mine.get(k) for k in (privacy or mine)},
        }
        differ = [key for key in expected if _canonical(stated[key]) != _canonical(expected[key])]
        if "keys" in differ:
            differ[differ.index("keys")] = "fields its protocol or DP record does not define"
        if differ:
            raise ClassifierNotOfStudyError(
                f"{source} states {', '.join(differ)} other than the study this institution took part in "
                f"(study {expected['study_digest'][:16]}...): the coordinator changed what the study decides "
                "(relabelled classes, another threshold, backbone or DP record); it is not stored"
            )

    def check_layout(self, source: str = "the classifier") -> None:
        """Refuse the file this classifier was read from if it holds a field the format does not
        define: a key beside the file's own, the backbone's or a session's, an audit part other than
        :data:`AUDIT_PARTS`, a top-level ``preprocessing`` other than the backbone's.  The parsed
        classifier, written again, must be the file (its content digest, checked on reading, is the
        one it gives): nothing in it is a statement no reader checks."""
        sessions_known = all(set(s) == set(SESSION_FIELDS) for s in self.sessions)
        if (
            content_digest(self._document()) != self.content_sha256
            or not sessions_known
            or set(self.audit) != set(AUDIT_PARTS)
        ):
            raise ClassifierNotOfStudyError(
                f"{source} holds fields the classifier format does not define (beside its own, its "
                "backbone's, its sessions' or its audit's), or a preprocessing other than its backbone's: "
                "a statement no institution checks; it is not stored"
            )

    def check_session_views(
        self, views: Mapping[str, Mapping[str, Any]], source: str = "the classifier"
    ) -> None:
        """Refuse a file whose record of a session in ``views`` (label -> this node's view, derived
        from the advertisements and the survivor set it signed; the groups by
        :meth:`~secure_afl.aggregation.layout.Layout.group_records`) states its participants,
        survivors or the audit's groups otherwise, or whose audit states groups of a session the
        file does not record: the audit is what the coordinator learned, and a reader of the file
        relies on it."""
        groups = self.audit.get("groups", [])
        labels = {str(s.get("label")) for s in self.sessions}
        malformed = not all(isinstance(g, Mapping) for g in groups)
        strays = [] if malformed else sorted({str(g.get("session")) for g in groups} - labels)
        if malformed or strays:
            raise ClassifierAuditMisstatedError(
                f"{source}'s audit states groups of sessions {strays} it does not record (or malformed "
                "entries): the coordinator misstated what it learned; it is not stored"
            )
        for label, view in views.items():
            session = next((s for s in self.sessions if str(s.get("label")) == label), {})
            stated = {
                "participants": list(session.get("participants", [])),
                "survivors": list(session.get("survivors", [])),
                "groups": [
                    {k: v for k, v in g.items() if k != "session"}
                    for g in groups
                    if g.get("session") == label
                ],
            }
            differ = [key for key, value in stated.items() if _canonical(value) != _canonical(view.get(key))]
            if differ:
                raise ClassifierAuditMisstatedError(
                    f"{source} states session {label}'s {', '.join(differ)} other than this institution took "
                    "part in it (its participants, survivors, groups' members, survivors and tensors): the "
                    "coordinator misstated what it learned; it is not stored"
                )

    def privacy_lines(self) -> list[str]:
        """What ``predict`` prints about the release's differential privacy (nothing without DP)."""
        if self.privacy is None:
            return []
        p = self.privacy
        unit = (
            "one image" if p["unit"] == "image" else f"one patient (≤ {p['max_images_per_patient']} images)"
        )
        spent = p["epsilon_spent"]
        stds = [b["noise_std_at_fewest"] for b in p["blocks"]]
        projection = p.get("projection")  # --dp-dim (absent from records made before it existed)
        rows = (
            "rows not projected"
            if not projection
            else f"rows projected to K = {projection['dim']} by the public projection of seed "
            f"{projection['seed']} before clipping (the weights are W = P W_K)"
        )
        centred = (
            ", each row less its own mean first (the weights are (I − 11ᵀ/d) W')"
            if p.get("row_centre")
            else ""
        )
        growth = p.get("growth")  # a growing study: every session's ε and the chain's
        chain = []
        if growth:
            worst = max(growth["epsilon_chain"].values())
            per_session = ", ".join(
                f"{s['session']}: {max(s['epsilon_spent'].values()):.4f}" for s in growth["sessions"]
            )
            how = "max over sessions" if growth["composition"] == "parallel" else "composed (RDP)"
            chain = [
                f"growing chain of {len(growth['sessions'])} DP sessions: worst ε per session {per_session}; "
                f"chain ε {worst:.4f} ({how}) at δ = {growth['delta_chain']:g}"
            ]
        return [
            f"differentially private: ε = {p['epsilon_target']:g}, δ = {p['delta']:g} for {unit} per "
            f"institution; feature rows clipped to L2 norm {p['clip']:g}",
            "ε spent per institution: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(spent.items())),
            f"noise std per group sum at its fewest survivors: {min(stds):.4g}..{max(stds):.4g}; "
            f"solve ridge λ = {p['ridge']:.4g} ({p.get('ridge_kind', 'bound')})",
            f"mechanism: {rows}{centred}; class sums: {p.get('class_sums', 'split')}",
            *chain,
        ]

    def summary_lines(self) -> list[str]:
        """What ``predict`` prints about the file itself: when it was made, from which study, how."""
        m = self.method
        method = ", ".join(f"{key} {m[key]}" for key in ("gamma", "balance", "gram", "rounds") if key in m)
        protocol = dict(self.protocol)
        protection = str(protocol.get("backend", "?"))
        if "threshold" in protocol:
            protection += f", threshold t = {protocol['threshold']}"
        sessions = ", ".join(
            f"{s.get('label')} {str(s.get('session_id', ''))[:16]}..." for s in self.sessions
        )
        return [
            f"classifier made {self.created}, study digest {self.study_digest}",
            f"method: {method}; protection {protection}; session(s) {sessions}",
        ]

    @property
    def dim(self) -> int:
        return int(self.weights.shape[0])

    def to_json(self, signer: ClassifierSigner | None = None) -> str:
        """The file's text: with ``signer``, signed by the coordinator; without, unsigned (refused by
        every verifying reader)."""
        document = self._document()
        document["content_sha256"] = content_digest(document)
        if signer is not None:
            document["signature"] = signer.sign(document)
        return json.dumps(document, indent=1, sort_keys=False) + "\n"

    def _document(self) -> dict[str, Any]:
        data = np.ascontiguousarray(self.weights, dtype="<f8").tobytes()
        document = {
            "format": CLASSIFIER_FORMAT,
            "classes": list(self.classes),
            "weights": {
                "dtype": "<f8",
                "shape": list(self.weights.shape),
                "data": base64.b64encode(data).decode("ascii"),
                "sha256": hashlib.sha256(data).hexdigest(),
            },
            "decision_threshold": self.decision_threshold,
            "backbone": dict(self.backbone),
            "preprocessing": self.backbone.get("preprocessing", ""),
            "method": dict(self.method),
            "protocol": dict(self.protocol),
            "sessions": [dict(s) for s in self.sessions],
            "roster_fingerprint": self.roster_fingerprint,
            "audit": dict(self.audit),
            "study_digest": self.study_digest,
            "created": self.created,
        }
        if self.privacy is not None:  # absent without DP: the file is what it was before DP
            document["differential_privacy"] = dict(self.privacy)
        return document

    @classmethod
    def from_json(cls, text: str | bytes, *, roster: Roster | None, source: str = "classifier") -> Classifier:
        """Parse and check a classifier file: its content digest always; with ``roster``, also the
        coordinator's signature and the roster fingerprint (``roster=None`` skips only those)."""
        try:
            document = json.loads(text, object_pairs_hook=_no_duplicate_keys)
        except ClassifierTamperedError as exc:
            raise ClassifierTamperedError(f"{source}: {exc}") from None
        except ValueError:
            raise ClassifierFileError(f"{source}: not a {CLASSIFIER_FORMAT} file (not JSON)") from None
        if isinstance(document, dict) and document.get("format") in UNSIGNED_FORMATS:
            raise UnsignedClassifierError(
                f"{source}: a {document['format']} file, written before classifier files were signed: "
                "nothing protects its threshold or shows who made it; use the signed "
                f"{CLASSIFIER_FORMAT} file of a new run"
            )
        if not isinstance(document, dict) or document.get("format") != CLASSIFIER_FORMAT:
            raise ClassifierFileError(f"{source}: not a {CLASSIFIER_FORMAT} file")
        if not isinstance(document.get("content_sha256"), str):
            raise ClassifierTamperedError(f"{source}: the file has no content_sha256 digest")
        if content_digest(document) != document["content_sha256"]:
            raise ClassifierTamperedError(
                f"{source}: the content does not match its sha256 digest: a field (the decision threshold, "
                "the weights, the classes, ...) was changed after the coordinator wrote it; do not use this "
                "file, ask the coordinator for it again"
            )
        signer = None if roster is None else verify_signature(document, roster, source=source)
        try:
            spec = document["weights"]
            if spec["dtype"] != "<f8":
                raise ClassifierFileError(f"{source}: weights must be '<f8', got {spec['dtype']!r}")
            shape = tuple(int(x) for x in spec["shape"])
            raw = base64.b64decode(spec["data"], validate=True)
            if hashlib.sha256(raw).hexdigest() != spec["sha256"]:
                raise ClassifierFileError(f"{source}: the weights do not match their sha256 digest")
            classes = tuple(str(c) for c in document["classes"])
            if len(shape) != 2 or shape[1] != len(classes) or len(raw) != 8 * shape[0] * shape[1]:
                raise ClassifierFileError(
                    f"{source}: weights of shape {shape} do not fit {len(classes)} classes"
                )
            weights = np.frombuffer(raw, dtype="<f8").reshape(shape).astype(np.float64)
            if not np.isfinite(weights).all():
                raise ClassifierFileError(f"{source}: the weights hold NaN or infinite values")
            backbone = {k: str(document["backbone"][k]) for k in ("name", "weights_id", "preprocessing")}
            return cls(
                weights=weights,
                classes=classes,
                backbone=backbone,
                method=dict(document["method"]),
                protocol=dict(document["protocol"]),
                sessions=tuple(dict(s) for s in document["sessions"]),
                roster_fingerprint=str(document["roster_fingerprint"]),
                audit=dict(document["audit"]),
                study_digest=str(document["study_digest"]),
                created=str(document["created"]),
                decision_threshold=_threshold(document["decision_threshold"], source),
                privacy=_privacy(document.get("differential_privacy"), source),
                signer=signer,
                content_sha256=document["content_sha256"],
            )
        except ClassifierFileError:
            raise
        except (KeyError, TypeError, ValueError, binascii.Error) as exc:
            raise ClassifierFileError(f"{source}: malformed classifier file: {exc}") from None

    def save(self, path: str | os.PathLike[str], signer: ClassifierSigner | None = None) -> None:
        write_classifier_file(path, self.to_json(signer).encode("utf-8"))

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, roster: Roster | None) -> Classifier:
        """Read and check a classifier file (see :meth:`from_json`; ``roster`` is required so that
        every caller says whether it verifies the signature)."""
        path = Path(path)
        try:
            if path.stat().st_size > MAX_CLASSIFIER_BYTES:
                raise ClassifierFileError(f"{path}: larger than {MAX_CLASSIFIER_BYTES} bytes")
            return cls.from_json(path.read_bytes(), roster=roster, source=str(path))
        except OSError as exc:
            raise ClassifierFileError(f"{path}: cannot read the classifier: {exc.strerror}") from None

    # --- prediction ----------------------------------------------------------------------------

    def check_features(
        self, backbone: Mapping[str, str], dim: int, classes: Sequence[str] | None = None
    ) -> None:
        """Refuse features from another backbone, weight file or preprocessing (or of another size)."""
        for key in ("name", "weights_id", "preprocessing"):
            if backbone.get(key) != self.backbone.get(key):
                raise ModelMismatchError(
                    f"the features' backbone {key} is {backbone.get(key)!r} but the model was fitted on "
                    f"{self.backbone.get(key)!r}: extract the features with the model's backbone"
                )
        if dim != self.dim:
            raise ModelMismatchError(f"the features have dimension {dim}, the model expects {self.dim}")
        if classes is not None and tuple(classes) != self.classes:
            raise ModelMismatchError(f"the feature file's classes {tuple(classes)} differ from the model's")

    def decision_function(self, features: np.ndarray) -> np.ndarray:
        """The linear scores ``h · w_c`` in float64, N × C (a ranking, not a probability)."""
        features = np.asarray(features)
        if features.ndim != 2 or features.shape[1] != self.dim:
            raise ModelMismatchError(f"features must be N × {self.dim}, got {features.shape}")
        return features.astype(np.float64) @ self.weights

    def decide(self, scores: np.ndarray) -> np.ndarray:
        """0/1 decisions from the scores: ``σ(score) > threshold``, computed as ``score > logit(threshold)``
        (exactly ``score > 0`` at 0.5, the simulator's rule, where σ would round tiny scores to 0.5)."""
        return np.asarray(scores) > self.score_threshold

    @property
    def score_threshold(self) -> float:
        """The decision threshold on the score ``h · w_c``: ``logit(decision_threshold)``, 0 at 0.5."""
        import scipy.special

        return float(scipy.special.logit(self.decision_threshold))

    def prediction_legend(self) -> list[str]:
        """What the columns of :meth:`write_predictions` are, and the rule behind the decisions."""
        return [
            "score(CLASS) = h·w_CLASS, the classifier's linear score: it ranks images (what AUC and mAP "
            "read); it is not a probability, and none is offered (none is calibrated)",
            f"positive(CLASS) = 1 when score(CLASS) > {self.score_threshold:g} (the file's signed "
            f"threshold {self.decision_threshold:g} on σ(score)): the balanced rule. The weights are fit to "
            "class-balanced targets (+1/N⁺, −1/N⁻), so the rule weighs a class's positives and negatives "
            "equally: it aims at balanced sensitivity and specificity (what BACC scores), it is not "
            "calibrated to prevalence, and on a rare class it flags many more images than are positive",
        ]

    def write_predictions(
        self,
        path: Path,
        image_ids: Sequence[str],
        scores: np.ndarray,
        decisions: np.ndarray | None = None,
    ) -> None:
        """CSV: ``image_id``, one ``score(CLASS)`` column per class (``h · w_c``), then one 0/1
        ``positive(CLASS)`` column per class (``decisions``, default :meth:`decide` of the scores):
        see :meth:`prediction_legend`."""
        import csv

        if decisions is None:
            decisions = self.decide(scores)
        decisions = np.asarray(decisions).astype(int)
        with open(path, "w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            scores_header = [f"score({c})" for c in self.classes]
            writer.writerow(["image_id", *scores_header, *(f"positive({c})" for c in self.classes)])
            for image_id, row, decision in zip(image_ids, scores, decisions, strict=True):
                writer.writerow([image_id, *(f"{float(x):.9g}" for x in row), *(int(x) for x in decision)])


def write_classifier_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Atomically (a temporary file beside it, mode 0600, then a rename): the exact bytes, never
    re-serialised."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)
    os.replace(temporary, path)


UNSIGNED_NAME = "classifier.unsigned.json"  # the ServerApp's record, before deploy run signs it
SIGN_REQUEST = "sign request"  # the ServerApp's line asking deploy run to sign: "sign request <digest>: ..."


def sign_classifier_file(
    data: bytes, signer: ClassifierSigner, *, roster: Roster, study_digest: str, content_sha256: str
) -> bytes:
    """Sign the ServerApp's unsigned classifier record (``deploy run``, which holds the key).

    Signs only a well-formed, unsigned file whose content digest is ``content_sha256`` (the one the
    ServerApp announced in its stream), made with ``roster`` for the study of ``study_digest`` (the
    run's own).  Returns the signed file's bytes, exactly what :meth:`Classifier.to_json` with the
    signer writes: the same document with the signature added.
    """
    source = "the ServerApp's unsigned classifier"
    if len(data) > MAX_CLASSIFIER_BYTES:
        raise ClassifierFileError(f"{source} is larger than {MAX_CLASSIFIER_BYTES} bytes")
    classifier = Classifier.from_json(data, roster=None, source=source)  # format and content digest
    document = json.loads(data, object_pairs_hook=_no_duplicate_keys)
    if "signature" in document:
        raise ClassifierFileError(f"{source} is already signed: refusing to sign it again")
    if document["content_sha256"] != content_sha256:
        raise ClassifierTamperedError(
            f"{source} has content digest {document['content_sha256']}, not the {content_sha256} the "
            "ServerApp announced: the file was replaced after the ServerApp wrote it; nothing was signed"
        )
    if classifier.roster_fingerprint != roster.fingerprint:
        raise RosterMismatchError(
            f"{source} was made with roster {classifier.roster_fingerprint}, this run's is "
            f"{roster.fingerprint}: nothing was signed"
        )
    if classifier.study_digest != study_digest:
        raise ClassifierFileError(
            f"{source} is of study {classifier.study_digest}, this run's study is {study_digest}: "
            "nothing was signed"
        )
    document["signature"] = signer.sign(document)
    return (json.dumps(document, indent=1, sort_keys=False) + "\n").encode("utf-8")


HISTORY_DIR = "classifiers"  # OUT_DIR/classifiers/<created>-<sha256 prefix>.json, one per file received
LATEST_NAME = "classifier.json"


@dataclass(frozen=True)
class StoredClassifier:
    """Where :func:`keep_classifier` put a classifier file, and what ``classifier.json`` held before."""

    latest: Path  # OUT_DIR/classifier.json: the newest file
    kept: Path  # its copy in the history, never overwritten
    sha256: str  # of the file's bytes
    replaced: Path | None = None  # the history copy of the file classifier.json held before, if another


def history_name(data: bytes) -> str:
    """``<created>-<first 16 hex digits of the file's SHA-256>.json``: sorted by date, unique by content.

    ``created`` is the file's own creation time (``20261202T053100Z``), or ``undated`` for a file
    that names none."""
    digest = hashlib.sha256(data).hexdigest()
    try:
        created = str(json.loads(data)["created"])
        stamp = datetime.datetime.fromisoformat(created).astimezone(datetime.timezone.utc)
        when = stamp.strftime("%Y%m%dT%H%M%SZ")
    except (ValueError, KeyError, TypeError):
        when = "undated"
    return f"{when}-{digest[:16]}.json"


def keep_classifier(out_dir: str | os.PathLike[str], data: bytes) -> StoredClassifier:
    """Store a (verified) classifier file as ``OUT_DIR/classifier.json`` and in the history.

    Every file received is kept as ``OUT_DIR/classifiers/<created>-<digest>.json`` (mode 0600); a
    name already there holds the same bytes (the same file delivered again) or the store is refused.
    ``classifier.json`` becomes the new file; the file it held before is first copied into the
    history if it is not there already, so no classifier is ever overwritten without a copy.
    """
    out_dir = Path(out_dir)
    history = out_dir / HISTORY_DIR
    history.mkdir(parents=True, exist_ok=True, mode=0o700)
    kept = _keep(history, data)
    latest = out_dir / LATEST_NAME
    replaced = None
    if latest.is_file():
        before = latest.read_bytes()
        if before != data:
            replaced = _keep(history, before)
    write_classifier_file(latest, data)
    return StoredClassifier(latest, kept, hashlib.sha256(data).hexdigest(), replaced)


def _keep(history: Path, data: bytes) -> Path:
    path = history / history_name(data)
    if path.exists():
        if path.read_bytes() != data:
            raise ClassifierFileError(
                f"{path} exists with other bytes than the classifier of the same name: the history is "
                "never overwritten; move that file away (it is not one this node stored) and store again"
            )
        return path
    write_classifier_file(path, data)
    return path


def _threshold(value: object, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 < float(value) < 1.0:
        raise ClassifierFileError(
            f"{source}: decision_threshold must be a probability in (0, 1), got {value!r}"
        )
    return float(value)


def _privacy(record: object, source: str) -> dict[str, Any] | None:
    if record is None:
        return None
    keys = ("epsilon_target", "delta", "clip", "unit", "epsilon_spent", "blocks", "ridge")
    if not isinstance(record, dict) or any(key not in record for key in keys):
        raise ClassifierFileError(f"{source}: malformed differential_privacy record (needs {list(keys)})")
    return dict(record)
