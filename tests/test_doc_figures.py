"""Every measured figure in README.md and docs/*.md names its command, commit and date, and no two
documents quote one named figure differently (the convention is docs/index.md's "Figures").

A *figure* is a number with a unit of time, size, ratio or per cent (``7.3 s``, ``1.7 GB``, ``41×``,
``5.0 %``, ``4 AUC points``) outside inline code. A *provenance* is a short commit hash followed
within a few characters by a date (``commit 0bbf10c, 2026-12-05``) together with a command in
backticks or a code block. A figure's block (a paragraph with the code block after it, a list, or a
table row) carries a provenance itself, in the block just before it (a table's caption), or by a
footnote ``[^name]`` whose definition carries one. Every date in these documents belongs to a
provenance. Unitless numbers (the metrics in results tables) are covered by their caption and are
not checked here; docs/cli.md (generated) and docs/security-history.md (history) are out of scope.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOT_CHECKED = {"cli.md", "security-history.md"}

NUMBER = r"(?<![\w.^/−-])\d[\d,]*(?:\.\d+)?"
UNIT = r"(?:×|\s?(?:CPU-s|ms|min|s|h|B|kB|MB|GB|KiB|MiB|GiB|%|images/s|(?:AUC |BACC )?points))(?![\w/])"
FIGURE = re.compile(NUMBER + UNIT)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
COMMIT = r"(?<![\w.,])[0-9a-f]{7,40}(?!\w|[.,]\d)"
PROVENANCE = re.compile(COMMIT + r"[^`\n|]{0,14}?\b20\d\d-\d\d-\d\d\b")
COMMAND = re.compile(
    r"`(?:[A-Z_]+=\S+ )*(?:secure-afl|python3?|bash|/usr/bin/time|time)\s[^`]*`|```|^ {4}\S", re.M
)
INLINE_CODE = re.compile(r"`[^`]*`")
FOOTNOTE_REF = re.compile(r"\[\^([\w-]+)\](?!:)")
FOOTNOTE_DEF = re.compile(r"^\[\^([\w-]+)\]:(.*(?:\n(?: {2,}|\t).*)*)", re.M)

# Figures with a unit that are settings, published sizes or derived bounds, not measurements: the
# phrase, in the document named, is left out of the check.
NOT_MEASURED: dict[str, tuple[str, ...]] = {
    "how-to-three-hospitals.md": (
        "(30 s: nodes on one machine answer",  # a timeout's default
        "the walk-through's default is 120 s",
        "waits up to 300 s",
        "600 s for a session's first round",
        "and 120 s for every other round",
        "(it waits `sign-timeout`, 300 s",
        "The unit restarts the SuperNode 15 s after",  # the systemd unit's RestartSec
        "one about every 24 s",  # Flower's heartbeat and liveness constants
        "offline after 60 s without one",
    ),
    "multisite.md": ("10 % of each site's rows", "at 10 %", "Google's 10 %"),  # --fraction 0.1
    "ref-methods.md": ("50 %", "erases 20 % of the dimensions"),  # the method's parameters
    "tutorial-chestxray14.md": (
        "(about 42 GB)",  # the NIH archives' published size
        "shifts 10 % of 1024",  # the synthetic model's parameters
        "276 MB for DenseNet-121",  # 4 bytes × d per image, computed
        "1.1 GB for VGG",
        "up to 690 MB for EfficientNet-B7",
    ),
    "README.md": ("(under 60 lines of 80",),
}


def documents() -> dict[str, str]:
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return {p.name: p.read_text(encoding="utf-8") for p in paths if p.name not in NOT_CHECKED}


@dataclass(frozen=True)
class Block:
    text: str
    line: int  # 1-based, of its first line
    table: bool


def blocks(text: str) -> list[Block]:
    """Paragraphs, lists and tables, each with the code blocks that follow it (fenced or indented)."""
    out: list[Block] = []
    lines = text.splitlines()
    current: list[str] = []
    start = 0
    fence = False

    def close() -> None:
        if current:
            body = "\n".join(current)
            code = body.startswith(("```", "    ", "\t"))
            if code and out:  # a code block belongs to the paragraph before it
                prev = out.pop()
                out.append(Block(prev.text + "\n\n" + body, prev.line, prev.table))
            else:
                out.append(Block(body, start, body.lstrip().startswith("|")))
            current.clear()

    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            if not fence and current and not current[0].lstrip().startswith("```"):
                close()
            if not current:
                start = number
            current.append(line)
            fence = not fence
            if not fence:
                close()
            continue
        if not fence and not line.strip():
            close()
            continue
        if not current:
            start = number
        current.append(line)
    close()
    return out


def _has_provenance(texts: tuple[str, ...], footnotes: dict[str, str]) -> bool:
    """A commit with its date, and a command, in these texts (a block and its caption) or their footnotes."""
    texts += tuple(footnotes.get(ref, "") for text in texts for ref in FOOTNOTE_REF.findall(text))
    return any(PROVENANCE.search(t.replace("\n", " ")) for t in texts) and any(
        COMMAND.search(t) for t in texts
    )


def figures(text: str) -> list[str]:
    return [m.group(0).strip() for m in FIGURE.finditer(INLINE_CODE.sub("", text))]


def violations(name: str, text: str, exempt: tuple[str, ...] = ()) -> list[str]:
    """What in one document breaks the convention: figures without a provenance, dates without a commit."""
    for phrase in exempt:
        text = text.replace(phrase, "")
    footnotes = {m.group(1): m.group(2) for m in FOOTNOTE_DEF.finditer(text)}
    found: list[str] = []
    all_blocks = blocks(text)
    for i, block in enumerate(all_blocks):
        caption = all_blocks[i - 1].text if i else ""
        for unit in block.text.splitlines() if block.table else [block.text]:
            shown = figures(unit)
            if shown and not _has_provenance((unit, caption), footnotes):
                where = f"table row {unit[:50]!r}" if block.table else "paragraph"
                found.append(f"{name}:{block.line}: {where}: {', '.join(shown[:4])} without command, commit "
                             "and date (in it, in the paragraph before it, or in a footnote)")  # fmt: skip
        flat = block.text.replace("\n", " ")
        spans = [m.span() for m in PROVENANCE.finditer(flat)]
        for m in DATE.finditer(flat):
            if not any(a <= m.start() < b for a, b in spans):
                found.append(f"{name}:{block.line}: the date {m.group(0)} follows no commit hash")
    return found


# Figures that several documents quote: each pattern's groups are one quote of the figure, and every
# quote must agree (to the precision of the less precise one) with every other.
REGISTRY: dict[str, tuple[str, ...]] = {
    "chance mAP of the image-wise test split": (
        r"mAP \*{0,2}(0\.\d{4})\*{0,2},? \(the test labels' mean",
        r"chance mAP (0\.\d{4})\*\*, their mean",
        r"is \*\*(0\.\d{4})\*\*\. `sim`",
        r"\((0\.\d{4}) on the default image-wise split",
        r"Chance: BACC 50, AUC 50, mAP (0\.\d{4})",
    ),
    "test split size": (r"test split \((\d{2},\d{3}) images\)", r"\(47,117 / (\d{2},\d{3})"),
    "CKKS / masking bytes sent, missing 1 and 7": (r"(\d+)× and (\d+)× the bytes",),
    "sim --missing 7 wall (0bbf10c)": (
        r"0bbf10c, 2026-12-05: (\d+\.\d+) s wall",
        r"\(`secure-afl sim --missing 7`, repeated\) \| (\d+\.\d+) s wall",
    ),
    "Table II run wall (72e918b)": (
        r"72e918b, 2026-12-05 \((\d+ min \d+ s) wall, (\d+) CPU-s",
        r"`secure-afl sim --missing all --baselines all` \| (\d+ min \d+ s) wall, (\d+) CPU-s",
    ),
    "three-hospitals.sh on an idle host (2dc18c6)": (
        r"(\d+) s wall,? (?:and )?(\d+) CPU-s on an (?:otherwise )?idle",
    ),
    "three-hospitals.sh under load (a6eb5ee)": (
        r"(\d+) s wall (?:on a 2-core host shared )?at load average 10–15",
    ),
    "DenseNet-121 extraction rate": (r"about (\d+\.\d) images/s",),
    "AFL (1 round), missing 1, seed 0": (
        r"\*\*AFL \(1 round\)\*\*[^|]*\| (\d+\.\d\d) \| (\d+\.\d\d) \| (0\.\d{4})",
        r"synthetic features\*\* (\d+\.\d\d) / (\d+\.\d\d) / (0\.\d{4}) at missing 1",
    ),
    "AFL (1 round), missing 7, seed 0": (
        r"\*\*AFL \(1 round\)\*\*[^|]*(?:\| [\d.]+ ){9}\| (\d+\.\d\d) \| (\d+\.\d\d) \| (0\.\d{4}) \|",
        r"│ AFL \(1 round\) +│ +(\d+\.\d\d) │ +(\d+\.\d\d) │ (0\.\d{4}) │",
        r"(\d+\.\d\d) / (\d+\.\d\d) / (0\.\d{4}) at missing 7",
    ),
    "round-2 pairs under the rescaled τ at missing 7": (r"(\d+) of 56 at missing 7",),
}


def _agree(a: str, b: str) -> bool:
    """Equal once the more precise of two quotes is rounded to the other's digits."""
    if not re.fullmatch(r"[\d,]+(?:\.\d+)?", a) or not re.fullmatch(r"[\d,]+(?:\.\d+)?", b):
        return a == b
    x, y = Decimal(a.replace(",", "")), Decimal(b.replace(",", ""))
    digits = min(max(-int(v.as_tuple().exponent), 0) for v in (x, y))
    return round(x, digits) == round(y, digits)


