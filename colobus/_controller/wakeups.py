"""How a task that awaits a colobus Future is woken: in the drain that settled it.

``await fut`` hands the task a :class:`Waiter`, which asyncio's Task takes as the
future it waits on (it speaks the part of the ``asyncio.Future`` protocol a Task
uses: ``_asyncio_future_blocking``, ``get_loop``, ``add_done_callback``,
``result``, ``cancel``). An ``asyncio.Future`` would schedule the task's wake-up
with ``call_soon``, one more turn of the loop per call; a Waiter settled while the
controller's channel drains its socket on the task's own loop thread wakes the
task once the drain has read what waits, before it sends: the task's next call
leaves with that drain's sends, in the same turn of the loop. Settled anywhere
else it wakes the task with ``call_soon`` (same thread) or through the loop's
inbox (another thread), as an ``asyncio.Future`` would.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import threading
from collections.abc import Callable
from typing import Any, Protocol

from .inbox import inbox_of

__all__ = ["Waiter", "drain_ends", "drain_reads_done", "drain_starts"]


class Awaited(Protocol):
    """What a Waiter uses of the colobus Future it stands for (``future.Future``)."""

    def add_done_callback(self, fn: Callable[[Any], object]) -> None: ...
    def cancel(self) -> bool: ...


class _Held(threading.local):
    waiters: list[Waiter] | None = None  # during a drain on this thread: woken after its reads
    backlog: collections.deque[Waiter] | None = None  # to wake, WAKE_CHUNK per turn


_HELD = _Held()


class Waiter:
    """What a task waits on while it awaits one colobus Future."""

    __slots__ = ("_asyncio_future_blocking", "_callbacks", "_cancel_msg", "_fired", "_fut",
                 "_inbox", "_loop")

    def __init__(self, fut: Awaited, loop: asyncio.AbstractEventLoop) -> None:
        self._asyncio_future_blocking = True  # the Task takes it as the future it waits on
        self._fut = fut
        self._loop = loop
        self._inbox = inbox_of(loop)  # made on the loop's thread: how other threads wake it
        self._callbacks: list[tuple[Callable[[Any], object], contextvars.Context | None]] = []
        self._fired = False
        self._cancel_msg: object = None  # set when the task was cancelled while waiting
        fut.add_done_callback(self._settled)

    # -- the part of asyncio.Future's protocol a Task uses ------------------------------------

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def add_done_callback(self, fn: Callable[[Any], object], *,
                          context: contextvars.Context | None = None) -> None:
        if self._fired:
            self._loop.call_soon(fn, self, context=context)
        else:
            self._callbacks.append((fn, context))

    def result(self) -> None:
        """Nothing (the awaiting generator reads the Future), or the task's cancellation."""
        if self._cancel_msg is not None:
            msg = self._cancel_msg
            raise asyncio.CancelledError() if msg is _NO_MSG else asyncio.CancelledError(msg)

    def cancel(self, msg: Any = None) -> bool:
        """The awaiting task was cancelled: so is the operation, and the task wakes."""
        if self._fired or self._cancel_msg is not None:
            return False
        self._cancel_msg = _NO_MSG if msg is None else msg
        self._fut.cancel()  # settles it (unless done): _settled schedules the wake-up
        if not self._fired:
            self._loop.call_soon(self._fire)
        return True

    # -- waking -----------------------------------------------------------------------

    def _settled(self, _: object) -> None:
        """The Future is done (on the thread that settled it): wake the task."""
        inbox = self._inbox
        if threading.get_ident() != inbox.thread:
            try:
                inbox.post(self._fire)
            except RuntimeError:  # the awaiting loop closed: nobody waits any more
                pass
            return
        held = _HELD.waiters
        if held is not None:
            held.append(self)  # the drain wakes it once it has read what waits
        else:
            self._loop.call_soon(self._fire)

    def _fire(self) -> None:
        if self._fired:
            return
        self._fired = True
        callbacks, self._callbacks = self._callbacks, []
        for fn, context in callbacks:
            if context is None:
                fn(self)
            else:
                context.run(fn, self)


_NO_MSG = object()  # cancelled without a message


def drain_starts() -> None:
    """The controller's channel starts a drain on this thread: hold the wake-ups."""
    if _HELD.waiters is None:
        _HELD.waiters = []


def drain_reads_done() -> None:
    """The drain read what waits (and is about to send): wake the tasks it settled.

    The woken tasks run here, one step each, and what they send leaves with the
    drain's sends; what they settle in turn is woken in this same loop. Inside a
    running task (a drain called from one) they are scheduled instead. At most
    :data:`WAKE_CHUNK` run here; the others run that many per turn of the loop
    from the next one on (see :data:`WAKE_CHUNK`).
    """
    held = _HELD.waiters
    woken = 0
    while held:
        _HELD.waiters = []
        if asyncio.current_task() is not None:
            for w in held:
                w._loop.call_soon(w._fire)
        else:
            backlog = _HELD.backlog
            if backlog and backlog[0]._loop is not held[0]._loop:  # a loop that ended
                backlog = _HELD.backlog = None
            room = 0 if backlog else WAKE_CHUNK - woken  # none ahead of those waiting
            for w in held[:room]:
                w._fire()
            woken += len(held[:room])
            if len(held) > room:
                if backlog is None:
                    backlog = _HELD.backlog = collections.deque()
                    held[0]._loop.call_soon(_wake_backlog)
                backlog.extend(held[room:])
        held = _HELD.waiters


# Tasks woken in one turn of the loop, at most. A task that leaves an
# ``asyncio.Semaphore`` wakes the next waiter, which leaves the semaphore's queue only
# when it runs, in a later turn; each release scans the waiters woken before it in
# this turn (CPython's ``Semaphore._wake_up_next``), so K releases in one turn cost
# K^2 / 2 looks: a drain of 1,000 replies to tasks under a semaphore spent a quarter
# of the loop's CPU there. Woken that many at a time, the woken waiters run between.
WAKE_CHUNK = 64


def _wake_backlog() -> None:
    """Wake the next :data:`WAKE_CHUNK` tasks of this thread's backlog (loop thread);
    again next turn while some are left."""
    backlog = _HELD.backlog
    if backlog is None:
        return
    for _ in range(min(WAKE_CHUNK, len(backlog))):
        w = backlog.popleft()
        w._fire()
    if backlog:
        backlog[0]._loop.call_soon(_wake_backlog)
    else:
        _HELD.backlog = None


def drain_ends() -> None:
    """The drain is over: nothing is held any more (what is left is scheduled)."""
    held, _HELD.waiters = _HELD.waiters, None
    for w in held or ():
        w._loop.call_soon(w._fire)
