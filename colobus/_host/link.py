"""Whether this worker's controller (or relay) is gone, judged by its link.

A worker ends its session when its controller has been silent past the liveness
timeout and the session's connection closed since it last spoke (or never opened: a
relay it cannot reach). A connection that stays open proves the controller's process
alive, since libzmq answers ZeroMQ's heartbeats in its own thread
(:mod:`colobus._wire.links`): a controller silent on one has its event loop held (a
debugger, ``input()``, a long computation) and is waited for, however long.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq

from .._wire.links import Closes

__all__ = ["ControllerLink"]

log = logging.getLogger("colobus.worker")


class ControllerLink:
    """One session socket's link to its controller (loop thread); ``last_heard``: when
    the worker last heard from it (its message path keeps that, shifted over stalls)."""

    def __init__(self, last_heard: Callable[[], float]) -> None:
        self._closes: Closes | None = None
        self._opened = False  # a handshake on this socket
        self._closed = False  # a close since the controller last spoke:
        self._heard_at_close = 0.0  # the worker's last-heard time at that close
        self._last_heard = last_heard
        self._said = False  # the wait on a live link was logged

    def watch(self, sock: zmq.Socket[Any] | None,
              loop: asyncio.AbstractEventLoop | None) -> None:
        """Watch ``sock`` (before it connects); None: stop watching (before it closes)."""
        if self._closes is not None:
            self._closes.close()
            self._closes = None
        self._opened = self._closed = False
        if sock is not None and loop is not None:
            self._closes = Closes(sock, loop, self._on_closed, self._on_opened)

    def _on_closed(self, fd: int) -> None:
        self._closed = True
        self._heard_at_close = self._last_heard()

    def _on_opened(self, fd: int) -> None:
        self._opened = True  # (a close since the last word still counts: a new
        # controller at the same address answers ZeroMQ's heartbeats too)

    def settle(self) -> None:
        """Read what the monitor reported, and forget a close the controller spoke after
        (before the worker shifts its last-heard time over a stall)."""
        if self._closes is not None:
            self._closes.read()
        if self._closed and self._last_heard() != self._heard_at_close:
            self._closed = False  # heard since: the connection is back

    def shift(self, frozen: float, now: float) -> None:
        """This process did not run for ``frozen`` s: move the close's time as the
        worker moves its last-heard (never past ``now``)."""
        self._heard_at_close = min(self._heard_at_close + frozen, now)

    def gone(self, liveness: float, now: float) -> bool:
        """Whether the controller is gone (see the module docstring)."""
        self.settle()
        silent = now - self._last_heard()
        if silent <= liveness:
            self._said = False
            return False
        if self._closed or not self._opened:
            log.warning("controller silent for %.1f s, its connection %s", silent,
                        "closed" if self._opened else "never opened")
            return True
        if not self._said:
            self._said = True
            log.info("controller silent for %.1f s, but its connection is alive: its "
                     "event loop is held (a debugger? input()?); waiting for it", silent)
        return False
