"""Broadcast trees: a block that many hosts need leaves the controller a few times.

A ``device_put`` block that ``Controller(broadcast_tree=N)`` or more hosts hold
the same (a replicated array, or the replicas of a partly replicated one), of
:data:`TREE_MIN_BYTES` or more, goes down a tree of those hosts instead of the
star: the controller sends it whole to :data:`FANOUT` roots, and every host serves
it on to at most :data:`FANOUT` children through its data plane
(:mod:`colobus._host.dataplane`), chunk by chunk as the chunks arrive. So the
controller sends the block :data:`FANOUT` times whatever the number of hosts, and
a block reaches ``N`` hosts in ``log2(N)`` pipelined hops.

Every host of the tree gets its own TREEPUT over its authenticated link, in
order with everything else (later calls wait for the block on the host, as after
a PUT): the layout, the SHA-256 of every 4 MiB chunk (computed once, on the
caller's thread, or on another if the caller is the controller's loop), the
parent to pull from with a random token, and the tokens of its children. A host
takes only chunks that match their digests, so a relay can delay a block but never
change it.

Each host's TREEPUT is an operation of its own, answered once the block is
stored: a lost host fails only its own, and each of its children that has not
answered gets the block whole from the controller (that child keeps serving its
own children). Once every host answered or was lost, the controller releases
the TREEPUTs' call ids, and the hosts stop serving the block.
"""

from __future__ import annotations

import collections
import functools
import secrets
from typing import TYPE_CHECKING, Any

from .._controller.future import Future
from .._wire import protocol as P
from .._wire.protocol import TOKEN_BYTES, TREE_CHUNK_BYTES, chunk_digests

if TYPE_CHECKING:
    from .._controller.controller import Controller
    from .._controller.hosts import Host
    from .._wire.envelope import Envelope

__all__ = ["FANOUT", "TREE_MIN_BYTES", "TreePut", "plan_trees"]

FANOUT = 2  # roots the controller sends to, and children per host
TREE_MIN_BYTES = 1 << 20  # smaller blocks take the star: a tree's hops cost more than they save
# A child that has not stored the block this long after its parent did gets it whole
# from the controller (a relay cut off from its children, or one that serves garbage).
PATIENCE_S = 5.0
PATIENCE_RATE = 50e6  # bytes/s: and the time the block takes at this rate


def _none(host: Host, body: P.Result, env: Envelope) -> None:
    return None


def upload_sizes(leaves: list[tuple[list[tuple[int, P.Put, memoryview]], list[TreePut]]]
                 ) -> dict[int, int]:
    """The bytes a put's leaves (star messages and trees) send, by host."""
    sizes: collections.Counter[int] = collections.Counter()
    for msgs, trees in leaves:
        for h, _, buf in msgs:
            sizes[h] += buf.nbytes
        for tree in trees:
            sizes.update(tree.sizes())
    return sizes


def plan_trees(ctl: Controller, msgs: list[tuple[int, P.Put, memoryview]],
               index: list[tuple[slice, ...]]) -> list[TreePut]:
    """Take the messages of blocks that go down a tree out of ``msgs`` (the rest keep
    to the star); ``index[i]`` is the block of ``msgs[i]`` in the array."""
    least = ctl.broadcast_tree
    if least <= 0 or ctl._curve is not None or len(msgs) < least:
        return []  # every small put stops here, before any work
    keys = [tuple((s.start, s.stop) for s in ix) for ix in index]
    hosts = ctl._hosts
    groups: dict[Any, list[int]] = {}
    for i, (h, _, buf) in enumerate(msgs):
        if buf.nbytes >= TREE_MIN_BYTES and 0 <= h < len(hosts) and hosts[h].data:
            groups.setdefault(keys[i], []).append(i)
    trees = [TreePut(ctl, [msgs[i] for i in group])
             for group in groups.values() if len(group) >= least]
    if trees:
        taken = {i for group in groups.values() if len(group) >= least for i in group}
        msgs[:] = [m for i, m in enumerate(msgs) if i not in taken]
    return trees


