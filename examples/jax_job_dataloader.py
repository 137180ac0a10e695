"""A data loader in maxtext's colocated style, with the hosts as one JAX job.

The cluster's default view makes the hosts one JAX multi-controller job once they
joined (no option given): host code sees every host's devices and global arrays, as under Pathways or
any multi-host JAX program. Each host's loader (a colocated object) reads its own
shard of the data, picked by ``jax.process_index()``, and builds the global batch
from its local pieces with ``jax.make_array_from_single_device_arrays``; a training
step in host code, jitted over the global arrays, averages the gradient across the
hosts (XLA's collectives, gloo on CPU); the loader's state is checkpointed as one
``process_{i}-of-{n}.json`` per host and restored from it.

    python examples/jax_job_dataloader.py [--steps N] [--hosts N] [--devices N]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

import numpy as np

import colobus as cb

FEATURES = 4
ROWS_PER_DEVICE = 8


@cb.colocated_python_class
class ShardedLoader:
    """One per host: this host's shard of a regression task ``y = x @ w_true``."""

    def __init__(self, seed: int, checkpoint_dir: str) -> None:
        import jax

        # as maxtext does: the shard is the JAX process's (== the colobus host's)
        self.host, self.hosts = jax.process_index(), jax.process_count()
        self.rng = np.random.default_rng(seed + self.host)
        self.step = 0
        self.dir = pathlib.Path(checkpoint_dir)
        self.w_true = np.linspace(-1.0, 1.0, FEATURES, dtype=np.float32)

    def get_next(self, like):
        """The next global batch: this host's rows, on its devices, as a global array
        laid out as ``like`` (a global array over every host's devices)."""
        import jax

        self.step += 1
        devices = sorted(like.sharding.addressable_devices, key=lambda d: d.id)
        n = ROWS_PER_DEVICE * len(devices)
        x = self.rng.normal(size=(n, FEATURES)).astype(np.float32)
        y = x @ self.w_true
        rows = like.sharding.mesh.size * ROWS_PER_DEVICE

        def global_array(local, shape):
            pieces = [jax.device_put(local[k * ROWS_PER_DEVICE:(k + 1) * ROWS_PER_DEVICE], d)
                      for k, d in enumerate(devices)]  # each device's rows, on it
            return jax.make_array_from_single_device_arrays(shape, like.sharding, pieces)

        return (global_array(x, (rows, FEATURES)), global_array(y, (rows,)))

    def save_state(self, step):
        """One file per host, named by JAX's process index and count."""
        import jax

        name = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
        path = self.dir / str(int(step.addressable_data(0))) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"step": self.step, "rng": self.rng.bit_generator.state}))
        return step

    def restore_state(self, step):
        import jax

        name = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
        state = json.loads((self.dir / str(int(step.addressable_data(0))) / name).read_text())
        self.step = state["step"]
        self.rng.bit_generator.state = state["rng"]
        return step


@cb.colocated_python
def train_step(w, x, y):
    """Data-parallel SGD on the global batch: jitted over global arrays, the gradient's
    mean runs across every host's devices."""
    import jax
    import jax.numpy as jnp

    def loss(w, x, y):
        return jnp.mean((x @ w - y) ** 2)

    replicated = jax.sharding.NamedSharding(w.sharding.mesh, jax.sharding.PartitionSpec())

    @jax.jit  # (global arrays go in as arguments: JAX's rule in a multi-process job)
    def step(w, x, y):
        value, grad = jax.value_and_grad(loss)(w, x, y)
        return jax.lax.with_sharding_constraint(w - 0.3 * grad, replicated), value

    return step(w, x, y)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--hosts", type=int, default=None,
                        help="hosts (default 2; under `colobus launch`, the launched ones)")
    parser.add_argument("--devices", type=int, default=None,
                        help="CPU devices per host (default 1; under `colobus launch`, its "
                             "--devices)")
    args = parser.parse_args(argv)
    with (tempfile.TemporaryDirectory() as ckpt,
          cb.local_cluster(hosts=args.hosts, devices_per_host=args.devices) as ctl):
        print(f"{len(ctl.hosts())} hosts in one JAX job:",
              ctl.stats()["jax_job"]["state"], flush=True)
        mesh = cb.make_mesh((len(cb.devices()),), ("data",))
        rows = cb.NamedSharding(mesh, cb.PartitionSpec("data"))
        like = cb.device_put(np.zeros(mesh.size, np.float32), rows)
        w = cb.device_put(np.zeros(FEATURES, np.float32),
                          cb.NamedSharding(mesh, cb.PartitionSpec()))
        loader = ShardedLoader(0, ckpt)
        for step in range(1, args.steps + 1):
            x, y = loader.get_next(like)
            w, loss = train_step(w, x, y)
            if step == 1 or step % 10 == 0:
                print(f"step {step}: global batch {x.shape}, loss {float(np.asarray(loss)):.4f}",
                      flush=True)
        # checkpoint the loaders (one file per host), read a batch, restore, read it again
        at = cb.device_put(np.array(args.steps, np.int32),
                           cb.NamedSharding(mesh, cb.PartitionSpec()))
        loader.save_state(at).block_until_ready()  # (its first call waited anyway)
        files = sorted(p.name for p in pathlib.Path(ckpt, str(args.steps)).iterdir())
        print("checkpoint:", ", ".join(files), flush=True)
        after, _ = loader.get_next(like)
        loader.restore_state(at)
        again, _ = loader.get_next(like)
        same = np.array_equal(np.asarray(after), np.asarray(again))
        w_true = np.linspace(-1.0, 1.0, FEATURES, dtype=np.float32)
        print(f"done: max |w - w_true| = {np.abs(np.asarray(w) - w_true).max():.3f}; "
              f"restored batch equal: {same}", flush=True)
        cb.close(loader)
    return 0


if __name__ == "__main__":
    sys.exit(main())
