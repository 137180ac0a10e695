"""The common reply's lane, controller side: a RESULT off the socket to its Future's
result in few Python calls.

A RESULT that ends a one-host call (the common call's reply: one message in its own
envelope, no buffers, its body inside the header) goes through the steps the general
path takes -- :meth:`Sessions.on_frames`, ``decode``, :meth:`Channel.take`,
:meth:`Operations.on_result`, :meth:`Operation.answered` and :meth:`Operation.end`, the
combiner, :meth:`Future.set_result` -- in one function here: the same checks in the
same order (sizes, MAC, header, session, sequence, acknowledgement, liveness, body,
owed), with no intermediate objects. Its outputs come from :data:`SETTLERS`: the
colocated call's one registers a builder that makes the output handles from what the
same description built before (``colobus._api.outputs``).

Whatever else comes in, or anything unusual about a RESULT (an error, a cancelled call,
a reply nobody owes, a traced call, a malformed field, a relay), takes the general path
where it stands, with what was read so far, so that every message is checked and
counted (drops, violations) exactly as there. ``COLOBUS_CALL_LANE=0`` (read at import)
keeps the general path for every message.

A call's RESULT may also answer the ``block_until_ready`` wait its host held for the
call (protocol 13): :func:`answer_fetch` reads that part of a RESULT for both paths (the
general path's RESULT handler is :func:`on_result`), so the lane and the general path
answer it alike.
"""

from __future__ import annotations

import collections
import hmac
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgpack
import zmq

from .._wire import protocol as P
from .._wire.channel import LINGER_MS
from .._wire.envelope import _KEYED, _LEN, MAC_SIZE, PROTOCOL_VERSION, Envelope
from .._wire.lane import _keyed
from .._wire.limits import COUNT_ABOVE
from .._wire.peer import TARGET_DELAY_S, WINDOW_MIN
from .future import _FINISHED, _LOCK, _PENDING
from .hangups import SRCFD
from .wakeups import _HELD, wake

__all__ = ["MISS", "SETTLERS", "ResultLane"]

# A builder that cannot build a reply's outputs from what it has seen says so with this.
MISS: Any = object()
# A decoder (``Operation.decode``) -> (build, learn, read): ``build(combiner, host,
# description bytes, count, times)`` is a one-host operation's result, or MISS (``times``:
# the RESULT's, or None); ``learn(combiner,
# host, bytes, count, result)`` is told what the general path built for a MISS;
# ``read(payload, count)`` is one host's value (the decoder's, from the payload alone:
# a fan-out's replies before its last).
SETTLERS: dict[Any, tuple[Callable[[Any, int, bytes, int, Any], Any],
                          Callable[[Any, int, bytes, int, Any], None],
                          Callable[[Any, int], Any]]] = {}

# A fan-out's replies before its last: what ``read`` made of a description (read, bytes,
# count) -> value, for descriptions up to READ_MAX bytes, READ_KEPT of them.
_READ: dict[tuple[Any, bytes, int], Any] = {}
READ_MAX = 4096
READ_KEPT = 256
LINGER = LINGER_MS > 0

RESULT = int(P.Kind.RESULT)
BATCH = int(P.Kind.BATCH)
OK = int(P.Status.OK)
MAX_OUTPUTS = P.MAX_OUTPUTS
_Frame = zmq.Frame
_unpack = msgpack.unpackb
_compare = hmac.compare_digest
_monotonic = time.monotonic
_get_ident = threading.get_ident


def _batch(entries: Any, total: int) -> list[tuple[int, Any, int]] | None:
    """A BATCH's messages (kind, body, payload length) where its body passes
    :func:`unpack_batch`'s checks and no message carries buffers (the lane's: a reply's
    description is its payload); else None (the general path reads, or drops, it)."""
    if type(entries) is not list or not entries:
        return None
    out = []
    at = 0
    for entry in entries:
        if type(entry) is not list or len(entry) != 5:
            return None
        kind, body, plen, nbufs, pbufs = entry
        if not (type(kind) is int and type(plen) is int and type(nbufs) is int
                and type(pbufs) is int and kind != BATCH and plen >= 0 and nbufs == 0
                and pbufs == 0 and at + plen <= total):
            return None
        at += plen
        out.append((kind, body, plen))
    return out if at == total else None


