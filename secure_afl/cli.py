"""The ``secure-afl`` command."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

# Only torch-free modules here: `sim` starts preparing the embedded data on a thread before it
# imports torch and the training code (about two seconds), so that the two overlap.
from secure_afl.cli_options import (
    LibraryErrorsGroup,
    check_dp_mechanism_options,
    ckks_degree_option,
    dp_options,
    renamed_option,
    resolve_clip,
    resolve_dp_ridge,
    split_pair,
)
from secure_afl.sim.data import CLASSES, N_CLIENTS, CohortError
from secure_afl.sim.datasets import DataRequest, ImageSource, PreparingData
from secure_afl.sim.methods import FEDNCA, MISSING_ALL, SCHEDULES, BaselineError, parse_baselines
from secure_afl.sim.partial import PartialLabelError

if TYPE_CHECKING:
    from secure_afl.sim.setting import SimConfig


@contextlib.contextmanager
def _imports_without_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while a block imports torch and the training code.

    Importing allocates hundreds of thousands of long-lived objects, so the collector runs hundreds
    of times and finds nothing to free: about 0.4 CPU-seconds of ``sim``'s start-up, taken from the
    data being prepared beside it.  The collector's previous state is restored on leaving.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _parse_missing(value: str) -> tuple[int, ...]:
    if value == "all":
        return MISSING_ALL
    levels = []
    for part in value.split(","):
        try:
            levels.append(int(part))
        except ValueError:
            raise click.BadParameter(f"{part!r} is not a missing level; use 1, 3, 5, 7 or 'all'") from None
    for level in levels:
        if not 0 <= level < len(CLASSES):
            raise click.BadParameter(
                f"unknown missing level {level}: use 1, 3, 5, 7 or 'all' (any integer 0..{len(CLASSES) - 1})"
            )
    return tuple(dict.fromkeys(levels))  # each setting once, in the order given


def _parse_baselines(value: str) -> tuple[str, ...]:
    parts = [p.strip() for p in value.split(",") if p.strip()]
    nca = [FEDNCA for p in parts if p.lower() == FEDNCA.lower()]
    try:
        table2 = parse_baselines(",".join(p for p in parts if p.lower() != FEDNCA.lower()))
    except BaselineError as exc:
        raise click.BadParameter(f"{exc}; or {FEDNCA}") from None
    return (*table2, *dict.fromkeys(nca))


# The sim's errors that are the user's to fix (printed as one line), by module: only the modules
# already imported are looked at, because an error class whose module never loaded cannot have been
# raised, and the ``except`` clause naming them runs for every exception, Ctrl-C included (importing
# them all there cost 2–3 s: torchvision, then torch._dynamo).
_SIM_ERRORS = {
    "secure_afl.privacy.dp": ("DpError",),
    "secure_afl.sim.fednca": ("FedNCAError",),
    "secure_afl.sim.runner": ("ExperimentError",),
    "secure_afl.analytic": ("StatisticsError",),
    "secure_afl.features.backbones": ("WeightsError", "UnknownBackboneError"),
    "secure_afl.features.images": ("ImagesNotFoundError", "CorruptImageError"),
}


def _sim_errors() -> tuple[type[Exception], ...]:
    loaded = [
        getattr(module, name)
        for module_name, names in _SIM_ERRORS.items()
        if (module := sys.modules.get(module_name)) is not None
        for name in names
    ]
    return (PartialLabelError, CohortError, *loaded)


class _LazyGroup(LibraryErrorsGroup):
    """A group whose listed subcommands are imported only when they run or help lists them.

    ``sim`` starts preparing its data as soon as its options are parsed; importing the deployment
    and the key commands first (the protocol, cryptography, Flower's helpers) would delay it.
    """

    def __init__(self, *args: object, lazy: dict[str, str], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._lazy = lazy  # command name -> "module:attribute"

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self._lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self._lazy:
            module, _, attribute = self._lazy[cmd_name].partition(":")
            return getattr(importlib.import_module(module), attribute)
        return super().get_command(ctx, cmd_name)


@click.group(
    cls=_LazyGroup,
    lazy={
        "keys": "secure_afl.cli_keys:keys",
        "audit": "secure_afl.cli_audit:audit",
        "deploy": "secure_afl.cli_deploy:deploy",
        "predict": "secure_afl.cli_deploy:predict",
        "features": "secure_afl.cli_features:features",
    },
)
@click.version_option(package_name="secure-afl")
def main() -> None:
    """Privacy-hardened one-round analytic federated learning."""


@main.command()
@click.option(
    "--missing",
    default="7",
    show_default=True,
    callback=lambda ctx, param, value: _parse_missing(value),
    help="Classes withheld per client: 1, 3, 5, 7, a comma list, or 'all'.",
)
@click.option(
    "--rounds", type=click.IntRange(1, 2), default=2, show_default=True, help="2 adds the pseudo-label round."
)
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Seeds the split, clients, label assignment, features and FedAvg.",
)
@click.option("--gamma", type=float, default=1.0, show_default=True, help="Ridge regularisation γ.")
@click.option(
    "--split",
    "split_by",
    type=click.Choice(["image", "patient"]),
    default="image",
    show_default=True,
    help="70/30 split image-wise (as the paper) or patient-wise (no leakage).",
)
@click.option(
    "--missing1-draw",
    "missing1",
    type=click.Choice(["permutation", "random"]),
    default="permutation",
    show_default=True,
    help="Missing 1: withheld classes a random permutation (every class labelled by 7 clients, as the "
    "paper) or the earlier random draw with coverage (|S_c| 3..8 by seed).",
)
@renamed_option(
    "--protection",
    old_names=("--secure",),
    type=click.Choice(["none", "mask", "ckks", "mask,ckks"]),
    default="mask",
    show_default=True,
    help="How client statistics are protected on their way to the server: pairwise masking, CKKS "
    "encryption (TenSEAL), or both side by side (the first fits the reported models). The deploy "
    "commands take the same --protection.",
)
@ckks_degree_option
@click.option(
    "--dropout",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Clients that drop out, drawn at random from --seed, at --dropout-stage. (deploy local "
    "--drop CLIENT@ROUND instead kills a named SuperNode at a round: its R1..R3 are these stages, its "
    "R4 the unmasking.)",
)
@click.option(
    "--dropout-stage",
    type=click.Choice(["R1", "R2", "R3"]),
    default="R2",
    show_default=True,
    help="R1: before sharing keys; R2: before sending the masked input; R3: after it (input still counts).",
)
@click.option(
    "--threshold",
    type=click.IntRange(min=1),
    default=None,
    help="Shamir threshold t of the masking protocol (default: a majority, n//2 + 1).",
)
@click.option(
    "--min-group-size",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Never unmask a group with fewer survivors (the simulator allows 1, with a loud audit line).",
)
@click.option(
    "--client-policy",
    type=click.Choice(["simulator", "deployment"]),
    default="simulator",
    show_default=True,
    help="deployment: also report, per method, which clients under the deployment policy (t >= 2n/3+1, "
    "groups >= 2, refuse sums that isolate a client) would refuse its layout, and why. The run's own "
    "clients always use the simulator policy (go on, report), so the metrics do not change.",
)
@click.option(
    "--fraction",
    type=click.FloatRange(0, 1, min_open=True),
    default=1.0,
    show_default=True,
    help="Use this random fraction of the rows.",
)
@click.option(
    "--dim", type=click.IntRange(min=1), default=1024, show_default=True, help="Synthetic feature dimension."
)
@click.option(
    "--schedule",
    type=click.Choice(sorted(SCHEDULES)),
    default="paper",
    show_default=True,
    help="Rounds of FedAvg and the --baselines: paper = 50 (each method's stage boundaries scaled by "
    "50/500 so that every stage runs), reference = FedMLP's code's own 500 (a long run).",
)
@click.option(
    "--fedavg-rounds",
    type=click.IntRange(min=1),
    default=None,
    help="Rounds of FedAvg and of the --baselines instead of the schedule's (stage boundaries scale "
    "with rounds/500).",
)
@click.option(
    "--baselines",
    default="",
    callback=lambda ctx, param, value: _parse_baselines(value),
    help="Extra gradient methods after FedAvg, a comma list: Table II's RSCFed,FedFixMatch,FedIRM,"
    "CBAFed,FedLSR,FedNoRo,FedMLP ('all' = these seven), and fednca-ml (FedNCA-ML on spatial tokens).",
)
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda.")
@click.option(
    "--dataset",
    type=click.Choice(["embedded", "nih"]),
    default="embedded",
    show_default=True,
    help="embedded: real labels with synthetic features; nih: ChestXray14 images under --data-dir.",
)
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="ChestXray14 images: images_001/images/*.png ... or a flat images/ folder.",
)
@click.option(
    "--csv",
    "csv_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Label table (default: bundled).",
)
@renamed_option(
    "--backbone",
    "backbones",
    old_names=("--backbones",),
    default="densenet121-xrv",
    show_default=True,
    help="Backbone, or a comma list for the Table III loop (resnet18,vgg11,efficientnet_b0,...).",
)
@click.option(
    "--weights",
    "weights",
    multiple=True,
    metavar="[NAME=]FILE",
    help="Weight file (FILE, or NAME=FILE per backbone; repeatable). Default: the library cache file.",
)
@click.option(
    "--cache-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="Feature cache (default: ~/.cache/secure-afl/features).",
)
@click.option(
    "--batch-size", type=click.IntRange(min=1), default=64, show_default=True, help="Images per forward pass."
)
@click.option(
    "--workers",
    type=click.IntRange(min=0),
    default=None,
    help="DataLoader workers (default: CPUs, at most 8).",
)
@click.option("--amp/--no-amp", default=False, show_default=True, help="Mixed precision forward pass (CUDA).")
@dp_options
@click.option(
    "--dp-sweep",
    is_flag=True,
    help="Instead of one run: BACC and AUC against ε ∈ {0.5, 1, 2, 4, 8, ∞} per --missing level, for "
    "today's mechanism (d dims, split class sums, bound ridge) and another side by side: the one "
    "--dp-dim/--dp-ridge/--dp-class-sums describe, else the positive class sums; writes dp_sweep.png "
    "and dp_sweep.json under --out.",
)
@click.option(
    "--scenario",
    type=click.Choice(["partial-labels", "mixed-type", "growing", "multisite"]),
    default="partial-labels",
    show_default=True,
    help="partial-labels: the paper's experiment; mixed-type: FedMT's setting (fine-labelled centre, "
    "coarse-labelled clients; see secure_afl/sim/mixed_type.py); growing: each client's rows arrive "
    "over --sessions sessions and the server accumulates them (secure_afl/sim/growing.py); multisite: "
    "seven public collections as sites, each labelling what its table labels (secure_afl/sim/multisite.py).",
)
@click.option(
    "--sites",
    default="all",
    show_default=True,
    help="multisite: a comma list of nih,chexpert,padchest,vindr,rsna,siim,google, or 'all'.",
)
@click.option(
    "--classes",
    "class_list",
    default="paper",
    show_default=True,
    help="multisite: 'paper' (the 8 classes), 'all' (torchxrayvision's 18 default pathologies some "
    "site labels) or a comma list of their names.",
)
@click.option(
    "--site-shift",
    type=click.FloatRange(min=0),
    default=0.1,
    show_default=True,
    help="multisite: the standard deviation of each site's pre-activation shift of the synthetic "
    "features (0: none).",
)
@click.option(
    "--site-dir",
    "site_dirs",
    multiple=True,
    metavar="SITE=DIR",
    help="multisite on real images: the directory of a site's images, as its collection lays them out "
    "(repeatable, one per site of --sites); with --backbone, --weights, --cache-dir.",
)
@click.option(
    "--sessions",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="growing: the number of sessions each client's training rows arrive in.",
)
@click.option(
    "--idle",
    "idle",
    multiple=True,
    metavar="SESSION:CLIENT",
    help="growing: client CLIENT (0..7) has no new rows in session SESSION (from 1); repeatable.",
)
@click.option(
    "--centre-n",
    default="5,20,80",
    show_default=True,
    help="mixed-type: fine-labelled images per class at the centre (comma list, one run each).",
)
@click.option(
    "--xi",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    default=0.9,
    show_default=True,
    help="mixed-type: FedMT's confidence threshold for estimating M.",
)
@click.option(
    "--fedmt-rounds",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="mixed-type: FedMT rounds.",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(path_type=Path),
    default=Path("runs/sim"),
    show_default=True,
    help="Where results.json and report.md are written.",
)
@click.option(
    "--verbose",
    is_flag=True,
    help="Print the full report (every group and client check of the privacy audit, the costs per "
    "protocol round, the seconds) instead of the table and a short, aggregated summary.",
)
def sim(**options: Any) -> None:
    """Run the paper's ChestXray14 experiment (Table II; Table III over several backbones).

    With --scenario mixed-type: FedMT's setting instead (the centre alone, FedMT with M known and
    estimated, and the one-round analytic counterpart), over the --centre-n sweep.  With --scenario
    growing: each client's rows arrive over --sessions sessions, each released through --protection and
    accumulated by the server; every session's classifier is compared with the centralised fit
    (under --dp-epsilon: the noisy sums accumulate and every session's ε is recorded).
    """
    _check_device(options["device"])
    _check_writable(options["out_dir"])
    dp = _dp_config(options)
    names = [b.strip() for b in options["backbones"].split(",") if b.strip()]
    given = click.get_current_context().get_parameter_source
    scenario = options["scenario"]
    for option_names, (needs, flags) in _SCENARIO_OPTIONS.items():  # a scenario's options, only there
        if scenario != needs and any(given(o) is not ParameterSource.DEFAULT for o in option_names):
            raise click.UsageError(f"{flags} need --scenario {needs}")
    _SCENARIOS[scenario](Console(), options, dp, names)


# option names (as click passes them) -> the scenario they belong to, and their flags
_SCENARIO_OPTIONS = {
    ("sites", "class_list", "site_shift", "site_dirs"): (
        "multisite",
        "--sites, --classes, --site-shift and --site-dir",
    ),
    ("sessions", "idle"): ("growing", "--sessions and --idle"),
}


def _check_device(device: str) -> None:
    if device not in ("auto", "cpu"):  # these two are always valid; checking others imports torch
        from secure_afl.analytic import resolve_device

        try:
            resolve_device(device)
        except (ValueError, RuntimeError) as exc:
            raise click.BadParameter(str(exc), param_hint="--device") from exc


def _dp_config(o: dict[str, Any]) -> Any:
    """The DP mechanism ``--dp-epsilon`` (or ``--dp-sweep``) asks for, checked; None without DP."""
    check_dp_mechanism_options(
        o["dp_epsilon"] is not None or o["dp_sweep"], o["dp_dim"], o["dp_ridge"], o["dp_projection_seed"],
        o["dp_class_sums"], o["dp_row_centre"],
    )  # fmt: skip
    if o["dp_epsilon"] is None and not o["dp_sweep"]:
        return None
    from secure_afl.privacy.dp import DpConfig, DpError

    # The sweep compares today's mechanism with another: unless one is described, the centred
    # rows with positive class sums.
    unchanged = o["dp_dim"] is None and o["dp_ridge"] is None and o["dp_class_sums"] is None
    if o["dp_sweep"] and unchanged and not o["dp_row_centre"]:
        o["dp_class_sums"], o["dp_row_centre"] = "positives", True
    dp = DpConfig(
        epsilon=1.0 if o["dp_epsilon"] is None else o["dp_epsilon"],
        delta=o["dp_delta"],
        clip=resolve_clip(o["clip"], o["dp_row_centre"]),
        unit=o["dp_unit"],
        max_images_per_patient=o["dp_max_images_per_patient"],
        projection_dim=o["dp_dim"],
        projection_seed=o["dp_projection_seed"],
        ridge=resolve_dp_ridge(o["dp_ridge"], o["dp_dim"]),  # type: ignore[arg-type]
        class_sums=o["dp_class_sums"] or "split",
        row_centre=o["dp_row_centre"],
    )
    try:
        dp.validate()
        if o["dataset"] != "nih":  # the embedded data's dimension is --dim (real features: once known)
            dp.statistics_dim(o["dim"])
    except DpError as exc:
        raise click.BadParameter(str(exc)) from exc
    return dp


def _image_sources(o: dict[str, Any], names: list[str]) -> list[ImageSource | None]:
    """One image source per backbone with ``--dataset nih``; [None] (the embedded data) otherwise."""
    if o["dataset"] != "nih":
        if len(names) > 1 or o["weights"] or o["data_dir"]:
            raise click.UsageError("--backbone, --weights and --data-dir need --dataset nih")
        return [None]
    if o["data_dir"] is None:
        raise click.UsageError("--dataset nih needs --data-dir DIR (the unpacked ChestXray14 images)")
    weight_files = _parse_weights(o["weights"], names)
    return [
        ImageSource(
            data_dir=o["data_dir"],
            backbone=name,
            weights=weight_files.get(name),
            csv=o["csv_path"],
            cache_dir=o["cache_dir"],
            device=o["device"],
            batch_size=o["batch_size"],
            num_workers=o["workers"],
            amp=o["amp"],
        )
        for name in names
    ]


def _gradient_schedule(o: dict[str, Any]) -> tuple[int, str]:
    """FedAvg's and the baselines' rounds, and the schedule's name ("custom" for another count)."""
    rounds = SCHEDULES[o["schedule"]] if o["fedavg_rounds"] is None else o["fedavg_rounds"]
    return rounds, o["schedule"] if rounds == SCHEDULES[o["schedule"]] else "custom"


def _sim_config_options(o: dict[str, Any]) -> dict[str, Any]:
    """The options every scenario's SimConfig takes, by its field names."""
    return dict(
        missing=o["missing"], rounds=o["rounds"], seed=o["seed"], gamma=o["gamma"], split=o["split_by"],
        missing1=o["missing1"], secure=o["protection"], ckks_poly_degree=int(o["ckks_degree"]),
        dropout=o["dropout"], dropout_stage=o["dropout_stage"], threshold=o["threshold"],
        min_group_size=o["min_group_size"], client_policy=o["client_policy"], fraction=o["fraction"],
        dim=o["dim"], device=o["device"],
    )  # fmt: skip


def _run_paper(console: Console, o: dict[str, Any], dp: Any, names: list[str]) -> None:
    """The paper's experiment (Table II; Table III over several backbones), or the DP sweep."""
    sources = _image_sources(o, names)
    gradient_rounds, schedule_name = _gradient_schedule(o)
    progress = _ProgressBars(console)
    preparing = None
    if sources == [None] and not o["dp_sweep"]:
        request = DataRequest(o["fraction"], o["dim"], o["seed"], N_CLIENTS, o["split_by"])
        preparing = PreparingData(request, progress)
    try:
        if preparing is not None:
            preparing.wait_for_cohort()  # its parsing and our imports both need the GIL: one after the other
        with _imports_without_gc():
            from secure_afl.sim.baselines import BaselineConfig
            from secure_afl.sim.fedavg import FedAvgConfig
            from secure_afl.sim.report import (
                FIGURE,
                print_backbone_table,
                print_report,
                write_backbone_table,
                write_reports,
            )
            from secure_afl.sim.runner import run_experiment
            from secure_afl.sim.setting import SimConfig

        results = []
        seed, out_dir = o["seed"], o["out_dir"]
        for source in sources:
            config = SimConfig(
                **_sim_config_options(o),
                images=source,
                fedavg=dataclasses.replace(FedAvgConfig(), rounds=gradient_rounds, seed=seed),
                baselines=o["baselines"],
                dp=dp,
                baseline=dataclasses.replace(
                    BaselineConfig(), rounds=gradient_rounds, seed=seed, schedule=schedule_name
                ),
            )
            if o["dp_sweep"]:
                _run_sweep(config, out_dir, console, resolve_clip(o["clip"], False))
                return
            try:
                result = run_experiment(config, progress=progress, preparing=preparing)
            except _sim_errors() as exc:
                raise click.ClickException(str(exc)) from exc
            where = out_dir if len(sources) == 1 else out_dir / source.backbone  # type: ignore[union-attr]
            if len(sources) == 1:
                print_report(result, console, verbose=o["verbose"])
            json_path, md_path = write_reports(result, where)
            written = [json_path, md_path] + ([where / FIGURE] if len(result.settings) > 1 else [])
            for path in written:  # one a line: the default report keeps to SUMMARY_WIDTH columns
                console.print(f"wrote {path}", markup=False, highlight=False, width=_report_width(console))
            results.append(result)
    except BaseException:
        if preparing is not None:
            preparing.cancel()  # Ctrl-C or an error: the feature thread stops at its next chunk
        raise
    if len(sources) > 1:
        print_backbone_table(results, console)
        console.print(f"wrote {write_backbone_table(results, out_dir)}")


def _report_width(console: Console) -> int:
    from secure_afl.sim.report import SUMMARY_WIDTH

    return min(console.width, SUMMARY_WIDTH)


def _run_sweep(config: SimConfig, out_dir: Path, console: Console, baseline_clip: float) -> None:
    from secure_afl.sim.dp_sweep import run_dp_sweep, write_sweep

    try:
        config.validate()
        sweep = run_dp_sweep(config, progress=_ProgressBars(console), baseline_clip=baseline_clip)
    except _sim_errors() as exc:
        raise click.ClickException(str(exc)) from exc
    for p in sweep["points"]:  # type: ignore[union-attr]
        eps = "∞" if p["epsilon"] is None else f"{p['epsilon']:g}"
        ridge = "" if p.get("ridge") is None else f"  λ {p['ridge']:.4g}"
        console.print(
            f"missing {p['missing']}  ε {eps:>4}  {p['method']} [{p.get('mechanism', '')}]: "
            f"BACC {100 * p['bacc']:.2f}  AUC {100 * p['auc']:.2f}  mAP {p['map']:.4f}{ridge}",
            markup=False,
            highlight=False,
            soft_wrap=True,  # one line per point, whatever the terminal's width
        )
    json_path, png_path = write_sweep(sweep, out_dir)
    console.print(f"wrote {json_path} and {png_path}")


def _parse_idle(values: tuple[str, ...]) -> tuple[tuple[int, int], ...]:
    out = []
    for value in values:
        session, sep, client = value.partition(":")
        try:
            if not sep:
                raise ValueError
            out.append((int(session), int(client)))
        except ValueError:
            raise click.BadParameter(
                f"{value!r} is not SESSION:CLIENT (e.g. 2:3: client 3 has no new rows in session 2)",
                param_hint="--idle",
            ) from None
    return tuple(dict.fromkeys(out))


def _scenario_growing(console: Console, o: dict[str, Any], dp: Any, names: list[str]) -> None:
    sources = _image_sources(o, names)
    if len(sources) != 1:
        raise click.UsageError("--scenario growing runs one backbone at a time")
    if o["dp_sweep"] or o["baselines"]:
        raise click.UsageError("--dp-sweep and --baselines are not run with --scenario growing")
    options = _sim_config_options(o)
    del options["dropout_stage"], options["client_policy"]
    if click.get_current_context().get_parameter_source("rounds") is ParameterSource.DEFAULT:
        options["rounds"] = 1  # round 2 is refused in a growing study (secure_afl/sim/growing.py says why)
    _run_growing(console, sessions=o["sessions"], idle=_parse_idle(o["idle"]), out_dir=o["out_dir"],
                 images=sources[0], dp=dp, **options)  # fmt: skip


def _scenario_multisite(console: Console, o: dict[str, Any], dp: Any, names: list[str]) -> None:
    if dp is not None or o["dataset"] != "embedded" or o["data_dir"] is not None or o["csv_path"] is not None:
        raise click.UsageError(
            "--scenario multisite reads the label tables shipped with torchxrayvision and, for real "
            "images, --site-dir per site; --dp-epsilon, --dp-sweep, --dataset, --data-dir and --csv do "
            "not apply"
        )
    if len(names) != 1:
        raise click.UsageError("--scenario multisite runs one backbone at a time")
    gradient_rounds, schedule = _gradient_schedule(o)
    options = _sim_config_options(o)
    del options["missing"], options["split"], options["missing1"]
    _run_multisite(
        console, out_dir=o["out_dir"], sites=o["sites"], classes=o["class_list"], site_shift=o["site_shift"],
        site_dirs=o["site_dirs"], backbone=names[0], weights=o["weights"], cache_dir=o["cache_dir"],
        batch_size=o["batch_size"], workers=o["workers"], amp=o["amp"], gradient_rounds=gradient_rounds,
        schedule=schedule, baselines=o["baselines"], **options,
    )  # fmt: skip


def _scenario_mixed_type(console: Console, o: dict[str, Any], dp: Any, names: list[str]) -> None:
    sources = _image_sources(o, names)
    if len(sources) != 1:
        raise click.UsageError("--scenario mixed-type runs one backbone at a time")
    if dp is not None:
        raise click.UsageError("--dp-epsilon and --dp-sweep are not supported with --scenario mixed-type")
    _run_mixed_type(
        console, source=sources[0], centre_n=_parse_centre_n(o["centre_n"]), seed=o["seed"], gamma=o["gamma"],
        split=o["split_by"], secure=o["protection"], threshold=o["threshold"],
        min_group_size=o["min_group_size"], fraction=o["fraction"], dim=o["dim"], xi=o["xi"],
        rounds=o["fedmt_rounds"], dropout=o["dropout"], out_dir=o["out_dir"],
    )  # fmt: skip


def _run_growing(
    console: Console, *, sessions: int, idle: tuple[tuple[int, int], ...], out_dir: Path, **options
) -> None:
    from secure_afl.sim.growing import GrowingConfig, print_growing_report, run_growing, write_growing_reports
    from secure_afl.sim.setting import SimConfig

    try:
        config = GrowingConfig(sim=SimConfig(**options), sessions=sessions, idle=idle)
        result = run_growing(config, progress=_ProgressBars(console))
    except _sim_errors() as exc:
        raise click.ClickException(str(exc)) from exc
    print_growing_report(result, console)
    for path in write_growing_reports(result, out_dir):
        console.print(f"wrote {path}", markup=False, highlight=False, width=_report_width(console))


def _run_multisite(
    console: Console,
    *,
    out_dir: Path,
    sites: str,
    classes: str,
    site_shift: float,
    site_dirs: tuple[str, ...],
    backbone: str,
    weights: tuple[str, ...],
    cache_dir: Path | None,
    batch_size: int,
    workers: int | None,
    amp: bool,
    gradient_rounds: int,
    schedule: str,
    **sim: object,
) -> None:
    from secure_afl.sim.baselines import BaselineConfig
    from secure_afl.sim.fedavg import FedAvgConfig
    from secure_afl.sim.multisite import (
        SITE_KEYS,
        MultisiteConfig,
        MultisiteError,
        print_multisite_report,
        run_multisite,
        write_multisite_reports,
    )
    from secure_afl.sim.setting import SimConfig

    keys = SITE_KEYS if sites == "all" else tuple(k.strip() for k in sites.split(",") if k.strip())
    pairs = [split_pair(item, "--site-dir", "SITE=DIR", "nih=/data/chestxray14") for item in site_dirs]
    dirs = [(site, Path(path)) for site, path in pairs]
    images = None
    if dirs:
        weight_files = _parse_weights(weights, [backbone])
        images = ImageSource(
            data_dir=dirs[0][1],  # unused: every site has its own directory
            backbone=backbone,
            weights=weight_files.get(backbone),
            cache_dir=cache_dir,
            device=str(sim["device"]),
            batch_size=batch_size,
            num_workers=workers,
            amp=amp,
        )
    elif weights:
        raise click.UsageError("--weights needs real images (--site-dir)")
    seed = int(sim["seed"])  # type: ignore[call-overload]
    config = MultisiteConfig(
        sim=SimConfig(
            **sim,  # type: ignore[arg-type]
            fedavg=dataclasses.replace(FedAvgConfig(), rounds=gradient_rounds, seed=seed),
            baseline=dataclasses.replace(
                BaselineConfig(), rounds=gradient_rounds, seed=seed, schedule=schedule
            ),
        ),
        sites=keys,
        classes=classes,
        site_shift=site_shift,
        site_dirs=tuple(dirs),
        images=images,
    )
    try:
        result = run_multisite(config, progress=_ProgressBars(console))
    except (MultisiteError, *_sim_errors()) as exc:
        raise click.ClickException(str(exc)) from exc
    print_multisite_report(result, console)
    for path in write_multisite_reports(result, out_dir):
        console.print(f"wrote {path}", markup=False, highlight=False)


def _parse_centre_n(value: str) -> tuple[int, ...]:
    sizes = []
    for part in value.split(","):
        try:
            sizes.append(int(part))
        except ValueError:
            raise click.BadParameter(f"{part!r} is not a number of images", param_hint="--centre-n") from None
    if any(n < 1 for n in sizes):
        raise click.BadParameter("every centre size must be at least 1", param_hint="--centre-n")
    return tuple(sorted(set(sizes)))


def _run_mixed_type(
    console: Console, *, source: ImageSource | None, dropout: int, out_dir: Path, **options
) -> None:
    from secure_afl.sim.mixed_type import (
        FedMTConfig,
        MixedTypeConfig,
        MixedTypeError,
        print_mixed_type_report,
        run_mixed_type,
        write_mixed_type_reports,
    )

    if dropout:
        raise click.UsageError("--dropout is not supported with --scenario mixed-type")
    xi, rounds, seed = options.pop("xi"), options.pop("rounds"), options["seed"]
    config = MixedTypeConfig(images=source, fedmt=FedMTConfig(rounds=rounds, xi=xi, seed=seed), **options)
    try:
        result = run_mixed_type(config, progress=_ProgressBars(console))
    except (MixedTypeError, *_sim_errors()) as exc:
        raise click.ClickException(str(exc)) from exc
    print_mixed_type_report(result, console)
    paths = write_mixed_type_reports(result, out_dir)
    console.print(f"wrote {', '.join(str(p) for p in paths)}")


def _check_writable(out_dir: Path) -> None:
    """Fail before the experiment, not after it, when the results cannot be written."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise click.BadParameter(
            f"cannot create {out_dir}: {exc.strerror or exc}", param_hint="--out"
        ) from exc
    if not os.access(out_dir, os.W_OK):
        raise click.BadParameter(f"{out_dir} is not writable", param_hint="--out")


def _parse_weights(values: tuple[str, ...], backbones: list[str]) -> dict[str, Path]:
    """``FILE`` (one backbone) or ``NAME=FILE`` entries, checked against the backbones asked for."""
    out: dict[str, Path] = {}
    for value in values:
        if "=" not in value:
            if len(backbones) != 1:
                raise click.BadParameter(
                    f"{value!r}: with several backbones give --weights NAME=FILE for each",
                    param_hint="--weights",
                )
            name, path = backbones[0], value
        else:
            name, path = split_pair(value, "--weights", "NAME=FILE", "resnet18=resnet18.pt")
        if name not in backbones:
            raise click.BadParameter(
                f"{name!r} is not among the backbones {backbones}", param_hint="--weights"
            )
        out[name] = Path(path)
    return out


class _ProgressBars:
    """Progress of the long phases; a bar is shown only while its task runs (other bars may follow)."""

    def __init__(self, console: Console) -> None:
        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            disable=not console.is_terminal,
        )
        self._tasks: dict[str, int] = {}
        self._live = False

    def __call__(self, task: str, done: int, total: int) -> None:
        if task not in self._tasks:
            self._tasks[task] = self._bar.add_task(task, total=total)
            if not self._live:
                self._bar.start()
                self._live = True
        self._bar.update(self._tasks[task], completed=done)
        if done >= total:
            self._bar.remove_task(self._tasks.pop(task))
            if not self._bar.tasks:
                self._bar.stop()
                self._live = False


# --scenario -> the function that runs it
_SCENARIOS = {
    "partial-labels": _run_paper,
    "mixed-type": _scenario_mixed_type,
    "growing": _scenario_growing,
    "multisite": _scenario_multisite,
}
