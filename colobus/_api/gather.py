"""``cb.gather``: await many colobus futures at the cost of one.

``asyncio.gather`` wraps every awaitable that is not an ``asyncio.Future`` in a
Task of its own, and a colobus Future is not one (it belongs to no loop: see
:mod:`colobus._controller.future`). So gathering a thousand calls costs a thousand Tasks,
each with its own waiter and two steps on the loop, about as much controller
CPU as the calls' own sending and settling. :func:`gather` instead gives every
future one done-callback that counts it off, and wakes the awaiting task once,
when the last one settles (or the first one fails).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable
from typing import Any

from .._controller.future import _CANCELLED, Future
from .._controller.inbox import inbox_of

__all__ = ["gather"]


async def gather(*aws: Awaitable[Any], return_exceptions: bool = False) -> list[Any]:
    """Await every awaitable; their results, in the order given.

    ``asyncio.gather`` for colobus futures: the same results, errors and
    cancellation, without a Task per future. As there, the first exception
    raised (in the order the futures end) propagates and the others keep
    running, unless ``return_exceptions=True`` puts each exception in its
    future's place; cancelling the awaiting task cancels every future not
    done yet (and so their calls). Awaitables that are not colobus futures
    (coroutines, asyncio futures) are handed to ``asyncio.gather`` with the
    rest, at its usual cost.

    Example::

        outs = await cb.gather(*(step(x) for x in batches))
    """
    if not all(type(a) is Future for a in aws):
        return list(await asyncio.gather(*aws, return_exceptions=return_exceptions))
    futs: tuple[Future[Any], ...] = aws  # type: ignore[assignment]
    loop = asyncio.get_running_loop()
    # Set to None once every future is done, or to the first one that failed.
    waiter: asyncio.Future[Future[Any] | None] = loop.create_future()
    if futs:
        _wait_for(futs, loop, waiter, return_exceptions)
    else:
        waiter.set_result(None)
    try:
        failed = await waiter
    except asyncio.CancelledError:  # the awaiting task was cancelled: so are the calls
        for f in futs:
            f.cancel()
        raise
    if failed is not None:
        failed._get()  # raises its exception (CancelledError if it was cancelled)
    if not return_exceptions:
        return [f._get() for f in futs]
    out: list[Any] = []
    for f in futs:
        if f.cancelled():
            out.append(asyncio.CancelledError())
        else:
            out.append(f._exception if f._exception is not None else f._result)
    return out


def _wait_for(futs: tuple[Future[Any], ...], loop: asyncio.AbstractEventLoop,
              waiter: asyncio.Future[Future[Any] | None], return_exceptions: bool) -> None:
    """Settle ``waiter`` (on its loop) once all of ``futs`` are done, or one failed."""
    n = len(futs)
    ended = itertools.count(1)  # next() is atomic: futures settle on several threads
    inbox = inbox_of(loop)

    def wake(failed: Future[Any] | None) -> None:
        inbox.call(_settle, waiter, failed)

    def one_done(f: Future[Any]) -> None:
        last = next(ended) == n
        if f._exception is not None:  # retrieved, as asyncio.gather retrieves each: the
            f._read()  # gather's own error or result carries it, never logged as unread
        if not return_exceptions and (f._state == _CANCELLED or f._exception is not None):
            wake(f)
        elif last:
            wake(None)

    for f in futs:
        f.add_done_callback(one_done)


def _settle(waiter: asyncio.Future[Future[Any] | None], failed: Future[Any] | None) -> None:
    if not waiter.done():
        waiter.set_result(failed)
