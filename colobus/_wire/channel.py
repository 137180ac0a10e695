"""One socket's message flow, the same on both sides of the wire.

A :class:`Channel` owns a ZeroMQ socket on an event loop: it reads every ready
message per wake-up (the socket's FD is edge-triggered), queues outgoing
messages per :class:`Peer` and sends those queued in one loop step as one
BATCH envelope, numbers them, and keeps each until the peer acknowledges it.

Reliability across a dropped connection: ZeroMQ reconnects by itself, but what
was in flight when a TCP connection broke is gone. Every envelope header
carries ``ack``, the highest sequence number its sender has received; a sender
keeps what the peer has not acknowledged and sends it again when it stays
unacknowledged for ``resend_after`` seconds (:meth:`Channel.resend_stale`).
The receiver drops the copies it already has (their sequence numbers are not
new). A network blip shorter than the liveness timeout therefore costs nothing.

The controller's ROUTER serves many peers (each with its routing identity as
the first frame); a worker's DEALER has one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from . import protocol as P
from .chunks import ACK_KIND, CHUNKED_KIND, PART_KIND
from .envelope import Buffer, Envelope, pack_body
from .lane import encode, envelope_bytes
from .outflow import Outflow
from .peer import ACK_AFTER, DEFAULT_MAX_WINDOW, Peer, Via
from .resends import resend, resend_stale
from .sockio import EVENTS, NOBLOCK, POLLIN, _get, _poll, _recv, send_frames, socket_fd

__all__ = ["DEFAULT_MAX_WINDOW", "Channel", "Peer"]

log = logging.getLogger("colobus.channel")

DRAIN_BUDGET_S = 0.01  # one drain reads this long at most, then lets the loop run
# A drain that read some of a fan-out's replies (``Channel.linger``) waits this long
# (ms) for the rest before it lets the loop run: one wake-up of the loop for the replies
# of many hosts, not one for each few. ``COLOBUS_FANOUT_LINGER_MS=0`` turns it off.
LINGER_MS = int(os.environ.get("COLOBUS_FANOUT_LINGER_MS", "1"))
# A loop step that queued this many messages for one peer sends them at once: the peer
# starts on them while the step goes on (a burst of calls, made in one step, overlaps
# with the host running them). ``COLOBUS_EAGER_BATCH`` sets it (for A/B runs).
EAGER_BATCH = int(os.environ.get("COLOBUS_EAGER_BATCH", "64"))
# An ACK's body: empty, or this (a NACK: "I have a gap after ack, resend from there").
NACK_BODY = [1]


class Channel(Outflow):
    """A socket on the event loop: drain-all reads, batched sends, resends.

    Args:
        sock: the bound ROUTER or connected DEALER.
        key: the MAC key.
        loop: the loop that owns the socket.
        on_frames: called with each received multipart message (loop thread).
        send_flags: flags for sends (the worker sends ``NOBLOCK``: with no
            connection a message waits in ``unacked`` for a resend instead).
        before_flush: called before messages are queued or sent, while
            :attr:`before_flush_due` is set (the owner sets it as it queues work for
            the hook; the channel clears it as it calls): the controller moves its
            queued frees into the outboxes there, so a message never overtakes a
            free asked for earlier.
        after_flush: called after each flush inside a drain; True means read
            again (the worker's brief wait for calls it just started).
        before_drain: called as each drain starts (the worker forgets the calls
            that earlier drains started: only this drain's are worth waiting for).
        on_release: called with a peer whose acknowledgement freed some of what this
            side held for it (:attr:`Peer.held`; the controller's uploads wait on it).
        after_reads: called in a drain once it has read what waits, before it sends
            (the controller wakes the tasks whose futures the drain settled there).
        after_drain: called as each drain ends, however it ends.
    """

    def __init__(
        self,
        sock: zmq.Socket[Any],
        key: bytes,
        loop: asyncio.AbstractEventLoop,
        on_frames: Callable[[list[Any]], None],
        *,
        send_flags: int = 0,
        before_flush: Callable[[], None] | None = None,
        after_flush: Callable[[], bool] | None = None,
        before_drain: Callable[[], None] | None = None,
        on_release: Callable[[Peer], None] | None = None,
        after_reads: Callable[[], None] | None = None,
        after_drain: Callable[[], None] | None = None,
    ) -> None:
        self.sock = sock
        self._key = key
        self._loop = loop
        self._on_frames = on_frames
        self._flags = send_flags
        self._before_flush = before_flush
        self.before_flush_due = False  # before_flush has work (see the class docstring)
        self._after_flush = after_flush
        self._before_drain = before_drain
        self._on_release = on_release
        self._after_reads = after_reads
        self._after_drain = after_drain
        self._dirty: list[Peer] = []  # peers with messages in their outbox
        self._gathered: list[Via] = []  # relays given messages for their hosts (enqueue)
        self._blocked: set[Peer] = set()  # peers with envelopes waiting for the window
        self._owed: set[Peer] = set()  # peers owed an acknowledgement now
        self._step_scheduled = False
        self._corked = False  # inside a drain (or a burst): sends leave when it ends
        # set by the reader of a fan-out's reply (not its last): the drain waits
        # LINGER_MS for more before it ends
        self.linger = False
        self.batches_sent = 0
        self.resent = 0
        self.moved = False  # to another socket (a session that moved to a relay)
        self._fd = socket_fd(sock)
        loop.add_reader(self._fd, self.drain)

    @property
    def open(self) -> bool:
        return not self.sock.closed

    def close(self, linger_ms: int = 0) -> None:
        """Stop reading and close the socket (after ``linger_ms`` for what is queued)."""
        if self.sock.closed:
            return
        self._loop.remove_reader(self._fd)
        self.sock.setsockopt(zmq.LINGER, linger_ms)
        self.sock.close()

    # -- sending -----------------------------------------------------------------------

    def send(self, peer: Peer, body: P.Body, payload: Buffer = b"",
             buffers: Sequence[Buffer] = (), pbufs: int = 0) -> None:
        """Queue a message to ``peer`` (loop thread); messages to one peer keep their order.

        The first message of a loop step leaves at once (a lone call waits for
        nothing); the ones queued after it in the same step, or while corked,
        leave together as one BATCH when the step ends (or, uncorked, as soon as
        :data:`EAGER_BATCH` of them wait for ``peer``).
        """
        self.send_packed(peer, body.kind, pack_body(body.to_wire()), payload, buffers, pbufs)

    def send_packed(self, peer: Peer, kind: int, packed: bytes, payload: Buffer = b"",
                    buffers: Sequence[Buffer] = (), pbufs: int = 0) -> None:
        """:meth:`send` of a body already packed (a fan-out's CALLs share most bytes)."""
        if self.sock.closed:
            return
        if self.before_flush_due and self._before_flush is not None:
            self.before_flush_due = False
            self._before_flush()
        outbox = peer.outbox
        if peer.via is not None:
            self.enqueue_packed(peer, kind, packed, payload, buffers, pbufs)
        else:  # (enqueue_packed, inline: one call less on every call)
            outbox.append((kind, packed, payload, buffers, pbufs))
            n = len(payload) if type(payload) is bytes else memoryview(payload).nbytes
            for b in buffers:
                n += len(b) if type(b) is bytes else memoryview(b).nbytes
            peer.held += n
            if len(outbox) == 1:
                self._dirty.append(peer)
        if self._corked:
            return
        if self._step_scheduled:
            if len(outbox) >= EAGER_BATCH:  # a long step: the peer starts on these now
                self.send_now(peer)
            return
        self._step_scheduled = True
        self._loop.call_soon(self._end_step)
        # Only this peer's messages leave now: others queued earlier (frees moved
        # into every host's outbox) wait for the end of the step, and ride along
        # with what the step sends them then (a fan-out call: one envelope per host).
        if peer in self._dirty:  # it is (its outbox is not empty), unless forgotten
            self._dirty.remove(peer)
        self._send_outboxes((peer,), time.monotonic())

    def enqueue(self, peer: Peer, body: P.Body, payload: Buffer = b"",
                buffers: Sequence[Buffer] = (), pbufs: int = 0) -> None:
        """Append to ``peer``'s outbox without arranging a flush.

        Raises:
            SerializationError: the body cannot be encoded; nothing was queued, no
                sequence number spent, and the messages queued before it stay.
        """
        self.enqueue_packed(peer, body.kind, pack_body(body.to_wire()), payload, buffers, pbufs)

    def enqueue_packed(self, peer: Peer, kind: int, packed: bytes, payload: Buffer = b"",
                       buffers: Sequence[Buffer] = (), pbufs: int = 0) -> None:
        """:meth:`enqueue` of a body already packed (one packing for many peers)."""
        via = peer.via
        if via is not None:  # a relayed host's: straight into its relay's next message
            via.add(peer, kind, packed, payload, buffers, pbufs)
            if via not in self._gathered:
                self._gathered.append(via)
            return
        outbox = peer.outbox
        outbox.append((kind, packed, payload, buffers, pbufs))
        n = len(payload) if type(payload) is bytes else memoryview(payload).nbytes
        for b in buffers:  # (peer.data_bytes, inline)
            n += len(b) if type(b) is bytes else memoryview(b).nbytes
        peer.held += n
        if len(outbox) == 1:
            self._dirty.append(peer)

    def send_raw(self, route: list[bytes], env: Envelope) -> None:
        """Send one envelope outside any session's numbering (REJECT, RESET, HELLO)."""
        try:
            send_frames(self.sock, [*route, *encode(self._key, env)], self._flags)
        except zmq.ZMQError:
            pass
        self._loop.call_soon(self.drain)  # the send may have taken the FD's edge

    def cork(self) -> bool:
        """Hold sends until :meth:`uncork`; returns the previous state for it."""
        corked, self._corked = self._corked, True
        return corked

    def uncork(self, corked: bool) -> None:
        """Undo :meth:`cork`: what was held leaves now, and the socket is read after."""
        self._corked = corked
        if corked:
            return
        if not self._step_scheduled:
            self._step_scheduled = True
            self._loop.call_soon(self._end_step)
        self.flush()

    def flush(self) -> bool:
        """Send every peer's queued messages now, batched; True if anything was sent."""
        if self.before_flush_due and self._before_flush is not None:
            self.before_flush_due = False
            self._before_flush()
        if not (self._dirty or self._gathered or self._blocked or self._owed):
            return False  # (nothing to send: the end of most drains)
        peers, self._dirty = self._dirty, []
        vias, self._gathered = self._gathered, []
        sock = self.sock
        if sock.closed:
            return False
        now = time.monotonic()
        direct = peers
        for peer in peers:
            if peer.via is not None:  # a relayed host's: one message per relay, after
                direct = []
                break
        if direct is not peers:
            for peer in peers:
                via = peer.via
                if via is None:
                    direct.append(peer)
                    continue
                via.collect(peer)
                if via not in vias:
                    vias.append(via)
        self._send_outboxes(direct, now)
        for via in vias:
            self._emit(via, now)
        sent = bool(peers or vias)
        for peer in list(self._blocked):  # acknowledgements may have made room
            if peer.inflight < peer.window or not peer.unacked:
                self._pump(peer, now)
                sent = True
        if self._owed:
            self._send_acks()
            sent = True  # the sends may have taken the FD's edge
        return sent

    def send_now(self, peer: Peer) -> None:
        """Send what ``peer``'s outbox holds now, past the end of the loop step."""
        if peer in self._dirty:
            self._dirty.remove(peer)
            self._send_outboxes((peer,), time.monotonic())

    def move(self, sock: zmq.Socket[Any], peer: Peer) -> None:
        """Carry on on ``sock`` (a worker moving to its relay): the old socket closes,
        and an ACK to ``peer`` says at once that this side is there now (the other
        resends what it could not deliver before)."""
        if not self.sock.closed:
            self._loop.remove_reader(self._fd)
            self.sock.close(0)
        self.sock = sock
        self.moved = True
        self._fd = socket_fd(sock)
        self._loop.add_reader(self._fd, self.drain)
        peer.ack_due = True
        self._owed.add(peer)
        self._loop.call_soon(self._end_step)

    def take(self, peer: Peer, env: Envelope, max_total: int) -> Envelope | str | None:
        """An authenticated envelope of ``peer``'s session, in: the message it completes
        (itself, or a chunked message with its last part), None (an ACK, or a part
        before the last), or why it was refused (``"replay"``, ``"gap"``).

        Raises:
            Dropped: a chunked message broke the rules (see :meth:`Peer.deliver`).
        """
        held = peer.held
        if env.kind == ACK_KIND:  # outside the numbering: only its ack counts
            peer.acked(env.ack)
            if peer.held < held and self._on_release is not None:
                self._on_release(peer)
            if env.body == NACK_BODY and env.ack > peer.went_back:
                peer.went_back = env.ack  # the peer has a gap after env.ack: go back to it
                self._resend(peer, time.monotonic(), 0.0)
            return None
        refused = peer.accept(env)
        if peer.held < held and self._on_release is not None:
            self._on_release(peer)
        if refused is not None:
            if refused == "replay":  # a resend of what we have: it missed our ack
                peer.ack_due = True
                self._owed.add(peer)
            elif peer.nack_due:  # a gap: ask for what is missing now, not after a timeout
                self._owed.add(peer)
            return refused
        if env.buffers:  # large amounts are acknowledged at once (a window waits)
            peer.recv_owed += envelope_bytes(env)
            if peer.recv_owed >= ACK_AFTER:
                self._owed.add(peer)
        if env.kind in (CHUNKED_KIND, PART_KIND) or peer.assembly is not None:
            return peer.deliver(env, max_total)
        return env

    def _send_acks(self) -> None:
        owed, self._owed = self._owed, set()
        for peer in owed:
            due = peer.recv_seq > peer.acked_sent or peer.ack_due or peer.nack_due
            if due and peer.their_session:
                env = Envelope(ACK_KIND, peer.session, peer.their_session, 0,
                               NACK_BODY if peer.nack_due else [], ack=peer.recv_seq)
                peer.ack_due = peer.nack_due = False
                peer.acked_sent = peer.recv_seq
                peer.recv_owed = 0
                try:
                    send_frames(self.sock, [*peer.route, *encode(self._key, env)], self._flags)
                except zmq.ZMQError:
                    pass

    def resend_stale(self, peers: Sequence[Peer], after: float) -> None:
        """Send again what ``peers`` left unacknowledged for ``after`` seconds.

        Copies carry their original sequence numbers, so the peer keeps the first
        it gets of each and drops the rest. Each envelope (a part of a large message
        is one) is resent on its own, at most a window's worth per round, and while
        nothing is acknowledged the rounds back off (``after`` doubling up to
        :data:`colobus._wire.resends.BACKOFF_MAX` times).
        """
        resend_stale(self, peers, after)

    def _resend(self, peer: Peer, now: float, wait: float) -> None:
        resend(self, peer, now, wait)

    def _end_step(self) -> None:
        self._step_scheduled = False
        self.flush()
        # The ZeroMQ FD is edge-triggered: a send can consume the edge that
        # announced incoming messages, so read what waits after sending.
        self.drain()

    # -- receiving -------------------------------------------------------------------

    def drain(self) -> None:
        """Read and handle every waiting message; replies leave in batches."""
        sock = self.sock
        if sock.closed:
            return
        if self._before_drain is not None:
            self._before_drain()
        corked, self._corked = self._corked, True
        start = time.monotonic()
        after_reads = self._after_reads
        on_frames = self._on_frames
        try:
            while True:
                # Received until none waits (sockio.recv_frames inline: no call per
                # message): a receive that finds nothing has processed the socket's
                # commands as ZMQ_EVENTS does (the FD's edge is re-armed); one that
                # finds a message costs no system call. After the first message (most
                # drains read one) ZMQ_EVENTS asks instead: the same system calls, and
                # no zmq.Again, which pyzmq builds in Python (~2.6 us, 5 calls)
                first = True
                while True:
                    try:
                        frame = _recv(sock, NOBLOCK, False)
                    except zmq.Again:
                        break
                    frames = [frame]
                    while frame.more:
                        frame = _recv(sock, NOBLOCK, False)
                        frames.append(frame)
                    on_frames(frames)
                    if sock.closed:
                        return
                    if first:
                        first = False
                        if not _get(sock, EVENTS) & POLLIN:
                            break
                    if time.monotonic() - start > DRAIN_BUDGET_S:
                        # A flood (or a long burst) must not hold the loop: what else
                        # waits runs first, then this drain goes on where it stopped.
                        # Checked after every envelope: one BATCH can be 256 messages
                        # (a host storing 256 small PUTs takes ~0.1 s; 64 such batches
                        # between checks held its loop, heartbeats included, for 5 s).
                        if after_reads is not None:
                            after_reads()
                        self.flush()
                        self._loop.call_soon(self.drain)
                        return
                if after_reads is not None:
                    after_reads()
                    if sock.closed:
                        return
                sent = self.flush()
                if self._after_flush is not None and self._after_flush():
                    continue
                if self.linger:  # a fan-out's first replies came in: its others are near
                    self.linger = False
                    if _poll([(sock, POLLIN)], LINGER_MS):
                        continue
                # the sends may have taken the FD's edge: read again where a message waits
                if not sent or not _get(sock, EVENTS) & POLLIN:
                    break
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EAGAIN, zmq.ENOTSOCK):
                log.warning("socket error: %s", exc)
        finally:
            self._corked = corked
            if self._after_drain is not None:
                self._after_drain()

