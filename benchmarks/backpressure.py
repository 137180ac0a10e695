"""Back-pressure benchmark: fire no-op calls at one host far faster than it runs them.

A plain thread submits ``--calls`` no-op calls (200,000 by default) to a one-host
local cluster without waiting for any of them; the controller's back-pressure
(``max_inflight`` sent per host, ``max_backlog`` queued) makes the thread block
while the host catches up. A sampler reads this process's RSS
(``/proc/self/status`` VmRSS) while it runs. Without a bound the controller
would hold every call's future, pickled arguments and closure: memory would grow
with the number of calls. With it, RSS stays flat.

    python benchmarks/backpressure.py            # 200,000 calls
    python benchmarks/backpressure.py --quick    # 20,000 calls
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np

import colobus as cb
from colobus._tools.bench_base import rss_mib


@cb.colocated_python
def noop(i: int) -> None:
    """Nothing at all: the host's cost per call is colobus's own."""


@cb.colocated_python
def token(i: int) -> np.ndarray:
    """A scalar: something to wait for (a call that returns nothing returns nothing to
    wait for in plain code, as JAX's)."""
    return np.int8(0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--quick", action="store_true", help="20,000 calls")
    ap.add_argument("--max-inflight", type=int, default=64)
    ap.add_argument("--max-backlog", type=int, default=64)
    args = ap.parse_args()
    n = 20_000 if args.quick else args.calls
    with cb.local_cluster(hosts=1, devices_per_host=1, max_inflight=args.max_inflight,
                          max_backlog=args.max_backlog) as ctl:
        dev = cb.devices()[0]
        call = noop.specialize(devices=[dev])
        call(0)  # code sent, caches warm (a first call: it returns once its host ran it)
        last_one = token.specialize(devices=[dev])
        cb.block_until_ready(last_one(0))
        sent = [0]
        done = threading.Event()
        last: list[cb.Array] = []

        def fire() -> None:
            for i in range(n):
                call(i)  # nothing to wait for: it returns as soon as it is submitted
                sent[0] = i + 1
            last.append(last_one(n))  # behind them all on the host: its array says when
            done.set()

        rss0 = rss_mib()
        samples: list[tuple[float, int, float, int]] = []
        t0 = time.perf_counter()
        threading.Thread(target=fire, daemon=True).start()
        while not done.wait(0.5):
            st = ctl.stats()
            samples.append((time.perf_counter() - t0, sent[0], rss_mib(), st["queued"]))
        cb.block_until_ready(last[0])
        elapsed = time.perf_counter() - t0
        samples.append((elapsed, sent[0], rss_mib(), ctl.stats()["queued"]))
        worker_pid = str(ctl.hosts()[0].pid)
        worker_rss = rss_mib(worker_pid)

    print(f"{'t (s)':>7} {'calls sent':>11} {'RSS (MiB)':>10} {'queued':>7}")
    step = max(1, len(samples) // 20)
    for t, k, r, q in samples[::step] + ([samples[-1]] if len(samples) % step != 1 else []):
        print(f"{t:7.1f} {k:11d} {r:10.1f} {q:7d}")
    later = [r for t, k, r, q in samples if k >= n // 10]  # after the first 10 %
    base = later[0] if later else rss0
    peak = max(r for _, _, r, _ in samples)
    print(f"\n{n} calls in {elapsed:.1f} s ({n / elapsed:,.0f} calls/s), "
          f"max_inflight={args.max_inflight}, max_backlog={args.max_backlog}")
    print(f"controller RSS: start {rss0:.1f} MiB, at 10 % {base:.1f} MiB, peak {peak:.1f} MiB, "
          f"end {samples[-1][2]:.1f} MiB; growth after warm-up "
          f"{(samples[-1][2] - base) / base * 100:+.1f} %")
    print(f"worker RSS at end: {worker_rss:.1f} MiB; peak queued "
          f"{max(q for *_, q in samples)} (bound {args.max_backlog})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
