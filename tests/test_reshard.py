"""Resharding, make_mesh, memory kinds and host identity, on real local clusters.

``cb.device_put(arr, sharding)`` of a ``cb.Array`` moves only the blocks each
host lacks (``docs/arrays.md``, "Resharding"); these tests check the values
against numpy, the bytes the controller moved (``ctl.stats()``), what each host
holds afterwards, and that a host lost mid-way fails exactly that operation.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import colobus as cb

P = cb.PartitionSpec


# -- make_mesh ------------------------------------------------------------------------------


def test_make_mesh_takes_devices_in_order(ctl: cb.Controller) -> None:
    mesh = cb.make_mesh((2, 4), ("hosts", "devices"))
    assert mesh.axis_names == ("hosts", "devices")
    assert mesh.device_ids.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    small = cb.make_mesh((3,), ("x",), devices=cb.devices()[::-1])
    assert small.device_ids.tolist() == [7, 6, 5]
    assert cb.make_mesh([2, 2], ["a", "b"], devices=cb.devices()[4:]).device_ids.tolist() == [
        [4, 5], [6, 7]]


@pytest.mark.parametrize("args", [((4, 3), ("x", "y")), ((2, 2), ("x",)),
                                  (("a", 2), ("x", "y")), ((16,), ("x",))])
def test_make_mesh_errors_are_jax_s(ctl: cb.Controller, args: tuple[Any, Any]) -> None:
    """The same ValueError texts as the installed jax.make_mesh (8 CPU devices here too)."""
    assert len(jax.devices()) == len(cb.devices()) == 8
    with pytest.raises(ValueError) as theirs:
        jax.make_mesh(*args)
    with pytest.raises(ValueError) as ours:
        cb.make_mesh(*args)
    assert str(ours.value) == str(theirs.value)


# -- memory kinds ---------------------------------------------------------------------------


def test_memory_kind_is_part_of_equality() -> None:
    from colobus._model.devices import Device

    devs = np.empty(2, dtype=object)
    devs[:] = [Device(0, 0, "cpu", "cpu", 0), Device(1, 0, "cpu", "cpu", 1)]
    mesh = cb.Mesh(devs, "x")
    plain = cb.NamedSharding(mesh, P("x"))
    host = cb.NamedSharding(mesh, P("x"), memory_kind="unpinned_host")
    assert plain.memory_kind is None and host.memory_kind == "unpinned_host"
    assert plain != host and hash(plain) != hash(host)
    # None is the default memory, "device", as JAX reads it
    assert plain == cb.NamedSharding(mesh, P("x"), memory_kind="device")
    assert hash(plain) == hash(cb.NamedSharding(mesh, P("x"), memory_kind="device"))
    one = cb.SingleDeviceSharding(devs[0], memory_kind="pinned_host")
    assert one.memory_kind == "pinned_host" and one != cb.SingleDeviceSharding(devs[0])
    assert "unpinned_host" in repr(host)
    import pickle

    assert pickle.loads(pickle.dumps(host)).memory_kind == "unpinned_host"
    with pytest.raises(TypeError):
        cb.NamedSharding(mesh, P(), memory_kind=3)  # type: ignore[arg-type]


@cb.colocated_python
def _memory_kinds(x: Any, sharding: Any) -> Any:
    import jax.numpy as jnp

    kinds = {x.sharding.memory_kind, sharding.memory_kind}
    assert kinds == {"unpinned_host"}, kinds
    return jax.device_put(jnp.asarray(x), x.sharding)


def test_memory_kind_reaches_host_code(ctl: cb.Controller) -> None:
    mesh = cb.make_mesh((2, 4), ("hosts", "devices"))
    sharding = cb.NamedSharding(mesh, P("hosts"), memory_kind="unpinned_host")
    x = np.arange(16.0, dtype=np.float32).reshape(8, 2)
    arr = cb.device_put(x, sharding)
    out = _memory_kinds(arr, sharding).result()
    assert out.sharding.memory_kind == "unpinned_host" and out.sharding == sharding
    np.testing.assert_array_equal(np.asarray(out), x)


# -- host identity --------------------------------------------------------------------------


def test_host_index_on_the_controller_raises() -> None:
    with pytest.raises(RuntimeError, match="host code"):
        cb.host_index()
    with pytest.raises(RuntimeError, match="host code"):
        cb.host_count()


@cb.colocated_python
def _write_host_file(x: Any, folder: str) -> Any:
    name = f"host-{cb.host_index()}-of-{cb.host_count()}-pid{jax.process_index()}.txt"
    Path(folder, name).write_text(str(np.asarray(x).sum()))
    return x


def test_one_file_per_host_named_by_host_index(ctl: cb.Controller, tmp_path: Path) -> None:
    mesh = cb.make_mesh((2, 4), ("hosts", "devices"))
    x = cb.device_put(np.arange(8.0, dtype=np.float32), cb.NamedSharding(mesh, P("hosts")))
    _write_host_file(x, str(tmp_path)).result()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "host-0-of-2-pid0.txt", "host-1-of-2-pid0.txt"]
    assert (tmp_path / "host-1-of-2-pid0.txt").read_text() == str(4.0 + 5 + 6 + 7)
