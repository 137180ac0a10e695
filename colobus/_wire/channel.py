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
import collections
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from . import protocol as P
from .chunks import (
    ACK_KIND,
    CHUNK_BYTES,
    CHUNKED_KIND,
    PART_KIND,
    Assembly,
    envelope_bytes,
    split,
)
from .envelope import (
    BATCH_KIND,
    Buffer,
    Dropped,
    Envelope,
    Outgoing,
    batched,
    encode,
    pack_body,
)
from .sockio import readable, recv_frames, send_frames, socket_fd

__all__ = ["DEFAULT_MAX_WINDOW", "Channel", "Peer"]

HEARTBEAT_KIND = int(P.Kind.HEARTBEAT)

log = logging.getLogger("colobus.channel")


# Flow control: what one peer may hold unacknowledged, in bytes. The window starts
# at one part and grows while acknowledgements come back fast; it shrinks when they
# are slow, so what waits ahead of a heartbeat on a slow link stays short.
WINDOW_MIN = CHUNK_BYTES
DEFAULT_MAX_WINDOW = 1 << 24  # 16 MiB: Controller(send_window_bytes=...)
# Acknowledgements that come this much later than the shortest round trip seen let
# the window grow no further; twice this shrinks it.
TARGET_DELAY_S = 0.25
ACK_AFTER = CHUNK_BYTES  # a receiver acknowledges at once after this many bytes
DRAIN_BUDGET_S = 0.01  # one drain reads this long at most, then lets the loop run
BACKOFF_MAX = 16  # resends back off to 16 x resend_after while nothing is acknowledged


