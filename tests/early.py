"""Long child processes that a test only waits for, started when the session starts.

``mypy --strict`` over the package (``test_lint.py``) is one long child process
with no deadline of its own; so is building the compose simulation's image
(``test_compose.py``: a Debian base, wheels, ``docker build``; minutes on a
fresh machine). Most tests spend their time waiting on sockets,
processes and timeouts rather than on the CPU, so it runs beside them from the
start, at a low CPU priority (mypy at the lowest; the image build at nice 10,
since at 19 beside a busy core its Compose probe could not start within 30 s):
``conftest.py`` calls :func:`start_collected` once the session collected its
tests, and the test calls :func:`result`, which waits for the child (or runs it
then, when it was not started early: a test run on its own). What it checks is
unchanged; only when it runs. :func:`stop_all` ends what an interrupted session
leaves. (The child pytest of ``test_no_unpickle.py`` stays in line: its tests
have liveness deadlines and would compete with the suite's.)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CHECKS", "Finished", "result", "start", "start_collected", "stop_all"]

ROOT = Path(__file__).resolve().parent.parent


def _mypy() -> tuple[list[str], dict[str, str] | None]:
    # At the lowest priority: it takes only CPU time the tests leave (it has no deadline).
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    return [*nice, sys.executable, "-m", "mypy", "--no-incremental", "colobus"], None


def _compose_image() -> tuple[list[str], dict[str, str] | None]:
    # Mostly waiting on disk and dockerd; its own CPU at a low priority, not the lowest
    # (at 19 beside a busy core it got too little to start Compose v1 within 30 s).
    # Where no engine runs it exits at once, saying why (the tests skip).
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    return [*nice, sys.executable, str(ROOT / "tests" / "composeimage.py")], None


# name -> (the test, or a file's tests ("path::"), that waits for it; how to make its
# command and environment)
CHECKS: dict[str, tuple[str, Callable[[], tuple[list[str], dict[str, str] | None]]]] = {
    "mypy": ("tests/test_lint.py::test_mypy_strict_clean", _mypy),
    "compose-image": ("tests/test_compose.py::", _compose_image),
}


@dataclass
class Finished:
    """A child's end: its status and output."""

    returncode: int
    stdout: str
    stderr: str


@dataclass
class _Running:
    proc: subprocess.Popen[bytes]
    dir: tempfile.TemporaryDirectory[str] | None  # None: the shared folder (xdist)


_running: dict[str, _Running] = {}

# Under pytest-xdist the controller process starts the checks (it outlives every worker)
# in the folder this names, one folder per check with its stdout, stderr and, once it
# ended, rc; the worker that runs the check's test reads them there.
SHARED = "COLOBUS_EARLY_DIR"


def share() -> None:
    """The xdist controller, before its workers start: checks go to a shared folder."""
    os.environ[SHARED] = tempfile.mkdtemp(prefix="colobus-early-")


def _in_worker() -> bool:
    return bool(os.environ.get("PYTEST_XDIST_WORKER"))


def start(name: str) -> None:
    """Start check ``name`` now (once), in the repository root, for :func:`result`."""
    if name in _running:
        return
    shared = os.environ.get(SHARED)
    if shared and not _in_worker():
        base = Path(shared) / name
        base.mkdir()
        tmp = None
    else:
        tmp = tempfile.TemporaryDirectory(prefix=f"colobus-early-{name}-")
        base = Path(tmp.name)
    argv, env = CHECKS[name][1]()
    with open(base / "stdout", "wb") as out, open(base / "stderr", "wb") as err:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=err)
    _running[name] = _Running(proc, tmp)
    if tmp is None:  # tell the workers when it ends
        threading.Thread(target=_note_end, args=(proc, base), daemon=True).start()


def _note_end(proc: subprocess.Popen[bytes], base: Path) -> None:
    code = proc.wait()
    (base / "rc.tmp").write_text(str(code))
    os.replace(base / "rc.tmp", base / "rc")


def _shared_result(base: Path, timeout: float) -> Finished:
    deadline = time.monotonic() + timeout
    while not (base / "rc").exists():
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(str(base), timeout)
        time.sleep(0.2)
    return Finished(int((base / "rc").read_text()),
                    (base / "stdout").read_text(errors="replace"),
                    (base / "stderr").read_text(errors="replace"))


def start_collected(nodeids: Iterable[str]) -> None:
    """Start the checks whose test is among ``nodeids`` (the session's collected tests)."""
    wanted = {n.rpartition("@")[0] or n for n in nodeids}  # xdist: "id@group"
    for name, (test, _) in CHECKS.items():
        if test in wanted or (test.endswith("::") and any(n.startswith(test) for n in wanted)):
            start(name)


def result(name: str, timeout: float = 1200) -> Finished:
    """Check ``name``'s end (started now if it was not started early)."""
    shared = os.environ.get(SHARED)
    if shared and _in_worker() and (Path(shared) / name).is_dir():
        return _shared_result(Path(shared) / name, timeout)
    start(name)
    run = _running.pop(name)
    assert run.dir is not None  # started in this process: a folder of its own
    base = Path(run.dir.name)
    try:
        code = run.proc.wait(timeout)
        return Finished(code, (base / "stdout").read_text(errors="replace"),
                        (base / "stderr").read_text(errors="replace"))
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
        run.dir.cleanup()


def stop_all() -> None:
    """Kill and remove the checks no test collected (the session ends)."""
    for run in _running.values():
        if run.proc.poll() is None:
            run.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            run.proc.wait(10)
        if run.dir is not None:
            run.dir.cleanup()
    _running.clear()
    shared = os.environ.get(SHARED)
    if shared and not _in_worker():
        shutil.rmtree(shared, ignore_errors=True)
