"""What a colocated function's caches hold: input signatures seen, code shipped per host.

JAX specializes a colocated function once per input signature (tree structure,
shapes, dtypes, shardings, devices) and counts the misses of that cache in its
tests. colobus compiles nothing per signature: its function is pickled once and
shipped once per host, and every call sends only arguments. It still counts
signatures the same way, so a port of JAX's cache-miss checks reads the same
number, and reports the shipping that actually costs something.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

from .array import Array

__all__ = ["CacheInfo", "Signatures"]

MAX_SIGNATURES = 4096  # distinct signatures remembered; beyond, the set starts over


class CacheInfo(NamedTuple):
    """``fn.cache_info()``.

    Attributes:
        hits: Calls whose input signature had been seen before.
        misses: Distinct input signatures (JAX's specialization cache misses).
        code_shipped: Host index -> times the function's code was sent there
            (1 per host, again only after the host rejoined).
    """

    hits: int
    misses: int
    code_shipped: dict[int, int]


class Signatures:
    """Input signatures of one (specialized) colocated function; thread-safe."""

    __slots__ = ("hits", "lock", "misses", "seen")

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.seen: set[Any] = set()
        self.lock = threading.Lock()  # (the call's lane counts a hit under it too)

    def note(self, treedef: Any, leaves: Sequence[Any], plan: Any) -> None:
        """Count one call with these flattened inputs on ``plan`` (its device set)."""
        sig = []  # (a loop, not a generator: fewer calls on every call)
        for x in leaves:
            sig.append((x.shape, x.dtype, x.sharding) if type(x) is Array else type(x))
        key = (treedef, plan.serial, tuple(sig))
        with self.lock:
            if key in self.seen:
                self.hits += 1
                return
            if len(self.seen) >= MAX_SIGNATURES:
                self.seen = set()  # (a new set: the lane knows a key it saw is gone)
            self.seen.add(key)
            self.misses += 1

    def info(self, shipped: collections.Counter[int]) -> CacheInfo:
        return CacheInfo(self.hits, self.misses, dict(sorted(shipped.items())))
