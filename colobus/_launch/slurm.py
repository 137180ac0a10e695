"""``cb.slurm_cluster``: workers on Slurm nodes, with the standard Slurm commands.

Two ways, chosen by ``$SLURM_JOB_ID``:

- **inside an allocation** (``salloc``, a batch script): one ``srun`` step per
  worker (``srun --nodes=1 --ntasks=1 --nodelist=NODE --overlap ...``), the key
  on the step's stdin as for ssh, stdin kept open (``--exit-on-stdin-eof``):
  :class:`SrunLauncher`, run by :class:`~colobus._launch.base.Workers`;
- **outside one**: a batch job (``sbatch --parsable``, the script on its
  stdin) whose single ``srun --label`` runs every worker, each restarted by a
  shell loop up to ``restart`` times. The key is a 0600 file in ``key_dir``
  (a directory the nodes share, by default ``~/.colobus/jobs``), removed on
  exit; the script names its path, never the key. While the job waits,
  ``squeue -h -j ID -o '%T %r'`` gives its state and Slurm's reason, logged
  when they change; at the join timeout a still pending job raises
  ``TimeoutError`` naming the job and the reason. The job's output file is
  relayed as ``[host N]`` lines. Exit, an error and Ctrl-C ``scancel`` the job.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._controller.cluster import number_hosts_by_name
from .._controller.controller import Controller
from .._controller.environ import own_workers
from .._controller.procwatch import describe_exit
from .._wire.keys import generate_key, write_key
from .base import LaunchedCluster, Launcher
from .onhosts import relay_argv, relays_on_hosts_option
from .ssh import concrete_address, route_source

__all__ = ["SlurmJobCluster", "SrunLauncher", "batch_script", "node_names", "own_address",
           "parse_label_line", "parse_squeue", "slurm_cluster"]

log = logging.getLogger("colobus.launch.slurm")

POLL_S = 2.0  # how often squeue is asked while the job waits
NOTE_S = 30.0  # how often a job that keeps its state is logged again
FINISHED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
            "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED"}


def parse_squeue(text: str) -> tuple[str, str] | None:
    """``(state, reason)`` from ``squeue -h -j ID -o '%T %r'`` output; None: no such job.

    >>> parse_squeue("PENDING Resources\\n")
    ('PENDING', 'Resources')
    """
    for line in text.splitlines():
        words = line.split(None, 1)
        if words:
            return words[0], (words[1].strip() if len(words) > 1 else "")
    return None


def _why(state: tuple[str, str]) -> str:
    return f" ({state[1]})" if state[1] and state[1] != "None" else ""


def parse_label_line(line: str) -> tuple[int | None, str]:
    """``(task, text)`` from a line ``srun --label`` wrote (``"3: text"``)."""
    head, sep, rest = line.partition(": ")
    if sep and head.strip().isdigit():
        return int(head.strip()), rest
    return None, line


def node_names(nodelist: str) -> list[str]:
    """The node names of a Slurm node list (``scontrol show hostnames``)."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                         text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"`scontrol show hostnames {nodelist}` failed: {out.stderr.strip()}")
    return out.stdout.split()


def _worker_argv(python: str, connect: str, devices: int) -> list[str]:
    return [*shlex.split(python), "-m", "colobus", "worker", "--connect", connect,
            "--devices", str(devices)]


def batch_script(*, nodes: int, workers_per_node: int, python: str, connect: str,
                 devices: int, key_file: str, restart: int, output: str,
                 srun_args: Sequence[str] = (), job_name: str = "colobus-workers",
                 give_up_after: float = 300.0) -> str:
    """The batch script that runs every worker of a :func:`slurm_cluster` job.

    It names the key file (a path), never the key. Worker ``k`` is Slurm task
    ``k`` (``$SLURM_PROCID``), named ``slurm-k``; a worker that exits with a
    non-zero status is started again, at most ``restart`` times, except one that
    gave up after ``give_up_after`` seconds without a controller (status 3).
    """
    worker = shlex.join(_worker_argv(python, connect, devices)) + \
        ' --name "slurm-$SLURM_PROCID" --key-file ' + shlex.quote(key_file) + \
        f" --give-up-after {give_up_after:g}"
    loop = "n=0; while :; do " + "; ".join([
        worker,
        "s=$?",
        '[ "$s" -eq 0 ] && exit 0',
        '[ "$s" -eq 3 ] && exit 3',  # gave up: no controller
        f'[ "$n" -ge {restart} ] && exit "$s"',
        "n=$((n+1))",
        f'echo "colobus: the worker exited with status $s; restarting it ($n of {restart})" >&2',
    ]) + "; done"
    srun = shlex.join(["srun", "--label", "--kill-on-bad-exit=0", *srun_args, "/bin/sh", "-c",
                       loop])
    return "\n".join([
        "#!/bin/sh",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={workers_per_node}",
        f"#SBATCH --output={output}",
        "export PYTHONUNBUFFERED=1",
        f"exec {srun}",
        "",
    ])


