"""How a task that awaits a colobus Future is woken: in the drain that settled it.

``await fut`` hands the task a :class:`Waiter`, an ``asyncio.Future`` of the task's
loop that stands for the colobus Future: the Task waits on it as on any future, and
its methods (``get_loop``, ``add_done_callback``, ``result``) are asyncio's own, in
C. Settling it the usual way (``set_result``) would schedule the task's wake-up with
``call_soon``, one more turn of the loop per call; a Waiter whose colobus Future is
settled while the controller's channel drains its socket on the task's own loop
thread is held instead, and woken once the drain has read what waits, before it
sends: its callbacks (the task's wake-up) are taken off, it is set, and they run
there, so the task's next call leaves with that drain's sends, in the same turn of
the loop. Settled anywhere else it is set as an ``asyncio.Future`` would be (same
thread) or woken through the loop's inbox (another thread).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from typing import Any

from .inbox import Inbox

__all__ = ["Waiter", "Watch", "current_task_of", "drain_ends", "drain_reads_done", "drain_starts",
           "fire", "wake"]

_get_ident = threading.get_ident
# Whether a task of ``loop`` runs now (``asyncio.current_task``, a Python function on
# 3.11: its table read directly where it is asyncio's C one).
_TASKS: Any = getattr(asyncio.tasks, "_current_tasks", None)
_BUILTIN: Any = type(len)
if (_TASKS is not None and type(asyncio.current_task) is not _BUILTIN
        and type(getattr(asyncio.tasks, "_enter_task", None)) is _BUILTIN):
    _in_task: Any = _TASKS.__contains__
    current_task_of: Any = _TASKS.get  # asyncio.current_task(loop), read in C
else:
    def _in_task(loop: asyncio.AbstractEventLoop) -> bool:
        return asyncio.current_task(loop) is not None

    current_task_of = asyncio.current_task


class _Held(threading.local):
    waiters: list[Waiter] | None = None  # during a drain on this thread: woken after its reads
    backlog: collections.deque[Waiter] | None = None  # to wake, WAKE_CHUNK per turn


_HELD = _Held()


class Waiter(asyncio.Future):  # type: ignore[type-arg]
    """What a task waits on while it awaits one colobus Future (made with ``loop=``, on
    that loop's thread; ``_fut`` and ``_box`` set by the awaiting Future)."""

    __slots__ = ("_box", "_fut")

    _fut: Any  # the colobus Future it stands for
    _box: Inbox  # the inbox of its loop: how other threads wake it

    def cancel(self, msg: Any = None) -> bool:
        """The awaiting task was cancelled: so is the operation, and the task wakes."""
        if self.done():
            return False
        cancelled = super().cancel(msg)  # first: its wake-up (below) then finds it done
        self._fut.cancel()
        return cancelled

    def _settled(self, _: object) -> None:
        """A done-callback of the colobus Future (a second task awaiting it)."""
        wake(self)


class Watch(Waiter):
    """A :class:`Waiter` whose cancellation (the awaiting task cancelled) leaves the
    operation running: what ``await arr`` waits on (an array is a value that other code
    may hold; ``fut.cancel()`` of a call's Future cancels the call)."""

    __slots__ = ()

    def cancel(self, msg: Any = None) -> bool:
        return asyncio.Future.cancel(self, msg)


def fire(w: Waiter) -> None:
    """Wake ``w``'s task now (loop thread, outside any task): its callbacks (the task's
    wake-up) run here instead of being scheduled."""
    if w.done():  # cancelled meanwhile: its cancellation woke the task
        return
    callbacks = w._callbacks
    if not callbacks:
        w.set_result(None)
        return
    for fn, _ in callbacks:
        w.remove_done_callback(fn)
    w.set_result(None)
    for fn, context in callbacks:
        context.run(fn, w)


def wake(w: Waiter) -> None:
    """``w``'s colobus Future is done (on the thread that settled it): wake the task --
    after the reads of a drain running on its thread, else as soon as its loop can."""
    box = w._box
    if _get_ident() != box.thread:
        try:
            box.post(fire, w)
        except RuntimeError:  # the awaiting loop closed: nobody waits any more
            pass
        return
    held = _HELD.waiters
    if held is not None:
        held.append(w)  # the drain wakes it once it has read what waits
    elif not w.done():
        w.set_result(None)  # the task's wake-up is scheduled, as for any future


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
        if _in_task(held[0]._loop):
            for w in held:
                if not w.done():
                    w.set_result(None)  # (its wake-up is scheduled)
        else:
            backlog = _HELD.backlog
            if backlog and backlog[0]._loop is not held[0]._loop:  # a loop that ended
                backlog = _HELD.backlog = None
            room = 0 if backlog else WAKE_CHUNK - woken  # none ahead of those waiting
            for w in held[:room]:  # fire(w), inline: one Python call less per call
                if w.done():  # cancelled meanwhile: its cancellation woke the task
                    continue
                callbacks = w._callbacks
                if callbacks:
                    for fn, _ in callbacks:
                        w.remove_done_callback(fn)
                    w.set_result(None)
                    for fn, context in callbacks:
                        context.run(fn, w)
                else:
                    w.set_result(None)
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
        fire(backlog.popleft())
    if backlog:
        backlog[0]._loop.call_soon(_wake_backlog)
    else:
        _HELD.backlog = None


def drain_ends() -> None:
    """The drain is over: nothing is held any more (what is left is scheduled)."""
    held, _HELD.waiters = _HELD.waiters, None
    for w in held or ():
        w._loop.call_soon(fire, w)
