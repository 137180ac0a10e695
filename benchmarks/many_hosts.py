"""Many hosts on one controller: join time, idle CPU, fan-out latency, memory per host.

Connects ``--hosts`` (default 256 and 1,024) light protocol-level hosts to one
controller on this machine and measures:

* join: from the moment every host process is ready (imports done) until the
  controller counts all of them joined (JOIN -> CHALLENGE -> HELLO -> WELCOME);
* idle: the controller's CPU over ``--idle`` seconds with nothing but heartbeats
  (its loop thread, from ``time.thread_time()``, and the whole process, from
  ``resource.getrusage``: the difference is ZeroMQ's I/O thread);
* fan-out: a no-op call specialized on every device, so every host gets a CALL
  and answers a RESULT with an empty output description; median latency and the
  controller's loop-thread CPU per call and per host;
* memory: the controller's RSS growth from before the hosts joined to after,
  per host.

A light host speaks the real protocol with colobus's own pieces (``_wire``,
``_protocol``, ``_channel``: seq/ack, batching, resends) and no JAX: several
hosts share one process and one asyncio loop, each with its own DEALER socket,
session and routing id. It answers CALLs with the description of a call that
returned ``None``, heartbeats every ``heartbeat_interval`` and echoes pings.

    python benchmarks/many_hosts.py                   # 256 and 1,024 hosts
    python benchmarks/many_hosts.py --hosts 64 --profile
    python benchmarks/many_hosts.py --json out.json
    python benchmarks/many_hosts.py --remote-relays 4    # relays as on other machines

Targets at 1,024 hosts (issue 15): joined in under 30 s, idle controller under
5 % of one core, fan-out no-op under 100 ms, under 50 KiB of controller memory
per host.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import importlib.metadata
import io
import json
import os
import pstats
import resource
import secrets
import statistics
import subprocess
import sys
import time
import types
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.join(os.path.dirname(HERE), "colobus")


# -- the light host side (no JAX: the colobus package's __init__ is not run) --------------


def _import_protocol_pieces() -> None:
    """Make ``colobus._wire.channel`` etc. importable without ``colobus/__init__`` (JAX)."""
    if "colobus" not in sys.modules:
        pkg = types.ModuleType("colobus")
        pkg.__path__ = [PACKAGE]
        # (what a host reports at join, as the real package says it)
        pkg.__version__ = importlib.metadata.version("colobus")  # type: ignore[attr-defined]
        sys.modules["colobus"] = pkg


class LightHost:
    """One protocol-level host: joins, heartbeats, answers CALLs with "returned None"."""

    def __init__(self, zctx: Any, address: str, key: bytes, name: str,
                 loop: asyncio.AbstractEventLoop) -> None:
        import zmq

        from colobus._wire.channel import Channel, Peer

        self.zctx, self.address, self.loop = zctx, address, loop
        self.identity = b"w" + secrets.token_bytes(16)
        sock = self._socket(address)
        self.key = key
        self.name = name
        self.peer = Peer([], secrets.token_bytes(16), b"")
        self.chan = Channel(sock, key, loop, self.on_frames, send_flags=zmq.NOBLOCK)
        self.joined = False
        self.ended = False
        self.answered = False
        self.ping = 0
        self.ping_at = 0
        self.calls = 0

    def _socket(self, address: str) -> Any:
        import zmq

        sock = self.zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.ROUTING_ID, self.identity)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.connect(address)
        return sock

    def move(self, relay: str) -> None:
        """The WELCOME named a relay: the session goes on there (as a worker's does)."""
        if relay.startswith("tcp://*:"):
            relay = self.address.rsplit(":", 1)[0] + ":" + relay.rsplit(":", 1)[1]
        self.chan.move(self._socket(relay), self.peer)

    def send_join(self) -> None:
        from colobus._wire import protocol as P

        self.answered = False
        self._raw(P.Join())

    def _raw(self, body: Any) -> None:
        from colobus._wire.envelope import Envelope

        self.peer.send_seq += 1
        self.chan.send_raw([], Envelope(body.kind, self.peer.session, b"",
                                        self.peer.send_seq, body.to_wire()))

    def heartbeat(self) -> None:
        from colobus._wire import protocol as P

        ping, self.ping = self.ping, 0
        held = time.monotonic_ns() - self.ping_at if ping else 0
        self.chan.send(self.peer, P.Heartbeat(0, 0, 0, 0, ping, held, 0, 0, {}))

    def on_frames(self, frames: list[Any]) -> None:
        from colobus._wire.envelope import BATCH_KIND, Dropped, decode, unpack_batch
        from colobus._wire.protocol import Kind

        peer = self.peer
        try:
            env = decode(self.key, frames)
        except Dropped:
            return
        if env.receiver != peer.session:
            return
        if not self.joined:
            if env.kind not in (Kind.WELCOME, Kind.REJECT, Kind.CHALLENGE):
                return
            peer.recv_seq = env.seq - 1
        elif env.sender != peer.their_session:
            return
        elif env.kind == Kind.RESET:
            self.ended = True
            return
        # As a worker does: ACKs (and a NACK's resend at once) and owed ACKs through the
        # channel; a light host that took numbered envelopes only (``peer.accept``) ignored
        # a relay's NACK after a gap and recovered by its resend timer alone (seconds).
        got = self.chan.take(peer, env, 1 << 62)
        if got is None or isinstance(got, str):
            return
        env = got
        for sub in unpack_batch(env) if env.kind == BATCH_KIND else [env]:
            self.dispatch(sub)

    def dispatch(self, env: Any) -> None:
        from colobus._wire import protocol as P
        from colobus._wire.protocol import Kind, Status

        kind, body = env.kind, env.body
        if kind == Kind.CALL:
            self.calls += 1
            self.chan.send(self.peer, P.Result(body[0], Status.OK, 0, [0, 0]), NOOP_OUTPUTS)
        elif kind == Kind.HEARTBEAT:
            self.ping = body[4] if len(body) > 4 else 0
            self.ping_at = time.monotonic_ns()
        elif kind == Kind.STATS:
            self.chan.send(self.peer, P.Result(body[0], Status.OK, [0, 0, 0, 0]))
        elif kind == Kind.CHALLENGE and not self.joined and not self.answered:
            self.answered = True
            from colobus._wire.versions import local_versions

            self._raw(P.Hello(self.name, os.getpid(), "light", [["cpu", "cpu", 0]], body[0],
                              "", local_versions()))  # (one without versions is refused)
        elif kind == Kind.WELCOME and not self.joined:
            self.peer.their_session = env.sender
            self.joined = True
            if len(body) > 8 and body[8]:
                self.loop.call_soon(self.move, body[8])
        elif kind in (Kind.SHUTDOWN, Kind.REJECT):
            self.ended = True
        # CODE, RELEASE, CANCEL, ...: nothing to keep for a no-op host


NOOP_OUTPUTS = b""  # set in light_main: the msgpack description of outputs == None


async def _light_hosts(address: str, key: bytes, first: int, count: int,
                       heartbeat: float) -> None:
    import msgpack
    import zmq

    global NOOP_OUTPUTS
    NOOP_OUTPUTS = msgpack.packb({"v": 1, "tree": None, "leaves": []}, use_bin_type=True)
    loop = asyncio.get_running_loop()
    zctx = zmq.Context()
    hosts = [LightHost(zctx, address, key, f"light-{first + i}", loop) for i in range(count)]
    print("ready", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)  # "go"
    for h in hosts:
        h.send_join()
    last_join = time.monotonic()
    while not all(h.ended for h in hosts):
        await asyncio.sleep(heartbeat)
        now = time.monotonic()
        retry = now - last_join > 3.0
        for h in hosts:
            if h.ended:
                continue
            if h.joined:
                h.heartbeat()
                h.chan.resend_stale([h.peer], 3 * heartbeat)
            elif retry:  # the challenge table was full, or our JOIN was lost: ask again
                h.send_join()
        if retry:
            last_join = now
    for h in hosts:
        h.chan.close()
    zctx.term()


def light_main(address: str, first: int, count: int, heartbeat: float) -> None:
    key = bytes.fromhex(sys.stdin.readline().strip())
    _import_protocol_pieces()
    asyncio.run(_light_hosts(address, key, first, count, heartbeat))


# -- the controller side --------------------------------------------------------------------


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _process_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _procs_cpu(procs: list[Any]) -> float:
    """CPU seconds the light host processes used so far (``/proc``: user + system)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _spawn(address: str, key: bytes, n: int, per_proc: int, heartbeat: float
           ) -> list[subprocess.Popen[str]]:
    procs = []
    for first in range(0, n, per_proc):
        count = min(per_proc, n - first)
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--light", address,
                              str(first), str(count), str(heartbeat)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdin is not None
        p.stdin.write(key.hex() + "\n")
        p.stdin.flush()
        procs.append(p)
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"a light host process failed to start (rc {p.poll()})")
    return procs


def _profile_lines(prof: cProfile.Profile, n: int = 14) -> list[str]:
    dump = os.environ.get("MANY_HOSTS_DUMP")
    if dump:
        prof.dump_stats(f"{dump}.{len(os.listdir(os.path.dirname(dump) or '.'))}")
    sort = os.environ.get("MANY_HOSTS_SORT", "tottime")
    n = int(os.environ.get("MANY_HOSTS_LINES", n))
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(sort).print_stats(n)
    lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if "ncalls" in ln), 0)
    return lines[start:start + n + 1]


def _spawn_relays(address: str, key: bytes, relay_key: bytes, count: int
                  ) -> list[subprocess.Popen[bytes]]:
    """``colobus relay --connect`` processes, as if on other machines: each connects to
    the controller, offers itself with the relay key, and carries the hosts it is given."""
    procs = []
    for i in range(count):
        p = subprocess.Popen([sys.executable, "-m", "colobus", "relay", "--connect", address,
                              "--key-file", "-", "--relay-key-file", "-", "--once",
                              "--bind", "tcp://127.0.0.1:*", "--name", f"remote-{i}"],
                             stdin=subprocess.PIPE)
        assert p.stdin is not None
        p.stdin.write(key.hex().encode() + b"\n" + relay_key.hex().encode() + b"\n")
        p.stdin.close()
        procs.append(p)
    return procs


async def measure(n: int, per_proc: int, idle_s: float, calls: int, profile: bool,
                  liveness: float, relays: int = 0, remote_relays: int = 0) -> dict[str, Any]:
    import colobus as cb

    @cb.colocated_python
    def noop() -> None:
        return None

    key = secrets.token_bytes(32)
    relay_key = secrets.token_bytes(32) if remote_relays else None
    heartbeat = 1.0
    ctl = cb.Controller("tcp://127.0.0.1:*", hosts=0, key=key, heartbeat_interval=heartbeat,
                        liveness_timeout=liveness, join_timeout=300.0, relays=relays,
                        relay_key=relay_key)
    out: dict[str, Any] = {"hosts": n, "hosts_per_process": per_proc, "relays": relays,
                           "remote_relays": remote_relays,
                           "heartbeat_interval": heartbeat, "liveness_timeout": liveness}
    remote: list[subprocess.Popen[bytes]] = []
    async with ctl:
        if remote_relays:  # they connect first: every host that joins moves to one
            assert relay_key is not None and ctl._relays is not None
            remote = _spawn_relays(ctl.address, key, relay_key, remote_relays)
            await ctl._relays.wait_ready(remote_relays, 300)
        gc.collect()
        await asyncio.sleep(0.5)
        rss0 = _rss_kib()
        procs = await asyncio.to_thread(_spawn, ctl.address, key, n, per_proc, heartbeat)
        try:
            prof = cProfile.Profile() if profile else None
            t0 = time.perf_counter()
            c0 = time.thread_time()
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            await ctl.wait_for_hosts(n, timeout=300)
            out["join_s"] = time.perf_counter() - t0
            out["join_loop_cpu_s"] = time.thread_time() - c0
            await asyncio.sleep(2 * heartbeat)  # settle: first heartbeats both ways
            gc.collect()
            out["rss_per_host_kib"] = (_rss_kib() - rss0) / n
            # idle: nothing but heartbeats
            if prof is not None:
                prof.enable()
            c0, p0, t0 = time.thread_time(), _process_cpu(), time.perf_counter()
            await asyncio.sleep(idle_s)
            wall = time.perf_counter() - t0
            out["idle_loop_cpu_pct"] = 100 * (time.thread_time() - c0) / wall
            out["idle_process_cpu_pct"] = 100 * (_process_cpu() - p0) / wall
            if prof is not None:
                prof.disable()
                out["idle_profile"] = _profile_lines(prof)
                prof = cProfile.Profile()
            alive = sum(1 for h in ctl.hosts() if h.state == "alive")
            out["alive_after_idle"] = alive
            # fan-out: one no-op call on every device
            f = noop.specialize(devices=ctl.devices())
            for _ in range(3):
                await f()
            lat = []
            chan = ctl._chan
            assert chan is not None
            b0 = chan.batches_sent
            relays = ([r.proc for r in ctl._relays.relays if r.proc is not None]
                      if ctl._relays is not None else []) + remote
            h0, p0, r0 = _procs_cpu(procs), _process_cpu(), _procs_cpu(relays)
            c0 = time.thread_time()
            if prof is not None:
                prof.enable()
            for _ in range(calls):
                t = time.perf_counter()
                await f()
                lat.append(time.perf_counter() - t)
            if prof is not None:
                prof.disable()
                out["fanout_profile"] = _profile_lines(prof)
            cpu = (time.thread_time() - c0) / calls
            hosts_cpu = (_procs_cpu(procs) - h0) / calls
            proc_cpu = (_process_cpu() - p0) / calls
            relays_cpu = (_procs_cpu(relays) - r0) / calls
            out["fanout_relays_cpu_ms_per_call"] = relays_cpu * 1e3
            out["fanout_process_cpu_us_per_call"] = proc_cpu * 1e6
            out["fanout_process_cpu_us_per_host"] = proc_cpu * 1e6 / n
            # The least wall time a call can take here: all its CPU, spread over the cores.
            out["fanout_hosts_cpu_ms_per_call"] = hosts_cpu * 1e3
            out["fanout_process_cpu_ms_per_call"] = proc_cpu * 1e3
            out["fanout_floor_ms"] = ((hosts_cpu + proc_cpu + relays_cpu) * 1e3
                                      / (os.cpu_count() or 1))
            out["fanout_batches_per_host_call"] = (chan.batches_sent - b0) / calls / n
            out["fanout_ms"] = statistics.median(lat) * 1e3
            out["fanout_loop_cpu_ms_per_call"] = cpu * 1e3
            out["fanout_loop_cpu_us_per_host"] = cpu * 1e6 / n
            out["dropped"] = dict(ctl.stats().get("dropped", {}))
        finally:
            await ctl.aclose()
            for p in [*procs, *remote]:
                try:
                    await asyncio.to_thread(p.wait, 10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    return out


TARGETS = {"join_s": 30.0, "idle_loop_cpu_pct": 5.0, "fanout_ms": 100.0,
           "rss_per_host_kib": 50.0}


def _report(r: dict[str, Any]) -> None:
    n = r["hosts"]
    remote = f", {r['remote_relays']} remote relays" if r.get("remote_relays") else ""
    print(f"\n{n} hosts ({r['hosts_per_process']} per light process, {r['relays']} relays"
          f"{remote}), load {os.getloadavg()[0]:.2f}")
    rows = [("joined in", r["join_s"], "s", "join_s"),
            ("  loop CPU while joining", r["join_loop_cpu_s"], "s", ""),
            ("idle loop-thread CPU", r["idle_loop_cpu_pct"], "% of a core", "idle_loop_cpu_pct"),
            ("idle process CPU", r["idle_process_cpu_pct"], "% of a core", ""),
            ("fan-out no-op latency", r["fanout_ms"], "ms (median)", "fanout_ms"),
            ("  loop CPU per call", r["fanout_loop_cpu_ms_per_call"], "ms", ""),
            ("  loop CPU per host per call", r["fanout_loop_cpu_us_per_host"], "us", ""),
            ("  controller process CPU", r["fanout_process_cpu_ms_per_call"], "ms per call", ""),
            ("    per relay", r["fanout_process_cpu_ms_per_call"] / max(
                1, r.get("remote_relays") or r["relays"]), "ms per call", ""),
            ("    per host", r["fanout_process_cpu_us_per_host"], "us", ""),
            ("  relays' CPU", r["fanout_relays_cpu_ms_per_call"], "ms per call", ""),
            ("  light hosts' CPU", r["fanout_hosts_cpu_ms_per_call"], "ms per call", ""),
            ("  floor: all CPU / cores", r["fanout_floor_ms"], "ms per call", ""),
            ("controller RSS per host", r["rss_per_host_kib"], "KiB", "rss_per_host_kib")]
    for label, value, unit, target in rows:
        mark = ""
        if target:
            t = TARGETS[target]
            mark = f"  target < {t:g}: {'met' if value < t else 'NOT met'}" if n >= 1024 else ""
        print(f"  {label:<30} {value:>10.2f} {unit}{mark}")
    print(f"  BATCH envelopes per host per call: {r['fanout_batches_per_host_call']:.2f}")
    print(f"  alive after idle: {r['alive_after_idle']}/{n}; dropped: {r['dropped'] or 'none'}")
    for key in ("idle_profile", "fanout_profile"):
        if key in r:
            print(f"  {key}:")
            for ln in r[key]:
                print("    " + ln)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--light":
        address, first, count, heartbeat = sys.argv[2:6]
        light_main(address, int(first), int(count), float(heartbeat))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--per-process", type=int, default=64, help="light hosts per process")
    ap.add_argument("--idle", type=float, default=10.0, help="seconds of idle measured")
    ap.add_argument("--calls", type=int, default=30, help="fan-out calls measured")
    ap.add_argument("--liveness", type=float, default=5.0, help="the controller's liveness_timeout")
    ap.add_argument("--profile", action="store_true", help="cProfile idle and fan-out")
    ap.add_argument("--relays", type=int, default=0,
                    help="relay processes carrying the hosts' sessions (Controller(relays=))")
    ap.add_argument("--remote-relays", type=int, default=0, metavar="R",
                    help="R relays in processes of their own, as if on other machines "
                         "(`colobus relay --connect`, Controller(relay_key=)): the "
                         "controller's CPU per call then follows R, not the hosts")
    ap.add_argument("--json", help="write the results there")
    args = ap.parse_args()
    results = []
    for n in args.hosts:
        r = asyncio.run(measure(n, args.per_process, args.idle, args.calls, args.profile,
                                args.liveness, args.relays, args.remote_relays))
        _report(r)
        results.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load": os.getloadavg(), "cpus": os.cpu_count(), "results": results}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
