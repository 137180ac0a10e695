"""Resharding a ``cb.Array``: each host gets the blocks it lacks, through the controller.

There is no host-to-host data plane yet, so what travels goes source host ->
controller -> destination host(s): a FETCH of one box of the source's block, its
reply's frame viewed without a copy and sent on as the buffer of one PIECE per
destination that needs it (a box several hosts need is fetched once). At most
:data:`WINDOW_BYTES` of fetched data (and :data:`WINDOW_MOVES` boxes) are in
flight at once, so the controller never holds a large array whole.

One :class:`Reshard` per ``device_put``. Its RESHARD operation (every host of
the plan; :mod:`colobus._host.reshard`) goes through the backlog like a PUT, so
it is ordered with everything else: each destination makes the new array's
store entry when it arrives (later calls wait for it there) and copies what it
already holds; lenders hold their source entries. The moves then leave at once
(``urgent``: they must not queue behind later calls that wait for them). A
destination answers the RESHARD once its block is stored; when all did, the
holds are released. Any failure (a host lost, a FETCH or a conversion that
fails) fails the new array as a whole: every destination drops its block and
what waits for it fails with a ``HostLostError``; the handle raises it at use.
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Protocol

from .._controller.controller import Controller
from .._controller.future import Future
from .._controller.hosts import Host
from .._errors import HostLostError
from .._model.blocks import HostBlock
from .._model.moves import Box, Move, ReshardPlan
from .._model.sharding import NamedSharding, Sharding
from .._wire import protocol as P
from .._wire.codec import dtype_to_wire, to_buffer
from .._wire.describe import BadReply, read_fetched
from .._wire.envelope import Envelope

__all__ = ["WINDOW_BYTES", "WINDOW_MOVES", "Reshard", "mesh_message"]

WINDOW_BYTES = 64 << 20
"""Fetched bytes the controller holds at once for one reshard (at least one box)."""
WINDOW_MOVES = 16


def mesh_message(block: HostBlock) -> list[Any]:
    """A host's part of a layout as a message: ``[[[platform, local id]...], shape, names]``,
    and the axis types by name where one is not Auto."""
    devs = [[d.platform, d.local_id] for d in block.local_devices.flat]
    sh = block.local_sharding
    if isinstance(sh, NamedSharding):
        mesh = sh.mesh
        out = [devs, list(block.local_devices.shape), list(mesh.axis_names)]
        if mesh.has_axis_types:
            out.append(list(mesh.axis_type_names))
        return out
    return [devs, [], []]


class Handle(Protocol):
    """What a reshard uses of the ``cb.Array`` it makes and the one it reads."""

    ref: int
    dtype: Any
    _failed: BaseException | None
    _ready: bool


def _wire_box(box: Box) -> list[list[int]]:
    return [[lo, hi] for lo, hi in box]


def _none(host: Host, body: P.Result, env: Envelope) -> None:
    return None


class Reshard:
    """One reshard in flight, from its RESHARD operation to the release of its holds."""

    def __init__(self, ctl: Controller, src: Handle, new: Handle, sharding: Sharding,
                 plan: ReshardPlan, key_impl: str | None) -> None:
        self.ctl = ctl
        self.src: Handle | None = src  # held (not collected, not released) until the end
        self.new = new
        self.sharding = sharding
        self.plan = plan
        self.key_impl = key_impl
        self.holds = {h: ctl._ops.next_id() << 16 for h in sorted(plan.lenders)}
        self.gens = {h: ctl._hosts[h].generation for h in plan.hosts}
        self.moves: collections.deque[Move] = collections.deque(plan.moves)
        self.in_flight = 0
        self.bytes_in_flight = 0
        # Bytes asked of each source and not answered yet: a host sends the replies of
        # one loop step as one envelope, which must stay under what the controller takes.
        self.asked: dict[int, int] = {}
        self.reply_budget = max(1, ctl.max_message_bytes // 2)
        self.failed: BaseException | None = None
        self.ended = False

    def start(self) -> Future[Any]:
        """Submit the RESHARD operation (any thread); the moves follow once it left."""
        fut = self.ctl._ops.submit(self.plan.hosts, self._send, _none, lambda _: None,
                                   backpressure=False)
        fut.add_done_callback(self._ended)
        return fut

    # -- the RESHARD operation ------------------------------------------------------------

    def _send(self, call_id: int) -> None:
        """Loop thread: one RESHARD per host of the plan, then the first moves."""
        from jax.sharding import PartitionSpec

        ctl, plan = self.ctl, self.plan
        src = self.src
        assert src is not None
        spec = P.encode_spec(self.sharding.spec if isinstance(self.sharding, NamedSharding)
                             else PartitionSpec())
        dtype = None if self.key_impl else dtype_to_wire(self.new.dtype)
        for h in plan.hosts:
            holds = [[src.ref, self.holds[h]]] if h in self.holds else []
            block = plan.blocks.get(h)
            if block is None:  # a lender only
                body = P.Reshard(call_id, 0, [], None, [], [], None, None, [], 0, holds)
            else:
                local = [[src.ref, _wire_box(a), _wire_box(b)] for a, b in plan.local[h]]
                body = P.Reshard(call_id, self.new.ref, list(block.shape), dtype,
                                 mesh_message(block), spec, self.key_impl,
                                 self.sharding.memory_kind, local, plan.pieces.get(h, 0),
                                 holds)
            ctl._send(ctl._hosts[h], body)
        self._pump()

    def _ended(self, fut: Future[Any]) -> None:
        """The RESHARD operation ended: every destination stored its block, or not."""
        if fut.cancelled():
            self._fail(RuntimeError("the reshard was cancelled"))
        elif (exc := fut.exception()) is not None:
            self._fail(exc)
        else:
            self._finish()

    # -- moves ------------------------------------------------------------------------------

    def _pump(self) -> None:
        """Start moves while the window has room (at least one at a time), each from a
        source whose unanswered fetches leave room for it in one reply envelope."""
        while self.moves and self.failed is None and (
                self.in_flight == 0 or (self.in_flight < WINDOW_MOVES
                                        and self.bytes_in_flight < WINDOW_BYTES)):
            move = self._next_move()
            if move is None:
                return
            self.in_flight += 1
            self.bytes_in_flight += move.nbytes
            self.asked[move.source] = self.asked.get(move.source, 0) + move.nbytes
            self._fetch(move)

    def _next_move(self) -> Move | None:
        for i, move in enumerate(self.moves):
            asked = self.asked.get(move.source, 0)
            if asked == 0 or asked + move.nbytes <= self.reply_budget:
                del self.moves[i]
                return move
        return None

    def _fetch(self, move: Move) -> None:
        ctl = self.ctl
        host = ctl._hosts[move.source]
        body = P.Fetch(0, self.holds[move.source], True, _wire_box(move.box))

        def send(call_id: int) -> None:
            ctl._send(host, P.Fetch(call_id, body.ref, True, body.box))

        fut = ctl._ops.submit((move.source,), send, functools.partial(self._decode, move),
                              lambda values: values[move.source], backpressure=False,
                              urgent=True)
        fut.add_done_callback(functools.partial(self._fetched, move))

    def _decode(self, move: Move, host: Host, body: P.Result, env: Envelope) -> Any:
        block = read_fetched(body.meta, env.buffers)  # a view on the received frame
        want = tuple(hi - lo for lo, hi in move.box)
        if tuple(block.shape[:len(want)]) != want:
            raise BadReply(f"a reshard box of shape {want} came back as {block.shape}")
        self.ctl._count("bytes_fetched", block.nbytes)
        return block

    def _fetched(self, move: Move, fut: Future[Any]) -> None:
        self.asked[move.source] -= move.nbytes
        if self.failed is not None:
            return
        if fut.cancelled() or fut.exception() is not None:
            self._fail(fut.exception() or RuntimeError("a reshard fetch was cancelled"))
            return
        block = fut.result()
        descr, buf = to_buffer(block)  # zero-copy: the same frame goes on
        ctl = self.ctl
        left = [len(move.to)]
        for h, box in move.to:
            host = ctl._hosts[h]

            def send(call_id: int, host: Host = host, box: Box = box) -> None:
                ctl._send(host, P.Piece(call_id, self.new.ref, _wire_box(box),
                                        list(block.shape), descr), b"", [buf])
                ctl._count("bytes_put", buf.nbytes)
                ctl._count("bytes_resharded", buf.nbytes)

            piece = ctl._ops.submit((h,), send, _none, lambda _: None, backpressure=False,
                                    urgent=True)
            piece.add_done_callback(functools.partial(self._placed, move, left))
        self._pump()  # the source has room for another

    def _placed(self, move: Move, left: list[int], fut: Future[Any]) -> None:
        if self.failed is not None:
            return
        if fut.cancelled() or fut.exception() is not None:
            self._fail(fut.exception() or RuntimeError("a reshard piece was cancelled"))
            return
        left[0] -= 1
        if left[0] == 0:  # every destination copied it: the frame can go
            self.in_flight -= 1
            self.bytes_in_flight -= move.nbytes
            self._pump()

    # -- endings ------------------------------------------------------------------------------

    def _finish(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self.failed is None:
            self.new._ready = True
        self._release_holds()

    def _fail(self, exc: BaseException) -> None:
        """Fail the new array as a whole: every destination drops its block."""
        if self.failed is not None or self.ended:
            return
        self.failed = exc
        self.moves.clear()
        text = f"the device_put that resharded this array failed: {exc}"
        self.new._failed = exc
        ctl = self.ctl
        for h in self.plan.blocks:
            host = ctl._hosts[h]
            if not ctl._closed and host.alive and host.generation == self.gens[h]:
                ctl._send(host, P.Piece(0, self.new.ref, [], [], None, text,
                                        isinstance(exc, HostLostError)))
        self._finish()

    def _release_holds(self) -> None:
        ctl = self.ctl
        for h, hold in self.holds.items():
            host = ctl._hosts[h]
            if host.alive and host.generation == self.gens[h]:
                ctl._send(host, P.Release([hold], []))
        self.src = None
