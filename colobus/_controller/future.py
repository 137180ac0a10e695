"""The Future behind every remote operation.

A :class:`Future` is resolved on the controller's event-loop thread and can be
awaited from any event loop, or waited on with :meth:`Future.result` from any
other thread. It is deliberately not an ``asyncio.Future``: those belong to one
loop, and colobus futures are shared between the controller's loop, the
caller's loop and plain threads.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

from .._observe.observer import FOLD_AT
from . import inbox as _inbox
from .wakeups import Waiter, Watch, wake

if TYPE_CHECKING:
    from .._observe.observer import FunctionStats
    from .._observe.trace import CallRecord, CallTimings

__all__ = ["ARRAY_WAYS", "Future", "fail_call", "in_event_loop"]

T = TypeVar("T")

_PENDING, _CANCELLED, _FINISHED = 0, 1, 2

log = logging.getLogger("colobus.future")

# One lock for every Future's state change: the critical sections are a few
# attribute writes, and a lock per Future would be one more object per call for
# the garbage collector to track while calls are in flight.
_LOCK = threading.Lock()
_new_lock = threading.Lock
_get_ident = threading.get_ident
_get_running_loop = asyncio.get_running_loop
_local = _inbox._local
_clock = time.perf_counter  # read per observed call: one global, not an attribute of one

# JAX's methods of arrays, for a Future that stands for a call's arrays, set by
# ``colobus._api`` as it loads (this layer does not import it): ``block(fut)`` waits
# until the call's arrays are ready, ``copy(fut)`` starts fetching them
ARRAY_WAYS: dict[str, Callable[[Future[Any]], Any]] = {}


class Future(Generic[T]):
    """The result of a remote operation, awaitable from any event loop.

    ``await fut`` works in any event loop; ``fut.result(timeout)`` works from any
    thread except the controller's own loop thread, where it raises a
    ``RuntimeError`` saying to ``await`` instead.
    """

    __slots__ = (
        "__weakref__",
        "_callbacks",
        "_canceller",
        "_event",
        "_exception",
        "_loop_thread",
        "_owner",
        "_result",
        "_returns",
        "_state",
        "_stats",
        "_submitted",
        "_timing",
        "_unread",
        "_waiter",
        "call_id",
        "info",
    )

    def __init__(self, loop_thread: int | None = None, call_id: int = 0,
                 owner: object = None) -> None:
        self._state = _PENDING
        self._owner = owner  # the controller that made it (None: made by colobus itself)
        self._result: Any = None
        self._exception: BaseException | None = None
        self._callbacks: list[Callable[[Future[T]], object]] | None = None
        # held by the first thread that waits in result(), released as it settles
        self._event: Any = None
        self._waiter: Waiter | None = None  # the first task awaiting it (wakeups)
        self._loop_thread = loop_thread
        self._canceller: Callable[[Future[T]], object] | None = None
        self.call_id = call_id
        self.info: Any = None  # what produced it (a colocated call's device list, ...)
        # what a colocated call made off the controller's loop thread returns in its
        # place (colobus._api.pending): None, the Future itself
        self._returns: Any = None
        # Set by the controller for colocated calls while metrics or tracing is on:
        self._stats: FunctionStats | None = None  # the function's counters
        self._submitted = 0.0  # when the call was made (perf_counter)
        self._timing: CallRecord | None = None  # its timings (tracing only)
        # ``_unread`` (a failed call's error nobody read yet, see fail_call) is left unset
        # here: only failing calls and calls handed on pay for it

    def __repr__(self) -> str:
        state = ("pending", "cancelled", "finished")[self._state]
        if self._state == _FINISHED and self._exception is not None:
            state = f"raised {type(self._exception).__name__}"
        return f"<colobus.Future {state}>"

    # -- state ---------------------------------------------------------------------

    def done(self) -> bool:
        """True once the future has a result, an exception, or was cancelled."""
        return self._state != _PENDING

    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    def cancel(self) -> bool:
        """Cancel the operation.

        A call that has not started on its hosts is removed there; one already
        running finishes and its result is dropped.

        Returns:
            True if the future was pending and is now cancelled.
        """
        with _LOCK:
            if self._state != _PENDING:
                return False
            self._state = _CANCELLED
            canceller, self._canceller = self._canceller, None
        if canceller is not None:
            canceller(self)
        self._finish()
        return True

    def set_result(self, result: T) -> None:
        with _LOCK:
            if self._state != _PENDING:
                return
            self._result = result
            self._state = _FINISHED
        self._finish()

    def set_exception(self, exc: BaseException) -> None:
        with _LOCK:
            if self._state != _PENDING:
                return
            self._exception = exc
            self._state = _FINISHED
        self._finish()

    def _set_cancelled(self) -> None:
        """The operation was cancelled elsewhere (on a host): end as cancelled.

        Unlike :meth:`cancel`, nothing is asked of the hosts: they already know.
        """
        with _LOCK:
            if self._state != _PENDING:
                return
            self._state = _CANCELLED
        self._finish()

    def _set_canceller(self, fn: Callable[[Future[T]], object]) -> None:
        self._canceller = fn

    def _finish(self) -> None:
        self._canceller = None
        stats = self._stats
        if stats is not None:  # metrics or tracing is on: the latency joins its outcome
            outcome = (2 if self._state == _CANCELLED else
                       0 if self._exception is None else 1)
            latencies = stats.ends[outcome]
            latencies.append(_clock() - self._submitted)
            if len(latencies) >= FOLD_AT:
                stats.fold_locked()
            rec = self._timing
            if rec is not None and rec.observer is not None:
                rec.observer.settled(rec, outcome)
        event = self._event
        if event is not None:
            event.release()  # (the threads waiting in result() go on, one after another)
        w = self._waiter
        if w is not None:  # the awaiting task wakes
            self._waiter = None
            wake(w)
        callbacks, self._callbacks = self._callbacks, None
        if callbacks:
            for cb in callbacks:
                _run_callback(cb, self)

    def add_done_callback(self, fn: Callable[[Future[T]], object]) -> None:
        """Call ``fn(fut)`` once done (at once if already done), on the resolving thread."""
        with _LOCK:
            if self._state == _PENDING:
                if self._callbacks is None:
                    self._callbacks = [fn]
                else:
                    self._callbacks.append(fn)
                return
        _run_callback(fn, self)

    def timings(self) -> CallTimings | None:
        """Where this call spent its time, once it is done.

        Recorded for colocated calls (functions and methods) while the
        controller runs with ``trace=`` on (``metrics=`` alone keeps only counters); see
        ``docs/observability.md``.

        Returns:
            A ``cb.CallTimings``, or None: not done yet, not a colocated call,
            or the controller records no timings.
        """
        rec = self._timing
        if rec is None or self._state == _PENDING or not rec.outcome:
            return None
        return rec.timings()

    # -- results -------------------------------------------------------------------

    def _get(self) -> T:
        if self._state == _CANCELLED:
            raise asyncio.CancelledError()
        if self._exception is not None:
            self._read()
            raise self._exception
        return self._result  # type: ignore[no-any-return]

    def _read(self) -> None:
        """Its error was read (awaited, ``result()``, ``exception()``) or handed to another
        call: never log it as unread."""
        unread = getattr(self, "_unread", None)
        if unread is None:
            self._unread = _HANDED
        elif unread is not _HANDED:
            unread.read = True

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The exception the operation raised, or None; waits like :meth:`result`."""
        self._wait(timeout)
        if self._state == _CANCELLED:
            raise asyncio.CancelledError()
        if self._exception is not None:
            self._read()
        return self._exception

    def result(self, timeout: float | None = None) -> T:
        """Block until done and return the result (or raise its exception).

        Raises:
            TimeoutError: not done within ``timeout`` seconds.
            RuntimeError: called on the controller's event-loop thread.
        """
        if self._state == _PENDING:
            self._wait(timeout)
        if self._state == _FINISHED and self._exception is None:
            return self._result  # type: ignore[no-any-return]
        return self._get()

    def _wait(self, timeout: float | None) -> None:
        """Wait until done: on a lock held until the Future settles (a raw lock, not a
        ``threading.Event``: its Python-level condition costs a dozen calls per wait).
        Each waiting thread, once in, lets the next one in."""
        if self._state != _PENDING:
            return
        if self._loop_thread is not None and _get_ident() == self._loop_thread:
            raise RuntimeError(
                "Future.result() would block the colobus controller's event loop; "
                "use `await fut` inside async code instead."
            )
        with _LOCK:
            lock = self._event
            if self._state == _PENDING and lock is None:
                lock = self._event = _new_lock()
                lock.acquire()  # released by _finish
        if lock is None:  # done before anyone waited
            return
        if timeout is None:
            got = lock.acquire()
        elif timeout > 0:
            got = lock.acquire(True, timeout)
        else:
            got = lock.acquire(False)
        if not got:
            raise TimeoutError(f"colobus operation not done after {timeout} s")
        lock.release()

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        """``np.asarray(fut)``: ``np.asarray`` of the value, waiting like :meth:`result`.

        Raises:
            RuntimeError: called on the controller's event-loop thread.
        """
        value = self.result()
        if copy:
            return np.array(value, dtype=dtype, copy=True)
        return np.asarray(value, dtype=dtype)

    def block_until_ready(self) -> Future[T]:
        """JAX's method, for a Future of a call's arrays: wait until the call is done and
        its arrays are ready (stored on their hosts and computed there), as
        ``cb.block_until_ready(fut)``; so ``jax.block_until_ready(fut)`` waits too.

        Returns:
            The Future itself, as JAX's returns the array.

        Raises:
            RuntimeError: called on the controller's event-loop thread (``await
                cb.block_until_ready(fut)`` there).
            Exception: the call's error.
        """
        block = ARRAY_WAYS.get("block")
        if block is None:  # (colobus._api is not loaded: no arrays to wait for)
            self.result()
        else:
            block(self)
        return self

    def copy_to_host_async(self) -> None:
        """JAX's method, for a Future of a call's arrays: start fetching its arrays' values
        once the call is done, so that a later ``np.asarray`` (``jax.device_get``) of them
        finds them on their way; returns at once."""
        copy = ARRAY_WAYS.get("copy")
        if copy is not None:
            copy(self)

    def __await__(self) -> Generator[Any, None, T]:
        if self._state == _PENDING:
            # the task waits on a Waiter, woken in the drain that settles this future
            owner: Any = self._owner
            # On its controller's loop thread the running loop is the controller's (asking
            # asyncio costs a getpid system call on Python 3.11)
            loop = (owner._loop if owner is not None and _get_ident() == self._loop_thread
                    else _get_running_loop())
            w = Waiter(loop=loop)
            box = getattr(_local, "inbox", None)  # inbox_of(loop), its hit inline
            w._box = box if box is not None and box.loop is loop else _inbox.inbox_of(loop)
            w._fut = self
            with _LOCK:
                waits = self._state == _PENDING
                if waits:
                    if self._waiter is None:
                        self._waiter = w
                    elif self._callbacks is None:
                        self._callbacks = [w._settled]
                    else:
                        self._callbacks.append(w._settled)
            if waits:
                w._asyncio_future_blocking = True
                try:
                    yield w
                except asyncio.CancelledError:
                    # The awaiting task was cancelled: cancel the operation too, as
                    # asyncio does for a future awaited by a cancelled task.
                    self.cancel()
                    raise
        if self._state == _FINISHED and self._exception is None:
            return self._result  # type: ignore[no-any-return]
        return self._get()

    def _ended(self) -> Generator[Any, None, None]:
        """``yield from fut._ended()``: wait, in any event loop, until done, neither reading
        the outcome nor cancelling the operation when the awaiting task is cancelled (what
        ``await arr`` waits on). Its twin: :meth:`__await__`'s wait, with a Watch."""
        if self._state != _PENDING:
            return
        loop = _get_running_loop()
        w = Watch(loop=loop)
        box = getattr(_local, "inbox", None)  # inbox_of(loop), its hit inline
        w._box = box if box is not None and box.loop is loop else _inbox.inbox_of(loop)
        w._fut = self
        with _LOCK:
            waits = self._state == _PENDING
            if waits:
                if self._waiter is None:
                    self._waiter = w
                elif self._callbacks is None:
                    self._callbacks = [w._settled]
                else:
                    self._callbacks.append(w._settled)
        if waits:
            w._asyncio_future_blocking = True
            yield w


