"""Where a small step's time goes on a colobus host: the host's own clock around the step.

``accelerator_check.py``'s MLP step (or the matmul step) pipelined, in a plain process and
as a colocated object's method on a ``local_cluster(hosts=1)`` worker. The worker's method
stamps its clock before and after the step's JAX dispatch; from the stamps:

* ``dispatch us``: JAX's dispatch of one step (the method's own time), median;
* ``between us``: from one step's end to the next one's start on the host, median: what
  colobus spends per call on the worker while calls are queued (receiving, scheduling,
  describing the output, replying), since the next call is already waiting; its mean,
  and the gaps of 0.5 ms or more (``long_gaps``: how many, and their share of the time
  between steps: the loop's turns between slices, or the host waiting for calls);
* ``in_one_call`` and ``in_one_call_kept``: the same steps run back to back inside one call
  on the same worker thread, the outputs dropped (as a plain loop does) or kept and asked
  ``is_ready`` (as a colobus host does with a call's outputs);
* per-thread CPU of the worker (``/proc/self/task``) over the run, by thread name;
* ``loop_profile``: the same steps again with a timing wrapper around each of the
  worker's per-call and per-turn functions (:data:`PROFILED`): per step, how often each
  ran and its time, inclusive and its own (less the wrapped functions it called), in us.
  The wrappers cost about 1-2 us a call; the rows say where a step's colobus time goes
  (``Runs._run_slice``'s own time holds the step itself).

The plain process's ``dispatch us`` and steps/s are measured the same way. Prints one JSON
object. Runs on an accelerator where one is (JAX's default backend), else on CPU.

    python benchmarks/step_anatomy.py --kind mlp --steps 400
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import colobus as cb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accelerator_check import Trainer as _Trainer  # (its step, by reference)


class Trainer(_Trainer):
    """``accelerator_check.Trainer``'s MLP (or matmul) step, each dispatch's start and end
    stamped in ``marks``."""

    def __init__(self, kind: str) -> None:
        self.marks: list[tuple[float, float]] = []
        super().__init__(kind)

    def step(self) -> Any:
        t0 = time.perf_counter()
        out = super().step()
        self.marks.append((t0, time.perf_counter()))
        return out


# (module, function or Class.method) timed on the worker for ``loop_profile``
PROFILED = (
    ("selectors", "EpollSelector.select"), ("asyncio.base_events", "BaseEventLoop._run_once"),
    ("asyncio.events", "Handle._run"),
    ("colobus._host.messages", "MessagePath._on_frames"),
    ("colobus._host.messages", "MessagePath._lane_in"),
    ("colobus._host.sched", "Scheduler.on_call"), ("colobus._host.sched", "Scheduler._queue"),
    ("colobus._host.sched", "Scheduler.pump"), ("colobus._host.sched", "Scheduler._target"),
    ("colobus._host.runs", "Runs._run_slice"), ("colobus._host.runs", "Runs._run_batch"),
    ("colobus._host.runs", "Runs._run_lone"), ("colobus._host.runs", "Runs._finish_all"),
    ("colobus._host.runs", "Runs._finish"), ("colobus._host.runs", "Runs._post_done"),
    ("colobus._host.runs", "call_args"), ("colobus._host.values", "HostValues.outputs"),
    ("colobus._host.store", "Store.store_outputs"), ("colobus._host.outbound", "Outbound.uncork"),
    ("colobus._wire.channel", "Channel.flush"), ("colobus._wire.channel", "Channel.uncork"),
    ("colobus._wire.channel", "Channel.drain"), ("colobus._host.alarm", "_TimerFd.wait"),
)


@cb.colocated_python
def profile_loop(like: Any, on: bool) -> Any:
    """``on``: wrap :data:`PROFILED` with timers; off: unwrap them and return what they
    counted, as JSON bytes (name: [calls, inclusive ns, own ns])."""
    import importlib

    stats: dict[str, list[int]] = {}
    tl, clock = threading.local(), time.perf_counter_ns

    def wrap(key: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            stack = tl.__dict__.setdefault("stack", [])
            stack.append(0)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = clock() - t0
                inner = stack.pop()
                row = stats.setdefault(key, [0, 0, 0])
                row[0] += 1
                row[1] += spent
                row[2] += spent - inner
                if stack:
                    stack[-1] += spent

        timed.profiled = fn  # type: ignore[attr-defined]
        timed.stats = stats  # type: ignore[attr-defined]
        return timed

    for mod, name in PROFILED:
        owner: Any = importlib.import_module(mod)
        attr = name
        if "." in name:
            cls, attr = name.split(".")
            owner = getattr(owner, cls, None)
        fn = getattr(owner, attr, None) if owner is not None else None
        if fn is None:
            continue  # (not on this platform: no timerfd)
        was = getattr(fn, "profiled", None)
        if on and was is None:
            setattr(owner, attr, wrap(name, fn))
        elif not on and was is not None:
            stats = fn.stats
            setattr(owner, attr, was)
    return like if on else np.frombuffer(json.dumps(stats).encode(), np.uint8).copy()


def _threads() -> dict[str, float]:
    """CPU seconds per thread of this process, by thread name (/proc/self/task)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        name = names.get(int(tid), "other:" + comm)
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _figures(marks: list[tuple[float, float]]) -> dict[str, float]:
    disp = [b - a for a, b in marks]
    between = [marks[i + 1][0] - marks[i][1] for i in range(len(marks) - 1)]
    long = [b for b in between if b >= 0.5e-3]
    return {"dispatch_us": statistics.median(disp) * 1e6,
            "between_us": statistics.median(between) * 1e6 if between else 0.0,
            "between_mean_us": statistics.mean(between) * 1e6 if between else 0.0,
            # the gaps of 0.5 ms or more (between slices, or waiting for calls): how many
            # and their share of all the time between steps
            "long_gaps": len(long),
            "long_gaps_share": sum(long) / sum(between) if between and sum(between) else 0.0}


