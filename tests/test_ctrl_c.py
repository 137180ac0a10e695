"""Ctrl-C at every stage of ``colobus launch`` and of a script under ``with``.

Each run is real: ``colobus launch`` (or the script alone) in a session of its own, and
a Ctrl-C as a terminal sends it, SIGINT to the whole foreground process group, at the
stage named. The driver sends it itself at the exact moment (a log line, its workers'
processes up, the host code running), so no test waits on timing. Each run must end in
the driver's own ``KeyboardInterrupt`` and status 130 (a shell's status for a process
SIGINT ended), with every worker stopped, and no worker blamed for the interrupt.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SCRIPT = Path(sys.executable).parent / "colobus"

DRIVER = textwrap.dedent("""
    import logging, os, signal, sys, threading, time
    from pathlib import Path
    import numpy as np
    import colobus as cb

    TRIGGER = os.environ["FH_TRIGGER"]
    MARKS = Path(os.environ["FH_DIR"])
    JOB = os.environ.get("FH_JOB") == "1"
    HOSTS = 2

    def ctrl_c():  # what a terminal's Ctrl-C does: SIGINT to its foreground group
        print("CTRL-C at", TRIGGER, flush=True)
        os.killpg(os.getpgrp(), signal.SIGINT)

    class OnLine(logging.Handler):
        def __init__(self, text):
            super().__init__()
            self.text, self.fired = text, False

        def emit(self, record):
            if not self.fired and self.text in record.getMessage():
                self.fired = True
                ctrl_c()

    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s: %(message)s")
    lines = {"forming": "forming the cluster's JAX job"}
    if TRIGGER in lines:
        logging.getLogger("colobus").setLevel(logging.INFO)
        logging.getLogger("colobus").addHandler(OnLine(lines[TRIGGER]))

    def when(ready):
        def watch():
            while not ready():
                time.sleep(0.01)
            ctrl_c()
        threading.Thread(target=watch, daemon=True).start()

    @cb.colocated_python
    def hold(x):
        import os, time
        from pathlib import Path
        Path(os.environ["FH_DIR"], f"call-{os.getpid()}").touch()
        time.sleep(600)
        return x

    launched = bool(os.environ.get("COLOBUS_ADDRESS"))
    options = {} if launched else {"hosts": HOSTS, "jax_distributed": JOB}
    cluster = cb.local_cluster(**options)
    if TRIGGER == "spawned":  # its worker processes started, none joined yet
        when(lambda: len(cluster.procs) == HOSTS)
    if TRIGGER == "bound":  # (under colobus launch) bound; waits for the workers to join
        when(lambda: cluster.state.value == "running")
    if TRIGGER == "call":  # the host code runs on every host
        when(lambda: len(list(MARKS.glob("call-*"))) == HOSTS)
    try:
        with cluster as ctl:
            print("JOINED", flush=True)
            mesh = cb.Mesh(np.array(ctl.devices()), ("d",))
            x = cb.device_put(np.arange(HOSTS), cb.NamedSharding(mesh, cb.PartitionSpec("d")))
            np.asarray(hold(x))
            print("UNREACHED", flush=True)
    except KeyboardInterrupt:
        print("DRIVER KeyboardInterrupt", flush=True)
        raise
""")

# What must never be said after a Ctrl-C: a worker blamed, a host lost, JAX aborting.
BLAME = ("before joining", "exited with status", "was lost", "HostLostError",
         "the driver was stopped", "error:", "never retrieved", "Exception ignored")
# A worker that ignored being told to stop (SIGTERM) and had to be killed. In a JAX job
# that depends on the worker's side (issue 63's `jobsafe` part: JAX's preemption handler
# took SIGTERM from colobus's worker).
KILLED = "of being told to stop (SIGTERM); killed"
JAX_ABORTS = ("FATAL", "Aborted", "SIGABRT", "exception not rethrown", "terminate called")


def _workers_of(marks: Path) -> list[int]:
    """The live colobus workers started for this run (their environment names ``marks``)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if b"worker" in cmdline and f"FH_DIR={marks}\0".encode() in environ:
            found.append(int(entry))
    return found


