"""Takes the objects a process starts with out of the garbage collector's way.

A controller or worker imports JAX and numpy before its first call: about
100,000 objects that live as long as the process. CPython's collector scans
its oldest generation again whenever enough objects have survived into it, and
calls in flight keep a steady stream of futures, operations and messages
surviving long enough to get there, so each full collection walks all of
JAX's objects too. Measured with 1,000 calls in flight, that was about 6 us of
controller CPU per call (37 -> 31 us). ``gc.freeze()`` moves every object that
exists at that moment into a permanent generation the collector never scans;
objects are still freed by reference counting as usual, and everything made
later is collected as before. What freezing costs: an object alive at that
moment that later becomes part of unreachable reference cycles is never
reclaimed (so colobus freezes once per process, right after a full collection).
"""

from __future__ import annotations

import gc
import logging
import threading

__all__ = ["freeze_once"]

log = logging.getLogger("colobus.gc")

_lock = threading.Lock()
_frozen = False


def freeze_once() -> bool:
    """Collect, then freeze what is alive; only the first call in a process does it.

    Returns:
        Whether this call froze anything.
    """
    global _frozen
    with _lock:
        if _frozen:
            return False
        _frozen = True
        gc.collect()
        gc.freeze()
    log.debug("froze %d startup objects out of the garbage collector's scans",
              gc.get_freeze_count())
    return True
