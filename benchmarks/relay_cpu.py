"""The controller machine's CPU per host per fan-out call, real workers, through relays.

Starts ``local_cluster(hosts=N, transport="tcp")`` with one relay on the controller's
machine (``--mode relay``: ``relays=1, relay_threshold=1``), relays on the hosts'
machines (``--mode on-hosts``: ``relays_on_hosts=--per``; here every process shares
this machine, so their CPU is reported apart), or none (``--mode star``); makes
``--warm`` fan-out no-op calls, then ``--calls`` more, and prints per host and call:
the controller process's CPU (``getrusage``: its loop and ZeroMQ's I/O thread), the
CPU of the relays the controller started (``/proc``), the two together (what the
controller's machine pays in the ``relay`` mode), and the median latency.

    python benchmarks/relay_cpu.py                       # 32 hosts, one relay
    python benchmarks/relay_cpu.py --mode star --hosts 32 --calls 200
    python benchmarks/relay_cpu.py --pairs 3             # several runs, alternating modes
    python benchmarks/relay_cpu.py --mode raw relay      # with the raw pyzmq floor beside it

``--mode raw`` is the baseline: a raw pyzmq ROUTER in this process and ``--hosts`` echo
DEALERs (``colobus bench``'s raw echo server, by path) over TCP, one 200-byte message to
each and its echo back per call, blocking, nothing else. Whatever on the controller's
machine exchanges one message each way with each host (the controller of a star, a relay
there) pays at least this per host: this process's CPU (its Python thread and ZeroMQ's
I/O thread) is printed the same way, and each colobus row is divided by it.

Times move with the machine (32 worker processes on two cores run the controller's code
with cold caches); compare runs made side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import time
from typing import Any

TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def _threads_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of each thread of ``pid``, by name ("python": the loop thread;
    ZeroMQ's I/O thread is "ZMQbg/IO/0")."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                text = f.read()
        except OSError:
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return out


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def measure(mode: str, hosts: int, calls: int, warm: int, per: int) -> dict[str, Any]:
    import colobus as cb
    from colobus._tools.bench_base import _fanout_array, bench_noop

    opts: dict[str, Any] = {"star": {"relays": 0}, "relay": {"relays": 1, "relay_threshold": 1},
                            "on-hosts": {"relays_on_hosts": per}}[mode]
    cluster = cb.local_cluster(hosts=hosts, devices_per_host=1, transport="tcp",
                               join_timeout=600, **opts)
    async with cluster as ctl:
        x = _fanout_array(ctl, hosts)
        await cb.block_until_ready(x)
        for _ in range(warm):
            await bench_noop(x)
        relays = ctl._relays.relays if ctl._relays is not None else []
        started = [r.proc.pid for r in relays if r.proc is not None]
        elsewhere = [p.pid for p in getattr(cluster, "relay_procs", [])]  # (on-hosts)
        c0, r0, e0 = _self_cpu(), sum(map(_proc_cpu, started)), sum(map(_proc_cpu, elsewhere))
        t0 = [_threads_cpu(pid) for pid in started]
        lat = []
        for _ in range(calls):
            t = time.perf_counter()
            await bench_noop(x)
            lat.append(time.perf_counter() - t)
        c1, r1, e1 = _self_cpu(), sum(map(_proc_cpu, started)), sum(map(_proc_cpu, elsewhere))
        t1 = [_threads_cpu(pid) for pid in started]
        ups = sum(r.ups for r in relays)
    ctl_us = (c1 - c0) / calls / hosts * 1e6
    relay_us = (r1 - r0) / calls / hosts * 1e6
    return {"mode": mode, "hosts": hosts, "calls": calls, "controller_us_per_host": ctl_us,
            "relay_us_per_host": relay_us, "machine_us_per_host": ctl_us + relay_us,
            "latency_ms": statistics.median(lat) * 1e3, "ups_per_call": ups / (calls + warm),
            "hosts_relays_us_per_host": (e1 - e0) / calls / hosts * 1e6,
            "relay_threads_us_per_host": {k: sum(b.get(k, 0) - a.get(k, 0)
                                                 for a, b in zip(t0, t1, strict=True))
                                          / calls / hosts * 1e6
                                          for k in {k for t in t1 for k in t}}}


_PUB_ECHO = """
import sys, zmq
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB); sub.setsockopt(zmq.SUBSCRIBE, b""); sub.connect(sys.argv[1])
out = ctx.socket(zmq.DEALER); out.setsockopt(zmq.IDENTITY, sys.argv[3].encode())
out.connect(sys.argv[2]); out.send(b"hello")
while True:
    frames = sub.recv_multipart(copy=False)
    if frames[0].bytes == b"q":
        break
    if frames[0].bytes == b"e":
        out.send_multipart(frames, copy=False)
