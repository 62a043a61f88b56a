"""The classifier file and the predictions ``secure-afl predict`` makes with it.

One JSON document (``secure-afl-classifier/v1``), nothing executable, no pickle::

    {
      "format": "secure-afl-classifier/v1",
      "classes": ["Atelectasis", ...],                    # column order of the weights
      "weights": {"dtype": "<f8", "shape": [d, C],         # w_c as columns, little-endian float64
                  "data": base64, "sha256": hex},          # exact bits, and their digest
      "decision_threshold": 0.5,                           # positive when sigmoid(h . w_c) > 0.5
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
      "differential_privacy": {...}                        # only under DP: ε target and spent per
    }                                                      # institution, δ, clip, unit, noise per block

The server writes it and sends it to every participant; each checks the roster fingerprint and the
session ids against its own before saving it.  ``digest`` is an integrity check, not a signature.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ClassifierFileError, ModelMismatchError

CLASSIFIER_FORMAT = "secure-afl-classifier/v1"
MAX_CLASSIFIER_BYTES = 512 * 1024 * 1024


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
        return [
            f"differentially private: ε = {p['epsilon_target']:g}, δ = {p['delta']:g} for {unit} per "
            f"institution; feature rows clipped to L2 norm {p['clip']:g}",
            "ε spent per institution: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(spent.items())),
            f"noise std per group sum at its fewest survivors: {min(stds):.4g}..{max(stds):.4g}; "
            f"solve ridge λ = {p['ridge']:.4g}",
        ]

    @property
    def dim(self) -> int:
        return int(self.weights.shape[0])

    def to_json(self) -> str:
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
        return json.dumps(document, indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "classifier") -> Classifier:
        try:
            document = json.loads(text)
        except ValueError:
            raise ClassifierFileError(f"{source}: not a {CLASSIFIER_FORMAT} file (not JSON)") from None
        if not isinstance(document, dict) or document.get("format") != CLASSIFIER_FORMAT:
            raise ClassifierFileError(f"{source}: not a {CLASSIFIER_FORMAT} file")
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
                decision_threshold=float(document["decision_threshold"]),
                privacy=_privacy(document.get("differential_privacy"), source),
            )
        except ClassifierFileError:
            raise
        except (KeyError, TypeError, ValueError, binascii.Error) as exc:
            raise ClassifierFileError(f"{source}: malformed classifier file: {exc}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_text(self.to_json(), encoding="utf-8")
        os.replace(temporary, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Classifier:
        path = Path(path)
        try:
            if path.stat().st_size > MAX_CLASSIFIER_BYTES:
                raise ClassifierFileError(f"{path}: larger than {MAX_CLASSIFIER_BYTES} bytes")
            return cls.from_json(path.read_bytes(), source=str(path))
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

    def predict_proba(self, features: np.ndarray) -> np.ndarray:
        import scipy.special

        features = np.asarray(features)
        if features.ndim != 2 or features.shape[1] != self.dim:
            raise ModelMismatchError(f"features must be N × {self.dim}, got {features.shape}")
        return scipy.special.expit(features.astype(np.float64) @ self.weights)

    def write_predictions(self, path: Path, image_ids: Sequence[str], probabilities: np.ndarray) -> None:
        """CSV: ``image_id``, one probability column per class, then one 0/1 decision column per class."""
        import csv

        decisions = (probabilities > self.decision_threshold).astype(int)
        with open(path, "w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(
                ["image_id"] + [f"p({c})" for c in self.classes] + [f"positive({c})" for c in self.classes]
            )
            for image_id, row, decision in zip(image_ids, probabilities, decisions, strict=True):
                writer.writerow([image_id, *(f"{p:.6f}" for p in row), *(int(x) for x in decision)])


def _privacy(record: object, source: str) -> dict[str, Any] | None:
    if record is None:
        return None
    keys = ("epsilon_target", "delta", "clip", "unit", "epsilon_spent", "blocks", "ridge")
    if not isinstance(record, dict) or any(key not in record for key in keys):
        raise ClassifierFileError(f"{source}: malformed differential_privacy record (needs {list(keys)})")
    return dict(record)
