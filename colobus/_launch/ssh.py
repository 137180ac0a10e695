"""``cb.ssh_cluster``: one worker per host, started through the system's ``ssh``.

Each worker runs as ``ssh [ssh_args] -o BatchMode=yes HOST 'exec env ... PYTHON
-m colobus worker --connect ADDR --name NAME --key-file - --exit-on-stdin-eof'``:

- the key is written to the ssh session's stdin (``--key-file -``), never on
  a command line or in the environment, and stdin stays open: when the session
  ends (this process exits or is killed, ``ssh`` is killed, the connection
  drops) the worker reads end-of-file and exits by itself;
- ``ssh`` reads ``~/.ssh/config``, agents and jump hosts as usual; the
  ``ssh_args`` come first, so options given there win over colobus's defaults
  (``ConnectTimeout=5``, ``ServerAliveInterval=5``);
- with ``curve=True`` the connections are CurveZMQ-encrypted: each worker
  reads its own secret key and the controller's public key from the same
  stdin, after the key, and only those workers' keys may connect;
- the controller binds by default on the address of the interface that routes
  to the first host (found with ``ssh -G`` and the kernel's routing table), on
  a random port.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shlex
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._controller.controller import Controller
from .._controller.environ import own_workers
from .._controller.procwatch import describe_exit
from .._wire.keys import generate_key, write_curve_keypair
from .base import LaunchedCluster, Launcher
from .onhosts import relay_argv, relays_on_hosts_option

__all__ = ["SshCluster", "SshLauncher", "concrete_address", "curve_keys", "route_source",
           "ssh_cluster", "ssh_hostname", "worker_command"]

log = logging.getLogger("colobus.launch.ssh")

SSH_DEFAULTS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
                "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3")
SSH_FAILED = 255  # ssh's own exit status when it could not connect or log in


def ssh_hostname(host: str, ssh_args: Sequence[str] = ()) -> str:
    """The address ``ssh`` connects to for ``host`` (``ssh -G``: config aliases resolved)."""
    try:
        out = subprocess.run(["ssh", *ssh_args, "-G", host], capture_output=True, text=True,
                             timeout=10, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return host
    for line in out.stdout.splitlines():
        word, _, value = line.partition(" ")
        if word == "hostname" and value.strip():
            return value.strip()
    return host


def route_source(host: str) -> str:
    """This machine's address on the interface that routes to ``host`` (IPv4).

    A UDP socket "connected" to the host asks the kernel for a route; nothing is sent.

    Raises:
        OSError: ``host`` does not resolve, or no route leads to it.
    """
    addr = socket.getaddrinfo(host, 22, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((addr, 9))
        return str(s.getsockname()[0])


def unresolved(dest: str, hostname: str, exc: OSError) -> str:
    """Why ``dest`` (``hostname`` to ssh) gives no address here, and where to fix it."""
    alias = f" (HostName {hostname!r})" if hostname != dest else ""
    return (f"ssh host {dest!r}{alias} does not resolve on this machine "
            f"({exc.strerror or exc}): check the name, or give the host a HostName in "
            f"~/.ssh/config (`ssh -G {dest}` shows what ssh uses)")


def worker_command(python: str, connect: str, name: str, devices: int,
                   env: Mapping[str, str] | None = None, cwd: str | None = None,
                   curve: bool = False) -> str:
    """The remote shell command that runs one worker, its key (and with ``curve`` its
    CurveZMQ secret key and the server's public key) read from stdin."""
    variables = {"PYTHONUNBUFFERED": "1", "COLOBUS_LOG_LEVEL": "WARNING", **(env or {})}
    for k in variables:
        if not k.isidentifier():
            raise ValueError(f"env: {k!r} is not an environment variable name")
    cmd = shlex.join(["exec", "env", *(f"{k}={v}" for k, v in variables.items()),
                      *shlex.split(python), "-m", "colobus", "worker", "--connect", connect,
                      "--devices", str(devices), "--name", name, "--key-file", "-",
                      *(["--curve-key-file", "-", "--server-key", "-"] if curve else []),
                      "--exit-on-stdin-eof"])
    return f"cd {shlex.quote(cwd)} && {cmd}" if cwd else cmd


def _said(stderr: Sequence[str]) -> str:
    return "; ".join(line.strip() for line in stderr if line.strip())[-600:]


class SshLauncher(Launcher):
    """Workers started as ``ssh HOST python -m colobus worker ...``.

    Args:
        hosts: the ssh destinations (``node1``, ``user@node2``, config aliases).
        devices_per_host: ``--devices`` of each worker.
        python: the Python command on the hosts (may hold words: ``"uv run python"``).
        ssh_args: arguments for every ``ssh`` (``-i KEY``, ``-F CONFIG``, ``-J JUMP``).
        env: environment variables for the workers (never the key).
        cwd: the workers' directory on the hosts (default: the login directory).
    """

    kind = "ssh"
    log = log

    def __init__(self, hosts: Sequence[str], devices_per_host: int = 1, *,
                 python: str = "python3", ssh_args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, cwd: str | None = None) -> None:
        if isinstance(hosts, str):
            raise TypeError("hosts is a list of ssh destinations, e.g. ['node1', 'node2']")
        if devices_per_host < 1:
            raise ValueError("devices_per_host must be >= 1")
        self.destinations = list(hosts)
        super().__init__([f"{h}-{i}" for i, h in enumerate(self.destinations)])
        self.devices_per_host = devices_per_host
        self.python = python
        self.ssh_args = [str(a) for a in ssh_args]
        self.env = dict(env or {})
        self.cwd = cwd
        # CurveZMQ: host i's Z85 secret key and the server's public key (SshCluster sets)
        self.curve: tuple[list[bytes], bytes] | None = None
        worker_command(python, "tcp://x:1", "x", 1, self.env, cwd)  # check env names now

    def describe(self, i: int) -> str:
        return f"ssh host {i} ({self.destinations[i]!r})"

    def ssh_command(self, i: int, connect: str) -> list[str]:
        """The local command line for host ``i``'s worker (no secret in it)."""
        remote = worker_command(self.python, connect, self.names[i], self.devices_per_host,
                                self.env, self.cwd, curve=self.curve is not None)
        return ["ssh", *self.ssh_args, *SSH_DEFAULTS, "-T", self.destinations[i], remote]

    def relay_command(self, i: int, connect: str) -> list[str]:
        variables = {"PYTHONUNBUFFERED": "1", "COLOBUS_LOG_LEVEL": "WARNING", **self.env}
        remote = shlex.join(["exec", "env", *(f"{k}={v}" for k, v in variables.items()),
                             *shlex.split(self.python), "-m", "colobus",
                             *relay_argv(connect, i)])
        if self.cwd:
            remote = f"cd {shlex.quote(self.cwd)} && {remote}"
        return ["ssh", *self.ssh_args, *SSH_DEFAULTS, "-T", self.destinations[i], remote]

    def start(self, i: int, connect: str, key: bytes) -> subprocess.Popen[bytes]:
        # A session of its own: Ctrl-C reaches this process only, which then stops the
        # workers in order (a SIGINT to ssh too would race with that).
        proc = subprocess.Popen(self.ssh_command(i, connect), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        assert proc.stdin is not None
        lines = [key.hex().encode()]
        if self.curve is not None:  # then the worker's CurveZMQ secret, the server's public key
            secrets, server_public = self.curve
            lines += [secrets[i], server_public]
        try:  # on the session's stdin, which stays open (see the module docs)
            proc.stdin.write(b"".join(line + b"\n" for line in lines))
            proc.stdin.flush()
        except OSError:  # ssh already gone: its exit and message tell why
            pass
        return proc

    def ended(self, code: int, stderr: Sequence[str]) -> str:
        if code == SSH_FAILED:
            last = [line.strip() for line in stderr if line.strip()][-1:]
            return "lost its ssh session" + (f" ({last[0]})" if last else
                                             " (ssh exited with status 255)")
        if code < 0:
            return f"lost its ssh session: the ssh client {describe_exit(code, hint=False)}"
        return f"exited with status {code} (over ssh)"

    def lost_because(self, how: str) -> str:
        return f"its worker {how}"

    def failure(self, i: int, code: int, stderr: Sequence[str]) -> Exception:
        dest = self.destinations[i]
        said = _said(stderr)
        if code == SSH_FAILED:
            return ConnectionError(
                f"cannot start the colobus worker on {dest!r} (ssh host {i}): ssh failed: "
                f"{said or describe_exit(code)}")
        return RuntimeError(
            f"the colobus worker on {dest!r} (ssh host {i}) {describe_exit(code)} before "
            f"joining" + (f": {said}" if said else ""))


def concrete_address(address: str, source: Callable[[], str]) -> str:
    """The endpoint workers join: the bound ``address``, a wildcard host (``0.0.0.0``)
    replaced by ``source()`` (this machine's address toward the workers)."""
    rest = address.split("://", 1)[1]
    host, _, port = rest.rpartition(":")
    host = host.strip("[]")
    try:
        wildcard = host in ("*", "") or ipaddress.ip_address(host).is_unspecified
    except ValueError:
        wildcard = False
    return f"tcp://{source()}:{port}" if wildcard else address


class SshCluster(LaunchedCluster):
    """A controller plus one worker per ssh host; see :func:`ssh_cluster`."""

    def __init__(self, hosts: Sequence[str], devices_per_host: int = 1, *,
                 python: str = "python3", ssh_args: Sequence[str] = (), bind: str | None = None,
                 restart: int = 0, env: Mapping[str, str] | None = None,
                 cwd: str | None = None, curve: bool = False, **options: Any) -> None:
        launcher = SshLauncher(hosts, devices_per_host, python=python, ssh_args=ssh_args,
                               env=env, cwd=cwd)
        if any(name.startswith("curve_") for name in options):
            raise ValueError("ssh_cluster sets up CurveZMQ itself: give curve=True, not "
                             "curve_* options (docs/security.md)")
        if bind is None:
            first = launcher.destinations[0]
            hostname = ssh_hostname(first, launcher.ssh_args)
            try:
                bind = f"tcp://{route_source(hostname)}:*"
            except socket.gaierror as exc:
                raise OSError(f"ssh_cluster: {unresolved(first, hostname, exc)}") from exc
            except OSError as exc:
                raise OSError(f"ssh_cluster: cannot find this machine's address toward "
                              f"{first!r} ({exc}); give bind='tcp://ADDRESS:*'") from exc
        key = generate_key()
        options.setdefault("exit_workers_on_close", True)
        per = relays_on_hosts_option(options.pop("relays_on_hosts", 0), options)
        curve_dir = tempfile.mkdtemp(prefix="colobus-curve-") if curve else None  # mode 0700
        try:
            if curve_dir is not None:
                options.update(curve_keys(launcher, curve_dir))
            with own_workers():  # its address, whatever a surrounding launch says
                controller = Controller(bind, hosts=len(launcher.names), key=key, **options)
        finally:  # the controller has read its secret key: the file goes at once
            if curve_dir is not None:
                shutil.rmtree(curve_dir, ignore_errors=True)
        first, args = launcher.destinations[0], launcher.ssh_args
        super().__init__(launcher, controller, key, restart=restart,
                         connect=lambda address: concrete_address(
                             address, lambda: route_source(ssh_hostname(first, args))),
                         relays_on_hosts=per)




def curve_keys(launcher: SshLauncher, folder: str) -> dict[str, Any]:
    """CurveZMQ for one cluster, as :class:`Controller` options: a server key pair (its
    secret in a 0600 file in ``folder``, for the controller to read) and a key pair per
    host, whose secret the launcher writes to that host's worker on its stdin; only
    those hosts' public keys may connect."""
    import zmq

    server_public, _ = write_curve_keypair(os.path.join(folder, "server"))
    pairs = [zmq.curve_keypair() for _ in launcher.names]
    launcher.curve = ([secret for _, secret in pairs], server_public)
    return {"curve_secret_key": os.path.join(folder, "server"),
            "curve_allow": [public for public, _ in pairs]}


def ssh_cluster(hosts: Sequence[str], devices_per_host: int = 1, *, python: str = "python3",
                ssh_args: Sequence[str] = (), bind: str | None = None, restart: int = 0,
                **options: Any) -> SshCluster:
    """A controller here plus one worker per host, started through ``ssh``.

    Use as ``async with`` or ``with``, like :func:`local_cluster`. Entry waits
    until every worker joined; a host that cannot be reached or refuses the
    login fails it within seconds with an error naming the host and ssh's own
    message, and the other workers are stopped. Exit (also on error or Ctrl-C)
    stops every worker; a worker whose ssh session ends exits by itself. Each
    worker's output is logged (logger ``colobus.launch.ssh``) as ``[host N] ...``.

    Args:
        hosts: ssh destinations, one worker each; host ``i`` is ``hosts[i]``.
        devices_per_host: CPU devices per worker (``colobus worker --devices``).
        python: the Python on the hosts that has colobus installed.
        ssh_args: arguments for every ``ssh`` (``-i``, ``-F``, ``-J``, ``-o ...``).
        bind: the controller's endpoint (default: this machine's address toward
            the first host, a random port). A wildcard (``tcp://0.0.0.0:5555``)
            binds every interface; workers are told the address toward the first host.
        restart: how often each host's worker may be started again after its
            process or ssh session ended; it rejoins under its name.
        **options: ``env`` (variables for the workers), ``cwd`` (their directory
            there), ``curve=True`` (CurveZMQ encryption, keys made for this cluster
            and sent on the workers' stdin), and :class:`Controller` options
            (``join_timeout``, ``metrics``, ...).

    Raises:
        ConnectionError: on entry, ssh could not reach a host or log in.
        RuntimeError: on entry, a worker exited before joining (no colobus there?).
        TimeoutError: on entry, not every worker joined within ``join_timeout``.
    """
    return SshCluster(hosts, devices_per_host, python=python, ssh_args=ssh_args, bind=bind,
                      restart=restart, **options)