"""


def measure_raw(hosts: int, calls: int, warm: int, pub: bool = False) -> dict[str, Any]:
    """The raw pyzmq floor of one message each way per host per call, over TCP: a
    ROUTER sending each host its copy (``raw``), or one PUB send that libzmq copies to
    every host (``raw-pub``, ZeroMQ's own fan-out); the replies come back on a ROUTER."""
    import subprocess
    import sys

    import zmq

    from colobus._tools import raw_echo

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    for opt in (zmq.LINGER, zmq.SNDHWM, zmq.RCVHWM):
        sock.setsockopt(opt, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    ids = [f"s{i}".encode() for i in range(hosts)]
    if pub:
        fan = ctx.socket(zmq.PUB)
        for opt in (zmq.LINGER, zmq.SNDHWM):
            fan.setsockopt(opt, 0)
        pub_port = fan.bind_to_random_port("tcp://127.0.0.1")
        procs = [subprocess.Popen([sys.executable, "-c", _PUB_ECHO, f"tcp://127.0.0.1:{pub_port}",
                                   f"tcp://127.0.0.1:{port}", i.decode()]) for i in ids]
    else:
        procs = [subprocess.Popen([sys.executable, raw_echo.__file__, f"tcp://127.0.0.1:{port}",
                                   i.decode()]) for i in ids]
    try:
        sock.setsockopt(zmq.RCVTIMEO, 120_000)
        for _ in ids:
            sock.recv_multipart()  # hello
        payload = b"x" * 200
        if pub:  # subscriptions travel after the connection: until every host echoes
            sock.setsockopt(zmq.RCVTIMEO, 100)
            heard: set[bytes] = set()
            while len(heard) < hosts:
                fan.send_multipart([b"e", payload])
                try:
                    while True:
                        heard.add(sock.recv_multipart()[0])
                except zmq.Again:
                    pass
            sock.setsockopt(zmq.RCVTIMEO, 120_000)
        lat: list[float] = []
        for n in (warm, calls):
            c0, t0, lat = _self_cpu(), _threads_cpu(os.getpid()), []
            for _ in range(n):
                t = time.perf_counter()
                if pub:
                    fan.send_multipart([b"e", payload])
                else:
                    for i in ids:
                        sock.send_multipart([i, b"e", payload])
                for _ in ids:
                    sock.recv_multipart()
                lat.append(time.perf_counter() - t)
            c1, t1 = _self_cpu(), _threads_cpu(os.getpid())
        if pub:
            fan.send_multipart([b"q"])
        else:
            for i in ids:
                sock.send_multipart([i, b"q"])
    finally:
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        sock.close(0)
        if pub:
            fan.close(0)
        ctx.term()
    us = (c1 - c0) / calls / hosts * 1e6
    return {"mode": "raw-pub" if pub else "raw", "hosts": hosts, "calls": calls,
            "controller_us_per_host": us, "relay_us_per_host": 0.0, "machine_us_per_host": us,
            "latency_ms": statistics.median(lat) * 1e3, "ups_per_call": 0.0,
            "hosts_relays_us_per_host": 0.0,
            "relay_threads_us_per_host": {f"(this process) {k}": (t1.get(k, 0) - t0.get(k, 0))
                                          / calls / hosts * 1e6 for k in t1}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", nargs="+", default=["relay"],
                    choices=["raw", "raw-pub", "star", "relay", "on-hosts"])
    ap.add_argument("--hosts", type=int, default=32)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--warm", type=int, default=50)
    ap.add_argument("--per", type=int, default=16, help="hosts per relay with --mode on-hosts")
    ap.add_argument("--pairs", type=int, default=1, help="runs of each mode, alternating")
    args = ap.parse_args()
    raw: list[float] = []
    for _ in range(args.pairs):
        for mode in args.mode:
            r = (measure_raw(args.hosts, args.calls, args.warm, mode == "raw-pub")
                 if mode.startswith("raw") else
                 asyncio.run(measure(mode, args.hosts, args.calls, args.warm, args.per)))
            if mode == "raw":
                raw.append(r["machine_us_per_host"])
            print(f"{r['mode']:>8} {r['hosts']} hosts: controller "
                  f"{r['controller_us_per_host']:6.1f}"
                  f" + relays started by it {r['relay_us_per_host']:6.1f} = "
                  f"{r['machine_us_per_host']:6.1f} us CPU per host per call"
                  + (f" (relays on the hosts' machines: {r['hosts_relays_us_per_host']:.1f})"
                     if r["mode"] == "on-hosts" else "")
                  + (f" ({r['machine_us_per_host'] / raw[-1]:.2f}x raw's)"
                     if raw and not mode.startswith("raw") else "") + "; latency "
                  f"{r['latency_ms']:6.2f} ms; {r['ups_per_call']:.2f} UPs per call; load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
            if r["relay_threads_us_per_host"]:
                print("         threads, us per host per call: " + ", ".join(
                    f"{k} {v:.1f}" for k, v in sorted(r["relay_threads_us_per_host"].items())))


if __name__ == "__main__":
    main()
