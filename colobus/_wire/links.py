"""Liveness of the links themselves, judged where no Python code has to run.

A process is alive while its ZeroMQ I/O thread is: that thread is C, runs without
the GIL, and answers ZeroMQ's own heartbeats (ZMTP PING and PONG) whatever the
process's Python code does. So the side that binds (the controller, a relay) sets
``ZMQ_HEARTBEAT_IVL`` (a PING every heartbeat interval on each connection),
``ZMQ_HEARTBEAT_TIMEOUT`` (a connection that brings nothing back within
:func:`link_timeout` of a PING is closed) and ``ZMQ_HEARTBEAT_TTL`` (carried in each
PING: the connecting side closes a connection that brings nothing for that long).
libzmq does all of it in its I/O threads, on both sides.

A connection that closes is seen through the socket's monitor
(``EVENT_DISCONNECTED``, :class:`Closes`). The judges then apply one rule: a peer is
lost when it has been silent past the liveness timeout *and* its connection closed
since it last spoke (or was never seen). Silence on a live connection is code that
holds the GIL or an event loop, a debugger, ``input()``: waited out, never a loss. A
process that is really gone stops answering PINGs (SIGSTOP, a frozen machine, a
cut cable) or closes its connection (SIGKILL, a crash), so its silence is judged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from .sockio import NOBLOCK, readable, socket_fd

__all__ = ["SRCFD", "Closes", "PeerLinks", "heartbeat_options", "link_timeout", "source_fd"]

log = logging.getLogger("colobus.channel")

SRCFD = int(zmq.SRCFD)  # a received frame's connection (its file descriptor)


def source_fd(frame: zmq.Frame) -> int:
    """The connection ``frame`` came on; -1 where it has no descriptor (``inproc://``:
    such a peer is judged by its silence alone)."""
    try:
        return int(frame.get(SRCFD))
    except zmq.ZMQError:
        return -1
DISCONNECTED = int(zmq.EVENT_DISCONNECTED)
OPENED = int(zmq.EVENT_HANDSHAKE_SUCCEEDED)  # a connection that speaks ZMTP
MAX_TTL_MS = 6_553_500  # ZMQ_HEARTBEAT_TTL travels in tenths of a second, 16 bits


def link_timeout(heartbeat: float, liveness: float) -> float:
    """How long a connection may bring nothing back after a PING before libzmq closes it:
    the liveness timeout less two heartbeat intervals (at least half of it), so that a
    peer that stops answering has its connection closed, and its silence judged, within
    the liveness timeout."""
    return max(liveness - 2 * heartbeat, liveness / 2)


def heartbeat_options(sock: zmq.Socket[Any], heartbeat: float, liveness: float) -> None:
    """ZeroMQ's heartbeats on every connection ``sock`` makes or accepts from now on
    (before it binds or connects): a PING every ``heartbeat``, the connection closed
    when nothing came back within the link timeout, and that timeout as the TTL its
    peers keep (:func:`link_timeout`)."""
    timeout_ms = max(1, round(link_timeout(heartbeat, liveness) * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, round(heartbeat * 1000)))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, min(max(timeout_ms, 100), MAX_TTL_MS))


class Closes:
    """Calls ``closed(fd)`` on the loop thread for each connection of ``sock`` that
    closes (its monitor's ``EVENT_DISCONNECTED``), and ``opened(fd)`` (if given) for
    each that completes its handshake, until :meth:`close`.

    A socket has one monitor: this is it. Close it before the socket.
    """

    def __init__(self, sock: zmq.Socket[Any], loop: asyncio.AbstractEventLoop,
                 closed: Callable[[int], None],
                 opened: Callable[[int], None] | None = None) -> None:
        self._sock = sock
        self._loop = loop
        self._closed = closed
        self._opened = opened
        events = DISCONNECTED | (OPENED if opened is not None else 0)
        self._monitor: zmq.Socket[Any] | None = sock.get_monitor_socket(events)
        self._fd = socket_fd(self._monitor)
        loop.add_reader(self._fd, self.read)
        self.read()  # the FD is edge-triggered: it signals only after EVENTS was read

    def read(self) -> None:
        """Take what the monitor reported (also called before judging silence)."""
        monitor = self._monitor
        if monitor is None or monitor.closed:
            return
        try:
            while readable(monitor):
                event = parse_monitor_message(monitor.recv_multipart(NOBLOCK))
                if event["event"] == DISCONNECTED:
                    self._closed(int(event["value"]))
                elif event["event"] == OPENED and self._opened is not None:
                    self._opened(int(event["value"]))
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EAGAIN, zmq.ENOTSOCK):
                log.warning("connection monitor error: %s", exc)

    def close(self) -> None:
        """Stop watching (before the socket closes)."""
        monitor, self._monitor = self._monitor, None
        if monitor is None:
            return
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(self._fd)
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        monitor.close(0)


class PeerLinks:
    """On a ROUTER's side (a relay's): the connection each peer was last heard on, and
    the peers whose connection closed since they last spoke (``last_seen``, the
    owner's: peer -> when it last spoke, which the owner keeps and shifts)."""

    def __init__(self, last_seen: dict[int, float]) -> None:
        self.conn_fd: dict[int, int] = {}  # peer -> the connection it was last heard on
        self._peer_on: dict[int, int] = {}  # and back
        self._closed: dict[int, float] = {}  # peer -> its last_seen when its link closed
        self._last_seen = last_seen

    def heard(self, peer: int, fd: int) -> None:
        """``peer`` spoke on connection ``fd``, not the one before (the owner checks
        ``conn_fd`` first: this runs only when a peer's connection changes)."""
        other = self._peer_on.get(fd)
        if other is not None and other != peer:
            self.closed(fd)  # that descriptor was other's connection: it closed
        old = self.conn_fd.get(peer)
        if old is not None and self._peer_on.get(old) == peer:
            del self._peer_on[old]
        self.conn_fd[peer] = fd
        self._peer_on[fd] = peer

    def closed(self, fd: int) -> None:
        """Connection ``fd`` closed (the socket's monitor said so)."""
        peer = self._peer_on.pop(fd, None)
        if peer is not None and self.conn_fd.get(peer) == fd and peer in self._last_seen:
            self._closed[peer] = self._last_seen[peer]

    def up(self, peer: int) -> bool:
        """Whether ``peer``'s link proves it alive: heard on a connection that has not
        closed since."""
        return peer in self.conn_fd and peer not in self._closed

    def settle(self, frozen: float, now: float) -> None:
        """Before judging: forget the closes of peers heard since, then move the rest
        forward by ``frozen`` as the owner moves ``last_seen`` (never past ``now``)."""
        seen = self._last_seen
        for peer in [p for p, at in self._closed.items() if at != seen.get(p)]:
            del self._closed[peer]  # heard since: it reconnected
        if frozen:
            for peer, at in self._closed.items():
                self._closed[peer] = min(at + frozen, now)

    def forget(self, peer: int) -> None:
        """``peer`` is gone (its last connection's entry goes when that closes)."""
        self.conn_fd.pop(peer, None)
        self._closed.pop(peer, None)
