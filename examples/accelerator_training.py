"""An async training loop on each host's accelerators, driven from one controller.

What runs where, on every host at once:

* ``Model`` (a ``colocated_python_class``, one instance per host) keeps its
  parameters on that host's first accelerator and trains them with a jitted step;
  the controller never sees them, only a loss per step (a ``cb.Array`` still
  being computed: JAX dispatches asynchronously, and so does colobus);
* ``make_batch`` prepares each batch on the host's colocated CPU device (the
  accelerator does not wait on Python for its data);
* ``Checkpoints`` writes the parameters, moved to the colocated CPU device with
  ``cb.device_put``, from an asyncio task of its own while the next steps run;
* ``cb.block_until_ready`` waits until the hosts' JAX has computed the last loss:
  the time printed is the accelerator's, not only the time to dispatch.

Each host trains its own replica on its own data (a host's chips are one slice).
On a machine without an accelerator it runs on the CPU devices and says so.

    python examples/accelerator_training.py --steps 200 --hosts 1

or under `colobus launch`, with the size it starts (e.g. `colobus launch local --hosts 3
-- python examples/accelerator_training.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

import colobus as cb

WIDTH = 512  # the MLP: WIDTH -> HIDDEN -> WIDTH
HIDDEN = 2048
BATCH = 256


def _host_device() -> Any:
    """This host's first accelerator, or its CPU device when it has none."""
    import jax

    return jax.devices()[0]


@cb.colocated_python_class
class Model:
    """A small MLP's parameters on this host's accelerator, and its jitted step."""

    def __init__(self, seed: int) -> None:
        import jax
        import jax.numpy as jnp

        dev = _host_device()
        k1, k2 = jax.random.split(jax.random.key(seed + cb.host_index()))
        params = {"w1": jax.random.normal(k1, (WIDTH, HIDDEN), jnp.float32) / WIDTH ** 0.5,
                  "w2": jax.random.normal(k2, (HIDDEN, WIDTH), jnp.float32) / HIDDEN ** 0.5}
        self.params = jax.device_put(params, dev)
        self.device = dev

        def loss_fn(p: Any, x: Any, y: Any) -> Any:
            h = jax.nn.relu(x @ p["w1"])
            return jnp.mean((h @ p["w2"] - y) ** 2)

        def step(p: Any, x: Any, y: Any) -> Any:
            loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
            return jax.tree.map(lambda w, g: w - 0.05 * g, p, grads), loss

        self._step = jax.jit(step, donate_argnums=0)

    def step(self, batch: Any) -> Any:
        """One step on a batch that lives on the colocated CPU device; the loss is
        returned as JAX dispatched it (still being computed)."""
        import jax

        x, y = jax.device_put((batch[0][0], batch[1][0]), self.device)  # CPU -> accelerator
        self.params, loss = self._step(self.params, x, y)
        # back to the CPU device as this host's entry of a (hosts,) array, still in flight
        return jax.device_put(loss.reshape(1), batch[0].sharding)

    def snapshot(self, like: Any) -> Any:
        """The parameters as one flat row, laid out as ``like`` (on the accelerator)."""
        import jax
        import jax.numpy as jnp

        flat = jnp.concatenate([self.params["w1"].ravel(), self.params["w2"].ravel()])
        return jax.device_put(flat[None], like.sharding)  # this host's row, on its accelerator


@cb.colocated_python
def make_batch(seed: Any) -> Any:
    """A batch of a fixed teacher task, made on this host's CPU device."""
    import jax

    s = int(np.asarray(seed).ravel()[0])
    rng = np.random.default_rng(s)
    teacher = np.random.default_rng(1234).normal(size=(WIDTH, WIDTH)).astype(np.float32)
    x = rng.normal(size=(BATCH, WIDTH)).astype(np.float32)
    y = np.tanh(x @ teacher / WIDTH ** 0.5)
    # this host's row of (hosts, BATCH, WIDTH) arrays, on its CPU device
    return jax.device_put(x[None], seed.sharding), jax.device_put(y[None], seed.sharding)


