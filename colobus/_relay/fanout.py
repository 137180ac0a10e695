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
from .._wire.envelope import Buffer, Dropped, Outgoing
from .._wire.lane import fast_one_envelope
from .._wire.sockio import COPY_BELOW, SNDMORE

if TYPE_CHECKING:
    from .relay import Relay

__all__ = ["call_id_of", "deliver", "forward"]

CALL = int(P.Kind.CALL)
_INT = frozenset((int,))
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


def forward(relay: Relay, body: Any, payload: Buffer, buffers: list[Buffer]) -> None:
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
    for e in body:
        # (relaywire.entry, inline: no call per entry, a fan-out has one per host)
        if not (type(e) is list and len(e) == 9 and type(e[0]) is list
                and type(e[1]) is int and type(e[2]) is bytes
                and set(map(type, e[3:8])) <= _INT
                and (e[8] is None or (type(e[8]) is list and len(e[8]) == len(e[0])))):
            raise Dropped("malformed", "relay entry")
        hosts, kind, packed, at, plen, boff, nbufs, pbufs, _ = e
        if (at < 0 or plen < 0 or at + plen > nview or boff < 0 or nbufs < 0
                or boff + nbufs > nbuf or not 0 <= pbufs <= nbufs
                or not set(map(type, hosts)) <= _INT):
            raise Dropped("malformed", "relay entry lengths")
        bufs = buffers[boff:boff + nbufs] if nbufs else []
        item: Outgoing = (kind, packed, view[at:at + plen] if plen else b"", bufs, pbufs)
        n = plen
        for b in bufs:
            n += b.nbytes if type(b) is memoryview else len(b)
        sent = 0
        for h in hosts:
            if h in peers:
                got = per.get(h)
                if got is None:
                    per[h] = [item]
                else:
                    got.append(item)
                if n:
                    sizes[h] = sizes.get(h, 0) + n
                sent += 1
        if kind == CALL and sent:
            cid = call_id_of(packed)
            if cid is not None:
                calls[cid] = calls.get(cid, 0) + sent
    given = relay.given
    for h, n in sizes.items():
        given[h] += n
    for cid, sent in calls.items():
        relay.hold.forwarded(cid, sent)
    deliver(relay, per)


def deliver(relay: Relay, per: dict[int, list[Outgoing]]) -> None:
    """Each host's messages: sent now as one envelope where its window is clear (the
    twin of Outflow._send_outbox's common case), else queued on the general path."""
    chan = relay.down
    sock = chan.sock
    if sock.closed:
        return
    key, flags, peers = chan._key, chan._flags, relay.peers
    enqueue = chan.enqueue_packed
    more = flags | SNDMORE
    now = time.monotonic()
    for h, items in per.items():
        peer = peers[h]
        one = None
        if not peer.outbox and not peer.pending and (
                peer.inflight < peer.window or not peer.unacked):
            whole = peer.window >> 2  # (part_size, inline)
            if whole > peer.max_part:
                whole = peer.max_part
            seq = peer.send_seq + 1
            one = fast_one_envelope(key, items, peer.session, peer.their_session, seq,
                                    peer.recv_seq, whole if whole > CHUNK_BYTES else CHUNK_BYTES)
        if one is None:  # the general path: after what waits, in parts where large
            for item in items:
                enqueue(peer, *item)
            continue
        frames, size, data, plen, batch = one
        relay.whole += 1
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
