"""Device-model objects that cross to a host arrive there as the host's JAX objects.

On the controller a ``cb.Device``, ``Mesh``, ``NamedSharding``,
``SingleDeviceSharding`` or ``ShapeDtypeStruct`` is a colobus object. When one
travels to a host inside pickled code (a closure, a default argument, a class
attribute) or arguments (also a colocated class's constructor arguments,
nested in any container), the host-bound picklers use :data:`HOST_REDUCERS`:
each object pickles as plain data (global device ids, shapes, names, the spec)
plus a call to :func:`localize`, which the host runs while unpickling. The
controller's own objects and other pickles are unchanged.

What each becomes on the host whose devices it uses (JAX's multi-controller
view, where a host addresses only its own devices):

* ``Device`` -> the host's ``jax.Device`` with that global id.
* ``Mesh`` -> a ``jax.sharding.Mesh`` of the host's *sub-mesh*: the host's
  devices at their mesh positions, with the same axis names (the mesh a host's
  block of an array over this mesh is laid out on).
* ``NamedSharding(mesh, spec)`` -> ``jax.sharding.NamedSharding`` of the same
  spec over that sub-mesh; ``SingleDeviceSharding(d)`` -> JAX's, on ``d``; both
  with the same ``memory_kind`` (JAX raises its own ``ValueError`` where the
  host's devices have no memory of that kind).
* ``ShapeDtypeStruct(shape, dtype, sharding)`` -> ``jax.ShapeDtypeStruct``
  with the shape of the host's block and the host's sharding (the spec an
  array argument of that layout arrives with).

In a JAX job (``jax_distributed``: :func:`install_job`), every host addresses the
whole job's devices as JAX's multi-controller view has them: a ``Device`` becomes the
job's ``jax.Device`` with that global id (another host's too: a non-addressable
device, as in multi-controller JAX), a ``Mesh`` the *whole* mesh over them, a
sharding the sharding over that mesh, and a ``ShapeDtypeStruct`` keeps its global
shape.

Otherwise, an object that uses no device of the host (a device of another host, a
mesh of other hosts' devices, a sharding or spec over them) arrives *as the colobus
object*, the host's stand-in for a device it cannot address: it keeps ``id``,
``process_index``, ``platform`` and the layout, and JAX functions reject it
with their own error, as they reject a non-addressable device. A mesh in which
the host's devices do not form a sub-box raises ``ValueError`` while the call's
code or arguments are unpickled on that host (the call fails with it).

Outside a worker (no devices installed) :func:`localize` rebuilds the colobus
object, so these pickles also load in a plain process.
"""

from __future__ import annotations

import copyreg
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .blocks import host_blocks
from .devices import Device, Mesh, jax_axis_types
from .sharding import NamedSharding, ShapeDtypeStruct, SingleDeviceSharding

__all__ = [
    "HOST_REDUCERS", "global_id", "host_count", "host_index", "in_job", "install", "install_job",
    "is_key_array", "localize", "set_host_count", "std_dispatch_table",
]

_DeviceRaw = tuple[int, int, str, str, int]

_lock = threading.Lock()
_host: int | None = None
_host_count = 0  # the cluster's host count as the last WELCOME or CALL told it
_devices: dict[int, Any] = {}  # global id -> this host's jax.Device
_ids: dict[Any, int] = {}  # this host's jax.Device -> global id
_meshes: dict[Any, Any] = {}  # raw mesh -> jax Mesh (one object per layout: cheap ==)
_job = False  # this host is a process of the cluster's JAX job (install_job)
# In the block view, the host's sharding of each ShapeDtypeStruct that arrived as this
# host's block of it: id(sharding) -> (sharding, block shape, global shape), so that host
# code building the global shape over it is told (colobus._host.viewguard)
block_structs: dict[int, tuple[Any, tuple[int, ...], tuple[int, ...]]] = {}


def install(host: int, devices: Mapping[int, Any], count: int = 0) -> None:
    """Worker, on WELCOME: this host's index, its ``jax.Device`` per global id, and the
    cluster's host count (the block model: only this host's devices)."""
    global _host, _host_count, _job
    with _lock:
        _host = host
        _host_count = max(count, host + 1)
        _job = False
        _devices.clear()
        block_structs.clear()
        _devices.update(devices)
        _ids.clear()
        _ids.update({d: i for i, d in devices.items()})
        _meshes.clear()


