"""TREEPUT on a host: a block that arrives whole or from a parent host, served on.

The store entry exists from the TREEPUT on (later calls wait for it there, as
for a RESHARD). A root gets the block as buffer 0 and stores it at once; any
other host pulls it from the parent named in ``source`` through the data plane
(:mod:`colobus._host.dataplane`), each chunk checked against the digest the
controller sent. Either way the host serves the block to the children whose
tokens are in ``serve`` from the moment it has each chunk, and answers the
TREEPUT once the block is stored. If the parent is lost, the controller sends
the block again, whole: that second TREEPUT completes the block and ends the
pull. A RELEASE of the TREEPUT's call id ends the serving.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

from .._wire import protocol as P
from .._wire.codec import from_buffer
from .._wire.envelope import Envelope, decode_dtype
from .._wire.protocol import TOKEN_BYTES, Status
from .dataplane import Blob
from .values import ChunkedBlock, jax_exact

if TYPE_CHECKING:
    from .sched import WorkerServices

__all__ = ["BlockStore", "HostTreePuts"]

_DIGEST_BYTES = 32


class BlockStore(Protocol):
    """What a TREEPUT uses of the host's arrays (:class:`colobus._host.arrays.HostArrays`)."""

    def store_block(self, fut: asyncio.Future[Any], ref: int, arr: Any, mesh: Any, spec: Any,
                    impl: str | None, memory: str | None) -> None: ...


class _Tree:
    """One TREEPUT on this host."""

    __slots__ = ("blob", "body", "epoch", "fut", "stored")

    def __init__(self, body: P.TreePut, fut: asyncio.Future[Any], blob: Blob,
                 epoch: int) -> None:
        self.body = body
        self.fut = fut
        self.blob = blob
        self.epoch = epoch
        self.stored = False


def _check(body: P.TreePut) -> None:
    if body.nbytes < 0 or body.chunk <= 0:
        raise ValueError("bad TREEPUT size")
    count = max(1, -(-body.nbytes // body.chunk))
    if len(body.digests) != count or not all(
            isinstance(d, bytes) and len(d) == _DIGEST_BYTES for d in body.digests):
        raise ValueError("bad TREEPUT digests")
    if body.source and not (len(body.source) == 2 and isinstance(body.source[0], str)
                            and isinstance(body.source[1], bytes)
                            and len(body.source[1]) == TOKEN_BYTES):
        raise ValueError("bad TREEPUT source")
    if not all(isinstance(t, bytes) and len(t) == TOKEN_BYTES for t in body.serve):
        raise ValueError("bad TREEPUT tokens")


def _strings(descr: Any) -> bool:
    return isinstance(descr, list) and len(descr) == 2 and descr[0] == "T"


def _whole(env: Envelope, nbytes: int) -> memoryview:
    if len(env.buffers) != 1:
        raise ValueError("TREEPUT without a source needs one buffer")
    buf = memoryview(env.buffers[0]).cast("B")
    if len(buf) != nbytes:
        raise ValueError(f"TREEPUT buffer of {len(buf)} bytes, not {nbytes}")
    return buf


class HostTreePuts:
    """The TREEPUT handler of one worker."""

    def __init__(self, worker: WorkerServices, arrays: BlockStore) -> None:
        self._w = worker
        self._arrays = arrays

    @property
    def _trees(self) -> dict[int, _Tree]:
        return self._w.store.trees  # dropped with the session's store

    def on_treeput(self, body: P.TreePut, env: Envelope) -> None:
        w = self._w
        try:
            _check(body)
        except ValueError as exc:  # answered, so the controller's put does not wait on
            w.reply_error(body.call_id, exc)
            raise
        plane = w.dataplane
        tree = self._trees.get(body.call_id)
        if tree is not None:  # the whole block, sent again: its source was lost
            if not tree.stored:
                whole = _whole(env, body.nbytes)
                if plane is not None:
                    plane.fill(body.call_id, whole)
                self._store(tree, whole)
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        w.store.arrays[body.ref] = fut
        w.store.puts.append((body.ref, env.seq))  # what a KeyError at a pin tells
        buf: memoryview | None = None
        try:
            if not body.source:
                buf = _whole(env, body.nbytes)
            if buf is None and plane is None:
                raise ValueError("this host has no data plane to take a TREEPUT from")
        except ValueError as exc:
            fut.set_exception(exc)
            fut.exception()
            w.reply_error(body.call_id, exc)
            return
        blob = Blob(body.nbytes, body.chunk, body.digests, buf)
        tree = self._trees[body.call_id] = _Tree(body, fut, blob, w.epoch)
        if plane is not None and body.serve:
            plane.offer(body.call_id, body.serve, blob)
        if buf is not None:
            self._store(tree, buf)
            return
        assert plane is not None
        endpoint, token = body.source

        def done() -> None:  # on the data thread
            try:
                loop.call_soon_threadsafe(self._pulled, tree)
            except RuntimeError:  # the loop closed: the worker is exiting
                pass

        plane.pull(body.call_id, endpoint, token, blob, done)

    def _pulled(self, tree: _Tree) -> None:
        """Loop thread: every chunk came from the parent and matched its digest."""
        if tree.epoch == self._w.epoch and not tree.stored:
            self._store(tree, None)

    def _store(self, tree: _Tree, buf: memoryview | None) -> None:
        """Store the block: ``buf`` whole, or (None) the chunks the blob pulled."""
        tree.stored = True
        body, fut = tree.body, tree.fut
        w = self._w
        impl = body.key_impl if isinstance(body.key_impl, str) else None
        epoch = tree.epoch
        fut.add_done_callback(lambda f: self._answer(body.call_id, epoch, f))
        try:
            mesh = w.values.local_mesh(body.mesh)
            spec = P.decode_spec(body.spec)
            chunks = tree.blob.chunks() if buf is None else [buf]
            dtype = decode_dtype(body.dtype) if not _strings(body.dtype) else None
            if len(chunks) > 1 and impl is None and dtype is not None and jax_exact(
                    w._jax, dtype):
                # Kept as the frames it came in; the first use makes it whole, once.
                sharding = w.values.sharding(mesh, spec, body.memory_kind)
                parts: list[Any] = [(None, c) for c in chunks]
                fut.set_result(ChunkedBlock(tuple(body.shape), dtype, parts, sharding,
                                            body.ref))
                return
            whole = chunks[0] if len(chunks) == 1 else memoryview(b"".join(chunks))
            arr = from_buffer(body.dtype, body.shape, whole)
        except Exception as exc:
            fut.set_exception(exc)
            fut.exception()
            return
        self._arrays.store_block(fut, body.ref, arr, mesh, spec, impl, body.memory_kind)

    def _answer(self, call_id: int, epoch: int, fut: asyncio.Future[Any]) -> None:
        w = self._w
        if epoch != w.epoch:
            return
        exc = None if fut.cancelled() else fut.exception()
        if exc is not None:
            w.reply_error(call_id, exc)
        else:
            w.send(P.Result(call_id, Status.OK, None))

    def release(self, calls: list[int]) -> None:
        """A RELEASE named these call ids: the blocks of those TREEPUTs are not served on."""
        plane = self._w.dataplane
        for call_id in calls:
            if self._trees.pop(call_id, None) is not None and plane is not None:
                plane.drop(call_id)
