"""``colobus bench``: colobus against a raw pyzmq baseline of the same shape, same run.

Every benchmark measures colobus and a raw ZeroMQ program doing the same
traffic (a ROUTER in this process, DEALER echo servers in subprocesses, over
``ipc``, blocking sockets on both ends), and reports both figures and their
ratio ``colobus / baseline``. ``better`` says which direction wins: for
latencies and memory lower is better (a ratio of 1.5 means 1.5x slower than raw),
for rates higher is better (a ratio of 0.5 means half the raw rate).

Groups (``colobus bench NAME``): ``latency``, ``pipelined``, ``fanout``,
``object``, ``transfer`` (includes peak memory), ``chain``, and those of
``bench_calls``: ``calls``, ``scaling``, ``bigout``; and ``bench_reshard``: ``reshard``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np
import zmq

import colobus as cb

from . import bench_calls, bench_reshard
from .bench_base import (
    FULL,
    QUICK,
    BenchObject,
    PeakMemory,
    RawEcho,
    Row,
    Sizes,
    _fanout_array,
    _format_row,
    _median_us,
    _one_device_array,
    bench_inc,
    bench_noop,
    quotient,
    unmeasured_lines,
)
from .bench_calls import bench_ident

__all__ = ["BENCHMARKS", "run_bench"]

log = logging.getLogger("colobus.bench")

MiB = 1 << 20


# -- benchmarks --------------------------------------------------------------------------


async def _latency_async(x: Any, n: int) -> list[float]:
    for _ in range(n // 10):
        await bench_noop(x)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await bench_noop(x)
        out.append(time.perf_counter() - t)
    return out


def _latency_sync(x: Any, n: int) -> list[float]:
    """``return x`` waited for as JAX code waits (a no-op returns nothing to wait for in
    plain code, as JAX's): its array at once, then ``block_until_ready``."""
    for _ in range(n // 10):
        bench_ident(x).block_until_ready()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        bench_ident(x).block_until_ready()
        out.append(time.perf_counter() - t)
    return out


async def _pipelined(x: Any, total: int, window: int) -> float:
    sem = asyncio.Semaphore(window)
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    left = [total]

    def finished(f: cb.Future[Any]) -> None:
        sem.release()
        left[0] -= 1
        if f.exception() is not None and not done.done():
            done.set_exception(f.exception())  # type: ignore[arg-type]
        elif left[0] == 0 and not done.done():
            done.set_result(None)

    t = time.perf_counter()
    for _ in range(total):
        await sem.acquire()
        bench_noop(x).add_done_callback(finished)
    await done
    return quotient(total, time.perf_counter() - t)


class Bench:
    """Runs the selected groups and collects rows."""

    def __init__(self, sizes: Sizes) -> None:
        self.sizes = sizes
        self.rows: list[Row] = []
        self._raw_rtt: dict[int, float] = {}

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print(_format_row(row), flush=True)

    def raw_rtt_us(self, raw: RawEcho, hosts: int = 1) -> float:
        return _median_us(raw.round_trips(self.sizes.latency_calls, hosts))

    # groups that share one async cluster ------------------------------------------------

    async def latency(self, ctl: cb.Controller, raw: RawEcho) -> None:
        s = self.sizes
        x = _one_device_array(ctl)
        await cb.block_until_ready(x)
        ours = _median_us(await _latency_async(x, s.latency_calls))
        base = self.raw_rtt_us(raw)
        self._raw_rtt[1] = base
        self.add(Row("latency_async", "us", ours, base, "lower",
                     "no-op call, 1 host, `async with`; baseline: raw blocking round trip"))

    async def pipelined(self, ctl: cb.Controller, raw: RawEcho) -> None:
        s = self.sizes
        x = _one_device_array(ctl)
        await cb.block_until_ready(x)
        await _pipelined(x, s.pipelined_calls // 10, s.window)
        ours = await _pipelined(x, s.pipelined_calls, s.window)
        base = raw.pipelined(s.pipelined_calls, s.window)
        self.add(Row("pipelined", "calls/s", ours, base, "higher",
                     f"no-op calls, {s.window} in flight, 1 host; baseline: raw pipelined "
                     "round trips"))

    async def fanout(self, ctl: cb.Controller, raw: RawEcho) -> None:
        s = self.sizes
        hosts = len(ctl.hosts())
        x1 = _one_device_array(ctl)
        x = _fanout_array(ctl, hosts)
        await cb.block_until_ready([x, x1])
        one = _median_us(await _latency_async(x1, s.latency_calls))
        ours = _median_us(await _latency_async(x, s.latency_calls))
        base = self.raw_rtt_us(raw, hosts)
        self.add(Row(f"fanout{hosts}_latency", "us", ours, base, "lower",
                     f"no-op call on {hosts} hosts; baseline: raw round trip to {hosts} servers",
                     {"colobus_1host": one, "vs_1host": quotient(ours, one)}))
        await _pipelined(x, s.pipelined_calls // 20, s.window)
        ours_p = await _pipelined(x, s.pipelined_calls // 2, s.window)
        base_p = raw.pipelined(s.pipelined_calls // 2, s.window, hosts)
        self.add(Row(f"fanout{hosts}_pipelined", "calls/s", ours_p, base_p, "higher",
                     f"no-op calls on {hosts} hosts, {s.window} in flight; baseline: raw "
                     f"pipelined round trips to {hosts} servers"))

    async def object(self, ctl: cb.Controller, raw: RawEcho) -> None:
        s = self.sizes
        x = _one_device_array(ctl)
        await cb.block_until_ready(x)
        times = []
        for i in range(s.object_reps + 2):
            t = time.perf_counter()
            obj: Any = BenchObject(i)  # the colocated wrapper: methods return Futures
            await obj.ping(x)
            times.append(time.perf_counter() - t)
            await cb.aclose(obj)
        ours = _median_us(times[2:])
        base = self._raw_rtt.get(1) or self.raw_rtt_us(raw)
        self.add(Row("object_first_call", "us", ours, base, "lower",
                     "construct a colocated object plus its first method call, 1 host; "
                     "baseline: raw blocking round trip"))

    async def transfer(self, ctl: cb.Controller, raw: RawEcho) -> None:
        worker = ctl.hosts()[0].pid
        dev = next(d for d in ctl.devices() if d.host == 0)
        me = os.getpid()
        for label, nbytes, reps in self.sizes.transfer:
            data = np.ones(nbytes, np.uint8)  # touched: no page faults inside the timing
            put_t, get_t, raw_put, raw_get = [], [], [], []
            mem: dict[str, PeakMemory] = {}
            for r in range(reps):
                measure = label == "large" and r == 0
                with PeakMemory({"controller": me, "worker": worker}) as m_put:
                    t = time.perf_counter()
                    a = cb.device_put(data, dev)
                    await cb.block_until_ready(a)
                    put_t.append(time.perf_counter() - t)
                with PeakMemory({"controller": me, "worker": worker}) as m_get:
                    t = time.perf_counter()
                    back = await cb.device_get(a)
                    get_t.append(time.perf_counter() - t)
                assert back.nbytes == nbytes
                del back
                a.delete()
                with PeakMemory({"controller": me, "worker": raw.pids[0]}) as r_put:
                    raw_put.append(raw.put(data))
                with PeakMemory({"controller": me, "worker": raw.pids[0]}) as r_get:
                    dt, got = raw.get()
                    raw_get.append(dt)
                assert got.nbytes == nbytes
                del got
                if measure:
                    mem = {"put": m_put, "get": m_get, "raw_put": r_put, "raw_get": r_get}
            gbs = nbytes / 1e9
            size = f"{nbytes // MiB} MiB"
            self.add(Row(f"put_{label}", "GB/s", quotient(gbs, statistics.median(put_t)),
                         quotient(gbs, statistics.median(raw_put)), "higher",
                         f"device_put + block_until_ready of {size}; baseline: raw zero-copy "
                         "frame + ack", {"bytes": nbytes}))
            self.add(Row(f"get_{label}", "GB/s", quotient(gbs, statistics.median(get_t)),
                         quotient(gbs, statistics.median(raw_get)), "higher",
                         f"device_get of {size}; baseline: raw zero-copy frame back",
                         {"bytes": nbytes}))
            for op in ("put", "get") if mem else ():
                for side in ("controller", "worker"):
                    ours = mem[op].peak[side] / MiB
                    base = mem["raw_" + op].peak[side] / MiB
                    # Growth under 1 MiB is RSS noise: it counts as 1 MiB in the ratio.
                    self.add(Row(f"peak_rss_{op}_{side}", "MiB", ours, max(base, 1.0), "lower",
                                 f"peak RSS growth of the {side} during {op} of {size}; "
                                 "baseline: the raw program's same side",
                                 {"bytes": nbytes, "per_payload": ours * MiB / nbytes,
                                  "baseline_per_payload": base * MiB / nbytes,
                                  "exact": mem[op].exact}))

    async def chain(self, ctl: cb.Controller, raw: RawEcho) -> None:
        s, n = self.sizes, self.sizes.chain_len
        x = cb.device_put(np.zeros(4, np.float32), next(d for d in ctl.devices() if d.host == 0))
        await cb.block_until_ready(x)
        chained, awaited = [], []
        for _ in range(s.chain_reps + 1):
            t = time.perf_counter()
            y: Any = x
            for _ in range(n):
                y = bench_inc(y)  # the Future itself is the next argument
            y = await y
            chained.append(time.perf_counter() - t)
            t = time.perf_counter()
            z = x
            for _ in range(n):
                z = await bench_inc(z)
            awaited.append(time.perf_counter() - t)
        check = await cb.device_get([y, z])
        assert float(check[0][0]) == n and float(check[1][0]) == n, check
        ours = statistics.median(chained[1:]) * 1e3
        aw = statistics.median(awaited[1:]) * 1e3
        base = sum(raw.round_trips(n)) * 1e3
        self.add(Row("chain100", "ms", ours, base, "lower",
                     f"{n} dependent calls, each given the previous call's Future unawaited; "
                     f"baseline: {n} raw blocking round trips",
                     {"colobus_awaited_each": aw, "speedup_vs_awaited": quotient(aw, ours)}))


CORE = ("latency", "pipelined", "fanout", "object", "transfer", "chain")
BENCHMARKS = CORE + bench_calls.GROUPS + bench_reshard.GROUPS


async def _run_async(bench: Bench, groups: list[str], options: dict[str, Any]) -> None:
    hosts = 4 if "fanout" in groups else 1
    # The echo servers start (a blocking wait for their hellos) before the cluster:
    # a wait on the controller's loop would starve its heartbeats.
    with RawEcho(hosts) as raw:
        async with cb.local_cluster(hosts=hosts, devices_per_host=1, **options) as ctl:
            for g in groups:
                await getattr(bench, g)(ctl, raw)


def _run_sync(bench: Bench, options: dict[str, Any]) -> None:
    with cb.local_cluster(hosts=1, devices_per_host=1, **options) as ctl, RawEcho(1) as raw:
        x = _one_device_array(ctl)
        cb.block_until_ready(x)
        ours = _median_us(_latency_sync(x, bench.sizes.latency_calls))
        base = bench._raw_rtt.get(1) or bench.raw_rtt_us(raw)
        bench.add(Row("latency_sync", "us", ours, base, "lower",
                      "`return x`, 1 host, `with`: its array at once, then "
                      "block_until_ready(); baseline: raw blocking round trip"))


def _huge_pages_line() -> str:
    from .._process import with_huge_pages

    here = "hugetlb=1" in os.environ.get("GLIBC_TUNABLES", "")
    workers = "hugetlb=1" in with_huge_pages(dict(os.environ)).get("GLIBC_TUNABLES", "")
    return (f"{'on' if here else 'off'} in this process and the raw echo servers, "
            f"{'on' if workers else 'off'} in colobus's local workers")


def _machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(),
            "numpy": np.__version__,
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES", "")}


def run_bench(name: str | None, json_path: str | None, quick: bool,
              peers: bool | None = None, peer_modules: dict[str, str] | None = None,
              metrics: bool = False) -> int:
    """Run the benchmarks (all, or the group ``name``); print a table, maybe write JSON.

    Args:
        name: one group of :data:`BENCHMARKS`, or None for all.
        json_path: write machine-readable results there (``"-"``: stdout).
        quick: small sizes and few repetitions (for CI).
        peers: run the same workloads on Ray and IPython Parallel where installed
            (``colobus._tools.bench_peers``); None: yes unless ``quick``.
        peer_modules: peer name -> module to import (default: all peers); a peer
            whose module is not importable is skipped as not installed.
        metrics: run colobus's clusters with metrics on (a free loopback port), to
            compare against a run with them off.

    Returns:
        The process exit code.
    """
    if name is not None and name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}; choose from: {', '.join(BENCHMARKS)}",
              file=sys.stderr)
        return 2
    groups = [g for g in BENCHMARKS if name in (None, g)]
    bench = Bench(QUICK if quick else FULL)
    out = sys.stderr if json_path == "-" else sys.stdout
    with contextlib.redirect_stdout(out):
        print(f"{'benchmark':<26} {'colobus':>12} {'raw pyzmq':>12} unit", flush=True)
        print(f"huge pages (glibc.malloc.hugetlb): {_huge_pages_line()}", flush=True)
        t0 = time.perf_counter()
        options: dict[str, Any] = {"metrics": "127.0.0.1:0"} if metrics else {}
        print(f"metrics: {'on' if metrics else 'off'}", flush=True)
        core = [g for g in groups if g in CORE]
        if core:
            asyncio.run(_run_async(bench, core, options))
        if name in (None, "latency"):
            _run_sync(bench, options)
        bench_calls.run_groups(bench, groups, options)
        bench_reshard.run_groups(bench, groups, options)
        from . import bench_peers as _bench_peers

        runs = _bench_peers.run_peers(
            bench.sizes, groups, enabled=(not quick) if peers is None else peers,
            modules=peer_modules, why_disabled="--quick (--peers runs them)" if quick
            else "--no-peers")
        _bench_peers.attach(bench.rows, runs)
        for line in _bench_peers.peer_lines(bench.rows):
            print(line, flush=True)
        for line in unmeasured_lines(bench.rows):
            print(line, flush=True)
        print(f"done in {time.perf_counter() - t0:.0f} s", flush=True)
    if json_path is not None:
        doc = {"machine": _machine(), "quick": quick, "metrics": metrics,
               "peers": {run.peer: run.as_dict() for run in runs},
               "benchmarks": {r.name: r.as_dict() for r in bench.rows}}
        text = json.dumps(doc, indent=2)
        if json_path == "-":
            print(text)
        else:
            with open(json_path, "w") as f:
                f.write(text + "\n")
    return 0

