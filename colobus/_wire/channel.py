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
from .envelope import BATCH_KIND, Buffer, Envelope, Outgoing, batched, encode
from .sockio import readable, recv_frames, send_frames, socket_fd

__all__ = ["Channel", "Peer", "router_socket"]

log = logging.getLogger("colobus.channel")


class Peer:
    """The other end of one session: sequence numbers both ways, the outbox, and
    what it has not acknowledged yet."""

    __slots__ = ("outbox", "recv_seq", "route", "send_seq", "session", "their_session",
                 "unacked")

    def __init__(self, route: list[bytes], session: bytes, their_session: bytes,
                 recv_seq: int = 0) -> None:
        self.route = route  # frames sent before each envelope: [identity] on a ROUTER
        self.session = session
        self.their_session = their_session
        self.send_seq = 0
        self.recv_seq = recv_seq
        self.outbox: list[Outgoing] = []
        # (seq, time sent, frames): kept until the peer's ack covers seq
        self.unacked: collections.deque[tuple[int, float, list[Buffer]]] = collections.deque()

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
        unacked = self.unacked
        ack = env.ack
        while unacked and unacked[0][0] <= ack:
            unacked.popleft()
        return None

    def forget(self) -> None:
        """The session is over: drop what waits to be sent or acknowledged."""
        self.outbox = []
        self.unacked.clear()


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
        self._step_scheduled = False
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
        self._step_scheduled = True
        self._loop.call_soon(self._end_step)
        # Only this peer's messages leave now: others queued earlier (frees moved
        # into every host's outbox) wait for the end of the step, and ride along
        # with what the step sends them then (a fan-out call: one envelope per host).
        if peer in self._dirty:  # it is (its outbox is not empty), unless forgotten
            self._dirty.remove(peer)
        self._send_outbox(peer, time.monotonic())

    def enqueue(self, peer: Peer, body: P.Body, payload: Buffer = b"",
                buffers: Sequence[Buffer] = (), pbufs: int = 0) -> None:
        """Append to ``peer``'s outbox without arranging a flush."""
        peer.outbox.append((body.kind, body.to_wire(), payload, buffers, pbufs))
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
        if not peers or sock.closed:
            return False
        now = time.monotonic()
        for peer in peers:
            self._send_outbox(peer, now)
        return True

    def _send_outbox(self, peer: Peer, now: float) -> None:
        """Send ``peer``'s queued messages, batched (the caller took it off ``_dirty``)."""
        sock = self.sock
        items, peer.outbox = peer.outbox, []
        for env in batched(items, peer.session, peer.their_session):
            peer.send_seq += 1
            env.seq = peer.send_seq
            env.ack = peer.recv_seq
            frames = encode(self._key, env)
            peer.unacked.append((env.seq, now, frames))
            if env.kind == BATCH_KIND:
                self.batches_sent += 1
            try:
                send_frames(sock, [*peer.route, *frames], self._flags)
            except zmq.ZMQError as exc:
                # No connection to that peer now (EHOSTUNREACH on a ROUTER, EAGAIN
                # on a DEALER): the message waits in ``unacked`` for a resend.
                log.debug("send failed (%s); resent once the peer is back", exc)

    def resend_stale(self, peers: Sequence[Peer], after: float) -> None:
        """Send again what ``peers`` left unacknowledged for ``after`` seconds.

        Copies carry their original sequence numbers, so the peer keeps the first
        it gets of each and drops the rest.
        """
        sock = self.sock
        if sock.closed:
            return
        now = time.monotonic()
        for peer in peers:
            unacked = peer.unacked
            if not unacked or now - unacked[0][1] < after:
                continue
            log.debug("resending %d unacknowledged messages", len(unacked))
            for i, (seq, _, frames) in enumerate(unacked):
                unacked[i] = (seq, now, frames)
                self.resent += 1
                try:
                    send_frames(sock, [*peer.route, *frames], self._flags)
                except zmq.ZMQError:
                    break

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
        try:
            while True:
                while readable(sock):
                    self._on_frames(recv_frames(sock))
                    if sock.closed:
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


def router_socket(ctx: zmq.Context[Any], max_message_bytes: int) -> zmq.Socket[Any]:
    """The controller's ROUTER, set up for colobus's channel (not yet bound)."""
    sock: zmq.Socket[Any] = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    # A worker that reconnects after a dropped connection keeps its routing id:
    # its new connection takes over the route even if the old one lingers.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    # libzmq refuses (and disconnects) a single frame over the limit before
    # colobus sees it; several smaller frames over it in total are counted there.
    sock.setsockopt(zmq.MAXMSGSIZE, min(max_message_bytes, (1 << 63) - 1))
    return sock
