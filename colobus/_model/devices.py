"""Devices and meshes: who the cluster's devices are and how they are arranged.

Pure data, no I/O. A :class:`Device` is compared, ordered and hashed by its
global id; a :class:`Mesh` is an N-dimensional array of them with a name per
axis. :func:`colocated_cpu_devices_from` follows JAX's
``colocated_cpu_devices``. Shardings over these are in :mod:`colobus._model.sharding`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

__all__ = ["AXIS_TYPES", "Device", "Mesh", "colocated_cpu_devices_from", "jax_axis_types",
           "make_mesh_from"]


# --------------------------------------------------------------------------- devices


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class Device:
    """One device of the cluster.

    Devices are compared, ordered and hashed by their global ``id`` only.

    Attributes:
        id: Global id, unique in the cluster.
        host: Index of the host (worker process) that owns the device.
        platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``.
        device_kind: The device kind as the worker's JAX reports it.
        local_id: Id of the matching ``jax.Device`` inside the worker process.
    """

    id: int
    host: int
    platform: str
    device_kind: str
    local_id: int

    @property
    def process_index(self) -> int:
        """The host index, under JAX's name."""
        return self.host

    def __repr__(self) -> str:
        return f"Device(id={self.id}, host={self.host}, platform={self.platform!r})"

    def __str__(self) -> str:
        # What JAX's own functions print of a value they refuse: whose device this is.
        return f"{self!r} (a colobus device: use cb.device_put with it, not jax.device_put)"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Device):
            return NotImplemented
        return self.id == other.id

    def __hash__(self) -> int:
        return hash(("colobus.Device", self.id))

    def __lt__(self, other: Device) -> bool:
        if not isinstance(other, Device):
            return NotImplemented
        return self.id < other.id

    def __le__(self, other: Device) -> bool:
        if not isinstance(other, Device):
            return NotImplemented
        return self.id <= other.id

    def __gt__(self, other: Device) -> bool:
        if not isinstance(other, Device):
            return NotImplemented
        return self.id > other.id

    def __ge__(self, other: Device) -> bool:
        if not isinstance(other, Device):
            return NotImplemented
        return self.id >= other.id


# --------------------------------------------------------------------------- mesh


def _object_array(items: Any) -> np.ndarray[Any, np.dtype[Any]]:
    """A fresh object ndarray from nested sequences (or an ndarray) of Devices."""
    return np.array(items, dtype=object)


AXIS_TYPES = ("Auto", "Explicit", "Manual")  # jax.sharding.AxisType's members, by name


def _axis_type_names(axis_types: Any, names: tuple[str, ...]) -> tuple[str, ...]:
    """JAX's ``_normalize_axis_types``, by name: None is Auto on every axis; one value
    stands for a tuple of it. Each is a ``jax.sharding.AxisType`` (or its name, for a
    JAX without them); JAX's errors."""
    if axis_types is None:
        return ("Auto",) * len(names)
    if not isinstance(axis_types, tuple | list):
        axis_types = (axis_types,)
    out = []
    for t in axis_types:
        name = t if isinstance(t, str) else getattr(t, "name", None)
        if name not in AXIS_TYPES or (not isinstance(t, str) and type(t).__name__ != "AxisType"):
            raise TypeError(
                "axis_types passed to Mesh must be of type `jax.sharding.AxisType`. Got "
                f"{tuple(axis_types)} of type {tuple(type(a) for a in axis_types)}")
        out.append(name)
    if len(out) != len(names):
        raise ValueError("Number of axis names should match the number of axis_types. Got "
                         f"axis_names={names} and axis_types={tuple(axis_types)}")
    return tuple(out)


def jax_axis_types(jax: Any, names: Sequence[str]) -> tuple[Any, ...]:
    """The ``jax.sharding.AxisType`` of each name, in this process's JAX.

    Raises:
        ValueError: this JAX has no axis types (``jax.sharding.AxisType`` came in 0.5.3;
            0.4.35 has none), or not one of these.
    """
    axis_type = getattr(jax.sharding, "AxisType", None)
    missing = [n for n in names if axis_type is None or n not in axis_type.__members__]
    if axis_type is None or missing:
        raise ValueError(
            f"this process's JAX {jax.__version__} has no mesh axis type "
            f"{(missing or list(names) or ['Auto'])[0]!r} "
            f"(jax.sharding.AxisType), so a mesh with axis_types={tuple(names)} cannot be "
            "built here: install JAX 0.5.3 or later where the mesh is used, or leave "
            "axis_types out (Auto on every axis)")
    return tuple(axis_type[n] for n in names)


