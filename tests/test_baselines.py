"""The seven gradient baselines of Table II: registry, mechanisms, and learning on partial labels."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from secure_afl.sim.baselines import BASELINES, BaselineConfig, BaselineError, parse_baselines, train_baseline
from secure_afl.sim.baselines.common import Batch, FeatureAugmenter, Federation
from secure_afl.sim.baselines.fssl import CBAFed, FedFixMatch, RSCFed, relation_matrix
from secure_afl.sim.metrics import evaluate


def _toy(rng: np.random.Generator, n: int, d: int = 24, n_classes: int = 4, signal=None):
    y = (rng.random((n, n_classes)) < 0.25).astype(int)
    x = rng.normal(size=(n, d)) + y @ signal
    return x.astype(np.float32), y


def test_parse_baselines() -> None:
    assert parse_baselines("all") == tuple(BASELINES) and len(BASELINES) == 7
    assert parse_baselines("fedmlp, RSCFed") == ("RSCFed", "FedMLP")  # Table II's order, any case
    assert parse_baselines("") == parse_baselines("none") == ()
    with pytest.raises(BaselineError, match=r"unknown baseline 'FedProx'.*FedAvg always runs"):
        parse_baselines("FedProx")


def test_federation_shows_only_active_labels() -> None:
    rng = np.random.default_rng(0)
    labels = [np.ones((10, 3), dtype=int), np.ones((10, 3), dtype=int)]
    labels[0][:5, 0] = 0
    fed = Federation.build([rng.normal(size=(10, 4))] * 2, labels, [[0, 2], np.array([False, True, False])])
    assert fed.y[0, :, 1].sum() == 0 and fed.y[1, :, 0].sum() == 0 and fed.y[1, :, 1].sum() == 10
    # FedMLP's pos_weight N/N⁺ on observed positives; 1 where the client has no label
    torch.testing.assert_close(fed.pos_weight, torch.tensor([[2.0, 1.0, 1.0], [1.0, 1.0, 1.0]]))
    assert fed.x.shape == (2, 10, 5) and torch.all(fed.x[:, :, -1] == 1)  # bias column


@pytest.mark.parametrize("name", list(BASELINES))
def test_every_baseline_learns_the_labelled_classes(name: str) -> None:
    rng = np.random.default_rng(1)
    signal = rng.normal(size=(4, 24))
    clients = [_toy(rng, 192, signal=signal) for _ in range(4)]
    test_x, test_y = _toy(rng, 800, signal=signal)
    active = [[c for c in range(4) if c != k] for k in range(4)]  # missing 1: a permutation
    config = BaselineConfig(rounds=6, batch_size=32, lr=1e-2)
    head = train_baseline(name, [x for x, _ in clients], [y for _, y in clients], active, config)
    again = train_baseline(name, [x for x, _ in clients], [y for _, y in clients], active, config)
    np.testing.assert_array_equal(head.coef, again.coef)  # seeded
    assert evaluate(test_y, head.decision_function(test_x), kind="logits").macro["auc"] > 0.8, name


def test_feature_augmentation_leaves_the_bias_column_and_differs_by_strength() -> None:
    augment = FeatureAugmenter(16, torch.Generator().manual_seed(0))
    x = torch.ones(2, 300, 17)
    weak, strong = augment("weak", x), augment("strong", x)
    assert torch.all(weak[:, :, -1] == 1) and torch.all(strong[:, :, -1] == 1)
    assert 0.05 < float(weak[:, :, :-1].std()) < 0.15
    assert float((strong[:, :, :-1] == 0).float().mean()) == pytest.approx(0.2, abs=0.03)  # erased


def _batch(y: torch.Tensor, active: torch.Tensor, views: dict[str, torch.Tensor]) -> Batch:
    a = active.float()[:, None, :]
    return Batch(0, views, y, a, 1 - a, torch.ones_like(a))


def test_fixmatch_pseudo_labels_only_rows_confident_on_every_missing_class() -> None:
    method = FedFixMatch()
    y = torch.zeros(1, 3, 3)
    active = torch.tensor([[True, False, False]])
    weak = torch.tensor([[[0.0, 3.0, -3.0], [0.0, 3.0, 0.1], [0.0, -3.0, -3.0]]])  # row 1 unsure on class 2
    strong = torch.zeros(1, 3, 3, requires_grad=True)
    views = {"weak": torch.zeros(1, 3, 5), "strong": torch.zeros(1, 3, 5)}
    method.loss(
        _batch(y, active, views), {"weak": weak.clone().requires_grad_(), "strong": strong}, None
    ).backward()
    grad = strong.grad[0]
    assert torch.all(grad[1] == 0) and torch.all(grad[:, 0] == 0)  # unsure row, active class: no pseudo-label
    assert grad[0, 1] < 0 and grad[0, 2] > 0 and grad[2, 1] > 0  # pulled towards the weak view's hard labels


def test_relation_matrix_is_sigmoid_of_half_the_mean_logits_per_label() -> None:
    logits = torch.tensor([[[2.0, -2.0], [4.0, 0.0], [0.0, 6.0]]])
    labels = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]])
    expected = torch.sigmoid(torch.tensor([[[3.0, -1.0], [0.0, 6.0]]]) / 2)
    torch.testing.assert_close(relation_matrix(logits, labels), expected)
    no_label = relation_matrix(logits, torch.zeros_like(labels))
    torch.testing.assert_close(no_label, torch.full_like(no_label, 0.5))


def test_cbafed_residual_aggregation_every_fifth_round() -> None:
    fed = Federation.build([np.zeros((4, 1))] * 2, [np.zeros((4, 1), dtype=int)] * 2, [[0]] * 2)
    method = CBAFed()
    method.stage_scale = 1.0  # the reference's 500 rounds: the warm-up lasts 50
    method.start(fed, torch.zeros(1, 2), torch.Generator())
    heads = [torch.full((2, 1, 1), float(r)) for r in range(11)]
    out = [method.aggregate(r, heads[r]) for r in range(11)]
    assert out[0].item() == 0 and out[3].item() == 3  # plain FedAvg between
    assert out[5].item() == pytest.approx(0.2 * 5 + 0.8 * 0)
    assert out[10].item() == pytest.approx(0.2 * 10 + 0.8 * out[5].item())


def test_rscfed_sub_consensus_of_identical_heads_is_that_head_and_downweights_outliers() -> None:
    fed = Federation.build([np.zeros((4, 3))] * 8, [np.zeros((4, 2), dtype=int)] * 8, [[0]] * 8)
    method = RSCFed()
    method.start(fed, torch.zeros(2, 4), torch.Generator().manual_seed(0))
    heads = torch.randn(1, 2, 4).expand(8, 2, 4).clone()
    torch.testing.assert_close(method.aggregate(0, heads), heads[0])
    heads[3] += 10.0
    plain = RSCFed()
    plain.DISTANCE_SCALE = 0.0  # the same random sub-groups, averaged without distance weights
    for m in (method, plain):
        m.start(fed, torch.zeros(2, 4), torch.Generator().manual_seed(1))
    weighted_shift = (method.aggregate(1, heads) - heads[0]).abs().max()
    plain_shift = (plain.aggregate(1, heads) - heads[0]).abs().max()
    assert 0 < weighted_shift < plain_shift


def test_sim_with_all_baselines_under_secure_aggregation(tmp_path) -> None:
    import json

    from click.testing import CliRunner

    from secure_afl.cli import main

    args = ["sim", "--missing", "1,7", "--fraction", "0.04", "--dim", "32", "--fedavg-rounds", "2"]
    result = CliRunner().invoke(
        main, [*args, "--baselines", "all", "--out", str(tmp_path)], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["config"]["secure"] == "mask" and data["config"]["baselines"] == list(BASELINES)
    for setting in data["settings"]:
        assert set(BASELINES) | {"FedAvg", "AFL (1 round)"} <= set(setting["metrics"])
        assert setting["protocol_costs"]  # AFL still went through the masking protocol
    assert "gradient methods (wait)" in data["seconds_per_phase"]
    assert all(set(BASELINES) | {"FedAvg"} <= set(s["seconds_per_method"]) for s in data["settings"])
    report = (tmp_path / "report.md").read_text()
    assert "| FNLL | FedNoRo |" in report and "![BACC and AUC" in report and "(figure.png)" in report
    assert (tmp_path / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.count("IN THE CLEAR") == 2 * 8  # FedAvg and the seven, at both levels
    bad = CliRunner().invoke(main, [*args, "--baselines", "FedProx", "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "unknown baseline 'FedProx'" in bad.output


def _gradient_inputs():
    rng = np.random.default_rng(5)
    signal = rng.normal(size=(4, 24))
    clients = [_toy(rng, 96, signal=signal) for _ in range(4)]
    active = {1: [[0, 1, 2], [1, 2, 3], [2, 3, 0], [3, 0, 1]], 3: [[0], [1], [2], [3]]}
    return [x for x, _ in clients], [y for _, y in clients], active


def test_gradient_jobs_give_the_same_heads_on_a_thread_in_workers_and_inline() -> None:
    from secure_afl.sim.fedavg import FedAvgConfig
    from secure_afl.sim.gradient import GradientMethods

    args = _gradient_inputs()
    fedavg = FedAvgConfig(rounds=2, batch_size=32)
    baseline = BaselineConfig(rounds=2, batch_size=32)
    names = ("FedIRM", "FedNoRo", "FedMLP")
    with GradientMethods(*args, fedavg=fedavg, baselines=names, baseline=baseline, workers=0) as inline:
        assert inline.mode == "inline" and inline.pool is None
        alone = {m: inline.collect(m)[0] for m in (1, 3)}
    # spawned worker processes (two, sharing the memory-mapped features), collected in any order
    with GradientMethods(*args, fedavg=fedavg, baselines=names, baseline=baseline, workers=2) as spawned:
        assert spawned.mode == "processes" and spawned.workers == 2 and spawned.pool is not None
        results = {m: spawned.collect(m) for m in (3, 1)}
    # FedAvg alone: a background thread (auto, outside a fresh console process), clients split over threads
    background = {}
    for workers in ("auto", "thread"):
        with GradientMethods(*args, fedavg=fedavg, workers=workers, fork_ok=True) as jobs:
            assert jobs.mode == "thread" and jobs.thread is not None and jobs.forked is None
            background[workers] = {m: jobs.collect(m)[0]["FedAvg"] for m in (1, 3)}
    for missing, (heads, seconds) in results.items():
        assert list(heads) == ["FedAvg", "FedIRM", "FedNoRo", "FedMLP"]
        for name, head in heads.items():
            np.testing.assert_array_equal(alone[missing][name].coef, head.coef)
            np.testing.assert_array_equal(alone[missing][name].bias, head.bias)
            assert seconds[name] > 0
        for fedavg_heads in background.values():
            np.testing.assert_array_equal(alone[missing]["FedAvg"].coef, fedavg_heads[missing].coef)
            np.testing.assert_array_equal(alone[missing]["FedAvg"].bias, fedavg_heads[missing].bias)
    assert not np.array_equal(alone[1]["FedAvg"].coef, alone[3]["FedAvg"].coef)  # the levels differ


_FORKED_EQUALS_INLINE = """
import os, sys
import numpy as np
from secure_afl.sim.baselines import BaselineConfig
from secure_afl.sim.fedavg import FedAvgConfig
from secure_afl.sim.gradient import FRESH_PROCESS_ENV, GradientMethods

