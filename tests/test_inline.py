"""Inline calls on the worker (issue 27): a lone quick plain call runs on the thread
that received it, and the loop passes to a follower when such a call blocks.

Each test proves inline execution happened (the call reports the thread it ran
on: a ``colobus-loop-N`` thread, not a ``colobus-call`` pool thread), then what
must hold with it: heartbeats flow past a call that blocks, calls that wait for
each other complete, and the loop is never running under a plain call.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import colobus as cb

_GATE = threading.Event()  # on each host: set by ``open_gate``
_WAITING: list[str] = []  # on each host: the thread of the ``wait_gate`` waiting now


@pytest.fixture(autouse=True)
def _inline_always(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every lone call inline, even after slow ones (a CPU hog beside the suite makes
    any call slow): the workers these tests start inherit it."""
    monkeypatch.setenv("COLOBUS_INLINE_CALLS", "always")
    yield


@cb.colocated_python
def where(x: Any) -> Any:
    """The thread this call ran on, and whether an event loop was running there."""
    running = asyncio._get_running_loop() is not None
    return np.array([threading.current_thread().name, str(running)])


@cb.colocated_python
def wait_gate(x: Any) -> Any:
    """Blocks until ``open_gate`` runs on this host (another call, another stream)."""
    name = threading.current_thread().name
    _WAITING.append(name)
    ok = _GATE.wait(60)
    _GATE.clear()
    _WAITING.clear()
    return np.array([name, str(ok)])


@cb.colocated_python
def waiting_on(x: Any) -> Any:
    """The thread ``wait_gate`` waits on (empty: none waits)."""
    return np.array(list(_WAITING[-1:]) or [""])


@cb.colocated_python
def open_gate(x: Any) -> Any:
    _GATE.set()
    return np.array([threading.current_thread().name])


async def _names(out: Any) -> list[str]:
    return [str(s) for s in np.asarray(await cb.device_get(out))]


async def _warm(x: Any) -> list[list[str]]:
    """Quick calls one after another: the host's last calls ran quick, so the next is inline."""
    return [await _names(await where(x)) for _ in range(20)]


async def test_a_lone_quick_call_runs_inline_outside_any_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLOBUS_INLINE_CALLS", "1")  # the default: inline while calls are quick
    async with cb.local_cluster(hosts=1, devices_per_host=1) as ctl:
        x = cb.device_put(np.ones(2, np.float32), ctl.devices()[0])
        seen = await _warm(x)
        assert any(name.startswith("colobus-loop-") for name, _ in seen), seen
        assert all(running == "False" for _, running in seen), seen  # no loop under it


async def _waiting_inline(x: Any) -> tuple[cb.Future[Any], str]:
    """Start ``wait_gate`` until it runs inline (a call that arrives in the same read as
    another goes to the pool: then it is let go and tried again); it and its thread."""
    for _ in range(10):
        await _warm(x)
        waiting = wait_gate(x)
        name = ""
        while not name:  # each probe from a task of its own: its own stream
            (name,) = await _names(await asyncio.create_task(_call(waiting_on, x)))
        if name.startswith("colobus-loop-"):
            return waiting, name
        await asyncio.create_task(_call(open_gate, x))
        await waiting
    raise AssertionError("wait_gate never ran inline")


async def test_an_inline_call_that_blocks_never_blocks_heartbeats() -> None:
    hb, live = 0.2, 1.5
    async with cb.local_cluster(hosts=1, devices_per_host=1, heartbeat_interval=hb,
                                liveness_timeout=live) as ctl:
        x = cb.device_put(np.ones(2, np.float32), ctl.devices()[0])
        waiting, name = await _waiting_inline(x)
        await asyncio.sleep(2 * live)  # twice the liveness timeout with that thread blocked
        assert ctl.hosts()[0].state == "alive"
        # Meanwhile another caller's calls run (the loop went on without that thread).
        others = await asyncio.create_task(_warm(x))
        assert len(others) == 20 and not waiting.done()
        await asyncio.create_task(_call(open_gate, x))
        got, ok = await _names(await waiting)
        assert (got, ok) == (name, "True")
        assert ctl.hosts()[0].state == "alive"


async def test_inline_calls_that_wait_for_each_other_complete() -> None:
    async with cb.local_cluster(hosts=1, devices_per_host=1) as ctl:
        x = cb.device_put(np.ones(2, np.float32), ctl.devices()[0])
        for _ in range(3):
            waiting, name = await _waiting_inline(x)  # blocks until another call opens it
            # Its own task, so its own stream: not queued behind the waiting call.
            opened = await _names(await asyncio.create_task(_call(open_gate, x)))
            assert opened[0].startswith(("colobus-loop-", "colobus-call")), opened
            assert await _names(await waiting) == [name, "True"]


async def _call(fn: Any, *args: Any) -> Any:
    return await fn(*args)


async def test_a_task_on_the_controllers_loop_waits_on_the_future_itself() -> None:
    """``await fut`` on the controller's loop yields the colobus future to the task (no
    waiter): results, cancelling the task, and ``asyncio.timeout`` behave as before."""
    async with cb.local_cluster(hosts=1, devices_per_host=1) as ctl:
        x = cb.device_put(np.ones(2, np.float32), ctl.devices()[0])
        fut = where(x)
        assert not asyncio.isfuture(fut)  # still no asyncio future to asyncio's helpers
        assert (await _names(await asyncio.create_task(_call(lambda: fut))))[1] == "False"
        assert not asyncio.isfuture(fut)

        blocked = wait_gate(x)
        task = asyncio.create_task(_call(lambda: blocked))
        await asyncio.sleep(0)  # the task waits on the future now
        task.cancel()
        try:
            await task
            raise AssertionError("the task was not cancelled")
        except asyncio.CancelledError:
            pass
        assert blocked.cancelled()  # cancelling the task cancelled the call

        timed = wait_gate(x)
        try:
            async with asyncio.timeout(0.05):
                await timed
            raise AssertionError("no timeout")
        except TimeoutError:
            pass
        assert timed.cancelled()
        for _ in range(2):  # let both calls go on the host (a gate opens for one)
            await asyncio.create_task(_call(open_gate, x))
        assert (await _names(await where(x)))[1] == "False"
