"""``secure-afl deploy local`` and ``secure-afl predict``: the command layer that may import both the
simulator (data partition, the in-process reference) and the deployment (which never imports sim).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from secure_afl.cli_options import ckks_degree_option, dp_options
from secure_afl.deploy.errors import DeploymentError
from secure_afl.deploy.study import Study, pseudo_group, pseudo_members, round2_classes

ClientData = tuple[np.ndarray, np.ndarray, tuple[int, ...]]  # features, labels, active classes
# ``deploy local --secure ckks`` against the masked simulation: CKKS rounds every decrypted sum to
# 2^-24, so the weights are equal only within a tolerance.  Measured (4 clients, missing 1):
# max |Δw| / max |w| = 1.0e-7 at d = 32 (fraction 0.08) and 3.6e-7 at d = 1024 (full data), metrics
# equal within 1e-7.  The check allows 1e-4 of the largest weight and 1e-3 on BACC, AUC and mAP.
CKKS_RELATIVE_WEIGHT_TOLERANCE = 1e-4
CKKS_METRIC_TOLERANCE = 1e-3


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


# --- secure-afl deploy local ---------------------------------------------------------------------


def _parse_drops(values: tuple[str, ...], client_ids: list[str], protection: str = "mask") -> dict[str, str]:
    from secure_afl.deploy.local import DROP_ROUNDS_BY_PROTECTION

    rounds = DROP_ROUNDS_BY_PROTECTION[protection]
    drops: dict[str, str] = {}
    for value in values:
        cid, sep, round_name = value.partition("@")
        if not sep or cid not in client_ids or round_name not in rounds:
            raise click.BadParameter(
                f"{value!r}: expected CLIENT@ROUND with CLIENT in {client_ids[0]}..{client_ids[-1]} and "
                f"ROUND one of {', '.join(rounds)} with --secure {protection} (e.g. client-2@R2)",
                param_hint="--drop",
            )
        if cid in drops:
            raise click.BadParameter(f"{cid} is dropped twice", param_hint="--drop")
        drops[cid] = round_name
    return drops


def _reference_dropouts(report: Mapping, participants: Collection[str]) -> dict[str, list[str]]:
    """From the server's report: the first round of session 1 each participant failed to answer."""
    first: dict[str, str] = {}
    events = [*report["dropouts"], *report["refusals"], *report["rejections"]]
    for event in sorted(events, key=lambda e: e["at"]):
        who = event.get("client", event.get("from"))
        if not event["at"].startswith("session 1 ") or who not in participants:
            continue
        first.setdefault(who, event["at"].split()[-1])
    dropouts: dict[str, list[str]] = {}
    for cid, round_name in first.items():
        dropouts.setdefault(round_name, []).append(cid)
    return dropouts


@click.group()
def deploy() -> None:
    """Deploy among institutions over Flower (SuperLink, SuperNodes)."""


@deploy.command("local")
@click.option(
    "--clients", type=click.IntRange(3, 8), default=4, show_default=True, help="SuperNodes (institutions)."
)
@click.option("--tls/--no-tls", default=False, show_default=True, help="TLS and SuperNode authentication.")
@click.option(
    "--drop",
    "drops",
    multiple=True,
    help="CLIENT@ROUND: kill that SuperNode at that protocol round (R1..R4; with ckks R1..R3, where "
    "R3 reaches only decryptors; a key holder killed at R1 is replaced by a re-election).",
)
@click.option(
    "--secure",
    type=click.Choice(["mask", "ckks"]),
    default="mask",
    show_default=True,
    help="How the statistics are protected: pairwise masking or CKKS encryption (TenSEAL); every "
    "institution's node config agrees to it.",
)
@ckks_degree_option
@click.option(
    "--missing", type=click.IntRange(0, 7), default=1, show_default=True, help="Classes withheld per client."
)
@click.option(
    "--rounds", type=click.IntRange(1, 2), default=1, show_default=True, help="2 adds the pseudo-label round."
)
@click.option("--gram", type=click.Choice(["global", "class"]), default="global", show_default=True)
@click.option("--balance", type=click.Choice(["client", "global"]), default=None,
              help="[default: client; global under --dp-epsilon, which needs it]")  # fmt: skip
@click.option("--gamma", type=float, default=1.0, show_default=True)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--fraction", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True)
@click.option(
    "--dim", type=click.IntRange(min=1), default=1024, show_default=True, help="Synthetic feature dimension."
)
@click.option("--round-timeout", type=click.FloatRange(1), default=30.0, show_default=True,
              help="Seconds after which a node that has not answered a round is a dropout.")  # fmt: skip