rng = np.random.default_rng(5)
signal = rng.normal(size=(4, 24))
labels = [(rng.random((96, 4)) < 0.25).astype(int) for _ in range(4)]
features = [(rng.normal(size=(96, 24)) + y @ signal).astype(np.float32) for y in labels]
active = {1: [[0, 1, 2], [1, 2, 3], [2, 3, 0], [3, 0, 1]], 3: [[0], [1], [2], [3]]}
args = (features, labels, active)
fedavg, baseline = FedAvgConfig(rounds=2, batch_size=32), BaselineConfig(rounds=2, batch_size=32)
names = ("FedIRM", "FedMLP")
os.environ[FRESH_PROCESS_ENV] = str(os.getpid())  # what the console script does
# forked before this process runs any torch work itself (the children do all of it)
with GradientMethods(*args, fedavg=fedavg, workers="auto", fork_ok=True) as jobs:
    assert jobs.mode == "fork" and jobs.forked is not None, jobs.mode
    auto = {m: jobs.collect(m)[0] for m in (1, 3)}
    child = jobs.forked.process
assert not child.is_alive() and FRESH_PROCESS_ENV not in os.environ  # closed; the mark is taken
with GradientMethods(*args, fedavg=fedavg, baselines=names, baseline=baseline, workers="fork") as jobs:
    assert jobs.mode == "fork" and jobs.pool is None
    every = {m: jobs.collect(m)[0] for m in (1, 3)}
