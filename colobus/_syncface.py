"""The sync face: the same async controller core, run on an event-loop thread of its own.

Plain scripts use ``with Controller(...)``: the controller's loop runs on a
private thread started with a bounded wait, and the blocking methods here hop
onto it. Each refuses, with a message saying what to do instead, where blocking
would deadlock (on that loop thread itself).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from ._loops import new_event_loop

__all__ = ["LoopThread"]

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
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

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
