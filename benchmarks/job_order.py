"""What a JAX job's one order costs: calls per second from 1, 2 and 8 driver threads.

In a job (the default view) calls that span several hosts start in one order on every
host, one at a time (docs/jax_job.md, "Calls in a job: one order"); in the block view
(``jax_distributed=False``) calls from different threads run side by side. For each view
this starts a local cluster of ``--hosts`` CPU-only workers (``--devices`` each) and, from
T driver threads at once, makes ``--calls`` calls per thread of each function, each
waited for (``cb.device_get``) before the thread's next, on an array over every host:

* ``return x``: host code that does nothing;
* ``sleep 5 ms``: host code that waits (I/O, a lock) without computing;
* ``jit sum`` (job only: across the hosts it is a collective): ``v - v.sum()``.

It prints calls per second (all threads together) per view, function and thread count.

    python benchmarks/job_order.py --threads 1 2 8 --calls 100
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import numpy as np

import colobus as cb


@cb.colocated_python
def ident(x: Any) -> Any:
    return x


@cb.colocated_python
def sleepy(x: Any) -> Any:
    time.sleep(0.005)
    return x


@cb.colocated_python
def centered(x: Any) -> Any:
    import jax

    return jax.jit(lambda v: v - v.sum(), out_shardings=x.sharding)(x)


def rate(fn: Any, x: cb.Array, threads: int, calls: int) -> float:
    """Calls per second of ``fn(x)`` from ``threads`` threads, ``calls`` each, each waited."""
    cb.device_get(fn(x))  # (its first call, and any compilation, out of the figure)
    start = threading.Barrier(threads + 1)

    def drive() -> None:
        start.wait()
        for _ in range(calls):
            cb.device_get(fn(x))

    workers = [threading.Thread(target=drive) for _ in range(threads)]
    for w in workers:
        w.start()
    start.wait()
    t0 = time.perf_counter()
    for w in workers:
        w.join()
    return threads * calls / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 8])
    p.add_argument("--calls", type=int, default=100, help="calls per thread")
    args = p.parse_args()
    rows = []
    for view in ("job", "block"):
        with cb.local_cluster(hosts=args.hosts, devices_per_host=args.devices,
                              jax_distributed=view == "job") as ctl:
            mesh = cb.make_mesh((len(ctl.devices()),), ("x",))
            x = cb.device_put(np.arange(len(ctl.devices()) * 4, dtype=np.float32),
                              cb.NamedSharding(mesh, cb.PartitionSpec("x")))
            fns = [("return x", ident), ("sleep 5 ms", sleepy)]
            if view == "job":
                fns.append(("jit sum", centered))
            for name, fn in fns:
                for t in args.threads:
                    r = rate(fn, x, t, args.calls)
                    rows.append((view, name, t, r))
                    print(f"{view:5} {name:10} {t} thread(s): {r:8.1f} calls/s", flush=True)
    print("\n| view | host code | " + " | ".join(f"{t} thread(s)" for t in args.threads) + " |")
    print("|---|---|" + "---|" * len(args.threads))
    for view in ("job", "block"):
        for name in ("return x", "sleep 5 ms", "jit sum"):
            figs = [r for v, n, _, r in rows if v == view and n == name]
            if figs:
                print(f"| {view} | {name} | " + " | ".join(f"{r:.0f}" for r in figs) + " |")


if __name__ == "__main__":
    main()
