"""``secure-afl features ...``: a hospital's images -> its feature file, and what a feature file holds.

- ``features extract``: reads the images (ChestXray14 with its label table, or a plain folder with an
  optional labels CSV) and a local weight file, runs the frozen backbone through the resumable
  feature cache (:func:`secure_afl.features.extraction.extract_features`) and writes the feature file
  of :mod:`secure_afl.features.file` (``secure-afl-features/v1``) atomically.
- ``features show``: prints what a feature file holds, including the strings a study must match.

The labels CSV of ``--images`` mode is read by :func:`secure_afl.features.labels.read_labels_csv`;
a malformed one raises :class:`~secure_afl.features.labels.LabelsCsvError` before anything is
computed or written.  Importing this module loads neither torch nor the backbones, so ``--help`` is
quick: they are imported when ``extract`` runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import numpy as np

from secure_afl.cli_options import renamed_option
from secure_afl.features.build import ExtractionInput, FeatureBuildError, write_extracted
from secure_afl.features.file import (
    FEATURE_FILE_FORMAT,
    REEXTRACT_ADVICE,
    FeatureFile,
    FeatureFileError,
    load_feature_file,
)
from secure_afl.features.labels import (
    IMAGE_COLUMN,
    PATIENT_COLUMN,
    LabelsCsvError,
    file_digest,
    read_labels_csv,
)
from secure_afl.sim.data import CLASSES

__all__ = ["features"]

NIH_TABLES = ("Data_Entry_2017_v2020.csv", "Data_Entry_2017.csv")  # looked for in --data-dir
BACKBONES_HELP = (
    "densenet121-xrv (TorchXRayVision, 1024-d), resnet18|34|50|101|152, vgg11|13|16|19, "
    "efficientnet_b0 ... efficientnet_b7 (torchvision ImageNet)"
)


def _parse_names(value: str | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    return tuple(dict.fromkeys(part.strip() for part in value.split(",") if part.strip()))


def _nih_input(data_dir: Path, csv_path: Path | None, view: str) -> ExtractionInput:
    from secure_afl.features.images import resolve_image_paths
    from secure_afl.sim.data import load_cohort

    if not data_dir.is_dir():
        raise click.BadParameter(f"{data_dir} is not a directory", param_hint="--data-dir")
    if csv_path is None:
        csv_path = next((data_dir / n for n in NIH_TABLES if (data_dir / n).is_file()), None)
    cohort = load_cohort(csv_path, view=view)
    names = [str(n) for n in cohort.image_names]
    found = resolve_image_paths(data_dir, names)
    missing = set(found.missing_names)
    keep = np.flatnonzero([name not in missing for name in names])
    cohort = cohort.subset(keep)
    notes = [f"label table {cohort.source}: {len(names)} {view} images"]
    if missing:
        notes.append(
            f"{len(missing)} {view} images of the label table are not under {data_dir} and were left out "
            f"(e.g. {sorted(missing)[0]})"
        )
    return ExtractionInput(
        paths=list(found.paths),
        image_ids=[str(n) for n in cohort.image_names],
        classes=CLASSES,
        labels=np.asarray(cohort.labels, dtype=np.uint8),
        labelled=CLASSES,
        patient_ids=[str(p) for p in cohort.patient_ids],
        source=f"ChestXray14 under {data_dir}",
        notes=notes,
    )


def _folder_input(images_dir: Path, labels_csv: Path | None, classes: tuple[str, ...]) -> ExtractionInput:
    if not images_dir.is_dir():
        raise click.BadParameter(f"{images_dir} is not a directory", param_hint="--images")
    from secure_afl.features.images import NoImagesError, list_images

    if labels_csv is None:
        paths = list_images(images_dir)  # NoImagesError (the extensions looked for) when there is none
        return ExtractionInput(
            paths=paths,
            image_ids=[p.name for p in paths],
            classes=classes,
            labels=None,
            labelled=(),
            patient_ids=None,
            source=f"the images in {images_dir} (no labels: a prediction-only file)",
        )
    table = read_labels_csv(labels_csv, images_dir, classes)
    listed = {p.resolve() for p in table.paths}
    try:
        unlisted = sum(1 for p in list_images(images_dir) if p.resolve() not in listed)
    except NoImagesError:  # the CSV may name files in subfolders only
        unlisted = 0
    notes = []
    if unlisted:
        notes.append(f"{unlisted} images in {images_dir} are not in {labels_csv} and were not read")
    kind = "" if table.labels is not None else " (no class columns: a prediction-only file)"
    return ExtractionInput(
        paths=list(table.paths),
        image_ids=list(table.image_ids),
        classes=classes,
        labels=table.labels,
        labelled=table.labelled,
        patient_ids=list(table.patient_ids) if table.patient_ids is not None else None,
        source=f"{labels_csv} over {images_dir}{kind}",
        notes=notes,
    )


def _active(data: ExtractionInput, requested: tuple[str, ...] | None) -> tuple[int, ...]:
    """Indices of the classes this hospital labels: ``--active``, or every class the source labels."""
    if requested is None:
        return tuple(data.classes.index(c) for c in data.labelled)
    if data.labels is None:
        raise click.BadParameter(
            "these images have no labels (no --labels CSV, or one without class columns): a "
            "prediction-only file labels no class",
            param_hint="--active",
        )
    if not requested:
        raise click.BadParameter("name at least one class", param_hint="--active")
    for name in requested:
        if name not in data.classes:
            raise click.BadParameter(
                f"{name!r} is not a class; the classes are {', '.join(data.classes)}", param_hint="--active"
            )
        if name not in data.labelled:
            raise click.BadParameter(
                f"{name!r} has no labels in {data.source}: add a {name} column of 0/1 to the labels "
                "CSV, or leave the class out",
                param_hint="--active",
            )
    return tuple(sorted(data.classes.index(c) for c in requested))


def _summary(path: Path, data: FeatureFile, digest: str) -> list[str]:
    """The lines ``show`` prints (and ``extract`` after writing): what a study must match."""
    lines = [
        f"feature file   {path}",
        f"format         {FEATURE_FILE_FORMAT}",
        f"rows           {len(data.features)}",
        f"dim            {data.dim}",
        f"dtype          {data.features.dtype}",
        f"classes        {len(data.classes)}: {','.join(data.classes)}",
    ]
    if data.labels is None:
        lines.append("labelled       none: no labels (a prediction-only file, for secure-afl predict)")
    else:
        positives = ", ".join(f"{data.classes[c]} {int(data.labels[:, c].sum())}" for c in data.active)
        indices = ",".join(str(c) for c in data.active)
        lines.append(f"labelled       {len(data.active)} (active {indices}); positives: {positives}")
        unlabelled = [c for i, c in enumerate(data.classes) if i not in data.active]
        if unlabelled:
            lines.append(f"not labelled   {', '.join(unlabelled)} (all-zero columns)")
    if data.patient_ids is None:
        lines.append('patient ids    absent (a study with dp-unit = "patient" cannot use this file)')
    else:
        lines.append(f"patient ids    present ({len(set(data.patient_ids))} patients)")
    if data.image_sha256 is None:
        lines.append(
            f"image digests  absent: this file cannot be released under the one-release-per-image rule; "
            f"{REEXTRACT_ADVICE}"
        )
    else:
        distinct = len(set(data.image_sha256))
        same = len(data.image_sha256) - distinct
        extra = f"; {same} rows repeat another row's image bytes" if same else ""
        lines.append(
            f"image digests  present (SHA-256 of each image file: {distinct} distinct images{extra})"
        )
    if data.pixel_sha256 is not None:
        same_pixels = len(data.pixel_sha256) - len(set(data.pixel_sha256))
        extra = f"; {same_pixels} rows repeat another row's pixels" if same_pixels else ""
        lines.append(f"pixel digests  present (SHA-256 of each decoded image{extra})")
    elif data.image_sha256 is not None:
        lines.append(
            "pixel digests  absent: no node releases this file (a lossless re-export of its images "
            f"would not be recognised); {REEXTRACT_ADVICE}"
        )
    if data.sop_instance_uids is not None:
        lines.append(
            f"DICOM UIDs     {sum(map(bool, data.sop_instance_uids))} rows name their SOP Instance UID"
        )
    lines += [
        f"backbone       {data.backbone}",
        f"weights-id     {data.weights_id}",
        f"preprocessing  {data.preprocessing}",
        f"digest         {digest} (SHA-256 of the file's bytes)",
        "",
        "A study can use this file only if its run config holds exactly these values (each hospital's "
        "node compares them with its file and refuses a difference):",
        f"  classes = {_toml_string(','.join(data.classes))}",
        f"  dim = {data.dim}",
        f"  backbone = {_toml_string(data.backbone)}",
        f"  weights-id = {_toml_string(data.weights_id)}",
        f"  preprocessing = {_toml_string(data.preprocessing)}",
    ]
    return lines


def _toml_string(value: str) -> str:
    """A TOML string for ``value``: a literal '...' string where possible (readable JSON inside)."""
    if "'" not in value and "\n" not in value and "\r" not in value:
        return f"'{value}'"
    return json.dumps(value, ensure_ascii=False)


def _summary_json(path: Path, data: FeatureFile, digest: str) -> dict[str, object]:
    labels = data.labels
    uids = None if data.sop_instance_uids is None else sum(map(bool, data.sop_instance_uids))
    positives = {} if labels is None else {data.classes[c]: int(labels[:, c].sum()) for c in data.active}
    return {
        "file": str(path),
        "format": FEATURE_FILE_FORMAT,
        "rows": len(data.features),
        "dim": data.dim,
        "dtype": str(data.features.dtype),
        "classes": list(data.classes),
        "active": list(data.active),
        "labelled": [data.classes[c] for c in data.active],
        "has_labels": labels is not None,
        "positives": positives,
        "patient_ids": data.patient_ids is not None,
        "image_digests": data.image_sha256 is not None,
        "distinct_images": len(set(data.image_sha256)) if data.image_sha256 is not None else None,
        "pixel_digests": data.pixel_sha256 is not None,
        "sop_instance_uids": uids,
        "backbone": data.backbone,
        "weights_id": data.weights_id,
        "preprocessing": data.preprocessing,
        "digest": digest,
    }


@click.group()
def features() -> None:
    """Feature files: a hospital's images -> features of the agreed backbone, and what a file holds.

    \b
    secure-afl features extract ...   images + a local weight file -> FILE.npz
    secure-afl features show FILE     rows, classes, backbone, weights id, preprocessing, digest

    The feature file (secure-afl-features/v1) is what a hospital's SuperNode reads (node config
    features="FILE") and what secure-afl predict scores.  The images never leave the hospital;
    only statistics of these features do, through the protocol.
    """


@features.command()
@click.option(
    "--dataset",
    type=click.Choice(["nih"]),
    default=None,
    help="nih: ChestXray14 under --data-dir, labels from its label table (Finding Labels).",
)
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="--dataset nih: the ChestXray14 folder, images_001/images/*.png ... as the archives unpack, "
    "or a flat images/*.png.",
)
@click.option(
    "--csv",
    "csv_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="--dataset nih: the label table. Default: Data_Entry_2017_v2020.csv or Data_Entry_2017.csv in "
    "--data-dir, else the copy bundled with torchxrayvision.",
)
@click.option(
    "--view",
    type=click.Choice(["PA", "AP"]),
    default="PA",
    show_default=True,
    help="--dataset nih: the View Position read (the paper uses the PA images).",
)
@click.option(
    "--images",
    "images_dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="A plain folder of images (PNG or JPEG, 8/16-bit grayscale or RGB; or DICOM, .dcm/.dicom or any "
    "file with the DICM preamble).",
)
@click.option(
    "--labels",
    "labels_csv",
    type=click.Path(path_type=Path, dir_okay=False),
    help="--images: the labels CSV (format below). Without it every PNG/JPEG/DICOM (.png .jpg .jpeg .dcm "
    ".dicom) directly in the folder is read, with no labels.",
)
@click.option(
    "--classes",
    "classes_text",
    default=None,
    help="--images: the study's class list, comma-separated, in the study's order. Default: the "
    "project's 8 ChestXray14 classes " + ", ".join(CLASSES) + ".",
)
@renamed_option(
    "--active",
    "active_text",
    old_names=("--classes-labelled",),
    default=None,
    help="The classes this hospital labels, comma-separated names; the others are written as all-zero "
    "columns. Default: every class with labels in the source (nih: all 8; --labels: its class columns).",
)
@click.option(
    "--patient-ids/--no-patient-ids",
    default=None,
    help='Record each image\'s patient id (needed by a study with dp-unit = "patient"). Default: when '
    "the data has them (nih: Patient ID; --labels: a 'patient' column).",
)
@click.option(
    "--backbone",
    default="densenet121-xrv",
    show_default=True,
    help=f"The study's frozen backbone: {BACKBONES_HELP}.",
)
@click.option(
    "--weights",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="The backbone's weight file, on local disk: nothing is downloaded. Default: where "
    "torchxrayvision / torch hub cache it (~/.torchxrayvision/models_data/..., "
    "~/.cache/torch/hub/checkpoints/...).",
)
@click.option(
    "--out",
    "out_path",
    type=click.Path(path_type=Path, dir_okay=False),
    required=True,
    help="The feature file to write (FILE.npz), mode 0600; replaced atomically, never left half-written.",
)
@click.option(
    "--cache-dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Feature cache, shared with secure-afl sim (default: ~/.cache/secure-afl/features), keyed by "
    "each image's content digest; files 0600, directories made 0700.",
)
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda (cuda:N).")
@click.option(
    "--batch-size", type=click.IntRange(min=1), default=64, show_default=True, help="Images per forward pass."
)
@click.option(
    "--workers",
    type=click.IntRange(min=0),
    default=None,
    help="Image-reading worker processes (default: the CPUs, at most 8; 0: read in this process).",
)
@click.option(
    "--shard-size",
    type=click.IntRange(min=1),
    default=2048,
    show_default=True,
    help="Images per cache shard, the unit of resumption (an existing cache keeps its own).",
)
@click.option("--amp/--no-amp", default=False, show_default=True, help="float16 forward pass (CUDA only).")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bar on stderr.")
@click.pass_context
def extract(
    ctx: click.Context,
    dataset: str | None,
    data_dir: Path | None,
    csv_path: Path | None,
    view: str,
    images_dir: Path | None,
    labels_csv: Path | None,
    classes_text: str | None,
    active_text: str | None,
    patient_ids: bool | None,
    backbone: str,
    weights: Path | None,
    out_path: Path,
    cache_dir: Path | None,
    device: str,
    batch_size: int,
    workers: int | None,
    shard_size: int,
    amp: bool,
    progress: bool,
) -> None:
    """Extract features from images and write a feature file (secure-afl-features/v1).

    \b
    Reads:  the images and their labels, one of
              --dataset nih --data-dir DIR [--csv TABLE]   ChestXray14 and its label table
              --images DIR [--labels FILE.csv]             a plain folder of images
            the weight file (--weights FILE; local only, nothing is downloaded)
            the feature cache (--cache-dir), to reuse or resume earlier work
    Writes: --out FILE.npz, mode 0600, atomically (a temporary file renamed into place)
            cache shards under --cache-dir (shards of --shard-size images), 0600

    \b
    Images: PNG, JPEG or DICOM. DICOM is read with pydicom: rescale slope/intercept
    (or a Modality LUT), then the file's first VOI LUT or window, onto 0-255;
    MONOCHROME1 is inverted. Compressed DICOM is read where a decoder is installed
    (RLE, JPEG Baseline, JPEG 2000); others are left out with the reason and how to
    convert them (gdcmconv --raw IN OUT).
    Each row records the SHA-256 of its image file's bytes (image_sha256), which keys the
    cache (images overwritten under the same names get fresh features), the SHA-256 of
    its decoded pixels (pixel_sha256) and, for DICOM, its SOP Instance UID: the names
    the ledger counts releases by (one image: any name agrees; a lossless re-export
    keeps the pixels). A file listing one image twice is written, with a note, but no
    node releases it.

    \b
    The labels CSV (--labels), UTF-8, comma-separated, a header line first:
      image,Atelectasis,Effusion,patient
      scans/0001.png,1,0,P-17
      scans/0002.png,0,1,P-17
    - image: the file name relative to --images DIR (subfolders allowed); each image once,
      and every listed image must exist.
    - one column per class this hospital labels, named exactly as in --classes (default
      the 8 ChestXray14 classes), every cell 0 or 1; classes without a column are written
      as all-zero columns and are not labelled (active).
    - patient (optional): each image's patient id, recorded unless --no-patient-ids.
    - a CSV with only the image column (or no --labels) gives a prediction-only file.
    A malformed CSV (missing image column, unknown class column, a value other than 0/1,
    an image listed twice or absent) stops the command before any extraction, with a
    message saying what to fix; no output file is written.

    \b
    Resumable: features are cached in shards; an interrupted run (Ctrl-C, a crash) keeps
    its completed shards, and the same command run again resumes from them.  Unreadable
    images are left out, each named with why, and the command then exits 1 (the file of
    the readable ones is written; none readable: nothing).  At the end it prints what was
    written, including the weights id (sha256 of the weight file), the preprocessing
    and the file's digest: the values the study must match (see secure-afl features show).
    """
    from secure_afl.sim.data import CohortError

    classes = _input_classes(dataset, data_dir, csv_path, images_dir, labels_csv, classes_text)
    if out_path.is_dir():
        raise click.BadParameter(f"{out_path} is a directory; give a file name", param_hint="--out")

    from secure_afl.features.backbones import UnknownBackboneError, WeightsError, load_backbone
    from secure_afl.features.images import (
        ImageChangedError,
        ImagesNotFoundError,
    )

    try:
        if dataset == "nih":
            data = _nih_input(data_dir, csv_path, view)  # type: ignore[arg-type]
        else:
            data = _folder_input(images_dir, labels_csv, tuple(classes))  # type: ignore[arg-type]
    except (LabelsCsvError, CohortError, ImagesNotFoundError) as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
    active = _active(data, _parse_names(active_text))
    if patient_ids and data.patient_ids is None:
        raise click.BadParameter(
            f"{data.source} has no patient ids: add a {PATIENT_COLUMN!r} column to the labels CSV",
            param_hint="--patient-ids",
        )
    write_patients = data.patient_ids is not None and patient_ids is not False
    _check_device(device)
    try:
        model = load_backbone(backbone, weights)
    except (UnknownBackboneError, WeightsError) as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None

    try:
        result = _run_extraction(ctx, data, model, out_path, cache_dir, device, batch_size, workers,
                                 shard_size, amp, progress)  # fmt: skip
    except ImageChangedError as exc:
        raise click.ClickException(f"ImageChangedError: {exc}; nothing was written to {out_path}") from None
    unreadable = result.unreadable_error(out_path)  # the same rule as predict's
    if unreadable is not None and len(result.skipped) == len(data.paths):
        raise click.ClickException(f"{type(unreadable).__name__}: {unreadable}")
    try:
        written, notes = write_extracted(data, model, result, out_path, active, write_patients)
    except FeatureBuildError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"read {data.source}")
    for note in notes:
        click.echo(note)
    click.echo(f"wrote {out_path}")
    for line in _summary(out_path, written, file_digest(out_path)):
        click.echo(line)
    if unreadable is not None:  # the file holds the readable ones, but the run did not read every image
        raise click.ClickException(f"{type(unreadable).__name__}: {unreadable}")


def _input_classes(
    dataset: str | None, data_dir: Path | None, csv_path: Path | None, images_dir: Path | None,
    labels_csv: Path | None, classes_text: str | None,
) -> tuple[str, ...]:  # fmt: skip
    """Check that the input options describe one source; the class list (``--classes`` or the 8)."""
    if (dataset is None) == (images_dir is None):
        raise click.UsageError("give either --dataset nih --data-dir DIR or --images DIR (one of the two)")
    if dataset == "nih":
        if data_dir is None:
            raise click.UsageError("--dataset nih needs --data-dir DIR (the ChestXray14 folder)")
        if labels_csv is not None or classes_text is not None:
            raise click.UsageError(
                "--labels and --classes belong to --images; with --dataset nih the labels come from the "
                "label table (--csv) and the classes are the 8 ChestXray14 classes"
            )
    else:
        if data_dir is not None or csv_path is not None:
            raise click.UsageError("--data-dir and --csv belong to --dataset nih; with --images use --labels")
    classes = CLASSES
    if classes_text is not None:
        listed = [part.strip() for part in classes_text.split(",") if part.strip()]
        classes = tuple(dict.fromkeys(listed))
        if not classes:
            raise click.BadParameter("name at least one class", param_hint="--classes")
        if len(classes) != len(listed):
            raise click.BadParameter("a class is named twice; list each class once", param_hint="--classes")
        reserved = [c for c in classes if c in (IMAGE_COLUMN, PATIENT_COLUMN)]
        if reserved:
            raise click.BadParameter(
                f"{reserved[0]!r} names a column of the labels CSV, not a class", param_hint="--classes"
            )
    return tuple(classes)


def _check_device(device: str) -> None:
    from secure_afl.analytic import resolve_device

    try:
        resolve_device(device)
    except (ValueError, RuntimeError) as exc:
        raise click.BadParameter(str(exc), param_hint="--device") from None


def _run_extraction(
    ctx: click.Context,
    data: ExtractionInput,
    model: object,
    out_path: Path,
    cache_dir: Path | None,
    device: str,
    batch_size: int,
    workers: int | None,
    shard_size: int,
    amp: bool,
    progress: bool,
):  # an ExtractionResult (secure_afl.features.extraction imports torch: imported here only)
    from secure_afl.features.extraction import default_num_workers, extract_features, feature_cache_key
    from secure_afl.features.images import hash_image_files
    from secure_afl.sim.datasets import default_cache_dir

    cache = cache_dir if cache_dir is not None else default_cache_dir()
    digests: tuple[str | None, ...] | None = None
    try:
        threads = max(1, default_num_workers() if workers is None else workers)
        digests = hash_image_files(data.paths, workers=threads)  # once: the cache key and the file's rows
        return extract_features(
            data.paths,
            model,  # type: ignore[arg-type]
            cache_dir=cache,
            device=device,
            batch_size=batch_size,
            num_workers=workers,
            amp=amp,
            shard_size=shard_size,
            progress=progress,
            image_sha256=digests,
        )
    except KeyboardInterrupt:
        from secure_afl.analytic import resolve_device

        if digests is None:
            click.echo(
                f"interrupted while hashing the images; nothing was computed or written to {out_path}",
                err=True,
            )
            ctx.exit(130)

        on_cuda = resolve_device(device).type == "cuda"  # extract_features drops amp elsewhere
        entry = cache / feature_cache_key(digests, model, amp=amp and on_cuda)  # type: ignore[arg-type]
        done, size = 0, shard_size
        try:
            manifest = json.loads((entry / "manifest.json").read_text())
            done, size = len(manifest["shards"]), int(manifest["shard_size"])
        except (OSError, ValueError, KeyError):
            pass
        total = -(-len(data.paths) // size)
        click.echo(
            f"interrupted: {done} of {total} shards ({size} images each) are saved in {entry}; run the "
            f"same command again to resume from them. Nothing was written to {out_path}.",
            err=True,
        )
        ctx.exit(130)


@features.command()
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the same facts as one JSON object.")
def show(file: Path, as_json: bool) -> None:
    """Print what a feature file holds, and the values a study must match.

    \b
    Reads:  FILE (secure-afl-features/v1, read without unpickling anything)
    Writes: nothing

    Prints the rows, feature dimension and dtype, the classes and which of them are labelled
    (active, with positives per class), the backbone, the weights id, the preprocessing,
    whether patient ids and image digests (each row's image SHA-256) are present, and the
    digest (SHA-256 of the file's bytes).  The study
    (the coordinator's run config) must hold exactly the printed classes, dim, backbone,
    weights-id and preprocessing, or each hospital's node refuses to take part.  A file that is
    missing or malformed is reported (exit status 1).
    """
    try:
        data = load_feature_file(file)
        digest = file_digest(file)
    except FeatureFileError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"{file}: cannot read: {exc.strerror}") from None
    if as_json:
        click.echo(json.dumps(_summary_json(file, data, digest), indent=1))
        return
    for line in _summary(file, data, digest):
        click.echo(line)
