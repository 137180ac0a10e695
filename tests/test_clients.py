"""Real clients of ``jax.experimental.colocated_python``, ported to colobus.

- maxtext's colocated data loader (``tests/maxtext_dataloading.py``: its
  ``RemoteIterator`` as maxtext wrote it, its ``RemoteIteratorWrapper`` ported) as a
  2-host JAX job: each host loads its own shard (``jax.process_index()`` picks it),
  ``get_next`` returns the global batch, and ``save_state`` / ``restore_state`` write
  and read one ``process_{i}-of-{n}.json`` per host;
- the cases of JAX's ``tests/multiprocess/colocated_python_test.py``, in the block
  model (the shared cluster) and in a JAX job (the shared job cluster): the host code
  as JAX's, the driver's JAX calls as colobus's (``docs/jax_comparison.md``).

They rely on JAX's habits as colobus keeps them (SPEC 3 and 5): a call returning its
arrays at once in plain code, ``addressable_data``, ``axis_types=`` on
``cb.make_mesh``, ``cb.device_get`` returning values in plain code, and the first call
of a method returning once its hosts ran it (maxtext's ``save_state`` drops its result
and expects the files written).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from maxtext_dataloading import RemoteIteratorWrapper

import colobus as cb

# -- maxtext's data loader, in a 2-host JAX job -----------------------------------------

ROWS = 4  # the global batch: 4 rows over the job's 4 CPU devices (2 per host)


def global_batch(step: int) -> np.ndarray:
    """Step ``step``'s global batch: host h's rows hold 100 * h + step."""
    return np.array([[step], [step], [100 + step], [100 + step]], dtype=np.int32)


class ShardIterator:
    """One host's shard of the data, with the state maxtext checkpoints."""

    def __init__(self, host: int, hosts: int) -> None:
        self.host, self.hosts, self.state = host, hosts, 0

    def __next__(self) -> np.ndarray:
        self.state += 1
        rows = ROWS // self.hosts
        return global_batch(self.state)[self.host * rows:(self.host + 1) * rows]

    def get_state(self) -> dict[str, int]:
        return {"state": self.state, "host": self.host}

    def set_state(self, state: dict[str, int]) -> None:
        assert state["host"] == self.host, (state, self.host)  # its own file
        self.state = state["state"]


class ShardLoader:
    def __init__(self, host: int, hosts: int) -> None:
        self.host, self.hosts = host, hosts

    def __iter__(self) -> ShardIterator:
        return ShardIterator(self.host, self.hosts)


def test_maxtext_remote_iterator_in_a_job(job: cb.Controller, tmp_path: Path) -> None:
    mesh = cb.make_mesh((ROWS,), ("data",))

    def get_ds_fn(dataloading_host_index: int, dataloading_host_count: int) -> Any:
        return ShardLoader(dataloading_host_index, dataloading_host_count)

    def preprocessing_fn(dataset: Any) -> Any:
        return dataset

    wrapper = RemoteIteratorWrapper(get_ds_fn=get_ds_fn, preprocessing_fn=preprocessing_fn,
                                    global_mesh=mesh, global_shape=(ROWS, 1),
                                    checkpoint_path=str(tmp_path), elastic=False)
    first = next(wrapper)
    # the global batch: every host's own shard, at its place
    assert isinstance(first, cb.Array) and first.shape == (ROWS, 1)
    np.testing.assert_array_equal(np.asarray(first), global_batch(1))
    assert np.asarray(first.addressable_data(0))[0] == 1

    wrapper.save_state(step=5)
    # its first call returned once the hosts ran it: the files are there
    files = [tmp_path / "5" / "iter" / f"process_{i}-of-2.json" for i in range(2)]
    assert sorted(p.name for p in (tmp_path / "5" / "iter").iterdir()) == [
        "process_0-of-2.json", "process_1-of-2.json"]
    for i, path in enumerate(files):
        assert json.loads(path.read_text()) == {"state": 1, "host": i}

    np.testing.assert_array_equal(np.asarray(next(wrapper)), global_batch(2))
    np.testing.assert_array_equal(np.asarray(next(wrapper)), global_batch(3))
    wrapper.restore_state(step=5)  # each host reads its own file: back to state 1
    np.testing.assert_array_equal(np.asarray(next(wrapper)), global_batch(2))


# -- JAX's tests/multiprocess/colocated_python_test.py, in both modes ---------------------
#
# Copyright 2025 The JAX Authors. Licensed under the Apache License, Version 2.0: the
# host code below is JAX's; the driver's JAX calls are colobus's (its controller cannot
# address the hosts' devices with JAX): jax.make_mesh -> cb.make_mesh,
# colocated_python -> cb, jax.device_put / jax.jit(identity, out_shardings=...) ->
# cb.device_put, jax.device_get -> cb.device_get, jax.device_count() -> len(cb.devices()).

def _make_mesh(shape: tuple[int, ...], names: tuple[str, ...], devices: Any = None) -> Any:
    return cb.make_mesh(shape, names, devices=devices,
                        axis_types=(jax.sharding.AxisType.Explicit,) * len(shape))


@pytest.fixture(params=["blocks", "job"])
def mode(request: pytest.FixtureRequest) -> cb.Controller:
    """The block model (the shared cluster) or a JAX job (the shared job cluster)."""
    ctl: cb.Controller = request.getfixturevalue("ctl" if request.param == "blocks" else "job")
    return ctl


def test_colocated_cpu_devices(mode: cb.Controller) -> None:
    device_count = len(cb.devices())
    if device_count % 2 == 0:
        mesh_shape = (2, device_count // 2)
    else:
        mesh_shape = (1, device_count)
    mesh = _make_mesh(mesh_shape, ("x", "y"))
    cpu_mesh1 = cb.colocated_cpu_devices(mesh)

    cpu_devices = cb.colocated_cpu_devices(mesh.devices.flat)
    cpu_mesh2 = _make_mesh(mesh_shape, ("x", "y"), devices=cpu_devices)
    assert cpu_mesh1 == cpu_mesh2


def test_simple_function(mode: cb.Controller) -> None:
    @cb.colocated_python
    def add_one(x: jax.Array) -> jax.Array:
        return jax.make_array_from_single_device_arrays(
            x.shape, x.sharding, [s.data + 1 for s in x.addressable_shards])

    mesh = _make_mesh((len(cb.devices()),), ("x",))
    cpu_mesh = cb.colocated_cpu_devices(mesh)
    cpu_sharding = cb.NamedSharding(cpu_mesh, cb.PartitionSpec("x"))

    x = np.arange(cpu_mesh.size)
    x = cb.device_put(x, cpu_sharding)

    out = add_one(x)

    out = cb.device_put(out, cb.NamedSharding(cpu_mesh, cb.PartitionSpec()))
    out = cb.device_get(out)

    np.testing.assert_equal(out, np.arange(cpu_mesh.size) + 1)
