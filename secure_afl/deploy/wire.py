"""Envelopes: what one deployment message carries, and its Flower record form.

An :class:`Envelope` is a kind, small metadata (str/int/float/bool values), an opaque payload (a
protocol message encoded by the backend's codec, or a classifier file) and named float64 arrays
(round 2's round-1 coefficients).  In Flower it is a ``RecordDict`` with a ``ConfigRecord``
``"meta"`` (the kind included), an ``ArrayRecord`` ``"payload"`` holding the bytes as one uint8 array,
and an ``ArrayRecord`` ``"arrays"``.  Flower serialises arrays with ``np.save(allow_pickle=False)``
and reads them back the same way: nothing on this path unpickles.

Kinds: server to client ``advertise`` (a session's first message; meta: session label, round,
study JSON, roster fingerprint), ``protocol`` (later rounds), ``classifier`` (the final file),
``verify`` (the classifier check's relays, :mod:`secure_afl.deploy.verify`); client to server
``reply``, ``refused`` (meta: error class, a message without the node's paths, and the roster id
the node claims) and ``ack``; ``dropped`` is the transport's own (Flower's error for a node that is
gone): the server counts it as a dropout, as it would a client's (which only drops out).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

MESSAGE_TYPE = "query"  # Flower's message category for a ClientApp function that answers
KINDS = frozenset({"advertise", "protocol", "classifier", "verify", "reply", "refused", "ack", "dropped"})
MetaValue = str | int | float | bool


@dataclass(frozen=True)
class Envelope:
    kind: str
    meta: Mapping[str, MetaValue] = field(default_factory=lambda: MappingProxyType({}))
    payload: bytes = b""
    arrays: Mapping[str, np.ndarray] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown envelope kind {self.kind!r}")

    @classmethod
    def refusal(cls, error: BaseException, **meta: MetaValue) -> Envelope:
        return cls("refused", {**meta, "error": type(error).__name__, "message": str(error)})

    def text(self, key: str) -> str:
        value = self.meta.get(key)
        if not isinstance(value, str):
            raise ValueError(f"the {self.kind} message lacks the text field {key!r}")
        return value


def to_record_dict(envelope: Envelope) -> Any:
    """The Flower ``RecordDict`` of an envelope (imports flwr only here)."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

    content = RecordDict()
    content["meta"] = ConfigRecord({**envelope.meta, "kind": envelope.kind})
    content["payload"] = ArrayRecord({"bytes": Array(np.frombuffer(envelope.payload, dtype=np.uint8).copy())})
    content["arrays"] = ArrayRecord(
        {
            name: Array(np.ascontiguousarray(value, dtype=np.float64))
            for name, value in envelope.arrays.items()
        }
    )
    return content


def from_record_dict(content: Any) -> Envelope:
    """The envelope in a Flower ``RecordDict``; anything malformed raises ``ValueError``."""
    try:
        meta = dict(content["meta"])
        kind = meta.pop("kind")
        payload_array = content["payload"]["bytes"].numpy()
        arrays = {name: array.numpy() for name, array in content["arrays"].items()}
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a secure-afl message: {exc}") from None
    if not isinstance(kind, str) or payload_array.dtype != np.uint8 or payload_array.ndim != 1:
        raise ValueError("not a secure-afl message: bad kind or payload")
    if any(not isinstance(v, str | int | float | bool) for v in meta.values()):
        raise ValueError("not a secure-afl message: metadata must be plain values")
    if any(a.dtype != np.float64 for a in arrays.values()):
        raise ValueError("not a secure-afl message: arrays must be float64")
    return Envelope(kind, MappingProxyType(meta), payload_array.tobytes(), MappingProxyType(arrays))
