"""Every test SECURITY.md and docs/*.md cite exists: each cited file under tests/ and each cited
test a module-level ``def test_*`` of that file (SECURITY.md §1.1: "each names the test that
checks it").  Forms read: ``path/test_x.py::test_name``; ``::test_name`` and a backticked bare
``test_name``, both in the file cited last before them; a bare file ``path/test_x.py`` (globs such as
``test_dp*.py`` must match a file); ``test_x.py`` (``tests/dir/``).  Paths are relative to tests/,
with or without a leading ``tests/``."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

_TOKEN = re.compile(
    r"(?<![\w/.*-])(?P<file>(?:[\w*-]+/)*test_[\w*]*\.py)(?:::(?P<test>test_\w+))?"
    r"(?:`\s*\(`(?P<dir>tests/[\w/]*)`\))?"
    r"|(?<![\w:])::(?P<cont>test_\w+)"
    r"|`(?P<bare>test_\w+)`"
)


def citations(text: str) -> list[tuple[int, str, str | None]]:
    """``(line, file, test)`` for each citation in ``text``, ``file`` relative to tests/ (a glob
    where the text has one), ``test`` None for a file cited alone.  A continuation before any file
    is ``(line, "", test)``."""
    found: list[tuple[int, str, str | None]] = []
    last = ""
    for match in _TOKEN.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        if match["file"]:
            path = match["file"].removeprefix("tests/")
            if match["dir"]:  # `test_x.py` (`tests/deploy/`)
                path = match["dir"].removeprefix("tests/") + path
            last = path
            found.append((line, path, match["test"]))
        else:
            found.append((line, last, match["cont"] or match["bare"]))
    return found


@cache
def defined_tests(path: Path) -> frozenset[str]:
    """The module-level ``def test_*`` names of the test file at ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return frozenset(
        node.name
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")
    )


def broken(text: str, tests: Path = TESTS) -> list[str]:
    """One line per citation in ``text`` that names no test file or no test of its file."""
    problems = []
    for line, file, test in citations(text):
        where = f"line {line}: `{file}{'::' + test if test else ''}`"
        if not file:
            problems.append(f"{where}: `::{test}` follows no cited file")
        elif "*" in file:
            if test is not None or not list(tests.glob(file)):
                problems.append(f"{where}: the glob matches no test file (or names a test)")
        elif not (tests / file).is_file():
            problems.append(f"{where}: no such file under tests/")
        elif test is not None and test not in defined_tests(tests / file):
            problems.append(f"{where}: {file} defines no module-level `def {test}`")
    return problems


def _report(document: str, problems: list[str]) -> str:
    return f"{document} cites tests that do not exist ({len(problems)}):\n" + "\n".join(problems)


def test_every_test_security_md_cites_is_defined_in_the_file_it_names() -> None:
    text = (ROOT / "SECURITY.md").read_text(encoding="utf-8")
    cited = citations(text)
    assert sum(1 for _, _, test in cited if test) > 50, "the citation parser found too few citations"
    problems = broken(text)
    assert not problems, _report("SECURITY.md", problems)


@pytest.mark.parametrize("document", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_every_test_a_doc_cites_is_defined_in_the_file_it_names(document: str) -> None:
    problems = broken((ROOT / "docs" / document).read_text(encoding="utf-8"))
    assert not problems, _report(f"docs/{document}", problems)


def test_the_parser_reads_each_form_and_reports_each_broken_citation(tmp_path: Path) -> None:
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "test_a.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('x', [1])\ndef test_one(x):\n    pass\n\n"
        "class TestGrouped:\n    def test_in_a_class(self):\n        pass\n"
    )
    (tmp_path / "test_b.py").write_text("def test_two():\n    pass\n")
    text = (
        "`deploy/test_a.py::test_one`, `::test_two`, `tests/test_b.py::test_two`,\n"
        "`::test_one` `test_b.py` `deploy/test_a*.py` `deploy/test_c*.py`\n"
        "`test_a.py` (`tests/deploy/`) `test_one` `deploy/test_a.py::test_in_a_class` `deploy/test_z.py`"
    )
    assert citations(text) == [
        (1, "deploy/test_a.py", "test_one"),
        (1, "deploy/test_a.py", "test_two"),
        (1, "test_b.py", "test_two"),
        (2, "test_b.py", "test_one"),
        (2, "test_b.py", None),
        (2, "deploy/test_a*.py", None),
        (2, "deploy/test_c*.py", None),
        (3, "deploy/test_a.py", None),
        (3, "deploy/test_a.py", "test_one"),
        (3, "deploy/test_a.py", "test_in_a_class"),
        (3, "deploy/test_z.py", None),
    ]
    assert broken(text, tmp_path) == [
        "line 1: `deploy/test_a.py::test_two`: deploy/test_a.py defines no module-level `def test_two`",
        "line 2: `test_b.py::test_one`: test_b.py defines no module-level `def test_one`",
        "line 2: `deploy/test_c*.py`: the glob matches no test file (or names a test)",
        "line 3: `deploy/test_a.py::test_in_a_class`: deploy/test_a.py defines no module-level "
        "`def test_in_a_class`",
        "line 3: `deploy/test_z.py`: no such file under tests/",
    ]
    assert broken("`::test_one` first", tmp_path) == [
        "line 1: `::test_one`: `::test_one` follows no cited file"
    ]
