"""A JAX job never costs more than its session, and only key holders reach its
coordination (docs/jax_job.md, docs/security.md, docs/network.md).

Real worker processes throughout: a module cluster (2 hosts x 1 CPU device,
``jax_distributed=True``, each host restartable once, a short liveness timeout since
losses are waited for) for the listeners, the stranger, a busy survivor and a frozen
host; standalone ``colobus worker`` processes for a driver killed with SIGKILL, and for
SIGTERM and SIGINT to a job's worker. Every wait is on an event (a file, a line, a
state), bounded.
"""

from __future__ import annotations

import collections.abc
import contextlib
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hostview_hostside import cross_host_sum
from lifecycle import SETTLE_S
from safety_hostside import hold_the_gil_until

import colobus as cb

P = cb.PartitionSpec
DOCS = Path(__file__).resolve().parent.parent / "docs"
LIVENESS_S = 3.0  # losses are waited for here (a frozen host); short, not spurious
ABORTS = ("Terminating process", "FATAL", "terminate called", "Aborted", "Check failed",
          "core dumped")


# -- what listens: /proc, as `ss -lp` reads it -----------------------------------------------


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


def tcp_listeners(pid: int) -> set[tuple[str, int]]:
    """(address, port) of each TCP socket ``pid`` listens on (IPv4 and IPv6)."""
    mine = _socket_inodes(pid)
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in mine:  # 0A: LISTEN
                address, port = f[1].split(":")
                raw = bytes.fromhex(address)
                if table == "tcp":
                    text = socket.inet_ntop(socket.AF_INET, raw[::-1])
                else:  # (four little-endian words)
                    text = socket.inet_ntop(socket.AF_INET6, b"".join(
                        raw[i:i + 4][::-1] for i in range(0, 16, 4)))
                found.add((text, int(port, 16)))
    return found


def established_to(pid: int, ports: set[int]) -> set[int]:
    """The local ports of ``pid``'s established TCP connections to any of ``ports``."""
    mine = _socket_inodes(pid)
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "01" and f[9] in mine and int(f[2].split(":")[1], 16) in ports:
                found.add(int(f[1].split(":")[1], 16))
    return found


def unix_listeners(pid: int) -> set[str]:
    """The paths of the Unix sockets ``pid`` listens on."""
    mine = _socket_inodes(pid)
    found = set()
    for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
        f = line.split()
        # flags 00010000: __SO_ACCEPTON (listening); a path in the 8th field
        if len(f) >= 8 and f[6] in mine and int(f[3], 16) & 0x10000:
            found.add(f[7])
    return found


