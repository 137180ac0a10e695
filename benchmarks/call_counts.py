"""Python calls per call, counted on both sides: what a change to the hot path removes.

Times move with the machine; counts do not. A ``sitecustomize`` on ``PYTHONPATH`` (which
the controller and its local workers share) installs ``sys.setprofile`` and
``threading.setprofile`` as each process starts, counting the ``'call'`` events (Python
functions entered, coroutine and generator resumptions included) and the ``'c_call'``
events (C functions called from Python) of every thread. For each pattern this runs
``--warm`` calls, then ``--calls`` calls, and prints both sides' counts divided by
``--calls``:

* controller: its counts over the measured calls, read before and after them;
* worker: each host reads its own counts in a marker call (``_mark``) made before the
  measured calls, again right after it, and after the measured calls; the second
  interval (one marker call's overhead) is taken from the third, so what is left is the
  measured calls alone. On the fan-out row the worker's figure is per host (the mean).

Patterns: ``noop`` (a no-op, awaited one at a time), ``ident`` (``return x``, awaited),
``kept`` (the same, each future kept: no frees ride along; the difference from
``ident`` is what freeing a call's result and output costs),
``sync`` (``return x`` on a plain thread, ``with local_cluster``: its array at once, then
``block_until_ready()``, as JAX code waits),
``foreign`` (``return x`` awaited in a coroutine on a loop of the caller's own,
``asyncio.run`` beside a ``with local_cluster``: a Jupyter kernel's or pytest-asyncio's
case; its array, awaited),
``method`` (a colocated object's no-op method, awaited), ``spec`` (``return x``
specialized with ``out_specs_fn``, as orbax wraps every function), ``mident``
(``return x`` as an object's method), ``window`` (``return x``, 100 calls in
flight: one task keeps the futures and awaits the oldest; ``mwindow``, the same of an
object's method, as a training step), ``tasks`` (``return x`` from 100 tasks, each
awaiting its own calls), ``fanout4`` (``return x`` on an array over 4
hosts, awaited), ``star4`` ... ``star32`` (a no-op on an array over that many hosts,
over TCP: the worker's figure per host, the controller's per call; the controller's
marginal cost per host is the slope between two of them), ``relay4``, ``relay16``,
``relay32`` (a fan-out no-op over N hosts connected over TCP, all carried by one relay;
the relay process is counted too, marked by ``SIGUSR1``, and its figure is for all its
hosts together).

    python benchmarks/call_counts.py                  # 1,000 calls after 200
    python benchmarks/call_counts.py --calls 200 --warm 50 --pattern star4 star16 star32
    python benchmarks/call_counts.py --calls 100 --warm 20 --pattern noop ident
    python benchmarks/call_counts.py --pattern window mwindow tasks   # 100 in flight

The counts include whatever else the processes do meanwhile (heartbeats: a few per
second), so they can move by a fraction of a call between runs; the profiler slows
both processes several times, so no time is printed. The worker's inline-call watchdog
(``colobus-loop-watch``) is counted apart, in the ``watch`` column (its Python calls per
call, per host): a watchdog that woke on a timer would show there a share that follows the
profiler's slowness, not the calls.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import itertools
import os
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

import colobus as cb

SHIM = r'''
import os, sys, threading
COUNTERS = []
DETAIL = bool(os.environ.get("COLOBUS_COUNT_DETAIL"))
WHERE = os.environ.get("COLOBUS_COUNT_DETAIL") == "where"  # C calls named with their caller
NAMES = []  # with DETAIL: per thread, (kind, where) -> count

def _counter():
    c = [0, 0]
    COUNTERS.append(c)
    if DETAIL:
        names = {}
        NAMES.append(names)
        def prof(frame, event, arg):
            if event == "call":
                c[0] += 1
                code = frame.f_code
                key = ("py", f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}")
            elif event == "c_call":
                c[1] += 1
                key = ("c", f"{getattr(arg, '__qualname__', arg)}")
                if WHERE:
                    code = frame.f_code
                    key = ("c", key[1] + " <- " + code.co_filename.rsplit('/', 1)[-1]
                           + ":" + code.co_name)
            else:
                return
            names[key] = names.get(key, 0) + 1
        return prof
    def prof(frame, event, arg):
        if event == "call":
            c[0] += 1
        elif event == "c_call":
            c[1] += 1
    return prof

# Threads counted apart (the worker's inline-call watchdog): their own columns
APART = ("colobus-loop-watch",)
WATCH = []  # their counters

def _first(frame, event, arg):
    if threading.current_thread().name in APART:
        c = [0, 0]
        WATCH.append(c)
        def watch(frame, event, arg):
            if event == "call":
                c[0] += 1
            elif event == "c_call":
                c[1] += 1
        sys.setprofile(watch)
        watch(frame, event, arg)
        return
    prof = _counter()
    sys.setprofile(prof)
    prof(frame, event, arg)

def totals():
    # (Python calls, C calls) so far, every thread of this process but those counted apart
    return sum(c[0] for c in COUNTERS), sum(c[1] for c in COUNTERS)

def watch_totals():
    # (Python calls, C calls) so far of the threads counted apart (the watchdog)
    return sum(c[0] for c in WATCH), sum(c[1] for c in WATCH)

def names():
    out = {}
    for d in NAMES:
        for k, v in list(d.items()):
            out[k] = out.get(k, 0) + v
    return out

def mark(tag):
    calls, c_calls = totals()
    w_calls, w_c_calls = watch_totals()
    d = os.environ["COLOBUS_COUNT_DIR"]
    with open(os.path.join(d, f"{os.getpid()}.txt"), "a") as f:
        f.write(f"{tag} {calls} {c_calls} {w_calls} {w_c_calls}\n")
    if DETAIL:
        import pickle
        with open(os.path.join(d, f"{os.getpid()}.{tag.replace(':', '.')}.names"), "wb") as f:
            pickle.dump(names(), f)

def _on_signal(signum, frame):
    # a relay process marks on SIGUSR1, under the tag the parent wrote (relay rows)
    with open(os.path.join(os.environ["COLOBUS_COUNT_DIR"], "signal_tag")) as f:
        mark(f.read().strip())

if os.environ.get("COLOBUS_COUNT_DIR"):
    sys.setprofile(_counter())
    threading.setprofile(_first)
    if threading.current_thread() is threading.main_thread():
        import signal
        signal.signal(signal.SIGUSR1, _on_signal)
'''

STARS = {"star4": 4, "star8": 8, "star16": 16, "star32": 32}
# The star rows' heartbeat interval (s; COLOBUS_COUNT_HEARTBEAT): heartbeats are work per
# second, not per call, and under the profiler on a small machine a 32-host call takes a
# good part of a second, so at the default 1 s each call would carry a share of every
# host's heartbeat (both ways) that grows with the width and the machine's load.
STAR_HEARTBEAT = float(os.environ.get("COLOBUS_COUNT_HEARTBEAT", "30"))
# relayN: N hosts over TCP, every one carried by one relay (relays=1, relay_threshold=1);
# the relay process is counted too (SIGUSR1 marks), its figure per call for all its hosts
RELAYED = {"relay4": 4, "relay16": 16, "relay32": 32}
PATTERNS = ("noop", "ident", "kept", "sync", "foreign", "spec", "method", "mident", "window",
            "mwindow", "tasks", "fanout4", *STARS, *RELAYED)
# Pipelined: 100 calls in flight (asked for by name)
PIPELINED = ("window", "mwindow", "tasks")
# (the star and relay rows start up to 32 workers: asked for by name)
DEFAULT = tuple(p for p in PATTERNS
                if p not in STARS and p not in RELAYED and p not in PIPELINED)
LABELS = {
    "noop": "no-op, awaited, 1 host",
    "ident": "`return x`, awaited, 1 host",
    "kept": "`return x`, awaited, futures kept (no frees)",
    "sync": "`return x`, plain thread, block_until_ready()",
    "foreign": "`return x`, awaited on a loop of the caller's own",
    "spec": "`return x`, specialized (out_specs_fn), awaited",
    "method": "object method (no-op), awaited",
    "mident": "object method `return x`, awaited",
    "window": "`return x`, 100 in flight (one task's futures)",
    "mwindow": "object method `return x`, 100 in flight",
    "tasks": "`return x`, 100 tasks awaiting their own",
    "fanout4": "`return x`, awaited, 4 hosts (worker: per host)",
    **{k: f"no-op, awaited, {n} hosts over TCP (worker: per host)" for k, n in STARS.items()},
    "relay4": "fan-out no-op, 4 hosts over TCP, one relay",
    "relay16": "fan-out no-op, 16 hosts over TCP, one relay",
    "relay32": "fan-out no-op, 32 hosts over TCP, one relay",
}


@cb.colocated_python
def _mark(x: Any, tag: str) -> Any:
    import sitecustomize  # the shim: this process's counters

    sitecustomize.mark(tag)
    return x


def _controller_totals(tag: str) -> tuple[int, int]:
    import pickle

    import sitecustomize

    got: tuple[int, int] = sitecustomize.totals()
    if sitecustomize.DETAIL:
        with open(os.path.join(os.environ["COLOBUS_COUNT_DIR"], f"controller.{tag}.names"),
                  "wb") as f:
            pickle.dump(sitecustomize.names(), f)
    return got


# -- in the counted child -----------------------------------------------------------------


async def _relay_mark(pids: list[int], tag: str) -> None:
    """Have each relay process write its counts under ``tag`` (SIGUSR1), and wait for it."""
    import signal

    d = os.environ["COLOBUS_COUNT_DIR"]
    with open(os.path.join(d, "signal_tag"), "w") as f:
        f.write(tag)
    for pid in pids:
        os.kill(pid, signal.SIGUSR1)
    for pid in pids:
        path = os.path.join(d, f"{pid}.txt")
        for _ in range(3000):
            if os.path.exists(path):
                with open(path) as f:
                    if any(line.split()[0] == tag for line in f):
                        break
            await asyncio.sleep(0.01)
        else:
            raise RuntimeError(f"relay {pid} wrote no mark {tag}")


async def _each(fn: Callable[[], Awaitable[Any]], n: int) -> None:
    for _ in range(n):
        await fn()


async def _window(fn: Callable[[], Awaitable[Any]], n: int, inflight: int = 100) -> None:
    """``n`` calls, ``inflight`` of them in flight (futures kept in order, the oldest
    awaited), as a training loop pipelines its steps."""
    futs: collections.deque[Awaitable[Any]] = collections.deque()
    for _ in range(n):
        futs.append(fn())
        if len(futs) >= inflight:
            await futs.popleft()
    for f in futs:
        await f


async def _tasks(fn: Callable[[], Awaitable[Any]], n: int, inflight: int = 100) -> None:
    """``n`` calls from ``inflight`` tasks, each awaiting its own one after another (each
    task a stream of its own)."""
    async def one(k: int) -> None:
        for _ in range(k):
            await fn()

    each, extra = divmod(n, inflight)
    await asyncio.gather(*(one(each + (i < extra)) for i in range(inflight)))


async def _measured(name: str, fn: Callable[[], Awaitable[Any]], x: Any, n: int,
                    warm: int, relays: list[int] | None = None,
                    run: Callable[[Callable[[], Awaitable[Any]], int], Awaitable[None]] = _each,
                    ) -> None:
    relays = relays or []
    await run(fn, warm)
    await _relay_mark(relays, f"{name}@relay:a")
    await _mark(x, f"{name}:a")
    await _relay_mark(relays, f"{name}@relay:b")
    await _mark(x, f"{name}:b")
    c0 = _controller_totals(f"{name}.0")
    await run(fn, n)
    c1 = _controller_totals(f"{name}.1")
    await _relay_mark(relays, f"{name}@relay:c")
    await _mark(x, f"{name}:c")
    print(f"ROW {name} {c1[0] - c0[0]} {c1[1] - c0[1]}", flush=True)


async def _async_rows(patterns: list[str], n: int, warm: int) -> None:
    from colobus._tools.bench_base import BenchObject, _fanout_array, _one_device_array, bench_noop
    from colobus._tools.bench_calls import bench_ident, bench_ident_specialized

    one = [p for p in patterns
           if p in ("noop", "ident", "kept", "spec", "method", "mident", "window", "mwindow",
                    "tasks")]
    if one:
        async with cb.local_cluster(hosts=1, devices_per_host=1) as ctl:
            x = _one_device_array(ctl)
            await cb.block_until_ready(x)
            obj: Any = BenchObject(0)
            kept: list[Any] = []

            async def keep() -> None:  # nothing to free while the futures (and outputs) live
                fut = bench_ident(x)
                await fut
                kept.append(fut)

            calls: dict[str, Callable[[], Awaitable[Any]]] = {
                "noop": lambda: bench_noop(x), "ident": lambda: bench_ident(x),
                "kept": keep, "spec": lambda: bench_ident_specialized(x),
                "method": lambda: obj.ping(x), "mident": lambda: obj.ident(x),
                "window": lambda: bench_ident(x), "tasks": lambda: bench_ident(x),
                "mwindow": lambda: obj.ident(x)}
            for name in one:
                await _measured(name, calls[name], x, n, warm,
                                run={"window": _window, "mwindow": _window,
                                     "tasks": _tasks}.get(name, _each))
                kept.clear()
            await cb.aclose(obj)
    if "fanout4" in patterns:
        async with cb.local_cluster(hosts=4, devices_per_host=1) as ctl:
            x = _fanout_array(ctl, 4)
            await cb.block_until_ready(x)
            await _measured("fanout4", lambda: bench_ident(x), x, n, warm)
    for name, hosts in STARS.items():
        if name in patterns:
            # (workers counted from their start import slowly: time to join, and to stay)
            async with cb.local_cluster(hosts=hosts, devices_per_host=1, transport="tcp",
                                        join_timeout=1800, heartbeat_interval=STAR_HEARTBEAT,
                                        liveness_timeout=10 * STAR_HEARTBEAT) as ctl:
                x = _fanout_array(ctl, hosts)
                await cb.block_until_ready(x)
                await _measured(name, lambda x=x: bench_noop(x), x, n, warm)
    for name in [p for p in patterns if p in RELAYED]:
        hosts = RELAYED[name]
        async with cb.local_cluster(hosts=hosts, devices_per_host=1, relays=1,
                                    relay_threshold=1, transport="tcp", join_timeout=1800,
                                    heartbeat_interval=STAR_HEARTBEAT,
                                    liveness_timeout=10 * STAR_HEARTBEAT) as ctl:
            x = _fanout_array(ctl, hosts)
            await cb.block_until_ready(x)
            assert ctl._relays is not None
            pids = [r.proc.pid for r in ctl._relays.relays]
            await _measured(name, functools.partial(bench_noop, x), x, n, warm, pids)


def _sync_row(x: Any, n: int, warm: int) -> None:
    from colobus._tools.bench_calls import bench_ident

    for _ in range(warm):
        bench_ident(x).block_until_ready()
    _mark(x, "sync:a").block_until_ready()
    _mark(x, "sync:b").block_until_ready()
    c0 = _controller_totals("sync.0")
    for _ in range(n):
        bench_ident(x).block_until_ready()  # its array at once, then waited, as JAX's
    c1 = _controller_totals("sync.1")
    _mark(x, "sync:c").block_until_ready()
    print(f"ROW sync {c1[0] - c0[0]} {c1[1] - c0[1]}", flush=True)


def _foreign_row(x: Any, n: int, warm: int) -> None:
    from colobus._tools.bench_calls import bench_ident

    async def run() -> None:  # a loop of this thread's own: not the controller's
        for _ in range(warm):
            await bench_ident(x)
        await _mark(x, "foreign:a")
        await _mark(x, "foreign:b")
        c0 = _controller_totals("foreign.0")
        for _ in range(n):
            await bench_ident(x)
        c1 = _controller_totals("foreign.1")
        await _mark(x, "foreign:c")
        print(f"ROW foreign {c1[0] - c0[0]} {c1[1] - c0[1]}", flush=True)

    asyncio.run(run())


def _plain_thread_rows(patterns: list[str], n: int, warm: int) -> None:
    """The rows called from this plain thread, beside a ``with local_cluster`` (one for
    both: each row's warm calls come before its marks)."""
    from colobus._tools.bench_base import _one_device_array

    with cb.local_cluster(hosts=1, devices_per_host=1) as ctl:
        x = _one_device_array(ctl)
        cb.block_until_ready(x)
        if "sync" in patterns:
            _sync_row(x, n, warm)
        if "foreign" in patterns:
            _foreign_row(x, n, warm)


def _child(patterns: list[str], n: int, warm: int) -> None:
    asyncio.run(_async_rows(patterns, n, warm))
    if "sync" in patterns or "foreign" in patterns:
        _plain_thread_rows(patterns, n, warm)


# -- in the parent ------------------------------------------------------------------------


def _worker_counts(directory: str) -> dict[str, list[tuple[int, ...]]]:
    """Per row, each worker's (calls, C calls, watchdog calls, watchdog C calls) over the
    measured calls."""
    marks: dict[tuple[str, str], dict[str, tuple[int, ...]]] = {}
    for name in os.listdir(directory):
        if not name.endswith(".txt") or name.startswith("controller"):
            continue
        with open(os.path.join(directory, name)) as f:
            for line in f:
                tag, *counts = line.split()
                row, point = tag.split(":")
                marks.setdefault((row, name), {})[point] = tuple(map(int, counts))
    out: dict[str, list[tuple[int, ...]]] = {}
    for (row, _), m in marks.items():
        a, b, c = m["a"], m["b"], m["c"]
        out.setdefault(row, []).append(tuple((c[i] - b[i]) - (b[i] - a[i])
                                             for i in range(len(a))))
    return out


def _names(path: str) -> dict[tuple[str, str], int]:
    import pickle

    with open(path, "rb") as f:
        got: dict[tuple[str, str], int] = pickle.load(f)
    return got


def _detail(d: str, row: str, n: int, top: int) -> None:
    """Print, per side, the functions called per call over ``row``'s measured calls."""
    def diff(after: dict[tuple[str, str], int], before: dict[tuple[str, str], int],
             ) -> dict[tuple[str, str], int]:
        return {k: v - before.get(k, 0) for k, v in after.items()}

    sides = {"controller": diff(_names(os.path.join(d, f"controller.{row}.1.names")),
                                _names(os.path.join(d, f"controller.{row}.0.names")))}
    pid = sorted(f.split(".")[0] for f in os.listdir(d) if f.endswith(f".{row}.a.names"))[0]
    a, b, c = (_names(os.path.join(d, f"{pid}.{row}.{p}.names")) for p in "abc")
    one, marker = diff(c, b), diff(b, a)
    sides["worker"] = {k: v - marker.get(k, 0) for k, v in one.items()}
    relay = sorted(f.split(".")[0] for f in os.listdir(d) if f.endswith(f".{row}@relay.a.names"))
    if relay:
        a, b, c = (_names(os.path.join(d, f"{relay[0]}.{row}@relay.{p}.names")) for p in "abc")
        one, marker = diff(c, b), diff(b, a)
        sides["relay"] = {k: v - marker.get(k, 0) for k, v in one.items()}
    for side, got in sides.items():
        for kind in ("py", "c"):
            rows = sorted(((v / n, k[1]) for k, v in got.items() if k[0] == kind and v),
                          reverse=True)
            print(f"{row} {side} {kind}: {sum(v for v, _ in rows):.1f} per call")
            for v, where in rows[:top]:
                print(f"  {v:7.2f} {where}")


def count(patterns: list[str], n: int, warm: int, detail: int = 0,
          ) -> dict[str, dict[str, float]]:
    """Run the counted child; per pattern its counts per call on both sides (with
    ``detail``, print that many functions per side, most called first)."""
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "sitecustomize.py"), "w") as f:
            f.write(SHIM)
        env = dict(os.environ, COLOBUS_COUNT_DIR=d, COLOBUS_COUNT_DETAIL=(
                       os.environ.get("COLOBUS_COUNT_DETAIL") or "1") if detail else "",
                   PYTHONPATH=os.pathsep.join([d, *filter(None, [os.environ.get("PYTHONPATH")])]))
        proc = subprocess.run([sys.executable, __file__, "--child", "--calls", str(n),
                               "--warm", str(warm), "--pattern", *patterns],
                              env=env, stdout=subprocess.PIPE, text=True, check=True)
        workers = _worker_counts(d)
        for row in patterns if detail else []:
            _detail(d, row, n, detail)
    out: dict[str, dict[str, float]] = {}
    for line in proc.stdout.splitlines():
        if not line.startswith("ROW "):
            continue
        _, row, calls, c_calls = line.split()
        ws = workers[row]
        out[row] = {"controller_calls": int(calls) / n, "controller_c_calls": int(c_calls) / n,
                    "worker_calls": sum(w[0] for w in ws) / len(ws) / n,
                    "worker_c_calls": sum(w[1] for w in ws) / len(ws) / n,
                    "watch_calls": sum(w[2] for w in ws) / len(ws) / n,
                    "watch_c_calls": sum(w[3] for w in ws) / len(ws) / n}
        rs = workers.get(f"{row}@relay")
        if rs:  # the relay's counts per call, all its hosts' work together
            out[row]["relay_calls"] = sum(r[0] for r in rs) / n
            out[row]["relay_c_calls"] = sum(r[1] for r in rs) / n
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--warm", type=int, default=200)
    ap.add_argument("--pattern", nargs="+", default=list(DEFAULT), choices=PATTERNS)
    ap.add_argument("--detail", type=int, default=0, metavar="N",
                    help="also print the N functions called most per call, per side")
    ap.add_argument("--child", action="store_true", help="(internal) the counted process")
    args = ap.parse_args()
    if args.child:
        _child(args.pattern, args.calls, args.warm)
        return
    got = count(args.pattern, args.calls, args.warm, args.detail)
    print(f"Python calls ('call') and C calls ('c_call') per call, {args.calls} calls after "
          f"{args.warm}")
    print(f"  {'pattern':52s} {'ctl calls':>9s} {'ctl C':>7s} {'wrk calls':>9s} {'wrk C':>7s}"
          f" {'watch':>6s} {'relay calls':>11s} {'relay C':>8s}")
    for name in args.pattern:
        r = got[name]
        relay = (f" {r['relay_calls']:11.1f} {r['relay_c_calls']:8.1f}" if "relay_calls" in r
                 else "")
        print(f"  {LABELS[name]:52s} {r['controller_calls']:9.1f} "
              f"{r['controller_c_calls']:7.1f} {r['worker_calls']:9.1f} "
              f"{r['worker_c_calls']:7.1f} {r['watch_calls']:6.2f}{relay}")
    stars = sorted((STARS[k], got[k]["controller_calls"]) for k in args.pattern if k in STARS)
    for (n0, c0), (n1, c1) in itertools.pairwise(stars):
        print(f"  star controller, Python calls per additional host, {n0} -> {n1} hosts: "
              f"{(c1 - c0) / (n1 - n0):.2f}")
    widths = sorted((RELAYED[p], got[p]) for p in args.pattern if p in RELAYED)
    for (n0, r0), (n1, r1) in itertools.pairwise(widths):  # what one more host costs
        per = (r1.get("relay_calls", 0) - r0.get("relay_calls", 0)) / (n1 - n0)
        ctl = (r1["controller_calls"] - r0["controller_calls"]) / (n1 - n0)
        print(f"  relay, marginal per host {n0} -> {n1}: relay {per:.1f}, controller "
              f"{ctl:.1f} Python calls per call")


if __name__ == "__main__":
    main()
