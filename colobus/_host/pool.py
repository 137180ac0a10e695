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

__all__ = ["ArgsUnpickler", "CallPool"]


class CallPool:
    """The threads plain functions run on: one job per ready run of a stream's calls.

    ``ThreadPoolExecutor`` makes a ``concurrent.futures.Future`` (a condition
    variable and its lock) and a work item per job and takes a semaphore on each
    submit; the runs of calls need none of that. Threads start on demand, up to
    ``max_threads``; a job waits in the queue while all are busy.
    """

    def __init__(self, max_threads: int, name: str) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads: list[threading.Thread] = []
        self._max = max_threads
        self._name = name

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1  # that thread takes this job
            elif len(self._threads) < self._max:
                t = threading.Thread(target=self._serve, daemon=True,
                                     name=f"{self._name}_{len(self._threads)}")
                self._threads.append(t)
                t.start()
        self._queue.put(job)

    def _serve(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                job()
            except BaseException:  # a job reports its own errors; this is a bug
                log.exception("a call-pool job failed")
            del job
            with self._lock:
                self._idle += 1

    def shutdown(self) -> None:
        """Let the threads go once their jobs end (daemons: they never hold up exit)."""
        for _ in self._threads:
            self._queue.put(None)


class ArgsUnpickler(pickle.Unpickler):
    """Unpickles call arguments; persistent ids name values resolved on this host."""

    def __init__(self, data: Buffer, values: Sequence[Any], buffers: Sequence[Buffer]) -> None:
        super().__init__(io.BytesIO(data), buffers=buffers)
        self._values = values

    def persistent_load(self, pid: Any) -> Any:
        try:
            return self._values[pid]
        except (IndexError, TypeError):
            raise pickle.UnpicklingError(f"bad persistent id {pid!r}") from None
