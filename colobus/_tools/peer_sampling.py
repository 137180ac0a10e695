"""How ``colobus bench --peers`` measures a peer: sampling loops with a time cap, and
the figures they give (see :mod:`colobus._tools.bench_peers`).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

if TYPE_CHECKING:
    from .bench_base import Sizes

__all__ = [
    "CAP_S", "MIN_SAMPLES", "PeerFigure", "PeerRun", "cut_note", "latency_figure", "median_us",
    "pipelined_figure", "sample", "sample_async", "transfer_rows",
]

MiB = 1 << 20

#: Seconds after which one measurement stops early (it keeps what it has).
CAP_S = 10.0
#: A measurement cut short by :data:`CAP_S` still has at least this many samples.
MIN_SAMPLES = 20
T = TypeVar("T")


@dataclass
class PeerFigure:
    """One peer's figure for the colobus row of the same name."""

    value: float
    note: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class PeerRun:
    """What happened with one peer: its status, version and figures by row name."""

    peer: str
    status: str  # "measured", "not installed", "skipped", "failed"
    version: str = ""
    detail: str = ""
    seconds: float = 0.0
    figures: dict[str, PeerFigure] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "version": self.version, "detail": self.detail,
                "seconds": self.seconds, "rows": sorted(self.figures)}


# -- measuring loops -----------------------------------------------------------------------


def _rate(num: float, seconds: float) -> float:
    """``num / seconds``; NaN where the clock read 0 (as ``bench_base.quotient``)."""
    return num / seconds if seconds > 0 else float("nan")


def median_us(xs: Sequence[float]) -> float:
    return statistics.median(xs) * 1e6


def sample(fn: Callable[[], object], n: int, cap_s: float) -> list[float]:
    """Seconds of each of up to ``n`` sequential calls of ``fn`` (after ``n // 10`` warm-ups)."""
    for _ in range(n // 10):
        fn()
    out: list[float] = []
    deadline = time.perf_counter() + cap_s
    while len(out) < n:
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
        if t > deadline and len(out) >= MIN_SAMPLES:
            break
    return out


async def sample_async(fn: Callable[[], Awaitable[object]], n: int,
                        cap_s: float) -> list[float]:
    """:func:`sample` awaiting ``fn()`` from an event loop."""
    for _ in range(n // 10):
        await fn()
    out: list[float] = []
    deadline = time.perf_counter() + cap_s
    while len(out) < n:
        t = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t)
        if t > deadline and len(out) >= MIN_SAMPLES:
            break
    return out


def _window(submit: Callable[[], T], wait: Callable[[T], object], total: int, window: int,
            cap_s: float) -> tuple[float, int]:
    """Calls per second with ``window`` calls in flight; waits on the oldest first.

    Returns:
        The rate and the number of calls it measured (fewer than ``total`` when
        ``cap_s`` ran out first).
    """
    pending: deque[T] = deque()
    sent = done = 0
    t0 = time.perf_counter()
    deadline = t0 + cap_s
    while sent < total:
        if len(pending) >= window:
            wait(pending.popleft())
            done += 1
            if done >= MIN_SAMPLES and time.perf_counter() > deadline:
                break
        pending.append(submit())
        sent += 1
    while pending:
        wait(pending.popleft())
        done += 1
    return _rate(done, time.perf_counter() - t0), done


def pipelined_figure(submit: Callable[[], T], wait: Callable[[T], object], total: int,
                      window: int, note: str) -> PeerFigure:
    _window(submit, wait, max(total // 10, 1), window, CAP_S / 4)  # warm-up
    rate, done = _window(submit, wait, total, window, CAP_S)
    return PeerFigure(rate, note + cut_note(done, total), {"calls": done})


def cut_note(done: int, planned: int) -> str:
    return f" (stopped after {done:,} of {planned:,} calls: {CAP_S:.0f} s cap)" \
        if done < planned else ""


def latency_figure(samples: list[float], planned: int, note: str) -> PeerFigure:
    return PeerFigure(median_us(samples), note + cut_note(len(samples), planned),
                      {"calls": len(samples)})


def transfer_rows(sizes: Sizes, put: Callable[[np.ndarray[Any, Any]], object],
                   get: Callable[[], np.ndarray[Any, Any]], release: Callable[[], object],
                   put_note: str, get_note: str) -> dict[str, PeerFigure]:
    figures: dict[str, PeerFigure] = {}
    for label, nbytes, reps in sizes.transfer:
        data = np.ones(nbytes, np.uint8)  # touched: no page faults inside the timing
        put_t: list[float] = []
        get_t: list[float] = []
        for _ in range(reps):
            t = time.perf_counter()
            put(data)
            put_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            back = get()
            get_t.append(time.perf_counter() - t)
            if back.nbytes != nbytes:
                raise RuntimeError(f"got {back.nbytes} bytes back, sent {nbytes}")
            del back
            release()
        gbs = nbytes / 1e9
        size = f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // 1024} KiB"
        figures[f"put_{label}"] = PeerFigure(_rate(gbs, statistics.median(put_t)),
                                             put_note.format(size=size), {"bytes": nbytes})
        figures[f"get_{label}"] = PeerFigure(_rate(gbs, statistics.median(get_t)),
                                             get_note.format(size=size), {"bytes": nbytes})
    return figures
