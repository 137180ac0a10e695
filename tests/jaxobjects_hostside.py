"""Host code of ``tests/test_jax_objects.py``: the patterns of real JAX colocated-Python
clients, written as those clients write them (JAX's own calls only; importable on the
workers, which inherit ``sys.path``).

``CheckpointWorker`` follows orbax's multi-tier checkpointing worker
(``WorkerCheckpointManager``): a colocated object whose methods take a dummy array and
answer with a scalar laid out like it (each worker its own value), and whose method
``close(dummy)`` closes the worker's own manager.
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def scalar_like(value: Any, like: jax.Array, dtype: Any) -> jax.Array:
    """A scalar on ``like``'s sharding, replicated: every device holds ``value``."""
    sharding = jax.sharding.NamedSharding(like.sharding.mesh, jax.sharding.PartitionSpec())
    return jax.make_array_from_callback((), sharding, lambda _: np.asarray(value, dtype))


class CheckpointWorker:
    """One per host: the steps this host saved, a save in flight, and a close."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.steps: list[int] = []
        self.saving = False
        self.closed = False

    def save(self, step_array: jax.Array, only_host: int) -> jax.Array:
        """Save ``step`` here; with ``only_host`` >= 0, only that host saves (a save
        that reached one worker, as after a failure), and it stays "in progress"."""
        step = int(np.asarray(step_array.addressable_data(0)))
        saved = only_host < 0 or jax.process_index() == only_host
        if saved:
            self.steps.append(step)
            self.saving = only_host >= 0
        return scalar_like(saved, step_array, jnp.bool_)

    def latest_step(self, dummy: jax.Array) -> jax.Array:
        return scalar_like(max(self.steps, default=0), dummy, jnp.int32)

    def is_saving_in_progress(self, dummy: jax.Array) -> jax.Array:
        return scalar_like(self.saving, dummy, jnp.bool_)

    def close(self, dummy: jax.Array) -> jax.Array:
        """The user's own ``close``: it must be reachable as a method."""
        self.closed = True
        open(os.path.join(self.folder, f"closed-{jax.process_index()}"), "w").close()
        return scalar_like(True, dummy, jnp.bool_)


def slow_write(x: jax.Array, folder: str) -> jax.Array:
    """Sleep, then leave a file per host: a wait that returned early sees none."""
    time.sleep(0.3)
    open(os.path.join(folder, f"wrote-{jax.process_index()}"), "w").close()
    return x + 1


def pair(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return x, x * 2


def plus_one(x: jax.Array) -> jax.Array:
    return x + 1