@click.option(
    "--out", "out_dir", type=click.Path(path_type=Path), default=Path("runs/deploy"), show_default=True
)
@click.option("--keep", is_flag=True, help="Keep the temporary directory (keys, logs, certificates).")
@dp_options
def deploy_local(
    clients: int,
    tls: bool,
    drops: tuple[str, ...],
    secure: str,
    ckks_degree: str,
    missing: int,
    rounds: int,
    gram: str,
    balance: str | None,
    gamma: float,
    seed: int,
    fraction: float,
    dim: int,
    round_timeout: float,
    out_dir: Path,
    keep: bool,
    dp_epsilon: float | None,
    dp_delta: float,
    clip: float,
    dp_unit: str,
    dp_max_images_per_patient: int,
) -> None:
    """A federation of N SuperNodes on this machine, compared with the in-process simulation.

    With --dp-epsilon the institutions noise their statistics before masking (SECURITY.md §9): the
    classifier then differs from any rerun, so it is compared with the simulation's non-private one
    (the price of privacy) instead of bit for bit.  The simulation is the masked one (exact to
    2^-32): with --secure mask the weights must be equal bit for bit, with --secure ckks within CKKS
    precision (CKKS_RELATIVE_WEIGHT_TOLERANCE).
    """
    import shutil
    import tempfile

    from rich.console import Console
    from rich.table import Table

    from secure_afl.deploy.errors import ConfigurationError
    from secure_afl.deploy.local import run_local
    from secure_afl.deploy.study import Method, StudyDp, deployment_threshold
    from secure_afl.features.file import save_feature_file
    from secure_afl.sim.data import CLASSES
    from secure_afl.sim.datasets import prepare
    from secure_afl.sim.metrics import evaluate
    from secure_afl.sim.partial import PartialLabelError, assign_partial_labels

    console = Console()
    say = console.print if console.is_terminal else (lambda text: click.echo(text))
    client_ids = [f"client-{k}" for k in range(clients)]
    drop_rounds = _parse_drops(drops, client_ids, secure)
    if dp_epsilon is not None and (balance == "client" or gram == "class"):
        raise click.UsageError(
            "--dp-epsilon needs --balance global and --gram global (plain sums and counts with clean "
            "sensitivities, SECURITY.md §9)"
        )
    balance = balance or ("global" if dp_epsilon is not None else "client")
    try:
        assignment = assign_partial_labels(clients, len(CLASSES), missing, seed=seed)
    except PartialLabelError as exc:
        raise click.BadParameter(str(exc), param_hint="--missing") from None
    try:
        study = Study(
            classes=CLASSES,
            dim=dim,
            backbone={
                "name": "embedded-synthetic",
                "weights_id": f"synthetic-seed-{seed}-dim-{dim}-fraction-{fraction}",
                "preprocessing": "none (synthetic features of the embedded ChestXray14 cohort)",
            },
            method=Method(gamma=gamma, balance=balance, gram=gram, rounds=rounds),
            protection=secure,
            ckks_degree=int(ckks_degree),
            dp=None
            if dp_epsilon is None
            else StudyDp(
                epsilon=dp_epsilon,
                delta=dp_delta,
                clip=clip,
                unit=dp_unit,
                max_images_per_patient=dp_max_images_per_patient,
                # the class lists are public under DP: every client sizes its noise from them
                class_lists={cid: tuple(assignment.active[k]) for k, cid in enumerate(client_ids)},
            ),
        )
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc)) from None
    live = [k for k, cid in enumerate(client_ids) if cid not in drop_rounds]
    # A client dropped after its upload (R3, R4) is still in the sums: only R1/R2 drops shrink a group.
    summed = [k for k, cid in enumerate(client_ids) if drop_rounds.get(cid) not in ("R1", "R2")]
    threshold = deployment_threshold(clients)
    if secure == "mask" and len(live) < threshold:
        raise click.UsageError(
            f"{len(live)} of {clients} institutions would remain, fewer than the threshold t={threshold} "
            f"(⌊2n/3⌋+1): drop fewer"
        )
    for c, name in enumerate(CLASSES):
        labelling = [client_ids[k] for k in summed if c in assignment.active[k]]
        if len(labelling) < study.min_group_size:
            raise click.UsageError(
                f"class {name} would be labelled by {len(labelling)} surviving institution(s) "
                f"{labelling}, fewer "
                f"than the minimum group size {study.min_group_size}: use a lower --missing or another --drop"
            )
    work_dir = Path(tempfile.mkdtemp(prefix="secure-afl-deploy-"))
    try:
        started = time.perf_counter()
        say(f"preparing the embedded data for {clients} institutions (as `secure-afl sim` partitions it)")
        data = prepare(None, fraction=fraction, dim=dim, seed=seed, n_clients=clients)
        (work_dir / "data").mkdir()
        client_data: dict[str, ClientData] = {}
        files = {}
        for k, cid in enumerate(client_ids):
            rows = data.split.clients[k]
            labels = data.cohort.labels[rows].astype(np.uint8)
            labels[:, [c for c in range(len(CLASSES)) if c not in assignment.active[k]]] = 0
            files[cid] = work_dir / "data" / f"{cid}.npz"
            save_feature_file(
                files[cid], data.features[rows], labels=labels, active=assignment.active[k], classes=CLASSES,
                backbone=study.backbone["name"], weights_id=study.backbone["weights_id"],
                preprocessing=study.backbone["preprocessing"],
                patient_ids=[str(p) for p in data.cohort.patient_ids[rows]],
            )  # fmt: skip
            client_data[cid] = (data.features[rows], labels, tuple(assignment.active[k]))
        data_seconds = time.perf_counter() - started
        say(
            f"  {len(data.split.test)} test rows; classes each institution labels: "
            f"{[list(a) for a in assignment.active]}"
        )
        try:
            result = run_local(
                work_dir, files, study, tls=tls, drops=drop_rounds, round_timeout=round_timeout, say=say
            )
        except DeploymentError as exc:
            raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
        session1 = result.report["sessions"][0]
        participants = session1["participants"]
        dropouts = _reference_dropouts(result.report, participants)
        say("computing the in-process simulation over the same survivors")
        reference = reference_classifier(
            {cid: client_data[cid] for cid in participants}, study, roster_size=clients, dropouts=dropouts
        )
        test_x, test_y = data.features[data.split.test], data.cohort.labels[data.split.test]
        # metrics rank the scores (logits), as the simulator's do
        deployed = evaluate(test_y, test_x.astype(np.float64) @ result.classifier.weights).macro
        simulated = evaluate(test_y, test_x.astype(np.float64) @ reference.coef).macro
        identical = result.classifier.weights.tobytes() == reference.coef.tobytes()
        same_survivors = tuple(session1["survivors"]) == reference.survivors
        private = study.dp is not None
        weight_error = float(np.max(np.abs(result.classifier.weights - reference.coef)))
        relative_error = weight_error / max(float(np.max(np.abs(reference.coef))), np.finfo(float).tiny)
        metric_error = max(abs(deployed[k] - simulated[k]) for k in ("bacc", "auc", "map"))
        table = Table(title=f"Deployment vs simulation over the same survivors {list(reference.survivors)}")
        table.add_column("metric")
        table.add_column(f"deployment (Flower{', DP' if private else ''})", justify="right")
        table.add_column(f"simulation (in-process{', no DP' if private else ''})", justify="right")
        for key, label, scale in (("bacc", "BACC %", 100), ("auc", "AUC %", 100), ("map", "mAP", 1)):
            table.add_row(label, f"{scale * deployed[key]:.4f}", f"{scale * simulated[key]:.4f}")
        console.print(table)
        digest = hashlib.sha256(result.classifier.weights.tobytes()).hexdigest()[:16]
        say(f"protection: {study.describe_protection()}")
        if private:
            for line in result.classifier.privacy_lines():
                say(line)
            say(f"weights (sha256 {digest}...): noisy, so not compared bit for bit with the simulation")
            agree = True
        elif secure == "mask":
            say(f"weights bit for bit equal: {'yes' if identical else 'NO'} (sha256 {digest}...)")
            agree = identical
        else:  # CKKS rounds the decrypted sums: equal within its precision, not bit for bit
            agree = relative_error <= CKKS_RELATIVE_WEIGHT_TOLERANCE and metric_error <= CKKS_METRIC_TOLERANCE
            say(
                f"weights equal within CKKS precision: {'yes' if agree else 'NO'} "
                f"(max |Δw| {weight_error:.3g}, {relative_error:.3g} of max |w|, "
                f"tolerance {CKKS_RELATIVE_WEIGHT_TOLERANCE:g}; "
                f"max |Δ metric| {metric_error:.3g}, tolerance {CKKS_METRIC_TOLERANCE:g})"
            )
            say(f"key holder: {session1.get('key_holder')}; decryptors: {session1.get('decryptors')}")
        say(f"killed: {result.killed or 'none'}; dropouts seen by the server: {dropouts or 'none'}")
        copies = {
            cid: _same_weights(path, result.classifier) for cid, path in result.node_classifiers.items()
        }
        say(f"classifier stored by {sorted(copies)}; identical copies: {all(copies.values())}")
        seconds = Table(title="Seconds per stage")
        seconds.add_column("stage")
        seconds.add_column("s", justify="right")
        seconds.add_row("data (embedded cohort, partition)", f"{data_seconds:.1f}")
        for name, value in result.seconds.items():
            seconds.add_row(name, f"{value:.1f}")
        for session in result.report["sessions"]:
            for round_name, value in session["round_seconds"].items():
                seconds.add_row(f"  session {session['label']} {round_name}", f"{value:.1f}")
        for name in ("solve", "deliver"):
            if name in result.report["seconds"]:
                seconds.add_row(f"  {name} (server)", f"{result.report['seconds'][name]:.2f}")
        seconds.add_row("simulation (in-process reference)", f"{reference.seconds:.1f}")
        console.print(seconds)
        out_dir.mkdir(parents=True, exist_ok=True)
        result.classifier.save(out_dir / "classifier.json")
        (out_dir / "report.json").write_text(
            json.dumps({**result.report, "local_seconds": result.seconds, "killed": result.killed}, indent=1)
        )
        say(f"wrote {out_dir / 'classifier.json'} and {out_dir / 'report.json'}")
        if not (agree and same_survivors):
            raise click.ClickException(
                "the deployed classifier differs from the simulation's over the same survivors"
            )
    finally:
        if keep:
            say(f"kept {work_dir}")
        else:
            shutil.rmtree(work_dir, ignore_errors=True)


