"""The worker's event loop, handed between threads so a lone call runs where it arrived.

A plain call sent to the call pool costs two hand-offs between threads (the loop
wakes a pool thread, which wakes the loop back): on a lone call that is most of
what the host adds to a round trip. With a :class:`Baton`, the thread running the
loop (the *leader*) runs such a call itself: the loop stops after its current
iteration, the leader runs the call with no loop running, then runs the loop
again (the reply leaves in its first iteration).

A leader runs the loop as ``run_forever`` does, with the calls between its iterations:
the loop's setup and teardown (running loop, thread, async generator hooks) happen once
per leader, and around a call only what user code may see (no running loop, no loop
thread, the thread's own async generator hooks) is put back. Where this Python's loop
lacks the internals that takes (``_run_once``), it stops and runs ``run_forever`` again.

A watchdog thread keeps the loop moving meanwhile. A call still running after
:data:`STALL_S` (slow, blocked, or waiting for a call this host has not received
yet) loses the loop: a new thread takes it over and runs it from then on, so
heartbeats flow and later calls are received and run (a call that waits for another
completes). The thread left in the call finishes it, hands its outcome to the loop
like a pool thread, and ends. The watchdog sleeps on an alarm
(:mod:`colobus._host.alarm`) that the leader arms as each inline call starts and
disarms once the call's reply left: it wakes once for a call that outlives the
threshold, never for one that ends (and answers) in time, and never on a clock of its
own.

Every leader is a daemon thread; the main thread only waits for the worker's
coroutine to end (and takes SIGTERM for it), so a call stuck forever never holds up
the exit. On by default; ``COLOBUS_INLINE_CALLS=0`` in a worker's environment turns
it off (then ``asyncio.run``, every plain call on the pool).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from .alarm import make_alarm

if TYPE_CHECKING:
    from .pool import CallPool

__all__ = ["STALL_S", "Baton", "Batons", "serve_worker"]

log = logging.getLogger("colobus.worker")

_set_running_loop = asyncio.events._set_running_loop
# The loop's internals run_forever uses (CPython 3.11-3.13), for _drive.
_DRIVEN = all(hasattr(asyncio.BaseEventLoop, name) for name in (
    "_run_once", "_check_closed", "_check_running", "_set_coroutine_origin_tracking",
    "_asyncgen_firstiter_hook", "_asyncgen_finalizer_hook"))

STALL_S = 0.002  # an inline call running this long hands the loop to another thread
_monotonic = time.monotonic
_new = object.__new__


class _Inline:
    """One call a leader runs inline: when it started; whether its thread lost the loop."""

    __slots__ = ("ident", "lost", "started")

    def __init__(self) -> None:
        self.started = _monotonic()
        self.lost = False
        self.ident = threading.get_ident()


class Baton:
    """Runs a coroutine on an event loop whose thread may change (see the module docstring).

    Args:
        after_inline: called on the leader after an inline call ended on it, before
            the loop runs again (as if inside it): the scheduler sends what finished.
        on_takeover: called on a new leader before it runs the loop, taken from a
            thread still in its call (the scheduler takes finished calls from then
            on as from a pool thread).
        pool: the call pool, where a thread left in its call holds a place until
            the call ends (the pool's bound and stuck count cover it).
        stall_s: how long an inline call may keep the loop stopped.
    """

    def __init__(self, after_inline: Callable[[], None], on_takeover: Callable[[], None],
                 pool: CallPool, stall_s: float = STALL_S) -> None:
        self._after_inline = after_inline
        self._on_takeover = on_takeover
        self._pool = pool
        self.stall_s = stall_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()  # an inline call's end against its takeover
        self._job: Callable[[], None] | None = None  # what the loop stopped for
        self._inline: _Inline | None = None  # the inline call running now
        self._finished = False  # the coroutine ended: nobody runs the loop again
        self._done = threading.Event()
        self._ended_on: threading.Thread | None = None  # the leader that saw the end
        self._closing = False
        self._alarm = make_alarm(stall_s)  # rings for an inline call that outlived stall_s
        self._made = 0
        self.inlined = 0
        self.late = 0  # inline calls that ran stall_s or longer (lost the loop or not)
        self.takeovers = 0
        self.watch_wakes = 0  # the watchdog's wake-ups (at most one per late call)
        self.takeover_after_s = 0.0  # the last takeover: how long its call had run

    @property
    def busy(self) -> bool:
        """An inline call waits for the loop to stop, or runs (loop thread)."""
        return self._job is not None

    def watching(self) -> _Inline | None:
        """Inside an inline job: its watch entry (a job running several calls sets its
        ``started`` as each starts); None where the loop was taken from it already."""
        return self._inline

    def between(self, watch: _Inline, fn: Callable[..., None], *args: Any) -> bool:
        """Inside an inline job, between its calls: ``fn(*args)`` as the loop's owner, and
        True; False (and nothing run) where the thread lost the loop meanwhile. The
        watchdog cannot take the loop while ``fn`` runs; the job should end after it."""
        with self._lock:
            if watch.lost:
                return False
            fn(*args)
            watch.started = _monotonic()  # (what is left of the job is no stuck call)
            return True

    def rearm(self, watch: _Inline) -> bool:
        """Inside an inline job, between its calls: the alarm rings ``stall_s`` from now,
        where that wakes nobody (a timerfd), so a job of many brief calls never wakes the
        watchdog (whose every wake takes the GIL from the calls); whether it was moved.
        The next call is still watched from its own start: it starts after this arm."""
        if not self._alarm.quiet_arm:
            return False
        with self._lock:
            if watch.lost or self._inline is not watch:
                return False  # (another leader's job may own the alarm now)
            self._alarm.arm()
            return True

    def inline(self, job: Callable[[], None]) -> None:
        """Run ``job`` on this thread once the loop's current iteration ends (loop thread)."""
        assert self._job is None and self.loop is not None
        self._job = job
        self.loop.stop()

    # -- the main thread -----------------------------------------------------------------

    def run(self, main: Callable[[], Coroutine[Any, Any, int]],
            on_sigterm: Callable[[], None]) -> int:
        """Run ``main()`` to its end and return its result (call on the main thread)."""
        loop = self.loop = asyncio.new_event_loop()
        task = loop.create_task(main())
        task.add_done_callback(self._main_ended)
        # The loop runs on other threads: the main thread's handler hops to it.
        previous = signal.signal(signal.SIGTERM,
                                 lambda *_: loop.call_soon_threadsafe(on_sigterm))
        watchdog = threading.Thread(target=self._watch, name="colobus-loop-watch", daemon=True)
        try:
            watchdog.start()
            self._start_leader(taking_over=False)
            interrupted = False
            try:
                while not self._done.wait(1.0):  # a timed wait: signals reach this thread
                    pass
            except KeyboardInterrupt:  # as asyncio.run: the coroutine is cancelled first
                interrupted = True
                loop.call_soon_threadsafe(task.cancel)
                while not self._done.wait(1.0):
                    pass
            if self._ended_on is not None:  # out of its last Python frames before the exit
                self._ended_on.join(1.0)
            # No thread runs the loop now: what asyncio.run does after its coroutine.
            asyncio.runners._cancel_all_tasks(loop)  # type: ignore[attr-defined]
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
            if interrupted:
                raise KeyboardInterrupt
            return int(task.result())
        finally:
            signal.signal(signal.SIGTERM, previous)
            self._closing = True
            self._alarm.ring()
            watchdog.join(1.0)
            if not watchdog.is_alive():
                self._alarm.close()
            if not loop.is_running():  # (a second Ctrl-C left a leader in it: let it be)
                loop.close()

    def _main_ended(self, _: object) -> None:
        self._finished = True
        assert self.loop is not None
        self.loop.stop()

    # -- leaders -------------------------------------------------------------------------

    def _start_leader(self, taking_over: bool) -> None:
        self._made += 1
        threading.Thread(target=self._lead, args=(taking_over,), daemon=True,
                         name=f"colobus-loop-{self._made}").start()

    def _lead(self, taking_over: bool) -> None:
        """Run the loop; between its runs, the inline calls it stopped for."""
        loop = self.loop
        assert loop is not None
        try:
            if taking_over:
                self._with_loop_set(self._on_takeover)
            if _DRIVEN:
                ended = self._drive(loop)
                if ended:
                    self._ended_on = threading.current_thread()
                    self._done.set()
                return
            while True:
                loop.run_forever()
                if self._finished:
                    self._ended_on = threading.current_thread()
                    self._done.set()
                    return
                job, self._job = self._job, None
                if job is None:
                    continue
                if self._run_inline(job):  # another thread leads now; this one ends
                    return
                self._with_loop_set(self._after_inline)
        except BaseException:  # a bug here would stop the worker silently
            log.exception("the worker's loop thread failed")
            self._done.set()

    def _drive(self, loop: Any) -> bool:
        """``loop.run_forever()``, with the inline calls between its iterations; True
        when the coroutine ended, False when this thread lost the loop in a call."""
        loop._check_closed()
        loop._check_running()
        loop._set_coroutine_origin_tracking(loop._debug)
        hooks = sys.get_asyncgen_hooks()
        loop_hooks = (loop._asyncgen_firstiter_hook, loop._asyncgen_finalizer_hook)
        me = loop._thread_id = threading.get_ident()
        sys.set_asyncgen_hooks(*loop_hooks)
        _set_running_loop(loop)
        run_once = loop._run_once
        arm, disarm, stall_s = self._alarm.arm, self._alarm.disarm, self.stall_s
        lost = False
        try:
            while True:
                run_once()
                if not loop._stopping:
                    continue
                loop._stopping = False
                if self._finished:
                    return True
                job, self._job = self._job, None
                if job is None:
                    continue
                # As after run_forever: user code sees no loop running, on no thread.
                loop._thread_id = None
                _set_running_loop(None)
                sys.set_asyncgen_hooks(*hooks)
                inline = _new(_Inline)  # (_run_inline, written out; _Inline() inline)
                inline.started = _monotonic()
                inline.lost = False
                inline.ident = me
                self._inline = inline
                arm()
                try:
                    job()
                finally:
                    with self._lock:
                        mine = self._inline is inline
                        if mine:
                            self._inline = None
                    lost = inline.lost  # (final: the watchdog sets it only before that)
                del job  # holds the call's batch: nothing of it lives on here (as the pool)
                self.inlined += 1
                if lost:  # another thread leads now; this one ends with its call
                    self.late += 1
                    self._pool.unhold(inline.ident)
                    return False
                loop._thread_id = me
                sys.set_asyncgen_hooks(*loop_hooks)
                _set_running_loop(loop)
                self._after_inline()
                # The alarm covers the call and its reply: disarmed once the reply left,
                # so its system call is not on the call's way back (a lost call's thread
                # leaves the alarm to the new leader)
                if mine:
                    disarm()
                if _monotonic() - inline.started >= stall_s:
                    self.late += 1
        finally:
            if not lost:  # (a lost thread leaves the loop as its new leader has it)
                loop._stopping = False
                loop._thread_id = None
                _set_running_loop(None)
                loop._set_coroutine_origin_tracking(False)
                sys.set_asyncgen_hooks(*hooks)

    def _run_inline(self, job: Callable[[], None]) -> bool:
        """Run an inline call's ``job`` (its loop stopped); whether it lost the loop."""
        me = _Inline()
        self._inline = me  # no lock: the watchdog only reads it, until it ends it
        self._alarm.arm()
        try:
            job()
        finally:
            with self._lock:
                mine = self._inline is me
                if mine:
                    self._inline = None
            if mine:
                self._alarm.disarm()
            if _monotonic() - me.started >= self.stall_s:
                self.late += 1
        del job  # holds the call's batch: nothing of it lives on here (as the pool)
        self.inlined += 1
        if me.lost:
            self._pool.unhold(me.ident)
        return me.lost

    def _with_loop_set(self, fn: Callable[[], None]) -> None:
        """``fn()`` as if inside the (stopped) loop: the scheduler's code asks for the
        running loop. Never around user code (a plain call sees no running loop)."""
        asyncio.events._set_running_loop(self.loop)
        try:
            fn()
        finally:
            asyncio.events._set_running_loop(None)

    def _watch(self) -> None:
        """Hand the loop to a new thread when an inline call runs past ``stall_s``.

        It sleeps on the alarm each inline call arms: it wakes only when one rang, for
        a call still running then (or one whose reply was leaving), and for the close.
        """
        alarm = self._alarm
        while True:
            alarm.wait()
            if self._closing:
                return
            self.watch_wakes += 1
            with self._lock:
                current = self._inline
                if current is None:
                    continue  # it ended as the alarm rang
                ran = _monotonic() - current.started
                if ran < self.stall_s:
                    # a later call of the job (a slice of pipelined calls): it is watched
                    # from its own start. (A later job arms the alarm for itself; this
                    # arm then only moves its ring nearer, never past it.)
                    alarm.arm_in(self.stall_s - ran)
                    continue
                current.lost = True  # read by its thread once the call ends
                self._inline = None
                self._pool.hold(current.ident)
            self.takeovers += 1
            self.takeover_after_s = ran
            self._start_leader(taking_over=True)


class Batons(Protocol):
    """What :func:`serve_worker` uses of the worker's scheduler."""

    baton: Baton | None
    pool: CallPool

    def inline_ended(self) -> None: ...


def serve_worker(serve: Callable[[], Coroutine[Any, Any, int]], sched: Batons,
                 on_sigterm: Callable[[], None]) -> int:
    """Run a worker's ``serve()``: with a :class:`Baton` (inline calls) where
    this is the main thread (unless ``COLOBUS_INLINE_CALLS=0``), else with ``asyncio.run``."""
    if (os.environ.get("COLOBUS_INLINE_CALLS", "1") == "0"
            or threading.current_thread() is not threading.main_thread()):
        return asyncio.run(serve())
    baton = sched.baton = Baton(sched.inline_ended, sched.inline_ended, sched.pool)
    return baton.run(serve, on_sigterm)
