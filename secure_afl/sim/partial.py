"""The partial-label protocol of FedMLP / paper §IV-B: which client labels which class."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_DRAWS = 10_000


class PartialLabelError(ValueError):
    """A missing level that the federation cannot realise."""


@dataclass(frozen=True)
class LabelAssignment:
    """``active[k]`` are the classes client ``k`` labels (``AC_k``); the rest are missing."""

    missing: int
    n_classes: int
    active: tuple[tuple[int, ...], ...]

    @property
    def n_clients(self) -> int:
        return len(self.active)

    def coverage(self) -> tuple[tuple[int, ...], ...]:
        """``S_c`` for every class: the clients that label it."""
        return tuple(
            tuple(k for k, classes in enumerate(self.active) if c in classes) for c in range(self.n_classes)
        )

    def mask(self) -> np.ndarray:
        """Clients × classes, True where the client labels the class."""
        out = np.zeros((self.n_clients, self.n_classes), dtype=bool)
        for k, classes in enumerate(self.active):
            out[k, list(classes)] = True
        return out


def assign_partial_labels(n_clients: int, n_classes: int, missing: int, *, seed: int = 0) -> LabelAssignment:
    """Each client withholds ``missing`` classes at random, redrawn until every class is labelled.

    With as many clients as classes and ``missing = C − 1``, client ``i`` labels class ``i`` (the
    paper's missing-7 diagonal).
    """
    if not isinstance(missing, (int, np.integer)) or not 0 <= missing < n_classes:
        raise PartialLabelError(
            f"missing must be an integer from 0 to {n_classes - 1} (classes withheld per client), "
            f"got {missing!r}"
        )
    kept = n_classes - missing
    if n_clients * kept < n_classes:
        raise PartialLabelError(
            f"{n_clients} clients labelling {kept} classes each cannot cover {n_classes} classes; "
            "use fewer missing classes or more clients"
        )
    if missing == n_classes - 1 and n_clients == n_classes:
        return LabelAssignment(missing, n_classes, tuple((k,) for k in range(n_clients)))
    rng = np.random.default_rng(seed)
    for _ in range(MAX_DRAWS):
        active = tuple(
            tuple(sorted(rng.choice(n_classes, size=kept, replace=False).tolist())) for _ in range(n_clients)
        )
        covered = {c for classes in active for c in classes}
        if len(covered) == n_classes:
            return LabelAssignment(missing, n_classes, active)
    raise PartialLabelError(
        f"no assignment covering every class found in {MAX_DRAWS} draws"
    )  # pragma: no cover
