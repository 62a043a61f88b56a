"""Federated noisy-label baselines (paper Table I, FNLL): FedLSR and FedNoRo.

A missing class is a label noise problem for these methods: its positives look like negatives.
Both follow FedMLP's adaptation (``utils/local_training_init_corr.py``, ``utils/FedNoRo.py``).
"""

from __future__ import annotations

import torch

from secure_afl.sim.baselines.common import Batch, Federation, Method, bce, masked_mean, sigmoid_rampup


class FedLSR(Method):
    """FedLSR (Jiang et al., CIKM 2022): local self-regularisation, as FedMLP adapts it.

    Two views; their sigmoid outputs are mixed with a Beta(1, 1) weight per client and batch, the
    mixture is sharpened (``σ(2·logit(p))``) and fitted to the labels by BCE with FedMLP's
    pos_weight over *all* classes (missing ones as negatives: the noisy labels), mean over B·C; a
    Jensen–Shannon term between the two views' outputs sharpened at temperature 1/3 (``σ(3z)``)
    is added with weight ``β = 0.4·min(round / t_w, 1)`` (``t_w`` = 40 of the reference's 500
    rounds, scaled with R: 4 at R = 50).  Server: FedAvg.

    FedMLP's code passes the sharpened *probability* into ``BCEWithLogitsLoss`` (a second sigmoid);
    here the BCE is of the sharpened probability itself, as FedLSR intends.
    """

    BETA, WARMUP_ROUNDS, SHARPEN_DISTILL, SHARPEN_MIX = 0.4, 40, 3.0, 2.0

    def __init__(self) -> None:
        super().__init__("FedLSR", "FNLL", views=("view1", "view2"))

    def start(self, fed: Federation, init: torch.Tensor, generator: torch.Generator) -> None:
        self.generator = generator

    def loss(self, batch: Batch, logits: dict[str, torch.Tensor], w: torch.Tensor) -> torch.Tensor:
        first, second = logits["view1"], logits["view2"]
        n_clients = first.shape[0]
        # Beta(1, 1) is uniform: one mixing weight per client and batch from the seeded generator
        mix = torch.rand((n_clients, 1, 1), generator=self.generator)
        mixed = torch.sigmoid(first) * mix + torch.sigmoid(second) * (1 - mix)
        mixed = mixed.clamp(1e-6, 1 - 1e-6)
        sharpened_logit = self.SHARPEN_MIX * torch.log(mixed / (1 - mixed))
        supervised = bce(sharpened_logit, batch.y, batch.pos_weight).mean(dim=(1, 2)).sum()
        p1 = torch.sigmoid(self.SHARPEN_DISTILL * first).clamp(min=1e-6)
        p2 = torch.sigmoid(self.SHARPEN_DISTILL * second).clamp(min=1e-6)
        middle = torch.log((p1 + p2) / 2)
        js = (
            (p1 * (torch.log(p1) - middle)).mean(dim=(1, 2))
            + (p2 * (torch.log(p2) - middle)).mean(dim=(1, 2))
        ) / 2
        beta = self.BETA * min(batch.rnd / (self.WARMUP_ROUNDS * self.stage_scale), 1.0)
        return supervised + beta * js.sum()


class FedNoRo(Method):
    """FedNoRo (Wu et al., IJCAI 2023) as FedMLP runs it: its noise-robust local training.

    Every client is "noisy" here (each lacks labels), so the distillation branch applies to all:
    ``(1 − w)·BCE(σ(z), y)`` on the active classes (mean over B·|AC|) plus ``w·MSE(σ(z),
    σ(z_teacher / 0.8))`` on the missing ones (mean over B·|MC|), the teacher being the global head
    of the round, ``w = 0.8·exp(−5(1 − t)²)`` with t the round's position between ``begin`` = 10
    and ``end`` = 499 of the reference's 500 rounds (FedMLP's ``begin``/``end``/``a``), scaled with
    R: from 1 to 49.9 at R = 50, so w reaches 0.8 by the last round as in the reference.  Student
    and teacher see the same augmented view (the reference's RandomAffine + flip; here the weak
    feature jitter).  Server: FedAvg — FedNoRo's distance-aware aggregation
    (DaAgg) weights noisy clients by their distance to the nearest *clean* client, and with every
    client noisy there is none; FedMLP's ``main.py`` also aggregates with FedAvg.
    """

    RAMP_BEGIN, RAMP_END, KD_MAX, TEMPERATURE = 10, 499, 0.8, 0.8

    def __init__(self) -> None:
        super().__init__("FedNoRo", "FNLL", views=("weak",))

    def start_round(self, rnd: int, global_w: torch.Tensor, local_w: torch.Tensor) -> None:
        self.teacher = local_w.clone()
        begin, end = self.RAMP_BEGIN * self.stage_scale, self.RAMP_END * self.stage_scale
        self.kd_weight = self.KD_MAX * sigmoid_rampup(rnd, begin, end)

    def teachers(self) -> dict[str, torch.Tensor]:
        return {"weak": self.teacher}

    def loss(self, batch: Batch, logits: dict[str, torch.Tensor], w: torch.Tensor) -> torch.Tensor:
        z = logits["weak"]
        soft = torch.sigmoid(batch.teacher["weak"] / self.TEMPERATURE)
        n_active, n_missing = batch.n_active, batch.n_missing
        supervised = masked_mean(bce(z, batch.y), batch.active, batch.size * n_active)
        distill = masked_mean((torch.sigmoid(z) - soft) ** 2, batch.missing, batch.size * n_missing)
        return self.kd_weight * distill + (1 - self.kd_weight) * supervised
