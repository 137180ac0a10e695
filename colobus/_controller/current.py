"""The controller's lifecycle states and the stack of entered controllers (the default)."""

from __future__ import annotations

import enum
import threading
from typing import Generic, TypeVar

__all__ = ["Current", "State"]


class State(enum.Enum):
    """Controller lifecycle."""

    NEW = "new"
    RUNNING = "running"
    CLOSED = "closed"


T = TypeVar("T")


class Current(Generic[T]):
    """Controllers entered and not yet closed, most recent last (any thread)."""

    def __init__(self) -> None:
        self._stack: list[T] = []
        self._lock = threading.Lock()

    def push(self, ctl: T) -> None:
        with self._lock:
            self._stack.append(ctl)

    def pop(self, ctl: T) -> None:
        with self._lock:
            if ctl in self._stack:
                self._stack.remove(ctl)

    def top(self) -> T | None:
        with self._lock:
            return self._stack[-1] if self._stack else None
