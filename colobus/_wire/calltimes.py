"""How long calls waited and ran on a host, counted there and sent with its heartbeats.

With metrics on, each worker keeps its calls' queued and run nanoseconds per
function (:class:`HostCallTimes`, the worker's loop thread) and, with each
heartbeat, sends what came since the last one as bucket counts
(:meth:`HostCallTimes.take`). The controller adds them to the function's
histograms (:func:`read_entries`). So the controller does nothing per host per
call for these histograms: a fan-out call to 1,024 hosts costs it no more than
a call to one, and a host's bad numbers cannot reach another host's counts.

A function is named on the wire by its code digest and method name (``""`` for
a function; a method's digest is its class's), so the controller maps an entry
to the function's counters without any per-call bookkeeping.

Wire form of one entry (a heartbeat's ``calls``)::

    [digest, method, queued_counts, queued_ns, run_counts, run_ns]

where ``*_counts`` has one count per bucket of :data:`BUCKETS` (seconds; upper
bounds) and one for above them all, and ``*_ns`` is the sum of those samples.
"""

from __future__ import annotations

import array
from typing import Any

import numpy as np

__all__ = ["BUCKETS", "HEARTBEAT_BUDGET", "MAX_ENTRIES", "HostCallTimes", "bucket_counts",
           "read_entries"]

# Upper bounds (seconds) of the latency and run-time histograms' buckets; +Inf follows.
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
           1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_BOUNDS = np.array(BUCKETS)
_BOUNDS_NS = np.array([round(b * 1e9) for b in BUCKETS], dtype=np.int64)
MAX_ENTRIES = 4096  # functions one heartbeat may report; the rest wait for the next
HEARTBEAT_BUDGET = 256 << 10  # bytes of entries one heartbeat carries at most
_ENTRY_BYTES = 400  # an entry's msgpack size at most, besides its digest and method
_INT64 = 1 << 63

Key = tuple[bytes, str]  # (code digest, method name or "")


def bucket_counts(values: np.ndarray[Any, Any], bounds: np.ndarray[Any, Any] = _BOUNDS
                  ) -> list[int]:
    """How many ``values`` fall in each bucket: the first whose bound they do not pass."""
    where = np.searchsorted(bounds, values, side="left")  # == bisect_left, vectorised
    return [int(n) for n in np.bincount(where, minlength=len(bounds) + 1).tolist()]


class HostCallTimes:
    """A worker's calls' queued and run ns per function, until a heartbeat takes them.

    Loop thread only. :meth:`add` is two appends to a function's array of int64s.
    """

    __slots__ = ("_samples",)

    def __init__(self) -> None:
        self._samples: dict[Key, array.array[int]] = {}

    def add(self, key: Key, queued_ns: int, ran_ns: int) -> None:
        samples = self._samples.get(key)
        if samples is None:
            samples = self._samples[key] = array.array("q")
        samples.append(queued_ns)
        samples.append(ran_ns)

    def take(self, budget: int = HEARTBEAT_BUDGET) -> list[list[Any]]:
        """What came since the last take, as heartbeat entries.

        At most :data:`MAX_ENTRIES` of them, and about ``budget`` bytes: a
        heartbeat must stay far below the controller's ``max_message_bytes``
        (a larger one would cost the host its connection). What does not fit
        waits for the next heartbeat; at least one entry always goes.
        """
        out: list[list[Any]] = []
        left = budget
        while self._samples and len(out) < MAX_ENTRIES:
            (digest, method), samples = next(iter(self._samples.items()))
            size = _ENTRY_BYTES + len(digest) + len(method.encode())
            if out and size > left:
                break
            left -= size
            del self._samples[(digest, method)]
            pairs = np.maximum(np.frombuffer(samples, dtype=np.int64).reshape(-1, 2), 0)
            queued, ran = pairs[:, 0], pairs[:, 1]
            out.append([digest, method, bucket_counts(queued, _BOUNDS_NS), int(queued.sum()),
                        bucket_counts(ran, _BOUNDS_NS), int(ran.sum())])
        return out


def _counts(value: Any) -> list[int] | None:
    if type(value) is not list or len(value) != len(BUCKETS) + 1:
        return None
    for n in value:
        if type(n) is not int or not 0 <= n < _INT64:
            return None
    return value


def read_entries(entries: list[Any]) -> tuple[list[tuple[Key, list[int], int, list[int], int]],
                                              int]:
    """A heartbeat's ``calls``, checked: the well-formed entries, and how many were not.

    An entry is taken whole or not at all: the right shape and types, counts and
    sums that are int64s and not negative, and both histograms counting the same
    calls. A hostile host can thus report calls that did not happen, or wrong
    times, but never a half entry, a negative count, or an entry that breaks a
    histogram's arithmetic.
    """
    good = []
    bad = 0
    for entry in entries[:MAX_ENTRIES]:
        if (type(entry) is not list or len(entry) != 6 or type(entry[0]) is not bytes
                or type(entry[1]) is not str):
            bad += 1
            continue
        queued, run = _counts(entry[2]), _counts(entry[4])
        queued_ns, run_ns = entry[3], entry[5]
        if (queued is None or run is None or type(queued_ns) is not int
                or type(run_ns) is not int or not 0 <= queued_ns < _INT64
                or not 0 <= run_ns < _INT64 or sum(queued) != sum(run)):
            bad += 1
            continue
        good.append(((entry[0], entry[1]), queued, queued_ns, run, run_ns))
    return good, bad + max(0, len(entries) - MAX_ENTRIES)
