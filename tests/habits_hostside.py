"""Host-side helpers for the JAX-habits tests (``test_habits.py``, ``userguide_client.py``).

Importable on the workers (they inherit ``sys.path``), so these travel by reference and
their module state (the barriers) persists on each host between calls.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import colobus as cb

_barriers: dict[str, threading.Barrier] = {}
_lock = threading.Lock()


def meet(name: str, parties: int = 2, timeout: float = 60.0) -> None:
    """Wait on this host until ``parties`` callers met under ``name``: only calls that run
    at the same time on the host get past it (``BrokenBarrierError`` otherwise)."""
    with _lock:
        barrier = _barriers.setdefault(name, threading.Barrier(parties, timeout=timeout))
    barrier.wait()


def wait_for_file(path: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.005)


@cb.colocated_python
def met(x: Any, name: str) -> Any:
    """``x + 1`` once two calls met on this host."""
    meet(name)
    return x + 1
