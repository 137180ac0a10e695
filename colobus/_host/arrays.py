"""Arrays on a host: PUT blocks stored, FETCH replies sent, values presented to calls.

A PUT block of 1 MiB and more whose dtype JAX holds exactly is kept as the numpy
view on the received frame (no copy); the first call that needs it makes the
``jax.Array``, and the store then keeps that alone. A FETCH of one controller
session never answers into the next one (its call ids would mean something else).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import gc
from typing import TYPE_CHECKING, Any

from .._wire import protocol as P
from .._wire.codec import from_buffer, to_buffer
from .._wire.envelope import Envelope
from .._wire.protocol import Kind, Status
from .computed import SPIN_SECONDS, is_computed, spins
from .reshard import HostReshards, as_numpy, box_index
from .store import CallResult
from .treeput import HostTreePuts
from .values import LAZY_PUT_BYTES, NumpyBlock, PiecedBlock, jax_exact, numpy_block, present

if TYPE_CHECKING:
    from .sched import WorkerServices

__all__ = ["REPLY_MARGIN", "HostArrays"]

REPLY_MARGIN = 1 << 20  # room for a reply's header, MAC and batch around a fetched block


class HostArrays:
    """The PUT and FETCH handlers of one worker, and how stored values are presented."""

    def __init__(self, worker: WorkerServices) -> None:
        self._w = worker
        self.reshards = HostReshards(worker)
        self.trees = HostTreePuts(worker, self)
        self._waits: concurrent.futures.ThreadPoolExecutor | None = None

    def handlers(self) -> dict[int, Any]:
        """The worker's dispatch entries for array messages."""
        return {Kind.PUT: self.on_put, Kind.FETCH: self.on_fetch,
                Kind.RESHARD: self.reshards.on_reshard, Kind.PIECE: self.reshards.on_piece,
                Kind.TREEPUT: self.trees.on_treeput, Kind.RELEASE: self.on_release}

    def on_release(self, body: P.Release, env: Envelope) -> None:
        self._w.store.release(body.refs, body.calls, body.code, env.seq)
        if body.calls and self._w.store.trees:
            self.trees.release(body.calls)

    def on_put(self, body: P.Put, env: Envelope) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        store = self._w.store
        store.arrays[body.ref] = fut
        store.puts.append((body.ref, env.seq))
        values = self._w.values
        try:
            if len(env.buffers) != 1:
                raise ValueError("PUT needs one buffer")
            arr = from_buffer(body.dtype, body.shape, env.buffers[0])
            mesh = values.local_mesh(body.mesh)
            spec = P.decode_spec(body.spec)
            impl = body.key_impl if isinstance(body.key_impl, str) else None
            memory = body.memory_kind
        except Exception as exc:
            fut.set_exception(exc)
            fut.exception()
            raise ValueError(f"bad PUT: {exc}") from exc
        self.store_block(fut, body.ref, arr, mesh, spec, impl, memory)

    def store_block(self, fut: asyncio.Future[Any], ref: int, arr: Any, mesh: Any, spec: Any,
                    impl: str | None, memory: str | None) -> None:
        """Settle store entry ``fut`` with block ``arr`` as a PUT stores it (loop thread)."""
        values = self._w.values
        loop = asyncio.get_running_loop()
        if arr.nbytes < LAZY_PUT_BYTES:
            try:
                fut.set_result(values.to_host_value(arr, mesh, spec, impl, memory))
            except Exception as exc:
                fut.set_exception(exc)
                fut.exception()
            return
        if impl is None and jax_exact(self._w._jax, arr.dtype):
            # Stored as the numpy view on the received frame: no copy now (the
            # put is done when the frame is here); a call makes the jax.Array.
            try:
                block = numpy_block(arr, values.sharding(mesh, spec, memory))
            except Exception as exc:
                fut.set_exception(exc)
                fut.exception()
                return
            block.lazy = True
            block.put_ref = ref
            fut.set_result(block)
            return
        work = loop.run_in_executor(self._w._pool, values.to_host_value_ready, arr, mesh, spec,
                                    impl, memory)
        work.add_done_callback(functools.partial(chain_future, fut))


    def present(self, value: Any) -> Any:
        """What user code receives for a stored value (any thread)."""
        if isinstance(value, PiecedBlock):  # made whole now; the store then keeps that
            value = self._swap_soon(value, value.materialize())
        lazy = isinstance(value, NumpyBlock) and value.lazy and value.jax_value is None
        out = present(self._w._jax, value)
        if lazy and self._w.loop is not None:
            try:
                self._w.loop.call_soon_threadsafe(self._swap_block, value)
            except RuntimeError:  # the loop closed: the worker is exiting
                pass
        return out

    def _swap_soon(self, old: PiecedBlock, new: NumpyBlock) -> NumpyBlock:
        """Any thread: the store entry of ``old`` becomes ``new`` (on the loop, if unchanged)."""
        loop = self._w.loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._swap_entry, old.ref, old, new)
            except RuntimeError:  # the loop closed: the worker is exiting
                pass
        return new

    def _swap_entry(self, ref: int, old: Any, new: Any) -> None:
        fut = self._w.store.arrays.get(ref)
        if fut is None or not fut.done() or fut.cancelled() or fut.exception() is not None:
            return
        if fut.result() is old:
            swapped = asyncio.get_running_loop().create_future()
            swapped.set_result(new)
            self._w.store.arrays[ref] = swapped

    def _swap_block(self, block: NumpyBlock) -> None:
        """Loop thread: a lazy PUT block got its jax.Array; store that alone.

        The numpy view (and the received frame under it) lives on only while
        calls that pinned the old entry still hold it. If JAX aliased the frame
        (aligned host memory), the jax.Array keeps it: no copy was made.
        """
        ref = block.put_ref
        fut = self._w.store.arrays.get(ref)
        if fut is None or not fut.done() or fut.cancelled() or fut.exception() is not None:
            return
        if fut.result() is not block or block.jax_value is None:
            return
        swapped = asyncio.get_running_loop().create_future()
        swapped.set_result(block.jax_value)
        self._w.store.arrays[ref] = swapped
        # jaxlib drops its reference to the copied numpy source from a callback of
        # the collector (references released off the GIL wait in a queue): run a
        # young-generation pass now, or the frame waits for the next automatic one.
        gc.collect(0)

    def on_fetch(self, body: P.Fetch, env: Envelope) -> None:
        fut = self._w.store.entry(body.ref)  # (an output of a call still running: its own)
        if body.data == P.FETCH_PROBE:
            self._probe(body.call_id, body.ref, fut)
            return
        if body.data == P.FETCH_CALL:
            store = self._w.store
            entry = store.results.get(body.ref)
            if (isinstance(entry, asyncio.Future) and not entry.done()
                    and body.ref not in store.awaited):
                # Its answer may leave with the call's RESULT (colobus._host.runs): no
                # task unless the call ends otherwise (it costs the call's start time).
                store.awaited[body.ref] = body.call_id
                entry.add_done_callback(functools.partial(
                    self._call_ended, body.call_id, body.ref, self._w.epoch))
                return
            self._w._spawn(self._wait_call(body.call_id, body.ref, self._w.epoch))
            return
        self._w._spawn(self._fetch(body.call_id, body.ref, fut, body.data == P.FETCH_DATA,
                                   self._w.epoch, body.box, body.device))

    def _probe(self, call_id: int, ref: int, fut: asyncio.Future[Any] | None) -> None:
        """Answer whether array ``ref`` is stored and computed, without waiting (is_ready)."""
        try:
            if fut is None:
                raise KeyError(f"array {ref} is not on host {self._w.host_index} (deleted?)")
            ready = fut.done() and is_computed(fut.result())
        except Exception as exc:
            self._w.reply_error(call_id, exc)
            return
        self._w.send(P.Result(call_id, Status.OK, ready))

    def _call_ended(self, call_id: int, call: int, epoch: int, _: asyncio.Future[Any]) -> None:
        """A call a FETCH_CALL waits for ended: its answer left with the RESULT, or it is
        given as for a call that had ended when the FETCH_CALL came. Either way the
        record of the wait goes (it is this FETCH's: ``on_fetch`` keeps one per call)."""
        answered = self._w.store.awaited.pop(call, None) == -call_id
        if not answered and epoch == self._w.epoch:
            self._w._spawn(self._wait_call(call_id, call, epoch))

    async def _wait_call(self, call_id: int, call: int, epoch: int) -> None:
        """Answer True once every output of ``call`` is computed; False where this host
        cannot tell (the call is unknown here or failed, an output is gone)."""
        store = self._w.store
        entry = store.results.get(call)
        try:
            if isinstance(entry, asyncio.Future):  # queued or running here
                try:
                    entry = await entry
                except BaseException:  # the call's own reply says why
                    entry = None
            refs = entry.refs if isinstance(entry, CallResult) else None
            entries = [store.arrays.get(ref) for ref in refs or ()]
            known = refs is not None and None not in entries
            for fut in entries if known else ():
                assert fut is not None
                await self.computed(await fut)
        except Exception as exc:
            if epoch == self._w.epoch:
                self._w.reply_error(call_id, exc)
            return
        if epoch == self._w.epoch:
            self._w.send(P.Result(call_id, Status.OK, known))

    async def computed(self, value: Any) -> None:
        """Wait until JAX finished computing ``value``: asked on the loop for up to
        ``SPIN_SECONDS``, then JAX's ``block_until_ready`` on a thread of its own (it
        holds its thread until the device is done: never the loop's)."""
        if is_computed(value):
            return
        # First ask JAX between the loop's other work, for a short while: a thread woken
        # by JAX's block_until_ready can cost more than a short device step (0.8 ms was
        # measured on a TPU VM under gVisor), and most waits are for the step in flight.
        # Not for a value on CPU devices: there the asking loop takes a core from the
        # computation it waits for (a 2 ms MLP step on 2 cores took twice as long).
        if spins(value):
            loop = asyncio.get_running_loop()
            until = loop.time() + SPIN_SECONDS
            while loop.time() < until:
                await asyncio.sleep(0)
                if is_computed(value):
                    return
        if self._waits is None:
            # Its own threads: a wait must not hold a slot that calls run in.
            self._waits = concurrent.futures.ThreadPoolExecutor(
                4, thread_name_prefix="colobus-ready")
        await asyncio.get_running_loop().run_in_executor(self._waits, value.block_until_ready)

    async def _fetch(self, call_id: int, ref: int, fut: asyncio.Future[Any] | None,
                     data: bool, epoch: int, box: list[Any], device: list[Any]) -> None:
        try:
            if fut is None:
                raise KeyError(f"array {ref} is not on host {self._w.host_index} (deleted?)")
            value = await fut
            await self.computed(value)
            if isinstance(value, PiecedBlock) and data:  # made whole off the loop
                value = await asyncio.get_running_loop().run_in_executor(
                    self._w._pool, value.materialize)
            if epoch != self._w.epoch:
                return  # that controller session is over: its call ids mean nothing now
            if not data:
                self._w.send(P.Result(call_id, Status.OK, None))
                return
            shard = self._device_shard(value, device) if device else None
            if shard is not None:  # that device's own buffer (replicas kept as returned)
                value, box = shard, []
            arr, impl = as_numpy(self._w._jax, value)
            if box:  # a box of the block only (a shard's, a reshard's move)
                arr = arr[box_index(box, arr.ndim)]
            descr, buf = to_buffer(arr)
            if buf.nbytes + REPLY_MARGIN > self._w._max_message:
                raise ValueError(
                    f"a block of {buf.nbytes} bytes is too large to fetch: the controller "
                    f"accepts messages up to max_message_bytes={self._w._max_message}; raise it "
                    "with Controller(..., max_message_bytes=N) or local_cluster(..., "
                    "max_message_bytes=N)")
        except BaseException as exc:
            if epoch == self._w.epoch and not isinstance(exc, asyncio.CancelledError):
                self._w.reply_error(call_id, exc)
            return
        self._w.send(P.Result(call_id, Status.OK, [list(arr.shape), descr, impl]), b"", [buf])

    def _device_shard(self, value: Any, device: list[Any]) -> Any:
        """What one device (``[platform, local id]``) holds of a stored JAX array that
        keeps a buffer per device (None: not such a value; its block's box tells)."""
        shards = getattr(value, "addressable_shards", None)
        if not shards or len(shards) < 2:
            return None
        try:
            want = self._w.values.device(str(device[0]), int(device[1]))
        except (IndexError, TypeError, ValueError):
            return None
        for s in shards:
            if s.device == want:
                return s.data
        return None


def chain_future(dst: asyncio.Future[Any], src: asyncio.Future[Any]) -> None:
    if dst.done():
        return
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
        dst.exception()
    else:
        dst.set_result(src.result())
