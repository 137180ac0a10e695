"""Devices, meshes and shardings: the pure layout math.

Nothing here touches a socket or a controller. This module answers, the same
way JAX answers it for its own types: which slice of a global array does each
device hold? (:meth:`Sharding.devices_indices_map`, identical to JAX's result
for the same mesh shape and spec.) Which block each *host* holds, and how a
global array is put back together from them, is in :mod:`colobus._blocks`.

Layouts are described in *tile coordinates*: a sharding splits array dimension
``d`` into ``factors[d]`` equal tiles, and each device holds one tile per
dimension. Working in tiles instead of element slices makes the checks exact
for every shape (zero-sized dimensions included) and independent of it.

Equality of shardings is by layout, not by class: two shardings are equal when
they split every dimension into the same number of tiles and give every device
the same tile. So ``SingleDeviceSharding(d)`` equals a ``NamedSharding`` over a
one-device mesh of ``d``; ``P('x', None)`` equals ``P('x')`` (trailing
unpartitioned dimensions are ignored, like JAX used to normalize specs); a
spec entry naming a size-1 mesh axis equals ``None``; and the order of the
device list does not matter (compare :attr:`Sharding.device_list` for that).
JAX's own ``==`` on shardings is stricter (it compares the mesh and the spec
as written); this layout equality is what JAX calls ``is_equivalent_to``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

import jax
import numpy as np

__all__ = [
    "Device",
    "Mesh",
    "NamedSharding",
    "PartitionSpec",
    "ShapeDtypeStruct",
    "Sharding",
    "SingleDeviceSharding",
    "colocated_cpu_devices_from",
]

PartitionSpec = jax.sharding.PartitionSpec

# (factors per dimension with trailing 1s stripped, {device id: tile per dimension}).
_LayoutKey = tuple[tuple[int, ...], frozenset[tuple[int, tuple[int, ...]]]]


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


class Mesh:
    """An N-dimensional array of devices with a name for each axis.

    Args:
        devices: An array-like (nested sequences or ndarray) of :class:`Device`.
        axis_names: One name per dimension of ``devices`` (a single string for
            a one-dimensional mesh).

    Raises:
        ValueError: If the number of axis names is not ``devices.ndim``, the
            names are not unique, an element is not a ``Device``, a device
            appears twice, or the mesh is empty.
    """

    __slots__ = ("_axis_names", "_devices", "_key")

    def __init__(self, devices: Any, axis_names: str | Sequence[str]) -> None:
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
        arr.flags.writeable = False
        self._devices = arr
        self._axis_names = names
        self._key = (tuple(ids), arr.shape, names)

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

    def __repr__(self) -> str:
        return f"Mesh(device_ids={self.device_ids.tolist()!r}, axis_names={self._axis_names!r})"

    def __str__(self) -> str:
        return "Mesh(" + ", ".join(f"{n!r}: {s}" for n, s in self.shape.items()) + ")"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Mesh, (self._devices, self._axis_names))


# --------------------------------------------------------------------------- shardings


class Sharding:
    """Base class of colobus shardings: how a global array's indices map to devices.

    Subclasses describe their layout by tile factors per dimension and one tile
    per device; everything else (index maps, shard shapes, equality) follows.
    """

    __slots__ = ("_hash", "_layout")

    def __init__(self) -> None:
        self._layout: _LayoutKey | None = None
        self._hash: int | None = None

    # -- what subclasses provide

    @property
    def device_list(self) -> tuple[Device, ...]:
        """The devices, in order (``mesh.devices.flat`` order for a NamedSharding)."""
        raise NotImplementedError

    def _factors(self) -> tuple[int, ...]:
        """Tiles per array dimension, one entry per spec dimension."""
        raise NotImplementedError

    def _tiles(self) -> dict[Device, tuple[int, ...]]:
        """The tile each device holds, one coordinate per entry of ``_factors()``."""
        raise NotImplementedError

    # -- derived

    @property
    def device_set(self) -> frozenset[Device]:
        """The devices, as a set."""
        return frozenset(self.device_list)

    @property
    def is_fully_replicated(self) -> bool:
        """Whether every device holds the whole array."""
        return all(f == 1 for f in self._factors())

    def check_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """Validates ``shape`` against this sharding (rank and divisibility).

        Args:
            shape: A global array shape.

        Returns:
            The shape as a tuple of ints.

        Raises:
            ValueError: If the rank is below the spec's length or a partitioned
                dimension is not divisible by its tile count (JAX's texts).
        """
        shape = as_shape(shape)
        factors = self._factors()
        if len(shape) < len(factors):
            raise ValueError(
                f"Sharding {self} is only valid for values of rank at least {len(factors)}, "
                f"but was applied to a value of rank {len(shape)}."
            )
        full = list(factors) + [1] * (len(shape) - len(factors))
        for dim, (size, factor) in enumerate(zip(shape, full, strict=True)):
            if size % factor:
                raise ValueError(
                    f"Sharding {self} implies that array axis {dim} is partitioned {factor} "
                    f"times, but the dimension size is {size} (full shape: {shape}, "
                    f"per-dimension tiling factors: {full} should evenly divide the shape)"
                )
        return shape

    def shard_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of each device's shard of an array of global ``shape``.

        Raises:
            ValueError: As :meth:`check_shape`.
        """
        shape = self.check_shape(shape)
        factors = self._factors()
        return tuple(
            size // factors[d] if d < len(factors) else size for d, size in enumerate(shape)
        )

    def devices_indices_map(self, shape: Sequence[int]) -> dict[Device, tuple[slice, ...]]:
        """The slice of a global array of ``shape`` that each device holds.

        The result equals JAX's for the same layout: ``slice(None)`` for a
        dimension split into one tile, ``slice(start, stop)`` otherwise, in
        :attr:`device_list` order.

        Raises:
            ValueError: As :meth:`check_shape`.
        """
        shape = self.check_shape(shape)
        factors = self._factors()
        tiles = self._tiles()
        result: dict[Device, tuple[slice, ...]] = {}
        for dev in self.device_list:
            tile = tiles[dev]
            index: list[slice] = []
            for d, size in enumerate(shape):
                factor = factors[d] if d < len(factors) else 1
                if factor == 1:
                    index.append(slice(None))
                else:
                    step = size // factor
                    index.append(slice(tile[d] * step, (tile[d] + 1) * step))
            result[dev] = tuple(index)
        return result

    def _layout_key(self) -> _LayoutKey:
        if self._layout is None:
            factors = list(self._factors())
            tiles = self._tiles()
            while factors and factors[-1] == 1:
                factors.pop()
            n = len(factors)
            self._layout = (
                tuple(factors),
                frozenset((dev.id, tile[:n]) for dev, tile in tiles.items()),
            )
        return self._layout

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sharding):
            return NotImplemented
        return self is other or self._layout_key() == other._layout_key()

    def __hash__(self) -> int:
        h = self._hash
        if h is None:  # hashed per call (signatures, plans): a frozenset's hash is not cached
            h = self._hash = hash(self._layout_key())
        return h


