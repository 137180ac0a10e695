"""The docs site builds with ``mkdocs build --strict``, so a broken link fails CI."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import colobus as cb

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("mkdocs", reason="mkdocs is in the [test] extra")


def _build(project: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        # No --quiet: it hides warnings from the counter that makes --strict fail.
        [sys.executable, "-m", "mkdocs", "build", "--strict",
         "-f", str(project / "mkdocs.yml"), "-d", str(site)],
        cwd=project, capture_output=True, text=True, timeout=120)


def _nav_pages() -> list[str]:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    return [next(iter(entry.values())) for entry in config["nav"]]


def test_docs_build_strict(tmp_path: Path) -> None:
    proc = _build(ROOT, tmp_path / "site")
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    for page in _nav_pages():
        built = tmp_path / "site" / (page[:-3] + "/index.html" if page != "index.md"
                                      else "index.html")
        assert built.is_file(), page


def test_every_doc_page_is_in_the_nav() -> None:
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages == set(_nav_pages())


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The check above can fail: strict mode turns a link to a missing page into an error."""
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    with open(tmp_path / "docs" / "index.md", "a") as f:
        f.write("\nSee [the missing page](no_such_page.md).\n")
    proc = _build(tmp_path, tmp_path / "site")
    assert proc.returncode != 0
    assert "no_such_page.md" in proc.stdout + proc.stderr


def test_api_page_lists_every_public_name() -> None:
    text = (ROOT / "docs" / "api.md").read_text()
    listed = set(re.findall(r"^\| `([A-Za-z_]+)` \|", text, re.M))
    assert listed == set(cb.__all__), (
        f"missing from docs/api.md: {sorted(set(cb.__all__) - listed)}; "
        f"not public: {sorted(listed - set(cb.__all__))}")


# -- the Python snippets of the docs ------------------------------------------------------
#
# Every fenced ```python block of docs/*.md compiles (top-level ``await`` allowed:
# most blocks are parts of an ``async def main()``). A block runs, as a script of its
# own, unless the line before its fence is ``<!-- not run -->`` (a part of a program,
# a sketch needing a remote cluster or JAX's own runtime): a block that runs must be a
# complete program. docs/index.md says so for writers of docs.

NOT_RUN = "<!-- not run -->"
_FENCE = re.compile(r"^( *)```python\s*$")


def _python_blocks() -> list[tuple[str, int, str, bool]]:
    """(page, line of the fence, code, whether it runs) for every python block."""
    import textwrap

    found = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        lines = path.read_text().split("\n")
        i = 0
        while i < len(lines):
            m = _FENCE.match(lines[i])
            if not m:
                i += 1
                continue
            end = i + 1
            while not re.match(r"^ *```\s*$", lines[end]):
                end += 1
            code = textwrap.dedent("\n".join(lines[i + 1:end]))
            before = [ln.strip() for ln in lines[:i] if ln.strip()]
            runs = (not before or before[-1] != NOT_RUN)
            found.append((path.name, i + 1, code, runs))
            i = end + 1
    return found


def test_every_python_snippet_compiles() -> None:
    import ast

    blocks = _python_blocks()
    assert len(blocks) > 20
    for page, line, code, _ in blocks:
        try:
            compile(code, f"docs/{page}:{line}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        except SyntaxError as exc:
            raise AssertionError(f"docs/{page}:{line} does not compile: {exc}") from exc


@pytest.mark.parametrize(("page", "line", "code"),
                         [pytest.param(p, n, c, id=f"{p}:{n}")
                          for p, n, c, runs in _python_blocks() if runs])
def test_python_snippet_runs(page: str, line: int, code: str, tmp_path: Path) -> None:
    """The snippets not marked ``<!-- not run -->`` are whole programs that run as shown."""
    import os

    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        f"docs/{page}:{line} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def test_the_snippet_markers_are_seen() -> None:
    """A guard on the guard: marked blocks do not run, the whole programs do."""
    blocks = {(p, n): runs for p, n, _, runs in _python_blocks()}
    assert sum(blocks.values()) >= 4
    assert not all(blocks.values())


def test_the_compose_file_on_the_deployment_page_is_the_repositorys() -> None:
    text = (ROOT / "docs" / "deployment.md").read_text()
    (block,) = re.findall(r"```yaml\n(services:.*?)```", text, re.DOTALL)
    assert yaml.safe_load(block) == yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_both_kubernetes_recipes_name_the_secret_alike() -> None:
    """The hand-written recipe and `colobus manifest kubernetes`: one Secret, one key name,
    one mount path, so a Secret made for either serves both."""
    from colobus._launch import kubernetes as k8s

    text = (ROOT / "docs" / "deployment.md").read_text()
    made = re.findall(r"kubectl create secret generic (\S+)\s+--from-file=(\w+)=", text)
    assert made and set(made) == {(k8s.SECRET_NAME, "key")}, made
    recipe = text[text.index("\n## Kubernetes\n"):]
    assert f"{k8s.KEY_DIR}/key" in recipe and "/run/secrets/colobus" not in recipe
