"""What every launcher shares: worker processes it owns, relayed, restarted and reaped.

Three parts, each with one job:

- :class:`Launcher`: how one kind of cluster starts the worker of host ``i``
  (a local subprocess, ``ssh HOST python -m colobus worker``, an ``srun``
  step) and what a failed start means in words;
- :class:`Workers`: the processes of one cluster: starts them, relays their
  output (``[host N]`` through logging, or local labels), tells the
  controller at once when one ends, starts it again (``restart``), and stops
  and reaps them all;
- :class:`LaunchedCluster`: a :class:`~colobus.Controller` plus
  :class:`Workers`, as ``async with`` and ``with``: entry returns once every
  host joined, exit (also on error or Ctrl-C) leaves no worker process.

``colobus launch`` uses :class:`Workers` without a controller: there the
controller lives in the driver script.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import logging
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType

from .._controller.cluster import announce_joins, host_process_ended, number_hosts_by_name
from .._controller.controller import Controller, _pop_current, _push_current
from .._controller.procwatch import Emit, HostProcess, describe_exit
from .onhosts import RelaysOnHosts

__all__ = ["LaunchedCluster", "Launcher", "Workers", "log_emit"]

log = logging.getLogger("colobus.launch")


def log_emit(logger: logging.Logger) -> Emit:
    """An ``emit`` for :class:`HostProcess`: each line to ``logger`` as ``[host N] line``.

    A worker's stdout (its host code's prints) is logged at INFO, its stderr
    (its own warnings, ssh's messages) at WARNING.
    """
    def emit(index: int, stream: str, line: str) -> None:
        logger.log(logging.INFO if stream == "stdout" else logging.WARNING,
                   "[host %d] %s", index, line)

    return emit


def checked_restart(restart: int) -> int:
    """``restart`` when valid (how often a host's worker may be started again).

    Raises:
        ValueError: ``restart`` is negative.
    """
    if restart < 0:
        raise ValueError(f"restart must be >= 0, got {restart}")
    return restart


class Launcher(abc.ABC):
    """How one kind of cluster starts the worker of each host.

    Attributes:
        kind: a word for messages: ``"local"``, ``"ssh"``, ``"slurm"``.
        names: each host's ``--name``; host ``i`` is ``names[i]``.
    """

    kind = "worker"
    log = log  # where process ends and restarts are told

    def __init__(self, names: Sequence[str]) -> None:
        if not names:
            raise ValueError(f"a {self.kind} cluster needs at least one host")
        self.names = list(names)

    def describe(self, i: int) -> str:
        """Host ``i`` in words, for messages: ``ssh host 1 ('node2-1')``."""
        return f"{self.kind} host {i} ({self.names[i]!r})"

    @abc.abstractmethod
    def start(self, i: int, connect: str, key: bytes) -> subprocess.Popen[bytes]:
        """Start the worker of host ``i``, joining ``connect`` with ``key``.

        The process has ``stdout`` and ``stderr`` pipes; the key has been
        written to its stdin (never a command line or the environment).
        """

    def emit(self) -> Emit | None:
        """Where the workers' lines go (None: this process's stdout/stderr, labelled)."""
        return log_emit(logging.getLogger(f"colobus.launch.{self.kind}"))

    def ended(self, code: int, stderr: Sequence[str]) -> str:
        """How a worker process ended, in words for logs and ``HostLostError``."""
        return describe_exit(code)

    def lost_because(self, how: str) -> str:
        """The reason a host is lost when its process ended ``how``."""
        return f"its process {how}"

    def reported_pid(self, proc: subprocess.Popen[bytes]) -> int | None:
        """The pid the worker reports when that is ``proc``'s (None: another machine's)."""
        return None

    def failure(self, i: int, code: int, stderr: Sequence[str]) -> Exception:
        """The error for host ``i``'s process that ended (``code``) before joining."""
        said = "; ".join(line for line in stderr if line.strip())[-600:]
        return RuntimeError(f"the colobus worker of {self.describe(i)} {describe_exit(code)} "
                            f"before joining" + (f": {said}" if said else ""))

    def relay_command(self, i: int, connect: str) -> list[str] | None:
        """The command line of a relay on host ``i``'s machine that connects to
        ``connect`` (``colobus relay``, its keys on stdin); None: this launcher places
        no relays on its hosts' machines."""
        return None

    def start_relay(self, i: int, connect: str, key: bytes,
                    relay_key: bytes) -> subprocess.Popen[bytes]:
        """Start a relay on host ``i``'s machine; both keys go on its stdin, which stays
        open (the relay exits when it closes, or when the controller's session ends).

        Raises:
            ValueError: this launcher places no relays on its hosts' machines.
        """
        cmd = self.relay_command(i, connect)
        if cmd is None:
            raise ValueError(f"relays_on_hosts= is not supported by {self.kind} clusters; "
                             "run `colobus relay --connect ...` on the machines you choose "
                             "(docs/deployment.md)")
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, start_new_session=True,
                                env=self.relay_env())
        assert proc.stdin is not None
        try:
            proc.stdin.write(key.hex().encode() + b"\n" + relay_key.hex().encode() + b"\n")
            proc.stdin.flush()
        except OSError:  # already gone: its exit says why
            pass
        return proc

    def relay_env(self) -> dict[str, str] | None:
        """The environment of the local process that starts a relay (None: this one's)."""
        return None

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        """Ask a worker to end: close its stdin (a remote worker's ssh session ends with
        it), then SIGTERM the process (the local end: ssh, srun, or the worker)."""
        if proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
        if proc.poll() is None:
            proc.terminate()


