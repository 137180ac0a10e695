"""Resharding on a host: a new block built from what the host holds and PIECEs that arrive.

A RESHARD names the new array's block on this host, the boxes of it the host
already holds (copied from its own store entries, pinned when the message
arrives) and how many PIECE messages bring the rest. The store entry of the new
array exists from the RESHARD on, so a later call or fetch that names it waits
for it. Once every piece is in, the block becomes what a PUT of it would have
stored, and the host answers the RESHARD. A PIECE with an error abandons the
block: the entry fails with a ``HostLostError`` of that text and is dropped, so
nothing of a failed reshard stays on the host.

Sources a host lends to other hosts are *held* under a second ref for the
reshard's FETCHes (the controller releases it at the end), so releasing the
source array after the reshard was issued cannot break it.
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import HostLostError
from .._model.jaxside import is_key_array
from .._wire import protocol as P
from .._wire.codec import from_buffer
from .._wire.envelope import Envelope
from .._wire.protocol import Status
from .values import LAZY_PUT_BYTES, NumpyBlock, PiecedBlock, jax_exact, numpy_block

if TYPE_CHECKING:
    from .sched import WorkerServices

__all__ = ["HostReshards", "as_numpy", "box_index"]


def box_index(raw: Any, ndim: int) -> tuple[slice, ...]:
    """``[[start, stop], ...]`` (checked) as slices over the leading dimensions."""
    if not isinstance(raw, list) or len(raw) > ndim:
        raise ValueError("bad box")
    out = []
    for pair in raw:
        if not (isinstance(pair, list) and len(pair) == 2
                and all(type(v) is int and v >= 0 for v in pair) and pair[0] <= pair[1]):
            raise ValueError("bad box")
        out.append(slice(pair[0], pair[1]))
    return tuple(out)


def as_numpy(jax: Any, value: Any) -> tuple[np.ndarray[Any, Any], str | None]:
    """A stored value's data as numpy (a view where JAX allows it) and its key impl."""
    from .._wire.codec import key_impl_name

    if isinstance(value, PiecedBlock):
        value = value.materialize()
    if isinstance(value, NumpyBlock):
        return value.view(np.ndarray), None
    if is_key_array(value):
        return np.asarray(jax.random.key_data(value)), key_impl_name(value)
    return np.asarray(value), None


class _Block:
    """A block being built: the parts that arrived (views, not copies), what is left."""

    __slots__ = ("body", "fut", "left", "parts", "whole")

    def __init__(self, body: P.Reshard, fut: asyncio.Future[Any]) -> None:
        self.body = body
        self.fut = fut
        self.parts: list[tuple[tuple[slice, ...], np.ndarray[Any, Any]]] = []
        self.whole: np.ndarray[Any, Any] | None = None  # the old block is the new one
        self.left = body.pieces + (1 if body.local else 0)