os.environ[FRESH_PROCESS_ENV] = str(os.getpid() + 1)  # another process's mark is not ours
with GradientMethods(*args, fedavg=fedavg, workers="auto", fork_ok=True) as jobs:
    assert jobs.mode == "thread", jobs.mode
with GradientMethods(*args, fedavg=fedavg, baselines=names, baseline=baseline, workers=0) as jobs:
    alone = {m: jobs.collect(m)[0] for m in (1, 3)}
for m in (1, 3):
    for name, head in every[m].items():
        assert np.array_equal(alone[m][name].coef, head.coef)
        assert np.array_equal(alone[m][name].bias, head.bias)
    assert np.array_equal(alone[m]["FedAvg"].coef, auto[m]["FedAvg"].coef)
print("forked heads equal inline heads")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="FedAvg forks on Linux only")
def test_forked_jobs_in_a_fresh_process_give_the_inline_heads(fresh_python, tmp_path) -> None:
    # In a process of its own: forking is safe only before the process has run MKL work, and this
    # test process has run plenty.
    done = fresh_python(_FORKED_EQUALS_INLINE, cwd=tmp_path)
    assert "forked heads equal inline heads" in done.stdout


def test_fedavg_on_several_threads_is_fedavg_on_one() -> None:
    from secure_afl.sim.fedavg import FedAvgConfig, train_fedavg

    features, labels, _ = _gradient_inputs()
    targets = [y.astype(np.float32) for y in labels]
    config = FedAvgConfig(rounds=3, local_epochs=2, batch_size=40)  # a last batch of 16 rows
    one = train_fedavg(features, targets, config)
    for threads in (2, 3, 8):  # 8 threads for 4 clients: one client each
        many = train_fedavg(features, targets, config, threads=threads)
        np.testing.assert_array_equal(one.coef, many.coef)
        np.testing.assert_array_equal(one.bias, many.bias)
    with pytest.raises(ValueError, match="at least 1"):
        train_fedavg(features, targets, config, threads=0)
    asked = iter([1, 3, 2, 8, 1])  # the simulator changes the count between rounds
    varying = train_fedavg(
        features, targets, FedAvgConfig(rounds=4, local_epochs=2, batch_size=40), threads=lambda: next(asked)
    )
    fixed = train_fedavg(features, targets, FedAvgConfig(rounds=4, local_epochs=2, batch_size=40))
    np.testing.assert_array_equal(fixed.coef, varying.coef)
    np.testing.assert_array_equal(fixed.bias, varying.bias)


