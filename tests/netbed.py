"""A multi-host test bed: one Linux network namespace per worker, all on one bridge.

Layout (``T`` is a short random tag per bed, ``X`` a free third octet)::

    root namespace (the test process, the controller)
      bridge cbnTbr  10.211.X.1/24
        |-- veth cbnTh0 ===== cbnTw0  10.211.X.10  in netns colobus-nb-PID-T-0 (worker 0)
        |-- veth cbnTh1 ===== cbnTw1  10.211.X.11  in netns colobus-nb-PID-T-1 (worker 1)
        ...

The /24 exists only on the bridge and inside our namespaces; no route leads
out of it, so all traffic stays between the bed's own interfaces. Cutting a
host (:meth:`NetBed.cut`) sets the root-side end of its veth down; restoring it
sets it up again. :meth:`NetBed.shape` limits a host's link to a rate (``tc`` tbf on
both ends of its veth); :meth:`NetBed.lose` drops a share of the packets a host's
namespace sends and receives, for real (iptables' ``statistic`` match: the kernel
drops them and TCP resends them; :func:`loss_unavailable_reason` says where it
cannot); a :class:`Relay` between a worker and the controller adds a delay each
way (netem, the kernel's delay, is missing from some kernels). Workers run as
``ip netns exec NS python -m colobus worker ...`` with the key in a 0600 file
(never on a command line).

Where the root namespace's iptables ``FORWARD`` chain filters (a Docker host:
policy DROP, with ``bridge-nf-call-iptables=1`` so that frames between two
ports of a bridge pass through it), the bed inserts its own ``ACCEPT`` rules
for its bridge (``-i``/``-o`` it) in each iptables backend that filters.
Several beds (of this run or another one beside it) coexist: each picks its
subnet and tag under a lock file, and names its namespaces and links after its
process.

Everything the bed creates is removed by :meth:`NetBed.close` (idempotent;
called from fixtures' ``finally``). Leftovers of a crashed earlier run (their
creating process is gone; FORWARD rules whose bridge is gone) are removed when
a new bed starts and by ``python tests/netbed.py --cleanup``; a live process's
bed is never touched. Tests use :func:`unavailable_reason` to skip where
namespaces cannot be made.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from colobus._wire.keys import write_key

__all__ = [
    "NetBed", "NetHost", "Relay", "cleanup_leftovers", "cpu_seconds", "eventually",
    "loss_unavailable_reason", "pid_alive", "unavailable_reason",
]

IF_PREFIX = "cbn"  # interface names: cbn<tag>br, cbn<tag>h<i>, cbn<tag>w<i> (<= 15 chars)
NS_PREFIX = "colobus-nb-"  # namespaces: colobus-nb-<creator pid>-<tag>-<i>
ALIAS_PREFIX = "colobus-netbed pid="  # ifalias of the bed's root-side links
SUBNET_BASE = "10.211"  # the bed takes the first free 10.211.X.0/24, X = 7 by preference

_probe_result: list[str | None] = []


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def unavailable_reason() -> str | None:
    """Why a bed cannot be made here (a skip reason), or None if it can."""
    if _probe_result:
        return _probe_result[0]
    reason: str | None = None
    if not sys.platform.startswith("linux"):
        reason = "the netns test bed needs Linux network namespaces"
    elif os.geteuid() != 0:
        reason = "the netns test bed needs root (ip netns add); CI runs it as root"
    elif shutil.which("ip") is None:
        reason = "the netns test bed needs iproute2's `ip` command"
    else:
        probe = f"{NS_PREFIX}probe-{os.getpid()}"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            reason = f"cannot create a network namespace: {made.stderr.strip()}"
        else:
            _ip("netns", "del", probe, check=False)
    _probe_result.append(reason)
    return reason


_iptables: list[tuple[str | None, str]] = []  # (the iptables that works, or None; why not)


def _iptables_probe() -> tuple[str | None, str]:
    """The iptables command whose ``statistic`` DROP rule works inside a namespace
    here (the nft backend first, then legacy), or None and why not."""
    if _iptables:
        return _iptables[0]
    found: tuple[str | None, str] = (None, "")
    why = []
    bed = unavailable_reason()
    if bed is not None:
        found = (None, bed)
    else:
        probe = f"{NS_PREFIX}probe-ipt-{os.getpid()}"
        _ip("netns", "add", probe)
        try:
            for cmd in ("iptables", "iptables-nft", "iptables-legacy"):
                if shutil.which(cmd) is None:
                    why.append(f"no `{cmd}`")
                    continue
                proc = subprocess.run(
                    ["ip", "netns", "exec", probe, cmd, "-w", "-A", "INPUT", "-m", "statistic",
                     "--mode", "random", "--probability", "0.5", "-j", "DROP"],
                    capture_output=True, text=True, timeout=30)
                if proc.returncode == 0:
                    found = (cmd, "")
                    break
                why.append(f"`{cmd}`: {proc.stderr.strip()[-200:]}")
        finally:
            _ip("netns", "del", probe, check=False)
        if found[0] is None:
            found = (None, "real packet loss needs iptables with the statistic match "
                     "(apt-get install iptables; .ci/run installs it): " + "; ".join(why))
    _iptables.append(found)
    return found


def loss_unavailable_reason() -> str | None:
    """Why :meth:`NetBed.lose` cannot drop packets here (a skip reason), or None."""
    cmd, why = _iptables_probe()
    return None if cmd is not None else why


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_leftovers() -> list[str]:
    """Remove namespaces and links of earlier beds whose creating process is gone.

    Returns what was removed. Beds of live processes (a concurrent run) are left alone.
    """
    removed: list[str] = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(NS_PREFIX):
            continue
        pid_text = name[len(NS_PREFIX):].split("-")[0]
        if pid_text.isdigit() and not pid_alive(int(pid_text)):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    net = "/sys/class/net"
    for link in sorted(os.listdir(net)) if os.path.isdir(net) else []:
        if not link.startswith(IF_PREFIX):
            continue
        try:
            with open(os.path.join(net, link, "ifalias")) as f:
                alias = f.read().strip()
        except OSError:
            continue
        if alias.startswith(ALIAS_PREFIX):
            pid_text = alias[len(ALIAS_PREFIX):]
            if pid_text.isdigit() and not pid_alive(int(pid_text)):
                _ip("link", "del", link, check=False)
                removed.append(link)
    # A bed's FORWARD rules name its bridge: once the bridge is gone (its bed's process
    # died, above), they are leftovers. A live bed's bridge exists before its rules do.
    for cmd, spec, dev in _bed_bridge_rules():
        if not os.path.exists(os.path.join(net, dev)):
            subprocess.run([cmd, "-w", "-D", "FORWARD", *spec], capture_output=True,
                           timeout=30)
            removed.append(f"FORWARD rule {' '.join(spec)}")
    return removed


def _iptables_backends() -> list[str]:
    """One iptables command per backend this machine has (nf_tables, legacy)."""
    found: dict[str, str] = {}
    for cmd in ("iptables", "iptables-nft", "iptables-legacy"):
        path = shutil.which(cmd) or shutil.which(cmd, path="/usr/sbin:/sbin")
        if path is None:
            continue
        proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        backend = proc.stdout.strip().rsplit(" ", 1)[-1] if proc.returncode == 0 else ""
        if backend == "(legacy)" and not _legacy_tables():
            continue  # (asking would load legacy tables where nothing uses them)
        if backend and backend not in found:
            found[backend] = path
    return list(found.values())


def _legacy_tables() -> bool:
    """Whether the kernel holds legacy iptables tables (something here uses them)."""
    try:
        with open("/proc/net/ip_tables_names") as f:
            return bool(f.read().strip())
    except OSError:
        return False


def _forward_rules(cmd: str) -> list[list[str]]:
    """The rules of ``cmd``'s FORWARD chain as ``-S`` prints them, split into words."""
    proc = subprocess.run([cmd, "-w", "-S", "FORWARD"], capture_output=True, text=True,
                          timeout=30)
    return [line.split() for line in proc.stdout.splitlines()] if proc.returncode == 0 else []


