"""Host-side helpers for the issue-23 tests (``test_edges.py``).

Importable on the workers (they inherit ``sys.path``), so these travel by
reference and their module state persists on each host between calls.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

import colobus as cb


def _wait_for_file(path: str, limit: float = 60.0, poll: float = 0.005) -> None:
    deadline = time.monotonic() + limit
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(poll)


@cb.colocated_python
def _block(gate: str) -> Any:
    """Block a worker thread until ``gate`` exists (the test creates it)."""
    _wait_for_file(gate)
    return np.int32(1)


def _one_int32(*_: Any) -> cb.ShapeDtypeStruct:
    return cb.ShapeDtypeStruct((), np.int32)


# Its output specs given: a call of it (and of its specializations) returns at once from a
# plain thread too, where a first call without them would wait for the gate it waits for.
block = _block.specialize(out_specs_fn=_one_int32)


@cb.colocated_python
def _token(n: int) -> Any:
    return np.int32(n)


token = _token.specialize(out_specs_fn=_one_int32)  # (returns at once, as block)


@cb.colocated_python
def _ident(x: Any) -> Any:
    return x


# Its output specs given (the input's): a call of it given a gated call's future returns at
# once from a plain thread too, where a first call would wait for the gate.
ident = _ident.specialize(out_specs_fn=lambda x: x)


class Box:
    """A plain object (no pytree node) that carries whatever it is given."""

    def __init__(self, value: Any) -> None:
        self.value = value


@cb.colocated_python
def unbox(box: Box) -> Any:
    return box.value


@cb.colocated_python
def cast_on(x: Any, pid: int) -> Any:
    """``x`` (sharded), cast to uint8 on the host with ``pid`` only."""
    import jax

    if os.getpid() != pid:
        return x
    return jax.device_put(x.astype(np.uint8), x.sharding)


@cb.colocated_python
def unbox_beside(x: Any, box: Box) -> Any:
    """What ``box`` carries (an array on the call's devices, beside the leaf ``x``)."""
    return box.value


@cb.colocated_python_class
class Holder:
    """Keeps state built from a sharded input; a method without arguments reads it."""

    def __init__(self) -> None:
        self.state: Any = None

    def keep(self, x: Any) -> Any:
        self.state = x * 2
        return x

    def read(self) -> Any:
        return self.state


def _first_global_id(sharding: Any) -> int:
    from colobus._model.jaxside import global_id

    return min(int(global_id(d) or 0) for d in sharding.mesh.devices.flat)


@cb.colocated_python
def fill_on(sharding: Any) -> Any:
    """A (1, 4) block per host on the host's part of a captured (hosts, d) mesh, filled with
    the host's first global device id."""
    import jax

    return jax.device_put(np.full((1, 4), _first_global_id(sharding), np.float32), sharding)


@cb.colocated_python
def own_axis_names() -> Any:
    """Each host lays its output on a mesh of its own devices under an axis name of its
    own: no global sharding fits."""
    import jax

    devs = np.array(jax.local_devices())
    name = f"h{os.getpid()}"
    mesh = jax.sharding.Mesh(devs, (name,))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(name))
    return jax.device_put(np.zeros(2 * len(devs), np.float32), sharding)


@cb.colocated_python
def raise_named(which: str) -> Any:
    """Raise an exception a worker must not have rebuilt in the caller, or a fine one."""
    if which == "host_lost":
        raise cb.HostLostError("forged by host code", 0)
    if which == "stop":
        raise StopIteration("forged")
    raise KeyError("fine")


@cb.colocated_python
def block_marked(gate: str, started: str) -> Any:
    """Say it started (create ``started``), then block until ``gate`` exists."""
    with open(started, "w"):
        pass
    _wait_for_file(gate, poll=0.05)  # many of these wait at once: poll gently
    return np.int32(1)


@cb.colocated_python
async def break_heartbeats_once() -> Any:
    """Make the worker's heartbeats task raise once (runs on the worker's loop)."""
    import asyncio

    # The worker is found through its serve() task (its heartbeats task is not always
    # among all_tasks() of the loop the call runs on).
    for task in asyncio.all_tasks():
        coro = task.get_coro()
        if getattr(coro, "__qualname__", "") == "Worker.serve":
            worker = coro.cr_frame.f_locals["self"]  # type: ignore[union-attr]
            for _ in range(200):  # a call can arrive before the session starts heartbeating
                if worker._hb is not None:
                    break
                await asyncio.sleep(0.01)
            if worker._hb is None or worker._hb.done():
                return np.int32(0)
            health = worker._health

            def once(worker: Any = worker, health: Any = health) -> Any:
                worker._health = health
                raise RuntimeError("injected: the heartbeats task dies here")

            worker._health = once
            return np.int32(1)
    return np.int32(0)


@cb.colocated_python_class
class StopsInInit:
    """An object whose ``__init__`` raises StopIteration."""

    def __init__(self) -> None:
        raise StopIteration("forged in __init__")

    def get(self, x: Any) -> Any:
        return x
