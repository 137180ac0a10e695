"""Host code's view in the block model: JAX's process functions answer colobus's.

Each host is a JAX process of its own, yet ``jax.process_index()`` and
``jax.process_count()`` in host code are the host's colobus index and the cluster's
host count, in every form user code names them (``docs/arrays.md``, "Host code's
view"); the controller's JAX is untouched. The hosts' JAX itself still sees one
process: host code works with its own devices as before.
"""

from __future__ import annotations

import jax
import numpy as np
from hostview_hostside import process_numbers
from jax import process_index

import colobus as cb

P = cb.PartitionSpec


def test_process_index_and_count_are_the_hosts(ctl: cb.Controller) -> None:
    mesh = cb.make_mesh((8,), ("x",))
    x = cb.device_put(np.zeros(8, np.float32), cb.NamedSharding(mesh, P("x")))
    got = np.asarray(process_numbers(x))
    assert got.shape == (8, 7)
    # host 0 holds devices 0-3, host 1 devices 4-7: every name says so, and count 2
    np.testing.assert_array_equal(got[:4], [[0, 2, 0, 2, 0, 2, 2]] * 4)
    np.testing.assert_array_equal(got[4:], [[1, 2, 1, 2, 1, 2, 2]] * 4)


def test_a_function_pickled_by_value_sees_them_too(ctl: cb.Controller) -> None:
    mesh = cb.make_mesh((2, 4), ("hosts", "devices"))
    x = cb.device_put(np.zeros(8, np.int32), cb.NamedSharding(mesh, P(("hosts", "devices"))))

    def which(x: jax.Array) -> jax.Array:  # a local function: cloudpickle, by value
        return x + 10 * process_index() + jax.process_count()

    y = np.asarray(cb.colocated_python(which)(x))
    np.testing.assert_array_equal(y, [2] * 4 + [12] * 4)


def test_the_controller_and_jax_itself_are_untouched(ctl: cb.Controller) -> None:
    # The controller's own JAX answers JAX's values; host code still has its devices.
    assert jax.process_index() == 0 and jax.process_count() == 1
    assert process_index is jax._src.xla_bridge.process_index

    @cb.colocated_python
    def local_count(x: jax.Array) -> jax.Array:
        # JAX's own view of the process: its devices are all local, its meshes too
        assert len(jax.local_devices()) == len(jax.devices()) == 4
        assert x.sharding.mesh.local_mesh.size == x.sharding.mesh.size == 4
        return x + len(x.addressable_shards)

    mesh = cb.make_mesh((2, 4), ("hosts", "devices"))
    x = cb.device_put(np.zeros(8, np.int32), cb.NamedSharding(mesh, P(("hosts", "devices"))))
    np.testing.assert_array_equal(np.asarray(local_count(x)), [4] * 8)
