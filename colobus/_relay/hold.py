"""How long a relay holds its hosts' replies: until a call's last one, while they come.

Workers answer a fan-out call a little apart, so a relay that sent up what each drain
read would send the controller several UPs per call, each a message it decodes, checks
and settles on its one loop thread. A relay knows which of its hosts each call went
to (the FORWARD named them), so it holds the replies of a call until the last of its
hosts answered, then sends them in one UP. Holding never delays the call: it ends with
its last reply, which releases the UP at once. Waits are bounded: what is held goes
once :data:`HOLD_S` passed without a further reply of its calls, or :data:`HOLD_MAX_S`
after the first was held (a host that is slow, lost, or never answers); a reply of any
other kind than a RESULT or a heartbeat (a transfer's parts) releases it at once.
On a busy machine a fan-out's replies come over longer than a fixed 5 ms (32 workers
on 2 cores: over 10 ms, 1.4 UPs per call), each a few hundred microseconds apart.
"""

from __future__ import annotations

import time

__all__ = ["HOLD_MAX_S", "HOLD_S", "ReplyHold"]

HOLD_S = 0.005  # held replies wait this long for the next of their calls' replies
HOLD_MAX_S = 0.02  # and this long in all, at most


class ReplyHold:
    """The replies each forwarded call still expects from this relay's hosts."""

    __slots__ = ("_expect", "_first", "_last", "_open", "urgent")

    def __init__(self) -> None:
        self._expect: dict[int, list[float]] = {}  # call id -> [replies expected, since]
        self._open: set[int] = set()  # calls with replies held, more expected
        self.urgent = False  # something held that must not wait
        self._first = self._last = 0.0  # when the first and the last held reply came

    def forwarded(self, call_id: int, hosts: int) -> None:
        """A CALL went to ``hosts`` of this relay's hosts."""
        e = self._expect.get(call_id)
        if e is None:
            self._expect[call_id] = [float(hosts), time.monotonic()]
        else:
            e[0] += hosts

    def answered(self, call_id: int, n: int = 1) -> None:
        """``n`` hosts' RESULTs for ``call_id`` joined the next UP."""
        e = self._expect.get(call_id)
        if e is None:
            return
        e[0] -= n
        if e[0] <= 0:
            del self._expect[call_id]
            self._open.discard(call_id)
        else:
            now = time.monotonic()
            if not self._open:
                self._first = now
            self._open.add(call_id)
            self._last = now

    @property
    def holding(self) -> bool:
        """Whether what is gathered should wait for more of its calls' replies."""
        return bool(self._open) and not self.urgent

    def left(self, now: float) -> float:
        """How much longer what is gathered waits (0: it goes now)."""
        if not self.holding:
            return 0.0
        return max(0.0, min(self._last + HOLD_S, self._first + HOLD_MAX_S) - now)

    def sent(self) -> None:
        """What was gathered went up."""
        self._open.clear()
        self.urgent = False

    def prune(self, older_than: float) -> None:
        """Forget the calls expected for longer than ``older_than`` seconds (their hosts
        were lost, or the call was cancelled before it started there)."""
        now = time.monotonic()
        for call_id in [c for c, e in self._expect.items() if now - e[1] > older_than]:
            del self._expect[call_id]
            self._open.discard(call_id)
