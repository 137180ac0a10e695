"""What colocated calls did, counted per function, for metrics, timings and traces.

A controller owns one :class:`Observer` when metrics or tracing is on, and feeds
it from three call sites: a call is made (the caller's thread), the loop sends
it, and its future settles (the thread that resolves it); a traced call also
records each host's RESULT as it is read. How long calls waited and ran on the
hosts arrives with the hosts' heartbeats (:meth:`Observer.add_host_calls`).
With both off there is no Observer, and each of those call sites costs one
attribute check.
"""

from __future__ import annotations

import array
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from .._wire.calltimes import BUCKETS, bucket_counts, read_entries
from .trace import CallRecord, ChromeTrace, OtelSpans

if TYPE_CHECKING:
    pass

__all__ = ["BUCKETS", "FunctionStats", "Histogram", "Observer"]

log = logging.getLogger("colobus.observe")

_FINISHED, _FAILED, _CANCELLED = range(3)  # CallRecord.code
_OUTCOMES = ("finished", "failed", "cancelled")
FOLD_AT = 8192  # samples a function keeps before folding them without a scrape

class Histogram:
    """Counts per bucket of :data:`BUCKETS` (the last: above them all) and their sum."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0

    def add_all(self, values: np.ndarray[Any, Any]) -> None:
        """Count ``values`` (seconds), each in the first bucket whose bound it does not pass."""
        if not len(values):
            return
        self.add_counts(bucket_counts(values), float(values.sum()))

    def add_counts(self, counts: list[int], total: float) -> None:
        """Add counts already bucketed (one per bucket, as :attr:`counts`) and their sum."""
        for i, n in enumerate(counts):
            self.counts[i] += n
        self.total += total

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count of values <= le)`` pairs, as a Prometheus histogram has them."""
        out, running = [], 0
        for bound, n in zip((*BUCKETS, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


class FunctionStats:
    """One function's calls: how many started and how each ended, and how long they took.

    The call path only appends numbers (an append is one step under the GIL, so
    no lock and no bucket search per call): the loop thread counts a call
    started, and the thread that settles the call's Future appends its latency
    to the array of its outcome. :meth:`fold` moves them into the counters and
    the latency histogram when someone reads them (a scrape), or when
    :data:`FOLD_AT` samples wait. How long calls waited and ran on the hosts
    is counted by the hosts and arrives with their heartbeats, already
    bucketed (:mod:`colobus._wire.calltimes`, :meth:`Observer.add_host_calls`).

    The samples wait in arrays (``array.array``), as raw doubles and int64s, not in
    lists or deques of Python numbers: thousands of floats and ints kept alive
    until a fold made every call allocate fresh memory instead of reusing what
    the last call freed, which cost pipelined calls about 10 % (see
    docs/observability.md).
    """

    __slots__ = ("cancelled", "ends", "failed", "finished", "latency", "lock", "queue", "run",
                 "started")

    def __init__(self) -> None:
        self.lock = threading.Lock()  # held by fold (and copy)
        self.started = self.finished = self.failed = self.cancelled = 0
        self.latency = Histogram()  # call made -> future settled (controller)
        self.run = Histogram()  # ran on a host, one entry per host per call (from heartbeats)
        self.queue = Histogram()  # waited on a host before running, likewise
        # Latencies (seconds) of calls that finished, failed, were cancelled.
        self.ends: tuple[array.array[float], ...] = (
            array.array("d"), array.array("d"), array.array("d"))

    def fold_locked(self) -> None:
        """:meth:`fold` under :attr:`lock` (nobody scrapes: keep the samples few)."""
        with self.lock:
            self.fold()

    def fold(self) -> None:
        """Move the samples into the counters and histograms (holding :attr:`lock`)."""
        latencies: list[float] = []
        counts = [0, 0, 0]
        for outcome, samples in enumerate(self.ends):
            n = len(samples)  # appends may go on meanwhile: take and drop just these
            latencies.extend(samples[:n])
            del samples[:n]
            counts[outcome] = n
        self.finished += counts[_FINISHED]
        self.failed += counts[_FAILED]
        self.cancelled += counts[_CANCELLED]
        self.latency.add_all(np.array(latencies, dtype=np.float64))

    def copy(self) -> FunctionStats:
        out = FunctionStats()
        out.started, out.finished, out.failed, out.cancelled = (
            self.started, self.finished, self.failed, self.cancelled)
        for name in ("latency", "run", "queue"):
            src, dst = getattr(self, name), getattr(out, name)
            dst.counts, dst.total = list(src.counts), src.total
        return out


class Observer:
    """Per-function counters of one controller, and per-call records where traced.

    Args:
        trace: the Chrome trace to add settled calls to, or None.
        otel: emit OpenTelemetry spans (``opentelemetry`` must be importable).
        records: keep a :class:`CallRecord` per call (``fut.timings()``): on
            with ``trace=``; metrics alone need only the counters.
    """

    def __init__(self, trace: ChromeTrace | None = None, otel: bool = False,
                 records: bool = False) -> None:
        self._lock = threading.Lock()  # adding a function
        self.functions_by_name: dict[str, FunctionStats] = {}
        # The same counters by what hosts call a function: (code digest, method).
        self.functions_by_key: dict[tuple[bytes, str], FunctionStats] = {}
        self.trace = trace
        self.otel = OtelSpans() if otel else None
        self.records = records or trace is not None or otel

    # -- the call sites ------------------------------------------------------------------

    def function(self, name: str, key: tuple[bytes, str] = (b"", "")) -> FunctionStats:
        """The counters of the function called ``name`` (any thread; made on first use).

        ``key`` is what hosts call it when they report its run times: its code
        digest and method name (:mod:`colobus._wire.calltimes`). A colocated call's
        Future carries the counters (``Operations.submit(stats=)``), set before
        the loop sees the call: the loop counts it started
        (``Operations._start``) and the Future settles it (``Future._finish``),
        so a call costs no table entry, no done-callback and no call through
        the observer.
        """
        return self.functions_by_key.get(key) or self._add_function(name, key)

    def record(self, call_id: int, name: str, hosts: tuple[int, ...]) -> CallRecord | None:
        """A new call's timing record where calls keep one (``trace=``), else None."""
        return CallRecord(call_id, name, hosts, time.perf_counter(), self) if self.records else None

    def _add_function(self, name: str, key: tuple[bytes, str]) -> FunctionStats:
        with self._lock:
            stats = self.functions_by_name.setdefault(name, FunctionStats())
            if key != (b"", ""):
                self.functions_by_key.setdefault(key, stats)
            return stats

    def add_host_calls(self, entries: list[Any]) -> int:
        """A host's heartbeat reported how long calls waited and ran (loop thread).

        Adds the well-formed entries of known functions to their queue and run
        histograms; returns how many entries were dropped (malformed, or naming
        a function never called).
        """
        good, bad = read_entries(entries)
        for key, queued, queued_ns, ran, ran_ns in good:
            stats = self.functions_by_key.get(key)
            if stats is None:
                bad += 1
                continue
            with stats.lock:
                stats.queue.add_counts(queued, queued_ns / 1e9)
                stats.run.add_counts(ran, ran_ns / 1e9)
        return bad

    def settled(self, rec: CallRecord, outcome: int) -> None:
        """A traced call's Future settled (the resolving thread): trace it."""
        rec.settled = time.perf_counter()
        rec.outcome = _OUTCOMES[outcome]
        if self.trace is not None:
            self.trace.add(rec)
        if self.otel is not None:
            try:
                self.otel.add(rec)
            except Exception:  # a broken exporter must not break calls
                log.exception("could not emit an OpenTelemetry span")

    # -- reading -----------------------------------------------------------------------

    def functions(self) -> dict[str, FunctionStats]:
        """A copy of every function's counters (any thread)."""
        out = {}
        for name, stats in list(self.functions_by_name.items()):
            with stats.lock:
                stats.fold()
                out[name] = stats.copy()
        return out

    def in_flight(self) -> int:
        """Colocated calls started and not settled yet."""
        total = 0
        for s in self.functions().values():
            total += max(0, s.started - s.finished - s.failed - s.cancelled)
        return total


