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
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import colobus as cb

_GATE = threading.Event()  # on each host: set by ``open_gate``
_WAITING = threading.Event()  # on each host: ``wait_gate`` waits for the gate


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
def sleep_then_where(x: Any, seconds: float) -> Any:
    time.sleep(seconds)
    return np.array([threading.current_thread().name])


@cb.colocated_python
def wait_gate(x: Any) -> Any:
    """Blocks until ``open_gate`` runs on this host (another call, another stream)."""
    name = threading.current_thread().name
    _WAITING.set()
    ok = _GATE.wait(60)
    _GATE.clear()
    _WAITING.clear()
    return np.array([name, str(ok)])


@cb.colocated_python
def is_waiting(x: Any) -> Any:
    return np.bool_(_WAITING.is_set())


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


async def test_an_inline_call_that_blocks_never_blocks_heartbeats() -> None:
    hb, live = 0.2, 1.5
    async with cb.local_cluster(hosts=1, devices_per_host=1, heartbeat_interval=hb,
                                liveness_timeout=live) as ctl:
        x = cb.device_put(np.ones(2, np.float32), ctl.devices()[0])
        await _warm(x)
        slow = sleep_then_where(x, 2 * live)  # twice the liveness timeout, inline
        # Meanwhile another caller's calls run (the loop went on without that thread).
        others = await asyncio.create_task(_warm(x))
        assert not slow.done()
        assert len(others) == 20
        (name,) = await _names(await slow)
        assert name.startswith("colobus-loop-"), name
        assert ctl.hosts()[0].state == "alive"
        stats = ctl.stats()
        assert stats["hosts"][0]["state"] == "alive", stats


async def test_inline_calls_that_wait_for_each_other_complete() -> None:
    async with cb.local_cluster(hosts=1, devices_per_host=1) as ctl:
        x = cb.device_put(np.ones(2, np.float32), ctl.devices()[0])
        ran_on = []
        for _ in range(10):
            await _warm(x)
            waiting = wait_gate(x)  # blocks its thread until another call opens the gate
            while not bool(np.asarray(await cb.device_get(
                    await asyncio.create_task(_call(is_waiting, x))))):
                await asyncio.sleep(0.01)
            # Its own task, so its own stream: it is not queued behind the waiting call.
            opened = await _names(await asyncio.create_task(_call(open_gate, x)))
            name, ok = await _names(await waiting)
            assert ok == "True"
            assert opened[0].startswith(("colobus-loop-", "colobus-call")), opened
            ran_on.append(name)
            if name.startswith("colobus-loop-"):
                break  # it ran inline, and the call it waited for still ran
        # Two calls that arrive in one read both go to the pool: retried until inline.
        assert any(n.startswith("colobus-loop-") for n in ran_on), ran_on


async def _call(fn: Any, *args: Any) -> Any:
    return await fn(*args)
