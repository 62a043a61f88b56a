"""FedNCA-ML (``seeds/fednca-ml-summary.txt``) as a head on frozen spatial features, trained with FedAvg.

The method, as the summary describes it, with the details the summary marks as damaged taken from
the authors' code (``CanPeng123/multi_label_fl_fednca``, read through the search tools; nothing of it
is copied here):

- **Shared simplex ETF** ``M ∈ R^{C×d}``, fixed and identical on every client:
  ``√(C/(C−1)) (I − 11ᵀ/C)`` with unit-norm rows (``m_iᵀm_j = −1/(C−1)``), placed in the first
  ``C`` coordinates of ``R^d`` (authors' ``neural_collapse/etf_classifier.py``: no random rotation).
- **LADM**: 4-head cross-attention (``torch.nn.MultiheadAttention`` parametrisation: learned
  ``W_q, W_k, W_v`` with biases and an output projection) whose queries are the ETF rows and whose
  keys and values are the spatial tokens plus a fixed 2-D sine–cosine positional encoding (DETR's
  form: first half of the channels encodes the row, second half the column, frequencies
  ``10000^{2⌊i/2⌋/(d/2)}``, even channels sine, odd cosine; authors'
  ``modeling/attention/attention.py``).  It yields one feature ``h_c`` per class.
- **Classifier**: ``ŷ_c = σ(s·h_cᵀm_c + β_c)``.  The summary writes ``σ(h_cᵀm_c)``; the authors' ETF
  classifier multiplies by a learnable scale ``s`` (initialised at 10) and adds a learnable per-class
  bias ``β`` (initialised at 0).  Both are kept: with unit-norm prototypes and features of arbitrary
  norm the scale only speeds up training.
- **Loss per sample** (authors' ``loss/binary_ce_w_reject_n_feature_contrastive_loss.py``; the
  summary's Eq. 12–13 are damaged): ``L = Σ_c BCE_c + λ1 Σ_{c negative} max(0, σ(max_j z_cj) − τ)
  + λ2 Σ_{c positive} CE(softmax_j(cos(h_c, m_j)/0.07), c)`` with ``z_cj = s·h_cᵀm_j + β_j``,
  ``τ = 0.3``; averaged over the batch.  The code's maximum runs over *all* prototypes, the
  summary's prose says "every non-self prototype"; the code is followed (the self term is pushed
  down by BCE anyway).  The code's contrastive temperature 0.07 is not in the summary.
- **Training**: AdamW (lr 1e-4, weight decay 0.01, fresh state every round), batch 32, 1 local
  epoch, equal-weight averaging of every trainable parameter (the summary's Algorithm 1; with the
  simulator's equal client sizes this is also sample-count weighting).  ``λ1 = 0.01``, ``λ2 = 1``
  (the summary's values for pretrained backbones).
- **Missing classes** (decided here): the summary separates a client with *no positive* of a class
  (FedNCA-ML's setting, where the zeros are true negatives) from *unknown* annotations.  In this
  simulator a class a client does not annotate is unknown: its images may well show it.  So an
  unannotated class enters none of the three terms for that client (masked out of BCE, never a
  "negative feature" for rejection, never a positive for the contrastive term), and the fixed ETF
  keeps the class's direction defined anyway.  ``missing="negative"`` treats them as negatives
  instead, as the FedAvg baseline does.

Clients of equal size train as one batched computation (a leading client axis); AdamW is
element-wise and the summed loss separates by client, so this is exactly K independent local runs.
The key projection is folded into the fixed queries (``q_hᵀ(W_k t + b_k) = (W_kᵀq_h)ᵀt + const``; the
constant cancels in the softmax over tokens), and the value projection is applied to the
attention-weighted token means rather than to every token; both are exact rewritings that change
only float rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import torch

from secure_afl.analytic import resolve_device

MissingPolicy = Literal["mask", "negative"]


class FedNCAError(ValueError):
    """A FedNCA-ML configuration or input that cannot be used."""


def simplex_etf(n_classes: int, dim: int) -> np.ndarray:
    """Unit-norm simplex ETF, ``n_classes × dim``: ``m_iᵀm_j = −1/(C−1)``, in the first C coordinates."""
    if n_classes < 2:
        raise FedNCAError(f"a simplex ETF needs at least 2 classes, got {n_classes}")
    if dim < n_classes:
        raise FedNCAError(f"the feature dimension {dim} must be at least the number of classes {n_classes}")
    centred = np.eye(n_classes) - np.full((n_classes, n_classes), 1.0 / n_classes)
    rows = centred / np.linalg.norm(centred, axis=1, keepdims=True)
    etf = np.zeros((n_classes, dim))
    etf[:, :n_classes] = rows
    return etf


def sincos_positional_encoding(height: int, width: int, dim: int) -> np.ndarray:
    """Fixed 2-D sine–cosine encoding, ``(height·width) × dim``, row-major over the grid (DETR's form)."""
    if height < 1 or width < 1 or dim < 2:
        raise FedNCAError(
            f"positional encoding needs a non-empty grid and dim ≥ 2, got {height}×{width}, {dim}"
        )
    half = dim // 2
    i = np.arange(half)
    frequency = 10000.0 ** (2 * (i // 2) / half)
    rows, cols = np.meshgrid(np.arange(height), np.arange(width), indexing="ij")

    def encode(coord: np.ndarray) -> np.ndarray:
        angle = coord.reshape(-1, 1) / frequency
        return np.where(i % 2 == 0, np.sin(angle), np.cos(angle))

    pe = np.zeros((height * width, dim))
    pe[:, :half] = encode(rows)
    pe[:, half : 2 * half] = encode(cols)
    return pe


class TokenSource(Protocol):
    """Spatial tokens of given rows: ``rows × tokens × d`` float32 (generated or read on demand)."""

    grid: tuple[int, int]

    def tokens(self, rows: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class FedNCAConfig:
    rounds: int = 50
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 1e-4
    weight_decay: float = 0.01
    heads: int = 4
    lambda_reject: float = 0.01  # λ1, pretrained backbones
    lambda_contrast: float = 1.0  # λ2
    reject_threshold: float = 0.3  # τ
    contrast_temperature: float = 0.07  # authors' code
    init_scale: float = 10.0  # authors' code
    missing: MissingPolicy = "mask"
    seed: int = 0
    # "auto": CUDA when torch finds a GPU.  At d = 1024 a round is minutes on a GPU and about five
    # on one CPU core (README), so the simulator passes its --device here.
    device: str = "cpu"


@dataclass(frozen=True)
class FedNCAModel:
    """The averaged head: attention parameters, logit scale and class biases, with the fixed ETF."""

    etf: np.ndarray  # C × d
    positional: np.ndarray  # T × d
    heads: int
    params: dict[str, np.ndarray]

    def predict_proba(self, source: TokenSource, rows: np.ndarray, *, batch_size: int = 256) -> np.ndarray:
        """``σ(s·h_cᵀm_c + β_c)`` per row and class."""
        return 1.0 / (1.0 + np.exp(-self.decision_function(source, rows, batch_size=batch_size)))

    def decision_function(
        self, source: TokenSource, rows: np.ndarray, *, batch_size: int = 256, device: str = "cpu"
    ) -> np.ndarray:
        """The class logits ``s·h_cᵀm_c + β_c`` (positive exactly when the probability passes 0.5)."""
        on = resolve_device(device)
        etf = torch.as_tensor(self.etf, dtype=torch.float32, device=on)
        pe = torch.as_tensor(self.positional, dtype=torch.float32, device=on)
        params = {k: torch.as_tensor(v, device=on)[None] for k, v in self.params.items()}
        out = []
        with torch.no_grad():
            for start in range(0, len(rows), batch_size):
                batch = source.tokens(np.asarray(rows[start : start + batch_size]))
                _, logits = _forward(params, torch.as_tensor(batch, device=on)[None], etf, pe, self.heads)
                out.append(torch.diagonal(logits[0], dim1=1, dim2=2).double().cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, len(self.etf)))


def _forward(
    params: dict[str, torch.Tensor], tokens: torch.Tensor, etf: torch.Tensor, pe: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Class features ``K×B×C×d`` and all class-prototype logits ``K×B×C×C`` for client-batched params."""
    n_clients, batch, _, d = tokens.shape
    n_classes = etf.shape[0]
    e = d // heads
    kv = tokens + pe  # fixed positional encoding on keys and values
    w_q, w_k, w_v = params["in_proj"].split(d, dim=1)  # each K × d × d (out × in)
    b_q, _, b_v = params["in_bias"].split(d, dim=1)
    q = torch.einsum("cd,ked->kce", etf, w_q) + b_q[:, None, :]  # K × C × d
    q = q.view(n_clients, n_classes, heads, e)
    # Key projection folded into the queries; q·b_k is constant over tokens and cancels in softmax.
    q_k = torch.einsum("kche,khed->kchd", q, w_k.view(n_clients, heads, e, d))
    scores = torch.einsum("kbtd,kchd->kbhct", kv, q_k) / math.sqrt(e)
    attention = torch.softmax(scores, dim=-1)
    # Attention-weighted tokens first, then the value projection: Σ_t a_t (W_v t + b_v) =
    # W_v (Σ_t a_t t) + b_v since Σ_t a_t = 1.  C·d² per image and head block instead of T·d²: the
    # same at 3×3 synthetic tokens, 6× fewer at DenseNet's 7×7 map.
    mixed = torch.einsum("kbhct,kbtd->kbhcd", attention, kv)
    w_v_heads = w_v.view(n_clients, heads, e, d)
    pooled = torch.einsum("kbhcd,khed->kbche", mixed, w_v_heads) + b_v.view(n_clients, 1, 1, heads, e)
    pooled = pooled.reshape(n_clients, batch, n_classes, d)
    features = torch.einsum("kbce,kde->kbcd", pooled, params["out_proj"]) + params["out_bias"][:, None, None]
    logits = params["scale"][:, None, None, None] * torch.einsum("kbcd,jd->kbcj", features, etf)
    return features, logits + params["class_bias"][:, None, None, :]


def _init_params(d: int, n_classes: int, config: FedNCAConfig) -> dict[str, torch.Tensor]:
    """As ``torch.nn.MultiheadAttention``: Xavier-uniform input projection, zero biases."""
    generator = torch.Generator().manual_seed(config.seed)
    bound = math.sqrt(6.0 / (d + 3 * d))  # xavier_uniform on the 3d × d in-projection
    out_bound = 1.0 / math.sqrt(d)  # nn.Linear's default (kaiming uniform, a=√5)
    return {
        "in_proj": (torch.rand((3 * d, d), generator=generator) * 2 - 1) * bound,
        "in_bias": torch.zeros(3 * d),
        "out_proj": (torch.rand((d, d), generator=generator) * 2 - 1) * out_bound,
        "out_bias": torch.zeros(d),
        "scale": torch.tensor(config.init_scale),
        "class_bias": torch.zeros(n_classes),
    }


def fednca_loss(
    features: torch.Tensor,
    logits: torch.Tensor,
    labels: torch.Tensor,
    known: torch.Tensor,
    etf: torch.Tensor,
    config: FedNCAConfig,
) -> torch.Tensor:
    """Per-client loss ``K``: BCE + λ1·negative rejection + λ2·positive contrastive, batch mean.

    ``labels`` and ``known`` are ``K×B×C`` 0/1; an unknown entry contributes nothing.
    """
    own = torch.diagonal(logits, dim1=-2, dim2=-1)  # K × B × C
    bce = torch.nn.functional.binary_cross_entropy_with_logits(own, labels, reduction="none")
    positive = labels * known
    negative = (1 - labels) * known
    strongest = torch.sigmoid(logits.max(dim=-1).values)  # over all prototypes (authors' code)
    reject = torch.clamp(strongest - config.reject_threshold, min=0)
    cosine = torch.einsum(
        "kbcd,jd->kbcj",
        torch.nn.functional.normalize(features, dim=-1),
        torch.nn.functional.normalize(etf, dim=-1),
    )
    log_softmax = torch.log_softmax(cosine / config.contrast_temperature, dim=-1)
    contrast = -torch.diagonal(log_softmax, dim1=-2, dim2=-1)
    per_sample = (
        (bce * known).sum(-1)
        + config.lambda_reject * (reject * negative).sum(-1)
        + config.lambda_contrast * (contrast * positive).sum(-1)
    )
    return per_sample.mean(dim=-1)


def train_fednca(
    source: TokenSource,
    client_rows: Sequence[np.ndarray],
    labels: Sequence[np.ndarray],
    active: Sequence[Sequence[int]],
    config: FedNCAConfig = FedNCAConfig(),
    *,
    progress: Callable[[int], None] | None = None,
) -> FedNCAModel:
    """FedAvg over equal-size clients; ``labels[k]`` rows × C 0/1, ``active[k]`` its annotated classes."""
    sizes = {len(r) for r in client_rows}
    if (
        not client_rows
        or len(sizes) != 1
        or len(labels) != len(client_rows)
        or len(active) != len(client_rows)
    ):
        raise FedNCAError(
            "FedNCA-ML here expects clients of equal size, with one label matrix and class list each"
        )
    if config.missing not in ("mask", "negative"):
        raise FedNCAError(f"missing must be 'mask' or 'negative', got {config.missing!r}")
    n = sizes.pop()
    n_clients = len(client_rows)
    n_classes = labels[0].shape[1]
    probe = source.tokens(np.asarray(client_rows[0][:1]))
    d = probe.shape[2]
    if d % config.heads:
        raise FedNCAError(f"the token dimension {d} must be divisible by {config.heads} heads")
    on = resolve_device(config.device)
    etf = torch.as_tensor(simplex_etf(n_classes, d), dtype=torch.float32, device=on)
    pe = torch.as_tensor(sincos_positional_encoding(*source.grid, d), dtype=torch.float32, device=on)
    if pe.shape[0] != probe.shape[1]:
        raise FedNCAError(f"the source's grid {source.grid} does not match its {probe.shape[1]} tokens")
    known = np.zeros((n_clients, n_classes), dtype=np.float32)
    for k, classes in enumerate(active):
        known[k, list(classes)] = 1.0
    y = np.stack([np.asarray(lab, dtype=np.float32) * known[k] for k, lab in enumerate(labels)])
    if config.missing == "negative":
        known[:] = 1.0
    y_t = torch.as_tensor(y, device=on)
    known_t = torch.as_tensor(known, device=on)[:, None, :]
    global_params = {k: v.to(on) for k, v in _init_params(d, n_classes, config).items()}
    generator = np.random.default_rng([config.seed, 0xCA])
    rows = np.stack([np.asarray(r) for r in client_rows])
    for round_ in range(config.rounds):
        params = {
            k: v.expand(n_clients, *v.shape).clone().requires_grad_(True) for k, v in global_params.items()
        }
        optimiser = torch.optim.AdamW(list(params.values()), lr=config.lr, weight_decay=config.weight_decay)
        for _ in range(config.local_epochs):
            order = np.stack([generator.permutation(n) for _ in range(n_clients)])
            for start in range(0, n, config.batch_size):
                local = order[:, start : start + config.batch_size]
                batch_rows = np.take_along_axis(rows, local, axis=1)
                tokens = torch.as_tensor(source.tokens(batch_rows.ravel()), device=on).view(
                    n_clients, local.shape[1], *probe.shape[1:]
                )
                index = torch.as_tensor(local, device=on)[:, :, None].expand(-1, -1, n_classes)
                yb = torch.gather(y_t, 1, index)
                features, logits = _forward(params, tokens, etf, pe, config.heads)
                loss = fednca_loss(features, logits, yb, known_t.expand_as(yb), etf, config).sum()
                optimiser.zero_grad(set_to_none=False)
                loss.backward()
                optimiser.step()
        global_params = {k: v.detach().mean(dim=0) for k, v in params.items()}
        if progress is not None:
            progress(round_ + 1)
    return FedNCAModel(
        etf=etf.double().cpu().numpy(),
        positional=pe.double().cpu().numpy(),
        heads=config.heads,
        params={k: v.cpu().numpy() for k, v in global_params.items()},
    )


# ----------------------------------------------------------------------------------------------
# Synthetic spatial tokens for the embedded data
# ----------------------------------------------------------------------------------------------


def signature_owners(dim: int, n_classes: int, seed: int) -> np.ndarray:
    """Per feature dimension, the class whose synthetic signature touches it (−1: none).

    Read off :func:`synthetic_features` itself: its random draws do not depend on the labels, so one
    row with class ``c`` and one with no class differ exactly on ``c``'s signature dimensions.  A
    dimension shared by several signatures goes to one of them at random (seeded).
    """
    from secure_afl.sim.synthetic import synthetic_features

    patients = np.zeros(1, dtype=np.int64)
    base = synthetic_features(np.zeros((1, n_classes), dtype=np.int8), patients, dim=dim, seed=seed)
    touched = np.zeros((n_classes, dim), dtype=bool)
    for c in range(n_classes):
        one = np.zeros((1, n_classes), dtype=np.int8)
        one[0, c] = 1
        touched[c] = synthetic_features(one, patients, dim=dim, seed=seed)[0] != base[0]
    rng = np.random.default_rng([seed, 0x70C])
    owners = np.full(dim, -1, dtype=np.int64)
    for j in np.flatnonzero(touched.any(axis=0)):
        owners[j] = rng.choice(np.flatnonzero(touched[:, j]))
    return owners


class SyntheticTokens:
    """Spatial tokens whose mean over the grid is the synthetic pooled feature, generated per batch.

    Model (an extension of :mod:`secure_afl.sim.synthetic`), for image ``i`` with pooled feature
    ``h_i`` (never changed) on a ``g×g`` grid of ``T = g²`` tokens::

        t_{i,p,j} = T · h_ij · W_{i,p,j},      Σ_p W_{i,p,j} = 1,  W ≥ 0

    so ``mean_p t_{i,p} = h_i`` (exactly in real arithmetic; float32 rounding in practice) and tokens
    are non-negative like CNN activation maps.  ``W`` spreads a dimension over the grid with a
    random pattern (softmax over positions of N(0, 0.5²) noise; ``patterns`` patterns drawn once,
    one picked per image); on the signature dimensions of class ``c`` a share ``κ = concentration``
    is put at one random position ``p_ic`` per image and class, so the class's evidence sits at a
    location that attention can find.  The positions and patterns are drawn without looking at the
    labels: the tokens are a function of ``h_i`` and label-independent noise, hence carry no more
    information about the labels than the pooled features every other method sees.

    Memory: nothing of size rows × T × d is kept; per batch the tokens are rebuilt from the pooled
    features, the image's pattern index and its class positions (``patterns × T × d`` float32 plus
    ``rows × (1 + C)`` integers).  The default grid is 3×3, not DenseNet's 7×7: the cost of the
    attention head grows with T and the embedded run must stay fast on 2 cores.
    """

    def __init__(
        self,
        features: np.ndarray,
        owners: np.ndarray,
        n_classes: int,
        *,
        grid: int = 3,
        concentration: float = 0.5,
        patterns: int = 64,
        seed: int = 0,
    ) -> None:
        if not 0 <= concentration <= 1:
            raise FedNCAError(f"concentration must lie in [0, 1], got {concentration}")
        if grid < 1:
            raise FedNCAError(f"grid must be at least 1, got {grid}")
        self.features = features
        self.grid = (grid, grid)
        n_tokens = grid * grid
        rng = np.random.default_rng([seed, 0x70C, 1])
        noise = rng.normal(0.0, 0.5, size=(patterns, n_tokens, features.shape[1]))
        weights = np.exp(noise - noise.max(axis=1, keepdims=True))
        self.patterns = (weights / weights.sum(axis=1, keepdims=True)).astype(np.float32)
        self.pattern_of = rng.integers(patterns, size=len(features))
        self.position_of = rng.integers(n_tokens, size=(len(features), n_classes))
        self.owned = np.flatnonzero(owners >= 0)
        self.owner = owners[self.owned]
        self.concentration = np.float32(concentration)

    def tokens(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows)
        n_tokens = self.grid[0] * self.grid[1]
        weights = self.patterns[self.pattern_of[rows]].copy()  # B × T × d
        weights[:, :, self.owned] *= 1 - self.concentration
        where = self.position_of[rows][:, self.owner]  # B × owned dims
        weights[np.arange(len(rows))[:, None], where, self.owned[None, :]] += self.concentration
        return (np.float32(n_tokens) * self.features[rows])[:, None, :] * weights


def token_source(data: object, *, seed: int, grid: int = 3) -> TokenSource:
    """The spatial tokens of the simulator's prepared data (embedded: synthetic tokens).

    ``data`` is a :class:`secure_afl.sim.datasets.PreparedData`.  On real images the tokens are the
    backbone's cached pre-pooling feature map (``ImageSource(spatial=True)``, which the simulator
    asks for when FedNCA-ML is among the baselines); never a silent fallback to pooled features.
    """
    description = data.description  # type: ignore[attr-defined]
    tokens = getattr(data, "tokens", None)
    if tokens is not None:
        return tokens
    if not description.get("synthetic_features"):
        raise FedNCAError(
            "FedNCA-ML needs the backbone's spatial feature map (before pooling), and these features "
            "were extracted without it: prepare the images with ImageSource(spatial=True) (the "
            "simulator does so when --baselines includes fednca-ml), or leave it out of --baselines"
        )
    features = data.features  # type: ignore[attr-defined]
    n_classes = data.cohort.labels.shape[1]  # type: ignore[attr-defined]
    owners = signature_owners(features.shape[1], n_classes, seed)
    return SyntheticTokens(features, owners, n_classes, grid=grid, seed=seed)


def fednca_scores(
    data: object,
    active: Sequence[Sequence[int]],
    config: FedNCAConfig = FedNCAConfig(),
    *,
    progress: Callable[[int], None] | None = None,
) -> np.ndarray:
    """Train FedNCA-ML on the simulator's clients and return its test-set logits (rows × C).

    ``data`` is a :class:`secure_afl.sim.datasets.PreparedData`; ``active[k]`` client k's classes.
    """
    source = token_source(data, seed=config.seed)
    clients = list(data.split.clients)  # type: ignore[attr-defined]
    labels = [data.cohort.labels[rows] for rows in clients]  # type: ignore[attr-defined]
    model = train_fednca(source, clients, labels, active, config, progress=progress)
    return model.decision_function(source, data.split.test, device=config.device)  # type: ignore[attr-defined]
