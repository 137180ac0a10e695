"""Where one sequential call's time goes: each side's Python on the critical path, and
the time between the two processes.

A sequential awaited call is a chain: the controller sends a CALL, the worker wakes,
reads it, runs the call and sends the RESULT, the controller wakes, reads it, settles
the Future, and the coroutine makes the next call. The processes take turns, so the
latency is the sum of the links. This benchmark timestamps each link in both processes
(``time.perf_counter`` is CLOCK_MONOTONIC, one clock for every process on the machine)
without changing the library: a ``sitecustomize`` on ``PYTHONPATH`` wraps
``colobus._wire.sockio``'s ``send_frames``/``send_envelope``/``recv_frames`` (and the
frame reads and sends written out in the worker's lane, ``colobus._host.messages``, and
in the channel's drain and outboxes) as the modules
load, and ``selectors.EpollSelector.select`` (the moment a blocked loop wakes with
work), in the controller and in its worker. It prints the median of each link over ``--calls``
calls (a no-op on one host, awaited one at a time) beside the same links of a
*minimal* call of the same design, timed the same way: an asyncio loop reading the
ROUTER, an asyncio Future per call, a msgpack header and a keyed BLAKE2b MAC on each
message, pickled arguments, and a worker that runs the call on its loop thread. It is
what a call costs with nothing else of colobus (no sessions, acknowledgements,
batches, frees, device sets or output layouts): the floor of this design on this
machine. The raw pyzmq round trip of ``colobus bench`` (a blocking ROUTER/DEALER echo),
the figure the issue's ratios divide by, is measured before and after.

    python benchmarks/critical_path.py              # 5,000 calls after 1,000
    python benchmarks/critical_path.py --calls 20000 --what ident
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import hashlib
import hmac
import os
import pickle
import selectors
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

# The shim: patches sockio's two functions before anything imports them by name.
SHIM = r'''
import atexit, importlib.abc, os, selectors, sys, time
_pc = time.perf_counter
TRACE = []
_rec = TRACE.append

def _patch(mod):
    send, recv = mod.send_frames, mod.recv_frames
    def send_frames(sock, frames, flags=0):
        _rec((_pc(), "s"))
        return send(sock, frames, flags)
    def recv_frames(sock, flags=mod.NOBLOCK):
        parts = recv(sock, flags)
        _rec((_pc(), "r"))
        return parts
    mod.send_frames, mod.recv_frames = send_frames, recv_frames
    envelope = getattr(mod, "send_envelope", None)  # (the channel's one-envelope sends)
    if envelope is not None:
        def send_envelope(sock, route, frames, plen, flags=0):
            _rec((_pc(), "s"))
            return envelope(sock, route, frames, plen, flags)
        mod.send_envelope = send_envelope

def _patch_lane(mod):
    # The worker's lane reads (colobus._host.messages) and sends (colobus._host.outbound),
    # and the channel's (colobus._wire.channel, outflow), go frame by frame with the
    # compiled methods: "r" once a message's last frame is in,
    # "s" as its first frame leaves (the one after a frame sent without SNDMORE).
    if hasattr(mod, "_recv"):
        recv = mod._recv
        def _recv(sock, flags, copy):
            frame = recv(sock, flags, copy)
            if not frame.more:
                _rec((_pc(), "r"))
            return frame
        mod._recv = _recv
    if hasattr(mod, "_send"):
        send, more = mod._send, mod.SNDMORE
        first = [True]
        def _send(sock, data, flags, copy):
            if first[0]:
                _rec((_pc(), "s"))
            first[0] = not flags & more
            return send(sock, data, flags, copy)
        mod._send = _send

PATCHES = {"colobus._wire.sockio": _patch, "colobus._host.messages": _patch_lane,
           "colobus._host.outbound": _patch_lane,
           # the channel's drain reads, and its outboxes' sends, written out the same way
           "colobus._wire.channel": _patch_lane, "colobus._wire.outflow": _patch_lane}

class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            PATCHES[name](module)
        spec.loader.exec_module = exec_module
        return spec

import importlib.util
sys.meta_path.insert(0, _Finder())
_select = selectors.EpollSelector.select
def select(self, timeout=None):
    ready = _select(self, timeout)
    if ready and (timeout is None or timeout > 0):
        _rec((_pc(), "w"))
    return ready
selectors.EpollSelector.select = select

def _dump():
    with open(os.path.join(os.environ["COLOBUS_CRITICAL_DIR"], f"{os.getpid()}.txt"), "w") as f:
        f.writelines(f"{t:.9f} {k}\n" for t, k in TRACE)
atexit.register(_dump)
'''

LINKS = (
    ("controller: sent -> worker woke", "Cs", "Ww"),
    ("worker: woke -> read the CALL", "Ww", "Wr"),
    ("worker: read -> sent the RESULT", "Wr", "Ws"),
    ("controller: sent <- worker", "Ws", "Cw"),
    ("controller: woke -> read the RESULT", "Cw", "Cr"),
    ("controller: read -> sent the next CALL", "Cr", "Cs"),
)


# -- colobus, traced ----------------------------------------------------------------------


async def _colobus_calls(n: int, what: str, warm: int) -> None:
    """Run in the traced child: ``n`` sequential awaited calls after ``warm`` of them."""
    import colobus as cb
    from colobus._tools.bench_base import _one_device_array, bench_noop
    from colobus._tools.bench_calls import bench_ident

    fn = bench_noop if what == "noop" else bench_ident
    async with cb.local_cluster(hosts=1, devices_per_host=1) as ctl:
        x = _one_device_array(ctl)
        await cb.block_until_ready(x)
        for _ in range(warm):
            await fn(x)
        print(f"MARK {time.perf_counter():.9f}", flush=True)
        for _ in range(n):
            await fn(x)
        print(f"MARK {time.perf_counter():.9f}", flush=True)


def _links(trace_dir: str, ctl_name: str, start: float, end: float) -> dict[str, list[float]]:
    """Each link's durations (us) over the chains Cs Ww Wr Ws Cw Cr Cs in [start, end]."""
    events: list[tuple[float, str]] = []
    for path in glob.glob(os.path.join(trace_dir, "*.txt")):
        side = "C" if os.path.basename(path) == ctl_name else "W"
        with open(path) as f:
            for line in f:
                t, k = line.split()
                if start <= float(t) <= end:
                    events.append((float(t), side + k))
    events.sort()
    kinds = [k for _, k in events]
    chain = ["Cs", "Ww", "Wr", "Ws", "Cw", "Cr", "Cs"]
    out: dict[str, list[float]] = {name: [] for name, _, _ in LINKS}
    out["round trip"] = []
    i = 0
    while i + 6 < len(events):
        if kinds[i:i + 7] != chain:
            i += 1
            continue
        ts = [events[i + j][0] for j in range(7)]
        for j, (name, _, _) in enumerate(LINKS):
            out[name].append((ts[j + 1] - ts[j]) * 1e6)
        out["round trip"].append((ts[6] - ts[0]) * 1e6)
        i += 6
    return out


