"""Host blocks: which rectangular block of a global array each host holds, and back.

Pure layout math on top of :mod:`colobus._model.sharding`: :func:`host_blocks` gives
each host's block and its local sharding, :func:`global_shape_from_host` is its
inverse, and :func:`assemble` puts a global array together from host blocks.
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .devices import Mesh
from .sharding import NamedSharding, Sharding, SingleDeviceSharding, as_dtype, as_shape

__all__ = ["HostBlock", "assemble", "global_shape_from_host", "host_blocks", "host_sub_mesh",
           "layout_from_host"]


# --------------------------------------------------------------------------- host blocks


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class HostBlock:
    """The part of a global array that one host holds.

    Attributes:
        host: The host index.
        index: The block of the global array, as slices with int start/stop.
        shape: The block's shape.
        local_devices: The host's devices, as an object ndarray shaped like its
            part of the mesh (same ndim as the mesh; shape ``(1,)`` for a
            SingleDeviceSharding).
        local_sharding: The layout of the block over ``local_devices``: the
            same spec over the host's sub-mesh, or the SingleDeviceSharding.
    """

    host: int
    index: tuple[slice, ...]
    shape: tuple[int, ...]
    local_devices: np.ndarray[Any, np.dtype[Any]]
    local_sharding: Sharding

    def _key(self) -> tuple[Any, ...]:
        spans = tuple((s.start, s.stop) for s in self.index)
        ids = tuple(d.id for d in self.local_devices.flat)
        return (self.host, spans, self.shape, ids, self.local_devices.shape, self.local_sharding)

    def __repr__(self) -> str:
        spans = ", ".join(f"{s.start}:{s.stop}" for s in self.index)
        ids = np.vectorize(lambda d: d.id, otypes=[object])(self.local_devices).tolist()
        return (
            f"HostBlock(host={self.host}, index=[{spans}], shape={self.shape}, "
            f"local_device_ids={ids}, local_sharding={self.local_sharding!r})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HostBlock):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


# Layout math per mesh object, remembered: a call's outputs on a mesh of N hosts need
# every host's block, and each host's block scans the whole mesh, so without this a
# fan-out call costs O(N^2) on the controller. Keyed by the mesh object's id, holding
# the mesh itself (so the id cannot be reused while its entry lives); bounded.
_CACHE_MAX = 1024
_cache: collections.OrderedDict[tuple[Any, ...], tuple[Mesh, Any]] = collections.OrderedDict()
_cache_lock = threading.Lock()


def _cached(mesh: Mesh, key: tuple[Any, ...]) -> Any:
    with _cache_lock:
        hit = _cache.get((id(mesh), *key))
        if hit is None or hit[0] is not mesh:
            return None
        _cache.move_to_end((id(mesh), *key))
        return hit[1]


def _remember(mesh: Mesh, key: tuple[Any, ...], value: Any) -> None:
    with _cache_lock:
        _cache[(id(mesh), *key)] = (mesh, value)
        while len(_cache) > _CACHE_MAX:
            _cache.popitem(last=False)


def host_sub_mesh(sharding: NamedSharding, host: int) -> tuple[tuple[tuple[int, ...], ...], Mesh]:
    """The per-axis mesh positions of ``host``'s devices and the sub-mesh they form."""
    mesh = sharding.mesh
    hit = _cached(mesh, ("sub", host))
    if hit is not None:
        return hit  # type: ignore[no-any-return]
    out = _host_sub_mesh(mesh, host, sharding)
    _remember(mesh, ("sub", host), out)
    return out


def _host_sub_mesh(mesh: Mesh, host: int, sharding: NamedSharding
                   ) -> tuple[tuple[tuple[int, ...], ...], Mesh]:
    positions = [pos for pos, dev in np.ndenumerate(mesh.devices) if dev.host == host]
    if not positions:
        raise ValueError(f"Host {host} has no device in {sharding!r}.")
    coords = tuple(sorted({p[a] for p in positions}) for a in range(mesh.devices.ndim))
    if len(positions) != math.prod(len(c) for c in coords):
        raise ValueError(
            f"The devices of host {host} do not form a sub-box of the mesh of {sharding!r}: "
            f"they sit at mesh positions {sorted(positions)}. colobus needs each host's "
            "devices to be the product of one set of positions per mesh axis."
        )
    local = mesh.devices[np.ix_(*coords)]
    return tuple(tuple(c) for c in coords), Mesh(local, mesh.axis_names, mesh.axis_type_names)


