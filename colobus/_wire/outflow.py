"""What leaves for one peer: its outbox batched into envelopes, numbered, kept until
acknowledged, and sent as its send window allows (large messages in parts).

:class:`Outflow` is the part of :class:`colobus._wire.channel.Channel` that does it
(the channel queues messages into the outboxes and says when they leave). The common
case, a step's messages to one peer leaving as one envelope with nothing waiting
for the window, takes one function (:func:`colobus._wire.lane.fast_one_envelope`) and
the bookkeeping :meth:`Outflow._transmit` does, inline.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import zmq

from .chunks import CHUNK_BYTES, Splitter, part_size
from .envelope import BATCH_KIND, Envelope
from .lane import ON, batched, encode, envelope_bytes, fast_one_envelope
from .peer import HEARTBEAT_KIND, Peer, Via
from .sockio import COPY_BELOW, SNDMORE, send_envelope, send_frames

__all__ = ["Outflow"]

log = logging.getLogger("colobus.channel")

_send: Any = zmq.backend.Socket.send  # (sockio's: the compiled methods)


class Outflow:
    """The sending half of a channel (see the module docstring)."""

    sock: zmq.Socket[Any]
    _key: bytes
    _flags: int
    _dirty: list[Peer]  # peers with messages in their outbox
    _blocked: set[Peer]  # peers with envelopes waiting for the window
    batches_sent: int

    def _emit(self, via: Via, now: float) -> None:
        """What ``via`` collected, as a message to its relay, sent now."""
        link = via.emit()
        if link is not None:
            if link in self._dirty:
                self._dirty.remove(link)
            self._send_outboxes((link,), now)

    def _send_outboxes(self, peers: Iterable[Peer], now: float) -> None:
        """Send each peer's queued messages, batched (the caller took them off
        ``_dirty``): a fan-out's hosts in one loop, no call per host in the common case.

        Heartbeats leave at once, ahead of anything waiting for the window; large
        messages go in parts (:mod:`colobus._wire.chunks`); the rest leaves in order
        as the window has room.
        """
        sock, key, flags = self.sock, self._key, self._flags
        for peer in peers:
            via = peer.via
            if via is not None:  # a relayed host's messages leave in its relay's
                via.collect(peer)
                self._emit(via, now)
                continue
            items, peer.outbox = peer.outbox, []
            if (ON and not peer.pending and (peer.inflight < peer.window or not peer.unacked)):
                # The common case: all of it leaves now as one envelope (see _transmit)
                whole = peer.window >> 2  # (part_size, inline)
                if whole > peer.max_part:
                    whole = peer.max_part
                seq = peer.send_seq + 1
                one = fast_one_envelope(key, items, peer.session, peer.their_session, seq,
                                        peer.recv_seq,
                                        whole if whole > CHUNK_BYTES else CHUNK_BYTES)
                if one is not None:
                    frames, size, data, plen, batch = one
                    peer.send_seq = seq
                    if not peer.unacked:
                        peer.ack_wait = now
                    peer.unacked.append((seq, now, frames, size, data))
                    peer.inflight += size
                    peer.acked_sent = peer.recv_seq
                    peer.recv_owed = 0
                    if batch:
                        self.batches_sent += 1
                    if self._blocked:
                        self._blocked.discard(peer)
                    try:  # (sockio.send_envelope, inline)
                        for r in peer.route:
                            _send(sock, r, flags | SNDMORE, True)
                        if len(frames) == 3:
                            header, payload, mac = frames
                            _send(sock, header, flags | SNDMORE, True)
                            _send(sock, payload, flags | SNDMORE, plen < COPY_BELOW)
                            _send(sock, mac, flags, True)
                        else:
                            send_envelope(sock, (), frames, plen, flags)
                    except zmq.ZMQError as exc:  # (as _transmit)
                        peer.undelivered = True
                        log.debug("send failed (%s); resent once the peer is back", exc)
                    continue
            self._send_rest(peer, items, now)

    def _send_rest(self, peer: Peer, items: list[Any], now: float) -> None:
        """:meth:`_send_outboxes` of ``items``, taken from ``peer``'s outbox, otherwise
        than as one envelope sent whole."""
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
            whole = part_size(peer.window, peer.max_part)  # more travels in parts
            for env in batched(rest, peer.session, peer.their_session):
                # the body counts (one over 64 KiB shares the payload's frame), but a
                # message of body alone travels whole: it has nothing to cut
                n = envelope_bytes(env)
                body = env.packed_body
                if n and n + (len(body) if body is not None else 0) > whole:
                    pending.append(Splitter(env))
                else:
                    pending.append(env)
        self._pump(peer, now)

    def _pump(self, peer: Peer, now: float) -> None:
        """Send what waits for ``peer`` while its window has room (always one envelope
        when nothing is in flight)."""
        pending = peer.pending
        while pending and (peer.inflight < peer.window or not peer.unacked):
            head = pending[0]
            if not isinstance(head, Splitter):
                self._transmit(peer, pending.popleft(), now)  # type: ignore[arg-type]
                continue
            self._transmit(peer, head.next(part_size(peer.window, peer.max_part)), now)
            if head.done:
                pending.popleft()
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
        size = 0
        for f in frames:
            size += len(f) if type(f) is bytes else memoryview(f).nbytes
        if not peer.unacked:
            peer.ack_wait = now
        peer.unacked.append((env.seq, now, frames, size, envelope_bytes(env)))
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
            peer.undelivered = True
            log.debug("send failed (%s); resent once the peer is back", exc)