def _same_weights(path: Path, classifier: object) -> bool:
    from secure_afl.deploy.classifier import Classifier

    return Classifier.load(path).weights.tobytes() == classifier.weights.tobytes()  # type: ignore[attr-defined]


# --- secure-afl predict ----------------------------------------------------------------------------


@click.command()
@click.option("--model", "model_path", type=click.Path(path_type=Path, dir_okay=False), required=True,
              help="The classifier file (classifier.json).")  # fmt: skip
@click.option("--features", "features_path", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="A feature file (secure-afl-features/v1).")  # fmt: skip
@click.option("--data-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="A directory of PNG images (features extracted with the model's backbone).")  # fmt: skip
@click.option("--weights", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="The backbone's weight file (with --data-dir; default: the library cache).")  # fmt: skip
@click.option("--cache-dir", type=click.Path(path_type=Path, file_okay=False), default=None)
@click.option("--device", default="auto", show_default=True)
@click.option("--out", "out_path", type=click.Path(path_type=Path, dir_okay=False),
              default=Path("predictions.csv"), show_default=True)  # fmt: skip
def predict(
    model_path: Path,
    features_path: Path | None,
    data_dir: Path | None,
    weights: Path | None,
    cache_dir: Path | None,
    device: str,
    out_path: Path,
) -> None:
    """Per-image probabilities and decisions of a classifier file, as CSV."""
    from secure_afl.deploy.classifier import Classifier
    from secure_afl.deploy.errors import ClassifierFileError, ModelMismatchError
    from secure_afl.features.file import FeatureFileError, load_feature_file

    if (features_path is None) == (data_dir is None):
        raise click.UsageError("give exactly one of --features FILE or --data-dir DIR")
    try:
        model = Classifier.load(model_path)
        if features_path is not None:
            data = load_feature_file(features_path)
            model.check_features(data.describe_backbone(), data.dim, data.classes)
            features, ids = data.features, data.image_ids
        else:
            features, ids = _extract_directory(model, data_dir, weights, cache_dir, device)  # type: ignore[arg-type]
        probabilities = model.predict_proba(features)
    except (ClassifierFileError, ModelMismatchError, FeatureFileError) as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
    model.write_predictions(out_path, ids, probabilities)
    for line in model.privacy_lines():
        click.echo(line)
    positives = (probabilities > model.decision_threshold).sum(axis=0)
    counts = ", ".join(f"{c} {int(n)}" for c, n in zip(model.classes, positives, strict=True))
    click.echo(f"wrote {out_path}: {len(ids)} images; positives per class: {counts}")


def _extract_directory(model, data_dir: Path, weights: Path | None, cache_dir: Path | None, device: str):
    from secure_afl.deploy.errors import ModelMismatchError
    from secure_afl.features.backbones import UnknownBackboneError, WeightsError, load_backbone
    from secure_afl.features.extraction import extract_features
    from secure_afl.features.file import describe_preprocessing
    from secure_afl.features.images import index_images

    try:
        backbone = load_backbone(model.backbone["name"], weights)
    except (UnknownBackboneError, WeightsError) as exc:
        raise ModelMismatchError(f"cannot load the model's backbone: {exc}") from None
    model.check_features(
        {"name": backbone.name, "weights_id": backbone.weights_id,
         "preprocessing": describe_preprocessing(backbone.preprocess)},
        backbone.feature_dim,
    )  # fmt: skip
    images = index_images(data_dir)
    if not images:
        raise ModelMismatchError(f"{data_dir}: no PNG images found")
    names = sorted(images)
    cache = cache_dir or Path.home() / ".cache" / "secure-afl" / "features"
    result = extract_features([images[n] for n in names], backbone, cache_dir=cache, device=device)
    keep = [i for i in range(len(names)) if i not in set(result.skipped)]
    return result.features[keep], [names[i] for i in keep]
