"""The ``colobus`` command as a user runs it, no tracebacks: the installed console script
(help, version, a usage error and a key error), and the other errors through the command's
entry point in this process (:func:`nsprocs.run_cli`: the same output and status, without
an interpreter's start each)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from nsprocs import run_cli

import colobus as cb

SCRIPT = Path(sys.executable).parent / "colobus"


def _colobus(*args: str, timeout: float = 60, stdin: str | None = None,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    assert SCRIPT.exists(), f"no console script at {SCRIPT}: pip install -e . first"
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          input=stdin, env=env)


def _cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return run_cli(list(args), stdin)


def _one_line_error(proc: subprocess.CompletedProcess[str], status: int = 2) -> str:
    assert proc.returncode == status, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_no_arguments_prints_help_and_version_works() -> None:
    proc = _colobus()
    assert proc.returncode == 0, proc.stderr
    assert "usage: colobus" in proc.stdout
    for command in ("worker", "keygen", "demo", "bench", "top"):
        assert command in proc.stdout
    version = _colobus("--version")
    assert version.returncode == 0
    assert version.stdout.strip() == f"colobus {cb.__version__}"


def test_every_option_has_help_text() -> None:
    from colobus._tools.cli import build_parser

    parser = build_parser()
    parsers = [parser]
    for p in parsers:  # grows as it goes: `launch` and `manifest` have subcommands too
        for action in p._actions:
            if action.choices and isinstance(action.choices, dict):
                parsers.extend(action.choices.values())
    assert len(parsers) == 13  # (relay: colobus relay --connect)
    for p in parsers:
        assert not p.allow_abbrev, p.prog
        for action in p._actions:
            if action.dest != "command":
                assert action.help, f"{p.prog} {action.option_strings or action.dest}"


def test_abbreviations_are_off_and_the_secret_is_not_echoed(tmp_path: Path) -> None:
    secret = "ab" * 32
    line = _one_line_error(_colobus("worker", "--connect", "tcp://127.0.0.1:9", "--key", secret))
    assert "unrecognized arguments" in line
    assert secret not in line
    assert "--key ..." in line and "--help" in line


@pytest.mark.parametrize(("endpoint", "why"), [
    ("localhost:5555", "did you mean tcp://localhost:5555"),
    ("tcp://localhost", "has no port"),
    ("tcp://localhost:", "has no port"),
    ("tcp://localhost:http", "not a number"),
    ("udp://h:1", "not supported"),
])
def test_malformed_connect_is_one_line_and_status_2(endpoint: str, why: str) -> None:
    line = _one_line_error(_cli("worker", "--connect", endpoint), 2)
    assert why in line and "--connect" in line


def test_key_file_errors_are_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope.key"
    line = _one_line_error(_colobus("worker", "--connect", "tcp://127.0.0.1:9",
                                    "--key-file", str(missing)))  # the console script
    assert str(missing) in line and "colobus keygen" in line
    bad = tmp_path / "bad.key"
    bad.write_text("not hex\n")
    line = _one_line_error(_cli("worker", "--connect", "tcp://127.0.0.1:9",
                                    "--key-file", str(bad)))
    assert "chmod 600" in line  # readable by others: refused before it is read
    bad.chmod(0o600)
    line = _one_line_error(_cli("worker", "--connect", "tcp://127.0.0.1:9",
                                    "--key-file", str(bad)))
    assert "not a colobus key (expected hex)" in line
    line = _one_line_error(_cli("worker", "--connect", "tcp://127.0.0.1:9",
                                    "--key-file", str(tmp_path)))  # a directory
    assert "colobus keygen" in line
    line = _one_line_error(_cli("worker", "--connect", "tcp://127.0.0.1:9",
                                    "--key-file", "-", stdin="zz\n"))
    assert "expected hex" in line
    line = _one_line_error(_cli("worker", "--connect", "tcp://127.0.0.1:9"))
    assert "needs the controller's key" in line
    if os.geteuid() != 0:  # root reads a 0000 file all the same
        bad.chmod(0)
        line = _one_line_error(_cli("worker", "--connect", "tcp://127.0.0.1:9",
                                        "--key-file", str(bad)))
        assert "ermission" in line


def test_curve_keys_read_from_stdin_are_checked_and_not_echoed() -> None:
    args = ["worker", "--connect", "tcp://127.0.0.1:9", "--key-file", "-",
            "--curve-key-file", "-", "--server-key", "-"]
    line = _one_line_error(_cli(*args, stdin="ab" * 32 + "\nnot-a-secret\nnot-a-key\n"))
    assert "not a Z85 CurveZMQ secret key" in line and "not-a-secret" not in line
    secret = "x" * 40  # Z85-shaped, but the server's key line is not a key
    line = _one_line_error(_cli(*args, stdin="ab" * 32 + f"\n{secret}\nnot-a-key\n"))
    assert "Z85 public key" in line and secret not in line


def test_demo_hosts_0_is_a_usage_error() -> None:
    line = _one_line_error(_cli("demo", "--hosts", "0"))
    assert "--hosts" in line and "1 or more" in line


def test_keygen_refuses_to_overwrite_and_missing_directories(tmp_path: Path) -> None:
    path = tmp_path / "k"
    assert _cli("keygen", str(path)).returncode == 0
    first = path.read_text()
    line = _one_line_error(_cli("keygen", str(path)), 1)
    assert "--force" in line and str(path) in line
    assert path.read_text() == first  # untouched
    forced = _cli("keygen", "--force", str(path))
    assert forced.returncode == 0, forced.stderr
    assert path.read_text() != first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    line = _one_line_error(_cli("keygen", str(tmp_path / "missing" / "k")))
    assert "no directory" in line
    curve = tmp_path / "c"
    assert _cli("keygen", "--curve", str(curve)).returncode == 0
    line = _one_line_error(_cli("keygen", "--curve", str(curve)), 1)
    assert "--force" in line


def test_driver_example_with_missing_key_file_says_keygen(tmp_path: Path) -> None:
    example = Path(__file__).parent.parent / "examples" / "async_training_loop.py"
    proc = subprocess.run(
        [sys.executable, str(example), "--bind", "tcp://127.0.0.1:0", "--hosts", "1",
         "--key-file", str(tmp_path / "none.key")],
        capture_output=True, text=True, timeout=120)
    line = _one_line_error(proc, 2)
    assert "colobus keygen" in line



def test_bench_help_lists_every_benchmark() -> None:
    from colobus._tools.bench import BENCHMARKS

    out = run_cli(["bench", "--help"])
    assert out.returncode == 0
    listed = re.findall(r"^  (\w+) +\S", out.stdout.split("benchmarks (NAME):", 1)[1], re.M)
    assert listed == list(BENCHMARKS), out.stdout


def test_bench_keeps_info_lines_out_of_its_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its clusters' INFO lines would cut through the table: bench logs warnings only,
    unless COLOBUS_LOG_LEVEL or -v says otherwise."""
    import logging

    from colobus._tools import bench

    levels = []
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: levels.append(
        logging.getLogger("colobus").getEffectiveLevel()) or 0)
    monkeypatch.delenv("COLOBUS_LOG_LEVEL", raising=False)
    assert run_cli(["bench", "latency"]).returncode == 0
    monkeypatch.setenv("COLOBUS_LOG_LEVEL", "INFO")
    assert run_cli(["bench", "latency"]).returncode == 0
    assert levels == [logging.WARNING, logging.INFO]
