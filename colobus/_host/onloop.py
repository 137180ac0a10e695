"""What a host's scheduler runs on the loop itself: ``async def`` calls and DESTROYs.

Each holds its stream (:mod:`colobus._host.sched`) until it ends, then starts the
stream's next calls.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from .._wire import protocol as P
from .._wire.protocol import Status
from .calls import _DONE, WorkerServices, _Call, _Destroy, _Stream, call_args

__all__ = ["destroy", "run_async"]


class Scheduler(Protocol):
    """What these use of :class:`colobus._host.sched.Scheduler`."""

    _w: WorkerServices

    def pump(self, stream: _Stream) -> None: ...
    def _finish(self, call: _Call) -> None: ...
    def _forget(self, call: _Call) -> None: ...


async def run_async(sched: Scheduler, call: _Call, fn: Any) -> None:
    """An ``async def`` call, on the loop."""
    w = sched._w
    call.started = time.perf_counter_ns()
    try:
        args, kwargs = call_args(call, w.present)
        out = await fn(*args, **kwargs)
        call.outcome = w.values.outputs(out, call.mesh, call.pins, fn, None, call.body.check)
        call.ok = True
    except asyncio.CancelledError as exc:
        if call.epoch != w.epoch:
            raise  # the session ended
        call.outcome = exc
    except BaseException as exc:
        call.outcome = exc
    call.ran = time.perf_counter_ns() - call.started
    del fn
    call.last = True
    if call.ok or not isinstance(call.outcome, asyncio.CancelledError):
        sched._finish(call)
        return
    # The function itself was cancelled (it awaited something cancelled).
    call.state = _DONE
    sched._forget(call)
    call.outcome = None
    if not call.results.done():
        call.results.set_exception(asyncio.CancelledError())
        call.results.exception()
    w.send(P.Result(call.body.call_id, Status.CANCELLED, None))
    stream = call.stream
    assert stream is not None
    stream.busy = False
    sched.pump(stream)


async def destroy(sched: Scheduler, item: _Destroy, stream: _Stream) -> None:
    """Drop an object once its calls finished; its stream waits meanwhile."""
    w = sched._w
    store = w.store
    epoch = w.epoch
    try:
        if item.calls:  # each call's result slot: settled once the call finished
            await asyncio.wait(item.calls)
        fut = store.objects.get(item.obj)
        if fut is not None:
            if not fut.done():
                await asyncio.wait({fut})
            if epoch == w.epoch and store.objects.get(item.obj) is fut:
                del store.objects[item.obj]
                store.classes.pop(item.obj, None)
            del fut  # the last reference: the instance's __del__ runs here
    finally:
        item.calls = set()
        stream.busy = False
        sched.pump(stream)
