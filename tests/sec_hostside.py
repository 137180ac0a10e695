"""Host-side helpers for the back-pressure, cancellation and soak tests.

This module is importable on the workers (they inherit ``sys.path``), so its
functions travel by reference and its module state persists on each host
between calls: that state is how a test proves what did or did not run there.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from typing import Any

import numpy as np

import colobus as cb

EVENTS: list[int] = []  # what ran on this host, in order (tokens; -gate for a gate's end)
_LOCK = threading.Lock()
CALLS = 0


def gate_path(gate: int) -> str:
    """The file whose creation opens ``gate`` (hosts share this machine's /tmp)."""
    return os.path.join(tempfile.gettempdir(), f"colobus-test-gate-{os.getppid()}-{gate}")


def open_gate(gate: int) -> None:
    """Open ``gate``: runs in the test process, needs no call (and no free slot)."""
    path = os.path.join(tempfile.gettempdir(), f"colobus-test-gate-{os.getpid()}-{gate}")
    with open(path, "w"):
        pass


def remove_gates() -> None:
    prefix = f"colobus-test-gate-{os.getpid()}-"
    for name in os.listdir(tempfile.gettempdir()):
        if name.startswith(prefix):
            os.unlink(os.path.join(tempfile.gettempdir(), name))


def _one_int32(*_: object) -> cb.ShapeDtypeStruct:
    return cb.ShapeDtypeStruct((), np.int32)


def _int32_out(fn: Any) -> Any:
    """``fn`` with its output specs given (one int32): its calls, and its specializations',
    return at once from a plain thread too; a first call without them would wait there
    until its hosts ran it, and these wait on gates or queue behind them."""
    return fn.specialize(out_specs_fn=_one_int32)


@_int32_out
@cb.colocated_python
def wait_gate(gate: int) -> np.ndarray:
    """Block (a worker thread) until the test process opens ``gate``; log start and end."""
    with _LOCK:
        EVENTS.append(gate + 1_000_000)
    path = gate_path(gate)
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.005)
    with _LOCK:
        EVENTS.append(-gate)
    return np.int32(gate)


@_int32_out
@cb.colocated_python
def mark(token: int) -> np.ndarray:
    """Record that the call carrying ``token`` ran on this host."""
    with _LOCK:
        EVENTS.append(token)
    return np.int32(token)


@cb.colocated_python
def events() -> np.ndarray:
    with _LOCK:
        return np.array(EVENTS, dtype=np.int32)


@_int32_out
@cb.colocated_python
def sleep_ms(ms: int) -> np.ndarray:
    time.sleep(ms / 1000)
    return np.int32(ms)


@cb.colocated_python
def noop() -> None:
    """The cheapest call there is: no inputs, no outputs."""
    global CALLS
    CALLS += 1


@_int32_out
@cb.colocated_python
def slow_mark(token: int, ms: int) -> np.ndarray:
    """Sleep ``ms`` then record ``token``: a host slower than its caller."""
    time.sleep(ms / 1000)
    with _LOCK:
        EVENTS.append(token)
    return np.int32(token)
