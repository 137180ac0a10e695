"""Resends: what a peer left unacknowledged, sent again (see :mod:`.channel`'s docstring).

A sender keeps every numbered envelope until the peer acknowledges it; one left
unacknowledged for ``resend_after`` seconds (or after the peer's NACK) is sent again
with its original sequence number, so the peer keeps the first copy it gets and drops
the rest. Rounds back off while nothing is acknowledged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

import zmq

from .peer import Peer
from .sockio import readable, send_frames

__all__ = ["BACKOFF_MAX", "resend", "resend_stale"]

log = logging.getLogger("colobus.channel")

BACKOFF_MAX = 16  # resends back off to 16 x resend_after while nothing is acknowledged


class Channel(Protocol):
    """What resends use of :class:`colobus._wire.channel.Channel`."""

    sock: zmq.Socket[Any]
    resent: int
    _flags: int
    _owed: set[Peer]
    _loop: asyncio.AbstractEventLoop

    def _send_acks(self) -> None: ...
    def drain(self) -> None: ...


def resend_stale(chan: Channel, peers: Sequence[Peer], after: float) -> None:
    """:meth:`Channel.resend_stale`."""
    sock = chan.sock
    if sock.closed:
        return
    now = time.monotonic()
    resent = chan.resent
    for peer in peers:
        unacked = peer.unacked
        wait = after * peer.backoff
        if not unacked or now - unacked[0][1] < wait:
            continue
        peer.backoff = min(peer.backoff * 2, BACKOFF_MAX)
        log.debug("resending unacknowledged messages (%d waiting)", len(unacked))
        resend(chan, peer, now, wait)
    if chan._owed:
        chan._send_acks()
    if chan.resent != resent and readable(sock):
        # The FD is edge-triggered: a send can take the edge that announced a
        # message waiting to be read, and nothing else would read it.
        chan._loop.call_soon(chan.drain)


def resend(chan: Channel, peer: Peer, now: float, wait: float) -> None:
    """Send again, from the oldest, what ``peer`` left unacknowledged for ``wait``
    seconds (0: all of it, the peer asked), at most a window's worth."""
    unacked = peer.unacked
    budget = peer.window
    for i, (seq, sent, frames, n, d) in enumerate(unacked):
        if now - sent < wait or budget <= 0:
            break
        unacked[i] = (seq, now, frames, n, d)
        budget -= n
        chan.resent += 1
        try:
            send_frames(chan.sock, [*peer.route, *frames], chan._flags)
        except zmq.ZMQError:
            break
    if peer.recv_seq:  # the copies carry old acks: say what we have now
        peer.ack_due = True
        chan._owed.add(peer)
