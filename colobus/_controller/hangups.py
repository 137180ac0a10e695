"""Notices a host's TCP connection closing: a hint to judge its silence sooner, never a verdict.

A worker process that dies on a remote machine closes its connection (its
kernel sends FIN or RST), and the controller can know that at once; a host
that is only cut off, or whose connection a proxy or NAT dropped, will
reconnect. The two look the same from here, so a closed connection is not
taken as death: the host gets a shorter deadline instead. If it has sent
nothing within ``grace`` seconds of the close (half the liveness timeout by
default), it is lost with a reason that says so; any message from it clears
the mark (a live worker heartbeats every ``heartbeat_interval``, and a
reconnected one delivers what it queued meanwhile at once).

How a close is tied to a host: the ROUTER's monitor reports
``EVENT_DISCONNECTED`` with the connection's file descriptor, and every
authenticated message tells which descriptor it came on (``ZMQ_SRCFD`` of its
first frame, about 0.1 us). A descriptor number reused by a new connection
before its old close is read can at worst mark a live host, which its next
heartbeat clears; nothing unauthenticated moves a mark.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from .._wire.sockio import NOBLOCK, readable, socket_fd

if TYPE_CHECKING:
    from .hosts import Host

__all__ = ["Hangups"]

log = logging.getLogger("colobus.controller")

SRCFD = int(zmq.SRCFD)
DISCONNECTED = int(zmq.EVENT_DISCONNECTED)


class Hangups:
    """The hosts whose connection closed, and the deadline each now has (loop thread)."""

    def __init__(self, sock: zmq.Socket[Any], loop: asyncio.AbstractEventLoop, grace: float,
                 lose: Callable[[Host, str], None]) -> None:
        self.grace = grace
        self._sock = sock
        self._loop = loop
        self._lose = lose
        self._host_on: dict[int, Host] = {}  # connection fd -> the host last heard on it
        self._monitor: zmq.Socket[Any] | None = sock.get_monitor_socket(DISCONNECTED)
        self._fd = socket_fd(self._monitor)
        loop.add_reader(self._fd, self._read)
        self._read()  # the FD is edge-triggered: it signals only after EVENTS was read

    def heard(self, host: Host, frame: zmq.Frame) -> None:
        """An authenticated message from ``host`` came in ``frame``'s connection."""
        host.hung_up = 0.0
        fd = frame.get(SRCFD)
        if fd != host.conn_fd:
            if self._host_on.get(host.conn_fd) is host:
                del self._host_on[host.conn_fd]
            host.conn_fd = fd
            self._host_on[fd] = host

    def _read(self) -> None:
        monitor = self._monitor
        if monitor is None or monitor.closed:
            return
        try:
            while readable(monitor):
                event = parse_monitor_message(monitor.recv_multipart(NOBLOCK))
                if event["event"] == DISCONNECTED:
                    self._closed(int(event["value"]))
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EAGAIN, zmq.ENOTSOCK):
                log.warning("connection monitor error: %s", exc)

    def _closed(self, fd: int) -> None:
        host = self._host_on.pop(fd, None)
        if host is None or not host.alive or host.conn_fd != fd or host.peer.via is not None:
            return  # not a host's connection, or it moved to a new one (or a relay) already
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
        monitor, self._monitor = self._monitor, None
        if monitor is None:
            return
        self._loop.remove_reader(self._fd)
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        monitor.close(0)
        self._host_on.clear()