def install_job(host: int, devices: Mapping[int, Any], count: int) -> None:
    """Worker, once the cluster's JAX job formed: every host's device, as the job's
    ``jax.Device`` per global id (the multi-controller view)."""
    install(host, devices, count)
    global _job
    _job = True


def in_job() -> bool:
    """Whether this host is a process of the cluster's JAX job."""
    return _job


def set_host_count(count: int) -> None:
    """Worker, on each CALL: the cluster's host count as the controller knows it now."""
    global _host_count
    if count > 0:
        _host_count = count


def _where() -> str:
    return ("cb.host_index() and cb.host_count() work in host code (inside a function "
            "decorated with @cb.colocated_python or a method of a @cb.colocated_python_class), "
            "not on the controller: there, use the hosts of an array (arr.sharding.device_set, "
            "Device.host) or len(ctl.hosts())")


def host_index() -> int:
    """In host code, the colobus index of this host (0, 1, ... in join order).

    ``jax.process_index()`` answers the same there (see ``colobus._host.jaxnames``).

    Raises:
        RuntimeError: outside host code (on the controller).
    """
    if _host is None:
        raise RuntimeError(_where())
    return _host


def host_count() -> int:
    """In host code, the cluster's host count: the controller's ``hosts=N``, or more
    where hosts beyond it joined (every host index is below it).

    It reaches the host in its WELCOME and again with every call, so it is current
    as of the call that runs.

    Raises:
        RuntimeError: outside host code (on the controller).
    """
    if _host is None:
        raise RuntimeError(_where())
    return _host_count


def global_id(device: Any) -> int | None:
    """The global id of one of this host's ``jax.Device``s (None if it is not one)."""
    return _ids.get(device)


# -- controller side: what the host-bound picklers write ------------------------------------


def _device_raw(d: Device) -> _DeviceRaw:
    return (d.id, d.host, d.platform, d.device_kind, d.local_id)


def _mesh_raw(m: Mesh) -> tuple[Any, ...]:
    raw = (tuple(_device_raw(d) for d in m.devices.flat), m.devices.shape, m.axis_names)
    return (*raw, m.axis_type_names) if m.has_axis_types else raw


def _sharding_raw(s: Any) -> tuple[str, Any] | None:
    if isinstance(s, NamedSharding):
        return ("named", (_mesh_raw(s.mesh), s.spec, s.memory_kind))
    if isinstance(s, SingleDeviceSharding):
        return ("single", (*_device_raw(s.device), s.memory_kind))
    return None


def _reduce_device(d: Device) -> tuple[Any, ...]:
    return (localize, ("device", _device_raw(d)))


def _reduce_mesh(m: Mesh) -> tuple[Any, ...]:
    return (localize, ("mesh", _mesh_raw(m)))


def _reduce_sharding(s: Any) -> tuple[Any, ...]:
    return (localize, _sharding_raw(s))


def _reduce_sds(s: ShapeDtypeStruct) -> tuple[Any, ...]:
    raw = None if s.sharding is None else _sharding_raw(s.sharding)
    return (localize, ("sds", (s.shape, s.dtype, raw)))


HOST_REDUCERS: dict[type, Callable[[Any], tuple[Any, ...]]] = {
    Device: _reduce_device,
    Mesh: _reduce_mesh,
    NamedSharding: _reduce_sharding,
    SingleDeviceSharding: _reduce_sharding,
    ShapeDtypeStruct: _reduce_sds,
}
"""``dispatch_table`` entries for picklers whose output a host unpickles."""

_std_table: tuple[int, dict[Any, Any]] = (-1, {})


def std_dispatch_table() -> dict[Any, Any]:
    """``copyreg``'s table plus :data:`HOST_REDUCERS`, as a plain dict.

    A plain dict, not a ``ChainMap``: the C pickler looks it up in C for every
    object it reduces. Rebuilt when ``copyreg`` gains an entry.
    """
    global _std_table
    n, table = _std_table
    if n != len(copyreg.dispatch_table):
        table = {**copyreg.dispatch_table, **HOST_REDUCERS}
        _std_table = (len(copyreg.dispatch_table), table)
    return table


# -- host side: rebuilding ---------------------------------------------------------------------


def _device(raw: _DeviceRaw) -> Device:
    return Device(*raw)