def test_clients_stacked_from_their_rows_equal_clients_stacked_from_copies() -> None:
    from secure_afl.sim.baselines.engine import stack_clients

    rng = np.random.default_rng(3)
    features = rng.normal(size=(50, 6))  # float64: the stacked tensor rounds to float32 either way
    rows = [rng.permutation(50)[:12] for _ in range(3)]
    stacked = stack_clients(features, rows)
    assert stacked.shape == (3, 12, 7) and stacked.dtype == torch.float32
    assert torch.equal(stacked, stack_clients([features[r] for r in rows]))
    assert torch.equal(stacked[..., -1], torch.ones(3, 12))
    with pytest.raises(ValueError, match="equal size, got sizes \\[11, 12\\]"):
        stack_clients(features, [rows[0], rows[1][:11]])
    with pytest.raises(ValueError, match="at least one client"):
        stack_clients(features, [])


def test_fedavg_takes_the_cores_the_main_thread_leaves(monkeypatch) -> None:
    from concurrent.futures import Future

    from secure_afl.sim import gradient
    from secure_afl.sim.fedavg import FedAvgConfig
    from secure_afl.sim.gradient import GradientMethods

    monkeypatch.setattr(gradient, "available_cores", lambda: 4)
    args = _gradient_inputs()
    with GradientMethods(*args, fedavg=FedAvgConfig(rounds=1, batch_size=32), workers="thread") as jobs:
        assert jobs.mode == "thread" and jobs.statistics_threads == 3
        assert jobs.fedavg_threads() == 3  # the AFL pipeline holds one core
        seen: list[int] = []

        class Probe(Future):
            def result(self, timeout=None):
                seen.append(jobs.fedavg_threads())  # asked while the main thread waits
                return super().result(timeout)

        for job, future in list(jobs.futures.items()):
            probe = Probe()
            probe.set_result(future.result())
            jobs.futures[job] = probe
        jobs.collect(1)
        assert seen == [4] and jobs.fedavg_threads() == 3


