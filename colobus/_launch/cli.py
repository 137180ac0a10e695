"""``colobus launch`` and ``colobus manifest``: start workers for a driver script.

``colobus launch KIND [options] -- COMMAND...`` binds nothing itself. It makes
a key file (0600, in a private temporary directory), picks the address the
driver's controller will bind, starts the workers pointed at that address (they
keep trying until the driver binds), and runs ``COMMAND`` with

- ``COLOBUS_ADDRESS``: the endpoint to bind (``tcp://IP:PORT`` or ``ipc://PATH``),
- ``COLOBUS_KEY_FILE``: the key file's path (a path, never the key),
- ``COLOBUS_HOSTS``: how many workers were started,
- ``COLOBUS_HOST_NAMES``: their names, host 0 first (so the controller numbers
  them as the ``[host N]`` lines here do),
- ``COLOBUS_DEVICES_PER_HOST``: each worker's ``--devices``,
- ``COLOBUS_PY_MODULES``: the ``--py-module`` paths, to ship to the hosts,
- ``COLOBUS_JAX_DISTRIBUTED=1`` with ``--jax-distributed`` (the hosts form one JAX job or
  the driver's controller fails), ``=0`` with ``--no-jax-distributed`` (the block view);
  unsaid, the default view (a job where the hosts can form one),

which ``cb.Controller()`` with no arguments reads; ``cb.init()`` and
``cb.local_cluster()`` serve the driver with these workers too. When the
driver exits, the workers are stopped and the key file removed; the exit
status is the driver's. A worker that fails for good (a non-zero exit not
covered by ``--restart``) ends the run: the driver is stopped and the message
says which host failed and why.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

# The parsers below are built for every `colobus` command, `--version` included: what
# running a launch needs is imported when one runs.
if TYPE_CHECKING:
    from .._controller.procwatch import Emit
    from .base import Launcher, Workers

__all__ = ["LAUNCH_KINDS", "add_launch_parsers", "driver_command", "run_launch",
           "split_command"]

log = logging.getLogger("colobus.launch")

LAUNCH_KINDS = ("local", "ssh", "slurm")
DRIVER_STOP_S = 5.0  # after SIGTERM, how long a driver may take before SIGKILL


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """``(colobus's arguments, the driver command)`` of a ``colobus launch`` line.

    The driver command is everything after the first ``--`` (None: no ``--``, or
    not a ``launch`` line).
    """
    args = list(argv)
    if "--" not in args:
        return args, None
    cut = args.index("--")
    if "launch" not in args[:cut]:
        return args, None
    return args[:cut], args[cut + 1:]


def add_launch_parsers(sub: Any, positive_int: Any) -> None:
    """Add ``launch`` and ``manifest`` to the ``colobus`` subcommands."""
    launch = sub.add_parser(
        "launch", help="start workers, then run a driver script that joins them",
        description="Start workers, then run COMMAND with COLOBUS_ADDRESS, COLOBUS_KEY_FILE "
                    "and COLOBUS_HOSTS set (cb.Controller() reads them). Usage: colobus "
                    "launch KIND [options] -- COMMAND...")
    kinds = launch.add_subparsers(dest="kind", metavar="KIND", required=True,
                                  parser_class=type(launch), help="where the workers run")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--devices", type=positive_int, default=1,
                       help="CPU devices per worker (default 1)")
        p.add_argument("--restart", type=int, default=0, metavar="N",
                       help="start a worker that died again, at most N times (default 0)")
        p.add_argument("--py-module", action="append", default=[], metavar="PATH",
                       help="a package directory or .py file the driver's controller ships "
                            "to the hosts too (repeat)")
        p.add_argument("--jax-distributed", action=argparse.BooleanOptionalAction,
                       default=None,
                       help="the hosts form one JAX multi-controller job once they joined, "
                            "or the driver fails (COLOBUS_JAX_DISTRIBUTED=1); --no-: the "
                            "block view (=0); unsaid: a job where the hosts can form one")

    lo = kinds.add_parser("local", help="workers as subprocesses of this machine")
    lo.add_argument("--hosts", type=positive_int, default=2, help="workers (default 2)")
    common(lo)

    ss = kinds.add_parser("ssh", help="one worker per host, through the system's ssh")
    ss.add_argument("hosts", nargs="+", metavar="HOST", help="ssh destinations")
    common(ss)
    ss.add_argument("--python", default="python3",
                    help="the Python on the hosts that has colobus (default python3)")
    ss.add_argument("--ssh-arg", action="append", default=[], metavar="ARG",
                    help="an argument for every ssh (repeat; write --ssh-arg=-i --ssh-arg=KEY)")
    ss.add_argument("--bind", default=None, metavar="ADDRESS",
                    help="this machine's address the hosts reach (default: the one toward "
                         "the first host), or a full tcp://ADDRESS:PORT")
    ss.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable for the workers (repeat)")
    ss.add_argument("--cwd", default=None, metavar="DIR",
                    help="the workers' directory on the hosts (default: the login directory)")

    sl = kinds.add_parser(
        "slurm", help="workers as srun steps (outside an allocation: under salloc)")
    sl.add_argument("--nodes", type=positive_int, default=1, help="nodes (default 1)")
    common(sl)
    sl.add_argument("--workers-per-node", type=positive_int, default=1,
                    help="workers (hosts) per node (default 1)")
    sl.add_argument("--python", default=sys.executable,
                    help="the Python on the nodes that has colobus (default: this one)")
    sl.add_argument("--srun-arg", action="append", default=[], metavar="ARG",
                    help="an argument for every srun (repeat)")
    sl.add_argument("--salloc-arg", action="append", default=[], metavar="ARG",
                    help="outside an allocation: an argument for salloc (repeat)")
    sl.add_argument("--bind", default=None, metavar="ADDRESS",
                    help="this machine's address the nodes reach, or tcp://ADDRESS:PORT")

    from .kubernetes import add_manifest_parser

    add_manifest_parser(sub, positive_int)


_BARE_PYTHON = re.compile(r"python(3(\.\d+)?)?")


def driver_command(command: list[str]) -> list[str]:
    """``command`` with a bare ``python``/``python3`` run as this launcher's own Python.

    ``colobus launch`` is often run as ``.venv/bin/colobus`` without the virtual
    environment activated; the ``python`` on ``PATH`` is then another interpreter,
    one without colobus (or the user's packages), and the driver would fail with
    ``No module named 'colobus'``. The local workers run on this interpreter too, and
    hosts with another Python version are refused, so the driver's must be this one.
    A ``pythonX.Y`` of another version, or a path, is run as written.
    """
    head = command[0] if command else ""
    match = _BARE_PYTHON.fullmatch(head)
    if match is None or (match.group(2) is not None
                         and head != f"python{sys.version_info[0]}.{sys.version_info[1]}"):
        return command
    found = shutil.which(head)
    if found is None or os.path.realpath(found) != os.path.realpath(sys.executable):
        log.info("running the driver's %r as %s, the Python colobus launch runs on "
                 "(the %s on PATH is %s)", head, sys.executable, head, found or "missing")
    return [sys.executable, *command[1:]]


class _LaunchError(Exception):
    """A launch that cannot go on: one line for the user, and an exit status."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def _free_tcp(host: str) -> str:
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def _tcp_address(bind: str | None, toward: str) -> str:
    from .ssh import route_source

    if bind and bind.startswith("tcp://"):
        return bind
    host = bind or route_source(toward)
    return _free_tcp(host)


def _local_launcher(hosts: int, devices: int) -> Launcher:
    """``launch local``: local workers whose lines go to logging as ``[host N]``."""
    from .base import log_emit
    from .local import LocalLauncher

    class Local(LocalLauncher):
        def emit(self) -> Emit | None:
            return log_emit(logging.getLogger("colobus.launch.local"))

    # The driver's own modules, from the current directory, import on the workers too.
    return Local(hosts, devices, paths=[os.getcwd(), *sys.path])


def _launcher(args: argparse.Namespace, tmp: str) -> tuple[Launcher, str]:
    """The launcher for ``args`` and the address the driver binds."""
    if args.kind == "local":
        return _local_launcher(args.hosts, args.devices), f"ipc://{tmp}/controller.sock"
    if args.kind == "ssh":
        from .ssh import SshLauncher, ssh_hostname, unresolved

        env = {}
        for item in args.env:
            name, sep, value = item.partition("=")
            if not sep:
                raise _LaunchError(f"--env {item!r}: expected NAME=VALUE", 2)
            env[name] = value
        hostname = ssh_hostname(args.hosts[0], args.ssh_arg)
        try:
            launcher = SshLauncher(args.hosts, args.devices, python=args.python,
                                   ssh_args=args.ssh_arg, env=env, cwd=args.cwd)
            address = _tcp_address(args.bind, hostname)
        except socket.gaierror as exc:
            raise _LaunchError(unresolved(args.hosts[0], hostname, exc), 2) from None
        except (ValueError, OSError) as exc:
            raise _LaunchError(str(exc), 2) from None
        return launcher, address
    from .slurm import SrunLauncher, node_names

    names = node_names(os.environ.get("SLURM_JOB_NODELIST", os.environ.get("SLURM_NODELIST",
                                                                           "")))
    if len(names) < args.nodes:
        raise _LaunchError(f"--nodes {args.nodes}, but allocation {os.environ['SLURM_JOB_ID']} "
                           f"has {len(names)} node(s)", 2)
    srun = SrunLauncher(names[:args.nodes], args.workers_per_node, args.devices,
                        python=args.python, srun_args=args.srun_arg)
    try:
        address = _tcp_address(args.bind, names[0])
    except OSError:  # node names that do not resolve here: toward slurmctld instead
        from .slurm import own_address

        address = _free_tcp(own_address())
    return srun, address


def _under_salloc(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Outside an allocation: run this same ``colobus launch slurm`` line under ``salloc``
    (which shows the job id and waits while it is pending, then runs it inside)."""
    if shutil.which("salloc") is None:
        raise _LaunchError("colobus launch slurm: not inside a Slurm allocation and no "
                           "`salloc` here")
    cmd = ["salloc", f"--nodes={args.nodes}", f"--ntasks-per-node={args.workers_per_node}",
           *args.salloc_arg, sys.executable, "-m", "colobus", *argv]
    log.info("not inside an allocation: asking for one with %s", " ".join(cmd[:3]))
    return subprocess.call(cmd)


class _Signals:
    """Ctrl-C and SIGTERM while ``colobus launch`` runs.

    Before the driver runs, Ctrl-C stops the launch at once (``KeyboardInterrupt``: the
    workers started so far are stopped, the status is 130). While it runs, Ctrl-C reaches
    the driver by itself (the terminal's group; the workers are in sessions of their own,
    so it never reaches them), so the first one here only waits for the driver's own
    ``KeyboardInterrupt``; a second, or SIGTERM, is passed on.
    """

    def __init__(self) -> None:
        self.driver: subprocess.Popen[bytes] | None = None
        self.interrupts = 0
        self.stopping = False
        self.starting = False  # the driver is being started: a Ctrl-C now is passed on
        self.missed = False  # one came then (the driver did not exist to get it)
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        driver = self.driver
        if sig == signal.SIGINT:
            self.interrupts += 1
            if self.stopping:  # the workers are being stopped: let that finish
                return
            if self.starting:  # (raising now could leave a driver started and unseen)
                self.missed = True
                return
            if driver is None:
                raise KeyboardInterrupt  # no driver yet: the launch itself stops
            if self.interrupts == 1:
                return
        if driver is not None and driver.poll() is None:
            driver.send_signal(signal.SIGTERM if sig == signal.SIGINT else sig)


def _stop_driver(driver: subprocess.Popen[bytes]) -> None:
    if driver.poll() is None:
        driver.terminate()
        try:
            driver.wait(DRIVER_STOP_S)
        except subprocess.TimeoutExpired:
            driver.kill()
            driver.wait()


def _watch(driver: subprocess.Popen[bytes], workers: Workers, signals: _Signals) -> int:
    """Wait for the driver; a worker gone for good with an error stops it (status 1).

    After a Ctrl-C, a worker that ends is not blamed: the driver is ending on its own
    ``KeyboardInterrupt`` (its controller closing ends the workers), and its status
    (130) is the run's.
    """
    while True:
        try:
            code = driver.wait(0.2)
            return code if code >= 0 else 128 - code
        except subprocess.TimeoutExpired:
            pass
        if workers.changed.is_set():
            failed = {i: c for i, c in dict(workers.gone).items() if c != 0}
            workers.changed.clear()
            if failed and signals.interrupts:
                log.info("after Ctrl-C: %s; waiting for the driver to end",
                         ", ".join(f"{workers.launcher.describe(i)} ended" for i in failed))
            elif failed:
                i, code = next(iter(failed.items()))
                hp = workers.current[i]
                error = workers.launcher.failure(i, code, list(hp.stderr_tail))
                _stop_driver(driver)
                raise _LaunchError(f"{error}; the driver was stopped")


def run_launch(args: argparse.Namespace, command: list[str] | None,
               argv: Sequence[str]) -> int:
    """Run ``colobus launch``; returns the exit status (the driver's)."""
    if not command:
        print("colobus launch: error: no driver command: write it after `--`, e.g. "
              "colobus launch local --hosts 2 -- python train.py", file=sys.stderr)
        return 2
    if args.restart < 0:
        print("colobus launch: error: --restart must be 0 or more", file=sys.stderr)
        return 2
    try:
        if args.kind == "slurm" and not os.environ.get("SLURM_JOB_ID"):
            try:
                return _under_salloc(args, argv)
            except KeyboardInterrupt:  # (the launch salloc runs says what it stopped)
                return 130
        return _run(args, command)
    except _LaunchError as exc:
        print(f"colobus launch {args.kind}: error: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:  # Ctrl-C before the driver ran (its own is the driver's)
        print(f"colobus launch {args.kind}: interrupted before the driver started; the "
              "workers were stopped", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace, command: list[str]) -> int:
    from .._controller.environ import DEVICES_ENV, PY_MODULES_ENV
    from .._wire.keys import KEY_ENV, write_key
    from .base import Workers

    tmp = tempfile.mkdtemp(prefix="colobus-launch-")  # mode 0700
    try:
        key_file = os.path.join(tmp, "key")
        key = write_key(key_file)
        launcher, address = _launcher(args, tmp)
        workers = Workers(launcher, address, key, restart=args.restart)
        workers.joined = True  # the driver's controller waits for them: restarts apply now
        env = dict(os.environ)
        for path in args.py_module:
            if not (os.path.isdir(path) or (os.path.isfile(path) and path.endswith(".py"))):
                raise _LaunchError(f"--py-module {path}: no package directory or .py file", 2)
        if args.py_module:
            env[PY_MODULES_ENV] = os.pathsep.join(os.path.abspath(p) for p in args.py_module)
        if args.jax_distributed is not None:
            from .._controller.jaxjob import JAX_DISTRIBUTED_ENV

            env[JAX_DISTRIBUTED_ENV] = "1" if args.jax_distributed else "0"
        env.update({"COLOBUS_ADDRESS": address, KEY_ENV: key_file,
                    "COLOBUS_HOSTS": str(len(launcher.names)),
                    "COLOBUS_HOST_NAMES": ",".join(launcher.names),
                    DEVICES_ENV: str(args.devices)})
        log.info("starting %d %s worker(s) for %s; the driver binds %s",
                 len(launcher.names), launcher.kind, command[0], address)
        with _Signals() as signals:
            try:
                workers.start_all()
                signals.starting = True
                try:
                    signals.driver = subprocess.Popen(driver_command(command), env=env)
                except OSError as exc:
                    raise _LaunchError(f"cannot run {command[0]!r}: {exc.strerror or exc}",
                                       127) from None
                finally:
                    signals.starting = False
                if signals.missed:  # a Ctrl-C as it started, before it could get its own
                    signals.driver.send_signal(signal.SIGINT)
                return _watch(signals.driver, workers, signals)
            finally:
                signals.stopping = signals.driver is None
                if signals.driver is None:  # no driver: no controller tells them to exit
                    workers.kill_all()
                else:
                    # The driver's controller is gone; the workers, the launch's, outlive
                    # its sessions: stop them now (SIGTERM: each leaves and exits).
                    _stop_driver(signals.driver)
                    workers.reap(timeout=10.0, grace=0.0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
