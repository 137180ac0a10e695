"""The controller's channel: one message to many peers at once (a fan-out).

A call, a free or a cancel to many hosts is one message, the same for each (or one
per distinct body). :class:`FanoutChannel` queues it for all of them in one go: a
relay's hosts' copies become one entry of the relay's next message, with no Python
work per host beyond finding its relay; hosts reached directly get it in their
outboxes as :meth:`Channel.send_packed` would. Where the peers are worked out once
(:meth:`FanoutChannel.fanout`), a caller that sends to the same peers again (a
fan-out call made every step) keeps the :class:`Fanout` while no host joined or was
lost, and sends with no step per relayed host at all.
"""

from __future__ import annotations

from collections.abc import Sequence

from .channel import EAGER_BATCH, Channel
from .envelope import Buffer
from .peer import Peer, Via
from .sockio import EVENTS, POLLIN, _get

__all__ = ["Fanned", "Fanout", "FanoutChannel", "Spliced"]


class Fanout:
    """One message's destinations, worked out once: the peers reached directly, and for
    each relay the indices of the hosts it carries."""

    __slots__ = ("direct", "relayed")

    def __init__(self, direct: list[Peer], relayed: list[tuple[Via, list[int]]]) -> None:
        self.direct = direct
        self.relayed = relayed


class Spliced:
    """One call's CALLs worked out once, for bodies that share a head and differ in
    their end (each host's part of the mesh): per relay its hosts and each one's end
    (one entry: the relay puts each body together), and the peers reached directly
    with theirs."""

    __slots__ = ("direct", "relayed")

    def __init__(self, direct: list[tuple[Peer, bytes]],
                 relayed: list[tuple[Via, list[int], list[bytes]]]) -> None:
        self.direct = direct
        self.relayed = relayed


class Fanned:
    """A fan-out call's destinations kept for its next calls (while no host joins or is
    lost): its hosts grouped by their part of the mesh, and those groups as one
    :class:`Spliced` for the host count its CALLs carry."""

    __slots__ = ("end", "groups", "spliced")

    def __init__(self, groups: list[tuple[bytes, Fanout]], end: bytes,
                 spliced: Spliced) -> None:
        self.groups = groups  # (packed mesh part, its peers)
        self.end = end  # what follows each mesh part (CallSplicer.end: the host count...)
        self.spliced = spliced


