"""Where one call spent its time: the timings a Future reports, Chrome traces, OTel spans.

A :class:`CallRecord` holds one call's timestamps (``time.perf_counter`` seconds
of the controller) and each host's reply with the durations the host measured
itself (clocks of different machines are never compared). From it come the
:class:`CallTimings` that ``fut.timings()`` returns, the Chrome-trace events of
:class:`ChromeTrace` (one complete event per host per call, loadable in Perfetto
or ``chrome://tracing``), and, where ``opentelemetry`` is importable, one span per
call with a child span per host (:class:`OtelSpans`).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["CallRecord", "CallTimings", "ChromeTrace", "HostTimings", "OtelSpans",
           "host_times"]

log = logging.getLogger("colobus.trace")

TRACE_MAX_CALLS = 200_000  # a trace keeps the newest this many calls


@dataclass(frozen=True, slots=True)
class HostTimings:
    """One host's part of a call, in seconds.

    Attributes:
        host: the host index.
        queue: waited on the host, from the CALL's arrival to the start of the
            function (its stream's earlier calls, unresolved inputs).
        run: the function ran (unpickling its arguments, the call, storing and
            describing its outputs).
        reply: the rest of the round trip as the controller saw it: from the
            CALL leaving the controller's loop to its RESULT being read, less
            ``queue`` and ``run``; the wire both ways and both sides' I/O.
    """

    host: int
    queue: float
    run: float
    reply: float


@dataclass(frozen=True, slots=True)
class CallTimings:
    """Where a colocated call spent its time, in seconds (``fut.timings()``).

    Attributes:
        function: the function's qualified name (``Class.method`` for methods).
        outcome: ``"finished"``, ``"failed"`` or ``"cancelled"``.
        controller_queue: from the call to the controller's loop starting to
            send it: the hop onto the loop thread and any wait in the
            back-pressure backlog.
        send: the loop building and queueing the call's messages (code the
            host has not seen, objects to construct, one CALL per host).
        hosts: each host's share, by host index.
        assembly: from the last host's RESULT to the future settling: decoding
            the replies and building the output handles.
        total: from the call to the future settling.
    """

    function: str
    outcome: str
    controller_queue: float
    send: float
    hosts: tuple[HostTimings, ...]
    assembly: float
    total: float


class CallRecord:
    """One call's timestamps, filled in on the caller's thread and the loop thread.

    The Future holds it (``fut._timing``); the Operation's send and each host's
    RESULT write into it, and the Future settles it: no table of calls, no
    done-callback, one object per call (two for a call on several hosts). A
    reply's host times are kept as they came and checked when read.
    """

    __slots__ = ("_first", "_more", "call_id", "go", "hosts", "name", "observer", "outcome",
                 "sent", "settled", "submitted")

    def __init__(self, call_id: int, name: str, hosts: tuple[int, ...], submitted: float,
                 observer: Any = None) -> None:
        self.call_id = call_id
        self.name = name
        self.hosts = hosts
        self.observer = observer  # settles it (``_observe.Observer``), or None
        self.submitted = submitted
        self.go = self.sent = self.settled = 0.0
        # The first reply (host, RESULT read at, the host's [ns queued, ns ran]) as
        # a tuple, the others flat in a list: nothing more per call.
        self._first: tuple[int, float, Any] | None = None
        self._more: list[Any] | None = None
        self.outcome = ""

    def add_reply(self, host: int, received: float, times: Any) -> None:
        """A host's RESULT was read at ``received`` (loop thread); ``times`` unchecked."""
        if self._first is None:
            self._first = (host, received, times)
        elif self._more is None:
            self._more = [host, received, times]
        else:
            self._more.extend((host, received, times))

    def raw_replies(self) -> list[tuple[int, float, Any]]:
        """``(host, RESULT read at, times as the host sent them)`` per reply."""
        if self._first is None:
            return []
        out = [self._first]
        r = self._more or []
        out.extend((r[i], r[i + 1], r[i + 2]) for i in range(0, len(r), 3))
        return out

    @property
    def replies(self) -> dict[int, tuple[float, int, int]]:
        """host -> (RESULT read at, ns queued on the host, ns it ran there)."""
        out: dict[int, tuple[float, int, int]] = {}
        for host, received, times in self.raw_replies():
            queued, ran = host_times(times) or (0, 0)
            out[int(host)] = (received, queued, ran)
        return out

    def timings(self) -> CallTimings:
        """The breakdown of a settled call (stages it never reached count as 0)."""
        go = self.go or self.settled
        sent = self.sent or go
        hosts = []
        last = sent
        replies = self.replies
        for h in sorted(replies):
            received, queued, ran = replies[h]
            last = max(last, received)
            q, r = queued / 1e9, ran / 1e9
            hosts.append(HostTimings(h, q, r, max(0.0, received - sent - q - r)))
        return CallTimings(
            function=self.name, outcome=self.outcome,
            controller_queue=max(0.0, go - self.submitted), send=max(0.0, sent - go),
            hosts=tuple(hosts), assembly=max(0.0, self.settled - last) if replies else 0.0,
            total=max(0.0, self.settled - self.submitted))


