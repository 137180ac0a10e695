"""``cb.block_until_ready``: every array stored and computed on its hosts.

Arrays are waited for with one FETCH per host, answered once JAX there says the
value is computed. For a call's Future, each host of the call is asked to answer
once the call's outputs are computed (``FETCH_CALL``), so awaiting a step costs
one round trip, not two (the call's reply, then a wait). A host that cannot tell
(the call went another way, through a relay, or already ended and an output is
gone) answers False: the wait then happens after the call's reply, as for any
array.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from .._controller.controller import Controller, default_controller
from .._controller.future import ARRAY_WAYS, Future
from .._controller.hosts import Host
from .._wire import protocol as P
from .._wire.envelope import Envelope
from .array import WAYS, Array, check_owner, off_loop
from .fetch import fetch_many
from .plan import CallPlan

__all__ = ["block_until_ready", "ready_future"]


def _is_handle(x: Any) -> bool:
    return isinstance(x, Array | Future)


def _answer(host: Host, body: P.Result, env: Envelope) -> bool:
    return body.meta is True


def _all_true(values: dict[int, bool]) -> bool:
    return all(values.values())


def _ask_hosts(ctl: Controller, call: Future[Any]) -> Future[bool] | None:
    """Ask the call's hosts to answer once its outputs are computed (None: not a call)."""
    plan = call.info
    if not isinstance(plan, CallPlan) or not call.call_id:
        return None
    hosts, ref = plan.hosts, call.call_id

    def send(call_id: int) -> None:
        for h in hosts:
            ctl._send(ctl._hosts[h], P.Fetch(call_id, ref, P.FETCH_CALL))

    return ctl._ops.submit(hosts, send, _answer, _all_true, backpressure=False)


def _arrays(tree: Any) -> list[Array]:
    import jax

    return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_handle)
            if isinstance(x, Array)]


class _Wait:
    """One ``block_until_ready`` over arrays and calls' Futures: done once every part is."""

    def __init__(self, ctl: Controller, tree: Any, arrays: list[Array],
                 calls: list[Future[Any]]) -> None:
        self.ctl, self.tree, self.calls = ctl, tree, calls
        self.outer: Future[Any] = ctl._ops.new_future()
        self.confirmed: dict[int, bool] = {}  # call index -> its hosts said computed
        asks = [_ask_hosts(ctl, c) for c in calls]
        self.left = 1 + len(calls) + sum(a is not None for a in asks)
        fetch_many(arrays, False, lambda _: None).add_done_callback(self._part)
        for i, (call, ask) in enumerate(zip(calls, asks, strict=True)):
            call.add_done_callback(self._part)
            if ask is not None:
                ask.add_done_callback(functools.partial(self._asked, i))

    def _asked(self, i: int, f: Future[bool]) -> None:
        self.confirmed[i] = not f.cancelled() and f.exception() is None and f.result()
        self._part(None)

    def _part(self, f: Future[Any] | None) -> None:
        if self.outer.done() or (f is not None and _failed(self.outer, f)):
            return
        self.left -= 1
        if self.left == 0:
            self._calls_done()

    def _calls_done(self) -> None:
        late: list[Array] = []
        for i, call in enumerate(self.calls):
            outs = _arrays(call.result())
            if self.confirmed.get(i):
                for a in outs:
                    a._ready = True
            else:
                late.extend(outs)
        fetch_many(late, False, lambda _: None).add_done_callback(self._finish)

    def _finish(self, f: Future[Any]) -> None:
        if self.outer.done() or _failed(self.outer, f):
            return
        import jax

        def value(x: Any) -> Any:
            return x.result() if isinstance(x, Future) else x

        self.outer.set_result(jax.tree_util.tree_map(value, self.tree, is_leaf=_is_handle))


