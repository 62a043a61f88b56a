"""Federated semi-supervised baselines (paper Table I, FSSL): RSCFed, FedFixMatch, FedIRM, CBAFed.

Each follows FedMLP's adaptation to partial labels (``utils/local_training_init_corr.py``,
``utils/FedAvg.py``, ``main.py`` of szbonaldo/FedMLP): supervised loss on the client's active
classes, the method's unsupervised signal on its missing classes.  Written here from those
descriptions for linear heads on cached features; see README's baseline table.
"""

from __future__ import annotations

import torch

from secure_afl.sim.baselines.common import (
    Batch,
    Federation,
    Method,
    bce,
    masked_mean,
    sigmoid_rampup,
)


def _supervised(batch: Batch, logits: torch.Tensor) -> torch.Tensor:
    """FedMLP's ``bce(pos_weight=N/N_c)[:, active].sum() / (B·|AC|)`` per client, summed."""
    per_client = batch.size * batch.n_active
    return masked_mean(bce(logits, batch.y, batch.pos_weight), batch.active, per_client)


class RSCFed(Method):
    """RSCFed (Liang et al., CVPR 2022) as FedMLP adapts it.

    Local: supervised BCE on the active classes of view 1, plus the MSE between the student's and a
    per-client teacher's sigmoid outputs on the missing classes (teacher on view 2).  The teacher is
    kept across rounds and follows the student by an EMA of 0.999 after every step.  Server: each
    round, M = 10 random sub-groups of 6 clients; in each, client weights ``N_k/N_group ·
    exp(−0.01·‖W_k − W̄‖/N_k)`` give a sub-consensus model; the global model is their mean.
    """

    GROUPS, GROUP_SIZE, EMA, DISTANCE_SCALE = 10, 6, 0.999, 0.01

    def __init__(self) -> None:
        super().__init__("RSCFed", "FSSL", views=("view1",))

    def start(self, fed: Federation, init: torch.Tensor, generator: torch.Generator) -> None:
        self.teacher = init.expand(fed.n_clients, *init.shape).clone()
        self.generator = generator
        self.group_size = min(self.GROUP_SIZE, fed.n_clients)
        self.rows = float(fed.x.shape[1])  # N_k, equal for every client here

    def teachers(self) -> dict[str, torch.Tensor]:
        return {"view2": self.teacher}

    def loss(self, batch: Batch, logits: dict[str, torch.Tensor], w: torch.Tensor) -> torch.Tensor:
        teacher = torch.sigmoid(batch.teacher["view2"])
        student = logits["view1"]
        per_client = batch.size * batch.n_missing
        unsupervised = masked_mean((torch.sigmoid(student) - teacher) ** 2, batch.missing, per_client)
        return _supervised(batch, student) + unsupervised

    def after_step(self, w: torch.Tensor) -> None:
        self.teacher.mul_(self.EMA).add_(w, alpha=1 - self.EMA)

    def aggregate(self, rnd: int, local_w: torch.Tensor) -> torch.Tensor:
        subs = []
        for _ in range(self.GROUPS):
            group = torch.randperm(local_w.shape[0], generator=self.generator)[: self.group_size]
            members = local_w[group]
            mean = members.mean(dim=0)
            # FedMLP's model_dist: the sum of the per-parameter norms (weight, bias)
            distance = (members[:, :, :-1] - mean[:, :-1]).flatten(1).norm(dim=1) + (
                members[:, :, -1] - mean[:, -1]
            ).norm(dim=1)
            # N_k / N_group · exp(−0.01 · dist / N_k), normalised; N_k is the same for every client
            weights = torch.exp(-self.DISTANCE_SCALE * distance / self.rows) / len(group)
            subs.append(torch.einsum("k,kcd->cd", weights / weights.sum(), members))
        return torch.stack(subs).mean(dim=0)


