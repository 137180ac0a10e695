"""Work handed to an event loop from other threads: one wake-up per burst.

``loop.call_soon_threadsafe`` writes a byte to the loop's self-pipe on every call: a
system call on the posting thread, and a handle and a read on the loop's. Threads post
in bursts (a task loop submitting calls as earlier ones return; the controller's loop
settling a batch of replies whose futures another loop awaits), so an :class:`Inbox`
posts the first item of a burst and queues the rest behind it: the loop runs them all,
in the order they were posted, in one callback. An item posted while that callback runs
waits for the next one, so a thread that posts without pause cannot keep the loop from
its sockets.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Inbox", "inbox_of"]


class Inbox:
    """A FIFO of callables that ``loop`` runs, posted from any thread."""

    __slots__ = ("_items", "_lock", "_posted", "loop", "thread")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        """Made on ``loop``'s own thread."""
        self.loop = loop
        self.thread = threading.get_ident()
        self._items: list[tuple[Callable[..., object], tuple[Any, ...]]] = []
        self._posted = False  # a drain is on its way to the loop
        self._lock = threading.Lock()

    def post(self, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop soon, after everything posted here before it.

        Raises:
            RuntimeError: the loop is closed (as ``call_soon_threadsafe`` raises).
        """
        with self._lock:
            if self._posted and self.loop.is_closed():  # the drain on its way never runs
                self._items.clear()
                self._posted = False
            self._items.append((fn, args))
            if self._posted:
                return
            self._posted = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # closed: nothing queued here will ever run
            with self._lock:
                self._items.clear()
                self._posted = False
            raise

    def call(self, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop: now when called there, else :meth:`post`; a
        closed loop drops it (a waker whose awaiting loop is gone)."""
        if threading.get_ident() == self.thread:
            fn(*args)
            return
        try:
            self.post(fn, *args)
        except RuntimeError:
            pass

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._posted = False
        for fn, args in items:
            try:
                fn(*args)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # as asyncio reports a callback's exception
                self.loop.call_exception_handler({
                    "message": f"Exception in callback {fn!r}", "exception": exc})


_local = threading.local()


def inbox_of(loop: asyncio.AbstractEventLoop) -> Inbox:
    """The inbox of ``loop``, the loop running on this thread (one per thread and loop)."""
    box: Inbox | None = getattr(_local, "inbox", None)
    if box is None or box.loop is not loop:
        box = _local.inbox = Inbox(loop)
    return box