class Workers:
    """The worker processes of one cluster, one per host, each restarted up to ``restart``.

    Args:
        launcher: how to start each host's worker.
        connect: the controller endpoint the workers join.
        key: the controller's key (written to each worker's stdin).
        restart: how often each host's process may be started again after it died.
        on_ended: called (on a relay thread) with the host's name, the pid its
            worker reported (when known here) and why, as soon as a process
            ended: the controller declares the host lost at once.
    """

    def __init__(self, launcher: Launcher, connect: str, key: bytes, *, restart: int = 0,
                 on_ended: Callable[[str, int | None, str], None] | None = None) -> None:
        self.launcher = launcher
        self.connect = connect
        self._key = key
        self.restart = checked_restart(restart)
        self._on_ended = on_ended
        self._lock = threading.Lock()
        self.current: list[HostProcess] = []  # host i's process now
        self._all: list[HostProcess] = []  # every process started, restarted ones too
        self.restarts = [0] * len(launcher.names)
        self.ended: dict[int, str] = {}  # host -> how its last process ended
        self.joined = False  # set once all joined: from then on a death means restart
        self.gone: dict[int, int] = {}  # host -> exit status of a process not restarted
        self.changed = threading.Event()  # set when a host is gone for good
        self.closing = False  # our own stop: workers ending now is no news

    @property
    def procs(self) -> list[subprocess.Popen[bytes]]:
        """Each host's current process."""
        return [hp.proc for hp in self.current]

    def _start(self, i: int) -> HostProcess:
        proc = self.launcher.start(i, self.connect, self._key)
        return HostProcess(i, self.launcher.names[i], proc, self._process_ended,
                           self.launcher.emit())

    def start_all(self) -> None:
        """Start every host's worker (they join in the background)."""
        for i in range(len(self.launcher.names)):
            hp = self._start(i)
            with self._lock:
                self.current.append(hp)
                self._all.append(hp)

    def _process_ended(self, hp: HostProcess, how: str) -> None:
        """A process ended (on its relay thread): tell the controller, maybe restart."""
        with self._lock:
            if self.closing or hp.index >= len(self.current) or self.current[hp.index] is not hp:
                return
        code = hp.proc.poll()
        if code is not None:
            hp.join(1.0)  # the last stderr lines say why (ssh's message)
            how = self.launcher.ended(code, list(hp.stderr_tail))
        with self._lock:
            self.ended[hp.index] = how
        what = self.launcher.describe(hp.index)
        self.launcher.log.warning("%s host %d (%r, pid %d) %s", self.launcher.kind, hp.index,
                                  hp.name, hp.proc.pid, how)
        if self._on_ended is not None:
            self._on_ended(hp.name, self.launcher.reported_pid(hp.proc),
                           self.launcher.lost_because(how))
        if not self.joined or self.restarts[hp.index] >= self.restart:
            with self._lock:
                self.gone[hp.index] = -1 if code is None else code
            self.changed.set()
            return
        self.restarts[hp.index] += 1
        self.launcher.log.warning("restarting %s (restart %d of %d); it rejoins under its name",
                    what, self.restarts[hp.index], self.restart)
        try:
            new = self._start(hp.index)
        except Exception as exc:
            self.launcher.log.error("could not restart %s: %s", what, exc)
            return
        with self._lock:
            if self.closing:  # closed while it started: it goes at once
                self.launcher.stop(new.proc)
            self.current[hp.index] = new
            self._all.append(new)
            self.ended.pop(hp.index, None)

    def check(self) -> None:
        """Before all joined: raise the launcher's error for a process that ended.

        Raises:
            Exception: :meth:`Launcher.failure` of the first host whose process ended.
        """
        for hp in list(self.current):
            code = hp.proc.poll()
            if code is not None:
                hp.join(2.0)  # its last stderr lines (ssh's own message) first
                raise self.launcher.failure(hp.index, code, list(hp.stderr_tail))

    def reap(self, timeout: float = 10.0, grace: float = 1.0) -> None:
        """Wait for the workers (told to exit by the closing controller); stop stragglers.

        A worker exits within milliseconds of reading the controller's SHUTDOWN.
        One that never got it (its connection went first) would exit only when its
        liveness timeout fires. So after ``grace`` seconds the rest are stopped
        (:meth:`Launcher.stop`: stdin closed, SIGTERM), and SIGKILLed at ``timeout``.
        """
        with self._lock:
            self.closing = True
            procs = [hp.proc for hp in self._all]
        deadline = time.monotonic() + timeout
        graced = time.monotonic() + min(grace, timeout)  # one grace for all, not each
        for p in procs:
            try:
                p.wait(max(0.0, graced - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            if p.poll() is None:
                log.debug("worker process %d did not exit on SHUTDOWN; stopping it", p.pid)
                self.launcher.stop(p)
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.launcher.log.warning(
                    "%s worker process %d did not exit within %.0f s of being told to stop "
                    "(SIGTERM); killed", self.launcher.kind, p.pid, timeout)
                p.kill()
                p.wait()
        for hp in self._all:
            hp.join(max(0.1, deadline - time.monotonic()))  # their last lines first
            if hp.proc.stdin is not None:
                try:
                    hp.proc.stdin.close()
                except OSError:
                    pass

    def kill_all(self) -> None:
        """Stop every worker now (a failed start, Ctrl-C) and reap them."""
        with self._lock:
            self.closing = True
            procs = [hp.proc for hp in self._all]
        for p in procs:
            if p.poll() is None:
                self.launcher.stop(p)
        self.reap(5.0, grace=2.0)


class LaunchedCluster(RelaysOnHosts):
    """A controller plus the workers a :class:`Launcher` starts for it.

    Entry starts the controller, then the workers, and returns once every host
    joined (a process that ends first fails the entry with the launcher's error);
    exit stops and reaps every worker, also on error or Ctrl-C.

    Args:
        launcher: how to start the workers.
        controller: a new controller, with ``hosts=len(launcher.names)``.
        key: the controller's key, for the workers.
        restart: how often each host's worker may be started again.
        connect: the endpoint the workers join (default: the controller's address).
    """

    launcher: Launcher

    def __init__(self, launcher: Launcher, controller: Controller, key: bytes, *,
                 restart: int = 0, connect: Callable[[str], str] | None = None,
                 relays_on_hosts: int = 0) -> None:
        self.launcher = launcher
        self.controller = controller
        self._key = key
        self.restart = checked_restart(restart)  # refused now, not after the controller started
        self._connect = connect
        self.workers: Workers | None = None
        self._closed = False
        # one relay per this many hosts, on the machines of hosts 0, N, 2N, ...
        self.relays_on_hosts = relays_on_hosts
        self.relay_procs: list[subprocess.Popen[bytes]] = []

    @property
    def procs(self) -> list[subprocess.Popen[bytes]]:
        """Each host's current worker process (the local end: ssh, srun, or the worker)."""
        return self.workers.procs if self.workers is not None else []

    def connect_address(self) -> str:
        """The endpoint the workers join (after the controller started)."""
        address = self.controller.address
        return self._connect(address) if self._connect else address

    def _spawn(self) -> None:
        ctl = self.controller
        self.workers = Workers(self.launcher, self.connect_address(), self._key,
                               restart=self.restart,
                               on_ended=functools.partial(host_process_ended, ctl))
        number_hosts_by_name(ctl, self.launcher.names)  # names[0] is host 0
        if self.launcher.kind != "local":  # a local cluster's own workers join quietly
            announce_joins(ctl)
        self.workers.start_all()

    async def _wait_joined(self) -> None:
        ctl = self.controller
        assert self.workers is not None
        deadline = time.monotonic() + ctl.join_timeout
        while True:
            self.workers.check()
            try:
                await ctl.wait_for_hosts(timeout=0.25)
                break
            except TimeoutError as exc:
                if time.monotonic() > deadline:
                    raise self.join_timed_out() from exc
        self.workers.joined = True

    def join_timed_out(self) -> TimeoutError:
        """The error for workers that had not all joined within ``join_timeout``."""
        ctl = self.controller
        n = len(self.launcher.names)
        joined = ctl._hosts.alive_count()
        missing = [i for i, name in enumerate(self.launcher.names)
                   if not ((h := ctl._hosts.by_name.get(name)) is not None and h.alive)]
        said = ", ".join(self._missing_words(i) for i in missing[:10])
        return TimeoutError(
            f"only {joined} of {n} {self.launcher.kind} workers joined {ctl.address} within "
            f"{ctl.join_timeout:g} s; missing: {said}{' ...' if len(missing) > 10 else ''} "
            f"(they connect to {self.connect_address()}; their [host N] log lines say why)")

    def _missing_words(self, i: int) -> str:
        """Host ``i``, which has not joined, in words: its name and its last line."""
        current = self.workers.current if self.workers is not None else []
        tail = list(current[i].stderr_tail) if i < len(current) else []
        last = next((line for line in reversed(tail) if line.strip()), "")
        return self.launcher.describe(i) + (f": {last.strip()[-200:]!r}" if last else "")

    def _closing(self) -> None:
        """From now on a worker that ends is ours stopping it: no news, no restart."""
        if self.workers is not None:
            self.workers.closing = True

    def _stop_workers(self, failed: bool) -> None:
        """After the controller closed: reap the workers it told to exit, or (``failed``:
        an entry that did not finish) stop them all now; then clean up."""
        if self.workers is not None:
            if failed:
                self.workers.kill_all()
            else:
                self.workers.reap()
        self._stop_relays()
        self._cleanup()

    def _cleanup(self) -> None:
        """After the workers are gone: remove what the cluster made (a socket file)."""

    # -- async with ---------------------------------------------------------------------

    async def __aenter__(self) -> Controller:
        try:
            await self.controller.start()
            await self._start_relays()
            self._spawn()
            await self._wait_joined()
        except BaseException:
            await self._aclose(failed=True)
            raise
        _push_current(self.controller)
        return self.controller

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self._aclose(failed=False)

    async def _aclose(self, failed: bool) -> None:
        self._closing()
        try:
            await self.controller.aclose()
        finally:
            await asyncio.get_running_loop().run_in_executor(None, self._stop_workers, failed)

    # -- with -----------------------------------------------------------------------------

    def __enter__(self) -> Controller:
        try:
            self.controller.start_in_thread()
            self.controller.run_sync(self._start_relays())
            self._spawn()
            self.controller.run_sync(self._wait_joined())
        except BaseException:
            self._close(failed=True)
            raise
        _push_current(self.controller)
        return self.controller

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Close the controller and stop every worker (idempotent)."""
        if not self._closed:
            self._close(failed=False)

    def _close(self, failed: bool) -> None:
        self._closed = True
        self._closing()
        try:
            self.controller.close()
        finally:
            _pop_current(self.controller)
            self._stop_workers(failed)
