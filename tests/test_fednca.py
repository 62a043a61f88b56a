"""FedNCA-ML: the ETF's geometry, the attention (against torch's MultiheadAttention), the loss's
masking of unknown classes, the synthetic tokens' pooled mean, and a small federated run."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from secure_afl.sim.fednca import (
    FedNCAConfig,
    FedNCAError,
    SyntheticTokens,
    _forward,
    _init_params,
    fednca_loss,
    signature_owners,
    simplex_etf,
    sincos_positional_encoding,
    train_fednca,
)
from secure_afl.sim.synthetic import synthetic_features
from secure_afl.torch_threads import one_torch_thread


@pytest.mark.parametrize(("n_classes", "dim"), [(2, 2), (8, 8), (8, 1024), (14, 64)])
def test_simplex_etf_has_unit_rows_and_equal_angles(n_classes: int, dim: int) -> None:
    etf = simplex_etf(n_classes, dim)
    gram = etf @ etf.T
    np.testing.assert_allclose(np.diag(gram), 1.0, atol=1e-12)
    off = gram[~np.eye(n_classes, dtype=bool)]
    np.testing.assert_allclose(off, -1.0 / (n_classes - 1), atol=1e-12)
    np.testing.assert_allclose(etf.sum(axis=0), 0.0, atol=1e-12)  # a simplex: the rows sum to zero
    with pytest.raises(FedNCAError, match="at least the number of classes"):
        simplex_etf(n_classes, n_classes - 1)


def test_positional_encoding_is_fixed_and_tells_positions_apart() -> None:
    pe = sincos_positional_encoding(7, 7, 64)
    assert pe.shape == (49, 64)
    np.testing.assert_array_equal(pe, sincos_positional_encoding(7, 7, 64))
    assert len({row.tobytes() for row in pe}) == 49
    # first half encodes the row, second half the column
    np.testing.assert_array_equal(pe[0, :32], pe[6, :32])
    np.testing.assert_array_equal(pe[0, 32:], pe[42, 32:])
    assert np.abs(pe).max() <= 1


def test_attention_equals_torch_multihead_attention_with_etf_queries() -> None:
    torch.manual_seed(0)
    d, n_classes, heads, batch, tokens = 16, 4, 4, 3, 9
    config = dataclasses.replace(FedNCAConfig(), heads=heads)
    params = _init_params(d, n_classes, config)
    params["in_bias"] = torch.randn(3 * d)  # non-zero biases, to test the folded key bias too
    params["out_bias"] = torch.randn(d)
    etf = torch.as_tensor(simplex_etf(n_classes, d), dtype=torch.float32)
    pe = torch.as_tensor(sincos_positional_encoding(3, 3, d), dtype=torch.float32)
    x = torch.rand(batch, tokens, d)
    features, logits = _forward({k: v[None] for k, v in params.items()}, x[None], etf, pe, heads)
    assert features.shape == (1, batch, n_classes, d) and logits.shape == (1, batch, n_classes, n_classes)
    reference = torch.nn.MultiheadAttention(d, heads, batch_first=True)
    with torch.no_grad():
        reference.in_proj_weight.copy_(params["in_proj"])
        reference.in_proj_bias.copy_(params["in_bias"])
        reference.out_proj.weight.copy_(params["out_proj"])
        reference.out_proj.bias.copy_(params["out_bias"])
        expected, _ = reference(etf.expand(batch, -1, -1), x + pe, x + pe)
    torch.testing.assert_close(features[0], expected, atol=1e-5, rtol=1e-5)
    # the classifier: s·h_cᵀm_j + β_j, the prediction for c on the diagonal
    torch.testing.assert_close(logits[0], config.init_scale * expected @ etf.T, atol=1e-4, rtol=1e-5)


def test_loss_ignores_unknown_classes_and_separates_the_three_terms() -> None:
    torch.manual_seed(1)
    k, b, c, d = 1, 6, 4, 8
    etf = torch.as_tensor(simplex_etf(c, d), dtype=torch.float32)
    features = torch.randn(k, b, c, d)
    logits = 10 * torch.einsum("kbcd,jd->kbcj", features, etf)
    labels = (torch.rand(k, b, c) < 0.5).float()
    known = torch.ones(k, b, c)
    known[..., 2] = 0  # class 2 unknown to this client
    config = FedNCAConfig()
    loss = fednca_loss(features, logits, labels, known, etf, config)
    flipped = labels.clone()
    flipped[..., 2] = 1 - flipped[..., 2]
    torch.testing.assert_close(fednca_loss(features, logits, flipped, known, etf, config), loss)
    # λ1 = λ2 = 0 leaves BCE over the known entries only
    bce_only = dataclasses.replace(config, lambda_reject=0.0, lambda_contrast=0.0)
    expected = torch.nn.functional.binary_cross_entropy_with_logits(
        torch.diagonal(logits, dim1=-2, dim2=-1), labels, reduction="none"
    )
    torch.testing.assert_close(
        fednca_loss(features, logits, labels, known, etf, bce_only), (expected * known).sum(-1).mean(-1)
    )
    # rejection: a negative feature whose strongest prototype response is below τ costs nothing
    reject_only = dataclasses.replace(config, lambda_reject=1.0, lambda_contrast=0.0)
    quiet = torch.full_like(logits, -5.0)  # σ(−5) < 0.3
    torch.testing.assert_close(
        fednca_loss(features, quiet, torch.zeros_like(labels), known, etf, reject_only),
        fednca_loss(features, quiet, torch.zeros_like(labels), known, etf, bce_only),
    )
    loud = quiet.clone()
    loud[0, 0, 0, 1] = 5.0  # sample 0's class-0 feature answers to prototype 1
    extra = fednca_loss(features, loud, torch.zeros_like(labels), known, etf, reject_only) - fednca_loss(
        features, loud, torch.zeros_like(labels), known, etf, bce_only
    )
    assert extra.item() == pytest.approx((torch.sigmoid(torch.tensor(5.0)) - 0.3).item() / b, rel=1e-5)


def test_synthetic_tokens_pool_to_the_synthetic_features() -> None:
    rng = np.random.default_rng(0)
    labels = (rng.random((300, 8)) < 0.2).astype(np.int8)
    patients = rng.integers(100, size=300)
    dim, seed = 64, 3
    features = synthetic_features(labels, patients, dim=dim, seed=seed)
    owners = signature_owners(dim, 8, seed)
    assert (owners >= 0).sum() >= round(0.1 * dim)  # every class owns signature dimensions
    source = SyntheticTokens(features, owners, 8, grid=3, seed=seed)
    rows = np.arange(300)
    tokens = source.tokens(rows)
    assert tokens.shape == (300, 9, dim) and tokens.dtype == np.float32 and (tokens >= 0).all()
    np.testing.assert_allclose(tokens.mean(axis=1), features, rtol=2e-6, atol=1e-7)
    np.testing.assert_array_equal(source.tokens(rows[:5]), tokens[:5])  # the same tokens every time
    # on class c's signature dimensions, the token at c's position holds the share κ + (1−κ)·pattern
    c = int(owners[owners >= 0][0])
    dims = np.flatnonzero(owners == c)
    at = source.position_of[:, c]
    share = tokens[rows, at][:, dims] / (9 * features[:, dims])
    assert (share >= 0.5 - 1e-5).all()


def test_signature_owners_are_the_dimensions_the_labels_move() -> None:
    owners = signature_owners(50, 8, seed=7)
    one = np.zeros((1, 8), dtype=np.int8)
    one[0, 2] = 1
    patients = np.zeros(1, dtype=np.int64)
    moved = (
        synthetic_features(one, patients, dim=50, seed=7)[0]
        != synthetic_features(0 * one, patients, dim=50, seed=7)[0]
    )
    assert moved.any()
    assert set(np.flatnonzero(owners == 2)) <= set(np.flatnonzero(moved))


def test_fednca_learns_a_class_located_at_one_token() -> None:
    """Two clients, 3 classes; a positive image has a bump on its class's channels at one token."""
    rng = np.random.default_rng(5)
    d, n, c = 16, 96, 3

    class Bumps:
        grid = (2, 2)

        def __init__(self) -> None:
            self.labels = (rng.random((2 * n + 200, c)) < 0.4).astype(np.int8)
            self.where = rng.integers(4, size=(len(self.labels), c))
            self.noise = rng.random((len(self.labels), 4, d)).astype(np.float32)

        def tokens(self, rows: np.ndarray) -> np.ndarray:
            out = self.noise[rows].copy()
            for j in range(c):
                hit = self.labels[rows, j] == 1
                out[np.flatnonzero(hit), self.where[rows[hit], j], 4 * j : 4 * j + 4] += 2.0
            return out

    source = Bumps()
    clients = [np.arange(n), np.arange(n, 2 * n)]
    labels = [source.labels[r] for r in clients]
    config = FedNCAConfig(rounds=6, lr=3e-3, batch_size=16, seed=1)
    test = np.arange(2 * n, 2 * n + 200)
    with one_torch_thread():  # tiny matrices: one thread is faster on shared cores
        model = train_fednca(source, clients, labels, [[0, 1, 2], [0, 1, 2]], config)
        proba = model.predict_proba(source, test)
    from sklearn.metrics import roc_auc_score

    aucs = [roc_auc_score(source.labels[test, j], proba[:, j]) for j in range(c)]
    assert min(aucs) > 0.8, aucs
    with pytest.raises(FedNCAError, match="equal size"):
        train_fednca(source, [np.arange(5), np.arange(6)], labels, [[0], [1]], config)
    # the device is the simulator's --device; asking for a GPU that is not there says so
    with pytest.raises(ValueError, match="no CUDA GPU"), pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        train_fednca(source, clients, labels, [[0], [1]], dataclasses.replace(config, device="cuda"))
    auto = dataclasses.replace(config, rounds=1, device="auto")
    with one_torch_thread(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        on_auto = train_fednca(source, clients, labels, [[0, 1, 2], [0, 1, 2]], auto)
        on_cpu = train_fednca(
            source, clients, labels, [[0, 1, 2], [0, 1, 2]], dataclasses.replace(auto, device="cpu")
        )
    for name, values in on_cpu.params.items():
        np.testing.assert_array_equal(on_auto.params[name], values)


def test_sim_baselines_fednca_ml_adds_its_row(tmp_path) -> None:
    import json

    from click.testing import CliRunner

    from secure_afl.cli import main

    args = ["sim", "--missing", "7", "--protection", "none", "--rounds", "1", "--baselines", "fednca-ml"]
    args += ["--fraction", "0.05", "--dim", "16", "--fedavg-rounds", "1", "--out", str(tmp_path)]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "FedNCA-ML" in result.output
    report = (tmp_path / "report.md").read_text()
    assert "| Related | FedNCA-ML |" in report  # not typed as an analytic method
    assert "FedNCA-ML | - | IN THE CLEAR: every client's attention head" in report
    metrics = json.loads((tmp_path / "results.json").read_text())["settings"][0]["metrics"]["FedNCA-ML"]
    assert 0 <= metrics["macro"]["auc"] <= 1 and 0 <= metrics["macro"]["bacc"] <= 1
    bad = CliRunner().invoke(main, ["sim", "--baselines", "fednca", "--out", str(tmp_path)])
    assert bad.exit_code == 2 and "unknown baseline 'fednca'" in bad.output
