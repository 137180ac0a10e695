"""Notices a host's connection closing: a hint to judge its silence sooner, never a verdict.

A worker process that dies on a remote machine closes its connection (its
kernel sends FIN or RST), and the controller can know that at once; a host
that is only cut off, or whose connection a proxy or NAT dropped, will
reconnect. The two look the same from here, so a closed connection is not
taken as death: the host gets a shorter deadline instead. If it has sent
nothing within ``grace`` seconds of the close (half the liveness timeout by
default), it is lost with a reason that says so; any message from it clears
the mark (a live worker heartbeats every ``heartbeat_interval``, and a
reconnected one delivers what it queued meanwhile at once).

The same marks say which hosts (and relays) are *proven alive*: one whose last
connection has not closed since it last spoke answers ZeroMQ's heartbeats in its
I/O thread (:mod:`colobus._wire.links`), whatever its Python code does, so its
silence is never judged (``Sessions.tick``, ``Relays.tick``).

How a close is tied to a host: the ROUTER's monitor reports
``EVENT_DISCONNECTED`` with the connection's file descriptor, and every
authenticated message tells which descriptor it came on (``ZMQ_SRCFD`` of its
first frame, about 0.1 us). A descriptor number reused by a new connection
before its old close is read can at worst mark a live host, which its next
heartbeat clears; and a host heard on a descriptor another host was last heard on
marks that other host (a descriptor is one open connection at a time, so the
other's closed). Nothing unauthenticated moves a mark.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from .._wire.links import SRCFD, Closes
from .hosts import Host

if TYPE_CHECKING:
    from .relaylink import Relay

__all__ = ["SRCFD", "Hangups", "link_up"]

log = logging.getLogger("colobus.controller")


class Hangups:
    """The hosts whose connection closed, and the deadline each now has (loop thread)."""

    def __init__(self, sock: zmq.Socket[Any], loop: asyncio.AbstractEventLoop, grace: float,
                 lose: Callable[[Host, str], None]) -> None:
        self.grace = grace
        self._loop = loop
        self._lose = lose
        # connection fd -> the host (or relay) last heard on it
        self._host_on: dict[int, Host | Relay] = {}
        self._closes: Closes | None = Closes(sock, loop, self._closed)

    def heard(self, host: Host | Relay, frame: zmq.Frame) -> None:
        """An authenticated message from ``host`` (or a relay) came in ``frame``'s
        connection."""
        host.hung_up = 0.0
        fd = frame.get(SRCFD)
        if fd != host.conn_fd:
            other = self._host_on.get(fd)
            if other is not None and other is not host:
                self._closed(fd)  # that descriptor was other's connection: it closed
            if self._host_on.get(host.conn_fd) is host:
                del self._host_on[host.conn_fd]
            host.conn_fd = fd
            self._host_on[fd] = host

    def read(self) -> None:
        """Take the closes the monitor reported (before silence is judged)."""
        if self._closes is not None:
            self._closes.read()

    def _closed(self, fd: int) -> None:
        host = self._host_on.pop(fd, None)
        if host is None or not host.alive or host.conn_fd != fd:
            return  # not a host's connection, or it moved to a new one already
        if not isinstance(host, Host):  # a relay: Relays.tick judges its silence
            host.hung_up = time.monotonic()
            return
        if host.peer.via is not None:
            return  # its session moved to a relay: that connection was the join's
        stamp = host.hung_up = time.monotonic()
        log.info("host %d (%r): its connection closed; lost unless it is heard from within "
                 "%.1f s", host.index, host.name, self.grace)
        self._loop.call_later(self.grace, self._judge, host, stamp)

    def _judge(self, host: Host, stamp: float) -> None:
        if host.alive and host.hung_up == stamp:
            self._lose(host, f"its connection closed and it did not come back within "
                             f"{self.grace:.1f} s")

    def close(self) -> None:
        """Stop watching (before the socket closes)."""
        closes, self._closes = self._closes, None
        if closes is not None:
            closes.close()
        self._host_on.clear()


def link_up(who: Host | Relay, hangups: Hangups | None) -> bool:
    """Whether ``who``'s process is proven alive by its link: it was heard on a
    connection that has not closed since (ZeroMQ's heartbeats keep that connection
    open while its I/O thread runs, :mod:`colobus._wire.links`)."""
    return hangups is not None and who.conn_fd >= 0 and not who.hung_up