def test_gradient_workers_setting(monkeypatch) -> None:
    from secure_afl.sim.gradient import WORKERS_ENV, _workers_from_environment

    monkeypatch.delenv(WORKERS_ENV, raising=False)
    assert _workers_from_environment() == "auto"
    monkeypatch.setenv(WORKERS_ENV, "0")
    assert _workers_from_environment() == 0
    monkeypatch.setenv(WORKERS_ENV, "2")
    assert _workers_from_environment() == 2
    for mode in ("fork", "thread", " Fork "):
        monkeypatch.setenv(WORKERS_ENV, mode)
        assert _workers_from_environment() == mode.strip().lower()
    monkeypatch.setenv(WORKERS_ENV, "two")
    with pytest.raises(ValueError, match=r"'fork', 'thread', 0 .* number of worker processes"):
        _workers_from_environment()
    monkeypatch.setenv(WORKERS_ENV, "-1")
    with pytest.raises(ValueError, match="or more, got -1"):
        _workers_from_environment()


def test_batches_with_targets_are_the_batches_and_their_taken_targets() -> None:
    from secure_afl.sim.baselines.engine import Epoch, epoch_order

    generator = torch.Generator().manual_seed(4)
    x = torch.randn(3, 50, 7, generator=generator)
    y = torch.randn(3, 50, 5, generator=generator)
    order = epoch_order(3, 50, generator)
    plain = [(xb.clone(), Epoch.take(y, rows)) for xb, rows in Epoch(x, 16, order=order)]
    paired = [(xb.clone(), yb.clone()) for xb, yb in Epoch(x, 16, order=order).with_targets(y)]
    assert [b[0].shape[1] for b in paired] == [16, 16, 16, 2]  # the last batch is short
    with pytest.raises(ValueError, match="3 × 50 like the features, got shape \\(3, 49, 5\\)"):
        next(Epoch(x, 16, order=order).with_targets(y[:, :49]))
    for (x_plain, y_plain), (x_paired, y_paired) in zip(plain, paired, strict=True):
        assert torch.equal(x_plain, x_paired) and torch.equal(y_plain, y_paired)
    for batch_size in (25, 64):  # batches that fill the epoch exactly; one batch larger than it
        plain = [(xb.clone(), Epoch.take(y, rows)) for xb, rows in Epoch(x, batch_size, order=order)]
        paired = [(xb.clone(), yb.clone()) for xb, yb in Epoch(x, batch_size, order=order).with_targets(y)]
        assert len(paired) == len(plain) == -(-50 // batch_size)
        for (x_plain, y_plain), (x_paired, y_paired) in zip(plain, paired, strict=True):
            assert torch.equal(x_plain, x_paired) and torch.equal(y_plain, y_paired)


def test_fedavg_with_reused_buffers_is_the_plain_loop_bit_for_bit() -> None:
    """FedAvg's loop reuses its buffers (batch, targets, gradient, Adam's denominator) and computes
    σ(z) − y (with pos_weight: σ(z)·(1 + (w − 1)y) − w·y) in place: the head must be the one of fresh
    tensors at every step.  Weight decay 5e-4 and pos_weight are FedMLP's train()."""
    from secure_afl.sim.baselines.engine import stack_clients
    from secure_afl.sim.fedavg import FedAvgConfig, train_fedavg_stacked, true_count_pos_weight

    features, labels, _ = _gradient_inputs()
    x = stack_clients(features)
    y = torch.as_tensor(np.stack(labels), dtype=torch.float32)
    config = FedAvgConfig(rounds=3, local_epochs=2, batch_size=40)  # a last batch of 16 rows
    for pos_weight in (None, torch.tensor(true_count_pos_weight(labels), dtype=torch.float32)):
        _fedavg_as_a_plain_loop(
            x, y, config, pos_weight, train_fedavg_stacked(x, y, config, pos_weight=pos_weight)
        )


def _fedavg_as_a_plain_loop(x, y, config, pos_weight, fast) -> None:
    from secure_afl.sim.baselines.engine import (
        Epoch,
        epoch_order,
        head_from_weights,
        initial_weights,
        weighted_average,
    )

    generator = torch.Generator().manual_seed(config.seed)
    global_w = initial_weights(x.shape[2] - 1, y.shape[2], generator)
    augment = FeatureAugmenter(x.shape[2] - 1, generator)  # FedMLP's RandomAffine + flip → weak jitter
    for _ in range(config.rounds):
        w = global_w.expand(x.shape[0], *global_w.shape).clone()
        m, v = torch.zeros_like(w), torch.zeros_like(w)
        orders = [epoch_order(x.shape[0], x.shape[1], generator) for _ in range(config.local_epochs)]
        starts = [augment.epoch_starts(x.shape[0], x.shape[1], config.batch_size) for _ in orders]
        step = 0
        for order, offsets in zip(orders, starts, strict=True):
            for (xb, rows), (start, size) in zip(
                Epoch(x, config.batch_size, order=order), offsets, strict=True
            ):
                xb = torch.cat(
                    [xb[:, :, :-1] * augment.noise("weak", start, size, slice(0, x.shape[0])), xb[:, :, -1:]],
                    2,
                )
                targets = Epoch.take(y, rows)
                logits = torch.bmm(w, xb.transpose(1, 2)).transpose(1, 2)
                if pos_weight is None:
                    error = torch.sigmoid(logits) - targets
                else:  # FedMLP's BCEWithLogitsLoss(pos_weight), differentiated
                    weighted = pos_weight[:, None, :] * targets
                    error = torch.sigmoid(logits) * (1 + weighted - targets) - weighted
                grad_logits = error / (targets.shape[1] * targets.shape[2])
                grad = torch.bmm(grad_logits.transpose(1, 2), xb).add(w, alpha=config.weight_decay)  # L2
                step += 1
                m.mul_(0.9).add_(grad, alpha=1 - 0.9)
                v.mul_(0.999).addcmul_(grad, grad, value=1 - 0.999)
                denominator = (v / (1 - 0.999**step)).sqrt_().add_(1e-8)
                w.addcdiv_(m, denominator, value=-config.lr / (1 - 0.9**step))
        global_w = weighted_average(w, torch.full((x.shape[0],), 1.0 / x.shape[0]))
    plain = head_from_weights(global_w)
    np.testing.assert_array_equal(fast.coef, plain.coef)
    np.testing.assert_array_equal(fast.bias, plain.bias)


def test_weighted_fedavg_gradient_is_bce_with_logits_pos_weight() -> None:
    """FedAvg's written-out gradient is autograd's of torch's BCEWithLogitsLoss(pos_weight), mean."""
    from secure_afl.sim.fedavg import weighted_bce_gradient

    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 10, 4, generator=generator, requires_grad=True)
    targets = (torch.rand(3, 10, 4, generator=generator) < 0.3).float()
    pos_weight = 1 + 9 * torch.rand(3, 1, 4, generator=generator)
    loss = sum(
        torch.nn.functional.binary_cross_entropy_with_logits(
            logits[k], targets[k], pos_weight=pos_weight[k, 0]
        )
        for k in range(3)
    )
    (expected,) = torch.autograd.grad(loss, logits)
    weighted = pos_weight * targets
    factors = torch.cat([1 + weighted - targets, weighted], dim=2)
    torch.testing.assert_close(weighted_bce_gradient(logits.detach(), factors), expected)


