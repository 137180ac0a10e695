"""The embedded default: a controller plus worker subprocesses on this machine."""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

from .._controller.controller import Controller, _pop_current
from .._controller.environ import check_launched
from .._controller.procwatch import Emit, describe_exit
from .._process import with_huge_pages
from .._wire.keys import generate_key
from .accel import local_worker_envs
from .base import LaunchedCluster, Launcher
from .onhosts import relay_argv, relays_on_hosts_option

__all__ = ["LocalCluster", "LocalLauncher", "init", "local_cluster", "shutdown"]

log = logging.getLogger("colobus.cluster")


class LocalLauncher(Launcher):
    """Worker subprocesses of this machine, the key on their stdin."""

    kind = "local"
    log = log

    def __init__(self, hosts: int, devices_per_host: int,
                 paths: Sequence[str] | None = None,
                 accelerators: Sequence[dict[str, str]] | None = None) -> None:
        super().__init__([f"local-{i}" for i in range(hosts)])
        self.devices_per_host = devices_per_host
        self._paths = list(sys.path if paths is None else paths)
        self._env: dict[str, str] | None = None
        # each worker's share of this machine's accelerators (_launch/accel.py)
        self._accelerators = list(accelerators or [{} for _ in range(hosts)])

    def worker_env(self, i: int) -> dict[str, str]:
        """Worker ``i``'s environment: the common one and its accelerators."""
        env = self.env()
        mine = self._accelerators[i]
        if not mine:
            return env
        env = dict(env)
        for name, value in mine.items():
            # a JAX_PLATFORMS of the user's own stays, unless this worker gets no chip
            if name != "JAX_PLATFORMS" or value == "cpu" or name not in env:
                env[name] = value
        return env

    def env(self) -> dict[str, str]:
        if self._env is None:
            env = with_huge_pages(dict(os.environ))  # the workers receive the large PUTs
            # This process's path less the working directory ("" or its name, unless
            # $PYTHONPATH names it): a module someone left there must not run in a
            # worker (which starts with -P for the same reason); user code travels
            # with the calls.
            cwd = os.getcwd()
            chosen = {os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep)
                      if p}
            paths = [p for p in self._paths
                     if p and (os.path.abspath(p) != cwd or os.path.abspath(p) in chosen)]
            env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
            env["COLOBUS_PARENT_PID"] = str(os.getpid())
            # Local workers share the user's terminal: only warnings and errors.
            env.setdefault("COLOBUS_LOG_LEVEL", "WARNING")
            env["COLOBUS_JAX_X64"] = "1" if _x64() else "0"
            env.pop("COLOBUS_KEY_FILE", None)
            env["PYTHONUNBUFFERED"] = "1"  # host code's prints reach us line by line
            self._env = env
        return self._env

    def start(self, i: int, connect: str, key: bytes) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-P", "-m", "colobus", "worker", "--connect", connect,
               "--devices", str(self.devices_per_host), "--name", self.names[i],
               "--key-file", "-"]
        # A session of its own, as ssh's and srun's: a Ctrl-C in the terminal reaches the
        # driver only, whose KeyboardInterrupt then stops the workers in order (a SIGINT
        # to each worker too would end them first, and their ends would read as failures).
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=self.worker_env(i),
                                cwd=os.getcwd(), start_new_session=True)
        assert proc.stdin is not None
        # The key travels on the worker's stdin, never on a command line.
        proc.stdin.write(key.hex().encode() + b"\n")
        proc.stdin.close()
        return proc

    def relay_command(self, i: int, connect: str) -> list[str]:
        # (on this machine, as its hosts are: loopback; keys on stdin)
        return [sys.executable, "-P", "-m", "colobus", *relay_argv(connect, i),
                "--bind", "tcp://127.0.0.1:*"]

    def relay_env(self) -> dict[str, str]:
        env = dict(self.env())
        env.pop("COLOBUS_RELAY_KEY_FILE", None)
        return env

    def emit(self) -> Emit | None:
        return None  # local workers share the terminal: ``[stdout:N]`` labels

    def reported_pid(self, proc: subprocess.Popen[bytes]) -> int | None:
        return proc.pid

    def failure(self, i: int, code: int, stderr: Sequence[str]) -> Exception:
        return RuntimeError(f"local colobus worker {i} {describe_exit(code)} before joining; "
                            f"see its [stderr:{i}] lines above")


class LocalCluster(LaunchedCluster):
    """A controller and ``hosts`` worker subprocesses; see :func:`local_cluster`."""

    def __init__(self, hosts: int = 2, devices_per_host: int = 1, *, transport: str = "ipc",
                 restart: int = 0, accelerators_per_host: int | None = None,
                 relays_on_hosts: int = 0, **options: Any) -> None:
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
        if hosts < 1 or devices_per_host < 1:
            raise ValueError("local_cluster needs hosts >= 1 and devices_per_host >= 1")
        self.hosts = hosts
        self.devices_per_host = devices_per_host
        self.transport = transport
        accelerators = local_worker_envs(hosts, accelerators_per_host)
        key = generate_key()
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
        per = relays_on_hosts_option(relays_on_hosts, options)
        super().__init__(LocalLauncher(hosts, devices_per_host, accelerators=accelerators),
                         Controller(bind, hosts=hosts, key=key, **options), key,
                         restart=restart, relays_on_hosts=per)

    def _cleanup(self) -> None:
        if self._ipc_path and os.path.exists(self._ipc_path):
            try:
                os.unlink(self._ipc_path)
            except OSError:
                pass