class Peer:
    """The other end of one session: sequence numbers both ways, the outbox, what waits
    for room in the window, what it has not acknowledged yet, and a chunked message
    being received."""

    __slots__ = ("ack_wait", "acked_sent", "assembly", "backoff", "base_delay", "inflight",
                 "last_cut",
                 "max_window", "outbox", "pending", "recv_owed", "recv_seq", "route",
                 "send_seq", "session", "their_session", "unacked", "window")

    def __init__(self, route: list[bytes], session: bytes, their_session: bytes,
                 recv_seq: int = 0, max_window: int = DEFAULT_MAX_WINDOW) -> None:
        self.route = route  # frames sent before each envelope: [identity] on a ROUTER
        self.session = session
        self.their_session = their_session
        self.send_seq = 0
        self.recv_seq = recv_seq
        self.outbox: list[Outgoing] = []
        # envelopes made from the outbox that wait for room in the window (unnumbered)
        self.pending: collections.deque[Envelope] = collections.deque()
        # (seq, time sent, frames, bytes): kept until the peer's ack covers seq
        self.unacked: collections.deque[tuple[int, float, list[Buffer], int]] = (
            collections.deque())
        self.inflight = 0  # bytes in ``unacked``
        self.max_window = max(WINDOW_MIN, max_window)
        self.window = WINDOW_MIN
        self.last_cut = 0.0
        self.base_delay = float("inf")  # the shortest round trip seen: the link's own
        self.ack_wait = 0.0  # since when ``unacked`` waits for the peer's next ack
        self.backoff = 1.0
        self.acked_sent = recv_seq  # the highest recv_seq we told the peer
        self.recv_owed = 0  # bytes received since then
        self.assembly: Assembly | None = None

    def accept(self, env: Envelope) -> str | None:
        """Take an authenticated envelope of this session, or say why not.

        Envelopes must come in sequence: ``"replay"`` for one already taken (a
        copy resent after a blip, or a replay), ``"gap"`` for one after a lost
        one (its sender resends from the gap on, since it is not acknowledged).
        """
        seq = env.seq
        if seq != self.recv_seq + 1:
            return "replay" if seq <= self.recv_seq else "gap"
        self.recv_seq = seq
        if self.unacked and self.unacked[0][0] <= env.ack:
            self.acked(env.ack)
        return None

    def acked(self, ack: int) -> None:
        """The peer has everything up to ``ack``: free it, and size the window."""
        unacked = self.unacked
        freed = 0
        sent = 0.0
        while unacked and unacked[0][0] <= ack:
            _, sent, _, n = unacked.popleft()
            freed += n
        if not freed:
            return
        now = time.monotonic()
        self.inflight -= freed
        self.ack_wait = now
        self.backoff = 1.0
        delay = now - sent
        self.base_delay = min(self.base_delay, delay)
        queued = delay - self.base_delay  # what the window adds to the round trip
        if queued < TARGET_DELAY_S:
            self.window = min(self.max_window, self.window + freed)
        elif queued > 2 * TARGET_DELAY_S and now - self.last_cut > delay:
            self.window = max(WINDOW_MIN, self.window * 7 // 10)
            self.last_cut = now

    def deliver(self, env: Envelope, max_total: int) -> Envelope | None:
        """The message an accepted envelope completes: itself, or a chunked message
        once its last part is in (None until then).

        Raises:
            Dropped: a part without a head, a head inside a chunked message, any other
                message between the parts (a heartbeat may come between them).
        """
        kind = env.kind
        assembly = self.assembly
        if kind == PART_KIND:
            if assembly is None:
                raise Dropped("malformed", "a part without its head")
            whole = assembly.feed(env)
            if whole is not None:
                self.assembly = None
            return whole
        if assembly is not None and kind != HEARTBEAT_KIND:
            raise Dropped("malformed", "a message between the parts of another")
        if kind == CHUNKED_KIND:
            self.assembly = Assembly(env, max_total)
            return None
        return env

    def forget(self) -> None:
        """The session is over: drop what waits to be sent or acknowledged."""
        self.outbox = []
        self.pending.clear()
        self.unacked.clear()
        self.inflight = 0
        self.assembly = None


class Channel:
    """A socket on the event loop: drain-all reads, batched sends, resends.

    Args:
        sock: the bound ROUTER or connected DEALER.
        key: the MAC key.
        loop: the loop that owns the socket.
        on_frames: called with each received multipart message (loop thread).
        send_flags: flags for sends (the worker sends ``NOBLOCK``: with no
            connection a message waits in ``unacked`` for a resend instead).
        before_flush: called before messages are queued or sent (the
            controller moves its queued frees into the outboxes there, so a
            message never overtakes a free asked for earlier).
        after_flush: called after each flush inside a drain; True means read
            again (the worker's brief wait for calls it just started).
        before_drain: called as each drain starts (the worker forgets the calls
            that earlier drains started: only this drain's are worth waiting for).
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
    ) -> None:
        self.sock = sock
        self._key = key
        self._loop = loop
        self._on_frames = on_frames
        self._flags = send_flags
        self._before_flush = before_flush
        self._after_flush = after_flush
        self._before_drain = before_drain
        self._dirty: list[Peer] = []  # peers with messages in their outbox
        self._blocked: set[Peer] = set()  # peers with envelopes waiting for the window
        self._owed: set[Peer] = set()  # peers owed an acknowledgement now
        self._step_scheduled = False
        self._sent_now = False  # a message left at once since the last read or step's end
        self._corked = False  # inside a drain (or a burst): sends leave when it ends
        self.batches_sent = 0
        self.resent = 0
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
        leave together as one BATCH when the step ends.
        """
        if self.sock.closed:
            return
        if self._before_flush is not None:
            self._before_flush()
        self.enqueue(peer, body, payload, buffers, pbufs)
        if self._corked or self._step_scheduled:
            return
        if self._sent_now:  # one left at once since the last read: the rest wait for the
            self._step_scheduled = True  # step's end (a lone message costs no iteration)
            self._loop.call_soon(self._end_step)
            return
        self._sent_now = True
        # Only this peer's messages leave now: others queued earlier (frees moved
        # into every host's outbox) wait for the end of the step, and ride along
        # with what the step sends them then (a fan-out call: one envelope per host).
        if peer in self._dirty:  # it is (its outbox is not empty), unless forgotten
            self._dirty.remove(peer)
        self._send_outbox(peer, time.monotonic())
        if self._dirty or self._blocked or self._owed:
            self._step_scheduled = True
            self._loop.call_soon(self._end_step)
        elif readable(self.sock):  # the send may have taken the FD's edge: read soon
            self._loop.call_soon(self.drain)

    def enqueue(self, peer: Peer, body: P.Body, payload: Buffer = b"",
                buffers: Sequence[Buffer] = (), pbufs: int = 0) -> None:
        """Append to ``peer``'s outbox without arranging a flush.

        Raises:
            SerializationError: the body cannot be encoded; nothing was queued, no
                sequence number spent, and the messages queued before it stay.
        """
        peer.outbox.append((body.kind, pack_body(body.to_wire()), payload, buffers, pbufs))
        if len(peer.outbox) == 1:
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
        if self._before_flush is not None:
            self._before_flush()
        peers, self._dirty = self._dirty, []
        sock = self.sock
        if sock.closed:
            return False
        now = time.monotonic()
        for peer in peers:
            self._send_outbox(peer, now)
        sent = bool(peers)
        for peer in list(self._blocked):  # acknowledgements may have made room
            if peer.inflight < peer.window or not peer.unacked:
                self._pump(peer, now)
                sent = True
        if self._owed:
            self._send_acks()
        return sent

    def _send_outbox(self, peer: Peer, now: float) -> None:
        """Send ``peer``'s queued messages, batched (the caller took it off ``_dirty``).

        Heartbeats leave at once, ahead of anything waiting for the window; large
        messages go in parts (:mod:`colobus._wire.chunks`); the rest leaves in order
        as the window has room.
        """
        items, peer.outbox = peer.outbox, []
        pending = peer.pending
        rest = items
        if len(items) > 1 or pending or peer.inflight >= peer.window:
            rest = []
            for item in items:
                if item[0] == HEARTBEAT_KIND:
                    self._transmit(peer, Envelope(item[0], peer.session, peer.their_session,
                                                  0, None, packed_body=item[1]), now)
                else:
                    rest.append(item)
        if rest:
            for env in batched(rest, peer.session, peer.their_session):
                if envelope_bytes(env) > CHUNK_BYTES:
                    pending.extend(split(env))
                else:
                    pending.append(env)
        self._pump(peer, now)

    def _pump(self, peer: Peer, now: float) -> None:
        """Send what waits for ``peer`` while its window has room (always one envelope
        when nothing is in flight)."""
        pending = peer.pending
        while pending and (peer.inflight < peer.window or not peer.unacked):
            self._transmit(peer, pending.popleft(), now)
        if pending:
            self._blocked.add(peer)
        else:
            self._blocked.discard(peer)

    def _transmit(self, peer: Peer, env: Envelope, now: float) -> None:
        """Number ``env``, keep it until acknowledged, and send it."""
        peer.send_seq += 1
        env.seq = peer.send_seq
        env.ack = peer.recv_seq
        frames = encode(self._key, env)
        size = sum(len(f) if type(f) is bytes else memoryview(f).nbytes for f in frames)
        if not peer.unacked:
            peer.ack_wait = now
        peer.unacked.append((env.seq, now, frames, size))
        peer.inflight += size
        peer.acked_sent = peer.recv_seq
        peer.recv_owed = 0
        if env.kind == BATCH_KIND:
            self.batches_sent += 1
        try:
            send_frames(self.sock, [*peer.route, *frames], self._flags)
        except zmq.ZMQError as exc:
            # No connection to that peer now (EHOSTUNREACH on a ROUTER, EAGAIN
            # on a DEALER): the message waits in ``unacked`` for a resend.
            log.debug("send failed (%s); resent once the peer is back", exc)

    def take(self, peer: Peer, env: Envelope, max_total: int) -> Envelope | str | None:
        """An authenticated envelope of ``peer``'s session, in: the message it completes
        (itself, or a chunked message with its last part), None (an ACK, or a part
        before the last), or why it was refused (``"replay"``, ``"gap"``).

        Raises:
            Dropped: a chunked message broke the rules (see :meth:`Peer.deliver`).
        """
        if env.kind == ACK_KIND:  # outside the numbering: only its ack counts
            peer.acked(env.ack)
            return None
        refused = peer.accept(env)
        if refused is not None:
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
            if peer.recv_seq > peer.acked_sent and peer.their_session:
                env = Envelope(ACK_KIND, peer.session, peer.their_session, 0, [],
                               ack=peer.recv_seq)
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
        :data:`BACKOFF_MAX` times).
        """
        sock = self.sock
        if sock.closed:
            return
        now = time.monotonic()
        for peer in peers:
            unacked = peer.unacked
            wait = after * peer.backoff
            if not unacked or now - unacked[0][1] < wait:
                continue
            peer.backoff = min(peer.backoff * 2, BACKOFF_MAX)
            budget = peer.window
            log.debug("resending unacknowledged messages (%d waiting)", len(unacked))
            for i, (seq, sent, frames, n) in enumerate(unacked):
                if now - sent < wait or budget <= 0:
                    break
                unacked[i] = (seq, now, frames, n)
                budget -= n
                self.resent += 1
                try:
                    send_frames(sock, [*peer.route, *frames], self._flags)
                except zmq.ZMQError:
                    break

    def _end_step(self) -> None:
        self._step_scheduled = False
        self._sent_now = False
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
        self._sent_now = False  # a read starts a new step
        corked, self._corked = self._corked, True
        start = time.monotonic()
        n = 0
        try:
            while True:
                while readable(sock):
                    self._on_frames(recv_frames(sock))
                    if sock.closed:
                        return
                    n += 1
                    if n % 64 == 0 and time.monotonic() - start > DRAIN_BUDGET_S:
                        # A flood (or a long burst) must not hold the loop: what else
                        # waits runs first, then this drain goes on where it stopped.
                        self.flush()
                        self._loop.call_soon(self.drain)
                        return
                sent = self.flush()
                if self._after_flush is not None and self._after_flush():
                    continue
                if not sent:
                    break  # else read again: the sends may have taken the FD's edge
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EAGAIN, zmq.ENOTSOCK):
                log.warning("socket error: %s", exc)
        finally:
            self._corked = corked

