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
    # (the hosts' own lines, relayed as "[stdout:N] ...": gloo's as its collectives connect)
    lines = [ln for ln in out.stdout.splitlines() if not ln.startswith("[stdout:")]
    first = lines[0]
    assert first.startswith("(8, 16)")
    assert abs(float(first.split()[-1]) - 1.0) < 1e-3
    assert lines[1].strip() == "8"  # the default view: x is the global array


def test_readme_says_what_the_full_run_needs_and_gives_a_quick_one() -> None:
    text = _readme()
    assert re.search(r"takes about \d+-\d+ minutes on 2 cores", text)
    for need in ("root", "sshd", "Slurm", "firewall", "Docker"):
        assert need in text, need
    (quick,) = re.findall(r"^(\.venv/bin/python -m pytest .*)$", text, re.MULTILINE)
    assert quick.endswith('-m "not bed"'), quick
    # Counts of tests go stale with every test added: the README states none.
    assert not re.search(r"\b\d[\d,]* (of (some|about) \d[\d,]* )?tests\b", text), \
        re.findall(r".{40}\d+ tests.{20}", text)


def test_the_quick_runs_marker_leaves_out_exactly_the_beds() -> None:
    """``-m "not bed"`` deselects a bed file's tests and keeps the others'."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-m", "not bed",
         "tests/test_launch_cli.py", "tests/test_readme.py"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    listed = [ln for ln in proc.stdout.splitlines() if "::" in ln]
    assert listed and all(ln.startswith("tests/test_readme.py::") for ln in listed), proc.stdout
    assert re.search(r"\d+ deselected", proc.stdout), proc.stdout
