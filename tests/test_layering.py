"""The package layout is a contract, read from the code's own imports with `ast`.

Every import counts: module-level, function-local and ``if TYPE_CHECKING:`` ones alike (a circle
held together by a deferred import is still a circle). The rules:

- imports point down the declared package order (or stay inside one package);
- no import circle between modules, not even inside one package;
- no module imports another module's ``_private`` name;
- a function-local import of our own modules says why it is deferred, on its line or the line
  above (``deferred: ...``): only torch, uvloop and asyncssh are worth deferring, and the ssh
  agent's start path, which every host of a fan-out pays for;
- the pure packages import neither asyncio nor socket, at any depth of what they import;
- every subpackage's docstring says its role and what it may import, and says it truly.

The order is declared here, once; ``docs/architecture.md`` shows it and is checked against it.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "flodl_async"

#: Bottom to top. A root module is named as itself; ``flodl_async/__init__.py`` (the face) is
#: above everything and appears in no list.
ORDER = (
    "_lazy",
    "_version",
    "verdict",
    "errors",
    "wire",
    "status",
    "deadlines",
    "host",
    "control",
    "training",
    "checkpoint",
    "net",
    "config",
    "relay",
    "agent",
    "controller",
    "cli",
    "trainer",
)
#: Decisions and codecs: they take bytes and ``now``, never a socket or a loop.
PURE = (
    "_lazy",
    "_version",
    "verdict",
    "errors",
    "deadlines",
    "wire",
    "control",
    "training",
    "checkpoint",
    "config",
)
#: What a deferred import of our own modules may be deferred for.
DEFER_REASONS = ("torch", "uvloop", "asyncssh", "start path")
FACE = "<face>"


@dataclass(frozen=True, slots=True)
class Edge:
    importer: str  # dotted module
    target: str  # dotted module (a package means its __init__)
    line: int
    local: bool  # inside a function
    names: tuple[str, ...]


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _package_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return FACE
    return parts[1]


def _function_lines(tree: ast.AST) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Import | ast.ImportFrom):
                    inside.add(sub.lineno)
    return inside


def _edges() -> list[Edge]:
    edges = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        local = _function_lines(tree)
        here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - (node.level - 1)]
                    base += node.module.split(".") if node.module else []
                elif node.module and node.module.split(".")[0] == "flodl_async":
                    base = node.module.split(".")
                else:
                    continue
                for alias in node.names:
                    named = ".".join([*base, alias.name])
                    target = named if named in MODULES else ".".join(base)
                    names = () if named in MODULES else (alias.name,)
                    edges.append(Edge(module, target, node.lineno, node.lineno in local, names))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "flodl_async":
                        edges.append(
                            Edge(module, alias.name, node.lineno, node.lineno in local, ())
                        )
    return edges


EDGES = _edges()


def test_every_package_and_root_module_is_in_the_order() -> None:
    present = {_package_of(m) for m in MODULES} - {FACE}
    assert sorted(present - set(ORDER)) == []
    assert sorted(set(ORDER) - present) == []


def test_the_root_holds_at_most_six_modules() -> None:
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 6, root


def test_imports_point_down_the_package_order() -> None:
    upward = []
    for edge in EDGES:
        a, b = _package_of(edge.importer), _package_of(edge.target)
        if a in (b, FACE):
            continue
        if b == FACE or ORDER.index(b) > ORDER.index(a):
            upward.append(f"{edge.importer}:{edge.line} -> {edge.target} ({a} is below {b})")
    assert upward == []


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the graph is small, but recursion limits are not ours)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    found.append(sorted(component))
    return found


def test_no_module_import_circle() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for edge in EDGES:
        if edge.target != edge.importer and edge.target in MODULES:
            # a module importing its own package's face is an edge to that __init__
            graph[edge.importer].add(edge.target)
    # A package's __init__ that re-exports its modules is not a circle with them when they do
    # not import it back; one that they do import back is.
    assert _strongly_connected(graph) == []


def test_no_module_imports_another_modules_private_names() -> None:
    private = [
        f"{edge.importer}:{edge.line} imports {name} from {edge.target}"
        for edge in EDGES
        for name in edge.names
        if name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
    ]
    assert private == []


def test_a_deferred_import_says_what_it_defers() -> None:
    unexplained = []
    for edge in EDGES:
        if not edge.local:
            continue
        lines = MODULES[edge.importer].read_text().splitlines()
        said = " ".join(lines[max(0, edge.line - 2) : edge.line + 1])
        comment = said[said.find("deferred:") :] if "deferred:" in said else ""
        if not any(reason in comment for reason in DEFER_REASONS):
            unexplained.append(f"{edge.importer}:{edge.line} -> {edge.target}")
    assert unexplained == []


def _module_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    local = _function_lines(tree)
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom) or node.lineno in local:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_pure_packages_import_neither_asyncio_nor_socket_at_any_depth() -> None:
    """What a pure module imports at module level, and what those import, down to the bottom."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for edge in EDGES:
        if not edge.local and edge.target in MODULES:
            graph[edge.importer].add(edge.target)
    offenders = []
    for module in MODULES:
        if _package_of(module) not in PURE:
            continue
        seen, todo = set(), [module]
        while todo:
            current = todo.pop()
            if current in seen:
                continue
            seen.add(current)
            todo.extend(graph[current])
            if _module_level_imports(MODULES[current]) & {"asyncio", "socket"}:
                offenders.append(f"{module} (through {current})")
    assert offenders == []


