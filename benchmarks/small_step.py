"""The small step on CPU: a jitted MLP training step through colobus and in a plain process.

``accelerator_check.py``'s small MLP step (a 128x256 batch through 256 -> 512 -> 16,
its loss and gradient, the parameters updated and donated), on JAX's CPU backend
(``JAX_PLATFORMS=cpu``), for machines without an accelerator: in a plain process of its
own and on a ``local_cluster(hosts=1)`` worker as a colocated object's method, both
kept for the run and measured in pairs (the plain side, then colobus, each alone on the
machine's cores while the other waits), both ways:

* ``pipelined``: ``--steps`` steps dispatched back to back, one wait at the end
  (steps/s; goal: colobus >= 0.9x plain);
* ``awaited``: each step waited for (``block_until_ready``), the median (goal: at most
  one colobus round trip more than plain, the round trip being an awaited no-op call).

A third side, ``raw`` (``raw_step.py``: the same step behind a raw pyzmq echo server,
nothing of colobus), measured in each pair after colobus, splits colobus's awaited extra
into the machine's part (``raw +us``: what any design sending each step over ZeroMQ pays
here, its wake-ups and a step started on threads that slept) and colobus's own (``own
+us``, the rest); ``raw +trips`` is the raw side's extra in its own round trips.

``ctl us`` is the controller process's CPU per pipelined step: on CPU it competes with
the step itself wherever the controller shares the worker's cores.

On CPU the controller, the worker's Python and JAX's own threads share the cores, so
what colobus costs per call is taken from the steps directly (on an accelerator the
chip computes while the host's Python runs). Each figure is the median of the pairs'
ratios: a shared machine's load moves both sides of a pair alike.

    python benchmarks/small_step.py                     # 5 pairs of 300 / 100 steps
    python benchmarks/small_step.py --rounds 1 --steps 50 --awaited 20   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # (this process's JAX, and its workers')


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accelerator_check import Trainer as _Trainer  # (after JAX_PLATFORMS is set)
from raw_step import RawStep


class Trainer(_Trainer):
    """``accelerator_check.Trainer``'s MLP: parameters on this process's first device and a
    jitted step; ``step()`` returns the loss as JAX dispatched it."""

    def __init__(self) -> None:
        super().__init__("mlp")


class _Plain:
    """The plain side: a Trainer in this process, measured on demand."""

    def __init__(self) -> None:
        self.t = Trainer()
        for _ in range(20):
            self.t.step()

    def pipelined(self, steps: int) -> float:
        """Steps/s, ``steps`` dispatched back to back and one wait."""
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = self.t.step()
        loss.block_until_ready()
        return steps / (time.perf_counter() - t0)

    def awaited(self, steps: int) -> float:
        """The median step waited for (us)."""
        waits = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self.t.step().block_until_ready()
            waits.append(time.perf_counter() - t0)
        return statistics.median(waits) * 1e6


def _serve_plain() -> None:
    """The plain process: one measurement per line asked on stdin, its figure on stdout."""
    plain = _Plain()
    print("ready", flush=True)
    for line in sys.stdin:
        what, n = line.split()
        print(getattr(plain, what)(int(n)), flush=True)


def _host_trainer() -> Any:
    import colobus as cb

    @cb.colocated_python_class
    class HostTrainer:
        """The same Trainer, kept on a colobus host."""

        def __init__(self) -> None:
            self.t = Trainer()

        def step(self, like: Any) -> Any:
            return self.t.step()  # on the device of ``like``: this host's first

    return HostTrainer


def _nop(x: Any) -> Any:
    return x


class _Colobus:
    """The colobus side: the Trainer kept on a worker as a colocated object."""

    async def start(self) -> None:
        import numpy as np

        import colobus as cb

        self.cluster = cb.local_cluster(hosts=1, devices_per_host=1)
        await self.cluster.__aenter__()
        dev = cb.devices()[0]
        self.like = cb.device_put(np.zeros(1, np.float32), cb.SingleDeviceSharding(dev))
        self.nop = cb.colocated_python(_nop)
        await self.nop(self.like)
        self.t: Any = _host_trainer()()
        await cb.block_until_ready(self.t.step(self.like))  # built and compiled
        await self.pipelined(20)

    async def stop(self) -> None:
        import colobus as cb

        await cb.aclose(self.t)
        await self.cluster.__aexit__(None, None, None)

    async def pipelined(self, steps: int) -> tuple[float, float]:
        """Steps/s, and this (the controller's) process's CPU per step (us)."""
        import colobus as cb

        c0, t0 = time.process_time(), time.perf_counter()
        futs = [self.t.step(self.like) for _ in range(steps)]
        await cb.block_until_ready(futs[-1])
        rate = steps / (time.perf_counter() - t0)
        cpu = (time.process_time() - c0) / steps * 1e6
        await cb.gather(*futs)
        return rate, cpu

    async def awaited(self, steps: int) -> float:
        import colobus as cb

        waits = []
        for _ in range(steps):
            t0 = time.perf_counter()
            await cb.block_until_ready(self.t.step(self.like))  # the wait rides behind
            waits.append(time.perf_counter() - t0)
        return statistics.median(waits) * 1e6

    async def round_trip(self, calls: int) -> float:
        trips = []
        for _ in range(calls):
            t0 = time.perf_counter()
            await self.nop(self.like)
            trips.append(time.perf_counter() - t0)
        return statistics.median(trips) * 1e6


async def measure(rounds: int, steps: int, awaited: int) -> list[dict[str, float]]:
    """``rounds`` pairs, each side's measurement right after the other's."""
    plain = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--plain"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert plain.stdin is not None and plain.stdout is not None
    via = _Colobus()
    raw: RawStep | None = None
    out = []
    try:
        if plain.stdout.readline().strip() != "ready":
            raise RuntimeError("the plain process failed")
        await via.start()
        raw = side = RawStep("mlp")
        side.awaited(20)  # warm

        def ask(what: str, n: int) -> float:
            assert plain.stdin is not None and plain.stdout is not None
            plain.stdin.write(f"{what} {n}\n")
            plain.stdin.flush()
            return float(plain.stdout.readline())

        for _ in range(rounds):
            plain_rate = ask("pipelined", steps)
            rate, cpu = await via.pipelined(steps)
            row = {"plain_steps_per_s": plain_rate, "colobus_steps_per_s": rate,
                   "controller_cpu_us": cpu,
                   "plain_awaited_us": ask("awaited", awaited),
                   "colobus_awaited_us": await via.awaited(awaited),
                   "round_trip_us": await via.round_trip(max(awaited, 30)),
                   "raw_awaited_us": side.awaited(awaited),
                   "raw_round_trip_us": side.round_trip(max(awaited, 30)),
                   "load": os.getloadavg()[0]}
            row["pipelined_ratio"] = row["colobus_steps_per_s"] / row["plain_steps_per_s"]
            row["awaited_extra_round_trips"] = (
                row["colobus_awaited_us"] - row["plain_awaited_us"]) / row["round_trip_us"]
            row["raw_extra_us"] = row["raw_awaited_us"] - row["plain_awaited_us"]
            row["own_extra_us"] = row["colobus_awaited_us"] - row["raw_awaited_us"]
            row["raw_extra_round_trips"] = row["raw_extra_us"] / row["raw_round_trip_us"]
            out.append(row)
            yield_row(row, len(out))
        await via.stop()
    finally:
        if raw is not None:
            raw.close()
        plain.stdin.close()
        plain.wait(60)
    return out


def yield_row(r: dict[str, float], i: int) -> None:
    print(f"  {i:5d} {r['plain_steps_per_s']:8.0f} {r['colobus_steps_per_s']:9.0f} "
          f"{r['pipelined_ratio']:6.3f} {r['plain_awaited_us']:9.0f} "
          f"{r['colobus_awaited_us']:10.0f} {r['round_trip_us']:10.0f} "
          f"{r['awaited_extra_round_trips']:+7.2f} {r['raw_extra_us']:+7.0f} "
          f"{r['raw_round_trip_us']:7.0f} {r['raw_extra_round_trips']:+9.2f} "
          f"{r['own_extra_us']:+7.0f} {r['controller_cpu_us']:7.0f} {r['load']:5.1f}",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="steps per pipelined run")
    ap.add_argument("--awaited", type=int, default=100, help="steps per awaited run")
    ap.add_argument("--rounds", type=int, default=5, help="pairs: plain, then colobus")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--plain", action="store_true", help="(internal) the plain process")
    args = ap.parse_args()
    if args.plain:
        _serve_plain()
        return
    print(f"the MLP step on CPU, {args.steps} pipelined / {args.awaited} awaited steps per run, "
          f"plain and colobus side by side, load {os.getloadavg()[0]:.1f}")
    print(f"  {'pair':>5s} {'plain/s':>8s} {'colobus/s':>9s} {'ratio':>6s} {'plain us':>9s} "
          f"{'colobus us':>10s} {'round trip':>10s} {'+trips':>7s} {'raw +us':>7s} "
          f"{'raw rt':>7s} {'raw +trips':>9s} {'own +us':>7s} {'ctl us':>7s} {'load':>5s}")
    rounds = asyncio.run(measure(args.rounds, args.steps, args.awaited))
    ratio = statistics.median(r["pipelined_ratio"] for r in rounds)
    extra = statistics.median(r["awaited_extra_round_trips"] for r in rounds)
    print(f"median of the pairs: pipelined {ratio:.3f}x plain (goal >= 0.9: "
          f"{'met' if ratio >= 0.9 else 'not met'}), awaited {extra:+.2f} round trips "
          f"(goal <= +1.0: {'met' if extra <= 1.0 else 'not met'})")
    raw_us = statistics.median(r["raw_extra_us"] for r in rounds)
    own_us = statistics.median(r["own_extra_us"] for r in rounds)
    raw_trips = statistics.median(r["raw_extra_round_trips"] for r in rounds)
    print(f"of colobus's awaited extra: the machine's (a raw pyzmq server's) {raw_us:+.0f} us "
          f"({raw_trips:+.2f} of its own round trips), colobus's own {own_us:+.0f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"pairs": rounds, "pipelined_ratio": ratio,
                       "awaited_extra_round_trips": extra, "raw_extra_us": raw_us,
                       "own_extra_us": own_us, "raw_extra_round_trips": raw_trips},
                      f, indent=1)

if __name__ == "__main__":
    main()
