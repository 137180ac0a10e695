"""What colocated calls did, counted per function, for metrics, timings and traces.

A controller owns one :class:`Observer` when metrics or tracing is on, and feeds
it from four call sites: a call is made (the caller's thread), the loop sends
it, each host's RESULT is read (the loop thread), and its future settles (the
thread that resolves it). With both off there is no Observer, and each of those
call sites costs one attribute check.
"""

from __future__ import annotations

import array
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ._trace import CallRecord, ChromeTrace, OtelSpans

if TYPE_CHECKING:
    from . import _protocol as P
    from ._metrics import MetricsServer

__all__ = ["BUCKETS", "FunctionStats", "Histogram", "Observer", "host_health", "observing"]

log = logging.getLogger("colobus.observe")

_FINISHED, _FAILED, _CANCELLED = range(3)  # CallRecord.code
_OUTCOMES = ("finished", "failed", "cancelled")
FOLD_AT = 8192  # samples a function keeps before folding them without a scrape

# Upper bounds (seconds) of the latency and run-time histograms' buckets; +Inf follows.
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
           1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_BOUNDS = np.array(BUCKETS)


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
        where = np.searchsorted(_BOUNDS, values, side="left")  # == bisect_left, vectorised
        for i, n in enumerate(np.bincount(where, minlength=len(self.counts)).tolist()):
            self.counts[i] += n
        self.total += float(values.sum())

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
    started and appends each host's queued and run nanoseconds (whole pairs of
    int64s, ``Operations.on_result``); the thread that settles the call's Future appends
    its latency to the array of its outcome. :meth:`fold` moves them into the
    counters and histograms when someone reads them (a scrape), or when
    :data:`FOLD_AT` samples wait.

    The samples wait in arrays (``array.array``), as raw doubles and int64s, not in
    lists or deques of Python numbers: thousands of floats and ints kept alive
    until a fold made every call allocate fresh memory instead of reusing what
    the last call freed, which cost pipelined calls about 10 % (see
    docs/observability.md).
    """

    __slots__ = ("cancelled", "ends", "failed", "finished", "host_times", "latency", "lock",
                 "queue", "run", "started")

    def __init__(self) -> None:
        self.lock = threading.Lock()  # held by fold (and copy)
        self.started = self.finished = self.failed = self.cancelled = 0
        self.latency = Histogram()  # call made -> future settled (controller)
        self.run = Histogram()  # ran on a host, one entry per host per call
        self.queue = Histogram()  # waited on a host before running, likewise
        # Latencies (seconds) of calls that finished, failed, were cancelled; and
        # host times flat (queued ns, ran ns, ...), whole pairs only.
        self.ends: tuple[array.array[float], ...] = (
            array.array("d"), array.array("d"), array.array("d"))
        self.host_times: array.array[int] = array.array("q")

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
        host_times = self.host_times
        n = len(host_times) // 2 * 2  # pairs are appended whole: an odd one is coming
        if n:
            pairs = np.maximum(np.array(host_times[:n], dtype=np.int64).reshape(-1, 2), 0)
            del host_times[:n]
            self.queue.add_all(pairs[:, 0] / 1e9)
            self.run.add_all(pairs[:, 1] / 1e9)

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
        self.trace = trace
        self.otel = OtelSpans() if otel else None
        self.records = records or trace is not None or otel

    # -- the call sites ------------------------------------------------------------------

    def function(self, name: str) -> FunctionStats:
        """The counters of the function called ``name`` (any thread; made on first use).

        A colocated call's Future carries them (``Operations.submit(stats=)``),
        set before the loop sees the call: the loop counts it started and adds
        each host's times (``Operations._start``, ``Operations.on_result``), and
        the Future settles it (``Future._finish``), so a call costs no table
        entry, no done-callback and no call through the observer.
        """
        return self.functions_by_name.get(name) or self._add_function(name)

    def record(self, call_id: int, name: str, hosts: tuple[int, ...]) -> CallRecord | None:
        """A new call's timing record where calls keep one (``trace=``), else None."""
        return CallRecord(call_id, name, hosts, time.perf_counter(), self) if self.records else None

    def _add_function(self, name: str) -> FunctionStats:
        with self._lock:
            return self.functions_by_name.setdefault(name, FunctionStats())

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


def observing(metrics: str | None, public: bool, trace: bool | str | os.PathLike[str] | None,
              stats: Callable[[], dict[str, Any]]
              ) -> tuple[Observer | None, MetricsServer | None, ChromeTrace | None]:
    """A controller's ``(observer, metrics server, Chrome trace)``; Nones when off.

    Raises:
        ValueError: a malformed ``metrics`` address, or one not loopback
            without ``public``.
        ImportError: ``metrics`` given without ``prometheus_client``.
    """
    if metrics is None and not trace:
        return None, None, None
    from ._metrics import MetricsServer, parse_address

    server_at = parse_address(metrics, public) if metrics is not None else None
    chrome = ChromeTrace(None if trace is True else trace) if trace else None
    observer = Observer(chrome, otel=bool(trace) and OtelSpans.available())
    server = MetricsServer(*server_at, stats, observer) if server_at is not None else None
    return observer, server, chrome


def host_health(host: Any) -> dict[str, Any]:
    """A host's figures from its last heartbeat, for ``Controller.stats()``.

    The heartbeat was read off the wire: only ``str -> int`` drop counters are
    kept, a few at most.
    """
    beat: P.Heartbeat | None = host.health
    dropped: dict[str, int] = {}
    if beat is not None:
        items = [(k, v) for k, v in beat.dropped.items()
                 if isinstance(k, str) and type(v) is int][:32]
        dropped = {k[:64]: v for k, v in items}
    return {
        "devices": len(host.devices),
        "rtt": host.rtt,
        "rss": beat.rss if beat is not None else None,
        "cpu": beat.cpu / 1e9 if beat is not None else None,
        "dropped": dropped,
    }
