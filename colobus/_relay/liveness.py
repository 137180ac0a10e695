"""A relay's liveness turn, every heartbeat interval.

As the controller judges its hosts (``colobus._controller.liveness``), a relay
judges the hosts it carries and its controller: silence counts only while the
relay ran (:mod:`colobus._wire.stalls`), a peer silent past the liveness timeout
is lost only when its connection closed since it last spoke
(:mod:`colobus._wire.links`), and an acknowledgement wait counts only the time a
host talked. Then every live host gets the controller's heartbeat, one body for
all (:mod:`.fanout`), and the controller the relay's own, with what it dropped.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import TYPE_CHECKING, Protocol

from .._wire import protocol as P
from .._wire.channel import Channel, Peer
from .._wire.envelope import pack_body
from .._wire.relaywire import NEVER_REACHED
from .._wire.stalls import StallClock
from .carrier import Carrier
from .fanout import deliver

if TYPE_CHECKING:
    from .._wire.envelope import Outgoing

__all__ = ["Judge", "tick"]

log = logging.getLogger("colobus.relay")


class Judge(Carrier, Protocol):
    """What a liveness turn uses of the relay (:class:`colobus._relay.relay.Relay`)."""

    up: Channel  # the controller's channel
    ctl: Peer  # the controller's session
    ctl_heard: float  # when the controller last spoke
    _ctl_closed_at: float | None  # ctl_heard when the controller's connection closed
    _stalls: StallClock
    _last_tick: float
    liveness: float
    resend_after: float
    done: asyncio.Future[str] | None
    dropped: collections.Counter[str]

    def end(self, why: str) -> None: ...
    def _lose(self, h: int, why: str, reason: str = "") -> None: ...
    def _flush_down(self) -> None: ...


HEARTBEAT = int(P.Kind.HEARTBEAT)


def tick(r: Judge) -> None:
    """One liveness turn: read what waits, judge the controller and every host (a
    silent one lost only when its link closed since it spoke), heartbeats out."""
    r.down.drain()
    r.up.drain()
    now = time.monotonic()
    frozen = r._stalls.frozen(now)  # this process did not run: nobody's silence
    elapsed, r._last_tick = now - r._last_tick, now
    if r._ctl_closed_at is not None and r._ctl_closed_at != r.ctl_heard:
        r._ctl_closed_at = None  # heard since: its connection is back
    r.links.settle(frozen, now)
    if frozen:  # (never past now: what the drains just read was heard now)
        r.ctl_heard = min(r.ctl_heard + frozen, now)
        if r._ctl_closed_at is not None:
            r._ctl_closed_at = min(r._ctl_closed_at + frozen, now)
        for h in r.last_seen:
            r.last_seen[h] = min(r.last_seen[h] + frozen, now)
    if (now - r.ctl_heard > 2 * r.liveness and r._ctl_closed_at is not None
            and r.done is not None):
        # (silent on an open connection: its loop is held, and it is waited for)
        log.warning("relay: the controller is silent and its connection closed; "
                    "ending its session")
        r.end("the controller was silent")
        return
    r.hold.prune(r.liveness)
    alive = []
    # the controller's heartbeat to every live host: one body, each host's envelope
    # sent at once where its window is clear (.fanout)
    pings: list[Outgoing] = [(HEARTBEAT, pack_body(P.Heartbeat(
        0, 0, 0, 0, time.monotonic_ns()).to_wire()), b"", (), 0)]
    to: dict[int, list[Outgoing]] = {}
    for h, peer in list(r.peers.items()):
        if peer.unacked:
            if r.last_seen[h] < now - elapsed:  # it said nothing since the last
                peer.ack_wait = min(peer.ack_wait + elapsed, now)  # tick: it could
                # not acknowledge either
            elif frozen:  # (a whole-machine freeze: nobody's wait)
                peer.ack_wait = min(peer.ack_wait + frozen, now)
        silent = now - r.last_seen[h]
        waited = now - peer.ack_wait if peer.unacked else 0.0
        if silent > r.liveness and not r.links.up(h):
            said = "no message" if h in r.arrived else f"{NEVER_REACHED}: no message"
            r._lose(h, f"{said} for {silent:.1f} s")
        elif waited > r.liveness:
            r._lose(h, f"it acknowledged nothing for {waited:.1f} s")
        else:
            to[h] = pings
            alive.append(peer)
    deliver(r, to)
    r._flush_down()
    r.down.resend_stale(alive, r.resend_after)
    r.up.send(r.ctl, P.Heartbeat(0, 0, 0, 0, 0, 0, 0, 0, dict(r.dropped)))
    r.up.resend_stale([r.ctl], r.resend_after)
