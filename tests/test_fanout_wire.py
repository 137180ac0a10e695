"""A fan-out's copies queued and its envelopes sent in one loop (colobus._wire.fanout,
colobus._wire.outflow): the same outboxes as :meth:`Channel.enqueue_packed` for each
host, and the same frames on the wire as :func:`colobus._wire.sockio.send_envelope`
(both written out there, with no call per host). Real ZeroMQ sockets.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import zmq

from colobus._wire import protocol as P
from colobus._wire.fanout import FanoutChannel
from colobus._wire.peer import Peer
from colobus._wire.sockio import POLLIN

KEY = b"k" * 32


def _peers(n: int) -> list[Peer]:
    return [Peer([b"w%d" % i], b"s%d" % i, b"t%d" % i) for i in range(n)]


def _state(p: Peer) -> Any:
    return (p.outbox, p.held, p.send_seq, p.inflight)


async def test_a_fan_outs_copies_are_queued_as_enqueue_packed_queues_each() -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        chan = FanoutChannel(sock, KEY, asyncio.get_running_loop(), lambda frames: None)
        chan.cork()  # queued, not sent
        many, each = _peers(5), _peers(5)
        each[2].outbox.append((1, b"earlier", b"", (), 0))  # one had a message queued
        many[2].outbox.append((1, b"earlier", b"", (), 0))
        for payload, bufs in ((b"", ()), (b"p" * 10, ()), (memoryview(b"q" * 7), [b"b" * 3])):
            chan._dirty = []
            chan.enqueue_packed_many(many, int(P.Kind.CALL), b"body", payload, bufs, len(bufs))
            dirty_many = list(chan._dirty)
            chan._dirty = []
            for p in each:
                chan.enqueue_packed(p, int(P.Kind.CALL), b"body", payload, bufs, len(bufs))
            assert [many.index(p) for p in dirty_many] == [each.index(p) for p in chan._dirty]
            assert [_state(p) for p in many] == [_state(p) for p in each]
        chan.close()
    finally:
        sock.close(0)
        ctx.term()


async def test_envelopes_sent_in_one_loop_arrive_as_send_envelope_sends_them() -> None:
    """Each host gets the frames the channel keeps for a resend (fast_one_envelope's),
    in order: header, payload, MAC, and the buffers (those go as send_envelope sends)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    addr = f"inproc://fan-{secrets.token_hex(4)}"
    router.bind(addr)
    dealers = []
    peers = _peers(3)
    try:
        for p in peers:
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.ROUTING_ID, p.route[0])
            d.connect(addr)
            dealers.append(d)
        for d in dealers:  # the ROUTER learns each identity
            d.send(b"hi")
        for _ in dealers:
            router.recv_multipart()
        chan = FanoutChannel(router, KEY, asyncio.get_running_loop(), lambda frames: None)
        for big in (b"", b"x" * 100_000):
            bufs = [big] if big else []
            chan.send_packed_many(peers, int(P.Kind.CALL), b"\x91\x01", b"pay", bufs, len(bufs))
            chan.flush()
            for p, d in zip(peers, dealers, strict=True):
                assert zmq.zmq_poll([(d, POLLIN)], 5000)
                got = d.recv_multipart()
                kept = p.unacked[-1][2]  # what a resend would send again
                assert got == [bytes(f) for f in kept]
                assert len(got) == 3 + len(bufs)
        chan.close()
    finally:
        for d in dealers:
            d.close(0)
        router.close(0)
        ctx.term()