class SrunLauncher(Launcher):
    """Inside an allocation: one ``srun`` step per worker, the key on its stdin."""

    kind = "slurm"
    log = log

    def __init__(self, nodes: Sequence[str], workers_per_node: int, devices: int, *,
                 python: str, srun_args: Sequence[str] = ()) -> None:
        self.nodes = [n for n in nodes for _ in range(workers_per_node)]
        super().__init__([f"slurm-{n}-{k}" for n in nodes for k in range(workers_per_node)])
        self.devices = devices
        self.python = python
        self.srun_args = list(srun_args)

    def describe(self, i: int) -> str:
        return f"slurm host {i} (node {self.nodes[i]!r})"

    def command(self, i: int, connect: str) -> list[str]:
        """The ``srun`` command line of host ``i`` (no secret in it)."""
        return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={self.nodes[i]}", "--overlap",
                "--kill-on-bad-exit=1", *self.srun_args,
                *_worker_argv(self.python, connect, self.devices), "--name", self.names[i],
                "--key-file", "-", "--exit-on-stdin-eof"]

    def relay_command(self, i: int, connect: str) -> list[str]:
        return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={self.nodes[i]}", "--overlap",
                "--kill-on-bad-exit=1", *shlex.split(self.python), "-m", "colobus",
                *relay_argv(connect, i)]

    def relay_env(self) -> dict[str, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("COLOBUS_KEY_FILE", None)
        return env

    def start(self, i: int, connect: str, key: bytes) -> subprocess.Popen[bytes]:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("COLOBUS_KEY_FILE", None)
        proc = subprocess.Popen(self.command(i, connect), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                start_new_session=True)
        assert proc.stdin is not None
        try:
            proc.stdin.write(key.hex().encode() + b"\n")
            proc.stdin.flush()
        except OSError:
            pass
        return proc

    def failure(self, i: int, code: int, stderr: Sequence[str]) -> Exception:
        said = "; ".join(line.strip() for line in stderr if line.strip())[-600:]
        return RuntimeError(f"the srun step of {self.describe(i)} {describe_exit(code)} "
                            f"before its worker joined" + (f": {said}" if said else ""))


class _JobNames(Launcher):
    """The names and messages of a batch job's workers (the job starts them, not us)."""

    kind = "slurm"
    log = log

    def start(self, i: int, connect: str, key: bytes) -> subprocess.Popen[bytes]:
        raise AssertionError("a batch job's workers are started by Slurm")


class SlurmJobCluster(LaunchedCluster):
    """Outside an allocation: the workers as one ``sbatch`` job; see :func:`slurm_cluster`."""

    def __init__(self, nodes: int, devices_per_host: int, *, workers_per_node: int,
                 sbatch_args: Sequence[str], srun_args: Sequence[str], python: str,
                 restart: int, bind: str | None, key_dir: str | os.PathLike[str] | None,
                 **options: Any) -> None:
        count = nodes * workers_per_node
        if options.pop("relays_on_hosts", 0):
            raise ValueError("relays_on_hosts= places relays with srun steps, inside an "
                             "allocation (salloc, or a job script); a batch job of workers "
                             "can run `colobus relay --connect ...` itself (docs/deployment.md)")
        key = generate_key()
        options.setdefault("exit_workers_on_close", True)
        bind = bind or f"tcp://{own_address()}:*"
        with own_workers():  # its address, whatever a surrounding launch says
            controller = Controller(bind, hosts=count, key=key, **options)
        super().__init__(_JobNames([f"slurm-{k}" for k in range(count)]), controller, key,
                         restart=restart,
                         connect=lambda address: concrete_address(address, own_address))
        self.nodes = nodes
        self.devices = devices_per_host
        self.workers_per_node = workers_per_node
        self.sbatch_args = list(sbatch_args)
        self.srun_args = list(srun_args)
        self.python = python
        self.key_dir = Path(key_dir if key_dir is not None
                            else Path.home() / ".colobus" / "jobs").expanduser()
        # A worker of the job exits after this long without a controller (a driver
        # killed before it could scancel): the join timeout, and a margin.
        self.give_up_after = float(options.get("join_timeout", 120.0)) + 60.0
        self.job_id: str | None = None
        self.state: tuple[str, str] | None = None
        self._tag = secrets.token_hex(4)
        self.key_file = self.key_dir / f"colobus-{self._tag}.key"
        self.output = self.key_dir / f"colobus-{self._tag}.out"
        self._stop_tail = threading.Event()
        self._tail: threading.Thread | None = None

    def script(self, connect: str) -> str:
        """The batch script this cluster submits."""
        return batch_script(nodes=self.nodes, workers_per_node=self.workers_per_node,
                            python=self.python, connect=connect, devices=self.devices,
                            key_file=str(self.key_file), restart=self.restart,
                            output=str(self.output), srun_args=self.srun_args,
                            give_up_after=self.give_up_after)

    def _spawn(self) -> None:
        ctl = self.controller
        number_hosts_by_name(ctl, self.launcher.names)
        self.key_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_key(self.key_file, self._key)
        out = subprocess.run(["sbatch", "--parsable", *self.sbatch_args],
                             input=self.script(self.connect_address()), capture_output=True,
                             text=True,
                             timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch refused the colobus worker job: {out.stderr.strip()}")
        self.job_id = out.stdout.strip().split(";")[0]
        log.info("submitted slurm job %s (%d workers on %d nodes); waiting for it to start",
                 self.job_id, len(self.launcher.names), self.nodes)
        self._tail = threading.Thread(target=self._relay_output, name="colobus-slurm-output",
                                      daemon=True)
        self._tail.start()

    def poll_state(self) -> tuple[str, str] | None:
        """The job's ``(state, reason)`` from ``squeue`` (None: Slurm no longer lists it)."""
        assert self.job_id is not None
        out = subprocess.run(["squeue", "-h", "-j", self.job_id, "-o", "%T %r"],
                             capture_output=True, text=True, timeout=30)
        return parse_squeue(out.stdout) if out.returncode == 0 else None

    async def _wait_joined(self) -> None:
        ctl = self.controller
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + ctl.join_timeout
        started = time.monotonic()
        next_poll = 0.0
        next_note = started + NOTE_S
        while True:
            if time.monotonic() >= next_poll:
                state = await loop.run_in_executor(None, self.poll_state)
                next_poll = time.monotonic() + POLL_S
                if state != self.state:
                    if state is not None:
                        log.info("slurm job %s: %s%s", self.job_id, state[0], _why(state))
                    self.state = state
                elif state is not None and time.monotonic() >= next_note:
                    log.info("slurm job %s still %s%s after %.0f s; waiting for its %d "
                             "worker(s) to join (timeout %.0f s)", self.job_id, state[0],
                             _why(state), time.monotonic() - started,
                             len(self.launcher.names), ctl.join_timeout)
                    next_note = time.monotonic() + NOTE_S
                if state is None or state[0] in FINISHED:
                    raise RuntimeError(
                        f"slurm job {self.job_id} ended ({state[0] if state else 'gone'}) "
                        f"before every worker joined; see its output {self.output}")
            try:
                await ctl.wait_for_hosts(timeout=0.5)
                if self.state is None or self.state[0] != "RUNNING":  # joined between polls
                    log.info("slurm job %s: RUNNING (its workers joined)", self.job_id)
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    if self.state is not None and self.state[0] == "PENDING":
                        raise TimeoutError(
                            f"slurm job {self.job_id} is still pending after "
                            f"{ctl.join_timeout:g} s (Slurm's reason: {self.state[1]}); "
                            "it is cancelled") from None
                    raise TimeoutError(f"slurm job {self.job_id}: {self.join_timed_out()}; "
                                       "it is cancelled") from None

    def _relay_output(self) -> None:
        """Copy the job's output file to logging as ``[host N]`` lines, as it grows."""
        f = None
        try:
            while not self._stop_tail.is_set():
                if f is None:
                    try:
                        f = open(self.output, encoding="utf-8", errors="replace")
                    except OSError:
                        self._stop_tail.wait(0.5)
                        continue
                line = f.readline()
                if not line:
                    self._stop_tail.wait(0.2)
                    continue
                task, text = parse_label_line(line.rstrip("\n"))
                if task is None:
                    log.info("[job %s] %s", self.job_id, text)
                else:
                    log.info("[host %d] %s", task, text)
        finally:
            if f is not None:
                f.close()

    def _cancel(self) -> None:
        if self.job_id is not None:
            out = subprocess.run(["scancel", self.job_id], capture_output=True, text=True,
                                 timeout=60)
            if out.returncode != 0:
                log.warning("scancel %s failed: %s", self.job_id, out.stderr.strip())
            else:
                log.info("cancelled slurm job %s", self.job_id)

    def _stop_workers(self, failed: bool) -> None:
        self._cancel()  # the job's steps, every worker with them, either way
        self._cleanup()

    def _cleanup(self) -> None:
        self._stop_tail.set()
        if self._tail is not None:
            self._tail.join(2.0)
        for p in (self.key_file, self.output):
            try:
                p.unlink()
            except OSError:
                pass


def own_address() -> str:
    """This machine's address that the nodes can reach: the one toward the Slurm
    controller (``scontrol show config``: ``SlurmctldHost[0] = NAME(ADDRESS)``), else
    this host name's; a loopback address only where nothing else is found."""
    found: list[str] = []
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                             timeout=30)
        m = re.search(r"^SlurmctldHost\[0\]\s*=\s*([^\s(]+)(?:\(([^)]+)\))?", out.stdout,
                      re.M)
        if m:
            found += [t for t in (m.group(2), m.group(1)) if t]
    except (OSError, subprocess.TimeoutExpired):
        pass
    found.append(socket.gethostname())
    sources = []
    for target in found:
        try:
            sources.append(route_source(target))
        except OSError:
            continue
    for address in sources:
        if not address.startswith("127."):
            return address
    return sources[0] if sources else socket.gethostname()


def slurm_cluster(nodes: int = 1, devices_per_host: int = 1, *, workers_per_node: int = 1,
                  sbatch_args: Sequence[str] = (), srun_args: Sequence[str] = (),
                  python: str = sys.executable, restart: int = 0, bind: str | None = None,
                  key_dir: str | os.PathLike[str] | None = None,
                  **options: Any) -> LaunchedCluster:
    """A controller here plus workers on Slurm nodes: ``srun`` steps or an ``sbatch`` job.

    Inside an allocation (``$SLURM_JOB_ID`` set) each worker is an ``srun``
    step on one of the allocation's nodes; outside one, the workers are
    submitted as a batch job, whose id and state are logged while it waits
    and which is cancelled on exit, on error and on Ctrl-C. Use as ``async
    with`` or ``with``, like :func:`local_cluster`.

    Args:
        nodes: how many nodes.
        devices_per_host: CPU devices per worker (``colobus worker --devices``).
        workers_per_node: workers (hosts) on each node.
        sbatch_args: extra ``sbatch`` arguments (``--partition=gpu``, ``--time=...``).
        srun_args: extra ``srun`` arguments (``--gpus-per-task=1``, ...).
        python: the Python on the nodes that has colobus installed.
        restart: how often each worker may be started again after it died.
        bind: the controller's endpoint (default: this machine's address, a random port).
        key_dir: outside an allocation, where the job's key file is written
            (0600; a directory every node can read, default ``~/.colobus/jobs``).
        **options: :class:`Controller` options (``join_timeout``, ...).

    Raises:
        TimeoutError: on entry, the job was still pending (or the workers had not
            all joined) at ``join_timeout``; the message names the job and Slurm's reason.
        RuntimeError: on entry, ``sbatch`` refused the job, or the job or an
            ``srun`` step ended before its workers joined.
    """
    if nodes < 1 or workers_per_node < 1 or devices_per_host < 1:
        raise ValueError("slurm_cluster needs nodes, workers_per_node and devices_per_host >= 1")
    if not os.environ.get("SLURM_JOB_ID"):
        return SlurmJobCluster(nodes, devices_per_host, workers_per_node=workers_per_node,
                               sbatch_args=sbatch_args, srun_args=srun_args, python=python,
                               restart=restart, bind=bind, key_dir=key_dir, **options)
    names = node_names(os.environ.get("SLURM_JOB_NODELIST", os.environ.get("SLURM_NODELIST",
                                                                           "")))
    if len(names) < nodes:
        raise ValueError(f"slurm_cluster(nodes={nodes}) inside job {os.environ['SLURM_JOB_ID']}"
                         f", whose allocation has {len(names)} node(s): {', '.join(names)}")
    launcher = SrunLauncher(names[:nodes], workers_per_node, devices_per_host, python=python,
                            srun_args=srun_args)
    key = generate_key()
    options.setdefault("exit_workers_on_close", True)
    per = relays_on_hosts_option(options.pop("relays_on_hosts", 0), options)
    if bind is None:
        try:
            bind = f"tcp://{route_source(names[0])}:*"
        except OSError:
            bind = f"tcp://{own_address()}:*"
    with own_workers():  # its address, whatever a surrounding launch says
        controller = Controller(bind, hosts=len(launcher.names), key=key, **options)
    return LaunchedCluster(launcher, controller, key, restart=restart, relays_on_hosts=per)
