"""The per-device view of a ``cb.Array``: ``addressable_shards``, as ``jax.Array`` lists them.

The controller addresses every host, so every shard is addressable (as in a
single-controller JAX runtime). A shard's ``data`` is a ``cb.Future`` of its
numpy value: fetching it reads only the block of the host that holds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .._controller.future import Future
from .._model.blocks import host_blocks
from .._model.devices import Device
from .._wire import protocol as P
from .._wire.describe import BadReply, read_fetched

if TYPE_CHECKING:
    from .._controller.controller import Controller
    from .._controller.hosts import Host
    from .._model.sharding import Sharding
    from .._wire.envelope import Envelope

__all__ = ["ShardedArray", "Shard", "addressable_shards"]


class ShardedArray(Protocol):
    """What a shard reads of the ``cb.Array`` it belongs to."""

    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def sharding(self) -> Sharding: ...
    @property
    def ref(self) -> int: ...
    @property
    def _ctl(self) -> Controller: ...
    @property
    def _key_impl(self) -> str | None: ...
    def check_usable(self) -> None: ...


class Shard:
    """One device's part of a ``cb.Array``.

    Attributes:
        device: The ``cb.Device`` that holds it.
        index: Its slices of the global array (as ``devices_indices_map`` gives).
        replica_id: 0 for the first device holding this index, 1 for the next...
    """

    __slots__ = ("_array", "device", "index", "replica_id")

    def __init__(self, array: ShardedArray, device: Device, index: tuple[slice, ...],
                 replica_id: int) -> None:
        self._array = array
        self.device = device
        self.index = index
        self.replica_id = replica_id

    @property
    def data(self) -> Future[Any]:
        """A ``cb.Future`` of this shard's value as numpy (a JAX key array for PRNG keys)."""
        return _fetch_shard(self._array, self.device.host, self.index)

    def __repr__(self) -> str:
        return (f"Shard(device={self.device!r}, index={self.index}, "
                f"replica_id={self.replica_id})")


def addressable_shards(array: ShardedArray) -> list[Shard]:
    """Every shard, in the sharding's device order (``mesh.devices.flat``), as JAX lists them."""
    index_map = array.sharding.devices_indices_map(array.shape)
    seen: dict[tuple[tuple[Any, Any], ...], int] = {}
    shards = []
    for dev in array.sharding.device_list:
        index = index_map[dev]
        key = tuple((s.start, s.stop) for s in index)
        replica = seen.get(key, 0)
        seen[key] = replica + 1
        shards.append(Shard(array, dev, index, replica))
    return shards


def _fetch_shard(array: ShardedArray, host: int, index: tuple[slice, ...]) -> Future[Any]:
    array.check_usable()
    block = host_blocks(array.sharding, array.shape)[host]
    local = []
    for s, b, n in zip(index, block.index, array.shape, strict=True):
        start, stop, _ = s.indices(n)  # JAX's indices use slice(None) for whole dimensions
        local.append(slice(start - b.start, stop - b.start))
    ctl = array._ctl
    ref = array.ref
    impl = array._key_impl

    def send(call_id: int) -> None:
        ctl._send(ctl._hosts[host], P.Fetch(call_id, ref, True))

    def decode(h: Host, body: P.Result, env: Envelope) -> Any:
        # The bounded reader (never the host's word for sizes), then the block's shape.
        data = read_fetched(body.meta, env.buffers)
        if tuple(data.shape) != tuple(block.shape):
            raise BadReply(f"fetched a block of shape {tuple(data.shape)} for a shard whose "
                           f"host holds {tuple(block.shape)}")
        return data

    def combine(values: dict[int, Any]) -> Any:
        data: np.ndarray[Any, Any] = values[host][tuple(local)]
        if impl:
            import jax

            return jax.random.wrap_key_data(data, impl=impl)  # type: ignore[arg-type]
        return data

    fut: Future[Any] = ctl._ops.submit((host,), send, decode, combine, backpressure=False)
    return fut
