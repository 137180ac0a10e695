"""Host numbers that follow names in a local cluster: ``local-0`` is host 0.

Workers start together and say HELLO in whatever order the OS runs them.
:class:`JoinOrder` holds the first HELLO of each expected name until all of
them arrived, then hands them back sorted by that order, so the controller
numbers hosts by name at no cost in join time: the last worker to say HELLO
sets the time either way. A name it does not expect passes straight through.
Used once, for the first join of a local cluster; rejoins keep their number.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

__all__ = ["JoinOrder"]

T = TypeVar("T")


class JoinOrder(Generic[T]):
    """Collects one item (a HELLO) per expected name; releases all in name order."""

    def __init__(self, names: Sequence[str]) -> None:
        self._order = {name: i for i, name in enumerate(names)}
        self._held: dict[str, T] = {}

    def offer(self, name: str, item: T) -> list[T]:
        """Hold ``item``; return what may go now (nothing, or every held item in order).

        A later item under a name already held replaces it (a resent HELLO).
        """
        if name not in self._order:
            return [item]
        self._held[name] = item
        if len(self._held) < len(self._order):
            return []
        ready = [self._held[n] for n in sorted(self._held, key=self._order.__getitem__)]
        self._held.clear()
        return ready
