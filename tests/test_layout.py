"""The package's layout is its architecture: parts import only downwards, no cycles.

Every import among colobus modules counts here: at run time, inside functions,
and under ``TYPE_CHECKING`` (a part that names the facade in a type hint
depends on it as much as one that calls it). ``docs/architecture.md`` draws the
same map.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "colobus"

# What each part may import (besides itself). Read downwards: _api, _launch ->
# _controller -> _observe -> _wire -> _model; _host -> _wire -> _model. _errors and _process
# are leaves every part may use; _tools (the command line) may use anything.
BASE = {"_errors", "_process"}
ALLOWED: dict[str, set[str]] = {
    "_model": BASE,
    "_wire": BASE | {"_model"},
    "_observe": BASE | {"_wire", "_model"},
    "_host": BASE | {"_wire", "_model"},
    "_controller": BASE | {"_observe", "_wire", "_model"},
    "_api": BASE | {"_controller", "_observe", "_wire", "_model"},
    "_launch": BASE | {"_controller", "_observe", "_wire", "_model"},
    "_relay": BASE | {"_wire", "_model"},
    "_errors": set(),
    "_process": set(),
}
MAX_LINES = 500
MAX_TOP_LEVEL_MODULES = 12


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` names a module when `pkg.sub` is one.
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    mods = _modules(package)
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the package itself (colobus)


def _against_layout(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for mod, deps in graph.items():
        part = _part(mod)
        if part is None or part == "_tools" or part == "__main__":
            continue  # the public package and the command line may use every part
        allowed = ALLOWED.get(part)
        assert allowed is not None, f"{mod}: a part the layout test does not know; add it"
        for dep in deps:
            dep_part = _part(dep)
            if dep_part == part:
                continue
            if dep_part is None and dep == "colobus" and part != "_tools":
                wrong.append(f"{mod} imports the public package")
            elif dep_part not in allowed:
                wrong.append(f"{mod} -> {dep}")
    return sorted(wrong)


def test_parts_import_only_downwards() -> None:
    wrong = _against_layout(_graph())
    assert not wrong, "imports against the layout:\n" + "\n".join(wrong)


def test_the_runtime_never_imports_the_tools() -> None:
    wrong = [f"{m} -> {d}" for m, deps in _graph().items() for d in deps
             if _part(d) == "_tools" and _part(m) not in ("_tools", "__main__")]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_modules_are_small_and_few_at_the_top() -> None:
    top = [p.name for p in PACKAGE.glob("*.py")]
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} modules directly in colobus/: {top}"
    big = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_the_check_sees_wrong_imports_of_every_kind(tmp_path: Path) -> None:
    """A guard on the guard: upward imports at run time, inside a function and for
    type hints only are all caught, and so is a cycle between two modules of a part."""
    pkg = tmp_path / "colobus"
    for part in ("_host", "_wire", "_controller", "_model"):
        (pkg / part).mkdir(parents=True)
        (pkg / part / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "_controller" / "facade.py").write_text("X = 1\n")
    (pkg / "_host" / "a.py").write_text("from .._controller.facade import X\n")
    (pkg / "_model" / "b.py").write_text("def f():\n    from .._wire import c\n")
    (pkg / "_wire" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .._host.a import X\n")
    (pkg / "_wire" / "d.py").write_text("from . import e\n")
    (pkg / "_wire" / "e.py").write_text("from .d import *\n")
    graph = _graph(pkg)
    assert _against_layout(graph) == [
        "colobus._host.a -> colobus._controller.facade",
        "colobus._model.b -> colobus._wire.c",
        "colobus._wire.c -> colobus._host.a",
    ]
    assert "colobus._wire.e" in graph["colobus._wire.d"]
    assert "colobus._wire.d" in graph["colobus._wire.e"]


# -- docs/ is for users ------------------------------------------------------------------

DOCS = PACKAGE.parent / "docs"
PERFORMANCE_MAX_LINES = 320  # what to expect, how to measure, what to tune: not a log
LOG_WORDS = re.compile(r"\bsession [0-9]|\bround [0-9]|\bissue [0-9]", re.IGNORECASE)


def test_the_performance_page_stays_a_user_page() -> None:
    """The record of experiments lives in benchmarks/NOTES.md, not in the docs."""
    lines = (DOCS / "performance.md").read_text().count("\n")
    assert lines <= PERFORMANCE_MAX_LINES, (
        f"docs/performance.md has {lines} lines (at most {PERFORMANCE_MAX_LINES}): keep "
        "today's figures there and move the record of experiments to benchmarks/NOTES.md")
    notes = (PACKAGE.parent / "benchmarks" / "NOTES.md").read_text()
    dated = re.findall(r"^## (\d{4}-\d{2}-\d{2})", notes, re.MULTILINE)
    assert dated and dated == sorted(dated, reverse=True), dated  # newest first


def test_no_doc_page_speaks_of_sessions_rounds_or_issues() -> None:
    found = [f"docs/{page.name}:{n}: {line.strip()}"
             for page in sorted(DOCS.glob("*.md"))
             for n, line in enumerate(page.read_text().splitlines(), 1)
             if LOG_WORDS.search(line)]
    assert not found, "docs/ is for users; records go to benchmarks/NOTES.md:\n" + "\n".join(found)
    assert LOG_WORDS.search("measured in session 15") and LOG_WORDS.search("Issue 25's relays")