class HostReshards:
    """The RESHARD and PIECE handlers of one worker."""

    def __init__(self, worker: WorkerServices) -> None:
        self._w = worker

    @property
    def _blocks(self) -> dict[int, _Block]:
        return self._w.store.reshards  # dropped with the session's store

    def on_reshard(self, body: P.Reshard, env: Envelope) -> None:
        store = self._w.store
        for hold in body.holds:
            src, held = hold
            lent = store.entry(src)  # (a running call's output: its own)
            store.arrays[held] = lent if lent is not None else _failed(
                KeyError(f"array {src} is not on host {self._w.host_index} (deleted?)"))
        if not body.ref:
            self._w.send(P.Result(body.call_id, Status.OK, None))
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        store.arrays[body.ref] = fut
        block = self._blocks[body.ref] = _Block(body, fut)
        pins = [(store.entry(src), src_box, dst_box) for src, src_box, dst_box in body.local]
        if block.left == 0:  # an empty block: nothing to copy
            self._spawn_finish(block)
        elif pins:
            self._w._spawn(self._take_local(block, pins, self._w.epoch))

    async def _take_local(self, block: _Block, pins: list[Any], epoch: int) -> None:
        """What the host already holds of its new block: views of its old blocks."""
        try:
            for fut, src_box, dst_box in pins:
                if fut is None:
                    raise KeyError(f"the source of array {block.body.ref} is not on host "
                                   f"{self._w.host_index} (deleted?)")
                value = await fut
                if isinstance(value, PiecedBlock):  # made whole off the loop
                    value = await asyncio.get_running_loop().run_in_executor(
                        self._w._pool, value.materialize)
                data, _ = as_numpy(self._w._jax, value)
                part = data[box_index(src_box, data.ndim)]
                block.parts.append((box_index(dst_box, part.ndim), part))
            if epoch != self._w.epoch or self._blocks.get(block.body.ref) is not block:
                return
            block.whole = self._whole(block)
        except Exception as exc:
            self._fail(block, exc)
            return
        self._done_one(block)

    def _whole(self, block: _Block) -> np.ndarray[Any, Any] | None:
        """The old block itself where one local part is the whole new block, no piece coming."""
        body = block.body
        if len(block.parts) != 1 or body.pieces or len(body.local) != 1:
            return None
        dst_box = body.local[0][2]
        data = block.parts[0][1]
        full = [[0, n] for n in body.shape]
        if dst_box != full or list(data.shape[:len(full)]) != list(body.shape):
            return None
        return data

    def on_piece(self, body: P.Piece, env: Envelope) -> None:
        block = self._blocks.get(body.ref)
        if body.error:
            if block is not None:
                self._fail(block, HostLostError(body.error) if body.lost
                           else RuntimeError(body.error))
            else:  # built already, but the array as a whole failed: drop it too
                self._w.store.arrays.pop(body.ref, None)
            return
        try:
            if block is None:
                raise KeyError(f"reshard block {body.ref} is not pending on host "
                               f"{self._w.host_index}")
            if len(env.buffers) != 1:
                raise ValueError("PIECE needs one buffer")
            part = from_buffer(body.dtype, body.shape, env.buffers[0])  # a view on the frame
            block.parts.append((box_index(body.box, part.ndim), part))
        except Exception as exc:
            self._w.reply_error(body.call_id, exc)
            if block is not None:
                self._fail(block, exc)
            return
        self._w.send(P.Result(body.call_id, Status.OK, None))
        self._done_one(block)

    def _done_one(self, block: _Block) -> None:
        block.left -= 1
        if block.left == 0:
            self._spawn_finish(block)

    def _spawn_finish(self, block: _Block) -> None:
        self._w._spawn(self._finish(block, self._w.epoch))

    async def _finish(self, block: _Block, epoch: int) -> None:
        """Every part is in: store what a PUT of the block would have stored.

        A large block of a dtype JAX holds as is stays in its pieces (a
        :class:`PiecedBlock`: made whole when first read, so a reshard copies
        nothing on arrival); others are assembled now, on a pool thread.
        """
        body, w = block.body, self._w
        values = w.values
        try:
            mesh = values.local_mesh(body.mesh)
            spec = P.decode_spec(body.spec)
            impl = body.key_impl if isinstance(body.key_impl, str) else None
            sharding = values.sharding(mesh, spec, body.memory_kind)
            if block.parts:
                sample = block.parts[0][1]
                shape = tuple(body.shape) + tuple(sample.shape[len(body.shape):])
                dtype = sample.dtype
            else:  # an empty block
                from .._wire.codec import dtype_from_wire

                shape, dtype = tuple(body.shape), dtype_from_wire(body.dtype)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            big = nbytes >= LAZY_PUT_BYTES and impl is None and jax_exact(w._jax, dtype)
            value: Any
            if big and block.whole is not None:
                value = numpy_block(block.whole, sharding)  # the old block, laid out anew
                value.lazy = True
                value.put_ref = body.ref
            elif big:
                value = PiecedBlock(shape, dtype, block.parts, sharding, body.ref)
            else:
                loop = asyncio.get_running_loop()
                value = await loop.run_in_executor(
                    w._pool, functools.partial(_assemble_value, values, block, shape, dtype,
                                               mesh, spec, impl, body.memory_kind))
        except Exception as exc:
            self._fail(block, exc)
            return
        if epoch != w.epoch or self._blocks.get(body.ref) is not block:
            return
        del self._blocks[body.ref]
        block.parts = []
        block.fut.set_result(value)
        w.send(P.Result(body.call_id, Status.OK, None))

    def _fail(self, block: _Block, exc: BaseException) -> None:
        """The block will not be: fail its entry, drop it, answer the RESHARD."""
        ref = block.body.ref
        if self._blocks.get(ref) is not block:
            return
        del self._blocks[ref]
        block.parts = []
        block.whole = None
        if not block.fut.done():
            block.fut.set_exception(exc)
            block.fut.exception()
        store = self._w.store
        if store.arrays.get(ref) is block.fut:
            del store.arrays[ref]
        self._w.reply_error(block.body.call_id, exc)


def _assemble_value(values: Any, block: _Block, shape: tuple[int, ...], dtype: Any, mesh: Any,
                    spec: Any, impl: str | None, memory_kind: str | None) -> Any:
    """Pool thread: the block made whole from its parts, as the store keeps a PUT of it."""
    data = block.whole
    if data is None:
        data = np.empty(shape, dtype)
        for index, part in block.parts:
            data[index] = part
    return values.to_host_value_ready(data, mesh, spec, impl, memory_kind)


def _failed(exc: BaseException) -> asyncio.Future[Any]:
    fut = asyncio.get_running_loop().create_future()
    fut.set_exception(exc)
    fut.exception()
    return fut