class FanoutChannel(Channel):
    """A :class:`Channel` that sends one message to many peers in one go."""

    def _end_step(self) -> None:
        """:meth:`Channel._end_step`, with no drain where nothing waits: the controller's
        drain hooks bracket its reads (the tasks woken by what it read), so a drain that
        reads nothing does only that read, whose ``zmq.Again`` pyzmq builds in Python
        (five Python calls, a call from a plain thread past 50). ``ZMQ_EVENTS`` asks
        with the same system calls (both process the socket's commands and re-arm the
        FD's edge, which a send may have taken)."""
        self._step_scheduled = False
        self.flush()
        if not self.sock.closed and _get(self.sock, EVENTS) & POLLIN:
            self.drain()

    def fanout(self, peers: Sequence[Peer]) -> Fanout:
        """Where a message to each of ``peers`` goes (valid while none joins, moves or
        is lost)."""
        direct: list[Peer] = []
        relayed: dict[Via, list[Peer]] = {}
        for peer in peers:
            via = peer.via
            if via is None:
                direct.append(peer)
            elif via in relayed:
                relayed[via].append(peer)
            else:
                relayed[via] = [peer]
        return Fanout(direct, [(via, via.carried(some)) for via, some in relayed.items()])

    def send_packed_many(self, peers: Sequence[Peer] | Fanout, kind: int, packed: bytes,
                         payload: Buffer = b"", buffers: Sequence[Buffer] = (),
                         pbufs: int = 0) -> None:
        """:meth:`send_packed` of one message to each of ``peers`` (a fan-out): a relay's
        hosts' copies join its next message as one entry; with no step under way,
        everything leaves now (else at the step's end, or once a peer's outbox holds
        :data:`EAGER_BATCH`)."""
        if self.sock.closed:
            return
        if self.before_flush_due and self._before_flush is not None:
            self.before_flush_due = False
            self._before_flush()
        direct = self.enqueue_packed_many(peers, kind, packed, payload, buffers, pbufs)
        if self._corked:
            return
        if self._step_scheduled:
            for peer in direct:
                if len(peer.outbox) >= EAGER_BATCH:
                    self.send_now(peer)
            return
        self._step_scheduled = True
        self._loop.call_soon(self._end_step)
        self.flush()

    def spliced(self, groups: Sequence[tuple[Fanout, bytes]]) -> Spliced:
        """The destinations of messages whose bodies are one head and then, for the
        peers of each :class:`Fanout`, its end (valid as long as the fan-outs)."""
        direct: list[tuple[Peer, bytes]] = []
        relayed: dict[Via, tuple[list[int], list[bytes]]] = {}
        for fan, tail in groups:
            for peer in fan.direct:
                direct.append((peer, tail))
            for via, hosts in fan.relayed:
                got = relayed.get(via)
                if got is None:
                    got = relayed[via] = ([], [])
                got[0].extend(hosts)
                got[1].extend([tail] * len(hosts))
        return Spliced(direct, [(via, h, t) for via, (h, t) in relayed.items()])

    def fanned(self, groups: list[tuple[bytes, Fanout]], end: bytes) -> Fanned:
        """A fan-out call's groups (packed mesh part, peers), kept: each CALL body is the
        call's head, then the group's mesh part and ``end`` (the host count, ...)."""
        return Fanned(groups, end, self.spliced([(fan, mesh + end) for mesh, fan in groups]))

    def send_fanned(self, to: Fanned, kind: int, head: bytes, end: bytes,
                    payload: Buffer = b"", buffers: Sequence[Buffer] = (),
                    pbufs: int = 0) -> None:
        """:meth:`send_spliced` of a kept fan-out's CALLs (their ends made again if the
        host count changed)."""
        if to.end != end:
            to.end = end
            to.spliced = self.spliced([(fan, mesh + end) for mesh, fan in to.groups])
        self.send_spliced(to.spliced, kind, head, payload, buffers, pbufs)

    def send_spliced(self, to: Spliced, kind: int, head: bytes, payload: Buffer = b"",
                     buffers: Sequence[Buffer] = (), pbufs: int = 0) -> None:
        """:meth:`send_packed_many` of the messages ``to`` describes, each peer's body
        ``head`` and then its own end: a relay's hosts' bodies go as one entry (the relay
        puts each together), with no Python step per relayed host at all."""
        if self.sock.closed:
            return
        if self.before_flush_due and self._before_flush is not None:
            self.before_flush_due = False
            self._before_flush()
        for via, hosts, tails in to.relayed:
            if hosts:
                via.add_spliced(hosts, kind, head, tails, payload, buffers, pbufs)
                if via not in self._gathered:
                    self._gathered.append(via)
        # (enqueue_packed for each direct peer, inline as in enqueue_packed_many: its size
        # counted once, no call per host)
        n = len(payload) if type(payload) is bytes else memoryview(payload).nbytes
        for b in buffers:
            n += len(b) if type(b) is bytes else memoryview(b).nbytes
        dirty = self._dirty
        for peer, tail in to.direct:
            outbox = peer.outbox
            outbox.append((kind, head + tail, payload, buffers, pbufs))
            peer.held += n
            if len(outbox) == 1:
                dirty.append(peer)
        if self._corked:
            return
        if self._step_scheduled:  # (as send_packed_many)
            for peer, _ in to.direct:
                if len(peer.outbox) >= EAGER_BATCH:
                    self.send_now(peer)
            return
        self._step_scheduled = True
        self._loop.call_soon(self._end_step)
        self.flush()

    def enqueue_packed_many(self, peers: Sequence[Peer] | Fanout, kind: int, packed: bytes,
                            payload: Buffer = b"", buffers: Sequence[Buffer] = (),
                            pbufs: int = 0) -> list[Peer]:
        """:meth:`enqueue_packed` for each of ``peers``; returns those not relayed."""
        to = peers if isinstance(peers, Fanout) else self.fanout(peers)
        for via, hosts in to.relayed:
            if hosts:
                via.add_indices(hosts, kind, packed, payload, buffers, pbufs)
                if via not in self._gathered:
                    self._gathered.append(via)
        # (enqueue_packed for each, its item and size made once: no call per host)
        item = (kind, packed, payload, buffers, pbufs)
        n = len(payload) if type(payload) is bytes else memoryview(payload).nbytes
        for b in buffers:
            n += len(b) if type(b) is bytes else memoryview(b).nbytes
        dirty = self._dirty
        for peer in to.direct:
            outbox = peer.outbox
            outbox.append(item)
            peer.held += n
            if len(outbox) == 1:
                dirty.append(peer)
        return to.direct
