"""Reading arrays back: ``cb.device_get``, and the fetches behind ``np.asarray``,
``is_ready`` and the waits of ``cb.block_until_ready``.

A fetch of a pending array (a call's output while the call runs) is sent at once: its
host answers once the call stored the output. It ends only once the call's Future did,
and with the call's error if the call failed (on a host, or on the controller: an
output check), never with data the controller refused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from .._controller.controller import Controller, default_controller
from .._controller.future import ARRAY_WAYS, Future
from .._controller.hosts import Host
from .._model.blocks import HostBlock, assemble, host_blocks
from .._wire import protocol as P
from .._wire.describe import read_fetched
from .._wire.envelope import Envelope
from .array import WAYS, Array, check_owner, off_loop

__all__ = ["device_get", "fetch_many", "fetch_tree", "gate", "off_loop", "probe"]


def _answer(host: Host, body: P.Result, env: Envelope) -> bool:
    return body.meta is True


def _all_true(values: dict[int, bool]) -> bool:
    return all(values.values())


def _ctl_of(leaves: list[Array]) -> Controller:
    ctl = leaves[0]._ctl if leaves else default_controller()
    for a in leaves:
        check_owner(a, ctl)
    return ctl


def probe(array: Array) -> Future[bool]:
    """Whether ``array``'s hosts hold it computed now (``is_ready``; they never wait)."""
    ctl = array._ctl
    ref = array.ref
    hosts = array.hosts

    def send(call_id: int) -> None:
        for h in hosts:
            ctl._send(ctl._hosts[h], P.Fetch(call_id, ref, P.FETCH_PROBE))

    return ctl._ops.submit(hosts, send, _answer, _all_true, backpressure=False)


def gate(outer: Future[Any], calls: list[Future[Any]], then: Callable[[], None]) -> None:
    """Run ``then()`` once every call of ``calls`` (the calls that make pending arrays)
    succeeded; end ``outer`` with the first one's error (or cancellation) instead."""
    left = [len(calls)]

    def one(f: Future[Any]) -> None:
        if outer.done():
            return
        if f.cancelled():
            outer._set_cancelled()
            return
        exc = f.exception()  # (read: handed on to what waits for the array)
        if exc is not None:
            outer.set_exception(exc)
            return
        left[0] -= 1
        if not left[0]:
            then()

    for f in calls:
        f.add_done_callback(one)


def _pending_calls(arrays: list[Array]) -> list[Future[Any]]:
    """The distinct calls still making some of ``arrays`` (each checked usable first)."""
    calls: dict[int, Future[Any]] = {}
    for a in arrays:
        a.check_usable()
        call = a._call
        if call is not None:
            calls[id(call)] = call
    return list(calls.values())


def fetch_many(arrays: list[Array], data: bool,
                finish: Callable[[list[Any]], Any]) -> Future[Any]:
    """One operation fetching (or only awaiting) every array's blocks; for pending
    arrays, ended once their calls did (with a call's error if one failed)."""
    ctl = _ctl_of(arrays)
    calls = _pending_calls(arrays)
    plan: list[tuple[int, int, Array, HostBlock | None]] = []  # (host, array idx, arr, block)
    for i, a in enumerate(arrays):
        if data:
            for h, blk in a._fetch_block_hosts().items():
                plan.append((h, i, a, blk))
        elif not a._ready:
            for h in a.hosts:
                plan.append((h, i, a, None))
    by_host: dict[int, list[tuple[int, Array, HostBlock | None]]] = {}
    for h, i, a, b in plan:
        by_host.setdefault(h, []).append((i, a, b))
    # One sub-call id per (host, block); the op completes when all replied.
    sub_ids: dict[int, tuple[int, int, Array, HostBlock | None]] = {}
    for h, items in by_host.items():
        for i, a, b in items:
            sub_ids[ctl._ops.next_id()] = (h, i, a, b)
    results: list[dict[int, np.ndarray[Any, Any]]] = [{} for _ in arrays]
    outer = ctl._ops.new_future()
    remaining = [len(sub_ids) + (1 if calls else 0)]
    errors: list[BaseException] = []  # a fetch's, held while a call may explain it

    def counted() -> None:
        remaining[0] -= 1
        if remaining[0] == 0:
            if errors:
                outer.set_exception(errors[0])
                return
            try:
                outer.set_result(finish(results))
            except BaseException as e:
                outer.set_exception(e)

    if calls:
        gate(outer, calls, counted)
    if not sub_ids:
        if not calls:
            outer.set_result(finish([None] * len(arrays)))
        return outer

    def on_one(sub: int, f: Future[Any]) -> None:
        h, i, _, _ = sub_ids[sub]
        if outer.done():
            return
        exc = f.exception() if not f.cancelled() else None
        if exc is not None:
            if not calls:
                outer.set_exception(exc)
                return
            errors.append(exc)  # (the call that makes the array failed there, likely)
        elif data:
            results[i][h] = f.result()
        counted()

    def decode(host: Host, body: P.Result, env: Envelope) -> Any:
        if not data:
            return None
        block = read_fetched(body.meta, env.buffers)
        ctl._count("bytes_fetched", block.nbytes)
        return block

    for sub, (h, _, a, _) in sub_ids.items():
        def send(call_id: int, h: int = h, a: Array = a) -> None:
            ctl._send(ctl._hosts[h], P.Fetch(call_id, a.ref, data))

        f = ctl._ops.submit((h,), send, decode, functools.partial(_value_of, h), call_id=sub,
                       backpressure=False)
        f.add_done_callback(functools.partial(on_one, sub))
    return outer