def traced_colobus(n: int, what: str, warm: int) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "sitecustomize.py"), "w") as f:
            f.write(SHIM)
        env = dict(os.environ, COLOBUS_CRITICAL_DIR=d,
                   PYTHONPATH=os.pathsep.join([d, *filter(None, [os.environ.get("PYTHONPATH")])]))
        proc = subprocess.run([sys.executable, __file__, "--child", what, "--calls", str(n),
                               "--warm", str(warm)],
                              env=env, stdout=subprocess.PIPE, text=True, check=True)
        marks = [float(line.split()[1]) for line in proc.stdout.splitlines()
                 if line.startswith("MARK ")]
        return _links(d, f"{_child_pid(proc.stdout)}.txt", marks[0], marks[1])


def _child_pid(stdout: str) -> int:
    for line in stdout.splitlines():
        if line.startswith("PID "):
            return int(line.split()[1])
    raise RuntimeError("the traced run printed no PID")


# -- the minimal design -------------------------------------------------------------------

_KEY = b"k" * 32


def _mac(header: bytes, payload: bytes) -> bytes:
    m = hashlib.blake2b(key=_KEY, digest_size=16)
    m.update(header)
    m.update(payload)
    return m.digest()


def _record_wakes(rec: Any, clock: Any) -> Any:
    """Record in ``rec`` when a blocked epoll wakes with work, as the shim does; returns
    the original ``select`` (to restore)."""
    select = selectors.EpollSelector.select

    def traced(self: Any, timeout: float | None = None) -> Any:
        ready = select(self, timeout)
        if ready and (timeout is None or timeout > 0):
            rec((clock(), "w"))
        return ready

    selectors.EpollSelector.select = traced  # type: ignore[method-assign]
    return select


def _minimal_noop(x: Any) -> None:
    return None


def minimal_worker(address: str, trace_path: str) -> None:
    """A worker of the minimal design: the call runs on its asyncio loop's thread."""
    import msgpack
    import zmq

    trace: list[tuple[float, str]] = []
    rec, clock = trace.append, time.perf_counter
    _record_wakes(rec, clock)

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    sock.send_multipart([b"hello", b"", b""])
    loop = asyncio.new_event_loop()
    functions = {b"noop": _minimal_noop}

    def on_readable() -> None:
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            h, p, tag = (f.bytes for f in sock.recv_multipart(copy=False))
            rec((clock(), "r"))
            if not hmac.compare_digest(_mac(h, p), tag):
                continue
            kind, seq, digest = msgpack.unpackb(h)
            if kind == 9:
                loop.stop()
                return
            out = functions[digest](*pickle.loads(p))
            rp = pickle.dumps(out)
            rh = msgpack.packb([2, seq, b""])
            rec((clock(), "s"))
            sock.send_multipart([rh, rp, _mac(rh, rp)])

    loop.add_reader(sock.getsockopt(zmq.FD), on_readable)
    loop.call_soon(on_readable)
    loop.run_forever()
    sock.close(0)
    ctx.term()
    with open(trace_path, "w") as f:
        f.writelines(f"{t:.9f} {k}\n" for t, k in trace)