def _spec_entries(spec: PartitionSpec) -> tuple[tuple[str, ...], ...]:
    """One tuple of mesh axis names per spec entry (``None`` -> ``()``)."""
    entries: list[tuple[str, ...]] = []
    for entry in spec:
        if entry is None:
            entries.append(())
        elif entry is PartitionSpec.UNCONSTRAINED:
            raise ValueError(
                f"colobus shardings need a concrete layout, but {spec!r} has an "
                "UNCONSTRAINED entry."
            )
        elif isinstance(entry, str):
            entries.append((entry,))
        else:
            entries.append(tuple(entry))
    return tuple(entries)


class NamedSharding(Sharding):
    """A sharding over a :class:`Mesh`, with a ``PartitionSpec`` per array dimension.

    Args:
        mesh: The mesh of devices.
        spec: Which mesh axes split each array dimension (``None`` for none;
            a tuple of names splits one dimension over several axes, the first
            name being the major one, as in JAX).

    Raises:
        ValueError: For an unknown axis name, an axis used twice, or an
            ``UNCONSTRAINED`` entry (JAX's texts for the first two).
        TypeError: If ``mesh`` is not a colobus Mesh or ``spec`` not a PartitionSpec.
    """

    __slots__ = ("_entries", "_mesh", "_spec")

    def __init__(self, mesh: Mesh, spec: PartitionSpec) -> None:
        super().__init__()
        if not isinstance(mesh, Mesh):
            raise TypeError(f"NamedSharding needs a colobus Mesh, but got {type(mesh)}.")
        if not isinstance(spec, PartitionSpec):
            raise TypeError(f"NamedSharding needs a PartitionSpec, but got {type(spec)}.")
        entries = _spec_entries(spec)
        seen: set[str] = set()
        for names in entries:
            for name in names:
                if name not in mesh.axis_names:
                    raise ValueError(
                        f"Resource axis: {name} of {spec!r} is not found in mesh: "
                        f"{mesh.axis_names}."
                    )
                if name in seen:
                    raise ValueError(
                        "A single NamedSharding spec specification can map every mesh axis to "
                        f"at most one positional dimension, but {spec!r} has duplicate entries "
                        f"for `{name}`"
                    )
                seen.add(name)
        if getattr(spec, "unreduced", None) or getattr(spec, "reduced", None):
            raise ValueError(f"colobus shardings do not support reduced axes, but got {spec!r}.")
        self._mesh = mesh
        self._spec = spec
        self._entries = entries

    @property
    def mesh(self) -> Mesh:
        """The mesh."""
        return self._mesh

    @property
    def spec(self) -> PartitionSpec:
        """The partition spec, as given."""
        return self._spec

    @property
    def device_list(self) -> tuple[Device, ...]:
        return tuple(self._mesh.devices.flat)

    def _factors(self) -> tuple[int, ...]:
        sizes = self._mesh.shape
        return tuple(math.prod(sizes[n] for n in names) for names in self._entries)

    def _tiles(self) -> dict[Device, tuple[int, ...]]:
        return _mesh_tiles(self._mesh, self._entries)

    def __repr__(self) -> str:
        return f"NamedSharding(mesh={self._mesh}, spec={self._spec!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (NamedSharding, (self._mesh, self._spec))