def host_times(times: Any) -> tuple[int, int] | None:
    """A RESULT's ``[ns queued, ns ran]`` (a third field says whether its outputs were
    computed, a fourth names the FETCH it answers), or None where a host sent none (or
    nonsense)."""
    if (type(times) is list and 2 <= len(times) <= 4 and type(times[0]) is int
            and type(times[1]) is int):
        return max(0, times[0]), max(0, times[1])
    return None


class ChromeTrace:
    """The settled calls of a controller, written as Chrome trace JSON.

    Each host is a row (``tid``) of the controller's process; each call is one
    complete event (``"ph": "X"``) on each host's row, from the CALL leaving the
    controller's loop to its RESULT being read, with the host's own queue and
    run times as arguments. Keeps the newest :data:`TRACE_MAX_CALLS` calls.
    """

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = path
        self._calls: collections.deque[CallRecord] = collections.deque(maxlen=TRACE_MAX_CALLS)
        self._lock = threading.Lock()
        self._warned = False

    def add(self, rec: CallRecord) -> None:
        with self._lock:
            if len(self._calls) == TRACE_MAX_CALLS and not self._warned:
                self._warned = True
                log.info("trace holds %d calls; older ones are dropped from now on",
                         TRACE_MAX_CALLS)
            self._calls.append(rec)

    def events(self) -> list[dict[str, Any]]:
        """The trace events: thread names, then one complete event per host per call."""
        pid = os.getpid()
        with self._lock:
            calls = list(self._calls)
        rows = sorted({h for rec in calls for h in rec.replies})
        out: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": "colobus"}}]
        out += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": h,
                 "args": {"name": f"host {h}"}} for h in rows]
        for rec in calls:
            sent = rec.sent or rec.go
            for h, (received, queued, ran) in sorted(rec.replies.items()):
                out.append({
                    "name": rec.name, "cat": "call", "ph": "X", "pid": pid, "tid": h,
                    "ts": sent * 1e6, "dur": max(0.0, received - sent) * 1e6,
                    "args": {"call_id": rec.call_id, "outcome": rec.outcome,
                             "host_queue_us": queued / 1e3, "run_us": ran / 1e3,
                             "controller_queue_us": max(0.0, rec.go - rec.submitted) * 1e6}})
        return out

    def write(self, path: str | os.PathLike[str] | None = None) -> str:
        """Write the trace as JSON (``{"traceEvents": [...]}``); returns the path."""
        target = path if path is not None else self.path
        if target is None:
            raise ValueError("no trace path: give one, or start the controller with trace=PATH")
        doc = {"traceEvents": self.events(), "displayTimeUnit": "ms"}
        tmp = f"{os.fspath(target)}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, target)
        return os.fspath(target)


class OtelSpans:
    """One OpenTelemetry span per settled call, with a child span per host.

    Spans go to the globally configured tracer provider (the OpenTelemetry SDK
    set up by the program); they are made after the call settled, with the
    recorded start and end times.
    """

    def __init__(self) -> None:
        from opentelemetry import trace

        self._trace = trace
        self._tracer = trace.get_tracer("colobus")
        # perf_counter seconds -> wall-clock ns since the epoch, as spans want
        self._offset = time.time_ns() - time.perf_counter_ns()

    @staticmethod
    def available() -> bool:
        try:
            import opentelemetry.trace  # noqa: F401
        except ImportError:
            return False
        return True

    def _ns(self, t: float) -> int:
        return self._offset + int(t * 1e9)

    def add(self, rec: CallRecord) -> None:
        trace = self._trace
        span = self._tracer.start_span(
            rec.name, start_time=self._ns(rec.submitted),
            attributes={"colobus.call_id": rec.call_id, "colobus.outcome": rec.outcome,
                        "colobus.hosts": len(rec.hosts)})
        ctx = trace.set_span_in_context(span)
        sent = rec.sent or rec.go or rec.submitted
        for h, (received, queued, ran) in sorted(rec.replies.items()):
            child = self._tracer.start_span(
                f"{rec.name} on host {h}", context=ctx, start_time=self._ns(sent),
                attributes={"colobus.host": h, "colobus.host_queue_ns": queued,
                            "colobus.run_ns": ran})
            child.end(end_time=self._ns(received))
        if rec.outcome == "failed":
            span.set_status(trace.Status(trace.StatusCode.ERROR))
        span.end(end_time=self._ns(rec.settled))
