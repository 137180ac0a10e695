"""What colocated calls did, counted per function, for metrics, timings and traces.

A controller owns one :class:`Observer` when metrics or tracing is on, and feeds
it from four call sites: a call is made (the caller's thread), the loop sends
it, each host's RESULT is read (the loop thread), and its future settles (the
thread that resolves it). With both off there is no Observer, and each of those
call sites costs one attribute check.
"""

from __future__ import annotations

import bisect
import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._trace import CallRecord, ChromeTrace, OtelSpans

if TYPE_CHECKING:
    from . import _protocol as P
    from ._controller import Controller
    from ._future import Future
    from ._metrics import MetricsServer

__all__ = ["BUCKETS", "FunctionStats", "Histogram", "Observer", "host_health", "observing"]

log = logging.getLogger("colobus.observe")

_FINISHED, _FAILED, _CANCELLED = range(3)

# Upper bounds (seconds) of the latency and run-time histograms' buckets; +Inf follows.
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
           1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    """Counts per bucket of :data:`BUCKETS` (the last: above them all) and their sum."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0

    def add(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count of values <= le)`` pairs, as a Prometheus histogram has them."""
        out, running = [], 0
        for bound, n in zip((*BUCKETS, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


class FunctionStats:
    """One function's calls: how many started and how each ended, and how long they took.

    The call path only appends to ``ends`` and ``host_times`` (a deque append is
    atomic, so no lock and no bucket search per call); :meth:`fold` moves them
    into the counters and histograms when someone reads them (a scrape).
    """

    __slots__ = ("cancelled", "ends", "failed", "finished", "host_times", "latency", "queue",
                 "run", "started")

    def __init__(self) -> None:
        self.started = self.finished = self.failed = self.cancelled = 0
        self.latency = Histogram()  # call made -> future settled (controller)
        self.run = Histogram()  # ran on a host, one entry per host per call
        self.queue = Histogram()  # waited on a host before running, likewise
        # Samples as flat deques of numbers: a tuple per sample would be one more
        # object per call for the garbage collector to count and scan.
        self.ends: collections.deque[float] = collections.deque()  # outcome, seconds, ...
        self.host_times: collections.deque[int] = collections.deque()  # queued ns, ran ns, ...

    def fold(self) -> None:
        """Move the samples the call path appended into the counters (under the lock)."""
        ends, host_times = self.ends, self.host_times
        while len(ends) >= 2:  # pairs are appended outcome first: a lone outcome waits
            outcome = ends.popleft()
            seconds = ends.popleft()
            if outcome == _FINISHED:
                self.finished += 1
            elif outcome == _FAILED:
                self.failed += 1
            else:
                self.cancelled += 1
            self.latency.add(seconds)
        while len(host_times) >= 2:
            queued = host_times.popleft()
            ran = host_times.popleft()
            self.queue.add(queued / 1e9)
            self.run.add(ran / 1e9)

    def copy(self) -> FunctionStats:
        out = FunctionStats()
        out.started, out.finished, out.failed, out.cancelled = (
            self.started, self.finished, self.failed, self.cancelled)
        for name in ("latency", "run", "queue"):
            src, dst = getattr(self, name), getattr(out, name)
            dst.counts, dst.total = list(src.counts), src.total
        return out


class Observer:
    """Per-function counters and per-call records of one controller.

    Args:
        trace: the Chrome trace to add settled calls to, or None.
        otel: emit OpenTelemetry spans (``opentelemetry`` must be importable).
    """

    def __init__(self, trace: ChromeTrace | None = None, otel: bool = False) -> None:
        self._lock = threading.Lock()
        self._functions: dict[str, FunctionStats] = {}
        self._calls: dict[int, CallRecord] = {}
        self.trace = trace
        self.otel = OtelSpans() if otel else None
        self._settled = self._on_settled  # one bound method, not one per call

    # -- the call sites ------------------------------------------------------------------

    def submit(self, ctl: Controller, hosts: tuple[int, ...], op: Any, decode: Any,
               name: str) -> Future[Any]:
        """Caller's thread: ``ctl.submit`` a colocated call (``op``), recording it."""
        rec = self.call_made(op.call_id, name, hosts)
        try:
            fut = ctl._ops.submit(hosts, op.send, decode, op, call_id=op.call_id,
                                  cancellable=True)
        except BaseException:
            with self._lock:
                self._calls.pop(op.call_id, None)
                rec.stats.started -= 1
            raise
        self.watch(fut, rec)
        return fut

    def call_made(self, call_id: int, name: str, hosts: tuple[int, ...]) -> CallRecord:
        """Caller's thread, before the call is submitted."""
        with self._lock:
            stats = self._functions.get(name)
            if stats is None:
                stats = self._functions[name] = FunctionStats()
            stats.started += 1
            rec = CallRecord(call_id, name, hosts, stats, time.perf_counter())
            self._calls[call_id] = rec
        return rec

    def watch(self, fut: Future[Any], rec: CallRecord) -> None:
        """Caller's thread: settle ``rec`` with ``fut`` (which may be done already)."""
        fut._timing = rec
        fut.add_done_callback(self._settled)

    def sending(self, call_id: int, go: float) -> None:
        """Loop thread: the call's messages are queued; ``go`` is when sending began."""
        rec = self._calls.get(call_id)
        if rec is not None:
            rec.go, rec.sent = go, time.perf_counter()

    def result(self, host: int, body: P.Result) -> None:
        """Loop thread: a host's RESULT was read."""
        rec = self._calls.get(body.call_id)
        if rec is None:
            return
        times = body.times
        queued = ran = 0
        if len(times) == 2 and type(times[0]) is int and type(times[1]) is int:
            queued, ran = max(0, times[0]), max(0, times[1])
        rec.add_reply(host, time.perf_counter(), queued, ran)
        if len(times) == 2:
            rec.stats.host_times.extend((queued, ran))  # one call: the pair stays together

    def _on_settled(self, fut: Future[Any]) -> None:
        rec = fut._timing
        if rec is None:
            return
        rec.settled = time.perf_counter()
        if fut.cancelled():
            rec.outcome = "cancelled"
        elif fut.exception() is not None:
            rec.outcome = "failed"
        else:
            rec.outcome = "finished"
        self._calls.pop(rec.call_id, None)
        outcome = (_FINISHED if rec.outcome == "finished" else
                   _FAILED if rec.outcome == "failed" else _CANCELLED)
        rec.stats.ends.extend((outcome, rec.settled - rec.submitted))
        if self.trace is not None:
            self.trace.add(rec)
        if self.otel is not None:
            try:
                self.otel.add(rec)
            except Exception:  # a broken exporter must not break calls
                log.exception("could not emit an OpenTelemetry span")

    # -- reading -----------------------------------------------------------------------

    def functions(self) -> dict[str, FunctionStats]:
        """A consistent copy of every function's counters (any thread)."""
        with self._lock:
            for stats in self._functions.values():
                stats.fold()
            return {name: s.copy() for name, s in self._functions.items()}

    def in_flight(self) -> int:
        """Colocated calls made and not settled yet."""
        return len(self._calls)


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
