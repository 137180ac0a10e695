"""A FORWARD delivered: each host's messages as one envelope, with no Python step per host.

A fan-out's FORWARD names every host of the relay: the frees that ride with the call
once for all of them, and each host's CALL (its own part of the mesh in its body).
The general path (:meth:`Channel.enqueue_packed` per host and message, then the
flush's :meth:`Outflow._send_outbox` per host) costs a relay some ten Python calls per
host. :func:`forward` reads the entries in one pass (the checks of
:func:`colobus._wire.relaywire.entries`, inline), lists each host's messages, and
sends each host whose window is clear its envelope directly: the frames
:func:`colobus._wire.lane.fast_one_envelope` makes (one call per host), numbered,
kept for resends and sent as :meth:`Outflow._send_outbox` does (its twin, inline;
``tests/test_relay_paths.py`` holds the two equal). A host with anything queued or
waiting for its window, or a message large enough to travel in parts, takes the
general path, after what waits. Each host still gets its own numbered, MAC'd
envelope: what hosts see is unchanged.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import zmq

from .._wire import protocol as P
from .._wire import sockio
from .._wire.chunks import CHUNK_BYTES
from .._wire.envelope import (
    _ARRAY9,
    _LEN,
    BATCH_KIND,
    MAC_SIZE,
    PROTOCOL_VERSION,
    Buffer,
    Dropped,
    Outgoing,
)
from .._wire.lane import _UINTS, _keyed, fast_one_envelope, pack
from .._wire.limits import (
    BATCH_MAX_BUFFERS,
    BATCH_MAX_BYTES,
    BATCH_MAX_ITEMS,
    BATCH_MAX_PAYLOAD,
    BODY_INLINE_MAX,
)
from .._wire.sockio import COPY_BELOW, SNDMORE

if TYPE_CHECKING:
    from .carrier import Carrier

__all__ = ["call_id_of", "deliver", "forward"]

CALL = int(P.Kind.CALL)
HEARTBEAT = int(P.Kind.HEARTBEAT)
_INT = frozenset((int,))
_BYTES = frozenset((bytes,))
send: Any = sockio._send  # the socket's compiled send
_UINT_WIDTH = {0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8}  # msgpack's uint 8, 16, 32, 64


def call_id_of(packed: bytes) -> int | None:
    """The call id a packed CALL body starts with (a list whose first field is an
    unsigned int), read from its bytes; None if it does not start so."""
    if len(packed) < 2 or not 0x91 <= packed[0] <= 0x9f:
        return None
    b = packed[1]
    if b < 0x80:
        return b
    width = _UINT_WIDTH.get(b)
    if width is None or len(packed) < 2 + width:
        return None
    return int.from_bytes(packed[2:2 + width], "big")


def forward(relay: Carrier, body: Any, payload: Buffer, buffers: list[Buffer]) -> None:
    """Deliver an authenticated FORWARD's entries to the hosts they name.

    Raises:
        Dropped: ``malformed``, an entry that does not describe the message's bytes
            (nothing of this FORWARD was delivered).
    """
    if not isinstance(body, list):
        raise Dropped("malformed", "relay body")
    view = memoryview(payload)
    nview, nbuf = len(view), len(buffers)
    peers = relay.peers
    per: dict[int, list[Outgoing]] = {}  # host -> its messages, in order
    sizes: dict[int, int] = {}  # host -> the payload and buffer bytes given for it
    calls: dict[int, int] = {}  # call id -> how many of this relay's hosts it went to
    placed: dict[tuple[int, int, int, int], tuple[Buffer, list[Buffer], int]] = {}
    last_head, last_cid = b"", None
    for e in body:
        # (relaywire.entry, inline: no call per entry, a fan-out has one per host)
        if not (type(e) is list and len(e) == 9 and type(e[0]) is list
                and type(e[1]) is int and type(e[2]) is bytes
                and set(map(type, e[3:8])) <= _INT
                and (e[8] is None or (type(e[8]) is list and len(e[8]) == len(e[0])))):
            raise Dropped("malformed", "relay entry")
        hosts, kind, packed, at, plen, boff, nbufs, pbufs, tails = e
        if (at < 0 or plen < 0 or at + plen > nview or boff < 0 or nbufs < 0
                or boff + nbufs > nbuf or not 0 <= pbufs <= nbufs
                or not set(map(type, hosts)) <= _INT):
            raise Dropped("malformed", "relay entry lengths")
        # the same bytes, the same objects: a host's messages that share a layout share
        # their payload and buffers (deliver's template keys on them)
        where = (at, plen, boff, nbufs)
        got_at = placed.get(where)
        if got_at is None:
            bufs = buffers[boff:boff + nbufs] if nbufs else []
            n = plen
            for b in bufs:
                n += b.nbytes if type(b) is memoryview else len(b)
            got_at = placed[where] = (view[at:at + plen] if plen else b"", bufs, n)
        pay, bufs, n = got_at
        item: Outgoing = (kind, packed, pay, bufs, pbufs)
        if tails is not None and not set(map(type, tails)) <= _BYTES:
            raise Dropped("malformed", "relay entry ends")
        sent = 0
        for j, h in enumerate(hosts):
            if h in peers:
                if tails is not None:  # each host's body: the entry's, then its own end
                    item = (kind, packed + tails[j], pay, bufs, pbufs)
                got = per.get(h)
                if got is None:
                    per[h] = [item]
                else:
                    got.append(item)
                if n:
                    sizes[h] = sizes.get(h, 0) + n
                sent += 1
        if kind == CALL and sent:
            head = packed[:10]  # (its call id: one call's CALLs share their first fields)
            if head != last_head:
                last_head, last_cid = head, call_id_of(packed)
            if last_cid is not None:
                calls[last_cid] = calls.get(last_cid, 0) + sent
    given = relay.given
    for h, n in sizes.items():
        given[h] += n
    for cid, sent in calls.items():
        relay.hold.forwarded(cid, sent)
    deliver(relay, per)


class _Shape:
    """What the envelopes of hosts whose messages differ only in the last one's body
    share (a fan-out's frees and its CALL, each host's own mesh in the CALL's body):
    everything but that body, the receiver's session and the numbers, worked out once.
    The twin of :func:`fast_one_envelope` (``tests/test_relay_paths.py``)."""

    __slots__ = ("batch", "bufs", "bufsum", "data", "extra", "head", "hpost", "hpre",
                 "kind", "last", "n", "payload", "plen", "plen_b", "post", "pre", "run",
                 "sender")

    def __init__(self, items: list[Outgoing], sender: bytes) -> None:
        """Raises ValueError: items one envelope would not carry whole as a batch."""
        n = self.n = len(items)
        self.sender = sender
        last = self.last = items[-1]
        self.head = items[:-1]
        uints = _UINTS
        buflens: list[int] = []
        bufs: list[Buffer] = []
        payloads: list[Buffer] = []
        plen = bufsum = 0
        parts: list[bytes] = []
        run = 0
        for j, (k, b, p, bs, pb) in enumerate(items):
            if type(b) is not bytes or (n > 1 and k == HEARTBEAT):
                raise ValueError("not batched whole")
            pl = p.nbytes if type(p) is memoryview else len(p)
            size = 0 if j == n - 1 else len(b)  # (the last body is each host's own)
            size += pl
            for x in bs:
                m = x.nbytes if type(x) is memoryview else len(x)
                buflens.append(m)
                size += m
                bufsum += m
            if j < n - 1:
                if size >= BATCH_MAX_PAYLOAD or (run and run + size > BATCH_MAX_BYTES):
                    raise ValueError("not batched whole")
                run += size + 16
                parts += (b"\x95", uints[k] if k < 128 else pack(k), b,
                          uints[pl] if pl < 128 else pack(pl),
                          uints[len(bs)] if len(bs) < 128 else pack(len(bs)),
                          uints[pb] if pb < 128 else pack(pb))
            else:
                self.extra = size  # the last message's bytes besides its body
            if pl:
                payloads.append(p)
                plen += pl
            bufs.extend(bs)
        if n > 1 and (n > BATCH_MAX_ITEMS or len(bufs) > BATCH_MAX_BUFFERS):
            raise ValueError("not batched whole")
        self.run = run
        k, _, p, bs, pb = last
        pl = p.nbytes if type(p) is memoryview else len(p)
        if n > 1:
            self.kind, pbufs = BATCH_KIND, 0
            self.pre = b"".join([bytes((0x90 | n,)) if n < 16 else b"\xdc" + n.to_bytes(2, "big"),
                                 *parts, b"\x95", uints[k] if k < 128 else pack(k)])
            self.post = b"".join([uints[pl] if pl < 128 else pack(pl),
                                  uints[len(bs)] if len(bs) < 128 else pack(len(bs)),
                                  uints[pb] if pb < 128 else pack(pb)])
            self.payload: Buffer = (b"" if not plen else b"".join(payloads)
                                    if len(payloads) > 1 or type(payloads[0]) is not bytes
                                    else payloads[0])
        else:
            self.kind, pbufs = k, pb
            self.pre = self.post = b""
            self.payload = p
        self.batch = n > 1
        self.bufs = bufs
        self.bufsum = bufsum
        self.plen = plen
        self.data = plen + bufsum
        self.plen_b = _LEN.pack(plen)
        self.hpre = _ARRAY9 + pack(PROTOCOL_VERSION) + pack(self.kind) + pack(sender)
        self.hpost = pack(buflens) + pack(pbufs)

    def fits(self, items: list[Outgoing], sender: bytes) -> bool:
        """Whether ``items`` (from ``sender``) differ from this shape's only in the last
        one's body."""
        if (len(items) != self.n or sender != self.sender
                or (self.n > 1 and items[:-1] != self.head)):
            return False
        k, b, p, bs, pb = items[-1]
        last = self.last
        return (k == last[0] and p is last[2] and bs is last[3] and pb == last[4]
                and type(b) is bytes)


def deliver(relay: Carrier, per: dict[int, list[Outgoing]]) -> None:
    """Each host's messages: sent now as one envelope where its window is clear (the
    twin of Outflow._send_outbox's common case; hosts whose messages differ only in
    the last body share its :class:`_Shape`), else queued on the general path."""
    chan = relay.down
    sock = chan.sock
    if sock.closed:
        return
    key, flags, peers = chan._key, chan._flags, relay.peers
    enqueue = chan.enqueue_packed
    more = flags | SNDMORE
    now = time.monotonic()
    keyed = _keyed(key)
    shape: _Shape | None = None
    for h, items in per.items():
        peer = peers[h]
        one = None
        if not peer.outbox and not peer.pending and (
                peer.inflight < peer.window or not peer.unacked):
            whole = peer.window >> 2  # (part_size, inline)
            if whole > peer.max_part:
                whole = peer.max_part
            if whole < CHUNK_BYTES:
                whole = CHUNK_BYTES
            seq = peer.send_seq + 1
            if shape is None or not shape.fits(items, peer.session):
                try:
                    shape = _Shape(items, peer.session)
                except ValueError:
                    shape = None
            body = items[-1][1]
            size = len(body) + shape.extra if shape is not None else 0
            if (shape is not None and (not shape.batch or not (
                    size >= BATCH_MAX_PAYLOAD or (shape.run and shape.run + size
                                                  > BATCH_MAX_BYTES)))):
                # (fast_one_envelope's frames, from the shape: each host's body, its
                # session and numbers)
                if shape.batch:
                    body = shape.pre + body + shape.post
                blen = len(body)
                data = shape.data
                if (not data or data + blen <= whole) and blen <= BODY_INLINE_MAX:
                    header = b"".join((shape.hpre, pack(peer.their_session), pack(seq),
                                       pack(peer.recv_seq), shape.hpost, body))
                    hlen = len(header)
                    m = keyed.copy()
                    m.update(_LEN.pack(hlen) + header + shape.plen_b)
                    payload = shape.payload
                    if shape.plen:
                        m.update(payload)
                    if shape.bufs:
                        frames = [header, payload, m.digest(), *shape.bufs]
                    else:
                        frames = [header, payload, m.digest()]
                    one = (frames, hlen + shape.plen + MAC_SIZE + shape.bufsum, data,
                           shape.plen, shape.batch)
            if one is None:  # (what the shape does not cover: fast_one_envelope decides)
                one = fast_one_envelope(key, items, peer.session, peer.their_session, seq,
                                        peer.recv_seq, whole)
        if one is None:  # the general path: after what waits, in parts where large
            for item in items:
                enqueue(peer, *item)
            continue
        frames, size, data, plen, batch = one
        relay.whole += 1
        relay.sent_down = True  # (the socket is read after: a send can take its FD's edge)
        peer.held += data  # (as enqueue_packed counts it)
        peer.send_seq = seq
        if not peer.unacked:
            peer.ack_wait = now
        peer.unacked.append((seq, now, frames, size, data))
        peer.inflight += size
        peer.acked_sent = peer.recv_seq
        peer.recv_owed = 0
        if batch:
            chan.batches_sent += 1
        try:  # (sockio.send_envelope, inline)
            send(sock, peer.route[0], more, True)
            send(sock, frames[0], more, True)
            if len(frames) == 3:
                send(sock, frames[1], more, plen < COPY_BELOW)
                send(sock, frames[2], flags, True)
                continue
            send(sock, frames[1], more, plen < COPY_BELOW)
            last = len(frames) - 1
            for i in range(2, last + 1):
                f = frames[i]
                m = f.nbytes if type(f) is memoryview else len(f)
                send(sock, f, more if i < last else flags, m < COPY_BELOW)
        except zmq.ZMQError:  # not connected yet: resent once it is (as _transmit)
            peer.undelivered = True
