"""The sync face: the same async controller core, run on an event-loop thread of its own.

Plain scripts use ``with Controller(...)``: the controller's loop runs on a
private thread started with a bounded wait, and the blocking methods here hop
onto it. Each refuses, with a message saying what to do instead, where blocking
would deadlock (on that loop thread itself).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

from .._wire.keys import catch_sigterm

__all__ = [
    "LoopThread", "SyncFace", "SyncOwner", "close", "new_event_loop", "run_sync",
    "start_in_thread", "uvloop_in_use",
]

log = logging.getLogger("colobus.controller")

T = TypeVar("T")


class LoopThread:
    """An event loop running on a daemon thread, and the way to stop it."""

    def __init__(self, name: str = "colobus-controller") -> None:
        self.loop = new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        loop.call_soon(self._ready.set)
        try:
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

    def start(self, timeout: float) -> None:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("colobus controller thread did not start")

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def on_thread(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for it (from any other thread)."""
        if self.on_thread():
            coro.close()
            raise RuntimeError(
                "this blocking colobus call would deadlock on the controller's own event-loop "
                "thread (e.g. inside a done-callback); use the async form (`await ...`) there")
        return wait_or_cancel(asyncio.run_coroutine_threadsafe(coro, self.loop), timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop and join the thread; from the thread itself, only ask it to stop."""
        if self.loop.is_closed():
            return
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # closed meanwhile
            return
        if not self.on_thread() and self._thread.is_alive():
            self._thread.join(timeout)


class SyncOwner(Protocol):
    """What the sync face uses of the controller it runs."""

    _own_thread: LoopThread | None
    _closing: asyncio.Task[None] | None
    _write_key_file: bool  # it makes its own key file (on its loop thread)

    @property
    def _loop(self) -> asyncio.AbstractEventLoop | None: ...
    @property
    def _closed(self) -> bool: ...
    def _set_closed(self) -> None: ...
    def _on_loop_thread(self) -> bool: ...
    async def start(self) -> None: ...
    async def aclose(self) -> None: ...


class SyncFace:
    """The controller's blocking methods for plain code (a base of ``Controller``)."""

    def start_in_thread(self: SyncOwner, timeout: float = 30.0) -> None:
        """Start the controller on a private event-loop thread (the sync face)."""
        start_in_thread(self, timeout)

    def run_sync(self: SyncOwner, coro: Any, timeout: float | None = None) -> Any:
        """Run a coroutine on the controller's loop and wait for it (not from that loop).

        Raises:
            RuntimeError: called on the controller's own loop thread (it would
                deadlock); ``await`` the coroutine there instead.
        """
        return run_sync(self, coro, timeout)

    def close(self: SyncOwner) -> None:
        """Close the controller from plain code (``with``), or from any other thread.

        On the controller's own loop thread (a done-callback), closing starts at
        once and finishes in the background: nothing may block that thread.
        """
        close(self)


def start_in_thread(ctl: SyncOwner, timeout: float) -> None:
    """Start ``ctl`` on a private event-loop thread; no thread outlives a failed start."""
    if ctl._write_key_file:  # the key file it makes there goes on SIGTERM too (set here:
        catch_sigterm()      # Python sets signal handlers on the main thread only)
    thread = LoopThread()
    thread.start(timeout)
    ctl._own_thread = thread
    try:
        thread.run(ctl.start(), timeout)
    except BaseException:
        # A start cut short (a Ctrl-C as it binds) may have bound the socket: undo it
        # on the loop, or the closing that follows would find no loop to run on.
        try:
            thread.run(ctl.aclose(), 30)
        except Exception as exc:
            log.debug("closing a controller whose start failed: %r", exc)
        finally:
            ctl._own_thread = None
            thread.stop()
        raise


def run_sync(ctl: SyncOwner, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
    """Run ``coro`` on ``ctl``'s loop and wait for it; refused on that loop's thread."""
    if ctl._own_thread is not None:
        return ctl._own_thread.run(coro, timeout)
    if ctl._loop is None or ctl._on_loop_thread():
        coro.close()
        raise RuntimeError("run_sync cannot run on the controller's own event loop; "
                           "await the coroutine there instead")
    return wait_or_cancel(asyncio.run_coroutine_threadsafe(coro, ctl._loop), timeout)


def wait_or_cancel(fut: concurrent.futures.Future[T], timeout: float | None) -> T:
    """``fut.result(timeout)``; on the timeout the coroutine behind it is cancelled."""
    try:
        return fut.result(timeout)
    except TimeoutError:
        fut.cancel()  # cancels the task on the loop: nothing keeps running unseen
        raise


def close(ctl: SyncOwner) -> None:
    """Close ``ctl`` from plain code or any other thread.

    On the controller's own loop thread (a done-callback), closing starts at once
    and finishes in the background: nothing may block that thread.
    """
    thread = ctl._own_thread
    loop = ctl._loop
    if loop is None or (thread is None and ctl._closed):
        ctl._set_closed()
        return
    if ctl._on_loop_thread():
        ctl._own_thread = None
        closing = ctl._closing = loop.create_task(ctl.aclose())
        if thread is not None:
            closing.add_done_callback(lambda _: thread.stop())
        return
    if thread is None:
        asyncio.run_coroutine_threadsafe(ctl.aclose(), loop).result(30)
        return
    ctl._own_thread = None
    try:
        if not ctl._closed:
            thread.run(ctl.aclose(), 30)
    finally:
        thread.stop()


# The controller's own event loop (the sync face): uvloop where installed.
#
# A controller entered with plain ``with`` runs on a loop thread of its own;
# where uvloop (the optional ``colobus[fast]`` extra) is installed, that loop is
# uvloop's, which runs the same callbacks with less overhead per iteration: the
# sync no-op call measured 359 against 386 us (medians of 12 alternating blocks
# of 300 calls, two clusters side by side). ``COLOBUS_UVLOOP=0`` keeps asyncio's
# loop. Workers keep asyncio's loop: uvloop there measured no gain (311 against
# 308 us), as their calls mostly wait on the thread pool, not the loop. A
# controller entered with ``async with`` runs on the caller's loop, whichever
# that is.
log = logging.getLogger("colobus.loops")


def _uvloop() -> Any:
    if os.environ.get("COLOBUS_UVLOOP", "1") == "0":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def uvloop_in_use() -> bool:
    """Whether the loops colobus starts are uvloop's."""
    return _uvloop() is not None


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's where installed and not turned off."""
    uvloop = _uvloop()
    if uvloop is not None:
        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        return loop
    return asyncio.new_event_loop()