def test_fedavg_pos_weight_comes_from_the_true_counts_and_is_checked() -> None:
    from secure_afl.sim.fedavg import FedAvgConfig, train_fedavg, true_count_pos_weight

    labels = [np.array([[1, 0], [0, 0], [0, 0], [1, 0]]), np.array([[1, 1], [0, 0], [0, 0], [0, 0]])]
    np.testing.assert_array_equal(true_count_pos_weight(labels), [[2.0, 1.0], [4.0, 4.0]])  # no positive: 1
    features = [np.ones((4, 3), dtype=np.float32)] * 2
    with pytest.raises(ValueError, match=r"pos_weight must be clients × classes = 2 × 2, got shape \(2, 3\)"):
        train_fedavg(features, labels, FedAvgConfig(rounds=1), pos_weight=np.ones((2, 3)))
    plain = train_fedavg(features, labels, FedAvgConfig(rounds=2))
    weighted = train_fedavg(
        features, labels, FedAvgConfig(rounds=2), pos_weight=true_count_pos_weight(labels)
    )
    assert not np.array_equal(plain.coef, weighted.coef)  # the weights reach the training


def test_padded_rows_give_the_heads_of_unpadded_rows() -> None:
    """stack_clients pads every row to a multiple of 64 bytes (faster products); the heads of every
    method are bit for bit those of the same features without padding."""
    from secure_afl.sim.baselines.common import train
    from secure_afl.sim.baselines.engine import padded_rows, stack_clients
    from secure_afl.sim.fedavg import FedAvgConfig, train_fedavg_stacked

    features, labels, active = _gradient_inputs()
    padded = stack_clients(features)
    assert padded.shape == (4, 96, 25) and padded_rows(padded).shape == (4, 96, 32)
    assert torch.all(padded_rows(padded)[:, :, 25:] == 0)  # the padding is zero
    plain = padded.contiguous()
    assert padded_rows(plain) is None and torch.equal(plain, padded)
    config = BaselineConfig(rounds=3, batch_size=40)  # a last batch of 16 rows
    for name in BASELINES:
        heads = [
            train(BASELINES[name](), Federation.from_stacked(x, labels, active[1]), config)
            for x in (padded, plain)
        ]
        np.testing.assert_array_equal(heads[0].coef, heads[1].coef, err_msg=name)
        np.testing.assert_array_equal(heads[0].bias, heads[1].bias, err_msg=name)
    y = torch.as_tensor(np.stack(labels), dtype=torch.float32)
    fedavg = [train_fedavg_stacked(x, y, FedAvgConfig(rounds=3, batch_size=40)) for x in (padded, plain)]
    np.testing.assert_array_equal(fedavg[0].coef, fedavg[1].coef)