@cb.colocated_python_class
class Checkpoints:
    """Writes parameters with numpy on this host (on its CPU device)."""

    def __init__(self, where: str) -> None:
        self.where = where

    def save(self, flat: Any, step: Any) -> Any:
        n = int(np.asarray(step).ravel()[0])
        path = os.path.join(self.where, f"host{cb.host_index()}-step{n}.npy")
        np.save(path, np.asarray(flat))
        return np.asarray([n], np.int32)


async def train(steps: int, every: int, where: str) -> dict[str, Any]:
    devices = cb.devices()
    accels = [d for d in devices if d.platform != "cpu"]
    hosts = sorted({d.host for d in devices})
    # each host's first accelerator (its first CPU device where it has none)
    first = [min((d for d in devices if d.host == h), key=lambda d: d.platform == "cpu")
             for h in hosts]
    cpus = cb.colocated_cpu_devices(first)
    kind = first[0].platform
    print(f"training on {len(hosts)} host(s): "
          + ", ".join(f"{d.platform}:{d.id} ({d.device_kind})" for d in first)
          + ("" if accels else " -- no accelerator here: CPU devices stand in"), flush=True)

    mesh = cb.Mesh(np.array(first, dtype=object), ("hosts",))
    cpu_mesh = cb.Mesh(np.array(cpus, dtype=object), ("hosts",))
    on_cpu = cb.NamedSharding(cpu_mesh, cb.PartitionSpec("hosts"))
    model: Any = Model(0)
    model.snapshot = model.snapshot.specialize(devices=first)
    ckpt: Any = Checkpoints(where)
    anchor = cb.device_put(np.zeros(len(first), np.float32),
                           cb.NamedSharding(mesh, cb.PartitionSpec("hosts")))

    def seeds(step: int) -> Any:
        return cb.device_put(np.arange(len(cpus), dtype=np.int32) * 100003 + step, on_cpu)

    saving: asyncio.Task[Any] | None = None
    saves = 0
    losses = []
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        batch = make_batch(seeds(step))  # a future: the step takes it as it is
        loss = model.step(batch)  # dispatched; not awaited
        losses.append(loss)
        if every and step % every == 0:
            if saving is not None:
                await saving
            flat = cb.device_put(await model.snapshot(anchor), on_cpu)  # to the CPU device
            steps_arr = cb.device_put(np.full(len(cpus), step, np.int32), on_cpu)
            saving = asyncio.ensure_future(ckpt.save(flat, steps_arr))
            saves += 1
    # the accelerators are done, not only dispatched (the wait leaves behind the call)
    last = await cb.block_until_ready(losses[-1])
    seconds = time.perf_counter() - t0
    if saving is not None:
        await saving
    first_loss = float(np.asarray(await cb.device_get(await losses[0])).mean())
    last_loss = float(np.asarray(await cb.device_get(last)).mean())
    await cb.aclose(model)
    await cb.aclose(ckpt)
    return {"platform": kind, "hosts": len(hosts), "steps": steps, "seconds": seconds,
            "first_loss": first_loss, "last_loss": last_loss, "saves": saves}


async def _main(args: argparse.Namespace) -> int:
    where = args.checkpoint_dir or tempfile.mkdtemp(prefix="colobus-ckpt-")
    async with cb.local_cluster(hosts=args.hosts):
        r = await train(args.steps, args.checkpoint_every, where)
    print(f"{r['steps']} steps on {r['hosts']} host(s) ({r['platform']}) in {r['seconds']:.2f} s "
          f"({r['steps'] / r['seconds']:.1f} steps/s, waited with block_until_ready); loss "
          f"{r['first_loss']:.4f} -> {r['last_loss']:.4f}; {r['saves']} checkpoints in {where}",
          flush=True)
    return 0 if r["last_loss"] < r["first_loss"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--hosts", type=int, default=None,
                   help="local worker processes (default 2; under `colobus launch`, the "
                        "launched ones)")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--checkpoint-dir", default=None)
    return asyncio.run(_main(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