class _Unread:
    """A failed call's error that no one read yet; logged once if it goes with its Future
    (as asyncio logs a task's exception that was never retrieved)."""

    __slots__ = ("exc", "host", "name", "read")

    def __init__(self, exc: BaseException, name: str, host: int | None) -> None:
        self.exc = exc
        self.name = name
        self.host = host
        self.read = False

    def __del__(self) -> None:
        if self.read:
            return
        exc = self.exc
        where = "" if self.host is None else f" on host {self.host}"
        try:
            log.error("colobus call of %s failed%s, and its Future was garbage-collected "
                      "with the error never read (await it, or call .result() or "
                      ".exception()): %s: %s", self.name, where, type(exc).__name__, exc,
                      exc_info=(type(exc), exc, exc.__traceback__))
        except Exception:  # interpreter shutdown: logging may be gone
            pass


_HANDED = _Unread(Exception(), "", None)  # ``_unread`` of a Future read or handed on
_HANDED.read = True
_QUIET = (asyncio.CancelledError,)  # never logged: the caller's own doing


def fail_call(fut: Future[Any], exc: BaseException, name: str, host: int | None,
              quiet: tuple[type[BaseException], ...] = ()) -> None:
    """Settle a colocated call's Future with ``exc`` (loop thread); logged once if the
    Future is garbage-collected with the error never read or handed to another call.
    ``quiet``: error types never logged so (the controller closing, say)."""
    if isinstance(exc, _QUIET + quiet) or getattr(fut, "_unread", None) is not None:
        fut.set_exception(exc)
        return
    unread = fut._unread = _Unread(exc, name, host)  # before any reader can see the error
    fut.set_exception(exc)
    if fut._exception is not exc:  # it had ended already
        unread.read = True


def _run_callback(fn: Callable[[Future[Any]], object], fut: Future[Any]) -> None:
    """Run one done-callback; one that raises is logged and the others still run.

    asyncio's rule: any exception a callback raises, ``BaseException`` included
    (a ``CancelledError`` from ``f.result()`` on a cancelled future), is logged
    and goes no further -- not into ``cancel()``'s caller, not into the message
    dispatch or liveness tick that settled the future. Only ``KeyboardInterrupt``
    and ``SystemExit`` propagate, as they do out of asyncio's callbacks.
    """
    try:
        fn(fut)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:
        log.exception("a colobus Future done-callback %r raised (the other callbacks still "
                      "run)", fn)


def in_event_loop() -> bool:
    """Whether this thread is running an asyncio event loop right now (so must not block)."""
    return asyncio._get_running_loop() is not None