def _run(cmd: list[str], marks: Path, trigger: str, job: bool,
         interrupt_on: str | None = None) -> tuple[int, str, str]:
    """Run ``cmd`` in a session of its own; returns its status, stdout and stderr.

    ``interrupt_on``: send the Ctrl-C from here, when a stderr line holds this text (before
    any driver runs, there is none to send it).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLOBUS_")}
    env.update(FH_TRIGGER=trigger, FH_DIR=str(marks), FH_JOB="1" if job else "0",
               PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=marks,
                            start_new_session=True)
    try:
        err_lines: list[str] = []
        if interrupt_on is not None:
            assert proc.stderr is not None
            for line in proc.stderr:
                err_lines.append(line)
                if interrupt_on in line:
                    os.killpg(proc.pid, signal.SIGINT)
                    break
        try:
            out, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:  # say what it printed, and what still runs
            left = subprocess.run(["ps", "-eLo", "pid,tid,ppid,stat,wchan:24,comm,args"],
                                  capture_output=True, text=True).stdout
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"{cmd} did not end within 240 s of the Ctrl-C\n--- stdout\n"
                        f"{out[-3000:]}\n--- stderr\n{(''.join(err_lines) + err)[-6000:]}"
                        f"\n--- processes\n{left[-12000:]}")
        return proc.returncode, out, "".join(err_lines) + err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _check_ended_by_the_interrupt(status: int, out: str, err: str, marks: Path,
                                  expected: int) -> None:
    assert status == expected, (status, out[-2000:], err[-4000:])
    for said in (*BLAME, KILLED):
        assert said not in err, (said, err[-4000:])
    assert "UNREACHED" not in out
    deadline = time.monotonic() + 5  # (reaped before the run ended; /proc catches up)
    while _workers_of(marks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _workers_of(marks), f"workers left behind: {_workers_of(marks)}"


def _check_driver_interrupted(out: str, err: str, trigger: str) -> None:
    assert f"CTRL-C at {trigger}" in out, (out[-2000:], err[-3000:])
    assert "DRIVER KeyboardInterrupt" in out, (out[-2000:], err[-3000:])
    # its own traceback (the workers' lines a launch relays may come after it)
    assert re.search(r"^Traceback .*\n(.*\n)*?KeyboardInterrupt$", err, re.MULTILINE), err[-3000:]


@pytest.mark.parametrize(("trigger", "job"), [
    ("bound", False),      # the driver waits for the launched workers to join
    ("forming", True),     # they joined; the JAX job forms
    ("call", True),        # host code of a call runs, in the job
], ids=["workers-joining", "job-forming", "mid-call-in-a-job"])
def test_ctrl_c_under_colobus_launch(tmp_path: Path, trigger: str, job: bool) -> None:
    (tmp_path / "driver.py").write_text(DRIVER)
    cmd = [str(SCRIPT), "launch", "local", "--hosts", "2",
           *(["--jax-distributed"] if job else []), "--", "python", "driver.py"]
    status, out, err = _run(cmd, tmp_path, trigger, job)
    _check_ended_by_the_interrupt(status, out, err, tmp_path, 130)
    _check_driver_interrupted(out, err, trigger)
    if job:  # (a worker of a job ends without JAX aborting it: issue 63's jobsafe part)
        for said in JAX_ABORTS:
            assert said not in err, (said, err[-4000:])


def test_ctrl_c_while_colobus_launch_starts_its_workers(tmp_path: Path) -> None:
    """Before the driver runs: the launch stops, stops its workers, and never runs it."""
    (tmp_path / "driver.py").write_text(DRIVER)
    cmd = [str(SCRIPT), "launch", "local", "--hosts", "2", "--", "python", "driver.py"]
    status, out, err = _run(cmd, tmp_path, "none", False,
                            interrupt_on="starting 2 local worker(s)")
    _check_ended_by_the_interrupt(status, out, err, tmp_path, 130)
    assert out == "", out  # the driver never ran
    assert err.rstrip().endswith("colobus launch local: interrupted before the driver "
                                 "started; the workers were stopped"), err[-3000:]
    assert "Traceback" not in err, err[-3000:]


@pytest.mark.parametrize(("trigger", "job"), [
    ("spawned", False),  # the workers' processes started; none joined yet
    ("call", False),     # host code of a call runs (the block view)
    ("call", True),      # host code of a call runs, in the job
], ids=["workers-starting", "mid-call", "mid-call-in-a-job"])
def test_ctrl_c_in_a_script_under_with(tmp_path: Path, trigger: str, job: bool) -> None:
    (tmp_path / "driver.py").write_text(DRIVER)
    status, out, err = _run([sys.executable, "driver.py"], tmp_path, trigger, job)
    _check_ended_by_the_interrupt(status, out, err, tmp_path, -signal.SIGINT)
    _check_driver_interrupted(out, err, trigger)
    if trigger == "spawned":
        assert "JOINED" not in out
    if job:  # (as under colobus launch: depends on issue 63's jobsafe part)
        for said in JAX_ABORTS:
            assert said not in err, (said, err[-4000:])
