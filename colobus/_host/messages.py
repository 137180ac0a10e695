"""The worker's message path: frames in, to their handlers; bodies out, to its controller.

:class:`Worker` (:mod:`colobus._host.worker`) joins and leaves sessions; this part
of it reads what the session's :class:`~colobus._wire.channel.Channel` receives
(authenticated, in sequence, unbatched, parsed, dispatched by kind) and sends what
its handlers and scheduler answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import zmq

from .._wire import protocol as P
from .._wire.channel import DRAIN_BUDGET_S, Channel, Peer
from .._wire.chunks import CHUNK_BYTES
from .._wire.envelope import (
    _ARRAY9,
    _KEYED,
    _LEN,
    BATCH_KIND,
    MAC_SIZE,
    PROTOCOL_VERSION,
    Buffer,
    Dropped,
    Envelope,
    unpack_batch,
)
from .._wire.failures import describe_error
from .._wire.lane import ON, _keyed, decode, pack
from .._wire.limits import BODY_INLINE_MAX
from .._wire.peer import ACK_AFTER
from .._wire.protocol import Kind, Status
from .._wire.sockio import COPY_BELOW, NOBLOCK, POLLIN, SNDMORE
from .._wire.splice import pack_body

if TYPE_CHECKING:
    from .arrays import HostArrays
    from .sched import Scheduler
    from .store import Store

__all__ = ["Exit", "MessagePath"]

log = logging.getLogger("colobus.worker")

_CALL, _RELEASE = int(Kind.CALL), int(Kind.RELEASE)
_LANE_KINDS = (BATCH_KIND, _CALL, _RELEASE)  # what the lane reads (the rest: the general path)
_send: Any = zmq.backend.Socket.send  # (sockio's: the compiled methods)
_recv = zmq.backend.Socket.recv
_poll = zmq.backend.zmq_poll
_monotonic = time.monotonic
_Call, _Result = P.Call, P.Result


class Exit(Exception):
    """Leave the worker's serve loop with this exit code (from a handler)."""

    def __init__(self, code: int) -> None:
        self.code = code


