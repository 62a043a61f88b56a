"""The study: what every party of a deployment agrees on before any statistic moves.

Classes, feature dimension and backbone (so that every hospital's features mean the same thing),
the method's options and the protocol's parameters.  The server sends it with each session's first
message; every client compares it with its own feature file and its own policy and refuses a
mismatch (:class:`~secure_afl.deploy.errors.StudyMismatchError`).  The classifier file records it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field

from secure_afl.aggregation.layout import Layout
from secure_afl.protocol.encoding import DEFAULT_FRAC_BITS, upper_triangle_length

from .errors import ConfigurationError

SYMMETRIC_TENSORS = frozenset({"gram"})
ALL_GROUP = "all"  # the same names as secure_afl.analytic (which imports torch; this module must not)


def class_group(c: int) -> str:
    return f"class/{c}"


def pseudo_group(c: int) -> str:
    return f"pseudo/{c}"


def deployment_threshold(n_clients: int) -> int:
    """t = ⌊2n/3⌋ + 1: the threshold that resists an active server (SECURITY.md §3)."""
    return (2 * n_clients) // 3 + 1


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
        if not (self.gamma > 0 and self.gamma < float("inf")):
            raise ConfigurationError(f"gamma must be a positive number, got {self.gamma}")
        if self.balance not in ("client", "global"):
            raise ConfigurationError(f"balance must be 'client' or 'global', got {self.balance!r}")
        if self.gram not in ("class", "global"):
            raise ConfigurationError(f"gram must be 'class' or 'global', got {self.gram!r}")
        if self.rounds not in (1, 2):
            raise ConfigurationError(f"rounds must be 1 or 2, got {self.rounds}")


@dataclass(frozen=True)
class Study:
    classes: tuple[str, ...]
    dim: int
    backbone: Mapping[str, str]  # name, weights_id, preprocessing
    method: Method = field(default_factory=Method)
    threshold: int = 0  # 0: deployment_threshold(roster size)
    min_group_size: int = 2
    frac_bits: int = DEFAULT_FRAC_BITS

    def __post_init__(self) -> None:
        if not self.classes or len(set(self.classes)) != len(self.classes):
            raise ConfigurationError("the study needs distinct class names")
        if self.dim < 1:
            raise ConfigurationError(f"the feature dimension must be positive, got {self.dim}")
        if set(self.backbone) != {"name", "weights_id", "preprocessing"}:
            raise ConfigurationError("the backbone needs exactly name, weights_id and preprocessing")
        if self.min_group_size < 1:
            raise ConfigurationError(f"min_group_size must be at least 1, got {self.min_group_size}")

    @property
    def n_classes(self) -> int:
        return len(self.classes)

    def threshold_for(self, roster_size: int) -> int:
        return self.threshold or deployment_threshold(roster_size)

    def to_json(self) -> str:
        document = asdict(self)
        document["classes"] = list(self.classes)
        document["backbone"] = dict(self.backbone)
        return json.dumps(document, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Study:
        try:
            document = json.loads(text)
            return cls(
                classes=tuple(str(c) for c in document["classes"]),
                dim=int(document["dim"]),
                backbone={k: str(v) for k, v in document["backbone"].items()},
                method=Method(**document["method"]),
                threshold=int(document["threshold"]),
                min_group_size=int(document["min_group_size"]),
                frac_bits=int(document["frac_bits"]),
            )
        except ConfigurationError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigurationError(f"malformed study description: {exc}") from None

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()


def round1_layout(study: Study) -> Layout:
    """Every class group and, where the method needs it, the ``all`` group (the names of analytic.py).

    Every class is in the layout: a class that fewer than ``min_group_size`` survivors label cannot
    be fitted without revealing a client's statistics, so the session aborts rather than drop it.
    """
    d, method = study.dim, study.method
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


def pseudo_members(
    labelled: Mapping[str, Collection[int]], live: Collection[str], n_classes: int
) -> dict[int, tuple[str, ...]]:
    """Round 2's groups: per class, the live clients that do not label it (Eq. 21)."""
    return {c: tuple(sorted(cid for cid in live if c not in labelled[cid])) for c in range(n_classes)}


def round2_classes(members: Mapping[int, Collection[str]], min_group_size: int) -> tuple[int, ...]:
    """The classes whose pseudo-label group is summed: at least ``min_group_size`` members.

    A smaller group would hand one client's pseudo-label projection to the server; that class keeps
    its round-1 right-hand side (the simulator, told the same rule, drops the same groups).
    """
    return tuple(c for c, ids in sorted(members.items()) if len(ids) >= max(min_group_size, 1))


def round2_layout(study: Study, classes: Collection[int]) -> Layout:
    d = study.dim
    return Layout(
        groups={pseudo_group(c): {f"b_pseudo/{c}": d} for c in sorted(classes)},
        shapes={f"b_pseudo/{c}": (d,) for c in sorted(classes)},
        symmetric=SYMMETRIC_TENSORS,
    )
