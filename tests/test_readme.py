"""The README's promises: the two commands, and its example runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_ci_runs_exactly_the_readme_test_command() -> None:
    commands = re.findall(r"^(python3 -m venv .*)$", _readme(), re.MULTILINE)
    assert len(commands) == 2, commands
    demo, tests = commands
    assert "colobus demo" in demo
    assert "pytest" in tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci.splitlines()


def test_readme_example_runs(tmp_path: Path) -> None:
    block = re.search(r"```python\n(.*?)```", _readme(), re.DOTALL)
    assert block is not None
    script = tmp_path / "example.py"
    script.write_text(block.group(1))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=180, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    first = out.stdout.splitlines()[0]
    assert first.startswith("(8, 16)")
    assert abs(float(first.split()[-1]) - 1.0) < 1e-3
    assert out.stdout.splitlines()[1].strip() == "4"