class MessagePath:
    """The worker's side of one session's messages (a base of :class:`Worker`)."""

    connect: str
    dropped: dict[str, int]
    _key: bytes
    _hostname: str
    _chan: Channel | None
    _peer: Peer | None
    _joined: bool
    _last_heard: float
    _handlers: dict[int, Any]
    _lane_call: Any  # the CALL and RELEASE handlers the lane stands for (while in place)
    _lane_release: Any
    sched: Scheduler
    store: Store
    arrays: HostArrays
    loop: asyncio.AbstractEventLoop | None

    def _on_reset(self, env: Envelope) -> None:
        raise NotImplementedError

    # -- out ---------------------------------------------------------------------------

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
        chan, peer = self._chan, self._peer
        if chan is None or peer is None:
            return
        if not (ON and chan._corked and peer.via is None):
            chan.send_packed(peer, body.kind, packed, payload, buffers, pbufs)
            return
        # Channel.enqueue_packed, while corked (the lane: it leaves at uncork); the
        # lines of send_packed written out, one call fewer on every RESULT
        item = (body.kind, packed, payload, buffers, pbufs)
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

    def send_packed(self, kind: int, packed: bytes, payload: Buffer = b"",
                    buffers: Sequence[Buffer] = (), pbufs: int = 0) -> None:
        """:meth:`send` of a body already packed (a RESULT packed by its maker)."""
        chan, peer = self._chan, self._peer
        if chan is None or peer is None:
            return
        if not (ON and chan._corked and peer.via is None):
            chan.send_packed(peer, kind, packed, payload, buffers, pbufs)
            return
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
        if _poll([(sock, POLLIN)], 0) and self.loop is not None:
            self.loop.call_soon(self._read)

    def reply_error(self, call_id: int, exc: BaseException, times: list[int] | None = None
                    ) -> None:
        """Report ``exc`` as data (type name, plain args, message, notes, traceback)."""
        self.send(P.Result(call_id, Status.ERROR, None, times or []),
                  describe_error(exc, self._hostname))

    def _send_join_raw(self, body: P.Body) -> None:
        """JOIN and HELLO: numbered outside the session's acknowledged stream."""
        assert self._chan is not None and self._peer is not None
        self._peer.send_seq += 1
        self._chan.send_raw([], Envelope(body.kind, self._peer.session, b"",
                                         self._peer.send_seq, body.to_wire()))

    # -- in ----------------------------------------------------------------------------

    def _drop(self, reason: str, detail: str = "") -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        log.debug("dropped message (%s) %s", reason, detail)

    def _read(self) -> None:
        """The socket's reader on the lane: :meth:`Channel.drain`'s loop, with the
        socket read in place and the channel flushed only when something waits."""
        chan = self._chan
        if chan is None:
            return
        sock = chan.sock
        if sock.closed:
            return
        sched = self.sched
        sched.drain_starts()
        corked, chan._corked = chan._corked, True
        start = _monotonic()
        on_frames = self._on_frames
        try:
            while True:
                while _poll([(sock, POLLIN)], 0):
                    frame = _recv(sock, NOBLOCK, False)  # sockio.recv_frames
                    frames = [frame]
                    while frame.more:
                        frame = _recv(sock, NOBLOCK, False)
                        frames.append(frame)
                    on_frames(frames)
                    if sock.closed:
                        return
                    if _monotonic() - start > DRAIN_BUDGET_S:  # as Channel.drain
                        chan.flush()
                        if self.loop is not None:
                            self.loop.call_soon(self._read)
                        return
                sent = (chan.flush() if chan._dirty or chan._blocked or chan._owed
                        or chan._gathered else False)
                if sched.wait_briefly():
                    continue
                if not sent:
                    break  # else read again: the sends may have taken the FD's edge
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EAGAIN, zmq.ENOTSOCK):
                log.warning("socket error: %s", exc)
        finally:
            chan._corked = corked
            sched.drain_ends()

    def _on_frames(self, frames: list[Any]) -> None:
        peer = self._peer
        if peer is None:
            return
        try:
            env = decode(self._key, frames)
        except Dropped as d:
            if d.reason == "unauthenticated" and not self._joined:
                log.warning("a message from %s failed authentication: is the key the same "
                            "on both sides?", self.connect)
            self._drop(d.reason, d.detail)
            return
        if env.receiver != peer.session:
            self._drop("stale")
            return
        kind = env.kind
        if not self._joined:
            if kind not in (Kind.WELCOME, Kind.REJECT, Kind.CHALLENGE):
                self._drop("unexpected_kind")
                return
            peer.recv_seq = env.seq - 1
        elif env.sender != peer.their_session:
            self._drop("stale")
            return
        elif kind == Kind.RESET:  # the controller's last word, outside the numbering
            self._on_reset(env)
            return
        elif (ON and kind in _LANE_KINDS and env.seq == peer.recv_seq + 1
              and peer.assembly is None and self._chan is not None):
            # The lane: Channel.take of the next envelope in sequence (Peer.accept, the
            # acknowledgement owed for large amounts), then unbatched and handled.
            if peer.unacked and peer.unacked[0][0] <= env.ack:
                peer.acked(env.ack)
            peer.recv_seq = env.seq
            if env.buffers:
                owed = peer.recv_owed  # (lane.envelope_bytes)
                for b in env.buffers:
                    owed += b.nbytes if type(b) is memoryview else len(b)
                p = env.payload
                peer.recv_owed = owed + (p.nbytes if type(p) is memoryview else len(p))
                if peer.recv_owed >= ACK_AFTER:
                    self._chan._owed.add(peer)
            self._last_heard = _monotonic()
            self._lane_in(env)
            return
        try:
            got = self._chan.take(peer, env, 1 << 62) if self._chan is not None else None
            if isinstance(got, str):
                self._drop(got, f"seq {env.seq}, expecting {peer.recv_seq + 1}")
                return
            self._last_heard = _monotonic()
            if got is None:  # an ACK, or a part of a larger message
                return
            env = got
            if env.kind != Kind.BATCH:
                self._dispatch(env)
                return
            subs = unpack_batch(env)
        except Dropped as d:
            self._drop(d.reason, d.detail)
            return
        for sub in subs:
            self._dispatch(sub)

    def _lane_in(self, env: Envelope) -> None:
        """The messages of an accepted envelope of the lane, handled in order.

        A BATCH gets :func:`unpack_batch`'s checks first (a malformed one is dropped
        whole); then no envelope is made for a RELEASE (it reads only the sequence
        number) and the last message's is made of the batch's own. A CALL's fields
        and a RELEASE's are read from the decoded list where they are exactly what
        :func:`P.parse` accepts (else it parses them), and handled as
        :meth:`_dispatch` would.
        """
        payload, buffers = env.payload, env.buffers
        entries: Any = env.body
        count = 1
        if env.kind == BATCH_KIND:
            total = payload.nbytes if type(payload) is memoryview else len(payload)
            nbuf = len(buffers) if buffers else 0
            at = nb = count = 0
            checked = False
            if type(entries) is list:
                for entry in entries:  # unpack_batch's checks
                    if type(entry) is not list:
                        break
                    try:
                        kind, body, plen, nbufs, pbufs = entry
                    except ValueError:
                        break
                    if not (type(kind) is int and type(plen) is int and type(nbufs) is int
                            and type(pbufs) is int and kind != BATCH_KIND and plen >= 0
                            and 0 <= pbufs <= nbufs and at + plen <= total
                            and nb + nbufs <= nbuf):
                        break
                    at += plen
                    nb += nbufs
                    count += 1
                else:
                    checked = count > 0 and at == total and nb == nbuf
            if not checked:
                try:
                    unpack_batch(env)  # what is wrong with it
                except Dropped as d:
                    self._drop(d.reason, d.detail)
                return
            at = nb = 0
        handlers = self._handlers
        i = 0
        while i < count:
            sub: Envelope | None = env
            if env.kind != BATCH_KIND:  # alone (or the batch's last, made its own)
                kind, body = env.kind, env.body
            else:
                kind, body, plen, nbufs, pbufs = entries[i]
                if i == count - 1:  # the batch's envelope, made this message's
                    env.kind, env.body, env.pbufs = kind, body, pbufs
                    env.payload = (memoryview(payload)[at:] if at else
                                   payload if plen else b"")
                    if nb:
                        env.buffers = buffers[nb:]
                elif kind == _RELEASE and not plen and not nbufs:
                    sub = None  # made only if it is not read here
                else:
                    sub = Envelope(kind, env.sender, env.receiver, env.seq, body,
                                   memoryview(payload)[at:at + plen] if plen else b"",
                                   buffers[nb:nb + nbufs], pbufs, env.version, env.ack)
                at += plen
                nb += nbufs
            i += 1
            try:
                if kind == _CALL:
                    handler = handlers[kind]
                    if (handler is self._lane_call and type(body) is list
                            and len(body) == 8):
                        call_id, stream, digest, obj, method, refs, mesh, hosts = body
                        if (type(call_id) is int and type(stream) is int
                                and type(digest) is bytes and type(obj) is int
                                and type(method) is str and type(refs) is list
                                and type(mesh) is list and type(hosts) is int):
                            handler(_Call(call_id, stream, digest, obj, method, refs, mesh,
                                          hosts), sub)
                            continue
                    handler(P.parse(kind, body), sub)
                    continue
                if kind == _RELEASE:
                    handler = handlers[kind]
                    if handler is self._lane_release and type(body) is list:
                        n = len(body)
                        refs = calls = code = None
                        if n == 2:
                            refs, calls = body
                            code = []
                        elif n == 3:
                            refs, calls, code = body
                        if type(refs) is list and type(calls) is list and type(code) is list:
                            store = self.store  # HostArrays.on_release
                            store.release(refs, calls, code, env.seq)
                            if calls and store.trees:
                                self.arrays.trees.release(calls)
                            continue
                    if sub is None:
                        sub = Envelope(kind, env.sender, env.receiver, env.seq, body, b"", [],
                                       0, env.version, env.ack)
                    handler(P.parse(kind, body), sub)
                    continue
                assert sub is not None
                parsed = P.parse(kind, body)
                handlers[kind](parsed, sub)
            except (ValueError, KeyError) as exc:
                self._drop("malformed", str(exc))
            except Exit:
                raise
            except Exception:
                log.exception("error handling %s", kind)

    def _dispatch(self, env: Envelope) -> None:
        """Handle one authenticated message of this session's controller."""
        try:
            body = P.parse(env.kind, env.body)
            self._handlers[env.kind](body, env)
        except (ValueError, KeyError) as exc:
            self._drop("malformed", str(exc))
        except Exit:
            raise
        except Exception:
            log.exception("error handling %s", env.kind)