def test_pure_packages_really_load_without_asyncio_or_socket() -> None:
    """The same rule, as Python sees it: each pure module imported alone, in a fresh interpreter
    that has neither loaded (one interpreter per package, to keep it quick)."""
    for package in PURE:
        modules = [m for m in MODULES if _package_of(m) == package]
        code = "".join(
            f"import importlib, sys; importlib.import_module({m!r}); "
            f"assert 'asyncio' not in sys.modules and 'socket' not in sys.modules, {m!r}\n"
            for m in modules
        )
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
        )
        assert result.returncode == 0, result.stderr


_MAY_IMPORT = re.compile(r"^May import:\s*(.*?)\.?\s*(?:\n\n|\Z)", re.MULTILINE | re.DOTALL)
_SUBPACKAGES = [p for p in ORDER if (PACKAGE / p).is_dir()]


def _may_import(package: str) -> set[str]:
    """The packages named by ``package``'s docstring on its 'May import:' line (which may wrap)."""
    doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text()))
    assert doc, f"{package}/__init__.py has no docstring"
    found = _MAY_IMPORT.search(doc)
    assert found, f"{package}/__init__.py's docstring has no 'May import:' line"
    names = (name.strip(" `") for name in " ".join(found.group(1).split()).split(","))
    return {name for name in names if name != "nothing"}


@pytest.mark.parametrize("package", _SUBPACKAGES, ids=lambda p: p)
def test_each_package_says_its_role_and_truly_what_it_may_import(package: str) -> None:
    said = _may_import(package)
    below = set(ORDER[: ORDER.index(package)])
    assert said <= below, f"{package} says it may import {sorted(said - below)}, which sit above"
    used = {
        _package_of(edge.target)
        for edge in EDGES
        if _package_of(edge.importer) == package and _package_of(edge.target) != package
    }
    assert used <= said, f"{package} imports {sorted(used - said)} but does not say so"


def test_docs_show_the_declared_order() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    found = re.search(r"^Package order, bottom to top: (.*)$", text, re.MULTILINE)
    assert found, "docs/architecture.md has no 'Package order, bottom to top:' line"
    shown = tuple(name.strip(" `.") for name in found.group(1).split("→"))
    assert shown == ORDER


def test_importing_every_module_does_not_import_torch() -> None:
    """torch costs ~2 s: nothing, not even the Trainer API, loads it before a model is built."""
    modules = [m for m in MODULES if not m.endswith("__main__")]
    code = "import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
    code += "print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "False"


def test_the_readme_layout_table_says_what_each_docstring_says() -> None:
    """README's one-line-per-package table copies each package's 'May import:' line."""
    rows = re.findall(
        r"^\| `(\w+)/` \| [^|]+ \| ([^|]+) \|$", (ROOT / "README.md").read_text(), re.M
    )
    assert {package for package, _ in rows} == set(_SUBPACKAGES)
    for package, cell in rows:
        assert {n.strip(" `") for n in cell.split(",")} == _may_import(package), package


def test_no_module_is_too_long_to_read() -> None:
    """None over 950 lines, and at most two over 700 (the frame codec and the coordinator, each one
    concern): a module that grows past that wants a cohesive part moved into a module of its own."""
    lengths = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    assert [m for m, n in lengths.items() if n > 950] == []
    assert len([m for m, n in lengths.items() if n > 700]) <= 2, sorted(
        (n, m) for m, n in lengths.items() if n > 700
    )


def _imports_asyncio(tree: ast.AST) -> bool:
    return any(
        (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "asyncio" for a in n.names))
        or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "asyncio")
        for n in ast.walk(tree)
    )


def test_no_shell_class_is_over_450_lines() -> None:
    """A class in a module that imports asyncio is a shell: it pumps and carries out. Past 450 lines
    it is deciding too; the decisions go into a pure core it drives."""
    too_long = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        if not _imports_asyncio(tree):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                if node.end_lineno - node.lineno + 1 > 450:
                    too_long.append(f"{module}.{node.name}")
    assert too_long == []


def _isinstance_ladder(node: ast.If) -> int:
    """How many `if isinstance(...)` / `elif isinstance(...)` branches start at ``node``."""
    branches = 0
    current: ast.stmt | None = node
    while (
        isinstance(current, ast.If)
        and isinstance(current.test, ast.Call)
        and isinstance(current.test.func, ast.Name)
        and current.test.func.id == "isinstance"
    ):
        branches += 1
        current = current.orelse[0] if len(current.orelse) == 1 else None
    return branches


def test_dispatch_is_by_table_not_by_a_long_isinstance_ladder() -> None:
    """More than three isinstance branches in a row is a dispatch: it belongs in a table keyed on
    the type (control.dispatch.TypeTable checks the table covers its union)."""
    ladders = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.If) and _isinstance_ladder(node) > 3:
                ladders.append(f"{module}:{node.lineno}")
    assert ladders == []
