"""The package stays `mypy --strict` and `ruff` clean (the project's conventions)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import early

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_ruff_clean() -> None:
    out = _run("ruff", "check", "colobus")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_mypy_strict_clean() -> None:
    # `mypy --no-incremental colobus`, started with the session (tests/early.py)
    out = early.result("mypy")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