def _named_host_block(sharding: NamedSharding, host: int, shape: tuple[int, ...]) -> HostBlock:
    _, local_mesh = host_sub_mesh(sharding, host)
    factors = sharding._factors()
    tiles = sharding._tiles()
    host_tiles = {dev: tiles[dev] for dev in local_mesh.devices.flat}
    lo = [min(t[d] for t in host_tiles.values()) for d in range(len(factors))]
    hi = [max(t[d] for t in host_tiles.values()) for d in range(len(factors))]
    distinct = set(host_tiles.values())
    box = math.prod(h - low + 1 for low, h in zip(lo, hi, strict=True))
    if len(distinct) != box:
        raise ValueError(
            f"The shards of host {host} under {sharding!r} do not form one rectangular block "
            f"of the global array (tiles {sorted(distinct)} of a {list(factors)} tiling). "
            "colobus needs each host's shards to form one rectangular block; choose a mesh "
            "whose host axis is major in the spec entries it appears in."
        )
    local_sharding = NamedSharding(local_mesh, sharding.spec, memory_kind=sharding.memory_kind)
    local_tiles = local_sharding._tiles()
    for dev, tile in host_tiles.items():
        expected = tuple(t - low for t, low in zip(tile, lo, strict=True))
        if local_tiles[dev] != expected:
            raise ValueError(
                f"The local sharding {local_sharding!r} of host {host} would place tile "
                f"{local_tiles[dev]} on {dev!r}, but {sharding!r} places tile {expected} of the "
                "host's block there."
            )
    index: list[slice] = []
    block_shape: list[int] = []
    for d, size in enumerate(shape):
        if d < len(factors):
            step = size // factors[d]
            start, stop = lo[d] * step, (hi[d] + 1) * step
        else:
            start, stop = 0, size
        index.append(slice(start, stop))
        block_shape.append(stop - start)
    return HostBlock(host, tuple(index), tuple(block_shape), local_mesh.devices, local_sharding)


def host_blocks(sharding: Sharding, shape: Sequence[int]) -> dict[int, HostBlock]:
    """The block of a global array that each host of ``sharding`` holds.

    Args:
        sharding: A :class:`NamedSharding` or :class:`SingleDeviceSharding`.
        shape: The global array's shape.

    Returns:
        Host index to :class:`HostBlock`, sorted by host.

    Raises:
        ValueError: If ``shape`` does not fit the sharding (rank, divisibility);
            if a host's devices do not form a sub-box of the mesh; if a host's
            shards do not form one rectangular block of the global array; or
            if the spec over the host's sub-mesh would not place the host's
            slices on the same devices.
    """
    shape = sharding.check_shape(shape)
    if isinstance(sharding, SingleDeviceSharding):
        dev = sharding.device
        devices = np.empty((1,), dtype=object)
        devices[0] = dev
        devices.flags.writeable = False
        index = tuple(slice(0, s) for s in shape)
        return {dev.host: HostBlock(dev.host, index, shape, devices, sharding)}
    if isinstance(sharding, NamedSharding):
        key = ("blocks", sharding._entries, shape, sharding.memory_kind)
        blocks = _cached(sharding.mesh, key)
        if blocks is None:
            hosts = sharding.mesh.host_tuple
            blocks = {h: _named_host_block(sharding, h, shape) for h in hosts}
            _remember(sharding.mesh, key, blocks)
        return dict(blocks)  # the caller's own dict; the HostBlocks are immutable
    raise TypeError(f"Unsupported sharding type: {type(sharding)}.")


def global_shape_from_host(
    sharding: NamedSharding, host: int, local_shape: Sequence[int]
) -> tuple[int, ...]:
    """The global shape whose block on ``host`` has shape ``local_shape``.

    This inverts :func:`host_blocks`: each dimension split by the spec is
    scaled by (tiles over the whole mesh) / (tiles over the host's sub-mesh).

    Args:
        sharding: The global sharding.
        host: A host of the sharding.
        local_shape: The shape of the host's block (laid out by the same spec
            over the host's sub-mesh).

    Returns:
        The global shape.

    Raises:
        ValueError: If ``host`` has no device in the sharding, ``local_shape``
            does not fit the local sharding, or the host's block of the
            resulting global shape is not ``local_shape``.
    """
    _, local_mesh = host_sub_mesh(sharding, host)
    local_sharding = NamedSharding(local_mesh, sharding.spec)
    local_shape = local_sharding.check_shape(local_shape)
    local_factors = local_sharding._factors()
    global_factors = sharding._factors()
    shape = tuple(
        size // local_factors[d] * global_factors[d] if d < len(global_factors) else size
        for d, size in enumerate(local_shape)
    )
    block = host_blocks(sharding, shape)[host]
    if block.shape != local_shape:
        raise ValueError(
            f"A block of shape {local_shape} on host {host} is inconsistent with {sharding!r}: "
            f"the global shape {shape} would give the host a block of shape {block.shape}."
        )
    return shape