class Mesh:
    """An N-dimensional array of devices with a name for each axis.

    Args:
        devices: An array-like (nested sequences or ndarray) of :class:`Device`.
        axis_names: One name per dimension of ``devices`` (a single string for
            a one-dimensional mesh).
        axis_types: JAX's: one ``jax.sharding.AxisType`` per axis (or one for all;
            or their names, ``"Auto"``, ``"Explicit"``, ``"Manual"``, where the
            controller's JAX has none); None: ``Auto`` on every axis. Kept, compared,
            and given to the meshes host code sees.

    Raises:
        ValueError: If the number of axis names is not ``devices.ndim``, the
            names are not unique, an element is not a ``Device``, a device
            appears twice, the mesh is empty, or the number of axis types is not
            the number of axes.
        TypeError: An axis type that is not a ``jax.sharding.AxisType``.
    """

    __slots__ = ("_axis_names", "_devices", "_flat", "_hosts", "_key", "_types")

    def __init__(self, devices: Any, axis_names: str | Sequence[str],
                 axis_types: Any = None) -> None:
        arr = _object_array(devices)
        names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
        if arr.ndim != len(names):
            raise ValueError(
                "Mesh requires the ndim of its first argument (`devices`) to equal the length "
                "of its second argument (`axis_names`), but got "
                f"devices.ndim == {arr.ndim} and len(axis_names) == {len(names)}."
            )
        if not all(isinstance(n, str) for n in names):
            raise TypeError(f"Mesh axis names must be strings, but got {names!r}.")
        if len(set(names)) != len(names):
            raise ValueError(f"Mesh axis names must be unique, but got {names!r}.")
        if arr.size == 0:
            raise ValueError("Mesh requires at least one device, but got an empty array.")
        for dev in arr.flat:
            if not isinstance(dev, Device):
                raise TypeError(f"Mesh devices must be colobus Devices, but got {dev!r}.")
        ids = [dev.id for dev in arr.flat]
        if len(set(ids)) != len(ids):
            dupes = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"Mesh devices must be unique, but device ids {dupes} repeat.")
        types = _axis_type_names(axis_types, names)
        arr.flags.writeable = False
        self._devices = arr
        self._axis_names = names
        self._types = types
        # (the axis types join the key only where one is not Auto: a mesh without them
        # keeps the key, and the hash, it always had)
        self._key: tuple[Any, ...] = (tuple(ids), arr.shape, names)
        if self.has_axis_types:
            self._key += (types,)
        self._flat: tuple[Device, ...] = tuple(arr.flat)
        self._hosts = tuple(sorted({dev.host for dev in self._flat}))

    @property
    def axis_type_names(self) -> tuple[str, ...]:
        """The axis types by name (``"Auto"``, ``"Explicit"``, ``"Manual"``), per axis."""
        return self._types

    @property
    def has_axis_types(self) -> bool:
        """Whether an axis is other than ``Auto`` (what the hosts' meshes are told)."""
        return any(t != "Auto" for t in self._types)

    @property
    def axis_types(self) -> tuple[Any, ...]:
        """One ``jax.sharding.AxisType`` per axis, as JAX's ``Mesh.axis_types`` (their
        names where the controller's JAX has no axis types)."""
        import jax

        if getattr(jax.sharding, "AxisType", None) is None:
            return self._types
        return jax_axis_types(jax, self._types)

    @property
    def device_tuple(self) -> tuple[Device, ...]:
        """The devices in ``devices.flat`` order, as one tuple made once (a sharding's
        ``device_list``: the same object each time, so plans cache on it)."""
        return self._flat

    @property
    def host_tuple(self) -> tuple[int, ...]:
        """The hosts of its devices, sorted, as one tuple made once (host registries
        cache on it)."""
        return self._hosts

    @property
    def devices(self) -> np.ndarray[Any, np.dtype[Any]]:
        """The devices, as a read-only object ndarray."""
        return self._devices

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The axis names, one per dimension."""
        return self._axis_names

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        """The size of each axis, in axis order."""
        return tuple(int(s) for s in self._devices.shape)

    @property
    def shape(self) -> dict[str, int]:
        """Axis name to size, in axis order (like ``jax.sharding.Mesh.shape``)."""
        return dict(zip(self._axis_names, self.axis_sizes, strict=True))

    @property
    def size(self) -> int:
        """The number of devices."""
        return int(self._devices.size)

    @property
    def device_ids(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The device ids, as an int ndarray shaped like the mesh."""
        return np.array(self._key[0], dtype=np.int64).reshape(self._devices.shape)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mesh):
            return NotImplemented
        return self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def _types_text(self) -> str:
        return (", axis_types=(" + ", ".join(self._types) + ("," if len(self._types) == 1
                                                             else "") + ")"
                if self.has_axis_types else "")

    def __repr__(self) -> str:
        return (f"Mesh(device_ids={self.device_ids.tolist()!r}, axis_names="
                f"{self._axis_names!r}{self._types_text()})")

    def __str__(self) -> str:
        return ("Mesh(" + ", ".join(f"{n!r}: {s}" for n, s in self.shape.items())
                + self._types_text() + ")")

    def __reduce__(self) -> tuple[Any, ...]:
        if self.has_axis_types:
            return (Mesh, (self._devices, self._axis_names, self._types))
        return (Mesh, (self._devices, self._axis_names))