def test_noise_banks_drawn_once_per_process_leave_the_generator_where_drawing_does() -> None:
    FeatureAugmenter._banks_drawn.clear()
    drawn = torch.Generator().manual_seed(11)
    fresh = FeatureAugmenter(16, drawn)
    reused_generator = torch.Generator().manual_seed(11)
    reused = FeatureAugmenter(16, reused_generator)  # the banks of the first, not drawn again
    assert all(reused.banks[kind] is fresh.banks[kind] for kind in ("weak", "strong"))
    assert torch.equal(drawn.get_state(), reused_generator.get_state())
    FeatureAugmenter._banks_drawn.clear()
    again = FeatureAugmenter(16, torch.Generator().manual_seed(11))  # drawn anew: the same values
    assert all(torch.equal(again.banks[kind], fresh.banks[kind]) for kind in ("weak", "strong"))
    other = FeatureAugmenter(16, torch.Generator().manual_seed(12))
    assert not torch.equal(other.banks["weak"], fresh.banks["weak"])


def test_views_made_in_the_batch_buffer_are_the_views_made_apart() -> None:
    from secure_afl.sim.baselines.common import _views
    from secure_afl.sim.baselines.engine import Epoch, stack_clients

    features, _, _ = _gradient_inputs()
    x = stack_clients(features)
    for names in (("view1", "view2"), ("weak", "strong"), ("weak",), ("plain", "strong"), ("view1", "view1")):
        one, two = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        augment_one, augment_two = FeatureAugmenter(24, one), FeatureAugmenter(24, two)
        for (xb, _), (reference, _) in zip(Epoch(x, 40, one), Epoch(x, 40, two), strict=True):
            expected = {"plain": reference.clone()} if "plain" in names else {}
            for name in dict.fromkeys(names):
                if name != "plain":
                    expected[name] = augment_two("strong" if name == "strong" else "weak", reference)
            got = _views([augment_one], xb, names)
            assert list(got) == list(expected)
            for name in expected:
                assert torch.equal(got[name], expected[name]), (names, name)


