"""How long a relay holds its hosts' replies: until a call's last one, 5 ms at most.

Workers answer a fan-out call a little apart, so a relay that sent up what each drain
read would send the controller several UPs per call, each a message it decodes, checks
and settles on its one loop thread. A relay knows which of its hosts each call went
to (the FORWARD named them), so it holds the replies of a call until the last of its
hosts answered, then sends them in one UP. Holding never delays the call: it ends with
its last reply, which releases the UP at once. Waits are bounded (:data:`HOLD_S`, for a
host that is slow, lost, or never answers), and a reply of any other kind than a
RESULT or a heartbeat (a transfer's parts) releases what is held at once.
"""

from __future__ import annotations

import time

__all__ = ["HOLD_S", "ReplyHold"]

HOLD_S = 0.005  # a reply waits this long for the rest of its call's, at most


class ReplyHold:
    """The replies each forwarded call still expects from this relay's hosts."""

    __slots__ = ("_expect", "_open", "urgent")

    def __init__(self) -> None:
        self._expect: dict[int, list[float]] = {}  # call id -> [replies expected, since]
        self._open: set[int] = set()  # calls with replies held, more expected
        self.urgent = False  # something held that must not wait

    def forwarded(self, call_id: int, hosts: int) -> None:
        """A CALL went to ``hosts`` of this relay's hosts."""
        e = self._expect.get(call_id)
        if e is None:
            self._expect[call_id] = [float(hosts), time.monotonic()]
        else:
            e[0] += hosts

    def answered(self, call_id: int) -> None:
        """A host's RESULT for ``call_id`` joined the next UP."""
        e = self._expect.get(call_id)
        if e is None:
            return
        e[0] -= 1
        if e[0] <= 0:
            del self._expect[call_id]
            self._open.discard(call_id)
        else:
            self._open.add(call_id)

    @property
    def holding(self) -> bool:
        """Whether what is gathered should wait for more of its calls' replies."""
        return bool(self._open) and not self.urgent

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