class FedFixMatch(Method):
    """FedAvg + FixMatch (Sohn et al. 2020) as FedMLP adapts it.

    Local: supervised BCE on the active classes of the weak view; for samples whose weak-view
    predictions are confident (σ > 0.8 or < 0.2) on *every* missing class, hard pseudo-labels
    (σ > 0.5) supervise the strong view's missing classes, weight 1.  Server: FedAvg.
    """

    CONFIDENT, UNSUPERVISED_WEIGHT = 0.8, 1.0

    def __init__(self) -> None:
        super().__init__("FedFixMatch", "FSSL", views=("weak", "strong"))

    def loss(self, batch: Batch, logits: dict[str, torch.Tensor], w: torch.Tensor) -> torch.Tensor:
        weak, strong = logits["weak"], logits["strong"]
        with torch.no_grad():
            p = torch.sigmoid(weak)
            sure = (p > self.CONFIDENT) | (p < 1 - self.CONFIDENT)
            # a row counts when every missing class is confident
            row_ok = (sure | (batch.missing == 0)).all(dim=2, keepdim=True).float()  # K × B × 1
            pseudo = (p > 0.5).float()
            n_missing = batch.n_missing
            denominator = (row_ok.sum(dim=1, keepdim=True) * n_missing).clamp(min=1.0)  # K × 1 × 1
        unsupervised = (bce(strong, pseudo) * batch.missing * row_ok / denominator).sum()
        return _supervised(batch, weak) + self.UNSUPERVISED_WEIGHT * unsupervised