class TreePut:
    """One block going down a tree of hosts: positions ``0..FANOUT-1`` are the roots; the
    children of position ``p`` are ``FANOUT * (p + 1) + j`` for ``j < FANOUT``."""

    def __init__(self, ctl: Controller, msgs: list[tuple[int, P.Put, memoryview]]) -> None:
        self.ctl = ctl
        self.hosts = [h for h, _, _ in msgs]
        self.bodies = [body for _, body, _ in msgs]
        buf = msgs[0][2]
        self.buf: memoryview | None = buf.cast("B") if buf.ndim != 1 or buf.format != "B" else buf
        self.nbytes = buf.nbytes
        # SHA-256 at ~1 GB/s: on the caller's thread, never on the loop's (there, the
        # put hashes on another thread before its messages leave: Operations.hold_for)
        self.digests: list[bytes] | None = None if ctl._on_loop_thread() else self.hash()
        n = len(msgs)
        self.tokens = [secrets.token_bytes(TOKEN_BYTES) for _ in range(n)]
        self.call_ids: dict[int, int] = {}
        self.gens: dict[int, int] = {}
        self.direct: set[int] = set()  # positions sent the block whole (a lost parent)
        self.settled: set[int] = set()
        self.left = n

    def hash(self) -> list[bytes]:
        """The digests of the block's chunks (any thread; hashlib lets go of the GIL)."""
        assert self.buf is not None
        self.digests = chunk_digests(self.buf, TREE_CHUNK_BYTES)
        return self.digests

    def sizes(self) -> dict[int, int]:
        """The bytes the controller sends, by host (the roots), for back-pressure."""
        return {h: self.nbytes for h in self.hosts[:FANOUT]}

    def children(self, p: int) -> range:
        first = FANOUT * (p + 1)
        return range(min(first, len(self.hosts)), min(first + FANOUT, len(self.hosts)))

    def start(self, gens: dict[int, int]) -> None:
        """Loop thread, in order with the put's other messages: one TREEPUT per host."""
        self.gens = gens
        for p, h in enumerate(self.hosts):
            fut = self.ctl._ops.submit((h,), functools.partial(self._send, p), _none,
                                       lambda _: None, backpressure=False, urgent=True)
            fut.add_done_callback(functools.partial(self._ended, p))

    def _body(self, p: int, call_id: int, whole: bool) -> P.TreePut:
        put = self.bodies[p]
        source: list[Any] = []
        if not whole:
            parent = self.hosts[p // FANOUT - 1]
            source = [self.ctl._hosts[parent].data, self.tokens[p]]
        digests = self.digests if self.digests is not None else self.hash()  # (a failed hash)
        return P.TreePut(call_id, put.ref, put.shape, put.dtype, put.mesh, put.spec,
                         put.key_impl, put.memory_kind, self.nbytes, TREE_CHUNK_BYTES, digests,
                         source, [self.tokens[c] for c in self.children(p)])

    def _send(self, p: int, call_id: int) -> None:
        self.call_ids[p] = call_id
        whole = p < FANOUT or p in self.direct
        self._post(p, self._body(p, call_id, whole), whole)

    def _post(self, p: int, body: P.TreePut, whole: bool) -> None:
        ctl = self.ctl
        host = ctl._hosts[self.hosts[p]]
        if ctl._closed or not host.alive:
            return
        if whole and self.buf is not None:
            ctl._send(host, body, b"", [self.buf])
            ctl._count("bytes_put", self.nbytes)
        else:
            ctl._send(host, body)

    def _ended(self, p: int, fut: Future[Any]) -> None:
        """Loop thread: host ``p`` stored the block, or failed, or was lost."""
        self.settled.add(p)
        self.left -= 1
        if fut.cancelled() or fut.exception() is not None:
            for c in self.children(p):  # they get it whole from here on
                self.direct.add(c)
                if c not in self.settled and c in self.call_ids:
                    self._resend(c)
        else:
            if p >= FANOUT and p not in self.direct:
                self.ctl._count("bytes_relayed", self.nbytes)
            loop = self.ctl._loop
            if self.children(p) and loop is not None:
                loop.call_later(PATIENCE_S + self.nbytes / PATIENCE_RATE, self._overdue, p)
        if self.left == 0:
            self._finish()

    def _overdue(self, p: int) -> None:
        """Loop thread: ``p`` stored the block a while ago; children still waiting for it
        get it whole (the data plane between them is cut, or ``p`` serves garbage)."""
        for c in self.children(p):
            if c not in self.settled and c not in self.direct and c in self.call_ids:
                self.direct.add(c)
                self.ctl._count("tree_overdue")
                self._resend(c)

    def _resend(self, c: int) -> None:
        host = self.ctl._hosts[self.hosts[c]]
        if host.alive and host.generation == self.gens.get(self.hosts[c], host.generation):
            self._post(c, self._body(c, self.call_ids[c], True), True)

    def _finish(self) -> None:
        """Every host answered or was lost: the block is not served any more."""
        ctl = self.ctl
        self.buf = None
        for p, h in enumerate(self.hosts):
            host = ctl._hosts[h]
            if (p in self.call_ids and self.children(p) and host.alive and not ctl._closed
                    and host.generation == self.gens.get(h, host.generation)):
                ctl._send(host, P.Release([], [self.call_ids[p]]))
