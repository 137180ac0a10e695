"""A one-shot alarm: one thread arms and disarms it, another sleeps until it rings.

The inline-call watchdog (:mod:`colobus._host.leader`) sleeps on one: the leader arms it
as an inline call starts and disarms it once the call's reply left, so the watchdog
wakes only for a call still running when it rings, never for one that ended in time,
and never on a clock of its own. On Linux it is a ``timerfd`` (``os.timerfd_*`` from Python 3.13,
libc's through :mod:`ctypes` before): arming and disarming are one system call each
and wake nobody; the watchdog blocks in ``read``. Elsewhere a condition variable
stands in (each arm then wakes the sleeper once: it waits out the deadline).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
import time
from typing import Any

__all__ = ["Alarm", "LoopTimer", "make_alarm", "make_loop_timer"]

_CLOCK_MONOTONIC = 1


class Alarm:
    """The interface (and the fallback): a condition variable and a deadline."""

    # Whether an arm while armed wakes nobody (a timerfd's does not; the fallback's
    # wakes its sleeper to read the new deadline).
    quiet_arm = False

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self._cond = threading.Condition(threading.Lock())
        self._deadline: float | None = None
        self._rang = False

    def arm(self) -> None:
        """Ring ``after_s`` from now, unless disarmed before (replaces an earlier arm)."""
        with self._cond:
            self._deadline = time.monotonic() + self.after_s
            self._cond.notify()

    def arm_in(self, seconds: float) -> None:
        """Ring ``seconds`` from now (replaces an earlier arm)."""
        with self._cond:
            self._deadline = time.monotonic() + seconds
            self._cond.notify()

    def disarm(self) -> None:
        """Do not ring (what was armed)."""
        self._deadline = None

    def ring(self) -> None:
        """Ring now (wakes the sleeper: the watchdog's close)."""
        with self._cond:
            self._rang = True
            self._cond.notify()

    def wait(self) -> None:
        """Sleep until it rings."""
        with self._cond:
            while not self._rang:
                deadline = self._deadline
                if deadline is None:
                    self._cond.wait()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    if self._deadline is deadline:
                        self._deadline = None
                    break
                self._cond.wait(left)
            self._rang = False

    def close(self) -> None:
        """Release what it holds (after its sleeper left)."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _spec(seconds: float) -> _Itimerspec:
    ns = max(1, round(seconds * 1e9))
    return _Itimerspec(_Timespec(0, 0), _Timespec(ns // 1_000_000_000, ns % 1_000_000_000))


def _set_in(settime: Any, fd: int, seconds: float) -> None:
    """Timerfd ``fd`` rings ``seconds`` from now (``settime``: libc's, or None: os's)."""
    if settime is None:
        os.timerfd_settime_ns(fd, initial=max(1, round(seconds * 1e9)))  # type: ignore[attr-defined]
    else:
        settime(fd, 0, ctypes.byref(_spec(seconds)), None)


class _TimerFd(Alarm):
    """A Linux ``timerfd``: nobody wakes unless it rings."""

    quiet_arm = True

    def __init__(self, after_s: float, settime: Any) -> None:
        self.after_s = after_s
        self._fd = _create()
        self._settime = settime
        fd = self._fd
        # partials, not lambdas: an arm and a disarm are one C call each, no Python
        if settime is None:  # Python 3.13+: os's own
            set_ns = os.timerfd_settime_ns  # type: ignore[attr-defined]
            after_ns = max(1, round(after_s * 1e9))
            self.arm = functools.partial(set_ns, fd, initial=after_ns)  # type: ignore[method-assign]
            self.disarm = functools.partial(set_ns, fd, initial=0)  # type: ignore[method-assign]
            self._ring = functools.partial(set_ns, fd, initial=1)
        else:
            armed, off, now = (ctypes.byref(_spec(after_s)), ctypes.byref(_Itimerspec()),
                               ctypes.byref(_spec(1e-9)))
            self.arm = functools.partial(settime, fd, 0, armed, None)  # type: ignore[method-assign]
            self.disarm = functools.partial(settime, fd, 0, off, None)  # type: ignore[method-assign]
            self._ring = functools.partial(settime, fd, 0, now, None)

    def arm_in(self, seconds: float) -> None:
        _set_in(self._settime, self._fd, seconds)

    def ring(self) -> None:
        self._ring()

    def wait(self) -> None:
        os.read(self._fd, 8)  # (blocks, the GIL released, until an expiry is counted)

    def close(self) -> None:
        os.close(self._fd)


def _libc_timerfd() -> tuple[Any, Any] | None:
    """libc's ``timerfd_create`` and ``timerfd_settime``, where there are."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        create, settime = libc.timerfd_create, libc.timerfd_settime
    except (OSError, AttributeError):
        return None
    create.argtypes, create.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settime.restype = ctypes.c_int
    return create, settime


class LoopTimer:
    """A ``timerfd`` an event loop reads: any thread sets when it rings (one system call,
    nobody woken); the loop's reader for :attr:`fd` runs then (call :meth:`clear` in it)."""

    def __init__(self) -> None:
        self.fd = _create(nonblocking=True)
        self._settime = None if _LIBC is None else _LIBC[1]
        self._off = ctypes.byref(_Itimerspec())

    def arm_in(self, seconds: float) -> None:
        """Ring ``seconds`` from now (replaces an earlier arm)."""
        _set_in(self._settime, self.fd, seconds)

    def disarm(self) -> None:
        if self._settime is None:
            os.timerfd_settime_ns(self.fd, initial=0)  # type: ignore[attr-defined]
        else:
            self._settime(self.fd, 0, self._off, None)

    def clear(self) -> None:
        """Take the ring (in the loop's reader), so the loop stops seeing it."""
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.fd)


def make_loop_timer() -> LoopTimer | None:
    """A :class:`LoopTimer` where this system has ``timerfd``, else None."""
    if sys.platform == "linux" and (hasattr(os, "timerfd_create") or _LIBC is not None):
        try:
            return LoopTimer()
        except OSError:  # (a sandbox without timerfd)
            pass
    return None


def _create(nonblocking: bool = False) -> int:
    flags = os.O_CLOEXEC | (os.O_NONBLOCK if nonblocking else 0)  # (TFD_* are O_*)
    if hasattr(os, "timerfd_create"):
        return int(os.timerfd_create(_CLOCK_MONOTONIC, flags=flags))
    assert _LIBC is not None
    fd = int(_LIBC[0](_CLOCK_MONOTONIC, flags))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


_LIBC = _libc_timerfd() if sys.platform == "linux" and not hasattr(os, "timerfd_create") else None


def make_alarm(after_s: float) -> Alarm:
    """An alarm that rings ``after_s`` after each arm: a ``timerfd`` where this system
    has one, else the condition variable."""
    if sys.platform == "linux" and (hasattr(os, "timerfd_create") or _LIBC is not None):
        try:
            return _TimerFd(after_s, None if _LIBC is None else _LIBC[1])
        except OSError:  # (a sandbox without timerfd)
            pass
    return Alarm(after_s)
