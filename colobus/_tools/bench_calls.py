"""``colobus bench`` rows for the calls users make: arrays back, many in flight, many hosts.

Groups (``colobus bench NAME``):

* ``calls``: ``return x`` and ``return x + 1`` against the no-op, from ``await``
  (alternating chunks of each, medians) with the controller's CPU per call
  (``time.thread_time()`` of the loop thread: in ``async with`` the controller
  runs on this thread), and from a plain thread (its array, then ``block_until_ready``);
  ``return x`` with 1,000 in flight driven by tasks + a semaphore and by ``asyncio.gather``;
  the memory held per call in flight and per finished call whose future and
  output are alive (controller and worker RSS).
* ``scaling``: fan-out over 1, 2, 4, 8, 16 hosts (quick: 1, 2, 4): latency and
  the controller's CPU per call, and the CPU per additional host per call.
* ``bigout``: each host returns N bytes (over its 4 devices); the worker's peak
  RSS growth against N, for a first and a second call.

Every row has a raw pyzmq baseline of the same shape, as in ``bench.py``.
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import threading
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

import colobus as cb

from .bench_base import BenchRun, RawEcho, quotient

__all__ = ["GROUPS", "run_groups"]

GROUPS = ("calls", "scaling", "bigout")
MiB = 1 << 20


@cb.colocated_python
def bench_ident(x: Any) -> Any:
    """``return x``: the call returns its (host-resident) array argument."""
    return x


def _same_specs(x: Any) -> Any:
    """The output specs of ``return x``: the input's (as orbax's dispatcher states them)."""
    return x


# ``return x`` specialized with its output specs, as orbax wraps every function
bench_ident_specialized = bench_ident.specialize(out_specs_fn=_same_specs)


@cb.colocated_python
def bench_plus1(x: Any) -> Any:
    """``return x + 1``: a new array computed on the host."""
    return x + 1


@cb.colocated_python
def bench_hold(x: Any, seconds: float) -> Any:
    """``return x`` after ``seconds``: holds the stream so later calls stay in flight."""
    time.sleep(seconds)
    return x


@cb.colocated_python
def bench_big(x: Any, nbytes: int) -> Any:
    """Returns ``nbytes`` of new data, split over the host's devices as ``x`` is."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    rows = x.shape[0]
    sharding = NamedSharding(x.sharding.mesh, PartitionSpec(x.sharding.spec[0], None))
    make = jax.jit(lambda: jnp.ones((rows, nbytes // rows), jnp.uint8), out_shardings=sharding)
    # Written before the reply: the peak then covers the whole output.
    return make().block_until_ready()


def _sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return {"chunk": 20, "rounds": 6, "pipelined": 2000, "inflight": 1000,
                "scaling": (1, 2, 4), "scaling_calls": 60, "bigout": 32 * MiB}
    return {"chunk": 50, "rounds": 30, "pipelined": 20000, "inflight": 1000,
            "scaling": (1, 2, 4, 8, 16), "scaling_calls": 400, "bigout": 512 * MiB}


async def _timed(call: Callable[[], Awaitable[Any]], n: int) -> tuple[list[float], float]:
    """``n`` awaited calls: each one's seconds, and loop-thread CPU seconds per call."""
    out = []
    c0 = time.thread_time()
    for _ in range(n):
        t = time.perf_counter()
        await call()
        out.append(time.perf_counter() - t)
    return out, (time.thread_time() - c0) / n


async def _alternate(calls: dict[str, Callable[[], Awaitable[Any]]], chunk: int, rounds: int
                     ) -> dict[str, tuple[float, float]]:
    """Chunks of each call in turn; per name the median latency (us) and CPU per call (us)."""
    lat: dict[str, list[float]] = {k: [] for k in calls}
    cpu: dict[str, list[float]] = {k: [] for k in calls}
    for call in calls.values():  # warm-up
        await _timed(call, chunk)
    for _ in range(rounds):
        for name, call in calls.items():
            xs, c = await _timed(call, chunk)
            lat[name].extend(xs)
            cpu[name].append(c)
    return {k: (statistics.median(lat[k]) * 1e6, statistics.median(cpu[k]) * 1e6)
            for k in calls}


def _rss_kib(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


async def _calls(bench: BenchRun, ctl: cb.Controller, raw: RawEcho) -> None:
    from .bench_base import Row, _median_us, _one_device_array, bench_noop

    z = _sizes(bench.sizes.latency_calls < 1000)
    x = _one_device_array(ctl)
    await cb.block_until_ready(x)
    await _inflight_memory(bench, ctl, x, z["inflight"])
    got = await _alternate({"noop": lambda: bench_noop(x), "ident": lambda: bench_ident(x),
                            "spec": lambda: bench_ident_specialized(x),
                            "plus1": lambda: bench_plus1(x)}, z["chunk"], z["rounds"])
    base = _median_us(raw.round_trips(bench.sizes.latency_calls))
    noop_us, noop_cpu = got["noop"]
    bench.add(Row("noop_async_alt", "us", noop_us, base, "lower",
                  "no-op, awaited, alternating with the rows below; baseline: raw round trip",
                  {"cpu_us": noop_cpu}))
    for name, what in (("ident", "`return x`"),
                       ("spec", "`return x` specialized with out_specs_fn"),
                       ("plus1", "`return x + 1`")):
        us, cpu = got[name]
        bench.add(Row(f"{name}_async", "us", us, base, "lower",
                      f"{what} (4 x float32), 1 host, awaited; baseline: raw round trip",
                      {"vs_noop": quotient(us, noop_us), "cpu_us": cpu,
                       "cpu_vs_noop": quotient(cpu, noop_cpu)}))
    await _pipelined_rows(bench, x, raw, z["pipelined"])


async def _pipelined_rows(bench: BenchRun, x: Any, raw: RawEcho, total: int) -> None:
    from .bench_base import Row

    window = bench.sizes.window
    sem = asyncio.Semaphore(window)

    async def one() -> None:
        async with sem:
            await bench_ident(x)

    async def tasks(n: int) -> float:
        t = time.perf_counter()
        await asyncio.gather(*[asyncio.create_task(one()) for _ in range(n)])
        return quotient(n, time.perf_counter() - t)

    async def gathered(n: int, gather: Any = asyncio.gather) -> float:
        batches = max(1, round(n / window))
        t = time.perf_counter()
        for _ in range(batches):
            await gather(*[bench_ident(x) for _ in range(window)])
        return quotient(batches * window, time.perf_counter() - t)

    await tasks(window)
    await gathered(window)
    await gathered(window, cb.gather)
    rates_t, rates_g, rates_c = [], [], []
    for _ in range(3):  # alternating
        rates_t.append(await tasks(total // 3))
        rates_g.append(await gathered(total // 3))
        rates_c.append(await gathered(total // 3, cb.gather))
    base = raw.pipelined(total, window)
    bench.add(Row("ident_pipelined_tasks", "calls/s", statistics.median(rates_t), base,
                  "higher", f"`return x`, {window} in flight: one task per call, a semaphore; "
                  "baseline: raw pipelined round trips"))
    bench.add(Row("ident_pipelined_gather", "calls/s", statistics.median(rates_g), base,
                  "higher", f"`return x`, asyncio.gather over {window} futures at a time; "
                  "baseline: raw pipelined round trips"))
    bench.add(Row("ident_pipelined_cbgather", "calls/s", statistics.median(rates_c), base,
                  "higher", f"`return x`, cb.gather over {window} futures at a time; "
                  "baseline: raw pipelined round trips"))


async def _inflight_memory(bench: BenchRun, ctl: cb.Controller, x: Any, n: int) -> None:
    """Memory per call while ``n`` calls wait on the host behind a held stream, then per
    finished call whose future (and its output) is still alive.

    The controller's figure is its Python heap (``tracemalloc``, exact); the
    worker's is its RSS growth (run first, before other rows grow its heap).
    """
    from .bench_base import Row

    worker = ctl.hosts()[0].pid
    gc.collect()
    tracemalloc.start()
    try:
        c0, w0 = tracemalloc.get_traced_memory()[0], _rss_kib(worker)
        hold = bench_hold(x, 1.5)
        futs = [bench_hold(x, 0.0) for _ in range(n)]
        await asyncio.sleep(1.0)  # all sent and queued on the host, the first still running
        c1, w1 = tracemalloc.get_traced_memory()[0], _rss_kib(worker)
        assert not futs[-1].done()
        await hold
        outs = [await f for f in futs]
        gc.collect()
        await asyncio.sleep(0.3)
        c2, w2 = tracemalloc.get_traced_memory()[0], _rss_kib(worker)
        del outs, futs, hold
    finally:
        tracemalloc.stop()
    per = {"inflight_controller": (c1 - c0) / 1024 / n, "inflight_worker": (w1 - w0) / n,
           "held_controller": (c2 - c0) / 1024 / n, "held_worker": (w2 - w0) / n}
    for name, kib in per.items():
        bench.add(Row(f"mem_{name}", "KiB", max(kib, 0.0), 1.0, "lower",
                      f"memory per call ({n} calls of `return x`) "
                      + ("waiting on the host behind a held stream" if "inflight" in name
                         else "finished, future and output alive")
                      + ("; controller: Python heap (tracemalloc)" if "controller" in name
                         else "; worker: RSS growth") + "; baseline: 1 KiB", {"calls": n}))


async def _scaling(bench: BenchRun, ctl: cb.Controller, raw: RawEcho) -> None:
    from .bench_base import Row, _fanout_array, _median_us, bench_noop

    z = _sizes(bench.sizes.latency_calls < 1000)
    per_k: dict[int, dict[str, tuple[float, float]]] = {}
    raw_cpu: dict[int, float] = {}
    for k in z["scaling"]:
        x = _fanout_array(ctl, k)
        await cb.block_until_ready(x)
        per_k[k] = await _alternate({"noop": lambda: bench_noop(x),  # noqa: B023
                                     "ident": lambda: bench_ident(x)},  # noqa: B023
                                    z["scaling_calls"] // 4, 4)
        c0 = time.thread_time()
        rtt = _median_us(raw.round_trips(z["scaling_calls"], k))
        raw_cpu[k] = (time.thread_time() - c0) / (z["scaling_calls"] * 1.1) * 1e6
        for name in ("noop", "ident"):
            us, cpu = per_k[k][name]
            bench.add(Row(f"scaling{k}_{name}", "us", us, rtt, "lower",
                          f"{'no-op' if name == 'noop' else '`return x`'} on {k} hosts, "
                          "awaited; baseline: raw round trip to as many servers",
                          {"cpu_us": cpu, "cpu_us_per_host": cpu / k, "hosts": k}))
    lo, hi = min(per_k), max(per_k)
    raw_slope = max((raw_cpu[hi] - raw_cpu[lo]) / (hi - lo), 0.01)
    for name in ("noop", "ident"):
        slope = (per_k[hi][name][1] - per_k[lo][name][1]) / (hi - lo)
        bench.add(Row(f"scaling_cpu_per_host_{name}", "us", max(slope, 0.0), raw_slope, "lower",
                      f"controller CPU per additional host per call, {lo} -> {hi} hosts "
                      f"({'no-op' if name == 'noop' else '`return x`'}); baseline: the raw "
                      "ROUTER's CPU per additional server per round trip",
                      {"hosts": [lo, hi]}))


async def _bigout(bench: BenchRun, ctl: cb.Controller, raw: RawEcho) -> None:
    from .bench_base import PeakMemory, Row

    z = _sizes(bench.sizes.latency_calls < 1000)
    n = z["bigout"]
    devs = [d for d in ctl.devices() if d.host == 0]
    mesh = cb.Mesh(np.array(devs, dtype=object), ("d",))
    x = cb.device_put(np.zeros(len(devs), np.float32),
                      cb.NamedSharding(mesh, cb.PartitionSpec("d")))
    await cb.block_until_ready(x)
    worker = ctl.hosts()[0].pid
    for attempt in ("first", "second"):
        gc.collect()
        with PeakMemory({"worker": worker}) as peak:
            t = time.perf_counter()
            out = await bench_big(x, n)
            await cb.block_until_ready(out)
            dt = time.perf_counter() - t
        assert out.shape == (len(devs), n // len(devs)), out.shape
        out.delete()
        del out
        await asyncio.sleep(0.2)
        growth = peak.peak["worker"] / MiB
        bench.add(Row(f"bigout_{attempt}_peak_rss_worker", "MiB", growth, n / MiB, "lower",
                      f"{attempt} call returning {n // MiB} MiB over {len(devs)} devices of one "
                      "host: the worker's peak RSS growth; baseline: the output's size",
                      {"bytes": n, "seconds": dt, "exact": peak.exact}))


def run_groups(bench: BenchRun, groups: list[str], options: dict[str, Any]) -> None:
    """Run the groups of :data:`GROUPS` among ``groups``, each on a cluster of its shape."""
    quick = bench.sizes.latency_calls < 1000
    if "calls" in groups:
        asyncio.run(_on_cluster(bench, _calls, 1, 1, options))
        _sync_rows(bench, options)
    if "scaling" in groups:
        hosts = max(_sizes(quick)["scaling"])
        asyncio.run(_on_cluster(bench, _scaling, hosts, 1, options))
    if "bigout" in groups:
        asyncio.run(_on_cluster(bench, _bigout, 1, 4, options))


async def _on_cluster(bench: BenchRun,
                      fn: Callable[[BenchRun, cb.Controller, RawEcho], Awaitable[None]],
                      hosts: int, devices: int, options: dict[str, Any]) -> None:

    # The echo servers first: starting them blocks, and the controller's loop must not
    # miss its heartbeats meanwhile.
    with RawEcho(hosts) as raw:
        async with cb.local_cluster(hosts=hosts, devices_per_host=devices, **options) as ctl:
            await fn(bench, ctl, raw)


def _sync_rows(bench: BenchRun, options: dict[str, Any]) -> None:
    """A plain thread's ``return x``, as JAX code waits for it: its array at once, then
    ``block_until_ready()`` (a no-op call returns nothing to wait for there, as JAX's)."""
    from .bench_base import RawEcho, Row, _median_us, _one_device_array

    z = _sizes(bench.sizes.latency_calls < 1000)
    with cb.local_cluster(hosts=1, devices_per_host=1, **options) as ctl, RawEcho(1) as raw:
        x = _one_device_array(ctl)
        cb.block_until_ready(x)
        lat: list[float] = []
        assert threading.current_thread() is threading.main_thread()
        for r in range(z["rounds"] + 1):
            for _ in range(z["chunk"]):
                t = time.perf_counter()
                bench_ident(x).block_until_ready()
                if r:
                    lat.append(time.perf_counter() - t)
        base = _median_us(raw.round_trips(bench.sizes.latency_calls))
    ident = statistics.median(lat) * 1e6
    bench.add(Row("ident_sync", "us", ident, base, "lower",
                  "`return x` from a plain thread (`with`): its array at once, then "
                  "block_until_ready(); baseline: raw round trip"))