def relation_matrix(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """FedIRM's class relation matrix per client: row i is ``σ(mean logits of label-i rows / 2)``.

    ``logits`` and ``labels`` are ``K × B × C``; rows without a label i give ``σ(0) = 0.5``.
    """
    sums = torch.bmm(labels.transpose(1, 2), logits)  # K × C × C
    counts = labels.sum(dim=1)[:, :, None]  # K × C × 1
    return torch.sigmoid(sums / (counts + 1e-8) / 2.0)


class FedIRM(Method):
    """FedIRM (Liu et al., MICCAI 2021) as FedMLP adapts it.

    Rounds < S = 20 (``rounds_FedIRM_sup`` of the reference's 500 rounds, scaled with R: 2 at
    R = 50): supervised BCE on the active classes of two views.  From round S − 1 every client sends
    its class relation matrix (mean logits per labelled class, through σ(·/2)); the server averages
    row c over the clients that label c.  From round S: the supervised loss plus, weighted by
    ``1·rampup(round, 30)`` (30 scaled likewise), the squared difference between the
    sigmoid outputs of the head (view 1) and a per-client EMA teacher (view 2, decay 0.99), and the
    symmetric KL between the relation matrix of the confident (σ > 0.7 or < 0.3 on every class),
    low-entropy (< 2.0) samples and the server's matrix.
    """

    SUPERVISED_ROUNDS, RAMPUP, EMA, CONFIDENT, MAX_UNCERTAINTY = 20, 30.0, 0.99, 0.7, 2.0

    def __init__(self) -> None:
        super().__init__("FedIRM", "FSSL", views=("view1", "view2"))

    def start(self, fed: Federation, init: torch.Tensor, generator: torch.Generator) -> None:
        self.supervised_rounds = self.stage_round(self.SUPERVISED_ROUNDS)
        self.rampup = self.RAMPUP * self.stage_scale
        self.active = fed.active
        self.target: torch.Tensor | None = None
        self.teacher: torch.Tensor | None = None
        self.steps = 0

    def start_round(self, rnd: int, global_w: torch.Tensor, local_w: torch.Tensor) -> None:
        self.rnd = rnd
        self.relation_sum = torch.zeros(local_w.shape[0], self.active.shape[1], self.active.shape[1])
        self.batches = 0
        if rnd >= self.supervised_rounds and self.teacher is None:
            self.teacher = local_w.clone()  # the EMA model starts from the global head once

    def loss(self, batch: Batch, logits: dict[str, torch.Tensor], w: torch.Tensor) -> torch.Tensor:
        first, second = logits["view1"], logits["view2"]
        loss = _supervised(batch, first) + _supervised(batch, second)
        if self.rnd >= self.supervised_rounds - 1:
            with torch.no_grad():
                self.relation_sum += relation_matrix(first, batch.y)
                self.batches += 1
        if "view2" not in batch.teacher or self.target is None:  # before round 20
            return loss
        weight = sigmoid_rampup(self.rnd, 0.0, self.rampup)
        with torch.no_grad():
            ema = torch.sigmoid(batch.teacher["view2"])
            p = torch.sigmoid(first)
            uncertainty = -(p * torch.log(p + 1e-6) + (1 - p) * torch.log(1 - p + 1e-6)).sum(dim=2)
            confident = ((p > self.CONFIDENT) | (p < 1 - self.CONFIDENT)).all(dim=2)
            keep = (confident & (uncertainty < self.MAX_UNCERTAINTY)).float()[:, :, None]  # K × B × 1
            pseudo = (p > 0.5).float() * keep
            any_kept = keep.sum(dim=1) > 0  # K × 1
        consistency = ((torch.sigmoid(first) - ema) ** 2).sum() / batch.size
        source = torch.where(any_kept[:, :, None], relation_matrix(first * keep, pseudo), 0.5)
        kd = _symmetric_kl(source, self.target.expand_as(source))
        return loss + weight * consistency + weight * kd

    def teachers(self) -> dict[str, torch.Tensor]:
        if self.rnd >= self.supervised_rounds and self.teacher is not None and self.target is not None:
            return {"view2": self.teacher}
        return {}

    def after_step(self, w: torch.Tensor) -> None:
        if self.rnd >= self.supervised_rounds and self.teacher is not None:
            decay = min(1 - 1 / (self.steps + 1), self.EMA)
            self.teacher.mul_(decay).add_(w, alpha=1 - decay)
            self.steps += 1

    def end_round(self, rnd: int, local_w: torch.Tensor) -> None:
        if rnd < self.supervised_rounds - 1 or not self.batches:
            return
        local = self.relation_sum / self.batches  # K × C × C, what each client sends
        share = self.active.float()  # row c averaged over the clients that label c
        counts = share.sum(dim=0).clamp(min=1.0)
        self.target = (local * share[:, :, None]).sum(dim=0) / counts[:, None]


def _symmetric_kl(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """FedIRM's ``(KL(P‖Q) + KL(Q‖P)) / 2`` with ``batchmean`` over the C rows, summed over clients."""
    rows = q.shape[1]
    kl_pq = (p * (torch.log(p) - torch.log(q))).sum() / rows
    kl_qp = (q * (torch.log(q) - torch.log(p))).sum() / rows
    return (kl_pq + kl_qp) / 2.0


class CBAFed(Method):
    """CBAFed (Li et al., CVPR 2023) as FedMLP's ``train_CBAFed`` and ``main.py`` run it.

    Stage 1, the warm-up (``rounds_CBAFed_warmup`` = 50 of the reference's 500 rounds, scaled with
    R: 5 at R = 50): supervised BCE (pos_weight N/N_c) on the active classes; "residual" aggregation:
    FedAvg, except every 5th round (5, 10, ...) the new global head is 0.2·FedAvg + 0.8·the global
    head kept at the previous such round.

    From the warm-up's last round on, the server computes each class's share of the labels the
    clients trained on, ``p_c`` (class counts over the sum of data counts; in the warm-up a client
    counts N rows for each active class), and the class-balanced thresholds ``τ_c = clip(p_c + 0.45
    − std(p), 0.55, 0.95)`` (std with 1/(C−1)).

    Stage 2: on each missing class c, the rows the head is confident about (``σ(z) > τ_c`` or
    ``< 1 − τ_c``, on the augmented view it trains on) get the pseudo-label ``σ(z) > τ_c``; their BCE
    with pos_weight ``confident / pseudo-positive`` (1 when no row is pseudo-positive; FedMLP's
    per-batch update) is averaged over the confident rows and added, class by class, to the
    supervised loss.  Clients count their labels (N per active class, the confident rows per
    missing class) for the next thresholds, and the server averages the heads weighted by those
    counts, with the residual every 5 rounds from the stage's start now at 0.5/0.5.

    The reference trains on RandomAffine + flip images; here the weak feature jitter.
    """

    RESIDUAL_EVERY, WARMUP_NEW_SHARE, STAGE2_NEW_SHARE = 5, 0.2, 0.5
    WARMUP_ROUNDS = 50
    TAU_SHIFT, TAU_MIN, TAU_MAX = 0.45, 0.55, 0.95

    def __init__(self) -> None:
        super().__init__("CBAFed", "FSSL", views=("weak",))

    def start(self, fed: Federation, init: torch.Tensor, generator: torch.Generator) -> None:
        self.warmup = self.stage_round(self.WARMUP_ROUNDS)
        self.active = fed.active
        self.pos_weight = fed.pos_weight.clone()  # K × C: the missing entries change in stage 2
        self.class_counts = torch.zeros(fed.n_clients, fed.n_classes)
        self.data_counts = torch.zeros(fed.n_clients)
        self.residual: torch.Tensor | None = None
        self.tau: torch.Tensor | None = None
        self.pseudo_labels = 0  # confident (row, missing class) pairs trained on in stage 2
        self.rnd = 0

    def start_round(self, rnd: int, global_w: torch.Tensor, local_w: torch.Tensor) -> None:
        self.rnd = rnd
        self.class_counts.zero_()
        self.data_counts.zero_()

    def loss(self, batch: Batch, logits: dict[str, torch.Tensor], w: torch.Tensor) -> torch.Tensor:
        z = logits["weak"]
        if self.rnd < self.warmup or self.tau is None:
            self.data_counts += batch.size
            return _supervised(batch, z)
        with torch.no_grad():
            p = torch.sigmoid(z)
            missing = batch.missing.bool()  # K × 1 × C
            above = (p > self.tau) & missing
            confident = (above | (p < 1 - self.tau)) & missing  # K × B × C
            n_above = above.sum(dim=1).float()  # K × C
            n_confident = confident.sum(dim=1).float()
            weight = torch.where(n_above > 0, n_confident / n_above.clamp(min=1.0), 1.0)
            self.pos_weight = torch.where(missing[:, 0], weight, self.pos_weight)
            targets = torch.where(missing, above.float(), batch.y)
            labelled = batch.active[:, 0] * batch.size  # K × C
            self.class_counts += n_confident + labelled
            self.data_counts += n_confident.sum(dim=1) + labelled.sum(dim=1)
            self.pseudo_labels += int(n_confident.sum())
        losses = bce(z, targets, self.pos_weight[:, None, :])
        per_client = batch.size * batch.n_active
        supervised = masked_mean(losses, batch.active, per_client)
        pseudo = ((losses * confident).sum(dim=1) / n_confident.clamp(min=1.0)).sum()
        return supervised + pseudo

    def end_round(self, rnd: int, local_w: torch.Tensor) -> None:
        if rnd < self.warmup:  # the reference's class_num_list[active] = data_num
            self.class_counts = self.active.float() * self.data_counts[:, None]

    def aggregate(self, rnd: int, local_w: torch.Tensor) -> torch.Tensor:
        if rnd >= self.warmup - 1:
            share = self.class_counts.sum(dim=0) / self.data_counts.sum().clamp(min=1.0)
            self.tau = (share + self.TAU_SHIFT - share.std()).clamp(self.TAU_MIN, self.TAU_MAX)
        if rnd < self.warmup:
            averaged, since, new_share = local_w.mean(dim=0), rnd, self.WARMUP_NEW_SHARE
        else:
            weights = self.data_counts / self.data_counts.sum().clamp(min=1.0)
            averaged = torch.einsum("k,kcd->cd", weights, local_w)
            since, new_share = rnd - self.warmup, self.STAGE2_NEW_SHARE
        if since % self.RESIDUAL_EVERY != 0:
            return averaged
        if since == 0 or self.residual is None:
            self.residual = averaged
            return averaged
        self.residual = new_share * averaged + (1 - new_share) * self.residual
        return self.residual
