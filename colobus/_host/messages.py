"""The worker's message path: frames in, to their handlers; bodies out, to its controller.

:class:`Worker` (:mod:`colobus._host.worker`) joins and leaves sessions; this part
of it reads what the session's :class:`~colobus._wire.channel.Channel` receives
(authenticated, in sequence, unbatched, parsed, dispatched by kind), and its base
:class:`~colobus._host.outbound.Outbound` sends what its handlers and scheduler
answer. The common messages (a CALL with a RELEASE riding ahead, its RESULT) take a
lane of few calls (``COLOBUS_CALL_LANE=0``: the general path everywhere).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import zmq

from .._wire import protocol as P
from .._wire.channel import DRAIN_BUDGET_S
from .._wire.envelope import BATCH_KIND, Dropped, Envelope, unpack_batch
from .._wire.lane import ON, decode
from .._wire.peer import ACK_AFTER
from .._wire.protocol import Kind
from .._wire.sockio import EVENTS, NOBLOCK, POLLIN, _get
from .outbound import Outbound

if TYPE_CHECKING:
    from .arrays import HostArrays
    from .sched import Scheduler
    from .store import Store

__all__ = ["Exit", "MessagePath"]

log = logging.getLogger("colobus.worker")

_CALL, _RELEASE = int(Kind.CALL), int(Kind.RELEASE)
_LANE_KINDS = (BATCH_KIND, _CALL, _RELEASE)  # what the lane reads (the rest: the general path)
_recv = zmq.backend.Socket.recv  # (sockio's: the compiled methods)
_monotonic = time.monotonic
_Call = P.Call


class Exit(Exception):
    """Leave the worker's serve loop with this exit code (from a handler)."""

    def __init__(self, code: int) -> None:
        self.code = code


class MessagePath(Outbound):
    """The worker's side of one session's messages (a base of :class:`Worker`)."""

    connect: str
    dropped: dict[str, int]
    _joined: bool
    _last_heard: float
    _handlers: dict[int, Any]
    _lane_call: Any  # the CALL and RELEASE handlers the lane stands for (while in place)
    _lane_release: Any
    sched: Scheduler
    store: Store
    arrays: HostArrays

    def _on_reset(self, env: Envelope) -> None:
        raise NotImplementedError

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
                # Received until none waits: a receive that finds nothing has processed
                # the socket's commands, as ZMQ_EVENTS does (the FD's edge is re-armed),
                # and a receive that finds a message costs no system call, where each
                # ZMQ_EVENTS does (getpid and poll, in libzmq's signaler). After the
                # first message ZMQ_EVENTS asks instead (as Channel.drain: no zmq.Again)
                first = True
                while True:
                    try:
                        frame = _recv(sock, NOBLOCK, False)  # sockio.recv_frames
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
                    if _monotonic() - start > DRAIN_BUDGET_S:  # as Channel.drain
                        chan.flush()
                        if self.loop is not None:
                            self.loop.call_soon(self._read)
                        return
                sent = (chan.flush() if chan._dirty or chan._blocked or chan._owed
                        or chan._gathered else False)
                if sched.wait_briefly():
                    continue
                # the sends may have taken the FD's edge: read again where a message waits
                if not sent or not _get(sock, EVENTS) & POLLIN:
                    break
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
                    n = len(body) if type(body) is list else 0
                    # (a spread call, on several hosts, has a ninth field: True)
                    if handler is self._lane_call and (n == 8 or (n == 9 and body[8] is True)):
                        call_id, stream, digest, obj, method, refs, mesh, hosts = (
                            body if n == 8 else body[:8])
                        if (type(call_id) is int and type(stream) is int
                                and type(digest) is bytes and type(obj) is int
                                and type(method) is str and type(refs) is list
                                and type(mesh) is list and type(hosts) is int):
                            handler(_Call(call_id, stream, digest, obj, method, refs, mesh,
                                          hosts, n == 9), sub)
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
