"""``cb.gather``: asyncio.gather's results, errors and cancellation, one wake-up in all.

The shared cluster's loop runs on a thread of its own, so these futures settle on
another thread than the one awaiting them (calls made here, off that thread, return
their arrays, which ``cb.gather`` awaits too; the Futures of the tests about Futures are
made as async code under ``async with`` makes them, on the controller's loop thread:
``lifecycle.in_async``); the last test runs the controller in the test's own loop, where
they settle on the awaiting thread.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import sec_hostside as hs
from lifecycle import in_async

import colobus as cb

_ids = itertools.count(30_000)


@pytest.fixture(autouse=True, scope="module")
def _gates() -> Iterator[None]:
    yield
    hs.remove_gates()


@cb.colocated_python
def g_add(x: Any) -> Any:
    return x + 1


@cb.colocated_python
def g_fail(x: Any) -> Any:
    raise KeyError("g_fail fails on purpose")


def _other_host() -> cb.Device:
    """A device of host 1; ``_vec`` puts on host 0, so gated calls hold nothing of those."""
    return next(d for d in cb.devices() if d.host == 1)


def _vec(i: int) -> cb.Array:
    return cb.device_put(np.array([i], np.int32), cb.devices()[0])


def _value(a: Any) -> int:
    return int(np.asarray(cb.device_get(a))[0])


async def test_results_come_in_the_order_given(ctl: cb.Controller) -> None:
    xs = [_vec(i) for i in range(40)]
    outs = await cb.gather(*(g_add(x) for x in xs))
    assert [_value(o) for o in outs] == list(range(1, 41))
    assert await cb.gather() == []


async def test_the_first_error_propagates_and_the_rest_still_run(ctl: cb.Controller) -> None:
    x = _vec(1)
    futs = in_async(lambda: [g_add(x), g_fail(x), g_add(x)])
    with pytest.raises(KeyError, match="on purpose"):
        await cb.gather(*futs)
    assert _value(await futs[2]) == 2 and not futs[2].cancelled()


async def test_return_exceptions_puts_each_in_its_place(ctl: cb.Controller) -> None:
    wait_gate = hs.wait_gate.specialize(devices=[_other_host()])
    x, gate = _vec(5), next(_ids)
    gated = in_async(lambda: wait_gate(gate))
    gated.cancel()
    outs = await cb.gather(*in_async(lambda: (g_add(x), g_fail(x))), gated,
                           return_exceptions=True)
    assert _value(outs[0]) == 6
    assert isinstance(outs[1], KeyError) and isinstance(outs[2], asyncio.CancelledError)
    hs.open_gate(gate)  # in case it had started


async def test_a_cancelled_call_ends_the_gather_as_cancelled(ctl: cb.Controller) -> None:
    wait_gate = hs.wait_gate.specialize(devices=[_other_host()])
    gate, x = next(_ids), _vec(0)
    gated, other = in_async(lambda: (wait_gate(gate), g_add(x)))
    gathering = asyncio.ensure_future(cb.gather(gated, other))
    await asyncio.sleep(0.05)
    gated.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gathering
    assert _value(await other) == 1  # a call's cancellation is not the gather's
    hs.open_gate(gate)


async def test_cancelling_the_gather_cancels_its_calls(ctl: cb.Controller) -> None:
    wait_gate = hs.wait_gate.specialize(devices=[_other_host()])
    mark = hs.mark.specialize(devices=[_other_host()])
    gate, queued = next(_ids), next(_ids)
    gated, behind = in_async(lambda: (
        wait_gate(gate),
        mark(queued)))  # same task: queued on the host behind the gated call
    task = asyncio.ensure_future(cb.gather(gated, behind))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gated.cancelled() and behind.cancelled()
    events = hs.events.specialize(devices=[_other_host()])
    # The host reads its messages in order: once a later call (its own stream) has
    # answered, the CANCELs were handled there. Opening the gate sooner let the queued
    # call run on a loaded machine, where its CANCEL was still on its way. (Its Futures,
    # each its own task: the log grows, which arrays of learned specs would refuse.)
    await in_async(events)
    hs.open_gate(gate)
    ran = [int(v) for v in np.asarray(cb.device_get(await in_async(events)))]
    assert queued not in ran  # cancelled before it started: it never ran


async def test_other_awaitables_go_to_asyncio_gather(ctl: cb.Controller) -> None:
    async def seven() -> int:
        return 7

    out = await cb.gather(g_add(_vec(2)), seven())
    assert _value(out[0]) == 3 and out[1] == 7


async def test_futures_settling_on_the_awaiting_thread() -> None:
    async with cb.local_cluster(hosts=1, devices_per_host=1) as local:
        x = cb.device_put(np.array([3], np.int32), local.devices()[0])
        outs = await cb.gather(*(g_add(x) for _ in range(300)))
        assert {int(np.asarray(await cb.device_get(o))[0]) for o in outs} == {4}
        with pytest.raises(KeyError):
            await cb.gather(g_add(x), g_fail(x))