class _Handle:
    """Stands for an array handle, pickled by reference."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (int, (7,))


async def _minimal_calls(n: int, trace_dir: str, warm: int) -> list[float]:
    """``n`` sequential calls of the minimal design; their times (us). Both sides'
    links go to ``trace_dir`` (the worker's as it exits)."""
    import msgpack
    import zmq

    trace: list[tuple[float, str]] = []
    rec, clock = trace.append, time.perf_counter
    select = _record_wakes(rec, clock)
    path = os.path.join(tempfile.gettempdir(), f"colobus-minimal-{os.getpid()}.sock")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"ipc://{path}")
    proc = subprocess.Popen([sys.executable, __file__, "--minimal-worker", f"ipc://{path}",
                             "--trace", os.path.join(trace_dir, "worker.txt")])
    identity = sock.recv_multipart()[0]
    loop = asyncio.get_running_loop()
    pending: dict[int, asyncio.Future[Any]] = {}

    def on_readable() -> None:
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            _, h, p, tag = (f.bytes for f in sock.recv_multipart(copy=False))
            rec((clock(), "r"))
            if hmac.compare_digest(_mac(h, p), tag):
                _, seq, _ = msgpack.unpackb(h)
                pending.pop(seq).set_result(pickle.loads(p))

    loop.add_reader(sock.getsockopt(zmq.FD), on_readable)
    seq = 0

    def call(*args: Any) -> asyncio.Future[Any]:
        nonlocal seq
        seq += 1
        fut = pending[seq] = loop.create_future()
        payload = pickle.dumps(args)
        header = msgpack.packb([1, seq, b"noop"])
        rec((clock(), "s"))
        sock.send_multipart([identity, header, payload, _mac(header, payload)])
        on_readable()  # the FD is edge-triggered: a send can take its edge
        return fut

    x, out = _Handle(), []
    for _ in range(warm):
        await call(x)
    trace.append((clock(), "mark"))
    for _ in range(n):
        t = time.perf_counter()
        await call(x)
        out.append((time.perf_counter() - t) * 1e6)
    header = msgpack.packb([9, 0, b""])
    sock.send_multipart([identity, header, b"", _mac(header, b"")])
    proc.wait(10)
    loop.remove_reader(sock.getsockopt(zmq.FD))
    selectors.EpollSelector.select = select  # type: ignore[method-assign]
    sock.close(0)
    ctx.term()
    os.unlink(path)
    start = next(t for t, k in trace if k == "mark")
    with open(os.path.join(trace_dir, "controller.txt"), "w") as f:
        f.writelines(f"{t:.9f} {k}\n" for t, k in trace if t > start and k != "mark")
    return out


def traced_minimal(n: int, warm: int) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory() as d:
        asyncio.run(_minimal_calls(n, d, warm))
        return _links(d, "controller.txt", 0.0, float("inf"))


# -- main ---------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--warm", type=int, default=1000,
                    help="calls before the measured ones, on each side (default 1,000)")
    ap.add_argument("--what", choices=("noop", "ident"), default="noop")
    ap.add_argument("--child", choices=("noop", "ident"), help=argparse.SUPPRESS)
    ap.add_argument("--minimal-worker", help=argparse.SUPPRESS)
    ap.add_argument("--trace", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.minimal_worker:
        minimal_worker(args.minimal_worker, args.trace)
        return
    if args.child:
        print(f"PID {os.getpid()}", flush=True)
        asyncio.run(_colobus_calls(args.calls, args.child, args.warm))
        return

    from colobus._tools.bench_base import RawEcho

    with RawEcho(1) as raw:
        raw_before = statistics.median(raw.round_trips(args.calls)) * 1e6
        links = traced_colobus(args.calls, args.what, args.warm)
        minimal = traced_minimal(args.calls, args.warm)
        raw_after = statistics.median(raw.round_trips(args.calls)) * 1e6
    base = (raw_before + raw_after) / 2
    print(f"sequential awaited {args.what}, 1 host: medians (us) over "
          f"{len(links['round trip'])} traced chains; minimal: the same design with nothing "
          "else of colobus (a no-op)")
    print(f"  {'':42s} {'colobus':>8s} {'minimal':>8s}")
    for name in [n for n, _, _ in LINKS] + ["round trip"]:
        print(f"  {name:42s} {statistics.median(links[name]):8.1f} "
              f"{statistics.median(minimal[name]):8.1f}")
    for what, pick in (("in Python, both sides", True), ("between the processes", False)):
        a, b = (sum(statistics.median(got[n]) for n, x, y in LINKS if (x[0] == y[0]) == pick)
                for got in (links, minimal))
        print(f"  {what:42s} {a:8.1f} {b:8.1f}")
    rt, floor = statistics.median(links["round trip"]), statistics.median(minimal["round trip"])
    print(f"raw pyzmq round trip {base:.1f} us (before {raw_before:.1f}, after {raw_after:.1f}); "
          f"colobus {rt / base:.2f}x raw, minimal {floor / base:.2f}x raw")


if __name__ == "__main__":
    main()
