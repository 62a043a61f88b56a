"""Command-line options shared by ``secure-afl sim`` and ``secure-afl deploy``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import click

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
    """``--dp-epsilon --dp-delta --clip --dp-unit --dp-max-images-per-patient`` (SECURITY.md §9)."""
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
        default=32.0,
        show_default=True,
        help="DP: L2 bound every feature row is clipped to (public; choose it without looking at the data).",
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
]
