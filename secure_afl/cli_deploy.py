"""``secure-afl deploy local`` and ``secure-afl predict``: the command layer that may import both the
simulator (data partition, the in-process reference) and the deployment (which never imports sim).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import click
import numpy as np

from secure_afl.deploy.errors import DeploymentError
from secure_afl.deploy.study import Study, pseudo_group, pseudo_members, round2_classes

ClientData = tuple[np.ndarray, np.ndarray, tuple[int, ...]]  # features, labels, active classes


@dataclass(frozen=True)
class Reference:
    """The in-process simulation of the same federation: its classifier and its survivors."""

    coef: np.ndarray
    survivors: tuple[str, ...]
    seconds: float


def reference_classifier(
    clients: Mapping[str, ClientData],
    study: Study,
    *,
    roster_size: int,
    dropouts: Mapping[str, Collection[str]],
    device: str = "auto",
) -> Reference:
    """The simulator's secure aggregation (``sim.secure.secure_aggregate``) and the same solve.

    Same statistics, same fixed-point encoding, same survivors: the sums are the same integers, so
    the classifier must be the deployment's bit for bit.  Round 2 goes on without every client that
    dropped in round 1, over the pseudo-label groups the deployment's rule keeps.
    """
    from secure_afl.analytic import (
        AnalyticClassifier,
        PseudoLabelConfig,
        client_statistics,
        pseudo_label_contributions,
    )
    from secure_afl.sim.secure import secure_aggregate

    started = time.perf_counter()
    method, threshold = study.method, study.threshold_for(roster_size)
    contributions = {}
    for cid, (features, labels, active) in sorted(clients.items()):
        stats = client_statistics(features, labels, device=device)
        contributions[cid] = stats.contributions(
            active, balance=method.balance, gram=method.gram, include_global_gram=method.rounds == 2
        )
    round1 = secure_aggregate(
        contributions,
        symmetric=("gram",),
        threshold=threshold,
        min_group_size=study.min_group_size,
        dropouts=dropouts,
        frac_bits=study.frac_bits,
    )
    model = AnalyticClassifier(study.n_classes, gamma=method.gamma, balance=method.balance, gram=method.gram)
    model.fit(round1.sums)
    survivors = tuple(sorted({c for ids in round1.survivors.values() for c in ids}))
    if method.rounds == 2:
        dropped = {c for ids in dropouts.values() for c in ids}
        live = [cid for cid in sorted(clients) if cid not in dropped]
        members = pseudo_members({cid: clients[cid][2] for cid in live}, live, study.n_classes)
        kept = {pseudo_group(c) for c in round2_classes(members, study.min_group_size)}
        if kept:
            config = PseudoLabelConfig(
                tau=method.tau, alpha=method.alpha, min_pos=method.min_pos, min_neg=method.min_neg
            )
            round2 = {}
            for cid in live:
                features, _, active = clients[cid]
                mine, _ = pseudo_label_contributions(
                    features, model.coef_, active, config=config, device=device
                )
                round2[cid] = {g: t for g, t in mine.items() if g in kept}
            sums2 = secure_aggregate(
                round2,
                threshold=threshold,
                min_group_size=study.min_group_size,
                frac_bits=study.frac_bits,
            ).sums
            model = AnalyticClassifier(study.n_classes, gamma=method.gamma, balance=method.balance).refine(
                round1.sums, sums2, alpha=method.alpha
            )
    return Reference(np.array(model.coef_), survivors, time.perf_counter() - started)


def _click_errors(exc: Exception) -> click.ClickException:
    return click.ClickException(f"{type(exc).__name__}: {exc}")


__all__ = ["DeploymentError", "Reference", "reference_classifier"]
