"""Host-side helpers for the issue-12 tests (endings, blips, the explorer).

Importable on the workers (they inherit ``sys.path``), so these functions and
classes travel by reference and this module's state persists on each host
between calls. A function decides what a host does from ``os.getpid()``
compared with a pid the test read from ``ctl.hosts()``, and waits on files the
test creates (hosts share this machine's disk).
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
import weakref
from typing import Any

import numpy as np

import colobus as cb

DESTROYED: set[int] = set()  # tokens of Flagged instances whose __del__ ran on this host
_LOCK = threading.Lock()


def _wait_for_file(path: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.005)


def _touch(path: str) -> None:
    with open(path, "w"):
        pass


@cb.colocated_python
def hold_on(x: Any, pid: int, gate: str) -> Any:
    """Return ``x`` (its block on this host); the host with ``pid`` first waits for ``gate``."""
    if os.getpid() == pid:
        _wait_for_file(gate)
    return x


@cb.colocated_python
def ones_unless(pid: int, how: str) -> Any:
    """``np.ones(4)`` on every host; the host with ``pid`` returns something else.

    ``how``: ``"tree"`` (a list instead of a tuple), ``"shape"`` (5 elements, not
    4), anything else (the same as the others).
    """
    if os.getpid() == pid and how == "tree":
        return [np.ones(4, np.float32)]
    if os.getpid() == pid and how == "shape":
        return (np.ones(5, np.float32),)
    return (np.ones(4, np.float32),)


class Tracked(np.ndarray):
    """A numpy array this host can tell is still alive (it is weakly referenced)."""


_RAW: list[weakref.ref[Tracked]] = []  # the raw return values of big_block made here


@cb.colocated_python
def big_block(nbytes: int) -> Any:
    """A fresh ``nbytes`` array, tracked: while any part of the host holds this raw
    return value (its results table, say), ``raw_alive`` counts it."""
    out = np.ones(nbytes, np.uint8).view(Tracked)
    _RAW.append(weakref.ref(out))
    return out


@cb.colocated_python
def raw_alive() -> Any:
    """How many raw return values of ``big_block`` this host still holds."""
    gc.collect()
    return np.int32(sum(1 for r in _RAW if r() is not None))


@cb.colocated_python
def nap(seconds: float, token: int) -> Any:
    """Sleep ``seconds`` (a worker thread), return ``token``."""
    time.sleep(seconds)
    return np.int32(token)


@cb.colocated_python
def nap_on(pid: int, seconds: float, token: int) -> Any:
    """Return ``token``; the host with ``pid`` first sleeps ``seconds``: a lopsided call."""
    if os.getpid() == pid:
        time.sleep(seconds)
    return np.int32(token)


@cb.colocated_python
def after_file(path: str, token: int) -> Any:
    """Wait (a worker thread, at most 60 s) until ``path`` exists, return ``token``."""
    _wait_for_file(path)
    return np.int32(token)


@cb.colocated_python
def fail(message: str) -> Any:
    raise ValueError(message)


@cb.colocated_python
def plus_one(x: Any) -> Any:
    return x + 1


@cb.colocated_python
def value(token: int) -> Any:
    return np.full(2, token, np.int32)


@cb.colocated_python
async def cancels_itself() -> Any:
    """An ``async def`` that is cancelled on its host: nobody on the controller asked."""
    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    await asyncio.sleep(1)
    return np.int32(0)


@cb.colocated_python
def was_destroyed(token: int) -> Any:
    """Whether the ``Flagged`` instance with ``token`` was dropped (its ``__del__`` ran) here."""
    with _LOCK:
        return np.bool_(token in DESTROYED)


@cb.colocated_python_class
class Flagged:
    """An instance that records its own ``__del__`` in this module's ``DESTROYED``."""

    def __init__(self, token: int) -> None:
        self.token = token

    def touch(self) -> Any:
        return np.int32(self.token)

    def __del__(self) -> None:
        with _LOCK:
            DESTROYED.add(self.token)


@cb.colocated_python_class
class Counter:
    """A host-side count: its state lives on each host that built it."""

    def __init__(self, start: int) -> None:
        self.n = start

    def incr(self) -> Any:
        self.n += 1
        return np.int32(self.n)

    def get(self) -> Any:
        return np.int32(self.n)


@cb.colocated_python_class
class SlowStart:
    """An instance whose ``__init__`` holds one of the host's pool threads ``seconds``."""

    def __init__(self, seconds: float) -> None:
        time.sleep(seconds)

    def ping(self) -> Any:
        return np.int32(1)