def block_until_ready(tree: Any) -> Any:
    """``tree`` once every ``cb.Array`` in it is ready: stored on its hosts and its value
    computed there (each host waits with JAX's ``block_until_ready``, off its loop
    thread).

    A colocated call's Future in ``tree`` is waited for too, and replaced by its value
    (its arrays, ready): the wait leaves right behind the call, so
    ``await cb.block_until_ready(step(x))`` costs one round trip.

    A pending array (a call's output while the call runs) is waited for with its call,
    whose error is raised here.

    Returns:
        Off the controller's event-loop thread (plain scripts under ``with``,
        ``cb.init()``, worker threads, a thread running another event loop such as a
        Jupyter kernel's), the tree, once ready: it blocks, as JAX's does, so
        ``cb.block_until_ready(y)`` as a statement waits. On that thread (async code
        under ``async with``), a ``cb.Future`` of it, to ``await``.
    """
    return off_loop(ready_future(tree))


class _OneCall:
    """``block_until_ready`` of one call's Future (``_Wait``'s case of a tree that is one
    call, written out: an awaited step's path, with no tree to walk and no empty fetch)."""

    __slots__ = ("call", "confirmed", "ctl", "left", "outer")

    def __init__(self, ctl: Controller, call: Future[Any], ask: Future[bool]) -> None:
        self.ctl, self.call = ctl, call
        self.outer: Future[Any] = ctl._ops.new_future()
        self.confirmed = False
        self.left = 2
        call.add_done_callback(self._part)
        ask.add_done_callback(self._asked)

    def _asked(self, f: Future[bool]) -> None:
        self.confirmed = not f.cancelled() and f.exception() is None and f.result()
        self._part(None)

    def _part(self, f: Future[Any] | None) -> None:
        outer = self.outer
        if outer.done() or (f is not None and _failed(outer, f)):
            return
        self.left -= 1
        if self.left:
            return
        value = self.call.result()
        if self.confirmed:
            for a in _arrays(value):
                a._ready = True
            outer.set_result(value)
            return
        fetch_many(_arrays(value), False, _nothing).add_done_callback(self._fetched)

    def _fetched(self, f: Future[Any]) -> None:
        if not self.outer.done() and not _failed(self.outer, f):
            self.outer.set_result(self.call.result())


def _nothing(_: list[Any]) -> None:
    return None


def _failed(outer: Future[Any], f: Future[Any]) -> bool:
    """Whether part ``f`` of a wait failed (or was cancelled): then ``outer`` fails so.
    (A cancelled Future's ``exception()`` raises: it is not asked.)"""
    exc = RuntimeError("cancelled") if f.cancelled() else f.exception()
    if exc is None:
        return False
    outer.set_exception(exc)
    return True


def ready_future(tree: Any) -> Future[Any]:
    """A Future of :func:`block_until_ready`'s value, on any thread."""
    import jax

    if type(tree) is Future and tree.call_id:  # one call's (an awaited step)
        owner = tree._owner
        ctl = owner if isinstance(owner, Controller) else default_controller()
        ask = _ask_hosts(ctl, tree)
        if ask is not None:
            return _OneCall(ctl, tree, ask).outer

    leaves = jax.tree_util.tree_leaves(tree, is_leaf=_is_handle)
    arrays = [x for x in leaves if isinstance(x, Array)]
    calls = [x for x in leaves if isinstance(x, Future)]
    if calls:
        return _with_calls(tree, arrays, calls)

    def finish(_: list[Any]) -> Any:
        for a in arrays:  # stored and computed: later waits need no round trip
            a._ready = True
        return tree

    return fetch_many(arrays, False, finish)


def _with_calls(tree: Any, arrays: list[Array], calls: list[Future[Any]]) -> Future[Any]:
    """``block_until_ready`` of a tree holding calls' Futures; it resolves to the tree
    with each Future replaced by its value."""
    owner = calls[0]._owner
    ctl = owner if isinstance(owner, Controller) else (
        arrays[0]._ctl if arrays else default_controller())
    for h in (*arrays, *calls):
        check_owner(h, ctl)
    return _Wait(ctl, tree, arrays, calls).outer


def _block_future(fut: Future[Any]) -> None:
    """``fut.block_until_ready()`` (a call's Future): as ``cb.block_until_ready(fut)``."""
    loop_thread = fut._loop_thread
    if loop_thread is not None and threading.get_ident() == loop_thread:
        raise RuntimeError(
            "fut.block_until_ready() would block the colobus controller's event loop; use "
            "`await cb.block_until_ready(fut)` in async code")
    ready_future(fut).result()


WAYS.ready = ready_future
ARRAY_WAYS["block"] = _block_future
