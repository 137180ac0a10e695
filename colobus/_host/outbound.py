"""The worker's bodies out, to its controller: sent on the session's channel, batched
while corked, and on the lane (one RESULT, nothing ahead of it) numbered, kept and
sent in :meth:`Outbound.uncork` itself. A base of
:class:`~colobus._host.messages.MessagePath`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import zmq

from .._wire import protocol as P
from .._wire.channel import Channel, Peer
from .._wire.chunks import CHUNK_BYTES
from .._wire.envelope import _ARRAY9, _KEYED, _LEN, MAC_SIZE, PROTOCOL_VERSION, Buffer, Envelope
from .._wire.failures import describe_error
from .._wire.lane import ON, _keyed, pack
from .._wire.limits import BODY_INLINE_MAX
from .._wire.protocol import Status
from .._wire.sockio import COPY_BELOW, EVENTS, POLLIN, SNDMORE
from .._wire.splice import pack_body
from .fetched import FETCHER

__all__ = ["Outbound"]

log = logging.getLogger("colobus.worker")

_send: Any = zmq.backend.Socket.send  # (sockio's: the compiled methods)
_get: Any = zmq.backend.Socket.get  # (sockio.readable's: ZMQ_EVENTS)
_monotonic = time.monotonic
_Result = P.Result


class Outbound:
    """What the worker sends its controller."""

    _key: bytes
    _hostname: str
    _chan: Channel | None
    _peer: Peer | None
    loop: asyncio.AbstractEventLoop | None

    def _read(self) -> None:
        """Read the socket (:class:`~colobus._host.messages.MessagePath`'s reader)."""
        raise NotImplementedError

    def send(self, body: P.Body, payload: Buffer = b"", buffers: Sequence[Buffer] = (),
             pbufs: int = 0) -> None:
        """Send a message to this session's controller (batched while corked).

        Raises:
            SerializationError: the body cannot be encoded (nothing was queued).
        """
        try:
            packed = pack([body.call_id, body.status, body.meta, body.times]  # (to_wire)
                          if type(body) is _Result else body.to_wire())
        except (TypeError, ValueError, OverflowError):
            packed = pack_body(body.to_wire())  # raises the SerializationError
        self.send_packed(body.kind, packed, payload, buffers, pbufs)

    def send_packed(self, kind: int, packed: bytes, payload: Buffer = b"",
                    buffers: Sequence[Buffer] = (), pbufs: int = 0) -> None:
        """:meth:`send` of a body already packed (a RESULT packed by its maker)."""
        chan, peer = self._chan, self._peer
        if chan is None or peer is None:
            return
        if not (ON and chan._corked and peer.via is None):
            chan.send_packed(peer, kind, packed, payload, buffers, pbufs)
            return
        # Channel.enqueue_packed, while corked (the lane: it leaves at uncork), written out
        item = (kind, packed, payload, buffers, pbufs)
        if peer.outbox:
            peer.outbox.append(item)
        else:  # (a new list where a list.append would do: it is one C call fewer)
            peer.outbox = [item]
            dirty = chan._dirty
            if dirty:
                dirty.append(peer)
            else:
                chan._dirty = [peer]
        n = (0 if not payload else
             len(payload) if type(payload) is bytes else memoryview(payload).nbytes)
        for b in buffers:
            n += len(b) if type(b) is bytes else memoryview(b).nbytes
        peer.held += n

    def cork(self) -> bool:
        """Hold sends until :meth:`uncork`; the previous state, for it."""
        chan = self._chan
        if chan is None:
            return False
        corked, chan._corked = chan._corked, True
        return corked

    def uncork(self, corked: bool) -> None:
        """Undo :meth:`cork`: what was held leaves now.

        The lane: one message waits, for the session's peer alone, with nothing ahead
        of it (no envelope waiting for the window, no acknowledgement owed) and room in
        the window for it whole; it is numbered, kept until acknowledged and sent here,
        as :meth:`Channel.flush` would, and the socket read after only if a message
        waits (the send may have taken the FD's edge). Else :meth:`Channel.uncork`.
        """
        chan, peer = self._chan, self._peer
        if chan is None:
            return
        if corked or peer is None or not ON:
            chan.uncork(corked)
            return
        sock = chan.sock
        outbox = peer.outbox
        if not (len(outbox) == 1 and chan._dirty == [peer] and not chan._gathered
                and not chan._blocked and not chan._owed and not peer.pending
                and peer.via is None and (peer.inflight < peer.window or not peer.unacked)
                and not sock.closed):
            chan.uncork(corked)
            return
        kind, packed, payload, bufs, pbufs = outbox[0]
        plen = data = (0 if not payload else
                       len(payload) if type(payload) is bytes else memoryview(payload).nbytes)
        for b in bufs:
            data += len(b) if type(b) is bytes else memoryview(b).nbytes
        blen = len(packed)
        if blen > BODY_INLINE_MAX or (data and data + blen > CHUNK_BYTES and data + blen > max(
                CHUNK_BYTES, min(peer.max_part, peer.window >> 2))):  # chunks.part_size
            chan.uncork(corked)
            return
        chan._corked = False
        chan._dirty = []
        peer.outbox = []
        # Channel._transmit: numbered, kept until acknowledged, sent
        peer.send_seq += 1
        seq = peer.send_seq
        # lane.fast_encode, a body inside the header
        head = pack([PROTOCOL_VERSION, kind, peer.session, peer.their_session, seq,
                     peer.recv_seq, [len(b) if type(b) is bytes else memoryview(b).nbytes
                                     for b in bufs] if bufs else [], pbufs])
        header = _ARRAY9 + head[1:] + packed
        hlen = len(header)
        keyed = _KEYED.get(self._key)
        h = (keyed if keyed is not None else _keyed(self._key)).copy()
        h.update(_LEN.pack(hlen) + header + _LEN.pack(plen))  # (envelope.mac's bytes)
        if plen:
            h.update(payload)
        tag = h.digest()
        frames: list[Buffer] = [header, payload, tag, *bufs] if bufs else [header, payload, tag]
        size = hlen + MAC_SIZE + data
        now = _monotonic()
        unacked = peer.unacked
        if not unacked:
            peer.ack_wait = now
        unacked.append((seq, now, frames, size, data))
        peer.inflight += size
        peer.acked_sent = peer.recv_seq
        peer.recv_owed = 0
        flags = chan._flags
        more = flags | SNDMORE
        try:  # sockio.send_frames (a DEALER's route is empty)
            _send(sock, header, more, hlen < COPY_BELOW)
            _send(sock, payload, more, plen < COPY_BELOW)
            if bufs:
                _send(sock, tag, more, True)
                last = len(bufs) - 1
                for i, b in enumerate(bufs):
                    _send(sock, b, more if i < last else flags,
                          (len(b) if type(b) is bytes else memoryview(b).nbytes) < COPY_BELOW)
            else:
                _send(sock, tag, flags, True)
        except zmq.ZMQError as exc:
            peer.undelivered = True
            log.debug("send failed (%s); resent once the peer is back", exc)
        if _get(sock, EVENTS) & POLLIN and self.loop is not None:
            self.loop.call_soon(self._read)

    def reply_error(self, call_id: int, exc: BaseException, times: list[int] | None = None
                    ) -> None:
        """Report ``exc`` as data (type name, plain args, message, notes, traceback)."""
        FETCHER.explain(exc)  # a module the controller could not provide says why
        self.send(P.Result(call_id, Status.ERROR, None, times or []),
                  describe_error(exc, self._hostname))

    def _send_join_raw(self, body: P.Body, payload: bytes = b"") -> None:
        """JOIN and HELLO: numbered outside the session's acknowledged stream. (A JOIN's
        payload is the worker's key id: a controller with another key names both.)"""
        assert self._chan is not None and self._peer is not None
        self._peer.send_seq += 1
        self._chan.send_raw([], Envelope(body.kind, self._peer.session, b"",
                                         self._peer.send_seq, body.to_wire(), payload))
