"""The per-device view of a ``cb.Array``: ``addressable_shards``, as ``jax.Array`` lists them.

The controller addresses every host, so every shard is addressable (as in a
single-controller JAX runtime). A shard's ``data`` is what its device holds, as JAX
keeps replicas: each device's shard holds what its host (and device) returned, never
compared with the others' (``docs/functions.md``, "Replicated outputs"). Reading it
fetches that one device's shard from the host that holds it.
"""

from __future__ import annotations

import threading
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

__all__ = ["ShardedArray", "Shard", "addressable_shards", "fetch_shard"]

_get_ident = threading.get_ident


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
    @property
    def _call(self) -> Future[Any] | None: ...
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
    def data(self) -> Any:
        """This device's shard as numpy (a JAX key array for PRNG keys): off the
        controller's event-loop thread the value, waited for (with the call that makes
        the array, whose error it raises); on it a ``cb.Future`` of it, to ``await``."""
        fut = fetch_shard(self._array, self.device, self.index)
        loop_thread = fut._loop_thread
        if loop_thread is not None and _get_ident() == loop_thread:
            return fut
        return fut.result()

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


def fetch_shard(array: ShardedArray, device: Device, index: tuple[slice, ...]) -> Future[Any]:
    """A Future of what ``device`` holds of ``array`` (its shard at ``index``): the host
    reads that device's own buffer where its value keeps one per device (a JAX array),
    else the box of its block; ended once the call that makes the array did."""
    array.check_usable()
    host = device.host
    block = host_blocks(array.sharding, array.shape)[host]
    local = []
    for s, b, n in zip(index, block.index, array.shape, strict=True):
        start, stop, _ = s.indices(n)  # JAX's indices use slice(None) for whole dimensions
        local.append([start - b.start, stop - b.start])
    shape = tuple(hi - lo for lo, hi in local)
    ctl = array._ctl
    ref = array.ref
    impl = array._key_impl
    call = array._call
    which = [device.platform, device.local_id]

    def send(call_id: int) -> None:
        ctl._send(ctl._hosts[host], P.Fetch(call_id, ref, P.FETCH_DATA, local, which))

    def decode(h: Host, body: P.Result, env: Envelope) -> Any:
        # The bounded reader (never the host's word for sizes), then the shard's shape.
        data = read_fetched(body.meta, env.buffers)
        if tuple(data.shape[:len(shape)]) != shape:
            raise BadReply(f"fetched a shard of shape {tuple(data.shape)} for one of "
                           f"shape {shape}")
        return data

    def combine(values: dict[int, Any]) -> Any:
        data: np.ndarray[Any, Any] = values[host]
        if impl:
            import jax

            return jax.random.wrap_key_data(data, impl=impl)  # type: ignore[arg-type]
        return data

    fut: Future[Any] = ctl._ops.submit((host,), send, decode, combine, backpressure=False)
    if call is None:
        return fut
    out: Future[Any] = ctl._ops.new_future()  # the shard once its call ended well

    def fetched(f: Future[Any]) -> None:
        if call.done():
            _copy(f, out, call)
        else:
            call.add_done_callback(lambda _: _copy(f, out, call))

    fut.add_done_callback(fetched)
    return out


def _copy(fetched: Future[Any], out: Future[Any], call: Future[Any]) -> None:
    """``out`` from a shard's fetch, or from the error of the call that makes its array."""
    if call.cancelled():
        out._set_cancelled()
    elif (exc := call.exception()) is not None:
        out.set_exception(exc)
    elif fetched.cancelled():
        out._set_cancelled()
    elif (exc := fetched.exception()) is not None:
        out.set_exception(exc)
    else:
        out.set_result(fetched.result())
