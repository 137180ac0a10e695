"""The ready runs of many streams, taken by as few pool jobs as keep them moving.

Each stream's ready plain calls form one run (:mod:`colobus._host.sched`). A pool
job per run costs a hand-off between threads per run; with many streams of one
call each (asyncio tasks, each its own stream) that hand-off was most of a call's
cost on the host. Here the runs wait in one queue, and one pool job (a *runner*)
takes them one after another. Runs of different streams may still need to run at
the same time (a call that waits for another stream's call, a call that sleeps):
while runs wait and no runner has taken one for :data:`HELP_AFTER_S`, more runners
start (one, then two, then four at each look that finds no progress), so calls that
wait for each other complete, and runs behind blocked calls wait a few of those
looks at most.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import threading
from collections.abc import Callable

from .pool import CallPool

__all__ = ["HELP_AFTER_S", "Runners"]

HELP_AFTER_S = 0.001  # a waiting run gets a runner of its own after this long without progress
HELP_MAX = 4  # runners one look adds at most


class Runners:
    """A queue of ready runs (callables, run on pool threads in the order added) and the
    pool jobs that take them from ``pool``."""

    def __init__(self, pool: CallPool) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._ready: collections.deque[Callable[[], None]] = collections.deque()
        self._runners = 0  # pool jobs taking runs now (or queued to)
        self._taken = 0  # runs taken so far: progress, for the watch
        self._seen = 0
        self._watching = False
        self._burst = 1  # runners the next stall adds
        self._gen = 0  # bumped by clear(): runners of before it stop

    def add(self, run: Callable[[], None], loop: asyncio.AbstractEventLoop) -> bool:
        """Loop thread: queue a run; False where no thread is free to take it now."""
        with self._lock:
            self._ready.append(run)
            start = self._runners == 0
            if start:
                self._runners += 1
            gen = self._gen
        if start:
            return self._pool.submit(functools.partial(self._runner, gen))
        self._watch(loop)
        return self._pool.has_room()

    def waiting(self) -> bool:
        """A run waits for a runner (loop thread; a snapshot)."""
        return bool(self._ready)

    def clear(self) -> None:
        """The session ended: its waiting runs are dropped, its runners stop."""
        with self._lock:
            self._gen += 1
            self._ready.clear()
            self._runners = 0

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._watching:
            return
        self._watching = True
        self._seen = self._taken
        loop.call_later(HELP_AFTER_S, self._check, loop)

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        """Loop thread: runs wait and none was taken since the last look: more runners,
        twice as many as at the last stall, up to :data:`HELP_MAX` (many blocked calls
        get threads within a few looks; quick ones rarely stall twice in a row)."""
        self._watching = False
        with self._lock:
            if not self._ready:
                self._burst = 1
                return
            if self._taken != self._seen:
                self._burst = 1
                more = 0
            else:
                more = min(self._burst, len(self._ready))
                self._burst = min(2 * self._burst, HELP_MAX)
                self._runners += more
            gen = self._gen
        for _ in range(more):
            self._pool.submit(functools.partial(self._runner, gen))
        self._watch(loop)

    def _runner(self, gen: int) -> None:
        """Pool thread: take runs until none waits (a runner of session ``gen``)."""
        while True:
            with self._lock:
                if gen != self._gen:
                    return  # cleared: a new session counts its own runners
                if not self._ready:
                    self._runners -= 1
                    return
                run = self._ready.popleft()
                self._taken += 1
            run()
            del run
