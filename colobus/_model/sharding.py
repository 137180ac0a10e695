"""Devices, meshes and shardings: the pure layout math.

Nothing here touches a socket or a controller. This module answers, the same
way JAX answers it for its own types: which slice of a global array does each
device hold? (:meth:`Sharding.devices_indices_map`, identical to JAX's result
for the same mesh shape and spec.) Which block each *host* holds, and how a
global array is put back together from them, is in :mod:`colobus._model.blocks`.

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
from typing import TYPE_CHECKING, Any

import numpy as np

from .devices import Device, Mesh

if TYPE_CHECKING:
    from jax.sharding import PartitionSpec

__all__ = [
    "NamedSharding",
    "PartitionSpec",
    "ShapeDtypeStruct",
    "Sharding",
    "SingleDeviceSharding",
    "with_memory_kind",
]



def __getattr__(name: str) -> Any:
    # ``PartitionSpec`` is JAX's own class, looked up when first asked for, so that
    # importing colobus (and its command line's quick commands) does not import JAX.
    if name == "PartitionSpec":
        from jax.sharding import PartitionSpec

        return PartitionSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# (factors per dimension with trailing 1s stripped, {device id: tile per dimension}).
_LayoutKey = tuple[tuple[int, ...], frozenset[tuple[int, tuple[int, ...]]]]


# --------------------------------------------------------------------------- shardings


class Sharding:
    """Base class of colobus shardings: how a global array's indices map to devices.

    Subclasses describe their layout by tile factors per dimension and one tile
    per device; everything else (index maps, shard shapes, equality) follows.
    """

    __slots__ = ("_hash", "_layout", "_memory_kind")

    def __init__(self, memory_kind: str | None = None) -> None:
        if memory_kind is not None and not isinstance(memory_kind, str):
            raise TypeError(f"memory_kind must be a string or None, but got {memory_kind!r}.")
        self._layout: _LayoutKey | None = None
        self._hash: int | None = None
        self._memory_kind = memory_kind

    @property
    def memory_kind(self) -> str | None:
        """The memory kind the array's data lives in on its devices, as given (None: the
        devices' default, ``"device"`` on every JAX platform)."""
        return self._memory_kind

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

    def _memory_key(self) -> str:
        # None is the devices' default memory, "device" on every JAX platform (JAX
        # itself reads None as the default: NamedSharding(m, p) == ...(memory_kind="device")).
        return "device" if self._memory_kind is None else self._memory_kind

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sharding):
            return NotImplemented
        return self is other or (self._layout_key() == other._layout_key()
                                 and self._memory_key() == other._memory_key())

    def __hash__(self) -> int:
        h = self._hash
        if h is None:  # hashed per call (signatures, plans): a frozenset's hash is not cached
            h = self._hash = hash((self._layout_key(), self._memory_key()))
        return h

    def _memory_repr(self) -> str:
        return "" if self._memory_kind is None else f", memory_kind={self._memory_kind!r}"

    def __str__(self) -> str:
        # What JAX's own functions print of a value they refuse ("Received invalid value:
        # ..."): it says whose sharding this is, and what takes it.
        return f"{self!r} (a colobus sharding: use cb.device_put with it, not jax.device_put)"


def _spec_entries(spec: PartitionSpec) -> tuple[tuple[str, ...], ...]:
    """One tuple of mesh axis names per spec entry (``None`` -> ``()``)."""
    from jax.sharding import PartitionSpec

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
        memory_kind: The memory the data lives in on each device, as JAX names
            it (``"device"``, ``"pinned_host"``, ``"unpinned_host"``...); None:
            the default. Passed to the host's own JAX sharding.

    Raises:
        ValueError: For an unknown axis name, an axis used twice, or an
            ``UNCONSTRAINED`` entry (JAX's texts for the first two).
        TypeError: If ``mesh`` is not a colobus Mesh or ``spec`` not a PartitionSpec.
    """

    __slots__ = ("_entries", "_mesh", "_spec")

    def __init__(self, mesh: Mesh, spec: PartitionSpec, *, memory_kind: str | None = None
                 ) -> None:
        super().__init__(memory_kind)
        if not isinstance(mesh, Mesh):
            raise TypeError(f"NamedSharding needs a colobus Mesh, but got {type(mesh)}.")
        from jax.sharding import PartitionSpec

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
        return self._mesh.device_tuple

    def _factors(self) -> tuple[int, ...]:
        sizes = self._mesh.shape
        return tuple(math.prod(sizes[n] for n in names) for names in self._entries)

    def _tiles(self) -> dict[Device, tuple[int, ...]]:
        return _mesh_tiles(self._mesh, self._entries)

    def __repr__(self) -> str:
        return f"NamedSharding(mesh={self._mesh}, spec={self._spec!r}{self._memory_repr()})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_named, (self._mesh, self._spec, self._memory_kind))


def _named(mesh: Mesh, spec: PartitionSpec, memory_kind: str | None) -> NamedSharding:
    return NamedSharding(mesh, spec, memory_kind=memory_kind)


def _single(device: Device, memory_kind: str | None) -> SingleDeviceSharding:
    return SingleDeviceSharding(device, memory_kind=memory_kind)


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
        memory_kind: As for :class:`NamedSharding`.
    """

    __slots__ = ("_device", "_list")

    def __init__(self, device: Device, *, memory_kind: str | None = None) -> None:
        super().__init__(memory_kind)
        if not isinstance(device, Device):
            raise TypeError(f"SingleDeviceSharding needs a colobus Device, but got {device!r}.")
        self._device = device
        self._list = (device,)  # one tuple: plans cache on its identity

    @property
    def device(self) -> Device:
        """The device."""
        return self._device

    @property
    def device_list(self) -> tuple[Device, ...]:
        return self._list

    def _factors(self) -> tuple[int, ...]:
        return ()

    def _tiles(self) -> dict[Device, tuple[int, ...]]:
        return {self._device: ()}

    def __repr__(self) -> str:
        return f"SingleDeviceSharding(device={self._device!r}{self._memory_repr()})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_single, (self._device, self._memory_kind))


def with_memory_kind(sharding: Sharding, memory_kind: str | None) -> Sharding:
    """The same layout with another memory kind."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, sharding.spec, memory_kind=memory_kind)
    if isinstance(sharding, SingleDeviceSharding):
        return SingleDeviceSharding(sharding.device, memory_kind=memory_kind)
    raise TypeError(f"Unsupported sharding type: {type(sharding)}.")


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
        import jax

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
