"""A check for a machine with an accelerator, in one run: what works there, and what it costs.

Prints one JSON object (``--out FILE`` also writes it) with:

* ``devices``: each host's devices as the controller sees them (accelerator first,
  then CPU), and ``colocated_cpu_devices`` of the accelerators;
* ``compute``: an array put on the accelerator, ``x * 2`` computed there by a jitted
  colocated function, fetched and checked;
* ``moves``: accelerator -> colocated CPU device -> accelerator with
  ``cb.device_put``, the values checked and each sharding's platform;
* ``two_workers``: ``local_cluster(hosts=2)`` on this machine: the platforms each
  worker got (with one chip: the first worker the chip, the second CPU-only);
* ``example``: ``examples/accelerator_training.py``'s last line;
* ``steps``: the overhead of a training step through colobus against the same
  jitted step in a plain process (which runs first, alone on the chip), for a
  4096x4096 bf16 matmul step and a small MLP step: (a) ``pipelined``: steps
  dispatched back to back, one wait at the end (goal: colobus >= 0.95x the plain
  steps/s); (b) ``awaited``: each step waited for with ``block_until_ready``
  (goal: at most one colobus round trip more than plain, the round trip being an
  awaited trivial colocated call, ``round_trip_us``); beside it, ``raw``: the same
  step behind a raw pyzmq echo server (``raw_step.py``, after the plain side, alone on
  the chip), the machine's part of an awaited step's extra (``raw_extra_us``, and in
  the raw server's own round trips) and colobus's own (``own_extra_us``).

The driver never opens the accelerator: each measurement runs in a process of its
own (one process at a time can hold a TPU). Without an accelerator it runs the
same on CPU devices and says so.

    python benchmarks/accelerator_check.py --out accelerator_check.json
    python benchmarks/accelerator_check.py --quick   # a smoke run (what CI runs)
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import colobus as cb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from raw_step import raw_timings  # (this directory's: the script runs by path)

ROOT = Path(__file__).resolve().parent.parent
# --quick: a smoke run of the script itself (tests/test_bench.py), small and short
QUICK = "--quick" in sys.argv or os.environ.get("ACCEL_CHECK_QUICK") == "1"
PIPELINED = 20 if QUICK else 200  # steps per pipelined run
AWAITED = 10 if QUICK else 100  # steps per awaited run
REPEATS = 1 if QUICK else 3  # runs of each; the best is reported
MATMUL = 256 if QUICK else 4096  # the matmul step's side


# -- the steps, the same in a plain process and on a colobus host -------------------------------


class Trainer:
    """Parameters on this process's first device and a jitted step; ``step()`` returns
    the loss as JAX dispatched it."""

    def __init__(self, kind: str) -> None:
        import jax
        import jax.numpy as jnp

        dev = jax.devices()[0]
        k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
        if kind == "matmul":
            n = MATMUL
            self.params = jax.device_put(jax.random.normal(k1, (n, n), jnp.bfloat16), dev)
            self.batch = jax.device_put(jax.random.normal(k2, (n, n), jnp.bfloat16) / 64, dev)

            def matmul_step(w: Any, x: Any) -> Any:
                w = (w @ x).astype(jnp.bfloat16)  # x ~ N(0, 1/64^2): w stays ~N(0, 1)
                return w, w[0, 0].astype(jnp.float32)

            step: Callable[[Any, Any], Any] = matmul_step
        else:
            self.params = jax.device_put({"w1": jax.random.normal(k1, (256, 512)) / 16,
                                          "w2": jax.random.normal(k2, (512, 16)) / 23}, dev)
            self.batch = jax.device_put(jax.random.normal(k3, (128, 256)), dev)

            def loss_fn(p: Any, x: Any) -> Any:
                return jnp.mean((jax.nn.relu(x @ p["w1"]) @ p["w2"] - 1.0) ** 2)

            def mlp_step(p: Any, x: Any) -> Any:
                loss, g = jax.value_and_grad(loss_fn)(p, x)
                return jax.tree.map(lambda w, d: w - 0.01 * d, p, g), loss

            step = mlp_step
        self._step = jax.jit(step, donate_argnums=0)
        self.step()[0].block_until_ready()  # compiled

    def step(self) -> Any:
        self.params, loss = self._step(self.params, self.batch)
        return loss.reshape(1)


def plain_timings(kind: str) -> dict[str, float]:
    """Steps/s pipelined and the median awaited step, in this (plain) process."""
    t = Trainer(kind)
    best = 0.0
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(PIPELINED):
            loss = t.step()
        loss.block_until_ready()
        best = max(best, PIPELINED / (time.perf_counter() - t0))
    waits = []
    for _ in range(REPEATS * AWAITED):
        t0 = time.perf_counter()
        t.step().block_until_ready()
        waits.append(time.perf_counter() - t0)
    return {"steps_per_s": best, "awaited_us": statistics.median(waits) * 1e6}


@cb.colocated_python_class
class HostTrainer:
    """The same Trainer, kept on a colobus host."""

    def __init__(self, kind: str) -> None:
        self.t = Trainer(kind)

    def step(self, like: Any) -> Any:
        return self.t.step()  # on the device of ``like``: this host's first


@cb.colocated_python
def nop(x: Any) -> Any:
    return x


@cb.colocated_python
def double(x: Any) -> Any:
    import jax

    return jax.jit(lambda a: a * 2)(x)


async def colobus_timings(kind: str, dev: cb.Device) -> dict[str, float]:
    sharding = cb.SingleDeviceSharding(dev)
    like = cb.device_put(np.zeros(1, np.float32), sharding)
    t: Any = HostTrainer(kind)
    await cb.block_until_ready(t.step(like))  # built and compiled
    best = 0.0
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        futs = [t.step(like) for _ in range(PIPELINED)]
        await cb.block_until_ready(futs[-1])
        best = max(best, PIPELINED / (time.perf_counter() - t0))
        await asyncio.gather(*futs)
    waits = []
    for _ in range(REPEATS * AWAITED):
        t0 = time.perf_counter()
        await cb.block_until_ready(t.step(like))  # the wait leaves behind the call
        waits.append(time.perf_counter() - t0)
    await cb.aclose(t)
    return {"steps_per_s": best, "awaited_us": statistics.median(waits) * 1e6}


async def round_trip_us(dev: cb.Device) -> float:
    x = cb.device_put(np.zeros(1, np.float32), cb.SingleDeviceSharding(dev))
    await nop(x)
    times = []
    for _ in range(30 if QUICK else 300):
        t0 = time.perf_counter()
        await nop(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


# -- the checks ------------------------------------------------------------------------------


def _describe(d: cb.Device) -> str:
    return f"{d.platform}:{d.id} host {d.host} ({d.device_kind})"


async def one_host(out: dict[str, Any]) -> dict[str, Any]:
    """Devices, compute, moves and the colobus side of the step timings (one worker)."""
    async with cb.local_cluster(hosts=1, devices_per_host=1) as ctl:
        out["devices"] = [[_describe(d) for d in h.devices] for h in ctl.hosts()]
        accel = next((d for d in cb.devices() if d.platform != "cpu"), None)
        out["accelerator"] = _describe(accel) if accel else None
        dev = accel or cb.devices()[0]
        cpu = cb.colocated_cpu_devices([dev])[0]
        out["colocated_cpu_devices"] = {_describe(dev): _describe(cpu)}
        data = np.arange(16, dtype=np.float32).reshape(2, 8)
        x = cb.device_put(data, cb.SingleDeviceSharding(dev))
        y = await double(x)
        got = await cb.device_get(y)
        out["compute"] = {"ok": bool(np.array_equal(got, data * 2)),
                          "result_platform": next(iter(y.sharding.device_set)).platform}
        on_cpu = cb.device_put(y, cb.SingleDeviceSharding(cpu))
        back = cb.device_put(on_cpu, cb.SingleDeviceSharding(dev))
        values = await cb.device_get((on_cpu, back))
        out["moves"] = {"ok": all(np.array_equal(v, data * 2) for v in values),
                        "platforms": [next(iter(a.sharding.device_set)).platform
                                      for a in (y, on_cpu, back)]}
        out["round_trip_us"] = await round_trip_us(dev)
        return {kind: await colobus_timings(kind, dev) for kind in ("matmul", "mlp")}


async def two_workers() -> dict[str, Any]:
    async with cb.local_cluster(hosts=2, devices_per_host=1) as ctl:
        return {"hosts": [[_describe(d) for d in h.devices] for h in ctl.hosts()]}


def in_own_process(code: str) -> Any:
    """Run ``code`` (which prints one JSON line last) in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{code!r} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="also write the JSON object here")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: small matmul, few steps, the example left out")
    args = p.parse_args()
    out: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    plain = in_own_process(  # a process of its own: it opens the accelerator
        f"import json, sys; sys.argv += {['--quick'] if QUICK else []!r}; "
        "sys.path.insert(0, 'benchmarks'); import accelerator_check as a; "
        "print(json.dumps({k: a.plain_timings(k) for k in ('matmul', 'mlp')}))")
    if QUICK:  # (the raw server's Trainer: the same sizes as the plain side's)
        os.environ["ACCEL_CHECK_QUICK"] = "1"
    raw = {kind: raw_timings(kind, REPEATS * AWAITED, 30 if QUICK else 300)
           for kind in ("matmul", "mlp")}
    via = asyncio.run(one_host(out))
    if out["accelerator"] is None:
        out["note"] = "no accelerator here: CPU devices stand in for it"
    rt = out["round_trip_us"]
    out["steps"] = {}
    for kind in ("matmul", "mlp"):
        a, b, r = plain[kind], via[kind], raw[kind]
        ratio = b["steps_per_s"] / a["steps_per_s"]
        extra = b["awaited_us"] - a["awaited_us"]
        raw_extra = r["awaited_us"] - a["awaited_us"]
        out["steps"][kind] = {
            "plain": a, "colobus": b, "pipelined_ratio": round(ratio, 3),
            "pipelined_goal_met": ratio >= 0.95, "awaited_extra_us": round(extra, 1),
            "awaited_extra_round_trips": round(extra / rt, 2), "awaited_goal_met": extra <= rt,
            "raw": r, "raw_extra_us": round(raw_extra, 1),
            "raw_extra_round_trips": round(raw_extra / r["round_trip_us"], 2),
            "own_extra_us": round(b["awaited_us"] - r["awaited_us"], 1)}
    out["two_workers"] = asyncio.run(two_workers())
    example_ok = True
    if not args.quick:
        ex = subprocess.run([sys.executable, str(ROOT / "examples" / "accelerator_training.py"),
                             "--steps", "200"], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
        out["example"] = {"exit": ex.returncode, "last_line": (ex.stdout.strip().splitlines() or
                                                              [ex.stderr[-500:]])[-1]}
        example_ok = ex.returncode == 0
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    ok = out["compute"]["ok"] and out["moves"]["ok"] and example_ok
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