def local_cluster(hosts: int | None = None, devices_per_host: int | None = None, *,
                  transport: str = "ipc", restart: int = 0,
                  accelerators_per_host: int | None = None, relays_on_hosts: int = 0,
                  **options: Any) -> LocalCluster | Controller:
    """A controller plus ``hosts`` worker subprocesses on this machine.

    Use as ``async with`` (the controller runs on your loop) or ``with`` (it runs
    on a thread of its own). Entry waits until every worker joined; exit stops
    and reaps them all, also on error or Ctrl-C. Workers get a fresh random key on
    their stdin, this process's ``sys.path`` less its working directory (they start
    with ``python -P``: a module left in that directory is never imported there),
    its working directory as theirs, and exit by themselves if this process dies.

    Under ``colobus launch`` (``$COLOBUS_ADDRESS`` set) it starts no workers: it
    is a :class:`Controller` that binds the launch's address and waits for the
    launched workers (``transport`` and ``restart`` are the launch's then).

    Args:
        hosts: number of worker processes (hosts); default 2.
        devices_per_host: CPU devices per host; default 1.
        transport: ``"ipc"`` (Unix socket) or ``"tcp"`` (loopback).
        restart: how often each host's worker process may be started again after
            it died; it rejoins under its name (same host index and device ids),
            and what the dead process held is lost as for any lost host.
        accelerators_per_host: this machine's accelerators (TPU chips, GPUs) each
            worker gets, seeing only its own. None: K // hosts of K each; with fewer
            than hosts, the first ones get one each and the rest are CPU-only. 0:
            CPU-only workers. Raises ``RuntimeError`` at once if this process already
            opened the accelerator with JAX (docs/accelerators.md).
        relays_on_hosts: one relay per this many hosts, each a ``colobus relay``
            process started beside a host's worker (here: on this machine), carrying
            the hosts' sessions for the controller; 0: none (docs/deployment.md).
        **options: passed to :class:`Controller` (``heartbeat_interval``, ``metrics``,
            ``trace``, ...).

    Raises:
        ValueError: under ``colobus launch``, ``hosts`` or ``devices_per_host``
            differ from the launch's.
    """
    if check_launched("local_cluster", hosts, devices_per_host):
        return Controller(**options)
    return LocalCluster(2 if hosts is None else hosts,
                        1 if devices_per_host is None else devices_per_host,
                        transport=transport, restart=restart,
                        accelerators_per_host=accelerators_per_host,
                        relays_on_hosts=relays_on_hosts, **options)


_default_cluster: LocalCluster | Controller | None = None
_default_lock = threading.Lock()


def init(hosts: int | None = None, devices_per_host: int | None = None,
         **options: Any) -> Controller:
    """Start a local cluster for a plain script and make it the default controller.

    ``hosts`` (default 2) and ``devices_per_host`` (default 1) as for
    :func:`local_cluster`. Under ``colobus launch`` (``$COLOBUS_ADDRESS`` set) it
    starts no workers: it binds that address and waits for the launched ones
    instead (``$COLOBUS_HOSTS`` of them).

    :func:`shutdown` stops it; it is also registered with ``atexit``.

    Raises:
        ValueError: under ``colobus launch``, ``hosts`` or ``devices_per_host``
            differ from the launch's.
    """
    global _default_cluster
    with _default_lock:
        if _default_cluster is not None:
            raise RuntimeError("colobus.init() was already called; call colobus.shutdown() first")
        if check_launched("init", hosts, devices_per_host):
            for launchs_own in ("transport", "restart"):
                options.pop(launchs_own, None)
            launched = Controller(**options)
            ctl = launched.__enter__()
            _default_cluster = launched
        else:
            cluster = LocalCluster(2 if hosts is None else hosts,
                                   1 if devices_per_host is None else devices_per_host,
                                   **options)
            ctl = cluster.__enter__()
            _default_cluster = cluster
    atexit.register(shutdown)
    return ctl


def shutdown() -> None:
    """Stop the cluster started by :func:`init` (idempotent)."""
    global _default_cluster
    with _default_lock:
        cluster, _default_cluster = _default_cluster, None
    if isinstance(cluster, Controller):
        cluster.close()
        _pop_current(cluster)
    elif cluster is not None:
        cluster.close()
        _pop_current(cluster.controller)


def _x64() -> bool:
    """This process's JAX's ``jax_enable_x64``, without importing JAX where it is not
    imported (``colobus launch``: an import cut short by a Ctrl-C could crash the
    process at exit); then JAX's own default, read from its environment variable."""
    jax = sys.modules.get("jax")
    if jax is not None:
        return bool(jax.config.read("jax_enable_x64"))
    return os.environ.get("JAX_ENABLE_X64", "").lower() in ("1", "y", "yes", "t", "true", "on")