def documented_job_listeners() -> dict[str, tuple[int, int]]:
    """docs/network.md's port table, the rows of a JAX job: who listens -> (TCP
    ports, Unix sockets), from the words of its "where" column."""
    rows: dict[str, tuple[int, int]] = {}
    for line in (DOCS / "network.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or "JAX job" not in cells[0]:
            continue
        who = "worker" if "worker" in cells[0] else "driver"
        where = cells[1]
        tcp = 1 if "one TCP port" in where else 0 if "no TCP port" in where else -1
        unix = 1 if "a Unix socket" in where else 0
        assert tcp >= 0, f"the row {cells[0]!r} says neither 'one TCP port' nor 'no TCP port'"
        old = rows.get(who, (0, 0))
        rows[who] = (old[0] + tcp, old[1] + unix)
    return rows


# -- the module cluster ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def safe_job() -> collections.abc.Iterator[tuple[cb.Controller, set[tuple[str, int]]]]:
    """The module's job cluster, and the TCP ports this process listened on before it."""
    before = tcp_listeners(os.getpid())
    with cb.local_cluster(hosts=2, devices_per_host=1, jax_distributed=True, restart=1,
                          relays=0, liveness_timeout=LIVENESS_S, join_timeout=120) as ctl:
        yield ctl, before


@pytest.fixture
def job2(safe_job: tuple[cb.Controller, Any]) -> collections.abc.Iterator[cb.Controller]:
    from colobus._controller.controller import _pop_current, _push_current

    ctl = safe_job[0]
    ctl.run_sync(ctl.wait_for_hosts(timeout=120))  # (formed again after an earlier test)
    _push_current(ctl)
    try:
        yield ctl
    finally:
        _pop_current(ctl)


def _over_both() -> cb.Array:
    mesh = cb.make_mesh((2,), ("x",))
    return cb.device_put(np.array([3.0, 4.0], np.float32), cb.NamedSharding(mesh, P("x")))


def _sums_right(ctl: cb.Controller) -> None:
    total = cross_host_sum(_over_both())
    assert float(cb.device_get(total)) == 7.0


def _wait(pred: Any, what: str, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _old_service_stopped(ctl: cb.Controller, generation: int) -> bool:
    """The job of ``generation`` ended and its coordination service has stopped."""
    job = ctl._job
    assert job is not None
    return (job.state != "formed" or job.generation > generation) and all(
        not t.is_alive() for t in job._stopping)


# -- the listeners, against the docs ------------------------------------------------------------


def test_the_docs_list_every_listener_of_a_job(safe_job: Any, job2: cb.Controller) -> None:
    ctl, before = job2, safe_job[1]
    _sums_right(ctl)  # (gloo listens from the first collective on)
    documented = documented_job_listeners()
    assert set(documented) == {"worker", "driver"}, documented
    # each worker: its gloo port (loopback: the driver's address is ipc://), its JAX
    # client's Unix socket in a private directory; nothing else of the job's (its data
    # plane is an ipc:// socket here, not a TCP port)
    for host in ctl.hosts():
        tcp, unix = tcp_listeners(host.pid), unix_listeners(host.pid)
        jax_unix = {p for p in unix if "colobus-jax-" in p}
        assert (len(tcp), len(jax_unix)) == documented["worker"], (host.index, tcp, unix)
        assert all(address == "127.0.0.1" for address, _ in tcp), tcp
        for path in jax_unix:
            folder = os.stat(os.path.dirname(path))
            assert stat.S_IMODE(folder.st_mode) == 0o700 and folder.st_uid == os.getuid()
    # the driver: the coordination service on a Unix socket in a private directory, and
    # no TCP port (this process listens on none it did not listen on before the job)
    service = ctl.stats()["jax_job"]["coordinator"]
    assert service.startswith("unix:"), service
    mine = {p for p in unix_listeners(os.getpid()) if "colobus-jax-" in p}
    assert service[len("unix:"):] in mine
    new_tcp = tcp_listeners(os.getpid()) - before
    assert (len(new_tcp), 1) == documented["driver"], new_tcp
    assert stat.S_IMODE(os.stat(os.path.dirname(service[len("unix:"):])).st_mode) == 0o700


# -- a stranger: no key, another account or the network -----------------------------------------


ATTACKER = r"""
import concurrent.futures, socket, sys
from jax._src.lib import _jax

def grpc_server(target):  # an HTTP/2 server answers a client's preface with SETTINGS at
    host, _, port = target.rpartition(":")  # once; gloo waits for more (then: not one)
    with socket.create_connection((host, int(port)), timeout=3) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
        head = b""
        try:
            while len(head) < 9 and (chunk := s.recv(9 - len(head))):
                head += chunk
        except OSError:
            pass
        return len(head) == 9 and head[3] == 4

def attack(address):
    client = _jax.get_distributed_runtime_client(address, 0, init_timeout=5,
                                                 shutdown_on_destruction=False)
    client.connect()
    print("IN", address, flush=True)
    print("READ", client.key_value_dir_get(""), flush=True)
    for i in range(8):  # gloo's rendezvous keys, written ahead of gloo
        client.key_value_set(f"gloo/{i}", "stranger", allow_overwrite=True)
    print("WROTE", flush=True)

with socket.socket() as s:  # the control: a service it may reach, where all of it works
    s.bind(("127.0.0.1", 0))
    control = f"127.0.0.1:{s.getsockname()[1]}"
service = _jax.get_distributed_runtime_service(control, 1)
targets = [control, *sys.argv[1:]]
with concurrent.futures.ThreadPoolExecutor(len(targets)) as pool:
    speaks = list(pool.map(grpc_server, targets))
for target, grpc in zip(targets, speaks):
    if grpc:
        attack(target)
    else:
        print("NOT-GRPC", target, flush=True)
print("DONE", flush=True)
"""


def _as_nobody_connect(path: str) -> int:
    """Connect to the Unix socket ``path`` as another account (uid 65534) in a forked
    child: 0 connected, else the errno."""
    with warnings.catch_warnings():
        # (fork with threads, which Python and JAX warn of where JAX is imported in this
        # process: the child only connects, then exits)
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 99
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(path)
            code = 0
        except OSError as exc:
            code = exc.errno or 98
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.skipif(os.geteuid() != 0, reason="another account needs root to become")
def test_a_stranger_cannot_reach_the_jobs_coordination(job2: cb.Controller,
                                                       tmp_path: Path) -> None:
    ctl = job2
    _sums_right(ctl)
    service = ctl.stats()["jax_job"]["coordinator"]
    # a network peer: every TCP port of the job (each worker's gloo; a coordinator a
    # driver announces at HOST:PORT) tried with jaxlib's own client, reading the
    # topology and pre-writing gloo's keys where it gets in
    targets = [f"{a}:{p}" for host in ctl.hosts() for a, p in tcp_listeners(host.pid)]
    if not service.startswith("unix:"):  # (HOST:PORT, or *:PORT: as coordinators once were)
        targets.append(service.replace("*:", "127.0.0.1:"))
    assert targets
    out = subprocess.run([sys.executable, "-c", ATTACKER, *targets], capture_output=True,
                         text=True, timeout=120)
    said = out.stdout + out.stderr[-2000:]
    assert "DONE" in out.stdout and out.stdout.count("WROTE") == 1, said  # (the control)
    assert out.stdout.split().count("IN") == 1, said  # the control only
    assert out.stdout.count("NOT-GRPC") == len(targets), said
    # another account on this machine: the driver's service socket and each worker's
    # JAX client socket are in directories it cannot enter
    sockets = [service[len("unix:"):]] if service.startswith("unix:") else []
    for host in ctl.hosts():
        sockets += [p for p in unix_listeners(host.pid) if "colobus-jax-" in p]
    assert len(sockets) == 3, sockets
    for path in sockets:
        assert _as_nobody_connect(path) == 13, path  # EACCES
    # (that account can connect where it may: the check itself works)
    open_dir = Path(tempfile.mkdtemp())
    try:
        os.chmod(open_dir, 0o755)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as control:
            control.bind(str(open_dir / "s"))
            os.chmod(open_dir / "s", 0o777)
            control.listen(1)
            assert _as_nobody_connect(str(open_dir / "s")) == 0
    finally:
        shutil.rmtree(open_dir)
    # the collectives still give exact results, and the job stands
    _sums_right(ctl)
    assert ctl.stats()["jax_job"]["state"] == "formed"


# -- a busy survivor, a frozen host ------------------------------------------------------------


def test_a_survivor_busy_in_host_code_outlives_a_loss_and_rejoins(job2: cb.Controller,
                                                                  tmp_path: Path) -> None:
    """Host 0 holds the GIL in a host call (it cannot even hear its session end) while
    host 1 dies and the job's coordination service stops; it lives, then rejoins."""
    ctl = job2
    before = ctl.stats()["jax_job"]["generation"]
    survivor = ctl.hosts()[0].pid
    started, fifo = tmp_path / "started", tmp_path / "fifo"
    os.mkfifo(fifo)
    mesh0 = cb.Mesh(np.array(ctl.devices()[:1]), ("x",))
    x0 = cb.device_put(np.zeros(2, np.float32), cb.NamedSharding(mesh0, P("x")))
    busy = hold_the_gil_until.specialize(out_specs_fn=lambda x, s, f: x)(x0, str(started),
                                                                         str(fifo))
    _wait(started.exists, "host 0's busy call")
    os.kill(ctl.hosts()[1].pid, signal.SIGKILL)
    _wait(lambda: _old_service_stopped(ctl, before), "the job's service to stop")
    # (JAX ended survivors here once: the service's shutdown reached their clients)
    with open(fifo, "wb") as release:  # (opens once host 0 waits in it)
        release.write(b"x")
    with pytest.raises(cb.HostLostError):
        cb.device_get(busy)
    ctl.run_sync(ctl.wait_for_hosts(timeout=120))  # host 1 restarted; host 0 rejoined
    info = ctl.stats()["jax_job"]
    assert info["state"] == "formed" and info["generation"] > before, info
    assert ctl.hosts()[0].pid == survivor
    _sums_right(ctl)


def test_a_frozen_host_resumes_and_rejoins_the_job(job2: cb.Controller) -> None:
    """SIGSTOP past the liveness timeout, then SIGCONT: the same processes form the job
    again (nothing restarted them)."""
    ctl = job2
    before = ctl.stats()["jax_job"]["generation"]
    pids = [h.pid for h in ctl.hosts()]
    os.kill(pids[1], signal.SIGSTOP)
    try:
        _wait(lambda: ctl.hosts()[1].state == "lost", "the frozen host's loss")
        _wait(lambda: _old_service_stopped(ctl, before), "the job's service to stop")
        # ... and every connection it had to this process's ports closed under it (a
        # coordinator on a TCP port, as once; none now)
        ours = {port for _, port in tcp_listeners(os.getpid())}
        _wait(lambda: not established_to(pids[1], ours), "its connections to close")
    finally:
        os.kill(pids[1], signal.SIGCONT)
    ctl.run_sync(ctl.wait_for_hosts(timeout=120))
    info = ctl.stats()["jax_job"]
    assert info["state"] == "formed" and info["generation"] > before, info
    assert [h.pid for h in ctl.hosts()] == pids
    _sums_right(ctl)


# -- a driver killed; SIGTERM and SIGINT to a job's workers ----------------------------------------


DRIVER = r"""
import sys
import numpy as np
import colobus as cb
from colobus._wire.keys import load_key
from hostview_hostside import cross_host_sum

address, key_file = sys.argv[1], sys.argv[2]
with cb.Controller(address, hosts=2, key=load_key(key_file), jax_distributed=True,
                   liveness_timeout=2.0, join_timeout=120) as ctl:
    sharding = cb.NamedSharding(cb.make_mesh((2,), ("x",)), cb.PartitionSpec("x"))
    x = cb.device_put(np.array([3.0, 4.0], np.float32), sharding)
    print("FORMED", float(cb.device_get(cross_host_sum(x))), flush=True)
    sys.stdin.read()  # until killed
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [p if p else os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    for name in ("COLOBUS_KEY_FILE", "COLOBUS_PARENT_PID", "COLOBUS_JAX_DISTRIBUTED"):
        env.pop(name, None)
    return env


def _line(proc: subprocess.Popen[str], want: str, seconds: float = 180.0) -> str:
    """The first line of ``proc``'s output that starts with ``want``."""
    got: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(want):
                got.append(line)
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(seconds)
    assert got, f"no {want!r} line within {seconds} s"
    return got[0]


def _no_abort(log: Path) -> str:
    text = log.read_text(errors="replace")
    hits = [word for word in ABORTS if word in text]
    assert not hits, f"{hits} in {log.name}:\n{text[-3000:]}"
    return text


def test_a_killed_driver_costs_only_its_session_and_signals_stop_workers(
        tmp_path: Path) -> None:
    from colobus._controller.controller import _pop_current, _push_current
    from colobus._wire.keys import write_key

    key_file = tmp_path / "key"
    key = write_key(key_file)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    logs = [tmp_path / f"w{i}.log" for i in range(2)]
    procs: list[subprocess.Popen[Any]] = []
    try:
        for i, log in enumerate(logs):  # started by hand, as an operator would
            with open(log, "w") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "colobus", "worker", "--connect", address,
                     "--name", f"w{i}", "--devices", "1", "--key-file", str(key_file)],
                    env=_env(), stdin=subprocess.DEVNULL, stdout=out, stderr=out))
        driver = subprocess.Popen([sys.executable, "-c", DRIVER, address, str(key_file)],
                                  env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        procs.append(driver)
        assert _line(driver, "FORMED").split()[1] == "7.0"
        driver.kill()  # SIGKILL: its coordination service goes with it
        driver.wait(30)
        # the workers live on, and join the next driver at the same address
        with cb.Controller(address, hosts=2, key=key, jax_distributed=True,
                           join_timeout=120) as ctl:
            _push_current(ctl)
            try:
                assert sorted(h.pid for h in ctl.hosts()) == sorted(p.pid for p in procs[:2])
                assert ctl.stats()["jax_job"]["state"] == "formed"
                _sums_right(ctl)
                # SIGTERM (docker, k8s, systemd) and SIGINT (a terminal's Ctrl-C) stop a
                # job's workers, without any abort; Ctrl-C's status is a shell's (130)
                procs[0].send_signal(signal.SIGTERM)
                procs[1].send_signal(signal.SIGINT)
                assert procs[0].wait(SETTLE_S) == 0
                assert procs[1].wait(SETTLE_S) == 130
            finally:
                _pop_current(ctl)
        for log in logs:
            text = _no_abort(log)
            assert re.search(r"joined .* as host", text), text[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
            for pipe in (p.stdin, p.stdout):
                if pipe is not None:
                    pipe.close()


# -- what a key holder's COORD costs the controller ------------------------------------------------


async def test_a_hosts_coordination_bytes_are_bounded(tmp_path: Path) -> None:
    """The controller carries a host's COORD only for the current generation while the host
    is a member, over at most 8 connections, each with at most 16 MiB the service has not
    read; beyond that the host is dropped. (A real Unix listener stands in for the service:
    it accepts and never reads.)"""
    import asyncio
    import collections
    import types

    from colobus._controller.coordlink import MAX_BUFFERED, MAX_CONNECTIONS, CoordLink
    from colobus._wire import protocol as WP

    sent: list[tuple[int, Any]] = []
    violations: list[tuple[int, str]] = []
    owner = types.SimpleNamespace(_send=lambda host, body, payload=b"", *a: sent.append(
        (host.index, body)))
    dropped: collections.Counter[str] = collections.Counter()
    link = CoordLink(owner, lambda host, reason, detail="": violations.append(
        (host.index, detail)), dropped)  # type: ignore[arg-type]
    host0 = types.SimpleNamespace(index=0, generation=3, alive=True)
    stranger = types.SimpleNamespace(index=1, generation=1, alive=True)
    address = link.open(5, {0: 3})
    assert address.startswith("unix:")
    service = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    service.bind(address[len("unix:"):])
    service.listen(64)
    service.setblocking(False)

    def coord(host: Any, conn: int, data: bytes = b"x", generation: int = 5) -> None:
        link.on_coord(host, WP.Coord(generation, conn, False),  # type: ignore[arg-type]
                      types.SimpleNamespace(payload=data))  # type: ignore[arg-type]

    try:
        coord(host0, 0, generation=4)  # a job that ended
        coord(stranger, 0)  # a host not in this one
        assert dropped["stale"] == 2 and not link._pipes
        for conn in range(MAX_CONNECTIONS):
            coord(host0, conn)
        await asyncio.sleep(0)  # (connected on the loop)
        accepted = []
        while len(accepted) < MAX_CONNECTIONS:
            try:
                accepted.append(service.accept()[0])
            except BlockingIOError:
                await asyncio.sleep(0.01)
        assert not violations
        coord(host0, MAX_CONNECTIONS)  # one more connection: dropped
        assert violations and "connections" in violations[-1][1]
        violations.clear()
        chunk = b"y" * (1 << 20)
        for _ in range(MAX_BUFFERED // len(chunk) + 2):  # the service reads none of it
            coord(host0, 0, chunk)
        assert violations and "did not read" in violations[-1][1]
        link.cut()  # everything cut at once: the service sees each connection end
        for conn in accepted:
            conn.setblocking(True)
            conn.settimeout(30)
            while conn.recv(1 << 20):
                pass
            conn.close()
    finally:
        service.close()
        link.close()