def _filtering_backends() -> list[str]:
    """The iptables backends whose FORWARD chain may drop what crosses a bridge: a DROP
    policy or any rule (what a Docker engine leaves, with ``bridge-nf-call-iptables``
    on: then frames between two ports of any bridge pass through FORWARD)."""
    return [cmd for cmd in _iptables_backends()
            if _forward_rules(cmd) not in ([], [["-P", "FORWARD", "ACCEPT"]])]


def _bed_bridge_rules() -> Iterator[tuple[str, list[str], str]]:
    """(iptables, rule spec, bridge) for each FORWARD rule naming a bed's bridge."""
    for cmd in _iptables_backends():
        for words in _forward_rules(cmd):
            if words[:2] != ["-A", "FORWARD"]:
                continue
            for flag in ("-i", "-o"):
                if flag in words[:-1]:
                    dev = words[words.index(flag) + 1]
                    if dev.startswith(IF_PREFIX) and dev.endswith("br"):
                        yield cmd, words[2:], dev
                        break


def _free_subnet() -> ipaddress.IPv4Network:
    used = _ip("-4", "-o", "addr", "show", check=False).stdout
    routes = _ip("-4", "route", "show", "table", "all", check=False).stdout
    for third in [7, *range(8, 255)]:
        net = ipaddress.IPv4Network(f"{SUBNET_BASE}.{third}.0/24")
        prefix = f"{SUBNET_BASE}.{third}."
        if prefix not in used and prefix not in routes:
            return net
    raise RuntimeError(f"no free {SUBNET_BASE}.X.0/24 for the netns test bed")