# --------------------------------------------------------------------------- colocated CPUs


@overload
def colocated_cpu_devices_from(devices: Mesh, all_devices: Sequence[Device]) -> Mesh: ...


@overload
def colocated_cpu_devices_from(
    devices: Sequence[Device], all_devices: Sequence[Device]
) -> list[Device]: ...


def colocated_cpu_devices_from(
    devices: Sequence[Device] | Mesh, all_devices: Sequence[Device]
) -> list[Device] | Mesh:
    """The CPU device on the same host for each of ``devices``.

    Follows ``jax.experimental.colocated_python.colocated_cpu_devices``: the
    order is kept; a CPU device maps to itself; the accelerators of host ``h``
    take host ``h``'s CPU devices (in ``all_devices`` order) one each, in the
    order given. A mesh maps to a mesh of the same shape and axis names.

    Args:
        devices: Devices or a Mesh.
        all_devices: Every device of the cluster.

    Returns:
        A list of CPU devices, or a Mesh of them.

    Raises:
        ValueError: ``Process {h} does not have enough local CPU devices`` when
            host ``h`` runs out of CPU devices.
    """
    if isinstance(devices, Mesh):
        flat = colocated_cpu_devices_from(list(devices.devices.flat), all_devices)
        arr = np.empty(len(flat), dtype=object)
        arr[:] = flat
        return Mesh(arr.reshape(devices.devices.shape), devices.axis_names,
                    devices.axis_type_names)
    pools: dict[int, list[Device]] = {}
    for dev in all_devices:
        if dev.platform == "cpu":
            pools.setdefault(dev.host, []).append(dev)
    for pool in pools.values():
        pool.reverse()  # pop() from the end hands them out in order
    result: list[Device] = []
    for dev in devices:
        if dev.platform == "cpu":
            result.append(dev)
            continue
        pool = pools.get(dev.host, [])
        if not pool:
            raise ValueError(f"Process {dev.host} does not have enough local CPU devices")
        result.append(pool.pop())
    return result


# --------------------------------------------------------------------------- make_mesh


def make_mesh_from(axis_shapes: Sequence[int], axis_names: Sequence[str],
                   devices: Sequence[Device], axis_types: Any = None) -> Mesh:
    """``jax.make_mesh`` over ``devices``: the first ``prod(axis_shapes)`` of them, in order.

    JAX's own ordering follows the physical topology of TPUs and GPUs; colobus
    has no such topology across hosts, so the mesh takes the devices in the order
    given (``cb.devices()`` is sorted by id: host by host). The errors are JAX's.

    Raises:
        ValueError: ``axis_shapes`` is not a sequence of ints; fewer devices than
            the product of the shape; a wrong number of axis names (JAX's texts).
    """
    try:
        shape = tuple(int(s) for s in axis_shapes)
    except (TypeError, ValueError):
        raise ValueError("`axis_shapes` passed to `make_mesh` should be a sequence of ints."
                         f" Got {axis_shapes}") from None
    size = math.prod(shape)
    devices = list(devices)
    if size > len(devices):
        raise ValueError(f"Number of devices {len(devices)} must be >= the product "
                         f"of mesh_shape {shape}")
    arr = np.empty(size, dtype=object)
    arr[:] = devices[:size]
    return Mesh(arr.reshape(shape), axis_names, axis_types)
