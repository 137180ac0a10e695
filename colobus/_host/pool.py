"""The threads a host's plain calls run on, and the unpickler of their arguments.

:class:`CallPool` runs one job per ready run of a stream's calls (see
:mod:`colobus._host.sched`); :class:`ArgsUnpickler` resolves the persistent ids
in a CALL's pickled arguments to the values stored on this host.
"""

from __future__ import annotations

import io
import logging
import pickle
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .._wire.envelope import Buffer

log = logging.getLogger("colobus.worker")

__all__ = ["ArgsLoader", "ArgsUnpickler", "CallPool"]


class CallPool:
    """The threads plain functions run on: one job per ready run of a stream's calls.

    ``ThreadPoolExecutor`` makes a ``concurrent.futures.Future`` (a condition
    variable and its lock) and a work item per job and takes a semaphore on each
    submit; the runs of calls need none of that. Threads start on demand, up to
    ``max_threads``; a job waits in the queue while all are busy.

    A job still running when its session ended (:meth:`new_session`) is *stuck*:
    nobody waits for it, and it may never end (a call blocked on a dead peer).
    The pool grows past stuck threads, so they cost the next session no
    capacity, up to ``hard_max`` threads in all (default four times
    ``max_threads``), with a warning; surplus threads leave once idle.
    """

    def __init__(self, max_threads: int, name: str, hard_max: int | None = None) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.idle = 0  # threads waiting for a job (read without the lock: a snapshot)
        self._threads: list[threading.Thread] = []
        self._max = max_threads
        self._hard_max = max(max_threads, hard_max if hard_max is not None else 4 * max_threads)
        self._name = name
        self._made = 0
        self._epoch = 0  # sessions begun; a job started in an older one is stuck
        self._running: dict[int, int] = {}  # thread ident -> the epoch its job started in
        self._held = 0  # threads not of the pool held in calls (an inline call past its time)
        self._warned = False

    def _stuck(self) -> int:
        epoch = self._epoch
        return sum(1 for e in self._running.values() if e < epoch)

    def _limit(self) -> int:
        return min(self._max + self._stuck(), self._hard_max)

    def submit(self, job: Callable[[], None]) -> bool:
        """Queue ``job``; whether a thread takes it now (False: all are busy)."""
        with self._lock:
            now = True
            if self.idle:
                self.idle -= 1  # that thread takes this job
            elif len(self._threads) + self._held < self._limit():
                self._made += 1
                t = threading.Thread(target=self._serve, daemon=True,
                                     name=f"{self._name}_{self._made}")
                self._threads.append(t)
                t.start()
            else:
                now = False
                if self._stuck() and not self._warned:
                    self._warned = True
                    log.warning("this host runs at most %d calls at once, and %d of them are "
                                "still calls of a controller that has gone (Python cannot stop "
                                "a running function): new calls wait until those end; restart "
                                "this worker to end them", self._hard_max, self._stuck())
        self._queue.put(job)
        return now

    def has_room(self) -> bool:
        """Whether a job submitted now would find a thread (idle, or one to start)."""
        if self.idle or len(self._threads) + self._held < self._max:
            return True  # (a snapshot, as ``idle`` is: the bound with no thread stuck)
        with self._lock:
            return bool(self.idle) or len(self._threads) + self._held < self._limit()

    def hold(self, ident: int) -> None:
        """Thread ``ident`` (not the pool's) runs a call from now on, as a pool thread would:
        the bound and the stuck count cover it until :meth:`unhold`."""
        with self._lock:
            self._held += 1
            self._running[ident] = self._epoch

    def unhold(self, ident: int) -> None:
        with self._lock:
            self._held -= 1
            self._running.pop(ident, None)

    def new_session(self) -> None:
        """A session ended: what still runs is stuck; the pool grows past it."""
        with self._lock:
            self._epoch += 1
            self._warned = False
            stuck = self._stuck()
        if stuck:
            log.warning("%d %s of the controller that has gone still %s on this host "
                        "(Python cannot stop a running function; %s result will be dropped). "
                        "New calls do not wait for %s: this host starts more threads for them "
                        "(up to %d in all)", stuck, "call" if stuck == 1 else "calls",
                        "runs" if stuck == 1 else "run", "its" if stuck == 1 else "their",
                        "it" if stuck == 1 else "them", self._hard_max)

    def figures(self) -> tuple[int, int]:
        """(threads, stuck threads): for the heartbeat and ``ctl.stats()``."""
        with self._lock:
            return len(self._threads) + self._held, self._stuck()

    def _serve(self) -> None:
        me = threading.get_ident()
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                self._running[me] = self._epoch
            try:
                job()
            except BaseException:  # a job reports its own errors; this is a bug
                log.exception("a call-pool job failed")
            del job
            with self._lock:
                del self._running[me]
                if len(self._threads) > self._limit() and self._queue.empty():
                    self._threads.remove(threading.current_thread())
                    return  # a surplus thread (grown past stuck ones) leaves
                self.idle += 1

    def shutdown(self) -> None:
        """Let the threads go once their jobs end (daemons: they never hold up exit)."""
        for _ in self._threads:
            self._queue.put(None)


class ArgsUnpickler(pickle.Unpickler):
    """Unpickles call arguments; persistent ids name values resolved on this host."""

    _values: Sequence[Any]

    def __init__(self, data: Buffer, values: Sequence[Any], buffers: Sequence[Buffer]) -> None:
        super().__init__(io.BytesIO(data), buffers=buffers)
        self._values = values

    def persistent_load(self, pid: Any) -> Any:
        try:
            return self._values[pid]
        except (IndexError, TypeError):
            raise pickle.UnpicklingError(f"bad persistent id {pid!r}") from None


class ArgsLoader(ArgsUnpickler):
    """:class:`ArgsUnpickler` made as ``pickle.Unpickler`` (a file, ``buffers=``), with no
    Python call; set ``_values`` before ``load()``."""

    __init__ = pickle.Unpickler.__init__