class Sessions(Protocol):
    """What the lane uses of the controller's sessions (:class:`.sessions.Sessions`)."""

    _ctl: Any
    dropped: collections.Counter[str]
    batches_received: int

    def on_frames(self, frames: list[Any]) -> None: ...
    def on_envelope(self, identity: bytes, env: Envelope, frame: Any) -> None: ...
    def _dispatch(self, host: Any, identity: bytes, env: Envelope) -> None: ...


class ResultLane:
    """The controller's reader of one multipart message (the channel's ``on_frames``)."""

    __slots__ = ("_ctl", "_sessions")

    def __init__(self, sessions: Sessions) -> None:
        self._sessions = sessions
        self._ctl = sessions._ctl

    def on_frames(self, frames: list[Any]) -> None:
        """:meth:`Sessions.on_frames`, a one-host call's RESULT settled here."""
        sessions = self._sessions
        ctl = self._ctl
        relays = ctl._relays
        if len(frames) != 4:
            sessions.on_frames(frames)
            return
        f0 = frames[0]
        identity = f0.bytes
        if relays is not None:  # a relay's message: straight to its reader
            relay = relays.by_identity.get(identity)
            if relay is not None:
                relays.on_frames(relay, frames)
                return
        host = ctl._hosts.by_identity.get(identity)
        fh, fp, ft = frames[1], frames[2], frames[3]
        if (host is None or (relays is not None and identity in relays.by_identity)
                or type(fh) is not _Frame or type(fp) is not _Frame or type(ft) is not _Frame):
            sessions.on_frames(frames)
            return
        # As ``decode`` checks, in its order: sizes, the MAC, the header.
        header, payload = fh.buffer, fp.buffer
        hlen, plen = header.nbytes, payload.nbytes
        tag = ft.bytes
        tlen = len(tag)
        if hlen > COUNT_ABOVE or hlen + plen + tlen > ctl.max_message_bytes or tlen != MAC_SIZE:
            sessions.on_frames(frames)  # (dropped or counted there)
            return
        key = ctl._key
        keyed = _KEYED.get(key)
        h = (keyed if keyed is not None else _keyed(key)).copy()
        h.update(_LEN.pack(hlen))
        h.update(header)
        h.update(_LEN.pack(plen))
        h.update(payload)
        if not _compare(h.digest(), tag):
            sessions.on_frames(frames)
            return
        try:
            fields = _unpack(header, raw=False, use_list=True)
        except Exception:  # (msgpack raises several types): dropped there
            sessions.on_frames(frames)
            return
        if type(fields) is not list or len(fields) != 9:
            sessions.on_frames(frames)
            return
        version, kind, sender, receiver, seq, ack, buflens, pbufs, body = fields
        if not (type(version) is int and type(kind) is int and type(sender) is bytes
                and type(receiver) is bytes and type(seq) is int and type(ack) is int
                and type(buflens) is list and not buflens and type(pbufs) is int
                and pbufs == 0):
            sessions.on_frames(frames)
            return
        peer = host.peer
        entries = None
        if kind == BATCH:  # (pipelined calls' replies) unpack_batch's checks first
            entries = _batch(body, plen)
        if ((kind != RESULT and entries is None) or sender != peer.their_session
                or receiver != ctl._session or version != PROTOCOL_VERSION
                or peer.via is not None or peer.assembly is not None):
            # decoded: the rest of the general path (a malformed batch dropped there)
            sessions.on_envelope(identity, Envelope(kind, sender, receiver, seq, body, payload,
                                                    [], 0, version, ack), f0)
            return
        # Channel.take -> Peer.accept: the acknowledgement counts even if refused
        held = peer.held
        unacked = peer.unacked
        if unacked and unacked[0][0] <= ack:
            # (Peer.acked, inline: tests/test_resultlane.py holds the two equal)
            freed = data = 0
            sent = 0.0
            while unacked and unacked[0][0] <= ack:
                _, sent, _, size, d = unacked.popleft()
                freed += size
                data += d
            if freed:
                now = _monotonic()
                peer.inflight -= freed
                peer.held -= data
                peer.ack_wait = now
                peer.backoff = 1.0
                delay = now - sent
                if delay < peer.base_delay:
                    peer.base_delay = delay
                queued = delay - peer.base_delay  # what the window adds to the round trip
                if queued < TARGET_DELAY_S:
                    window = peer.window + freed
                    peer.window = window if window < peer.max_window else peer.max_window
                elif queued > 2 * TARGET_DELAY_S and now - peer.last_cut > delay:
                    peer.window = max(WINDOW_MIN, peer.window * 7 // 10)
                    peer.last_cut = now
            if peer.held < held:  # the channel's on_release, its no-op inline
                uploads = ctl._uploads
                if uploads._blocked or uploads._waiters:
                    uploads.on_release(peer)
        if seq != peer.recv_seq + 1:  # a replay or a gap: refused and counted there
            sessions.on_envelope(identity, Envelope(kind, sender, receiver, seq, body, payload,
                                                    [], 0, version, ack), f0)
            return
        peer.recv_seq = seq
        host.last_seen = _monotonic()
        hangups = ctl._hangups
        if hangups is not None:  # Hangups.heard, its common case inline
            host.hung_up = 0.0
            if f0.get(SRCFD) != host.conn_fd:
                hangups.heard(host, f0)
        if entries is None:
            self._settle(host, identity, body, payload, sender, receiver, seq, version, ack)
            return
        # A BATCH's messages in order, as Sessions.on_envelope hands them on after
        # unpack_batch (its twin: tests/test_resultlane.py holds the two equal)
        sessions.batches_received += 1
        at = 0
        for kind, body, n in entries:
            if not host.alive:
                return  # dropped for an earlier message of the batch
            part = payload[at:at + n]
            at += n
            if kind == RESULT:
                self._settle(host, identity, body, part, sender, receiver, seq, version, ack)
            else:
                sessions._dispatch(host, identity, Envelope(kind, sender, receiver, seq, body,
                                                            part if n else b"", [], 0, version,
                                                            ack))

    def _settle(self, host: Any, identity: bytes, body: Any, payload: Any, sender: bytes,
                receiver: bytes, seq: int, version: int, ack: int) -> None:
        """One accepted RESULT of ``host`` (alone in its envelope, or a BATCH's): a
        one-host call settled, a fan-out's reply before its last recorded; anything else
        to :meth:`Sessions._dispatch`, as the general path hands it on."""
        sessions = self._sessions
        ctl = self._ctl
        kind = RESULT
        # The body (P.Result's fields) and the operation it ends.
        ops = ctl._ops
        op = None
        n = len(body) if type(body) is list else 0
        if 3 <= n <= 4:
            call_id, status, meta = body[0], body[1], body[2]
            if (type(call_id) is int and status == OK and type(status) is int
                    and type(meta) is int and 0 <= meta < MAX_OUTPUTS
                    and (n == 3 or type(body[3]) is list)):
                op = ops.pending.get(call_id)
        bit = 1 << host.index
        if op is not None and op.wide and op.remaining & bit and op.remaining != bit:
            # one host of a fan-out, not its last: its value recorded (Operation.answered)
            fut = op.future
            settler = SETTLERS.get(op.decode)
            if settler is not None and fut._state == _PENDING and fut._timing is None:
                # read once per description: a fan-out's hosts answer alike, call after
                # call (the value is the host-blind decoder's: one for all, read-only)
                read = settler[2]
                key = (read, bytes(payload), meta) if payload.nbytes <= READ_MAX else None
                value = _READ.get(key, MISS) if key is not None else MISS
                if value is MISS:
                    try:
                        value = read(payload, meta)
                    except (KeyboardInterrupt, SystemExit):
                        raise
                    except BaseException:  # (a bad description) failed there, and counted
                        value = MISS
                    if key is not None and value is not MISS:
                        if len(_READ) >= READ_KEPT:
                            _READ.clear()
                        _READ[key] = value
                if value is not MISS:
                    chan = ctl._chan
                    if chan is not None and LINGER:  # the others' are near: read them too
                        chan.linger = True
                    op.remaining &= ~bit
                    op.outputs[host.index] = meta
                    op.values[host.index] = value
                    if n == 4 and len(body[3]) > 3:  # it answers a FETCH_CALL too
                        answer_fetch(ops, host, body[3], Envelope(
                            kind, sender, receiver, seq, body, payload, [], 0, version, ack))
                    if ops.backlog:
                        ops.pump()
                    return
        if (op is None or op.wide or call_id not in host.awaiting
                or op.remaining != bit):
            sessions._dispatch(host, identity, Envelope(kind, sender, receiver, seq, body,
                                                        payload, [], 0, version, ack))
            return
        fut = op.future
        settler = SETTLERS.get(op.decode)
        if settler is None or fut._state != _PENDING or fut._timing is not None:
            sessions._dispatch(host, identity, Envelope(kind, sender, receiver, seq, body,
                                                        payload, [], 0, version, ack))
            return
        raw = bytes(payload)
        try:
            result = settler[0](op.combine, host.index, raw, meta, body[3] if n == 4 else None)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # (a bug) as Sessions.handle counts one
            result = MISS
            sessions.dropped["lane_error"] += 1
        if result is MISS:  # the general path, then what it built is remembered
            sessions._dispatch(host, identity, Envelope(kind, sender, receiver, seq, body,
                                                        payload, [], 0, version, ack))
            if fut._state == _FINISHED and fut._exception is None:
                settler[1](op.combine, host.index, raw, meta, fut._result)
            return
        # Operations.on_result -> Operation.answered -> Operation.end, for the one host
        host.awaiting.discard(call_id)
        host.inflight.discard(call_id)
        op.remaining = 0
        ops.pending.pop(call_id, None)
        op.send = None
        # Future.set_result -> _finish, its common case inline
        with _LOCK:
            settled = fut._state == _PENDING
            if settled:
                fut._result = result
                fut._state = _FINISHED
        if settled:
            if fut._stats is not None or fut._callbacks is not None:
                fut._finish()
            else:
                fut._canceller = None
                event = fut._event
                if event is not None:
                    event.release()  # the thread waiting in result() goes on
                w = fut._waiter
                if w is not None:
                    fut._waiter = None
                    waiters = _HELD.waiters
                    if waiters is not None and _get_ident() == w._box.thread:
                        waiters.append(w)  # woken by the drain once it has read what waits
                    else:
                        wake(w)
        if n == 4 and len(body[3]) > 3:  # it answers a FETCH_CALL too (on_result, below)
            answer_fetch(ops, host, body[3], Envelope(
                kind, sender, receiver, seq, body, payload, [], 0, version, ack))
        if ops.backlog:
            ops.pump()


def on_result(ops: Any, host: Any, body: P.Result, env: Envelope) -> None:
    """A joined host's RESULT off the general path: :meth:`Operations.on_result`, then
    the FETCH_CALL answer it may carry (:func:`answer_fetch`)."""
    ops.on_result(host, body, env)
    if len(body.times) > 3 and body.status == OK and host.alive:
        answer_fetch(ops, host, body.times, env)


def answer_fetch(ops: Any, host: Any, times: list[Any], env: Envelope) -> None:
    """A call's RESULT that also answers the FETCH_CALL its host held for the call
    (``times[3]``, that FETCH's id, sent only where every output was computed; protocol
    13): that FETCH's answer, True, as the FETCH's own RESULT brought it before (an
    awaited step's wait needs no message of its own). After the call's RESULT."""
    fetch = times[3]
    if type(fetch) is not int or fetch <= 0:
        ops.ctl._sessions.violation(host, "malformed", f"call times {times!r}")
        return
    ops.on_result(host, P.Result(fetch, OK, True), Envelope(
        RESULT, env.sender, env.receiver, env.seq, [fetch, OK, True], b"", [], 0,
        env.version, env.ack))
