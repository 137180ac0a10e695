r"""A real Slurm cluster on this machine, for tests: slurmctld, one slurmd per netns, munge.

Layout (built on :class:`netbed.NetBed`; ``X`` is the bed's free third octet)::

    root namespace (the test process, the colobus controller)
      munged        socket  <tmp>/run/munge.socket   (its own key, 0400)
      slurmctld     listens on SlurmctldPort (all addresses); SlurmctldHost = 10.211.X.1
      bridge        10.211.X.1/24
        |-- netns colobus-nb-PID-T-0   10.211.X.10   slurmd -D -N n0   (NodeName n0)
        |-- netns colobus-nb-PID-T-1   10.211.X.11   slurmd -D -N n1   (NodeName n1)
        ...

Nothing is mocked: ``sbatch``/``srun``/``squeue``/``scancel``/``sinfo`` from the
test process talk to the bed's slurmctld, authenticated by the bed's munged, and
jobs run on the bed's slurmd inside their network namespaces, so a job step sees
only its node's address (``hostname -I`` prints 10.211.X.10+i) and reaches the
root namespace through the bridge address (:attr:`SlurmBed.controller_ip`), as a
colobus worker started by ``srun`` reaches its controller.

Partitions:

- ``debug`` (Default=YES): every node, ``cpus_per_node`` CPUs each (4 by default,
  whatever the machine has: ``SlurmdParameters=config_overrides``), so one node
  runs several workers (``--ntasks-per-node``); CPUs are consumable
  (``select/cons_tres`` + ``CR_CPU``).
- ``hold`` (:attr:`SlurmBed.hold_partition`): the same nodes but ``State=DOWN``:
  a job sent there is accepted and stays PENDING for good, with
  ``squeue -h -j ID -o '%T %r'`` printing ``PENDING PartitionDown``
  (:data:`HOLD_REASON`).

Environment: the config is found through ``SLURM_CONF`` only (the munge socket
is named in it, ``AuthInfo=socket=...``). While a bed is open it sets
``os.environ["SLURM_CONF"]`` and removes other inherited ``SLURM_*`` variables
(the previous values come back on close), so
subprocesses started with the default environment use the bed; one started
with an explicit ``env=`` needs ``env={**os.environ, ...}`` or
``bed.env(...)``. Jobs inherit it (sbatch/srun export the whole environment
by default), so ``srun`` inside a batch job finds the same cluster.

Use (fixtures ``slurm_bed``/``slurm`` in ``tests/slurm_fixtures.py``)::

    with SlurmBed(nodes=2) as bed:                  # about a second to start
        job = bed.sbatch("#!/bin/sh\nhostname -I\n", "-N1")    # job id (str)
        bed.wait_job(job, None)                     # until squeue lists it no more
        bed.job_state(job, finished=True)           # ("COMPLETED", "None")
        open(bed.job_output_path(job)).read()       # "10.211.X.10 \n"
        bed.slurm("srun", "-N2", "hostname")        # any Slurm command, checked
        with bed.allocation(2) as env:              # inside a real salloc allocation:
            ...                                     #   SLURM_JOB_ID etc. in os.environ

Job ids restart at 1 in every bed (each has its own state); finished jobs
leave squeue at once (``squeue -t all`` shows them for ``min_job_age`` s).
Without ``-o``, a job's output file is ``slurm-ID.out`` in the submitter's cwd
(Slurm's default): :meth:`SlurmBed.sbatch` puts it in the bed's dir instead.

Everything the bed starts or writes is removed by :meth:`SlurmBed.close`
(idempotent; also after a failed start): jobs are cancelled, every process left
in the nodes' namespaces (slurmd, slurmstepd, job steps) is killed, then
slurmctld and munged, then the namespaces and the temp dir. Daemons die with
the test process too (``PR_SET_PDEATHSIG`` when started from the main thread),
and :func:`cleanup_leftovers` (run at each start, and by
``python tests/slurmbed.py --cleanup``) removes what a killed earlier run left.
Tests skip with :func:`unavailable_reason` where the bed cannot run.

Every wait is a poll with a deadline; a failure says what it waited for and
shows the tail of the daemons' logs (:meth:`SlurmBed.log_tail`).
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import netbed
from netbed import NetBed, pid_alive
from nsprocs import cmdline, kill_ns_processes, ns_pids

__all__ = [
    "DEFAULT_PARTITION", "HOLD_PARTITION", "HOLD_REASON", "SlurmBed", "SlurmBedError",
    "SlurmNode", "cleanup_leftovers", "unavailable_reason",
]

DEFAULT_PARTITION = "debug"
HOLD_PARTITION = "hold"  # State=DOWN: jobs sent there stay PENDING
HOLD_REASON = "PartitionDown"  # what squeue's %r shows for them
TMP_PREFIX = "colobus-slurmbed-"
SLURMD_PORT = 6818  # the same in every namespace: each has its own port space
BINARIES = ("nsenter", "munged", "munge", "unmunge", "slurmctld", "slurmd", "slurmstepd",
            "sbatch", "srun", "salloc", "squeue", "scancel", "sinfo", "scontrol")
SLURM_CLI_TIMEOUT = 30.0

_probe_result: list[str | None] = []


class SlurmBedError(RuntimeError):
    """The bed could not start (or a wait ran out); the message holds the logs' tails."""


