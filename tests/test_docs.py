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