# The same file for every run on this machine, whatever its TMPDIR (beds run as root).
LOCK_FILE = os.path.join("/run/lock" if os.path.isdir("/run/lock") else "/tmp",
                         "colobus-netbed.lock")


@contextlib.contextmanager
def _bed_lock() -> Iterator[None]:
    """Held while a bed picks its subnet and tag, against every other process here."""
    import fcntl

    with open(LOCK_FILE, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (from /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat.rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


@dataclass
class NetHost:
    """One namespace: where one worker runs, with its own address."""

    index: int
    ns: str
    host_if: str  # root-namespace end of the veth, a port of the bridge
    ns_if: str  # the end inside the namespace
    ip: str


class NetBed:
    """A bridge, ``hosts`` namespaces on it, and the worker processes started in them.

    Args:
        hosts: how many namespaces (worker hosts) to make.
    """

    def __init__(self, hosts: int = 2) -> None:
        self.tag = secrets.token_hex(2)
        self.bridge = f"{IF_PREFIX}{self.tag}br"
        self.hosts: list[NetHost] = []
        self._n = hosts
        self._procs: list[subprocess.Popen[bytes]] = []
        self._tmp = tempfile.TemporaryDirectory(prefix="colobus-netbed-")
        self.key_file = os.path.join(self._tmp.name, "key")
        self.key = write_key(self.key_file)
        self.controller_ip = ""
        self._made_links: list[str] = []
        self._made_ns: list[str] = []
        self._made_rules: list[tuple[str, list[str]]] = []  # (iptables, FORWARD rule spec)
        self._closed = False

    # -- building and tearing down -------------------------------------------------

    def create(self) -> NetBed:
        """Make the bridge and namespaces; undoes what it made if a step fails."""
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def _create(self) -> None:
        cleanup_leftovers()
        alias = f"{ALIAS_PREFIX}{os.getpid()}"
        # Another run's bed may be choosing at the same moment: a subnet (and a tag)
        # is taken only under the lock, and taken once its address is on our bridge.
        with _bed_lock():
            while os.path.exists(f"/sys/class/net/{self.bridge}"):
                self.tag = secrets.token_hex(2)
                self.bridge = f"{IF_PREFIX}{self.tag}br"
            net = _free_subnet()
            addrs = list(net.hosts())
            self.controller_ip = str(addrs[0])
            _ip("link", "add", "name", self.bridge, "type", "bridge")
            self._made_links.append(self.bridge)
            _ip("link", "set", "dev", self.bridge, "alias", alias)
            _ip("addr", "add", f"{self.controller_ip}/24", "dev", self.bridge)
        _ip("link", "set", "dev", self.bridge, "up")
        self._accept_forwarding()
        for i in range(self._n):
            h = NetHost(i, f"{NS_PREFIX}{os.getpid()}-{self.tag}-{i}",
                        f"{IF_PREFIX}{self.tag}h{i}", f"{IF_PREFIX}{self.tag}w{i}",
                        str(addrs[9 + i]))
            _ip("netns", "add", h.ns)
            self._made_ns.append(h.ns)
            _ip("link", "add", h.host_if, "type", "veth", "peer", "name", h.ns_if)
            self._made_links.append(h.host_if)
            _ip("link", "set", "dev", h.host_if, "alias", alias)
            _ip("link", "set", h.ns_if, "netns", h.ns)
            _ip("link", "set", h.host_if, "master", self.bridge)
            _ip("link", "set", h.host_if, "up")
            _ip("-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", h.ns_if)
            _ip("-n", h.ns, "link", "set", "lo", "up")
            _ip("-n", h.ns, "link", "set", h.ns_if, "up")
            self.hosts.append(h)
        self._check_reachable()

    def _accept_forwarding(self) -> None:
        """Let the bridge's traffic through a FORWARD chain that would drop it (a Docker
        host's DROP policy): our own ACCEPT rules, first in the chain, for this bridge
        only; :meth:`close` removes them (and :func:`cleanup_leftovers` a dead bed's)."""
        for cmd in _filtering_backends():
            for flag in ("-i", "-o"):
                spec = [flag, self.bridge, "-j", "ACCEPT"]
                proc = subprocess.run([cmd, "-w", "-I", "FORWARD", *spec], capture_output=True,
                                      text=True, timeout=30)
                if proc.returncode != 0:
                    raise RuntimeError(f"netns bed: cannot let {self.bridge} through FORWARD "
                                       f"({cmd}): {proc.stderr.strip()}")
                self._made_rules.append((cmd, spec))

    def _check_reachable(self) -> None:
        """Each namespace can open TCP to the controller's address (else a clear error)."""
        with socket.socket() as srv:
            srv.bind((self.controller_ip, 0))
            srv.listen(len(self.hosts))
            port = srv.getsockname()[1]
            code = ("import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])),"
                    " timeout=5).close()")
            for h in self.hosts:
                proc = subprocess.run(
                    ["ip", "netns", "exec", h.ns, sys.executable, "-c", code,
                     self.controller_ip, str(port)],
                    capture_output=True, text=True, timeout=30)
                if proc.returncode != 0:
                    raise RuntimeError(
                        f"netns bed: {h.ns} ({h.ip}) cannot reach {self.controller_ip}:{port} "
                        f"over the bridge (a firewall?): {proc.stderr.strip()[-300:]}")
                srv.accept()[0].close()

    def close(self) -> None:
        """Kill the bed's workers, delete its namespaces and links; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            for p in self._procs:
                if p.poll() is None:
                    p.kill()
            for p in self._procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(10)
        finally:
            for cmd, spec in reversed(self._made_rules):
                subprocess.run([cmd, "-w", "-D", "FORWARD", *spec], capture_output=True,
                               timeout=30)
            for ns in reversed(self._made_ns):
                _ip("netns", "del", ns, check=False)  # takes the veth pair with it
            for link in reversed(self._made_links):
                if os.path.exists(f"/sys/class/net/{link}"):
                    _ip("link", "del", link, check=False)
            self._tmp.cleanup()

    def __enter__(self) -> NetBed:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- using it ------------------------------------------------------------------------

    def bind(self, port: int | str = "*") -> str:
        """A ZeroMQ endpoint on the controller's bridge address."""
        return f"tcp://{self.controller_ip}:{port}"

    def free_port(self) -> int:
        """A TCP port free on the controller's address right now."""
        with socket.socket() as s:
            s.bind((self.controller_ip, 0))
            return int(s.getsockname()[1])

    def start_worker(self, i: int, connect: str, *, name: str | None = None, devices: int = 2,
                     key_file: str | None = None) -> subprocess.Popen[bytes]:
        """Start ``colobus worker`` inside namespace ``i``; the bed kills it on close.

        The Popen pid is the worker's (``ip netns exec`` execs in place).
        """
        h = self.hosts[i]
        env = dict(os.environ)
        paths = [p if p else os.getcwd() for p in sys.path]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env["COLOBUS_PARENT_PID"] = str(os.getpid())  # no orphans if the test process dies
        env.pop("COLOBUS_KEY_FILE", None)
        cmd = ["ip", "netns", "exec", h.ns, sys.executable, "-m", "colobus", "worker",
               "--connect", connect, "--devices", str(devices),
               "--name", name or f"nb-{i}", "--key-file", key_file or self.key_file]
        proc = subprocess.Popen(cmd, env=env, cwd=os.getcwd(), stdin=subprocess.DEVNULL)
        self._procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to a worker this bed started and reap it."""
        if proc.poll() is None:
            proc.send_signal(sig)
        proc.wait(10)

    def cut(self, i: int) -> None:
        """Take host ``i`` off the network: its bridge-side veth goes down."""
        _ip("link", "set", self.hosts[i].host_if, "down")

    def restore(self, i: int) -> None:
        """Bring host ``i`` back onto the bridge."""
        _ip("link", "set", self.hosts[i].host_if, "up")

    def shape(self, i: int, rate: str, *, burst: str = "64kb", latency: str = "200ms") -> None:
        """Limit host ``i``'s link to ``rate`` (e.g. ``"80mbit"``) both ways (``tc``
        tbf on both ends of its veth); again to change it, :meth:`unshape` to clear it.
        For loss see :meth:`lose`; for delay (netem is not in every kernel), :class:`Relay`."""
        h = self.hosts[i]
        args = ["tbf", "rate", rate, "burst", burst, "latency", latency]
        for prefix in ([], ["ip", "netns", "exec", h.ns]):
            dev = h.ns_if if prefix else h.host_if
            proc = subprocess.run([*prefix, "tc", "qdisc", "replace", "dev", dev, "root", *args],
                                  capture_output=True, text=True, timeout=30)
            if proc.returncode != 0:
                raise RuntimeError(f"tc on {dev} failed: {proc.stderr.strip()}")

    def shape_controller(self, rate: str, *, burst: str = "64kb", latency: str = "200ms"
                         ) -> None:
        """Limit what the controller (the root namespace) sends into the bed to ``rate``:
        ``tc`` tbf on the bridge's egress. Hosts' traffic to each other is forwarded
        between bridge ports and not limited."""
        proc = subprocess.run(["tc", "qdisc", "replace", "dev", self.bridge, "root", "tbf",
                               "rate", rate, "burst", burst, "latency", latency],
                              capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"tc on {self.bridge} failed: {proc.stderr.strip()}")

    def unshape(self, i: int) -> None:
        """Remove what :meth:`shape` set on host ``i``'s link."""
        h = self.hosts[i]
        for prefix in ([], ["ip", "netns", "exec", h.ns]):
            dev = h.ns_if if prefix else h.host_if
            subprocess.run([*prefix, "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True, text=True, timeout=30)

    def lose(self, i: int, probability: float) -> None:
        """Drop ``probability`` of the packets host ``i``'s namespace receives and of
        those it sends, at random, in the kernel (iptables ``statistic`` rules on
        INPUT and OUTPUT): real loss, which TCP recovers from by resending."""
        cmd, why = _iptables_probe()
        if cmd is None:
            raise RuntimeError(why)
        for chain in ("INPUT", "OUTPUT"):
            subprocess.run(
                ["ip", "netns", "exec", self.hosts[i].ns, cmd, "-w", "-A", chain, "-m",
                 "statistic", "--mode", "random", "--probability", str(probability),
                 "-j", "DROP"], check=True, capture_output=True, timeout=30)

    def part(self, i: int, j: int) -> None:
        """Cut the link between hosts ``i`` and ``j`` only (iptables DROP rules in
        ``i``'s namespace, both ways); each still reaches the controller."""
        cmd, why = _iptables_probe()
        if cmd is None:
            raise RuntimeError(why)
        other = self.hosts[j].ip
        for chain, side in (("INPUT", "-s"), ("OUTPUT", "-d")):
            subprocess.run(["ip", "netns", "exec", self.hosts[i].ns, cmd, "-w", "-A", chain,
                            side, other, "-j", "DROP"], check=True, capture_output=True,
                           timeout=30)

    def dropped(self, i: int) -> dict[str, int]:
        """Packets the :meth:`lose` rules of host ``i`` dropped so far, by chain (read
        from the rules' counters: ``iptables -L CHAIN -v -n -x``)."""
        cmd, why = _iptables_probe()
        if cmd is None:
            raise RuntimeError(why)
        out = {}
        for chain in ("INPUT", "OUTPUT"):
            listing = subprocess.run(
                ["ip", "netns", "exec", self.hosts[i].ns, cmd, "-w", "-L", chain, "-v", "-n",
                 "-x"], check=True, capture_output=True, text=True, timeout=30).stdout
            out[chain] = sum(int(line.split()[0]) for line in listing.splitlines()
                             if "DROP" in line.split()[2:3] and "statistic" in line)
        return out

    @contextlib.contextmanager
    def cut_off(self, i: int) -> Iterator[None]:
        """``with bed.cut_off(i):`` host ``i`` is unreachable inside the block."""
        self.cut(i)
        try:
            yield
        finally:
            self.restore(i)


class Relay:
    """A TCP relay that delays every byte by ``delay`` seconds each way (loss is the
    kernel's: :meth:`NetBed.lose`).

    It listens on ``listen_ip`` (a free port: :attr:`port`) and forwards to
    ``target`` (host, port); a thread of its own runs it, so a busy test loop does
    not shape the link. :meth:`close` stops it and closes every connection.
    """

    def __init__(self, listen_ip: str, target: tuple[str, int], *, delay: float = 0.0) -> None:
        import threading

        self.target, self.delay = target, delay
        self._sock = socket.socket()
        self._sock.bind((listen_ip, 0))
        self._sock.listen(16)
        self.port = int(self._sock.getsockname()[1])
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="relay", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve())
            loop.run_until_complete(asyncio.gather(*asyncio.all_tasks(loop),
                                                   return_exceptions=True))
        finally:
            loop.close()

    async def _serve(self) -> None:
        self._server = await asyncio.start_server(self._conn, sock=self._sock)
        async with self._server:
            with contextlib.suppress(asyncio.CancelledError):
                await self._server.serve_forever()

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        writers = [w]
        try:
            tr, tw = await asyncio.open_connection(*self.target)
            writers.append(tw)
            await asyncio.gather(self._pipe(r, tw), self._pipe(tr, w))
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            for x in writers:
                x.close()
                with contextlib.suppress(Exception):
                    await x.wait_closed()

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    w.close()
                    return
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                w.write(data)
                await w.drain()

        sender = loop.create_task(deliver())
        try:
            while data := await r.read(1 << 16):
                queue.put_nowait((loop.time() + self.delay, data))
        finally:
            queue.put_nowait((0.0, b""))
            await asyncio.gather(sender, return_exceptions=True)

    def close(self) -> None:
        def stop() -> None:
            self._server.close()
            for t in asyncio.all_tasks(self._loop):
                t.cancel()

        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(stop)
            self._thread.join(10)


async def eventually(pred: Callable[[], object], timeout: float, what: str,
                     step: float = 0.05) -> None:
    """Poll ``pred()`` (without blocking the loop) until true; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(step)


def _main(argv: list[str]) -> int:
    """``python tests/netbed.py --cleanup``: remove leftovers of beds whose process died."""
    if argv != ["--cleanup"]:
        print("usage: python tests/netbed.py --cleanup", file=sys.stderr)
        return 2
    reason = unavailable_reason()
    if reason is not None:
        print(f"netbed: nothing to clean ({reason})")
        return 0
    removed = cleanup_leftovers()
    print(f"netbed: removed {len(removed)} leftover namespace(s)/link(s)"
          + (f": {', '.join(removed)}" if removed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
