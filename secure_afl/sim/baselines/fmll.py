"""Federated multi-label baseline with partial labels (paper Table I, FMLL): FedMLP."""

from __future__ import annotations

import torch

from secure_afl.sim.baselines.common import Batch, Method, bce, masked_mean


class FedMLP(Method):
    """FedMLP (Sun et al., MICCAI 2024) as its released code runs at R = 50.

    FedMLP's settings give its first stage ``rounds_FedMLP_stage1`` = 50 rounds, so at the paper's
    R = 50 only stage 1 runs: on two views, BCE of ``σ(z)`` on the active classes (the logit
    adjustment in FedMLP's ``LogitAdjust_Multilabel`` is commented out) plus, on the missing classes,
    the MSE between the head's and the round's global head's sigmoid outputs on the same view (both
    averaged over the two views; a view-consistency term carries weight 0).  Server: FedAvg.  The
    second stage (class prototypes, pseudo-labels of missing classes, adaptive thresholds) starts
    after round 50 and is not reached (README says so).
    """

    def __init__(self) -> None:
        super().__init__("FedMLP", "FMLL", views=("view1", "view2"))

    def start_round(self, rnd: int, global_w: torch.Tensor, local_w: torch.Tensor) -> None:
        self.global_head = local_w.clone()

    def teachers(self) -> dict[str, torch.Tensor]:
        return {"view1": self.global_head, "view2": self.global_head}

    def loss(self, batch: Batch, logits: dict[str, torch.Tensor], w: torch.Tensor) -> torch.Tensor:
        n_active, n_missing = float(batch.active[0].sum()), float(batch.missing[0].sum())
        total = torch.zeros(())
        for view in ("view1", "view2"):
            z = logits[view]
            g = torch.sigmoid(batch.teacher[view])
            supervised = masked_mean(bce(z, batch.y), batch.active, batch.size * n_active)
            distill = masked_mean((torch.sigmoid(z) - g) ** 2, batch.missing, batch.size * n_missing)
            total = total + (supervised + distill) / 2
        return total