def unavailable_reason() -> str | None:
    """Why a Slurm bed cannot run here (a skip reason), or None if it can."""
    if _probe_result:
        return _probe_result[0]
    reason = netbed.unavailable_reason()
    if reason is None:
        missing = [b for b in BINARIES if _which(b) is None]
        if missing:
            reason = (f"the Slurm test bed needs {', '.join(missing)} (Debian: apt-get install "
                      "slurm-wlm munge; .ci/run does it)")
    _probe_result.append(reason)
    return reason


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")


def cleanup_leftovers() -> list[str]:
    """Kill and remove what beds of dead test processes left; returns what was removed.

    For each namespace of a dead bed creator, the processes still in it (slurmd,
    slurmstepd, job steps) are killed before :func:`netbed.cleanup_leftovers`
    deletes it; for each ``colobus-slurmbed-*`` temp dir whose owner is dead, the
    daemons recorded in it (only if their command line names that dir) are killed
    and the dir is removed. Beds of live processes are left alone.
    """
    removed: list[str] = []
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                             timeout=30).stdout if shutil.which("ip") else ""
    for line in listing.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(netbed.NS_PREFIX):
            continue
        pid_text = name[len(netbed.NS_PREFIX):].split("-")[0]
        if pid_text.isdigit() and not pid_alive(int(pid_text)) and ns_pids(name):
            kill_ns_processes(name)
            removed.append(f"processes in {name}")
    tmp = tempfile.gettempdir()
    for entry in sorted(os.listdir(tmp)):
        path = os.path.join(tmp, entry)
        if not entry.startswith(TMP_PREFIX) or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, "owner.pid")) as f:
                owner = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if pid_alive(owner):
            continue
        with contextlib.suppress(OSError), open(os.path.join(path, "daemons.pid")) as f:
            for word in f.read().split():
                if word.isdigit() and path in cmdline(int(word)):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(word), signal.SIGKILL)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if shutil.which("ip"):
        removed += netbed.cleanup_leftovers()
    return removed


def _dying_with_parent(cmd: Sequence[str]) -> list[str]:
    """``cmd`` run so that it is killed when the thread that starts it ends.

    ``setpriv --pdeathsig`` (util-linux) sets PR_SET_PDEATHSIG and execs the
    command: no ``preexec_fn``, so no Python code runs between fork and exec (JAX
    warns from an at-fork hook, and the suite turns warnings into errors). On the
    main thread only: the signal follows the thread that forked.
    """
    if threading.current_thread() is threading.main_thread() and shutil.which("setpriv"):
        return ["setpriv", "--pdeathsig", "KILL", *cmd]
    return list(cmd)


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()[-20000:]
    except OSError as e:
        return f"({e.strerror})"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class SlurmNode:
    """One Slurm node: a netns of the bed with its slurmd."""

    name: str  # NodeName, n0, n1, ...
    ip: str  # its NodeAddr, the namespace's address
    ns: str  # the network namespace slurmd (and every job step on it) runs in


