"""A call that depends on another (a Future, or a pending array, among its arguments)
ends as that call ends badly: with its error, whatever it was (an error on a host, a
check of its outputs on the controller, a lost host), never with what its hosts make of
the other call's outputs missing."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from .._errors import ControllerClosedError
from .._wire import protocol as P
from .operation import Operation

if TYPE_CHECKING:
    from .future import Future
    from .ops import Operations

__all__ = ["fail_with"]


def fail_with(ops: Operations, fut: Future[Any], exc: BaseException) -> None:
    """End the operation of ``fut`` with ``exc`` (any thread; on the loop thread at once,
    before its own reply is read). Its hosts that have not answered are told to drop it,
    as for a cancel; one still in the backlog never leaves."""
    ctl = ops.ctl
    if threading.get_ident() == ctl._loop_thread_id:
        _fail(ops, fut, exc)
        return
    try:
        ctl._call_soon(_fail, ops, fut, exc)
    except ControllerClosedError:
        pass


def _fail(ops: Operations, fut: Future[Any], exc: BaseException) -> None:
    op = ops.pending.get(fut.call_id)
    if op is None or op.future is not fut:  # still in the backlog, or ended already
        if fut.done():
            return
        for queued in ops.backlog:  # (it is skipped as it reaches the front)
            if isinstance(queued, Operation) and queued.future is fut:
                queued.fail(exc)
                return
        fut.set_exception(exc)  # (not on the loop yet: it is skipped there)
        return
    hosts = ops.hosts
    for i in op.waiting_for():
        h = hosts[i]
        if h.alive:
            ops.ctl._send(h, P.Cancel(op.call_id))
    op.end(ops, exc)