def _mesh_tiles(mesh: Mesh, entries: tuple[tuple[str, ...], ...]) -> dict[Device, tuple[int, ...]]:
    """Tile coordinates of every mesh device: mixed radix over the entry's axes, major first."""
    sizes = mesh.shape
    axis_of = {name: i for i, name in enumerate(mesh.axis_names)}
    tiles: dict[Device, tuple[int, ...]] = {}
    for pos, dev in np.ndenumerate(mesh.devices):
        tile: list[int] = []
        for names in entries:
            t = 0
            for name in names:
                t = t * sizes[name] + int(pos[axis_of[name]])
            tile.append(t)
        tiles[dev] = tuple(tile)
    return tiles


class SingleDeviceSharding(Sharding):
    """The whole array on one device.

    Args:
        device: The device.
    """

    __slots__ = ("_device",)

    def __init__(self, device: Device) -> None:
        super().__init__()
        if not isinstance(device, Device):
            raise TypeError(f"SingleDeviceSharding needs a colobus Device, but got {device!r}.")
        self._device = device

    @property
    def device(self) -> Device:
        """The device."""
        return self._device

    @property
    def device_list(self) -> tuple[Device, ...]:
        return (self._device,)

    def _factors(self) -> tuple[int, ...]:
        return ()

    def _tiles(self) -> dict[Device, tuple[int, ...]]:
        return {self._device: ()}

    def __repr__(self) -> str:
        return f"SingleDeviceSharding(device={self._device!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (SingleDeviceSharding, (self._device,))


# --------------------------------------------------------------------------- specs


def as_shape(shape: Sequence[int]) -> tuple[int, ...]:
    try:
        result = tuple(operator.index(s) for s in shape)
    except TypeError as exc:
        raise TypeError(f"A shape must be a sequence of ints, but got {shape!r}.") from exc
    if any(s < 0 for s in result):
        raise ValueError(f"A shape must not have negative dimensions, but got {result}.")
    return result


def as_dtype(dtype: Any) -> np.dtype[Any]:
    try:
        result: np.dtype[Any] = np.dtype(dtype)
    except TypeError:
        # JAX's extended dtypes (typed PRNG keys) are not numpy dtypes; keep them as given.
        if jax.numpy.issubdtype(dtype, jax.dtypes.extended):
            kept: np.dtype[Any] = dtype
            return kept
        raise
    return result


@dataclass(frozen=True, init=False)
class ShapeDtypeStruct:
    """The shape, dtype and (optionally) sharding of an array, without its data.

    Args:
        shape: Any sequence of ints; stored as a tuple.
        dtype: Anything ``np.dtype`` accepts (a JAX extended dtype, such as a
            typed PRNG key's, is kept as given).
        sharding: The sharding, or ``None``.
    """

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    sharding: Sharding | None

    def __init__(self, shape: Sequence[int], dtype: Any, sharding: Sharding | None = None) -> None:
        if sharding is not None and not isinstance(sharding, Sharding):
            raise TypeError(f"sharding must be a colobus Sharding or None, got {sharding!r}.")
        object.__setattr__(self, "shape", as_shape(shape))
        object.__setattr__(self, "dtype", as_dtype(dtype))
        object.__setattr__(self, "sharding", sharding)

    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """The number of elements."""
        return math.prod(self.shape)


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
        return Mesh(arr.reshape(devices.devices.shape), devices.axis_names)
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
