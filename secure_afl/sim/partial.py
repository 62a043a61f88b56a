"""The partial-label protocol of FedMLP / paper §IV-B: which client labels which class."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

MAX_DRAWS = 10_000
Missing1Draw = Literal["permutation", "random"]
MISSING1_DRAWS: tuple[str, ...] = ("permutation", "random")


class PartialLabelError(ValueError):
    """A missing level that the federation cannot realise."""


@dataclass(frozen=True)
class LabelAssignment:
    """``active[k]`` are the classes client ``k`` labels (``AC_k``); the rest are missing."""

    missing: int
    n_classes: int
    active: tuple[tuple[int, ...], ...]
    draw: str = "random"  # how it was drawn: "diagonal", "permutation" or "random" (with coverage)

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


def assign_partial_labels(
    n_clients: int,
    n_classes: int,
    missing: int,
    *,
    seed: int = 0,
    missing1: Missing1Draw = "permutation",
) -> LabelAssignment:
    """Which classes each client labels, as paper §IV-B describes.

    - ``missing = C − 1`` with as many clients as classes: client ``i`` labels class ``i`` (the
      paper's missing-7 diagonal, ``|S_c| = 1``);
    - ``missing = 1`` with as many clients as classes and ``missing1="permutation"`` (default): the
      withheld classes are a random permutation of the classes, so every class is labelled by
      exactly ``K − 1`` clients (the paper: "every class is labeled by exactly 7 clients");
    - otherwise (and at missing 1 with ``missing1="random"``, the draw used before): each client
      withholds ``missing`` classes at random, redrawn until every class is labelled (at missing 1
      this gives ``|S_c|`` from about 3 to 8 depending on the seed).
    """
    if missing1 not in MISSING1_DRAWS:
        raise PartialLabelError(f"missing1 must be 'permutation' or 'random', got {missing1!r}")
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
        return LabelAssignment(missing, n_classes, tuple((k,) for k in range(n_clients)), "diagonal")
    rng = np.random.default_rng(seed)
    if missing == 1 and n_clients == n_classes and missing1 == "permutation":
        withheld = rng.permutation(n_classes)
        active = tuple(tuple(c for c in range(n_classes) if c != withheld[k]) for k in range(n_clients))
        return LabelAssignment(missing, n_classes, active, "permutation")
    for _ in range(MAX_DRAWS):
        active = tuple(
            tuple(sorted(rng.choice(n_classes, size=kept, replace=False).tolist())) for _ in range(n_clients)
        )
        covered = {c for classes in active for c in classes}
        if len(covered) == n_classes:
            return LabelAssignment(missing, n_classes, active, "random")
    raise PartialLabelError(
        f"no assignment covering every class found in {MAX_DRAWS} draws"
    )  # pragma: no cover