@cb.colocated_python_class
class HostTrainer:
    def __init__(self, kind: str) -> None:
        self.t = Trainer(kind)

    def step(self, like: Any) -> Any:
        return self.t.step()

    def begin(self, like: Any) -> Any:
        self.t.marks.clear()
        self.cpu0 = _threads()
        return like

    def report(self, like: Any) -> Any:
        cpu1 = _threads()
        marks = list(self.t.marks)
        self.t.marks.clear()
        t0 = time.perf_counter()
        for _ in range(len(marks)):
            loss = self.t.step()
        loss.block_until_ready()
        rate = len(marks) / (time.perf_counter() - t0)
        one = _figures(self.t.marks)
        # the same, each step's output kept and asked whether it is computed, as a
        # colobus host does with a call's outputs (stored until the controller frees them)
        self.t.marks.clear()
        kept = []
        t0 = time.perf_counter()
        for _ in range(len(marks)):
            loss = self.t.step()
            loss.is_ready()
            kept.append(loss)
        loss.block_until_ready()
        kept_rate = len(marks) / (time.perf_counter() - t0)
        del kept
        out = {"host": _figures(marks),
               "in_one_call": {"steps_per_s": rate, **one},
               "in_one_call_kept": {"steps_per_s": kept_rate, **_figures(self.t.marks)},
               "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
               "thread_cpu_s": {k: round(v - self.cpu0.get(k, 0.0), 3) for k, v in cpu1.items()
                                if v - self.cpu0.get(k, 0.0) > 0.005}}
        Path(os.environ.get("STEP_ANATOMY_OUT", "/tmp/step_anatomy.json")).write_text(
            json.dumps(out))
        return like


def plain(kind: str, steps: int) -> dict[str, Any]:
    t = Trainer(kind)
    for _ in range(20):
        t.step()
    t.step().block_until_ready()
    t.marks.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = t.step()
    loss.block_until_ready()
    return {"steps_per_s": steps / (time.perf_counter() - t0), **_figures(t.marks)}


async def via(kind: str, steps: int) -> dict[str, Any]:
    out_file = f"/tmp/step_anatomy_{os.getpid()}.json"
    os.environ["STEP_ANATOMY_OUT"] = out_file
    async with cb.local_cluster(hosts=1, devices_per_host=1):
        dev = next((d for d in cb.devices() if d.platform != "cpu"), cb.devices()[0])
        like = cb.device_put(np.zeros(1, np.float32), cb.SingleDeviceSharding(dev))
        t: Any = HostTrainer(kind)
        for _ in range(20):
            t.step(like)
        await cb.block_until_ready(t.step(like))
        await cb.block_until_ready(t.begin(like))
        t0 = time.perf_counter()
        futs = [t.step(like) for _ in range(steps)]
        sent = time.perf_counter() - t0
        await cb.block_until_ready(futs[-1])
        rate = steps / (time.perf_counter() - t0)
        await cb.block_until_ready(t.report(like))
        await cb.block_until_ready(profile_loop(like, True))
        t0 = time.perf_counter()
        futs = [t.step(like) for _ in range(steps)]
        await cb.block_until_ready(futs[-1])
        profiled_rate = steps / (time.perf_counter() - t0)
        rows = json.loads(bytes(await cb.device_get(await profile_loop(like, False))))
        await cb.aclose(t)
    host = json.loads(Path(out_file).read_text())
    table = {name: {"per_step": round(n / steps, 2), "incl_us": round(incl / steps / 1e3, 1),
                    "own_us": round(own / steps / 1e3, 1)}
             for name, (n, incl, own) in sorted(rows.items(), key=lambda kv: -kv[1][2])}
    return {"steps_per_s": rate, "sent_us_per_call": sent / steps * 1e6, **host,
            "loop_profile": {"steps_per_s": profiled_rate, "per_step": table}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("mlp", "matmul"), default="mlp")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--plain", action="store_true", help="(internal) the plain process")
    args = ap.parse_args()
    if args.plain:
        print(json.dumps(plain(args.kind, args.steps)))
        return 0
    proc = subprocess.run([sys.executable, __file__, "--plain", "--kind", args.kind,
                           "--steps", str(args.steps)], capture_output=True, text=True,
                          check=True)
    p = json.loads(proc.stdout.strip().splitlines()[-1])
    v = asyncio.run(via(args.kind, args.steps))
    print(json.dumps({"kind": args.kind, "plain": p, "colobus": v,
                      "ratio": round(v["steps_per_s"] / p["steps_per_s"], 3)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
