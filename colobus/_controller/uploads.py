"""Back-pressure for uploads: the bytes queued for each host, bounded.

A ``device_put`` returns at once and its bytes leave in the background, kept (as
zero-copy views of the caller's arrays) until the host acknowledges them. A loop
that puts faster than a link carries would hold all of it. So each host counts
what the controller holds for it: bytes of puts not yet handed to the channel
(reserved here, on the caller's thread) and what the channel holds for the peer
(:attr:`colobus._wire.channel.Peer.held`: queued, waiting for the window, or sent
and not acknowledged; for a host behind a relay, what the relay was given for it
and has not seen it acknowledge, :meth:`.relaylink.Relay.held_for`). A put to a
host holding ``max_queued_bytes`` or more waits, the way calls wait for room in the
backlog: a plain thread blocks in ``device_put``; code on an event loop never blocks
there and awaits :meth:`Uploads.wait_room` (``ctl.wait_capacity()``) instead. A put
larger than the bound leaves alone once its hosts are below it.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from .future import Future, in_event_loop

if TYPE_CHECKING:
    from .._wire.channel import Peer
    from .hosts import HostRegistry

__all__ = ["DEFAULT_MAX_QUEUED_BYTES", "Uploads", "UploadsOwner"]

DEFAULT_MAX_QUEUED_BYTES = 1 << 26  # 64 MiB per host: Controller(max_queued_bytes=...)


class UploadsOwner(Protocol):
    """What :class:`Uploads` reads of the controller."""

    @property
    def _hosts(self) -> HostRegistry: ...
    @property
    def _closed(self) -> bool: ...
    def _on_loop_thread(self) -> bool: ...
    def _check_open(self) -> None: ...


class Uploads:
    """The bytes queued per host for uploads, and those waiting for room."""

    def __init__(self, ctl: UploadsOwner, max_bytes: int) -> None:
        self.ctl = ctl
        self.max_bytes = max(1, max_bytes)
        self.reserved: collections.Counter[int] = collections.Counter()  # by host index
        self._cond = threading.Condition()
        self._blocked = 0  # threads waiting in reserve()
        self._waiters: list[Future[None]] = []

    def queued(self, index: int) -> int:
        """The bytes the controller holds for host ``index`` (any thread; a snapshot)."""
        hosts = self.ctl._hosts
        peer = hosts[index].peer if 0 <= index < len(hosts) else None
        if peer is None:
            return self.reserved[index]
        via = peer.via  # a relayed host's: what its relay was given and it not acknowledged
        return self.reserved[index] + (peer.held if via is None else via.held_for(index))

    def _full(self, indices: Iterable[int]) -> bool:
        hosts = self.ctl._hosts
        n = len(hosts)
        for i in indices:
            if 0 <= i < n and hosts[i].alive and self.queued(i) >= self.max_bytes:
                return True
        return False

    def reserve(self, sizes: dict[int, int]) -> None:
        """Count a put's bytes per host before it is posted; a plain thread first
        waits while one of its hosts holds ``max_bytes`` or more.

        Raises:
            ControllerClosedError: the controller closed (before or while waiting).
        """
        ctl = self.ctl
        with self._cond:
            if not ctl._on_loop_thread() and not in_event_loop():
                self._blocked += 1  # before the check: a release after it wakes us
                try:
                    while self._full(sizes) and not ctl._closed:
                        self._cond.wait()
                finally:
                    self._blocked -= 1
                ctl._check_open()
            for i, n in sizes.items():
                self.reserved[i] += n

    def handed(self, index: int, n: int) -> None:
        """Loop thread: ``n`` reserved bytes went to the channel (or nowhere: a lost
        host's), which counts them from now on."""
        with self._cond:
            left = self.reserved[index] - n
            if left > 0:
                self.reserved[index] = left
            else:
                del self.reserved[index]

    def on_release(self, peer: Peer | None = None) -> None:
        """Loop thread: bytes were acknowledged, a host was lost or the controller
        closed: whoever waits checks again."""
        if not self._blocked and not self._waiters:
            return
        with self._cond:
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        for w in waiters:
            w.set_result(None)

    async def wait_room(self) -> None:
        """Wait until no live host holds ``max_bytes`` or more.

        Raises:
            ControllerClosedError: the controller closed.
        """
        while True:
            self.ctl._check_open()
            with self._cond:
                if not self._full(range(len(self.ctl._hosts))):
                    return
                waiter: Future[None] = Future()
                self._waiters.append(waiter)
            await waiter
