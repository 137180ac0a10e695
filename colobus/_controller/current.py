"""The controller's lifecycle states and the stack of entered controllers (the default)."""

from __future__ import annotations

import enum
import threading
import weakref
from typing import Any, Generic, TypeVar

from .._errors import ClusterClosedError, NoControllerError

__all__ = ["Current", "State", "no_controller_error"]


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
        self._left: Any = None  # a weak reference to the controller that left the stack last

    def push(self, ctl: T) -> None:
        with self._lock:
            self._stack.append(ctl)

    def pop(self, ctl: T) -> None:
        with self._lock:
            if ctl in self._stack:
                self._stack.remove(ctl)
                self._left = weakref.ref(ctl)

    def left_last(self) -> T | None:
        """The controller that left the stack last (closed), while it is alive."""
        left = self._left
        found: T | None = left() if left is not None else None
        return found

    def top(self) -> T | None:
        with self._lock:
            return self._stack[-1] if self._stack else None


def no_controller_error(gone: Any) -> NoControllerError:
    """The error of a call made while no controller runs; ``gone`` is the controller that
    was the default last (None: none), which says the cluster was closed if it was."""
    if gone is not None and gone.state is State.CLOSED:
        return ClusterClosedError(repr(gone))
    return NoControllerError()
