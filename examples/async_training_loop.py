"""Async data-parallel training, driven from one asyncio controller.

What it does, on every host at once:

* a colocated data loader (``Loader``, one instance per host) makes each host's
  batch, already split over that host's devices;
* a colocated step (``device_grads``) computes one loss and gradient per device
  with JAX, where the data is; the controller averages the gradients and every
  host applies the same update (``apply_update``), so the parameters stay on the
  hosts as a ``cb.Array`` from step to step;
* a colocated checkpoint writer (``CheckpointWriter``) saves the parameters with
  numpy on every host; saves are futures that training does not wait for, and
  the summary says how much of their time was hidden behind training.

Run it on an embedded local cluster (worker subprocesses on this machine)::

    python examples/async_training_loop.py --steps 40 --hosts 2 --devices 4

or as the driver of remote workers (see docs/deployment.md and docker-compose.yml)::

    colobus keygen colobus.key
    python examples/async_training_loop.py --bind tcp://0.0.0.0:5555 --hosts 3 \\
        --key-file colobus.key
    # on each host:
    colobus worker --connect tcp://DRIVER:5555 --devices 4 --key-file colobus.key

The code itself lives in the package, in ``colobus/_tools/demo.py``, so that
``colobus demo`` runs the very same loop from a plain ``pip install``; read it
there (it is written to be read top to bottom). The heart of it is this loop::

    loader = Loader(FEATURES, ROWS_PER_DEVICE)
    loader.next_batch = loader.next_batch.specialize(devices=devices)
    params = cb.device_put(np.zeros(FEATURES, np.float32),
                           cb.NamedSharding(mesh, cb.PartitionSpec()))
    for step in range(1, steps + 1):
        batch = loader.next_batch(step)                  # a future, passed on as is
        grads, losses = await device_grads(params, batch)
        g, loss = await cb.device_get((grads, losses))   # a few floats per device
        params = apply_update(params, g.mean(axis=0), LEARNING_RATE)
        if step % checkpoint_every == 0:
            await checkpoints.start(params, step)        # runs in the background
"""

from __future__ import annotations

import sys

from colobus._tools.demo import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