class SlurmBed:
    """slurmctld + ``nodes`` slurmd (one per network namespace) + munged, all real.

    Use as a context manager (``with SlurmBed(2) as bed:``) or ``create()``/``close()``.

    Args:
        nodes: how many nodes (namespaces), n0..n{nodes-1}.
        cpus_per_node: CPUs each node offers to Slurm (not tied to the machine's).
        start_timeout: seconds for the whole start, until every node is idle.
        min_job_age: ``MinJobAge``: seconds a finished job's record is kept (``scontrol
            show job``; squeue without ``-t all`` no longer lists a finished job).
        extra_conf: more ``slurm.conf`` lines, after the bed's own (a later line wins).
    """

    def __init__(self, nodes: int = 2, cpus_per_node: int = 4, *, start_timeout: float = 60.0,
                 min_job_age: int = 30, extra_conf: Sequence[str] = ()) -> None:
        self.extra_conf = list(extra_conf)
        self.net = NetBed(nodes)
        self.partition = DEFAULT_PARTITION
        self.hold_partition = HOLD_PARTITION
        self.hold_reason = HOLD_REASON
        self.cpus_per_node = cpus_per_node
        self.nodes: list[SlurmNode] = []
        self.start_timeout = start_timeout
        self.min_job_age = min_job_age
        self.dir = ""
        self.conf = ""
        self.munge_socket = ""
        self.cluster_name = ""
        self.controller_ip = ""
        self.ctld_port = 0
        self.start_seconds = 0.0  # how long create() took
        self._procs: list[tuple[str, subprocess.Popen[bytes], str]] = []  # (what, proc, log)
        self._extra_procs: list[subprocess.Popen[bytes]] = []  # salloc of allocation()
        self._saved_env: dict[str, str] = {}
        self._env_set = False
        self._closed = False
        self._created = False

    # -- starting -------------------------------------------------------------------------

    def __enter__(self) -> SlurmBed:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self) -> SlurmBed:
        """Start munged, slurmctld and the slurmds; return once every node is idle.

        Undoes everything it did if a step fails (then raises :class:`SlurmBedError`).
        """
        if self._created:
            raise RuntimeError("a SlurmBed starts once")
        self._created = True
        reason = unavailable_reason()
        if reason is not None:
            raise SlurmBedError(reason)
        t0 = time.monotonic()
        deadline = t0 + self.start_timeout
        try:
            cleanup_leftovers()
            self.net.create()
            self._layout()
            self._start_munged(deadline)
            self._start_slurmctld(deadline)
            self._start_slurmds()
            self.wait_nodes_idle(deadline - time.monotonic())
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def _layout(self) -> None:
        self.controller_ip = self.net.controller_ip
        self.cluster_name = f"cb{self.net.tag}"
        self.dir = tempfile.mkdtemp(prefix=TMP_PREFIX)
        os.chmod(self.dir, 0o755)  # munged wants every dir above its socket searchable
        for sub, mode in [("munge", 0o700), ("run", 0o755), ("log", 0o755), ("state", 0o700),
                          ("spool", 0o755)]:
            os.mkdir(os.path.join(self.dir, sub), mode)
        with open(os.path.join(self.dir, "owner.pid"), "w") as f:
            f.write(f"{os.getpid()}\n")
        self.munge_socket = os.path.join(self.dir, "run", "munge.socket")
        self.nodes = [SlurmNode(f"n{h.index}", h.ip, h.ns) for h in self.net.hosts]
        self.ctld_port = _free_port()
        self.conf = os.path.join(self.dir, "slurm.conf")
        with open(self.conf, "w") as f:
            f.write(self._slurm_conf())
        # SLURM_CONF names the bed's config; SLURM_* inherited from a real job around the
        # test run (SLURM_JOB_ID ...) would point srun at a job the bed does not have
        self._saved_env = {k: v for k, v in os.environ.items() if k.startswith("SLURM_")}
        for k in self._saved_env:
            del os.environ[k]
        os.environ["SLURM_CONF"] = self.conf
        self._env_set = True

    def _slurm_conf(self) -> str:
        d = self.dir
        debug = os.environ.get("COLOBUS_SLURMBED_DEBUG", "info")
        host = socket.gethostname().split(".")[0]
        lines = [
            "# written by colobus tests/slurmbed.py; removed with the bed",
            f"ClusterName={self.cluster_name}",
            f"SlurmctldHost={host}({self.controller_ip})",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={SLURMD_PORT}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobContainerType=job_container/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=bf_interval=1,sched_min_interval=200000",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "PropagateResourceLimits=NONE",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/run/slurmctld.pid",
            f"SlurmdPidFile={d}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd-%n.log",
            f"PlugStackConfig={d}/plugstack.conf",
            f"SlurmctldDebug={debug}",
            f"SlurmdDebug={debug}",
            "SlurmctldTimeout=10",
            "SlurmdTimeout=30",
            "MessageTimeout=10",
            "TCPTimeout=5",
            "InactiveLimit=0",
            "KillWait=2",
            "WaitTime=0",
            f"MinJobAge={self.min_job_age}",
            "UnkillableStepTimeout=30",
            "HealthCheckInterval=0",
            "MailProg=/bin/true",
        ]
        for n in self.nodes:
            lines.append(f"NodeName={n.name} NodeAddr={n.ip} NodeHostname={n.name} "
                         f"CPUs={self.cpus_per_node} RealMemory=1000 State=UNKNOWN")
        names = ",".join(n.name for n in self.nodes)
        lines += [
            f"PartitionName={self.partition} Nodes={names} Default=YES MaxTime=INFINITE "
            "State=UP OverSubscribe=NO",
            f"PartitionName={self.hold_partition} Nodes={names} Default=NO MaxTime=INFINITE "
            "State=DOWN",
        ]
        lines += self.extra_conf
        with open(os.path.join(d, "plugstack.conf"), "w") as f:
            f.write("# no SPANK plugins\n")
        return "\n".join(lines) + "\n"

    def _popen(self, what: str, cmd: Sequence[str], log: str) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            # A session of its own: a Ctrl-C reaches the test, not the daemons.
            proc = subprocess.Popen(_dying_with_parent(cmd), stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, env=self.env(),
                                    start_new_session=True)
        self._procs.append((what, proc, log))
        with open(os.path.join(self.dir, "daemons.pid"), "a") as f:
            f.write(f"{proc.pid}\n")
        return proc

    def _start_munged(self, deadline: float) -> None:
        key = os.path.join(self.dir, "munge", "munge.key")
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
        d = self.dir
        self._popen("munged", [
            _which("munged") or "munged", "--foreground", "--force", f"--key-file={key}",
            f"--socket={self.munge_socket}", f"--pid-file={d}/run/munged.pid",
            f"--seed-file={d}/munge/munged.seed", "--num-threads=4",
        ], f"{d}/log/munged.log")

        def ready() -> bool:
            if not os.path.exists(self.munge_socket):
                return False
            probe = subprocess.run(
                f"{_which('munge')} -n -S {self.munge_socket} | "
                f"{_which('unmunge')} -S {self.munge_socket}",
                shell=True, capture_output=True, timeout=10)
            return probe.returncode == 0

        self._wait(ready, deadline, "munged to answer on its socket")

    def _start_slurmctld(self, deadline: float) -> None:
        self._popen("slurmctld", [_which("slurmctld") or "slurmctld", "-D", "-i", "-f", self.conf],
                    f"{self.dir}/log/slurmctld.out")

        def ready() -> bool:
            return self.slurm("scontrol", "ping", check=False, timeout=10).returncode == 0

        self._wait(ready, deadline, f"slurmctld to answer `scontrol ping` on port {self.ctld_port}")

    def _start_slurmds(self) -> None:
        for n in self.nodes:
            os.mkdir(os.path.join(self.dir, "spool", n.name), 0o755)
            self._popen(f"slurmd {n.name}", [
                # nsenter switches the network namespace only: unlike `ip netns exec`
                # it keeps the host's /sys, whose cgroup mounts slurmd's init insists on
                "nsenter", f"--net=/run/netns/{n.ns}", _which("slurmd") or "slurmd", "-D",
                "-N", n.name, "-f", self.conf,
            ], f"{self.dir}/log/slurmd-{n.name}.out")

    def wait_nodes_idle(self, timeout: float = 30.0) -> None:
        """Poll ``sinfo`` until every node of the bed is idle (no job on it)."""
        states: dict[str, str] = {}

        def idle() -> bool:
            states.clear()
            states.update(self.node_states())
            return all(states.get(n.name) == "idle" for n in self.nodes)

        self._wait(idle, time.monotonic() + timeout, "every node to be idle",
                   lambda: f"node states: {states}", step=0.2)

    def _wait(self, pred: Callable[[], bool], deadline: float, what: str,
              detail: Callable[[], str] = lambda: "", step: float = 0.1) -> None:
        while True:
            for name, proc, _ in self._procs:
                if proc.poll() is not None:
                    raise SlurmBedError(f"Slurm bed: {name} exited ({proc.returncode}) while "
                                        f"waiting for {what}\n{self.log_tail()}")
            if pred():
                return
            if time.monotonic() > deadline:
                extra = detail()
                raise SlurmBedError(f"Slurm bed: timed out waiting for {what}"
                                    + (f" ({extra})" if extra else "") + f"\n{self.log_tail()}")
            time.sleep(step)

    # -- using it -------------------------------------------------------------------------

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for a subprocess that uses the bed: ``os.environ`` + SLURM_CONF."""
        env = dict(os.environ)
        env["SLURM_CONF"] = self.conf
        env.update(extra)
        return env

    def slurm(self, *cmd: str, check: bool = True, timeout: float = SLURM_CLI_TIMEOUT,
              input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run a Slurm command (``bed.slurm("squeue", "-h")``) against the bed; text output.

        ``check``: a non-zero exit raises :class:`SlurmBedError` with its stderr.
        """
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                              env=self.env(), input=input,
                              stdin=None if input is not None else subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise SlurmBedError(f"`{' '.join(cmd)}` failed ({proc.returncode}): "
                                f"{proc.stderr.strip()[-2000:]}")
        return proc

    def sbatch(self, script: str, *args: str) -> str:
        """Submit ``script`` (its text, starting with ``#!``) with ``sbatch --parsable``; job id.

        Without ``-o``/``--output`` in ``args`` the job's output goes to
        :meth:`job_output_path` (in the bed's dir), not to ``slurm-ID.out`` in the cwd.
        """
        if not any(a == "-o" or a.startswith(("-o", "--output")) for a in args):
            args = (f"--output={self.dir}/slurm-%j.out", *args)
        out = self.slurm("sbatch", "--parsable", *args, input=script).stdout.strip()
        return out.split(";")[0]

    def job_output_path(self, job_id: str) -> str:
        """Where a job submitted with :meth:`sbatch` (no ``-o``) writes its output."""
        return os.path.join(self.dir, f"slurm-{job_id}.out")

    def job_state(self, job_id: str, *, finished: bool = False) -> tuple[str, str] | None:
        """``(state, reason)`` as squeue prints them (``%T %r``); None when squeue lists none.

        squeue lists a job only while it is pending, running or completing; with
        ``finished=True`` (``squeue -t all``) also afterwards, for ``min_job_age``
        seconds: ``("COMPLETED", "None")``, ``("FAILED", "NonZeroExitCode")``,
        ``("CANCELLED", ...)``.
        """
        states = ["-t", "all"] if finished else []
        proc = self.slurm("squeue", "-h", *states, "-j", job_id, "-o", "%T %r", check=False)
        words = proc.stdout.split(None, 1)
        if proc.returncode != 0 or not words:
            return None
        return words[0], (words[1].strip() if len(words) > 1 else "")

    def wait_job(self, job_id: str, states: Sequence[str] | None, timeout: float = 30.0
                 ) -> tuple[str, str] | None:
        """Poll squeue until job ``job_id`` is in one of ``states`` (None: until it is gone)."""
        seen: list[tuple[str, str] | None] = [None]

        def reached() -> bool:
            seen[0] = self.job_state(job_id)
            return seen[0] is None if states is None else (
                seen[0] is not None and seen[0][0] in states)

        what = f"job {job_id} to be " + ("gone from squeue" if states is None else "/".join(states))
        self._wait(reached, time.monotonic() + timeout, what, lambda: f"last seen: {seen[0]}",
                   step=0.2)
        return seen[0]

    @contextlib.contextmanager
    def allocation(self, nodes: int = 1, *args: str, timeout: float = 30.0,
                   apply_env: bool = True) -> Iterator[dict[str, str]]:
        """``with bed.allocation(2) as env:`` the test process is "inside an allocation".

        A real ``salloc -N nodes ARGS`` holds the allocation (its shell runs here, in
        the root namespace, like an salloc shell on a login node); ``env`` is the
        ``SLURM_*`` environment salloc gave that shell (``SLURM_JOB_ID``,
        ``SLURM_JOB_NODELIST``, ``SLURM_JOB_NUM_NODES``, ...). With ``apply_env``
        those variables are also set in ``os.environ`` inside the block (so ``srun``
        and ``cb.slurm_cluster`` see an allocation) and removed after it. On exit the
        job is cancelled and salloc ends.
        """
        marker = b"__colobus_slurmbed_env_end__"
        err_path = os.path.join(self.dir, "log", f"salloc-{time.monotonic_ns()}.err")
        with open(err_path, "wb") as err:
            proc = subprocess.Popen(
                _dying_with_parent(["salloc", f"--nodes={nodes}", *args, "sh", "-c",
                                    f"env -0; printf '{marker.decode()}'; exec cat >/dev/null"]),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=self.env(),
                start_new_session=True)
        self._extra_procs.append(proc)
        assert proc.stdout is not None and proc.stdin is not None
        saved: dict[str, str | None] = {}
        job_id = ""
        try:
            data = b""
            deadline = time.monotonic() + timeout
            while marker not in data:
                left = deadline - time.monotonic()
                if proc.poll() is not None or left <= 0:
                    why = (f"salloc exited ({proc.returncode})" if proc.returncode is not None
                           else f"no allocation within {timeout} s")
                    raise SlurmBedError(f"Slurm bed: {why}: {_tail(err_path, 10)}\n"
                                        f"{self.log_tail()}")
                ready, _, _ = select.select([proc.stdout], [], [], min(left, 0.5))
                if ready:
                    chunk = os.read(proc.stdout.fileno(), 65536)
                    data += chunk
            entries = data.split(marker)[0].split(b"\0")
            env = dict(e.decode(errors="replace").split("=", 1) for e in entries if b"=" in e)
            env = {k: v for k, v in env.items() if k.startswith("SLURM_") and k != "SLURM_CONF"}
            job_id = env["SLURM_JOB_ID"]
            if apply_env:
                for k, v in env.items():
                    saved[k] = os.environ.get(k)
                    os.environ[k] = v
            yield env
        finally:
            for k, old in saved.items():
                if old is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = old
            if not job_id:  # not granted (yet): salloc names the job it waits for
                found = re.search(r"job allocation (\d+)", _tail(err_path, 50))
                job_id = found.group(1) if found else ""
                if job_id:
                    self.slurm("scancel", job_id, check=False, timeout=10)
            proc.stdin.close()  # its shell's `cat` ends, so salloc relinquishes the allocation
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                if job_id:
                    self.slurm("scancel", job_id, check=False, timeout=10)
                proc.kill()
                proc.wait(10)
            proc.stdout.close()
            if job_id:
                with contextlib.suppress(SlurmBedError):
                    self.wait_job(job_id, None, timeout=15)

    def node_states(self) -> dict[str, str]:
        """``{node: state}`` as ``sinfo -N`` prints them (``idle``, ``alloc``, ``down*`` ...)."""
        proc = self.slurm("sinfo", "-h", "-N", "-p", self.partition, "-o", "%N %t", check=False,
                          timeout=10)
        return dict(line.split(None, 1) for line in proc.stdout.splitlines()
                    if len(line.split()) == 2)

    def scancel_all(self, timeout: float = 15.0) -> None:
        """Cancel every job of the bed's cluster and wait until squeue lists none running."""
        self.slurm("scancel", "-u", "root", check=False, timeout=10)  # every job here is root's

        def none_left() -> bool:
            out = self.slurm("squeue", "-h", "-o", "%i %T", check=False, timeout=10).stdout
            return not any(w in out for w in ("RUNNING", "PENDING", "COMPLETING", "CONFIGURING"))

        with contextlib.suppress(SlurmBedError):
            self._wait(none_left, time.monotonic() + timeout, "every job to end", step=0.2)

    def log_tail(self, lines: int = 25) -> str:
        """The last ``lines`` lines of each daemon's log files, for error messages."""
        if not self.dir or not os.path.isdir(self.dir):
            return "(no logs: the bed's dir is gone)"
        parts = []
        logs = sorted(os.listdir(os.path.join(self.dir, "log")))
        for name in logs:  # X.out is a daemon's stderr: shown only where it has no X.log
            if name.endswith(".out") and name[:-4] + ".log" in logs:
                continue
            path = os.path.join(self.dir, "log", name)
            if os.path.getsize(path):
                parts.append(f"--- {name} (last {lines} lines) ---\n{_tail(path, lines)}")
            else:
                parts.append(f"--- {name} (empty) ---")
        return "\n".join(parts) or "(no daemon started yet)"

    # -- stopping -------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel jobs, stop every daemon and process, remove all files; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            ctld = [p for what, p, _ in self._procs if what == "slurmctld"]
            if ctld and ctld[0].poll() is None:
                self.scancel_all()
        finally:
            try:
                for n in self.nodes:  # slurmd, slurmstepd and the steps: all in the namespaces
                    kill_ns_processes(n.ns)
                for proc in self._extra_procs:
                    if proc.poll() is None:
                        proc.kill()
                    proc.wait(10)
                for _, proc, _ in reversed(self._procs):
                    if proc.poll() is None:
                        proc.terminate()
                    try:
                        proc.wait(10)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait(10)
            finally:
                if self._env_set:
                    os.environ.pop("SLURM_CONF", None)
                    os.environ.update(self._saved_env)
                    self._env_set = False
                self.net.close()
                if self.dir:
                    shutil.rmtree(self.dir, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _main(argv: list[str]) -> int:
    """``--cleanup``: remove leftovers of dead runs; ``--demo``: start a bed, show it, stop."""
    if argv == ["--cleanup"]:
        if sys.platform.startswith("linux") and os.geteuid() == 0:
            removed = cleanup_leftovers()
            print(f"slurmbed: removed {len(removed)} leftover(s)"
                  + (f": {', '.join(removed)}" if removed else ""))
        return 0
    if argv == ["--demo"]:
        with SlurmBed(2) as bed:
            print(f"started in {bed.start_seconds:.1f} s; SLURM_CONF={bed.conf}")
            print(bed.slurm("sinfo").stdout)
            print(bed.slurm("srun", "-N2", "-l", "hostname", "-I").stdout)
        return 0
    print("usage: python tests/slurmbed.py --cleanup | --demo", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
