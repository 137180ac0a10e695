"""The worker's event loop handed between threads (leader/follower), for inline calls.

A lone plain call costs two thread hand-offs on the pool (the loop thread wakes a
pool thread, which wakes the loop thread back). :class:`LoopBaton` lets the
thread that received it run it instead: the loop stops after the current
iteration, its thread (the *leader*) runs the call with no loop running, and
starts the loop again. A watchdog thread keeps the loop alive meanwhile: if
the call is still running after ``stall_s`` (it is slow, or blocks, or waits
for a call that has not arrived yet), another thread (a *follower*) takes the
loop over, so heartbeats flow and later calls are received and run; the
thread in the call becomes a follower once its call ends.

Every thread that leads is a daemon: the main thread only waits for the
worker's coroutine to end, so a call stuck forever never holds up the exit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from .pool import CallPool

__all__ = ["InlineScheduler", "LoopBaton", "run_serving"]

log = logging.getLogger("colobus.worker")

STALL_S = 0.002  # an inline call running this long hands the loop to a follower
IDLE_FOLLOWERS = 2  # followers kept waiting to lead; more leave
WATCH_IDLE_S = 0.5  # the watchdog sleeps until woken after this long without inline calls

_RUNNING, _DONE, _ABANDONED = range(3)


class _Inline:
    """One inline job: when it started, and whether its thread still leads."""

    __slots__ = ("ident", "started", "state")

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.state = _RUNNING
        self.ident = threading.get_ident()


class LoopBaton:
    """Runs a coroutine on an event loop whose thread may change (see the module docstring).

    Args:
        on_takeover: called on the new leader before it runs the loop, after it
            took the loop from a thread still in an inline job (the scheduler
            collects what that job finished so far).
        after_inline: called on the leader after its own inline job ended (loop
            stopped; it may ``call_soon``).
        pool: the call pool, where an inline job that lost the loop holds a place
            until it ends (the pool's bound covers it).
        stall_s: how long an inline job may keep the loop stopped.
    """

    def __init__(self, on_takeover: Callable[[], None], after_inline: Callable[[], None],
                 pool: CallPool, stall_s: float = STALL_S) -> None:
        self._on_takeover = on_takeover
        self._after_inline = after_inline
        self._pool = pool
        self.stall_s = stall_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task[Any] | None = None
        self._lock = threading.Lock()
        self._followers = threading.Condition(self._lock)  # followers wait to lead here
        self._watch = threading.Condition(self._lock)  # the watchdog waits here
        self._job: Callable[[], None] | None = None  # what the loop stopped for
        self._current: _Inline | None = None  # the inline job running now
        self._wanted = False  # the loop needs a leader (taken from a thread in a job)
        self._idle = 0  # followers waiting
        self._finished = threading.Event()
        self._watch_asleep = True
        self._watcher: threading.Thread | None = None
        self._made = 0
        self.takeovers = 0

    # -- used on the loop thread -------------------------------------------------------

    @property
    def busy(self) -> bool:
        """An inline job waits for the loop to stop (no second one may be handed)."""
        return self._job is not None

    def inline(self, job: Callable[[], None]) -> None:
        """Run ``job`` on this thread once the loop's current iteration ends (loop thread)."""
        assert self._job is None and self.loop is not None
        self._job = job
        self.loop.stop()

    # -- the threads -------------------------------------------------------------------

    def run(self, main: Callable[[], Coroutine[Any, Any, int]],
            on_sigterm: Callable[[], None] | None = None) -> int:
        """Run ``main()`` to its end; its result (call on the main thread)."""
        loop = self.loop = asyncio.new_event_loop()
        self._main = loop.create_task(main())
        self._main.add_done_callback(lambda _: loop.stop())
        previous: Any = None
        if on_sigterm is not None:
            # The loop runs on another thread: the main thread's handler hops to it.
            previous = signal.signal(signal.SIGTERM, lambda *_: loop.call_soon_threadsafe(
                on_sigterm))
        try:
            self._start_leader()
            while not self._finished.wait(1.0):
                pass
            # No thread runs the loop now: what asyncio.run does after its coroutine.
            asyncio.runners._cancel_all_tasks(loop)  # type: ignore[attr-defined]
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
            return int(self._main.result())
        finally:
            if on_sigterm is not None:
                signal.signal(signal.SIGTERM, previous)
            loop.close()
            with self._lock:
                self._followers.notify_all()
                self._watch.notify_all()

    def _start_leader(self) -> None:
        self._made += 1
        threading.Thread(target=self._serve, daemon=True,
                         name=f"colobus-loop-{self._made}").start()

    def _serve(self, taking_over: bool = False) -> None:
        """A thread's life: lead while it can, follow while it must, until the end."""
        try:
            while True:
                if taking_over:
                    self._on_takeover()
                if not self._lead():
                    return  # the coroutine ended
                if not self._follow():
                    return
                taking_over = True
        except BaseException:  # a bug here would stop the worker silently
            log.exception("the worker's loop thread failed")
            self._finished.set()

    def _lead(self) -> bool:
        """Run the loop and the inline jobs it stops for; False once the coroutine ended,
        True when a follower took the loop while this thread was in a job."""
        loop = self.loop
        main = self._main
        assert loop is not None and main is not None
        while True:
            loop.run_forever()
            if main.done():
                self._finished.set()
                return False
            job, self._job = self._job, None
            if job is None:
                continue
            rec = _Inline()
            with self._lock:
                self._current = rec
                if self._watch_asleep:
                    self._wake_watchdog()
            try:
                job()
            except BaseException:  # a job reports its own errors; this is a bug
                log.exception("an inline call job failed")
            with self._lock:
                lost = rec.state == _ABANDONED
                rec.state = _DONE
                if self._current is rec:
                    self._current = None
            if lost:
                self._pool.release_adopted()
                return True
            self._after_inline()

    def _follow(self) -> bool:
        """Wait until the loop needs this thread to lead (True), or the end (False)."""
        with self._lock:
            self._idle += 1
            try:
                while not self._wanted:
                    if self._finished.is_set() or self._idle > IDLE_FOLLOWERS:
                        return False
                    self._followers.wait(1.0)
                self._wanted = False
                return True
            finally:
                self._idle -= 1

    def _wake_watchdog(self) -> None:
        """Lock held: the watchdog watches from now on."""
        self._watch_asleep = False
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watchdog, daemon=True,
                                             name="colobus-loop-watch")
            self._watcher.start()
        else:
            self._watch.notify()

    def _watchdog(self) -> None:
        """Hand the loop to a follower when an inline job keeps it stopped too long.

        It polls every ``stall_s`` while inline jobs come (waking it per job would
        cost each call a thread wake-up), and sleeps once none came for a while.
        """
        last_seen = time.monotonic()
        with self._lock:
            while not self._finished.is_set():
                rec = self._current
                now = time.monotonic()
                if rec is None:
                    if now - last_seen > WATCH_IDLE_S:
                        self._watch_asleep = True
                        self._watch.wait()
                        last_seen = time.monotonic()
                    else:
                        self._watch.wait(self.stall_s)
                    continue
                last_seen = now
                left = rec.started + self.stall_s - now
                if left > 0:
                    self._watch.wait(left)
                    continue
                # Still in it: the loop goes on without this thread.
                rec.state = _ABANDONED
                self._current = None
                self._pool.adopt(rec.ident)
                self.takeovers += 1
                if self._idle:
                    self._wanted = True
                    self._followers.notify()
                else:
                    self._made += 1
                    threading.Thread(target=self._serve, args=(True,), daemon=True,
                                     name=f"colobus-loop-{self._made}").start()


class InlineScheduler(Protocol):
    """What :func:`run_serving` sets up in the worker's scheduler."""

    baton: LoopBaton | None
    inline_always: bool
    pool: CallPool

    def inline_ended(self) -> None: ...


def run_serving(serve: Callable[[], Coroutine[Any, Any, int]], sched: InlineScheduler,
                on_sigterm: Callable[[], None]) -> int:
    """Run the worker's ``serve()`` to its end, with inline calls unless
    ``COLOBUS_INLINE_CALLS=0`` (``always``: also right after slow calls)."""
    inline = os.environ.get("COLOBUS_INLINE_CALLS", "1")
    if inline == "0":
        return asyncio.run(serve())
    sched.inline_always = inline == "always"
    baton = sched.baton = LoopBaton(sched.inline_ended, sched.inline_ended, sched.pool)
    on_main = threading.current_thread() is threading.main_thread()
    return baton.run(serve, on_sigterm if on_main else None)
