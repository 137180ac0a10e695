"""Time a process did not run, so that silence is judged on time it could have heard.

Every liveness check ticks once per heartbeat interval. A tick that comes much later
than asked means this process was frozen (a paused VM or container, a suspended
laptop, a debugger, a sandbox that stops every process on the machine while one of
them opens an accelerator): the peers on the same machine were most likely frozen
too, and what the others sent meanwhile is read before judging. So the time a tick
came late is nobody's silence: the judge moves each peer's "last heard" forward by it.
A loop that is merely slow still judges: only the part of a tick's delay beyond one
interval is taken off, so silence keeps growing by at least an interval per tick.
"""

from __future__ import annotations

import time

__all__ = ["StallClock"]


class StallClock:
    """How late each liveness tick came, past its interval.

    Args:
        interval: the seconds between ticks (the heartbeat interval).
    """

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._last = time.monotonic()

    def frozen(self, now: float) -> float:
        """Seconds this tick came late beyond one interval (0.0 when on time, or nearly)."""
        late = now - self._last - 2 * self._interval
        self._last = now
        return late if late > 0.0 else 0.0