def contradictions(docs: dict[str, str], registry: dict[str, tuple[str, ...]], least: int = 2) -> list[str]:
    found: list[str] = []
    for figure, patterns in registry.items():
        quotes: list[tuple[str, tuple[str, ...]]] = []
        for name, text in docs.items():
            flat = re.sub(r"\s*\n\s*", " ", text)
            for pattern in patterns:
                quotes += [(name, m.groups()) for m in re.finditer(pattern, flat)]
        if len(quotes) < least:
            found.append(f"{figure!r} is quoted {len(quotes)} time(s), not in {least} places: update "
                         "tests/test_doc_figures.py's REGISTRY to the documents' wording")  # fmt: skip
            continue
        first_name, first = quotes[0]
        for name, value in quotes[1:]:
            if len(value) != len(first) or not all(_agree(a, b) for a, b in zip(value, first, strict=True)):
                found.append(
                    f"{figure!r}: {name} quotes {' / '.join(value)}, {first_name} {' / '.join(first)}"
                )
    return found


@pytest.mark.parametrize("name", sorted(documents()))
def test_every_figure_names_its_command_commit_and_date(name: str) -> None:
    found = violations(name, documents()[name], NOT_MEASURED.get(name, ()))
    assert not found, "\n".join(found) + "\n(the convention: docs/index.md, 'Figures')"