def layout_from_host(mesh: Mesh, spec: Any, host: int, local_shape: tuple[int, ...]
                     ) -> tuple[NamedSharding, tuple[int, ...], Mapping[int, HostBlock], bool]:
    """An output laid out by ``spec`` over ``mesh``, known from ``host``'s block shape: its
    sharding, global shape, every host's block (shared: do not change it), and whether
    every host's block has ``local_shape`` (then one reply's shape stands for all).

    Remembered per mesh: a function's outputs come back laid out alike call after call.

    Raises:
        ValueError: as :func:`global_shape_from_host`.
    """
    key = ("layout", spec, host, local_shape)
    hit = _cached(mesh, key)
    if hit is not None:
        return hit  # type: ignore[no-any-return]
    sharding = NamedSharding(mesh, spec)
    shape = global_shape_from_host(sharding, host, local_shape)
    blocks = host_blocks(sharding, shape)
    out = (sharding, shape, blocks, all(b.shape == local_shape for b in blocks.values()))
    _remember(mesh, key, out)
    return out


def assemble(
    shape: Sequence[int],
    dtype: Any,
    blocks: Mapping[int, np.ndarray[Any, Any]],
    host_blocks: Mapping[int, HostBlock],
    out: np.ndarray[Any, Any] | None = None,
) -> np.ndarray[Any, Any]:
    """Builds a global array from per-host blocks (the reverse of :func:`host_blocks`).

    Each element is copied once into a preallocated result. Where hosts hold
    the same region (replication), the lowest host index among ``blocks``
    wins; a host may be left out of ``blocks`` when another host given there
    holds the same region. When one block covers the whole array and ``out``
    is not given, that block is returned as is, without a copy.

    Args:
        shape: The global shape.
        dtype: The global dtype.
        blocks: Host index to that host's block.
        host_blocks: Host index to :class:`HostBlock`, as :func:`host_blocks` returns.
        out: An array of ``shape`` and ``dtype`` to fill, or ``None`` to allocate one.

    Returns:
        The global array (``out`` when given).

    Raises:
        ValueError: If a block has the wrong shape, a region has no block, a
            block belongs to no known host, or ``out`` does not match.
    """
    shape = as_shape(shape)
    dtype = as_dtype(dtype)
    unknown = sorted(set(blocks) - set(host_blocks))
    if unknown:
        raise ValueError(f"Blocks given for hosts {unknown}, which hold no part of the array.")
    # One source per distinct region, the lowest host first.
    regions: dict[tuple[tuple[int, int], ...], int] = {}
    for host in sorted(host_blocks):
        hb = host_blocks[host]
        region = tuple((int(s.start), int(s.stop)) for s in hb.index)
        if len(region) != len(shape):
            raise ValueError(
                f"Host {host}'s block has rank {len(region)}, but the array has rank {len(shape)}."
            )
        if host in blocks:
            got = tuple(np.shape(blocks[host]))
            if got != hb.shape:
                raise ValueError(
                    f"Host {host} sent a block of shape {got}, but holds a block of shape "
                    f"{hb.shape}."
                )
            if regions.get(region, -1) < 0:
                regions[region] = host
        else:
            regions.setdefault(region, -1)
    missing = sorted(r for r, h in regions.items() if h < 0)
    if missing:
        raise ValueError(f"No block was given for the regions {missing} of the array.")
    whole = tuple((0, s) for s in shape)
    if out is None and whole in regions:
        block = np.asarray(blocks[regions[whole]])
        return block if block.dtype == dtype else block.astype(dtype)
    if out is None:
        out = np.empty(shape, dtype=dtype)
    elif out.shape != shape or out.dtype != dtype:
        raise ValueError(
            f"out has shape {out.shape} and dtype {out.dtype}, but the array has shape "
            f"{shape} and dtype {dtype}."
        )
    # Lowest host last, so it wins where regions partly overlap.
    for region, host in sorted(regions.items(), key=lambda item: -item[1]):
        out[tuple(slice(a, b) for a, b in region)] = blocks[host]
    return out