def _value_of(host: int, values: dict[int, Any]) -> Any:
    return values[host]


def _assemble(a: Array, blocks: dict[int, np.ndarray[Any, Any]]) -> Any:
    hb = host_blocks(a.sharding, a.shape)
    if a._key_impl:
        import jax

        sample = next(iter(blocks.values()))
        extra = sample.shape[len(a.shape):]
        data_hb = {h: hb[h] for h in blocks}
        full = _assemble_blocks(a.shape + extra, sample.dtype, blocks, data_hb, len(extra))
        return jax.random.wrap_key_data(full, impl=a._key_impl)  # type: ignore[arg-type]
    return assemble(a.shape, a.dtype, blocks, {h: hb[h] for h in blocks})


def _assemble_blocks(shape: tuple[int, ...], dtype: Any, blocks: dict[int, Any],
                     hb: dict[int, HostBlock], extra: int) -> np.ndarray[Any, Any]:
    out = np.empty(shape, dtype)
    for h, blk in blocks.items():
        out[hb[h].index + (slice(None),) * extra] = blk
    return out


def _is_handle(x: Any) -> bool:
    return isinstance(x, Array | Future)


def device_get(tree: Any) -> Any:
    """Fetch every ``cb.Array`` in ``tree``: the same tree with numpy leaves.

    A ``cb.Future`` in ``tree`` (a colocated call's) is waited for and replaced by its
    value, fetched the same way; so is a pending array (a call's output while the call
    runs), whose call's error is raised. Non-array leaves pass through. Typed PRNG key
    arrays come back as JAX key arrays. Where several devices hold one block (a
    replicated output), the value is the first device's, as JAX's.

    Returns:
        Off the controller's event-loop thread (plain scripts under ``with``,
        ``cb.init()``, worker threads, a thread running another event loop such as a
        Jupyter kernel's), the fetched tree, waited for as JAX's ``device_get`` does; on
        that thread (async code under ``async with``), a ``cb.Future`` of it, to
        ``await``.
    """
    return off_loop(fetch_tree(tree))


def fetch_tree(tree: Any) -> Future[Any]:
    """A Future of :func:`device_get`'s value, on any thread."""
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_handle)
    calls = [x for x in leaves if isinstance(x, Future)]
    if calls:
        return _after_futures(tree, leaves, treedef, calls)
    arrays = [x for x in leaves if isinstance(x, Array)]
    tdef: Any = treedef

    def finish(results: list[Any]) -> Any:
        it = iter(_assemble(a, r) for a, r in zip(arrays, results, strict=True))
        return tdef.unflatten([next(it) if isinstance(x, Array) else x for x in leaves])

    return fetch_many(arrays, True, finish)


def _after_futures(tree: Any, leaves: list[Any], treedef: Any,
                   futures: list[Future[Any]]) -> Future[Any]:
    """:func:`fetch_tree` of ``tree`` once its futures are done, each replaced by its
    value (its error, or its cancellation, is the fetch's)."""
    arrays = [x for x in leaves if isinstance(x, Array)]
    owner = futures[0]._owner
    ctl = owner if isinstance(owner, Controller) else _ctl_of(arrays)
    for h in (*arrays, *futures):
        check_owner(h, ctl)
    outer: Future[Any] = ctl._ops.new_future()
    left = [len(futures)]

    def copy(f: Future[Any]) -> None:
        if f.cancelled():
            outer._set_cancelled()
        elif (exc := f.exception()) is not None:
            outer.set_exception(exc)
        else:
            outer.set_result(f.result())

    def one(f: Future[Any]) -> None:
        if outer.done():
            return
        if f.cancelled() or f.exception() is not None:
            copy(f)
            return
        left[0] -= 1
        if left[0]:
            return
        values = [x.result() if isinstance(x, Future) else x for x in leaves]
        try:
            inner = fetch_tree(treedef.unflatten(values))
        except BaseException as exc:  # a deleted or lost array among the values
            outer.set_exception(exc)
            return
        inner.add_done_callback(copy)

    for f in futures:
        f.add_done_callback(one)
    return outer


def _copy_future(fut: Future[Any]) -> None:
    """``fut.copy_to_host_async()`` (a call's Future): its arrays' fetches start once
    it is done (``copy_to_host_async`` on each)."""
    def start(f: Future[Any]) -> None:
        if f.cancelled() or f._exception is not None:
            return
        import jax

        for leaf in jax.tree_util.tree_leaves(f._result):
            if type(leaf) is Array:
                leaf.copy_to_host_async()

    fut.add_done_callback(start)


WAYS.fetch = fetch_tree
WAYS.probe = probe
ARRAY_WAYS["copy"] = _copy_future