def test_documents_agree_on_the_figures_they_share() -> None:
    found = contradictions(documents(), REGISTRY)
    assert not found, "\n".join(found)


PROVENANCE_LINE = "(`secure-afl sim --missing 7`, commit 0bbf10c, 2026-12-05)"


@pytest.mark.parametrize(
    "text",
    [
        "It took 12.5 s wall on two cores.\n",
        "It took 12.5 s wall (commit 0bbf10c, 2026-12-05).\n",  # no command
        "It took 12.5 s wall (`secure-afl sim`, 2026-12-05).\n",  # no commit
        "Intro " + PROVENANCE_LINE + ".\n\n| a | b |\n|---|---|\n| x | 3 GiB |\n\nLater: 41× the bytes.\n",
        "| command | figure |\n|---|---|\n| `python bench/x.py` | 2.1 MB, commit 0bbf10c, 2026-12-05 |\n"
        "| `python bench/y.py` | 3.4 MB |\n",
        "Recorded on 2026-12-07 " + PROVENANCE_LINE + ".\n",  # a date that belongs to no commit
        "Measured: 7 %[^x].\n\n[^x]: by hand, 2026-12-05.\n",  # a footnote without a provenance
    ],
)
def test_a_planted_figure_without_provenance_is_found(text: str) -> None:
    assert violations("planted.md", text)


@pytest.mark.parametrize(
    "text",
    [
        "It took 12.5 s wall " + PROVENANCE_LINE + ".\n",
        "Caption " + PROVENANCE_LINE + ":\n\n| a | b |\n|---|---|\n| x | 3 GiB |\n",
        "Commands (commit 0bbf10c, 2026-12-05):\n\n    secure-afl sim   # 75.9 s wall, 1.7 GB\n",
        "Measured: 7 % and 41×[^m].\n\nMore text.\n\n[^m]: " + PROVENANCE_LINE[1:-1] + "\n",
        "The `--round-timeout 30s` option, and no figure at all: 62.38 / 67.89.\n",
    ],
)
def test_a_figure_with_provenance_passes(text: str) -> None:
    assert violations("planted.md", text) == []


def test_an_exempt_setting_passes_and_only_it() -> None:
    text = "It waits up to 300 s, then took 12 s.\n"
    found = violations("x.md", text, ("waits up to 300 s",))
    assert len(found) == 1 and "12 s without command" in found[0] and "300" not in found[0]


def test_a_planted_contradiction_is_found() -> None:
    registry = {"CKKS bytes": (r"(\d+)× and (\d+)× the bytes",), "wall": (r"(\d+\.\d+) s wall",)}
    agree = {
        "a.md": "CKKS sends 41× and 22× the bytes; 7.28 s wall",
        "b.md": "41× and 22× the bytes, 7.3 s wall",
    }
    assert contradictions(agree, registry) == []
    disagree = dict(agree, **{"c.md": "about 40× and 22× the\nbytes; 7.4 s wall"})
    found = contradictions(disagree, registry)
    assert len(found) == 2 and "c.md quotes 40 / 22" in found[0] and "c.md quotes 7.4" in found[1]
    assert "quoted 1 time(s)" in contradictions({"a.md": "41× and 22× the bytes"}, registry)[0]


def test_violations_planted_in_the_real_documents_are_found() -> None:
    docs = documents()
    readme = docs["README.md"] + "\nThe run took 42 s wall on a busy host.\n"
    found = violations("README.md", readme, NOT_MEASURED["README.md"])
    assert len(found) == 1 and "42 s without command" in found[0]
    quote = re.compile(r"(\d+)(× and \d+× the bytes)")
    name = next(n for n, text in docs.items() if quote.search(text))
    planted = dict(docs, **{name: quote.sub(r"99\2", docs[name], count=1)})
    found = contradictions(planted, REGISTRY)
    assert found and all("CKKS / masking bytes" in f and "99 / 22" in f for f in found)
