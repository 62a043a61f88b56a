"""Command-line options shared by ``secure-afl sim`` and ``secure-afl deploy``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click

from secure_afl.privacy.dp_config import DEFAULT_CENTRED_CLIP, DEFAULT_CLIP, DEFAULT_DP_DIM, default_ridge

F = TypeVar("F", bound=Callable[..., object])


# CKKS ring degree N; the two the clients accept by default (protocol/ckks/context.py).
ckks_degree_option = click.option(
    "--ckks-degree",
    type=click.Choice(["8192", "16384"]),
    default="8192",
    show_default=True,
    help="CKKS ring degree N, with --protection ckks (16384: twice the slots and a larger security "
    "margin, slower).",
)


class RenamedOption(click.Option):
    """An option that still answers to its ``old_names`` for one release.

    The old names are parsed as the option itself, never listed in ``--help`` (so the generated
    reference shows one name per concept), and using one prints a one-line deprecation note to
    standard error.  Giving the new and an old name together is refused: which one was meant?
    """

    def __init__(self, *args: Any, old_names: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.is_flag and old_names:
            raise TypeError("RenamedOption: a flag's old names are not supported")
        self.old_names = tuple(old_names)

    def _old_dest(self, index: int) -> str:
        return f"{self.name} old name {index}"  # never an identifier: no clash with another option

    def add_to_parser(self, parser: Any, ctx: click.Context) -> None:
        super().add_to_parser(parser, ctx)
        action = "append" if self.multiple else "store"
        for index, old in enumerate(self.old_names):  # one destination each: the note names it
            parser.add_option(
                obj=self, opts=[old], dest=self._old_dest(index), action=action, nargs=self.nargs
            )

    def consume_value(self, ctx: click.Context, opts: Any) -> Any:
        used = [
            (old, opts[self._old_dest(i)])
            for i, old in enumerate(self.old_names)
            if self._old_dest(i) in opts
        ]
        new = self.opts[0]
        if used:
            names = [old for old, _ in used]
            if self.name in opts or len(used) > 1:
                given = " and ".join(([new] if self.name in opts else []) + names)
                raise click.UsageError(f"{given} name one option: give {new} only", ctx=ctx)
            deprecation_note(ctx, names[0], new)
            opts = {**opts, self.name: used[0][1]}
        return super().consume_value(ctx, opts)


def renamed_option(*param_decls: str, old_names: Sequence[str], **attrs: Any) -> Callable[[F], F]:
    """``click.option`` for an option renamed for one vocabulary: ``old_names`` still work, with a
    deprecation note (:class:`RenamedOption`)."""
    return click.option(*param_decls, cls=RenamedOption, old_names=old_names, **attrs)


def deprecation_note(ctx: click.Context, old: str, new: str, hint: str = "") -> None:
    """The one line every old name prints (:class:`RenamedOption`'s words)."""
    click.echo(
        f"{ctx.command_path}: {old} is deprecated, use {new} (the old name goes in the next release)"
        + (f": {hint}" if hint else ""),
        err=True,
    )


class DeprecatedOption(click.Option):
    """A hidden option kept for one release whose value is not the new option's (``--identity-key
    FILE`` for ``--key-dir DIR``): given, it prints the note naming ``replacement``; the command maps
    its value (e.g. :func:`identity_key_file`)."""

    def __init__(
        self, *args: Any, replacement: str, hint: Callable[[Any], str] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, hidden=True, **kwargs)
        self.replacement = replacement
        self.hint = hint

    def process_value(self, ctx: click.Context, value: Any) -> Any:
        value = super().process_value(ctx, value)
        if value is not None and not ctx.resilient_parsing:
            deprecation_note(ctx, self.opts[0], self.replacement, self.hint(value) if self.hint else "")
        return value


class DeprecatedArgument(click.Argument):
    """A positional argument that became an option (``deploy run APP_DIR FEDERATION`` is now
    ``deploy run --app-dir DIR --federation NAME``): still parsed for one release, never shown in the
    usage line; the command resolves it with :func:`positional_or_option`, which prints the note."""

    def __init__(self, *args: Any, replacement: str, **kwargs: Any) -> None:
        super().__init__(*args, required=False, **kwargs)
        self.replacement = replacement

    def get_usage_pieces(self, ctx: click.Context) -> list[str]:
        return []


def positional_or_option(
    ctx: click.Context, positional: Any, option: Any, *, default: Any, name: str | None = None
) -> Any:
    """The value of a :class:`DeprecatedArgument` (the command's parameter ``name``; by default its
    only one) or of the option that replaced it (not both)."""
    param = next(
        p for p in ctx.command.params if isinstance(p, DeprecatedArgument) and name in (None, p.name)
    )
    if positional is None:
        return default if option is None else option
    name = (param.metavar or (param.name or "").upper()).strip()
    if option is not None:
        raise click.UsageError(f"{name} (positional) and {param.replacement} name one value: give "
                               f"{param.replacement} only", ctx=ctx)  # fmt: skip
    deprecation_note(ctx, f"the positional {name}", param.replacement, f"{param.replacement} {positional}")
    return positional


def key_dir_option(help: str, *, old_names: Sequence[str], dest: str = "key_dir") -> Callable[[F], F]:
    """``--key-dir DIR``: the directory of this party's own identity key (``keys init``: identity.key
    and identity.pub.json), in every command that uses one, the coordinator's ``deploy app`` and
    ``deploy run`` included (their old ``--identity-key FILE``: :func:`identity_key_alias`)."""
    return renamed_option(
        "--key-dir", dest, old_names=old_names, type=click.Path(path_type=Path, file_okay=False),
        default=None, metavar="DIR", help=help,
    )  # fmt: skip


def identity_key_alias(command: F) -> F:
    """The hidden ``--identity-key FILE`` of ``deploy app`` and ``deploy run``, before ``--key-dir``."""

    def hint(path: Path) -> str:
        from secure_afl.keys.store import KEY_FILE

        return (
            f"--key-dir {path.parent}"
            if path.name == KEY_FILE
            else f"--key-dir DIR, the key at DIR/{KEY_FILE}"
        )

    return click.option(
        "--identity-key", "identity_key", cls=DeprecatedOption, replacement="--key-dir", hint=hint,
        type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None,
    )(command)  # fmt: skip


def identity_key_file(key_dir: Path | None, identity_key: Path | None) -> Path:
    """The key file ``--key-dir DIR`` names (DIR/identity.key, as ``keys init`` writes it; default
    $SECURE_AFL_HOME or ~/.secure-afl), or the old ``--identity-key FILE`` itself."""
    from secure_afl.keys.store import KEY_FILE, default_key_dir

    if identity_key is not None:
        if key_dir is not None:
            raise click.UsageError("--key-dir and --identity-key name one key: give --key-dir only")
        return identity_key
    directory = key_dir or default_key_dir()
    path = directory / KEY_FILE
    if not path.is_file():
        raise click.BadParameter(
            f"{directory}: no {KEY_FILE} here: give the directory `secure-afl keys init --id coordinator` "
            "wrote",
            param_hint="--key-dir",
        )
    return path


def split_pair(
    item: str, option: str, metavar: str, example: str, *, value_optional: bool = False
) -> tuple[str, str]:
    """One ``NAME=VALUE`` item of a repeatable option (``--set``, ``--expect``, ``--site-dir``,
    ``--weights``, and ``--drop`` with its ``@``), split at the separator ``metavar`` shows.

    Every such option refuses a malformed item with the same words: the item, what was expected,
    and an example.  Both halves are stripped; the name may not be empty, nor the value unless
    ``value_optional`` (``--set KEY=`` sets an empty string).
    """
    separator = "@" if "@" in metavar else "="
    name, sep, value = item.partition(separator)
    name, value = name.strip(), value.strip()
    if not sep or not name or not (value or value_optional):
        raise click.BadParameter(f"{item!r}: expected {metavar}, e.g. {example}", param_hint=option)
    return name, value


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
        "smallest eigenvalues (its own share of the budget). Every hospital derives bound and adassp "
        "itself; adaptive no hospital can, so its classifier is not checked (SECURITY.md §5.1). "
        "[default: adaptive with --dp-dim, else bound]",
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
