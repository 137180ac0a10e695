"""Liveness without Python: what a heartbeat thread sees, what ZeroMQ's heartbeats see,
and what a colobus cluster does, when Python code holds the GIL or an event loop, and
when a process is really gone.

    python benchmarks/liveness.py            # about a minute
    python benchmarks/liveness.py --hold 30  # the driver holds its loop 30 s

1. A Python heartbeat thread next to a native call that holds the GIL (ctypes' PyDLL
   never releases it): the longest gap between its beats.
2. Raw pyzmq, a ROUTER with ZMQ_HEARTBEAT_IVL/TIMEOUT/TTL and a DEALER in a child
   process: whether the connection closes (the ROUTER's monitor) while the child holds
   its GIL, and how long after SIGSTOP and SIGKILL it does.
3. A local cluster at the default heartbeat (1 s) and liveness timeout (5 s): the driver
   holds its loop (``time.sleep`` inside ``async with``), a host holds its GIL, then a
   worker is stopped (SIGSTOP): the states after each, and how long the loss took.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import zmq

import colobus as cb
from colobus._wire.links import heartbeat_options, link_timeout

CHILD = r"""
import ctypes, sys, time, zmq
ctx = zmq.Context(); d = ctx.socket(zmq.DEALER); d.connect(sys.argv[1])
d.send(b"hi"); print("up", flush=True)
if sys.argv[2] == "gil":
    ctypes.PyDLL(None).usleep(int(float(sys.argv[3]) * 1e6))
    print("released", flush=True)
time.sleep(60)
"""


def thread_gaps(hold: float) -> float:
    beats: list[float] = []
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            beats.append(time.monotonic())
            time.sleep(0.05)

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    time.sleep(0.2)
    ctypes.PyDLL(None).usleep(int(hold * 1e6))
    time.sleep(0.2)
    stop.set()
    t.join()
    return max(b - a for a, b in itertools.pairwise(beats))


def zmq_close_after(mode: str, hb: float, live: float, hold: float = 0.0) -> str:
    ctx: zmq.Context[Any] = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    heartbeat_options(r, hb, live)
    r.bind("tcp://127.0.0.1:*")
    mon = r.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    p = subprocess.Popen([sys.executable, "-c", CHILD, r.getsockopt_string(zmq.LAST_ENDPOINT),
                          mode, str(hold)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        p.stdout.readline()
        r.recv_multipart()
        t0 = time.monotonic()
        if mode == "stop":
            os.kill(p.pid, signal.SIGSTOP)
        elif mode == "kill":
            os.kill(p.pid, signal.SIGKILL)
        wait = hold + 2.0 if mode == "gil" else live + 5.0
        closed = mon.poll(int(wait * 1000))
        took = time.monotonic() - t0
        if mode == "gil":
            return f"GIL held {hold:.0f} s: connection {'closed' if closed else 'open'}"
        return f"{mode}: connection closed after {took:.2f} s" if closed else f"{mode}: open"
    finally:
        p.kill()
        p.wait()
        ctx.destroy(0)


@cb.colocated_python
def hold_gil(x: Any, seconds: Any) -> Any:
    import ctypes as c

    c.PyDLL(None).usleep(int(float(np.asarray(seconds)) * 1e6))
    return x + 1


@cb.colocated_python
def ident(x: Any) -> Any:
    return x


async def cluster(hold: float) -> None:
    async with cb.local_cluster(hosts=2) as ctl:
        d0, d1 = ctl.devices()
        x0, x1 = cb.device_put(np.arange(3.0), d0), cb.device_put(np.arange(3.0), d1)
        await ident(x1)
        time.sleep(hold)  # the driver's own code holds the loop
        await ident(x1)
        print(f"  driver held its loop {hold:.0f} s: states {[h.state for h in ctl.hosts()]}")
        t = time.monotonic()
        await hold_gil(x0, np.float64(hold))
        print(f"  host 0 held its GIL {time.monotonic() - t:.0f} s: states "
              f"{[h.state for h in ctl.hosts()]}")
        pid = ctl.hosts()[1].pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        t = time.monotonic()
        try:
            while ctl.hosts()[1].state != "lost":
                await asyncio.sleep(0.05)
        finally:
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)
        print(f"  host 1 stopped: lost after {time.monotonic() - t:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hold", type=float, default=12.0, help="seconds each hold lasts")
    args = ap.parse_args()
    print(f"1. a Python heartbeat thread (every 50 ms) next to a {args.hold:.0f} s GIL hold: "
          f"longest gap {thread_gaps(args.hold):.2f} s")
    for hb, live in ((1.0, 5.0), (0.2, 1.5)):
        print(f"2. ZeroMQ heartbeats, interval {hb} s, link timeout "
              f"{link_timeout(hb, live):.1f} s (liveness {live} s):")
        for mode in ("gil", "stop", "kill"):
            print("  ", zmq_close_after(mode, hb, live, args.hold))
    print("3. a local cluster, heartbeat 1 s, liveness timeout 5 s:")
    asyncio.run(cluster(args.hold))


if __name__ == "__main__":
    main()
