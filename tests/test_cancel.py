"""Timeouts and cancellation (SPEC section 4), proved with host-side state.

Each test gates a call on a host (``wait_gate`` blocks a worker thread until
``open_gate``), queues more calls behind it in the same stream, cancels some,
then reads the host's event log back to see what ran there and in what order.

The shared cluster runs on a loop thread of its own; the tests' calls whose Futures they
cancel are made as async code under ``async with`` makes them, on that thread, in one
task (``calls_return_futures``: one stream), and awaited here, on pytest's loop. Calls
made here, off the controller's loop thread, return their arrays (SPEC 4).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import sec_hostside as hs
from lifecycle import calls_return_futures, in_async

import colobus as cb

_ids = itertools.count(10_000)


@pytest.fixture(autouse=True, scope="module")
def _gates() -> Iterator[None]:
    yield
    hs.remove_gates()


def _on(dev: cb.Device) -> tuple[Any, Any, Any]:
    """The host-side helpers, specialized to one device (host of ``dev``)."""
    return (hs.wait_gate.specialize(devices=[dev]), hs.mark.specialize(devices=[dev]),
            hs.events.specialize(devices=[dev]))


async def _events(events: object) -> list[int]:
    # Its own task, hence its own stream: it does not queue behind gated calls. Its
    # Future: the log grows, and arrays made from the specs of an earlier call with the
    # same inputs would refuse a longer one (as JAX's).
    arr = await in_async(events)
    return [int(x) for x in np.asarray(cb.device_get(arr))]


async def _call(fn: object, *args: object) -> object:
    return await fn(*args)  # type: ignore[operator]


async def _until_started(events: object, gate: int) -> None:
    for _ in range(600):
        if gate + 1_000_000 in await _events(events):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("gated call never started")


async def test_cancel_before_start_never_runs_and_order_holds(ctl: cb.Controller) -> None:
    wait_gate, mark, events = _on(cb.devices()[0])
    gate, skipped, after = next(_ids), next(_ids), next(_ids)
    a, b, c = in_async(lambda: (
        wait_gate(gate),
        mark(skipped),         # same task: queued on the host behind a
        mark(after)))          # and c behind b
    await _until_started(events, gate)
    assert b.cancel()
    assert b.cancelled() and b.done()
    assert not b.cancel()      # only once
    with pytest.raises(asyncio.CancelledError):
        await b
    with pytest.raises(asyncio.CancelledError):
        b.exception()
    assert not c.done()
    # The host reads its messages in order: once a later call (its own stream) has
    # answered, the CANCEL was handled there; opening the gate sooner let the cancelled
    # call run on a loaded machine, where the CANCEL was still on its way.
    await _events(events)
    hs.open_gate(gate)
    await a
    assert int(np.asarray(cb.device_get(await c))) == after
    log = await _events(events)
    assert skipped not in log, "a call cancelled before it started ran on its host"
    # c ran only after a finished: cancelling b did not let c jump the queue.
    assert log.index(-gate) < log.index(after)


async def test_cancel_running_call_finishes_result_dropped(ctl: cb.Controller) -> None:
    wait_gate, mark, events = _on(cb.devices()[1])
    gate, after = next(_ids), next(_ids)
    with calls_return_futures() as on_loop:  # (one task: one stream)
        a = on_loop(lambda: wait_gate(gate))
        await _until_started(events, gate)
        assert a.cancel()
        with pytest.raises(asyncio.CancelledError):
            await a
        hs.open_gate(gate)
        # The host finished the running call; the next call in the stream runs after it.
        after_fut = on_loop(lambda: mark(after))
        assert int(np.asarray(cb.device_get(await after_fut))) == after
    log = await _events(events)
    assert log.index(-gate) < log.index(after)
    assert a.cancelled()
    assert a.call_id not in ctl._ops.pending


async def test_cancelling_awaiting_task_cancels_call(ctl: cb.Controller) -> None:
    wait_gate, mark, events = _on(cb.devices()[4])
    gate, skipped, after = next(_ids), next(_ids), next(_ids)
    calls: list[cb.Future] = []

    with calls_return_futures() as on_loop:  # (one task: one stream)
        async def worker_task() -> object:
            calls.append(on_loop(lambda: wait_gate(gate)))
            calls.append(on_loop(lambda: mark(skipped)))
            return await calls[1]  # (a Future awaited from another loop than its own)

        task = asyncio.create_task(worker_task())
        await _until_started(events, gate)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert calls[1].cancelled()
        assert not calls[0].done()
        # The host reads its messages in order: once a later call (its own stream) has
        # answered, the CANCEL was handled there; opening the gate sooner let the
        # cancelled call run on a loaded machine, where the CANCEL was still on its way.
        await _events(events)
        hs.open_gate(gate)
        await calls[0]
        await on_loop(lambda: mark(after))
    log = await _events(events)
    assert skipped not in log
    assert after in log


async def test_wait_for_timeout_cancels_call(ctl: cb.Controller) -> None:
    wait_gate, mark, events = _on(cb.devices()[5])
    gate, skipped = next(_ids), next(_ids)
    a, b = in_async(lambda: (wait_gate(gate), mark(skipped)))
    await _until_started(events, gate)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(_call(lambda: b), 0.05)
    assert b.cancelled()
    # The host reads its messages in order: once a later call (its own stream) has
    # answered, the CANCEL was handled there; opening the gate sooner let the cancelled
    # call run on a loaded machine, where the CANCEL was still on its way.
    await _events(events)
    hs.open_gate(gate)
    await a
    assert skipped not in await _events(events)


def test_result_timeout_raises_timeouterror_and_call_survives(ctl: cb.Controller) -> None:
    dev = cb.devices()[2]
    wait_gate, _, _ = _on(dev)
    gate = next(_ids)
    a = in_async(lambda: wait_gate(gate))
    with pytest.raises(TimeoutError):
        a.result(timeout=0.05)
    with pytest.raises(TimeoutError):
        a.exception(timeout=0.01)
    assert not a.done()
    # A timeout is not a cancellation: the call completes once the gate opens.
    hs.open_gate(gate)
    out = a.result(timeout=30)
    assert int(np.asarray(out)) == gate


def test_result_on_loop_thread_says_await(ctl: cb.Controller) -> None:
    wait_gate, _, _ = _on(cb.devices()[3])
    gate = next(_ids)
    fut = in_async(lambda: wait_gate(gate))

    async def on_loop() -> str:
        try:
            fut.result(timeout=5)
        except RuntimeError as exc:
            return str(exc)
        return "no error"

    text = ctl.run_sync(on_loop(), timeout=30)
    assert "await" in text
    hs.open_gate(gate)
    fut.result(timeout=30)