def _mesh(raw: tuple[Any, ...]) -> Mesh:
    devs, shape, names = raw[:3]
    arr = np.empty(len(devs), dtype=object)
    arr[:] = [_device(r) for r in devs]
    return Mesh(arr.reshape(shape), names, raw[3] if len(raw) > 3 else None)


def _sharding(raw: tuple[str, Any]) -> Any:
    kind, body = raw
    if kind == "named":
        return NamedSharding(_mesh(body[0]), body[1], memory_kind=body[2])
    return SingleDeviceSharding(_device(body[:5]), memory_kind=body[5])


def localize(kind: str, raw: Any) -> Any:
    """Rebuild a device-model object from its plain description, as this host sees it."""
    if kind == "device":
        return _local_device(_device(raw))
    if kind == "mesh":
        return _local_mesh(_mesh(raw))
    if kind in ("named", "single"):
        return _local_sharding(_sharding((kind, raw)))
    if kind == "sds":
        shape, dtype, sraw = raw
        return _local_sds(ShapeDtypeStruct(shape, dtype, None if sraw is None else _sharding(sraw)))
    raise ValueError(f"unknown device-model object {kind!r}")


def _mine(d: Device) -> Any:
    """This host's ``jax.Device`` for ``d``, or None (another host's, or not a worker);
    in a JAX job, the job's device whatever its host."""
    if _host is None or (d.host != _host and not _job):
        return None
    return _devices.get(d.id)


def _local_device(d: Device) -> Any:
    local = _mine(d)
    return d if local is None else local


def _local_mesh(m: Mesh) -> Any:
    import jax

    key = (tuple(d.id for d in m.devices.flat), m.devices.shape, m.axis_names,
           m.axis_type_names)
    with _lock:
        found = _meshes.get(key)
    if found is not None:
        return found
    positions = [pos for pos, d in np.ndenumerate(m.devices) if _mine(d) is not None]
    if not positions:
        return m  # no device here: the colobus mesh is the stand-in
    coords = tuple(sorted({p[a] for p in positions}) for a in range(m.devices.ndim))
    sub = m.devices[np.ix_(*coords)]
    if sub.size != len(positions):
        raise ValueError(
            f"The devices of host {_host} do not form a sub-box of {m!r} (they sit at mesh "
            f"positions {sorted(positions)}), so the mesh has no local view on this host. "
            "colobus needs each host's devices to be the product of one set of positions "
            "per mesh axis.")
    local = np.vectorize(_mine, otypes=[object])(sub)
    if m.has_axis_types:
        mesh = jax.sharding.Mesh(local, m.axis_names,
                                 axis_types=jax_axis_types(jax, m.axis_type_names))
    else:
        mesh = jax.sharding.Mesh(local, m.axis_names)
    with _lock:
        if len(_meshes) > 256:
            _meshes.clear()
        _meshes[key] = mesh
    return mesh


def _local_sharding(s: Any) -> Any:
    import jax

    if isinstance(s, SingleDeviceSharding):
        local = _mine(s.device)
        return s if local is None else jax.sharding.SingleDeviceSharding(
            local, memory_kind=s.memory_kind)
    mesh = _local_mesh(s.mesh)
    if isinstance(mesh, Mesh):
        return s
    return jax.sharding.NamedSharding(mesh, s.spec, memory_kind=s.memory_kind)


def _local_sds(s: ShapeDtypeStruct) -> Any:
    import jax

    if s.sharding is None:
        return jax.ShapeDtypeStruct(s.shape, s.dtype)
    local = _local_sharding(s.sharding)
    if local is s.sharding:
        return s  # no device of this host
    if _job:
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=local)  # the global view
    try:
        shape = host_blocks(s.sharding, s.shape)[_host].shape  # type: ignore[index]
    except (ValueError, KeyError):
        shape = s.shape  # the shape does not split over the layout: keep it whole
    if tuple(shape) != tuple(s.shape):
        with _lock:
            if len(block_structs) > 256:
                block_structs.clear()
            block_structs[id(local)] = (local, tuple(shape), tuple(s.shape))
    return jax.ShapeDtypeStruct(shape, s.dtype, sharding=local)


def is_key_array(x: Any) -> bool:
    """True for a JAX typed PRNG key array (``jax.random.key``)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or isinstance(dtype, np.dtype):
        return False
    import jax
    import jax.numpy as jnp

    return bool(jnp.issubdtype(dtype, jax.dtypes.prng_key))
