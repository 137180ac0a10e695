"""Processes of the test beds: found by command line, listed and killed per network namespace,
and waited for (:func:`wait_until`); a ``colobus`` command run without a process of its own
(:func:`run_cli`).

Shared by the beds that run daemons inside :mod:`netbed`'s namespaces
(:mod:`sshbed`'s sshds, :mod:`slurmbed`'s slurmds) and by the tests that check
no process outlived them.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection

__all__ = [
    "alive", "cmdline", "kill_ns_processes", "ns_pids", "processes_with", "run_cli", "wait_until",
]


def cmdline(pid: int) -> str:
    """``pid``'s command line, its words joined by spaces ("" when it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def processes_with(*words: str) -> list[int]:
    """Pids of live processes (not zombies) whose command line holds every word."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if not alive(int(entry)):
            continue
        text = [a.decode(errors="replace") for a in argv]
        if all(any(w in a for a in text) for w in words):
            found.append(int(entry))
    return found


def ns_pids(ns: str) -> list[int]:
    """Pids of the processes inside network namespace ``ns``."""
    proc = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                          timeout=30)
    return [int(x) for x in proc.stdout.split() if x.isdigit()]


def kill_ns_processes(ns: str, keep: Collection[int] = (), deadline_s: float = 10.0) -> None:
    """SIGKILL every process inside netns ``ns`` but ``keep`` (all were started by a bed),
    and wait until they are gone (at most ``deadline_s``)."""
    deadline = time.monotonic() + deadline_s
    while True:
        pids = [p for p in ns_pids(ns) if p != os.getpid() and p not in keep and alive(p)]
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def wait_until(pred: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``pred`` until true; past ``timeout`` seconds fail saying ``what`` was awaited."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def run_cli(argv: list[str], stdin: str = "") -> subprocess.CompletedProcess[str]:
    """``colobus ARGV`` through the command's own entry point, in this process: its output,
    errors and exit status as a process gives them, without an interpreter's start (about
    3 s of CPU with jax's import). For commands that end before starting anything
    (``manifest``, usage and key errors). ``stdin`` is what the command reads there; its
    colobus log lines go to its stderr as in a process; the colobus logger's level, which
    the command sets, is put back."""
    from colobus._tools import cli

    out, err = io.StringIO(), io.StringIO()
    colobus_log = logging.getLogger("colobus")
    level = colobus_log.level
    said = logging.StreamHandler(err)
    colobus_log.addHandler(said)
    real_stdin, sys.stdin = sys.stdin, io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(argv)
    except SystemExit as exc:  # argparse's own errors (status 2)
        code = int(exc.code or 0)
    finally:
        sys.stdin = real_stdin
        colobus_log.removeHandler(said)
        colobus_log.setLevel(level)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
