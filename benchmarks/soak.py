"""Soak: many calls and array put/delete cycles; memory must stay flat, stores empty.

Runs ``--calls`` colocated calls (100,000 by default; each takes a sharded array
and returns one, whose result the caller drops at once) and ``--cycles`` array
put/delete cycles (10,000; half deleted with ``delete()``, half dropped for the
garbage collector) on a two-host local cluster. It prints the controller's and
each worker's RSS (from ``/proc/PID/status``) after a warm-up (the first 10 %)
and at the end, with the growth in percent (target: under 5 %), and checks that
the hosts' stores end empty (``ctl.refresh_stats()``).

    python benchmarks/soak.py            # 100,000 calls, 10,000 cycles
    python benchmarks/soak.py --quick    # 2,000 calls, 500 cycles
"""

from __future__ import annotations

import argparse
import gc
import time
from collections import deque
from typing import Any

import numpy as np

import colobus as cb
from colobus._tools.bench_base import rss_mib


@cb.colocated_python
def bump(x: Any) -> Any:
    return x + 1


def _rss_all(ctl: cb.Controller) -> dict[str, float]:
    gc.collect()
    out = {"controller": rss_mib()}
    for h in ctl.hosts():
        out[f"worker {h.index}"] = rss_mib(h.pid)
    return out


def run_soak(calls: int, cycles: int, window: int = 256) -> dict[str, Any]:
    """Run the soak on a fresh 2x2 local cluster; returns the figures."""
    report: dict[str, Any] = {"calls": calls, "cycles": cycles}
    with cb.local_cluster(hosts=2, devices_per_host=2) as ctl:
        mesh = cb.Mesh(np.array(cb.devices()).reshape(2, 2), ("hosts", "devices"))
        sharding = cb.NamedSharding(mesh, cb.PartitionSpec("hosts", "devices"))
        x = cb.device_put(np.arange(64, dtype=np.float32).reshape(4, 16), sharding)
        data = np.arange(1024, dtype=np.float32).reshape(4, 256)

        # Calls: a window of calls in flight (their arrays), dropped as they land.
        t0 = time.perf_counter()
        pending: deque[cb.Array] = deque()
        warm: dict[str, float] | None = None
        for i in range(calls):
            pending.append(bump(x))
            if len(pending) >= window:
                cb.block_until_ready(pending.popleft())
            if i == calls // 10:
                warm = _rss_all(ctl)
        while pending:
            cb.block_until_ready(pending.popleft())
        report["calls_s"] = time.perf_counter() - t0
        report["calls_warm"] = warm
        report["calls_end"] = _rss_all(ctl)

        # Array put/delete cycles.
        t0 = time.perf_counter()
        warm = None
        for i in range(cycles):
            a = cb.device_put(data, sharding)
            if i % 2:
                a.delete()
            else:
                cb.block_until_ready(a)
                del a
            if i == cycles // 10:
                warm = _rss_all(ctl)
        report["cycles_s"] = time.perf_counter() - t0
        report["cycles_warm"] = warm
        report["cycles_end"] = _rss_all(ctl)

        x.delete()
        del x
        gc.collect()
        deadline = time.monotonic() + 30
        while True:  # frees are batched and asynchronous: poll until they landed
            stats = ctl.refresh_stats().result(60)
            hosts = stats["hosts"]
            if all(h["arrays"] == 0 and h["objects"] == 0 for h in hosts.values()):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        report["stores_end"] = {i: (h["arrays"], h["bytes"], h["objects"])
                                for i, h in hosts.items()}
        report["dropped"] = stats["dropped"]
    return report


def _growth(warm: dict[str, float] | None, end: dict[str, float]) -> str:
    if not warm:
        return ", ".join(f"{k} {v:.1f} MiB" for k, v in end.items())
    return ", ".join(f"{k} {warm[k]:.1f} -> {end[k]:.1f} MiB ({(end[k] - warm[k]) / warm[k]:+.1%})"
                     for k in end)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--cycles", type=int, default=10_000)
    ap.add_argument("--quick", action="store_true", help="2,000 calls and 500 cycles")
    args = ap.parse_args()
    calls, cycles = (2_000, 500) if args.quick else (args.calls, args.cycles)
    r = run_soak(calls, cycles)
    print(f"{calls} calls in {r['calls_s']:.1f} s ({calls / r['calls_s']:,.0f}/s); RSS after "
          f"10 % -> end: {_growth(r['calls_warm'], r['calls_end'])}")
    print(f"{cycles} put/delete cycles in {r['cycles_s']:.1f} s "
          f"({cycles / r['cycles_s']:,.0f}/s); RSS after 10 % -> end: "
          f"{_growth(r['cycles_warm'], r['cycles_end'])}")
    print(f"host stores at the end (arrays, bytes, objects): {r['stores_end']}")
    print(f"dropped messages: {r['dropped'] or 'none'}")
    empty = all(v == (0, 0, 0) for v in r["stores_end"].values())
    print("stores empty: " + ("yes" if empty else "NO"))
    return 0 if empty else 1


if __name__ == "__main__":
    raise SystemExit(main())
