"""Command-line options shared by ``secure-afl sim`` and ``secure-afl deploy``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import click

from secure_afl.privacy.dp_config import DEFAULT_CENTRED_CLIP, DEFAULT_CLIP, DEFAULT_DP_DIM, default_ridge

F = TypeVar("F", bound=Callable[..., object])


# CKKS ring degree N; the two the clients accept by default (protocol/ckks/context.py).
ckks_degree_option = click.option(
    "--ckks-degree",
    type=click.Choice(["8192", "16384"]),
    default="8192",
    show_default=True,
    help="CKKS ring degree N, with --secure ckks (16384: twice the slots and a larger security "
    "margin, slower).",
)


def dp_options(command: F) -> F:
    """``--dp-epsilon --dp-delta --clip --dp-unit --dp-max-images-per-patient --dp-dim
    --dp-projection-seed --dp-ridge`` (SECURITY.md §9)."""
    for option in reversed(_DP_OPTIONS):
        command = option(command)
    return command


_DP_OPTIONS = [
    click.option(
        "--dp-epsilon",
        type=float,
        default=None,
        help="Differential privacy for the released classifier: the ε each institution may spend "
        "(clients add distributed discrete Gaussian noise before masking). Off when absent.",
    ),
    click.option("--dp-delta", type=float, default=1e-6, show_default=True, help="The δ of (ε, δ)-DP."),
    click.option(
        "--clip",
        type=float,
        default=None,
        help="DP: L2 bound every feature row is clipped to (public; choose it without looking at the data). "
        f"[default: {DEFAULT_CLIP:g}; {DEFAULT_CENTRED_CLIP:g} with --dp-row-centre]",
    ),
    click.option(
        "--dp-row-centre",
        is_flag=True,
        default=False,
        help="DP: subtract every row's own mean over its features before the projection and the clip (a "
        "public map; non-negative features carry most of their norm along the all-ones direction, which "
        "has no class signal but sets the clip). The classifier still predicts on the original features.",
    ),
    click.option(
        "--dp-unit",
        type=click.Choice(["image", "patient"]),
        default="image",
        show_default=True,
        help="DP: protect one image, or one patient (with at most --dp-max-images-per-patient images).",
    ),
    click.option(
        "--dp-max-images-per-patient",
        type=click.IntRange(min=1),
        default=4,
        show_default=True,
        help="DP, --dp-unit patient: images kept per patient (the rest are dropped before the statistics).",
    ),
    click.option(
        "--dp-dim",
        type=int,
        default=None,
        help="DP: project every feature row to K dimensions with a public, data-independent random "
        "projection before clipping (statistics K×K and K instead of d×d and d; the classifier is "
        f"mapped back to the d features). Off when absent (--dp-sweep: compares with K = {DEFAULT_DP_DIM}).",
    ),
    click.option(
        "--dp-projection-seed",
        type=int,
        default=0,
        show_default=True,
        help="DP, --dp-dim: the public seed the projection is derived from (part of the study).",
    ),
    click.option(
        "--dp-class-sums",
        type=click.Choice(["split", "positives"]),
        default=None,
        help="DP: what each class group carries. split: positive and negative sums per class (an image "
        "moves every labelled class's block, so the noise grows with the classes a hospital labels); "
        "positives: label-normalised positive sums per class plus one total sum for the negatives' mean "
        "(one block's noise for all classes; exact for IID hospitals, biased when the annotators' rows "
        "differ from the federation's). [default: split; --dp-sweep compares split with positives]",
    ),
    click.option(
        "--dp-ridge",
        type=click.Choice(["bound", "adaptive", "adassp"]),
        default=None,
        help="DP: the solve's ridge. bound: the Gram noise's high-probability bound (data-independent); "
        "adaptive: that bound less a lower bound on the Gram's smallest eigenvalue read off the noisy "
        "Gram (post-processing); adassp: the same from a separately noised release of the clients' "
        "smallest eigenvalues (its own share of the budget). [default: adaptive with --dp-dim, else bound]",
    ),
]


def resolve_dp_ridge(dp_ridge: str | None, dp_dim: int | None) -> str:
    """``--dp-ridge``'s default: the adaptive ridge with ``--dp-dim`` (the new mechanism), else today's."""
    return default_ridge(dp_ridge, dp_dim)


def resolve_clip(clip: float | None, row_centre: bool) -> float:
    """``--clip``'s default: :data:`DEFAULT_CLIP`, or :data:`DEFAULT_CENTRED_CLIP` for centred rows."""
    if clip is not None:
        return clip
    return DEFAULT_CENTRED_CLIP if row_centre else DEFAULT_CLIP


def check_dp_mechanism_options(
    dp_on: bool,
    dp_dim: int | None,
    dp_ridge: str | None,
    seed: int,
    class_sums: str | None = None,
    row_centre: bool = False,
) -> None:
    """``--dp-dim``, ``--dp-ridge``, ``--dp-class-sums``, ``--dp-row-centre`` and
    ``--dp-projection-seed`` only make sense under DP."""
    if dp_on:
        return
    options = (
        ("--dp-dim", dp_dim),
        ("--dp-ridge", dp_ridge),
        ("--dp-class-sums", class_sums),
        ("--dp-row-centre", True if row_centre else None),
    )
    given = [name for name, value in options if value is not None]
    if seed != 0:
        given.append("--dp-projection-seed")
    if given:
        raise click.UsageError(
            f"{' and '.join(given)} {'shape' if len(given) > 1 else 'shapes'} the differential-privacy "
            "mechanism: add --dp-epsilon (or --dp-sweep), or drop "
            f"{'them' if len(given) > 1 else 'it'} (without DP the statistics are exact and never projected)"
        )


class LibraryErrorsGroup(click.Group):
    """A command group that shows the library's "what to do next" errors as click shows its own
    (``Error: ...``, exit 1): a :class:`~secure_afl.keys.store.KeyStoreError` names the file and
    the remedy already, so the commands need not catch it one by one."""

    def invoke(self, ctx: click.Context) -> object:
        from secure_afl.keys.store import KeyStoreError

        try:
            return super().invoke(ctx)
        except KeyStoreError as exc:
            raise click.ClickException(str(exc)) from None
