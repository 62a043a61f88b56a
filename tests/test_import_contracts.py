"""The package's import rules: the layers (import-linter, pyproject's [tool.importlinter]), no import
cycle between modules, and no module reaching into another's private names."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "secure_afl"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _imports(name: str, path: Path) -> Iterator[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import of secure_afl in ``path``,
    at any depth (a function's lazy import is an import too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("secure_afl"):
                    yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target.startswith("secure_afl"):
                for alias in node.names:
                    yield target, alias.name, node.lineno


def test_the_layers_contract_holds() -> None:
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "1 kept, 0 broken" in result.stdout


def test_no_module_imports_another_modules_private_name() -> None:
    modules = _modules()
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {target}.{imported}"
        for name, path in modules.items()
        for target, imported, line in _imports(name, path)
        if imported and imported.startswith("_") and not imported.startswith("__") and target != name
    ]
    assert found == [], "make the name public where it is defined, or move the code:\n" + "\n".join(found)


def test_no_import_cycle_between_modules() -> None:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target, imported, _ in _imports(name, path):
            submodule = f"{target}.{imported}" if imported else target
            dependency = submodule if submodule in modules else target
            if dependency in modules and dependency != name and not name.startswith(dependency + "."):
                graph[name].add(dependency)  # a package's __init__ is not a cycle with its own modules
    cycles = _strongly_connected(graph)
    assert cycles == [], f"import cycles: {cycles}"


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iteratively: the components of two or more modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _strongly_connected(graph) == [["a", "b", "c"]]


def test_every_command_is_thin() -> None:
    """A click command parses, calls one library function and prints: no body over 60 lines."""
    long = []
    for path in sorted(PACKAGE.glob("cli*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef):
                continue
            if not any(
                ".command" in ast.unparse(d) or ".group" in ast.unparse(d) for d in node.decorator_list
            ):
                continue
            body = node.body
            first = (
                body[1] if len(body) > 1 and isinstance(body[0], ast.Expr) else body[0]
            )  # after the docstring
            lines = (node.end_lineno or first.lineno) - first.lineno + 1
            if lines > 60:
                long.append(f"{path.name}:{node.lineno} {node.name}: {lines} lines")
    assert long == [], "move the logic into the library: " + "; ".join(long)
