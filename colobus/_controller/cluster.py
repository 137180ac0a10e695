"""The embedded default: a controller plus worker subprocesses on this machine."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from .._errors import ControllerClosedError
from .._process import with_huge_pages
from .._wire.keys import generate_key
from .controller import Controller, State, _pop_current, _push_current
from .joinwait import JoinOrder
from .procwatch import HostProcess, describe_exit

__all__ = ["LocalCluster", "init", "local_cluster", "shutdown"]

log = logging.getLogger("colobus.cluster")


class LocalCluster:
    """A controller and ``hosts`` worker subprocesses; see :func:`local_cluster`."""

    def __init__(self, hosts: int = 2, devices_per_host: int = 1, *, transport: str = "ipc",
                 **options: Any) -> None:
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
        if hosts < 1 or devices_per_host < 1:
            raise ValueError("local_cluster needs hosts >= 1 and devices_per_host >= 1")
        self.hosts = hosts
        self.devices_per_host = devices_per_host
        self.transport = transport
        self._key = generate_key()
        self._ipc_path: str | None = None
        if transport == "ipc":
            self._ipc_path = os.path.join(
                tempfile.gettempdir(), f"colobus-{os.getpid()}-{secrets.token_hex(4)}.sock")
            bind = f"ipc://{self._ipc_path}"
        else:
            bind = "tcp://127.0.0.1:*"
        if any(name.startswith("curve_") for name in options):
            raise ValueError(
                "local_cluster does not set up CurveZMQ (its workers talk over ipc or "
                "loopback on this machine); use cb.Controller(..., curve_secret_key=...) and "
                "`colobus worker --curve-key-file ... --server-key ...` (docs/security.md)")
        options.setdefault("exit_workers_on_close", True)
        self.controller = Controller(bind, hosts=hosts, key=self._key, **options)
        self.procs: list[subprocess.Popen[bytes]] = []
        self._watched: list[HostProcess] = []
        self._ended: dict[int, str] = {}  # host number -> how its process ended
        self._closing = False  # our own stop: workers ending now is no news
        self._closed = False

    # -- processes ----------------------------------------------------------------------

    def _spawn(self) -> None:
        env = with_huge_pages(dict(os.environ))  # the workers receive the large PUTs
        paths = [p if p else os.getcwd() for p in sys.path]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env["COLOBUS_PARENT_PID"] = str(os.getpid())
        # Local workers share the user's terminal: only warnings and errors.
        env.setdefault("COLOBUS_LOG_LEVEL", "WARNING")
        import jax

        env["COLOBUS_JAX_X64"] = "1" if jax.config.read("jax_enable_x64") else "0"
        env.pop("COLOBUS_KEY_FILE", None)
        env["PYTHONUNBUFFERED"] = "1"  # host code's prints reach us line by line
        names = [f"local-{i}" for i in range(self.hosts)]
        _number_hosts_by_name(self.controller, names)  # local-0 is host 0
        for i, name in enumerate(names):
            cmd = [sys.executable, "-m", "colobus", "worker",
                   "--connect", self.controller.address,
                   "--devices", str(self.devices_per_host),
                   "--name", name, "--key-file", "-"]
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=env, cwd=os.getcwd())
            assert proc.stdin is not None
            # The key travels on the worker's stdin, never on a command line.
            proc.stdin.write(self._key.hex().encode() + b"\n")
            proc.stdin.close()
            self.procs.append(proc)
            self._watched.append(HostProcess(i, name, proc, self._process_ended))

    def _process_ended(self, hp: HostProcess, how: str) -> None:
        """A worker process ended (on its relay thread): tell the controller at once."""
        if self._closing:
            return
        self._ended[hp.index] = how
        log.warning("local host %d (%r, pid %d) %s", hp.index, hp.name, hp.proc.pid, how)
        _host_process_ended(self.controller, hp.name, hp.proc.pid, f"its process {how}")

    def _check_procs(self) -> None:
        for i, p in enumerate(self.procs):
            code = p.poll()
            if code is not None:
                raise RuntimeError(
                    f"local colobus worker {i} {describe_exit(code)} before joining; "
                    f"see its [stderr:{i}] lines above")

    def _reap(self, timeout: float = 10.0, grace: float = 1.0) -> None:
        """Wait for the workers (told to exit by the closing controller); stop stragglers.

        A worker exits within milliseconds of reading the controller's SHUTDOWN.
        One that never got it (its connection went first) would exit only when its
        liveness timeout fires. So after ``grace`` seconds the rest get SIGTERM,
        and SIGKILL at ``timeout``.
        """
        self._closing = True
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.0, min(grace, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                log.debug("local worker %d did not exit on SHUTDOWN; terminating it", p.pid)
                p.terminate()
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for hp in self._watched:
            hp.join(max(0.1, deadline - time.monotonic()))  # their last lines first
        self._watched.clear()
        self.procs.clear()
        if self._ipc_path and os.path.exists(self._ipc_path):
            try:
                os.unlink(self._ipc_path)
            except OSError:
                pass

    def _kill_all(self) -> None:
        self._closing = True
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        self._reap(5.0)

    async def _wait_joined(self) -> None:
        ctl = self.controller
        deadline = time.monotonic() + ctl.join_timeout
        while True:
            self._check_procs()
            try:
                await ctl.wait_for_hosts(timeout=0.25)
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise

    # -- async with ---------------------------------------------------------------------

    async def __aenter__(self) -> Controller:
        try:
            await self.controller.start()
            self._spawn()
            await self._wait_joined()
        except BaseException:
            self._closing = True
            await self.controller.aclose()
            self._kill_all()
            raise
        _push_current(self.controller)
        return self.controller

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        self._closing = True
        try:
            await self.controller.aclose()
        finally:
            await asyncio.get_running_loop().run_in_executor(None, self._reap)

    # -- with -----------------------------------------------------------------------------

    def __enter__(self) -> Controller:
        try:
            self.controller.start_in_thread()
            self._spawn()
            self.controller.run_sync(self._wait_joined())
        except BaseException:
            self._closing = True
            self.controller.close()
            self._kill_all()
            raise
        _push_current(self.controller)
        return self.controller

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._closing = True
        try:
            self.controller.close()
        finally:
            _pop_current(self.controller)
            self._reap()


def local_cluster(hosts: int = 2, devices_per_host: int = 1, *, transport: str = "ipc",
                  **options: Any) -> LocalCluster:
    """A controller plus ``hosts`` worker subprocesses on this machine.

    Use as ``async with`` (the controller runs on your loop) or ``with`` (it runs
    on a thread of its own). Entry waits until every worker joined; exit stops
    and reaps them all, also on error or Ctrl-C. Workers get a fresh random key on
    their stdin, this process's ``sys.path`` and working directory, and exit by
    themselves if this process dies.

    Args:
        hosts: number of worker processes (hosts).
        devices_per_host: CPU devices per host.
        transport: ``"ipc"`` (Unix socket) or ``"tcp"`` (loopback).
        **options: passed to :class:`Controller` (``heartbeat_interval``, ``metrics``,
            ``trace``, ...).
    """
    return LocalCluster(hosts, devices_per_host, transport=transport, **options)


_default_cluster: LocalCluster | None = None
_default_lock = threading.Lock()


def init(hosts: int = 2, devices_per_host: int = 1, **options: Any) -> Controller:
    """Start a local cluster for a plain script and make it the default controller.

    :func:`shutdown` stops it; it is also registered with ``atexit``.
    """
    global _default_cluster
    with _default_lock:
        if _default_cluster is not None:
            raise RuntimeError("colobus.init() was already called; call colobus.shutdown() first")
        cluster = LocalCluster(hosts, devices_per_host, **options)
        ctl = cluster.__enter__()
        _default_cluster = cluster
    atexit.register(shutdown)
    return ctl


def shutdown() -> None:
    """Stop the cluster started by :func:`init` (idempotent)."""
    global _default_cluster
    with _default_lock:
        cluster, _default_cluster = _default_cluster, None
    if cluster is not None:
        cluster.close()
        _pop_current(cluster.controller)


def _number_hosts_by_name(ctl: Controller, names: Sequence[str]) -> None:
    """Give the first hosts to join these names the numbers 0, 1, ... in this order.

    For ``local_cluster``, before its workers start: HELLOs wait until all
    of ``names`` said HELLO (see :mod:`colobus._controller.joinwait`).
    """
    ctl._sessions.join_order = JoinOrder(names)


def _host_process_ended(ctl: Controller, name: str, pid: int, why: str) -> None:
    """The process of host ``name`` (pid ``pid``) is gone: declare it lost now.

    Called from any thread by whoever owns the process (``local_cluster``),
    so the host is lost at once rather than after ``liveness_timeout``.
    """
    def lose() -> None:
        host = ctl._hosts.by_name.get(name)
        if host is not None and host.pid == pid:
            ctl._sessions.lose(host, why)

    if ctl.state is State.RUNNING:
        with contextlib.suppress(RuntimeError, ControllerClosedError):  # closed meanwhile
            ctl._call_soon(lose)
