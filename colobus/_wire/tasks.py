"""Background tasks of either side: one that dies unexpectedly is logged and handled.

A controller's liveness loop and a worker's heartbeats are asyncio tasks that
must outlive every message they handle. :func:`supervise` attaches a done
callback that tells an expected ending (cancelled, or returned) from a death
(an exception escaped): a death is logged with its traceback and handed to
``on_death``, which restarts the task or closes what depends on it, saying why.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

__all__ = ["supervise"]

log = logging.getLogger("colobus.tasks")


def supervise(task: asyncio.Task[Any], what: str,
              on_death: Callable[[str], object] | None = None) -> asyncio.Task[Any]:
    """Log ``task``'s death (an exception, not a cancel) and call ``on_death(why)``.

    Returns:
        ``task``, for chaining.
    """

    def ended(t: asyncio.Task[Any]) -> None:
        if t.cancelled():
            return
        exc = t.exception()
        if exc is None:
            return
        why = f"{what} died: {type(exc).__name__}: {exc}"
        log.error("colobus background task %s", why, exc_info=exc)
        if on_death is not None:
            try:
                on_death(why)
            except Exception:
                log.exception("handling the death of %s failed", what)

    task.add_done_callback(ended)
    return task
