"""Host-side helpers of tests/test_hostview.py and tests/test_jaxjob.py.

Importable on the workers (they inherit ``sys.path``): functions here travel by
reference, and this module is imported on each host after the worker set JAX up, as
a user's module is. It names JAX's process functions in the three forms user code
writes them.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax import process_count, process_index

import colobus as cb


@cb.colocated_python
def process_numbers(x: Any) -> Any:
    """Per device of this host: [jax.process_index(), jax.process_count(), the names
    imported with ``from jax import``, cb.host_index(), cb.host_count(),
    len(jax.process_indices())], as this host's part of an (n, 7) array laid out as ``x`` (1-D)."""
    row = [jax.process_index(), jax.process_count(), process_index(), process_count(),
           cb.host_index(), cb.host_count(), len(jax.process_indices())]

    def rows(index: Any) -> np.ndarray:
        return np.array([row] * len(range(*index[0].indices(x.shape[0]))), dtype=np.int32)

    return jax.make_array_from_callback((x.shape[0], len(row)), x.sharding, rows)


# -- a JAX job (tests/test_jaxjob.py) ----------------------------------------------------


def _replicated(mesh: Any) -> Any:
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


@cb.colocated_python
def global_view(x: Any) -> Any:
    """What host code sees of ``x``, the same on every host, as a replicated int array:
    [global length, fully addressable, jax.process_count(), len(jax.devices())], then
    [JAX device id, process index] for each device of its mesh, in mesh order."""
    rows = [[x.shape[0], int(x.is_fully_addressable), jax.process_count(), len(jax.devices())]]
    rows += [[d.id, d.process_index, 0, 0] for d in x.sharding.mesh.devices.flat]
    return np.array(rows, dtype=np.int32)


@cb.colocated_python
def my_shards(x: Any) -> Any:
    """Per device of the 1-D x's mesh, [JAX device id, start, stop] of its shard of the
    global x, each host giving its own devices' rows: an (n devices, 3) array."""
    pieces = [jax.device_put(np.array([[s.device.id, s.index[0].start or 0,
                                        s.index[0].stop or x.shape[0]]], dtype=np.int32),
                             s.device) for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays((x.sharding.mesh.size, 3), x.sharding,
                                                    pieces)


@cb.colocated_python
def cross_host_sum(x: Any) -> Any:
    """A jitted sum over the global x: a collective across the hosts (gloo on CPU)."""
    assert jax.distributed.is_initialized()  # as after jax.distributed.initialize
    return jax.jit(lambda v: v.sum(), out_shardings=_replicated(x.sharding.mesh))(x)


@cb.colocated_python
def psum_shard_map(x: Any) -> Any:
    """``jax.lax.psum`` across every device of the job, in shard_map."""
    from jax.experimental.shard_map import shard_map

    mesh = x.sharding.mesh
    f = shard_map(lambda v: jax.lax.psum(v, mesh.axis_names), mesh=mesh,
                  in_specs=x.sharding.spec, out_specs=x.sharding.spec)
    return jax.jit(f)(x)


@cb.colocated_python
def plus_one_global(x: Any) -> Any:
    """JAX's multiprocess test body: a global array from this host's pieces."""
    return jax.make_array_from_single_device_arrays(
        x.shape, x.sharding, [s.data + 1 for s in x.addressable_shards])


@cb.colocated_python
def block_output(x: Any) -> Any:
    """The block model's output form, in a job: this host's block (of a 1-D x sharded
    over every device), times 10, over the host's part of the mesh."""
    local = x.sharding.mesh.local_mesh
    shards = [s.data * 10 for s in x.addressable_shards]
    size = sum(s.shape[0] for s in shards)
    return jax.make_array_from_single_device_arrays(
        (size,), jax.sharding.NamedSharding(local, x.sharding.spec), shards)


@cb.colocated_python
def devices_seen(x: Any, devices: Any) -> Any:
    """The colobus devices ``devices`` as they arrive: [JAX id, process index] each."""
    return np.array([[d.id, d.process_index] for d in devices], dtype=np.int32)


@cb.colocated_python
def wait_or_collect(x: Any, folder: str) -> Any:
    """Host 1 says it started, then waits for a file that never comes (it is killed);
    the others enter a collective with it."""
    import os
    import time

    if jax.process_index() == 1:
        open(os.path.join(folder, "started"), "w").close()
        while not os.path.exists(os.path.join(folder, "never")):
            time.sleep(0.01)
    return jax.jit(lambda v: v.sum(), out_shardings=_replicated(x.sharding.mesh))(x)


@cb.colocated_python
def wait_for_file(x: Any, path: str) -> Any:
    """Wait until ``path`` exists (a call that stays in flight on its host)."""
    import os
    import time

    while not os.path.exists(path):
        time.sleep(0.01)
    return x


@cb.colocated_python
def on_a_mesh_of_its_own(x: Any) -> Any:
    """A global output over a 2x2 mesh host code makes of the job's 4 devices."""
    devices = np.array(x.sharding.mesh.devices).reshape(2, 2)
    mesh = jax.sharding.Mesh(devices, ("a", "b"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b"))
    whole = np.arange(24, dtype=np.float32).reshape(4, 6)
    return jax.make_array_from_callback((4, 6), sharding, lambda index: whole[index])
