"""The coordinator's accumulated sums: what a growing study adds its session's sums to.

After a study whose statistics are additive (``balance="global"``, one round) the ServerApp
writes ``OUT_DIR/sums-<study digest>.npz``: the float64 sums of every image released so far in the
chain of studies ending with it (:func:`secure_afl.growth.accumulate_sums`), and the chain itself
(each study's digest and session, with its survivors).  A study that extends it (``extends`` = that
digest) reads the file from the same out-dir, adds its own session's sums and solves: the classifier
is the centralised fit on every image released in the chain.

Under DP the sums are the noisy ones the server was given, and each chain entry also keeps its
session's noise record (the noise stds at its survivors and the ε it spent): a chain's DP solve
sizes its ridge from every session's noise, and its classifier records every session's ε.  A chain
is DP in every study or in none (:func:`secure_afl.growth.check_same_privacy`).

These are the server's own outputs (the sums it was given anyway), kept beside its classifier: a
coordinator that loses them can no longer extend the chain, only start a new one over new images.
The file is read with ``allow_pickle=False`` and checked (format, study digest, tensors).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConfigurationError

SUMS_FORMAT = "secure-afl-sums/v1"


@dataclass(frozen=True)
class AccumulatedSums:
    """The sums of a chain of growing studies, and the chain (oldest first)."""

    study_digest: str  # the last study of the chain, whose file this is
    sums: Mapping[str, Mapping[str, np.ndarray]]
    chain: tuple[Mapping[str, Any], ...]  # per study: its digest, its session id and survivors


def is_additive(study: Any) -> bool:
    """Whether a study's sums can be extended (the layout :mod:`secure_afl.growth` accumulates)."""
    return study.method.balance == "global" and study.method.rounds == 1


def sums_path(out_dir: Path, study_digest: str) -> Path:
    return Path(out_dir) / f"sums-{study_digest}.npz"


def save_sums(out_dir: Path, accumulated: AccumulatedSums) -> Path:
    """Write ``accumulated`` atomically (temporary file, rename); return its path."""
    path = sums_path(out_dir, accumulated.study_digest)
    arrays: dict[str, np.ndarray] = {
        "format": np.array(SUMS_FORMAT),
        "study": np.array(accumulated.study_digest),
        "chain": np.array(json.dumps(list(accumulated.chain), sort_keys=True)),
    }
    for group, tensors in accumulated.sums.items():
        for tensor, values in tensors.items():
            arrays[f"sum|{group}|{tensor}"] = np.asarray(values, dtype=np.float64)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp.npz")
    np.savez(temporary, **arrays)
    os.replace(temporary, path)
    return path


def load_sums(out_dir: Path, study_digest: str) -> AccumulatedSums:
    """The accumulated sums of study ``study_digest`` from ``out_dir`` (:class:`ConfigurationError`
    saying what is missing or wrong)."""
    path = sums_path(out_dir, study_digest)
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except FileNotFoundError:
        raise ConfigurationError(
            f"the study extends {study_digest[:16]}..., but {path} is missing: a growing study runs with "
            f"the out-dir of the coordinator that ran the study it extends (the earlier sums are its own "
            f"outputs); without them start a new chain over images not yet released"
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"cannot read the accumulated sums {path}: {exc}") from None
    try:
        if str(arrays.pop("format")) != SUMS_FORMAT or str(arrays.pop("study")) != study_digest:
            raise ValueError("another format or another study")
        chain = tuple(json.loads(str(arrays.pop("chain"))))
        sums: dict[str, dict[str, np.ndarray]] = {}
        for name, values in arrays.items():
            kind, group, tensor = name.split("|", 2)
            if kind != "sum" or values.dtype != np.float64:
                raise ValueError(f"unexpected array {name!r}")
            sums.setdefault(group, {})[tensor] = values
    except (KeyError, ValueError, TypeError) as exc:
        raise ConfigurationError(
            f"{path} is not the accumulated sums of study {study_digest}: {exc}"
        ) from None
    return AccumulatedSums(study_digest, sums, chain)


def chain_entry(
    study_digest: str, session_id: bytes, survivors: Sequence[str], dp: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """One study of the chain: its digest, session and survivors; under DP also its session's noise
    record (:meth:`secure_afl.privacy.dp_growth.SessionNoise.to_json`: the noise std of the Gram and
    of the λ_min release at its survivors, and the ε it spent per institution)."""
    entry: dict[str, Any] = {
        "study": study_digest,
        "session_id": session_id.hex(),
        "survivors": list(survivors),
    }
    if dp is not None:
        entry["dp"] = dict(dp)
    return entry
