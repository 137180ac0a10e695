"""Per-stream batching on the host (issue 7 fast path), proved with host-side logs.

Calls from one task form one stream: the host runs them in order, and runs the
ready plain calls queued in a stream back to back in one thread-pool job. These
tests fire bursts so that batches form, then read back what ran where and in
what order.

The shared cluster runs on a loop thread of its own: the bursts whose Futures the tests
follow are made as async code under ``async with`` makes them, on that thread, in one
task (``lifecycle.in_async``, ``calls_return_futures``: one stream); calls made here, on
pytest's loop, return their arrays (SPEC 4).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import sec_hostside as hs
from lifecycle import calls_return_futures, in_async

import colobus as cb

_ids = itertools.count(50_000)
_LOG: list[tuple[int, str]] = []  # on each host: (token, thread name), in run order
_LOCK = threading.Lock()


@pytest.fixture(autouse=True, scope="module")
def _gates() -> Iterator[None]:
    yield
    hs.remove_gates()


def _off_loop() -> bool:
    """No event loop runs on this thread: a plain call (pool or inline), not a coroutine."""
    return asyncio._get_running_loop() is None


@cb.colocated_python
def record(token: int) -> np.ndarray:
    """Log ``token`` and whether it ran off the event loop (on the call pool, or inline
    on a loop thread with the loop stopped); tokens divisible by 7 fail after logging."""
    with _LOCK:
        _LOG.append((token, _off_loop()))
    if token % 7 == 0:
        raise ValueError(f"token {token} fails")
    return np.int32(token)


@cb.colocated_python
async def record_async(token: int) -> np.ndarray:
    """An ``async def`` link in a stream of plain calls."""
    await asyncio.sleep(0)
    with _LOCK:
        _LOG.append((token, _off_loop()))
    return np.int32(token)


@cb.colocated_python
def add_one(x: Any) -> Any:
    return x + 1


@cb.colocated_python
def read_log() -> tuple[np.ndarray, np.ndarray]:
    with _LOCK:
        tokens = np.array([t for t, _ in _LOG], np.int32)
        off_loop = np.array([off for _, off in _LOG], np.bool_)
    return tokens, off_loop


def _on(dev: cb.Device, *fns: Any) -> list[Any]:
    return [f.specialize(devices=[dev]) for f in fns]


async def _host_log(dev: cb.Device) -> tuple[list[int], list[bool]]:
    (read,) = _on(dev, read_log)
    # Its own task, hence its own stream: never queued behind the stream under test (its
    # Future: the log grows, which arrays made from an earlier call's specs would refuse).
    out = await in_async(read)
    tokens, off_loop = cb.device_get(out)
    return [int(t) for t in np.asarray(tokens)], [bool(p) for p in np.asarray(off_loop)]


async def _call(fn: Any, *args: Any) -> Any:
    return await fn(*args)


async def _until_started(dev: cb.Device, gate: int) -> None:
    (events,) = _on(dev, hs.events)
    for _ in range(600):
        arr = await in_async(events)  # (its own task: its own stream)
        if gate + 1_000_000 in [int(x) for x in np.asarray(cb.device_get(arr))]:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("gated call never started")


async def test_burst_runs_in_order_with_errors_per_call(ctl: cb.Controller) -> None:
    dev = cb.devices()[1]
    (rec,) = _on(dev, record)
    tokens = [next(_ids) for _ in range(300)]
    futs = in_async(lambda: [rec(t) for t in tokens])  # one task: one stream, not awaited
    results = await asyncio.gather(*futs, return_exceptions=True)
    for t, r in zip(tokens, results, strict=True):
        if t % 7 == 0:
            assert isinstance(r, ValueError) and f"token {t} fails" in str(r), r
        else:
            assert isinstance(r, cb.Array), r
            assert int(np.asarray(cb.device_get(r))) == t
    log, off_loop = await _host_log(dev)
    mine = [(t, p) for t, p in zip(log, off_loop, strict=True) if t in set(tokens)]
    assert [t for t, _ in mine] == tokens, "calls of one stream ran out of order"
    assert all(p for _, p in mine), "a plain function ran on the event loop"


async def test_async_def_in_a_burst_keeps_order_and_runs_on_the_loop(
        ctl: cb.Controller) -> None:
    dev = cb.devices()[2]
    rec, rec_async = _on(dev, record, record_async)
    tokens = [t for t in itertools.islice(_ids, 70) if t % 7][:60]  # no failures here
    futs = in_async(lambda: [(rec_async if i % 10 == 5 else rec)(t)
                             for i, t in enumerate(tokens)])
    await asyncio.gather(*futs)
    log, off_loop = await _host_log(dev)
    mine = {t: p for t, p in zip(log, off_loop, strict=True) if t in set(tokens)}
    assert [t for t in log if t in mine] == tokens
    for i, t in enumerate(tokens):
        assert mine[t] is (i % 10 != 5), (i, t)  # async def on the loop, plain off it


async def test_cancel_a_call_inside_a_running_batch(ctl: cb.Controller) -> None:
    dev = cb.devices()[3]
    wait_gate, mark, events = _on(dev, hs.wait_gate, hs.mark, hs.events)
    g1, g2 = next(_ids), next(_ids)
    skipped, after = next(_ids), next(_ids)
    with calls_return_futures() as on_loop:  # (one task: one stream)
        a = on_loop(lambda: wait_gate(g1))
        await _until_started(dev, g1)
        # Queued behind a: they become one batch when a finishes.
        b, c, d = on_loop(lambda: (wait_gate(g2), mark(skipped), mark(after)))
    await asyncio.sleep(0.05)  # let them reach the host's queue
    hs.open_gate(g1)
    await a
    await _until_started(dev, g2)  # b runs: c and d wait in the same pool job
    assert c.cancel()
    with pytest.raises(asyncio.CancelledError):
        await c
    assert not d.done()
    # The host reads its messages in order: once a later call (its own task, so its
    # own stream) has answered, the CANCEL was handled there. Opening the gate
    # before that let c run on a loaded machine, where the CANCEL was still on its way.
    await in_async(events)
    hs.open_gate(g2)
    await b
    assert int(np.asarray(cb.device_get(await d))) == after
    arr = await in_async(events)
    log = [int(x) for x in np.asarray(cb.device_get(arr))]
    assert skipped not in log, "a call cancelled inside a batch ran"
    assert log.index(-g2) < log.index(after)


async def test_futures_chain_in_a_burst(ctl: cb.Controller) -> None:
    dev = cb.devices()[5]
    (inc,) = _on(dev, add_one)
    x = cb.device_put(np.zeros(3, np.float32), dev)
    y: Any = x
    side = []
    for _i in range(40):
        y = inc(y)  # each waits for the previous call's result on the host
        side.append(inc(x))  # ready at once: batched around the chain
    assert np.asarray(cb.device_get(await y)).tolist() == [40.0] * 3
    for s in await asyncio.gather(*side):
        assert np.asarray(cb.device_get(s)).tolist() == [1.0] * 3


async def test_other_streams_run_while_one_is_gated(ctl: cb.Controller) -> None:
    dev = cb.devices()[6]
    wait_gate, mark = _on(dev, hs.wait_gate, hs.mark)
    gate, token = next(_ids), next(_ids)
    a = in_async(lambda: wait_gate(gate))  # (its Future: done() is read below)
    await _until_started(dev, gate)
    out = await asyncio.create_task(_call(mark, token))  # another stream
    assert int(np.asarray(cb.device_get(out))) == token
    assert not a.done()
    hs.open_gate(gate)
    await a