def test_levels_in_lockstep_give_every_level_the_head_it_gets_alone() -> None:
    from secure_afl.sim.baselines.common import LockstepError, train, train_levels
    from secure_afl.sim.baselines.engine import stack_clients
    from secure_afl.sim.baselines.fnll import FedLSR

    features, labels, active = _gradient_inputs()
    x = stack_clients(features)
    federations = [Federation.from_stacked(x, labels, active[m]) for m in (1, 3)]
    # 4 rounds: every method's second stage from round 1; batches of 40 leave a last one of 16 rows
    config = BaselineConfig(rounds=4, batch_size=40)
    for name, factory in BASELINES.items():
        alone = [train(factory(), fed, config) for fed in federations]
        together = train_levels([factory() for _ in federations], federations, config)
        for one, other in zip(alone, together, strict=True):
            np.testing.assert_array_equal(one.coef, other.coef, err_msg=name)
            np.testing.assert_array_equal(one.bias, other.bias, err_msg=name)

    class LabelDependentDraws(FedLSR):
        def loss(self, batch, logits, w):
            if batch.n_active > 1:  # a draw at one level only: the levels' numbers part
                torch.rand(1, generator=self.generator)
            return super().loss(batch, logits, w)

    with pytest.raises(LockstepError, match="depend on the labels"):
        train_levels([LabelDependentDraws() for _ in federations], federations, config)
    copy = Federation.from_stacked(x.clone(), labels, active[3])
    with pytest.raises(ValueError, match="share one feature tensor"):
        train_levels([FedLSR(), FedLSR()], [federations[0], copy], config)
