"""The training-loop idea as a plain script: no asyncio, JAX's habits.

``with cb.local_cluster(...)`` starts the controller on a thread of its own and
the workers as subprocesses; from this (ordinary) thread a colocated call returns
its outputs as ``cb.Array`` handles at once, as JAX's does, and using one
(``np.asarray``, ``cb.device_get``, ``block_until_ready``) waits for it.

    python examples/sync_script.py [--steps N] [--hosts N] [--devices N]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import colobus as cb


@cb.colocated_python_class
class Loader:
    """One per host: this host's rows of a regression task ``y = x @ w_true``."""

    def __init__(self, features: int) -> None:
        self.rng = np.random.default_rng()  # each host its own stream of data
        self.w_true = np.arange(1.0, features + 1, dtype=np.float32) / features

    def next_batch(self, like):
        import jax

        # ``like`` is this host's block of the parameters: its sharding tells the
        # loader which devices (and mesh) this host's rows belong on.
        mesh = like.sharding.mesh
        x = self.rng.normal(size=(32 * mesh.size, self.w_true.size)).astype(np.float32)
        y = x @ self.w_true
        rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("hosts", "devices")))
        return jax.device_put(x, rows), jax.device_put(y, rows)


@cb.colocated_python
def host_step(w, x, y, lr):
    """On each host: one SGD step on this host's rows only (local SGD)."""
    import jax
    import jax.numpy as jnp

    def loss(w):
        return jnp.mean((x @ w[0] - y) ** 2)

    value, grad = jax.value_and_grad(loss)(w)
    # w is this host's row of a (hosts, features) array: one model replica per host.
    return jax.device_put(w - lr * grad, w.sharding), jax.device_put(value[None], w.sharding)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--hosts", type=int, default=None,
                        help="hosts (default 2; under `colobus launch`, the launched ones)")
    parser.add_argument("--devices", type=int, default=None,
                        help="CPU devices per host (default 1; under `colobus launch`, its "
                             "--devices)")
    args = parser.parse_args(argv)
    features = 8

    # The block view, chosen: each host trains its own replica on its own rows (local
    # SGD), a per-host program; the default view (one JAX job) would make w global.
    # Given no size, local_cluster picks its own, or serves the workers `colobus launch`
    # started: the script takes the size of the cluster it gets.
    with cb.local_cluster(hosts=args.hosts, devices_per_host=args.devices,
                          jax_distributed=False) as ctl:
        hosts = len(ctl.hosts())
        mesh = cb.Mesh(np.array(cb.devices()).reshape(hosts, -1), ("hosts", "devices"))
        per_host = cb.NamedSharding(mesh, cb.PartitionSpec("hosts"))
        w = cb.device_put(np.zeros((hosts, features), np.float32), per_host)
        loader = Loader(features)
        for step in range(1, args.steps + 1):
            x, y = loader.next_batch(w)  # the arrays at once; the hosts hand them on
            w, loss = host_step(w, x, y, 0.2)
            if step % 10 == 0 or step == args.steps:
                # Model averaging through the controller: fetch every replica
                # (blocking np.asarray), average, and upload the mean to all hosts.
                replicas = np.asarray(w)
                w = cb.device_put(np.broadcast_to(replicas.mean(0), replicas.shape).copy(),
                                  per_host)
                losses = ", ".join(f"{v:.4f}" for v in np.asarray(loss))
                print(f"step {step}: loss per host [{losses}], replicas averaged")
        final = cb.device_get(w)[0]
        cb.close(loader)

    w_true = np.arange(1.0, features + 1, dtype=np.float32) / features
    error = float(np.abs(final - w_true).max())
    print(f"done: max |w - w_true| = {error:.4f}")
    return 0 if error < 0.1 else 1


if __name__ == "__main__":
    sys.exit(main())
