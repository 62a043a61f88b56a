"""Federated multi-label baseline with partial labels (paper Table I, FMLL): FedMLP."""

from __future__ import annotations

import torch

from secure_afl.sim.baselines.common import Batch, Federation, Method, bce, masked_mean
from secure_afl.sim.baselines.engine import logits_of


class FedMLP(Method):
    """FedMLP (Sun et al., MICCAI 2024), reconstructed from ``train_FedMLP`` of its released code.

    The released ``main.py`` cannot run FedMLP: it branches on ``'FeMLP'``, calls ``train_FeMLP``
    and reads ``rounds_FeMLP_stage1``, none of which exist.  This follows ``train_FedMLP`` and the
    ``args.exp == 'FedMLP'`` aggregation branch of ``main.py``.

    Stage 1 (``rounds_FedMLP_stage1`` = 50 of the reference's 500 rounds, scaled with R: 5 at
    R = 50): on two views, BCE of ``σ(z)`` on the active classes (the logit adjustment in FedMLP's
    ``LogitAdjust_Multilabel`` is commented out) plus, on the missing classes, the MSE between the
    head's and the round's global head's sigmoid outputs on the same view (both averaged over the
    two views; a view-consistency term carries weight 0).  Server: FedAvg.

    At the end of stage 1's last round each client sends, for its active classes, the mean feature
    of its label-0 and its label-1 rows (the class prototypes; FedMLP's penultimate features are
    this head's frozen input), and for its missing classes the share of rows its head predicts
    confidently (``σ < L = 0.3`` or ``> U = 0.7``).  The server averages the prototypes over the
    clients that label the class and the shares over the clients that miss it (the "difficulty"
    τ; FedMLP's code computes and prints it every round but its use in the selection is commented
    out, so here it is reported in ``state["tao"]``, from the last round's heads, and changes nothing).

    Stage 2, every round: for each missing class c, a client scores its rows not yet pseudo-labelled
    for c by ``cos(h, P_c0) − cos(h, P_c1)``; of those scoring ≥ 0 the top 0.5 % (``clean_threshold``)
    get pseudo-label 0, of those scoring < 0 the bottom 1 % (``noise_threshold``) pseudo-label 1,
    and the pseudo-labels accumulate over the rounds.  Local loss: BCE of ``σ(z)`` on one view over
    the entries with a label (active classes, and the pseudo-labelled (row, class) pairs), averaged
    over those entries.  Server: FedAvg.

    The reference scores rows on features of an augmented image each round; on frozen features the
    scores use the features themselves, so they do not change between rounds (nor, the features
    being frozen, do the prototypes: they are computed once).
    """

    STAGE1_ROUNDS = 50
    CLEAN_SHARE, NOISE_SHARE = 0.005, 0.01  # clean_threshold, noise_threshold
    LOWER, UPPER = 0.3, 0.7  # L, U

    def __init__(self) -> None:
        super().__init__("FedMLP", "FMLL", views=("view1", "view2"))

    def start(self, fed: Federation, init: torch.Tensor, generator: torch.Generator) -> None:
        self.stage1 = self.stage_round(self.STAGE1_ROUNDS)
        self.fed = fed
        self.views = ("view1", "view2")
        shape = (fed.n_clients, fed.x.shape[1], fed.n_classes)
        self.selected = torch.zeros(shape, dtype=torch.bool)  # pseudo-labelled (row, missing class)
        self.pseudo = torch.zeros(shape)  # their pseudo-labels
        self.score: torch.Tensor | None = None  # K × N × C: cos to P_c0 − cos to P_c1
        self.state["prototypes"] = None
        self.state["tao"] = None
        self.last_heads: torch.Tensor | None = None  # the clients' heads after the last round (τ)
        self.rnd = 0

    def start_round(self, rnd: int, global_w: torch.Tensor, local_w: torch.Tensor) -> None:
        self.rnd = rnd
        if rnd < self.stage1:
            self.global_head = local_w.clone()
            return
        self.views = ("view1",)
        self._select()
        fed = self.fed
        self.targets = torch.where(self.selected, self.pseudo, fed.y)
        self.labelled = (self.selected | fed.active[:, None, :]).float()

    def teachers(self) -> dict[str, torch.Tensor]:
        if self.rnd < self.stage1:
            return {"view1": self.global_head, "view2": self.global_head}
        return {}

    def loss(self, batch: Batch, logits: dict[str, torch.Tensor], w: torch.Tensor) -> torch.Tensor:
        if self.rnd >= self.stage1:
            if batch.rows is None and batch.flat_rows is None:
                raise ValueError(
                    "FedMLP's stage 2 needs each batch's rows (Batch.rows) to find its pseudo-labels"
                )
            targets = batch.take(self.targets)
            labelled = batch.take(self.labelled)
            per_client = labelled.sum(dim=(1, 2)).clamp(min=1.0)
            return ((bce(logits["view1"], targets) * labelled).sum(dim=(1, 2)) / per_client).sum()
        n_active, n_missing = batch.n_active, batch.n_missing
        total = torch.zeros(())
        for view in ("view1", "view2"):
            z = logits[view]
            g = torch.sigmoid(batch.teacher[view])
            supervised = masked_mean(bce(z, batch.y), batch.active, batch.size * n_active)
            distill = masked_mean((torch.sigmoid(z) - g) ** 2, batch.missing, batch.size * n_missing)
            total = total + (supervised + distill) / 2
        return total

    def end_round(self, rnd: int, local_w: torch.Tensor) -> None:
        if rnd < self.stage1 - 1:
            return
        if self.score is None:
            self._prototypes()
        # τ is reported, not used, and each round's replaced the last's: it is computed once, from the
        # last round's heads, when training ends (a pass over every client's rows: about 35 ms a
        # round, some 4 % of FedMLP's time, when it ran every round)
        self.last_heads = local_w.clone()

    def end_training(self) -> None:
        if self.last_heads is not None:
            self._difficulty(self.last_heads)

    def _difficulty(self, local_w: torch.Tensor) -> None:
        """τ: every client's share of confident predictions on its missing classes, averaged per
        class over the clients that miss it (1 where none does, as FedAvg_tao)."""
        with torch.no_grad():
            p = torch.sigmoid(logits_of(local_w, self.fed.x))
            sure = ((p < self.LOWER) | (p > self.UPPER)).float().mean(dim=1)  # K × C
        missing = (~self.fed.active).float()
        counts = missing.sum(dim=0)
        tao = (sure * missing).sum(dim=0) / counts.clamp(min=1.0)
        self.state["tao"] = torch.where(counts > 0, tao, 1.0)

    def _prototypes(self) -> None:
        """Class prototypes P_c0, P_c1 from the clients that label c, and every row's score."""
        fed = self.fed
        h = fed.x[:, :, :-1]  # frozen features, without the bias column
        y = fed.y  # the active classes' labels (0 elsewhere)
        rows = float(h.shape[1])
        ones = torch.einsum("knc,knd->kcd", y, h)  # K × C × d: sums over label-1 rows
        zeros = h.sum(dim=1)[:, None, :] - ones
        n_ones = y.sum(dim=1)  # K × C
        n_zeros = rows - n_ones
        prototypes = []
        for sums, counts in ((zeros, n_zeros), (ones, n_ones)):
            use = (fed.active & (counts > 0)).float()  # clients labelling c with such rows
            means = sums / counts.clamp(min=1.0)[:, :, None]
            pooled = (means * use[:, :, None]).sum(dim=0) / use.sum(dim=0).clamp(min=1.0)[:, None]
            prototypes.append(torch.where(use.sum(dim=0)[:, None] > 0, pooled, torch.nan))
        p0, p1 = prototypes  # C × d each
        self.state["prototypes"] = torch.stack([p0, p1], dim=1)  # C × 2 × d
        unit = h / h.norm(dim=2, keepdim=True).clamp(min=1e-12)

        def cosine(p: torch.Tensor) -> torch.Tensor:
            return unit @ (p / p.norm(dim=1, keepdim=True).clamp(min=1e-12)).T  # K × N × C

        self.score = cosine(p0) - cosine(p1)  # NaN for a class nobody labels: never selected

    def _select(self) -> None:
        """This round's new pseudo-labels: per client and missing class, the top 0.5 % of the
        unselected rows scoring ≥ 0 (label 0) and the bottom 1 % of those scoring < 0 (label 1)."""
        assert self.score is not None
        fed = self.fed
        for k in range(fed.n_clients):
            for c in torch.nonzero(~fed.active[k]).flatten().tolist():
                score = self.score[k, :, c]
                free = ~self.selected[k, :, c] & ~torch.isnan(score)
                clean, noisy = free & (score >= 0), free & (score < 0)
                n_clean = int(self.CLEAN_SHARE * int(clean.sum()))
                n_noisy = int(self.NOISE_SHARE * int(noisy.sum()))
                if n_clean:
                    top = torch.topk(torch.where(clean, score, -torch.inf), n_clean).indices
                    self.selected[k, top, c] = True
                    self.pseudo[k, top, c] = 0.0
                if n_noisy:
                    bottom = torch.topk(torch.where(noisy, -score, -torch.inf), n_noisy).indices
                    self.selected[k, bottom, c] = True
                    self.pseudo[k, bottom, c] = 1.0
