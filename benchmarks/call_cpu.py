"""Where one call's CPU goes: per process and thread, per call pattern, 1 host.

Wall-clock rows on a shared 2-core VM drift by tens of per cent between runs; the CPU
each side spends per call drifts much less, and it is what a change to the hot path
moves. For each pattern this runs ``--calls`` calls on a ``local_cluster(hosts=1)``
and prints calls/s, the controller's loop-thread CPU per call, the loop's iterations
per call (a counter around ``_run_once``), and the worker's CPU per call by thread
(its loop thread, its other threads -- the call threads, mostly -- and ZeroMQ's I/O
thread, from ``/proc``), with its thread count. The raw pyzmq round trip and pipelined
rate of the same run are the baseline (``colobus bench``'s echo server).

    python benchmarks/call_cpu.py                    # all patterns
    python benchmarks/call_cpu.py --calls 6000 --pattern tasks gather

Patterns: ``awaited`` (a no-op, awaited one at a time), ``ident`` (``return x``, awaited
one at a time), ``tasks`` (``return x``, one
task per call, ``--window`` in flight by a semaphore), ``gather`` (``asyncio.gather``
over ``--window`` futures at a time), ``cbgather`` (``cb.gather``, the same).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

import colobus as cb
from colobus._tools.bench_base import RawEcho

TICK = os.sysconf("SC_CLK_TCK")


def _threads(pid: int) -> dict[tuple[str, str], float]:
    """CPU seconds so far of each thread of ``pid``: (tid, name) -> user + system."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        out[(tid, name)] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def _by_role(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float],
             main_tid: str) -> dict[str, float]:
    """CPU by role: the loop (main) thread, ZeroMQ's I/O threads, the rest (the call
    threads and the data plane's: Python does not name OS threads before 3.14)."""
    roles: dict[str, float] = {"loop": 0.0, "zmq_io": 0.0, "other": 0.0}
    for key, cpu in after.items():
        used = cpu - before.get(key, 0.0)
        tid, name = key
        role = "loop" if tid == main_tid else "zmq_io" if name.startswith("ZMQbg") else "other"
        roles[role] += used
    return roles


@cb.colocated_python
def _noop(x: Any) -> None:
    return None


@cb.colocated_python
def _ident(x: Any) -> Any:
    return x


async def _measure(args: argparse.Namespace) -> None:
    raw = RawEcho(1)
    try:
        raw_us = statistics.median(raw.round_trips(500)) * 1e6
        raw_rate = raw.pipelined(args.calls, args.window)
    finally:
        raw.close()
    print(f"raw pyzmq: round trip {raw_us:.1f} us (median), pipelined {raw_rate:,.0f} /s")
    async with cb.local_cluster(hosts=1) as ctl:
        x = cb.device_put(np.zeros(4, np.float32), ctl.devices()[0])
        await cb.block_until_ready(x)
        pid = ctl.hosts()[0].pid
        assert pid is not None
        loop = asyncio.get_running_loop()
        turns = [0]
        run_once = loop._run_once  # type: ignore[attr-defined]

        def counted() -> None:
            turns[0] += 1
            run_once()

        loop._run_once = counted  # type: ignore[attr-defined]
        sem = asyncio.Semaphore(args.window)

        async def awaited(n: int) -> None:
            for _ in range(n):
                await _noop(x)

        async def awaited_ident(n: int) -> None:
            for _ in range(n):
                await _ident(x)

        async def one() -> None:
            async with sem:
                await _ident(x)

        async def tasks(n: int) -> None:
            await asyncio.gather(*[asyncio.create_task(one()) for _ in range(n)])

        def gathered(gather: Callable[..., Awaitable[Any]]) -> Callable[[int], Awaitable[None]]:
            async def run(n: int) -> None:
                for _ in range(max(1, n // args.window)):
                    await gather(*[_ident(x) for _ in range(args.window)])
            return run

        patterns: dict[str, Callable[[int], Awaitable[None]]] = {
            "awaited": awaited, "ident": awaited_ident, "tasks": tasks,
            "gather": gathered(asyncio.gather),
            "cbgather": gathered(cb.gather)}
        worker_main = str(pid)  # the worker's loop runs on its main thread
        for name in args.pattern:
            fn = patterns[name]
            await fn(min(args.calls, 300))  # warm
            one_at_a_time = name in ("awaited", "ident")
            n = args.calls if one_at_a_time else max(args.window, args.calls)
            w0, t0, c0, p0 = _threads(pid), turns[0], time.thread_time(), time.perf_counter()
            await fn(n)
            wall = time.perf_counter() - p0
            loop_cpu, iters = time.thread_time() - c0, turns[0] - t0
            roles = _by_role(w0, _threads(pid), worker_main)
            threads = len(os.listdir(f"/proc/{pid}/task"))
            base = (f"{wall / n * 1e6 / raw_us:.2f}x raw's round trip" if one_at_a_time
                    else f"{n / wall / raw_rate:.3f}x raw's rate")
            print(f"{name:9s} {n / wall:9,.0f} calls/s ({base}); controller loop "
                  f"{loop_cpu / n * 1e6:6.1f} us/call, {iters / n:.3f} turns/call; worker "
                  f"loop {roles['loop'] / n * 1e6:.1f}, call threads "
                  f"{roles['other'] / n * 1e6:.1f}, zmq I/O {roles['zmq_io'] / n * 1e6:.1f} "
                  f"us/call ({threads} threads)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--window", type=int, default=1000, help="calls in flight (pipelined)")
    every = ["awaited", "ident", "tasks", "gather", "cbgather"]
    ap.add_argument("--pattern", nargs="+", default=every, choices=every)
    asyncio.run(_measure(ap.parse_args()))


if __name__ == "__main__":
    main()
