"""Correctness at the API's edges (issue 23), on the real stack.

Each test names the finding it proves. Every wait is bounded (a hang fails the
test); none relies on a fixed sleep as proof.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import edges_hostside as hs
import numpy as np
from lifecycle import bounded, outcome

import colobus as cb


class Boom(BaseException):
    """What a careless done-callback raises: not an ``Exception``."""


def _boom(_: cb.Future[Any]) -> None:
    raise Boom()


def _touch(path: str) -> None:
    with open(path, "w"):
        pass


# -- 1: done-callbacks that raise BaseException are contained ------------------------------


def test_1_cancel_from_a_thread_contains_a_raising_callback(ctl: cb.Controller,
                                                            tmp_path: Path) -> None:
    """``fut.cancel()`` on a user thread does not raise a callback's ``CancelledError``;
    later callbacks still run, and another thread awaiting the future settles."""
    gate = str(tmp_path / "gate")
    fut = hs.block.specialize(devices=[ctl.devices()[0]])(gate)
    ran: list[int] = []
    fut.add_done_callback(lambda f: f.result())  # raises CancelledError on a cancelled future
    fut.add_done_callback(lambda f: ran.append(1))
    seen: list[BaseException] = []

    async def wait() -> None:
        try:
            await fut
        except BaseException as exc:
            seen.append(exc)

    t = threading.Thread(target=lambda: asyncio.run(wait()))
    t.start()
    try:
        deadline = time.monotonic() + 20
        while len(fut._callbacks or ()) < 3:  # the awaiting thread's waker is registered
            assert time.monotonic() < deadline, "the awaiting thread never registered"
            time.sleep(0.01)
        assert fut.cancel() is True
        assert ran == [1]
        t.join(20)
        assert not t.is_alive(), "another awaiter of the cancelled future hangs"
        assert len(seen) == 1 and isinstance(seen[0], asyncio.CancelledError), seen
    finally:
        _touch(gate)


def test_1_raising_callback_never_loses_the_rest_of_a_batch(ctl: cb.Controller,
                                                             tmp_path: Path) -> None:
    """A callback raising ``BaseException`` on the loop thread (inside the dispatch of a
    BATCH of replies) does not lose the other replies of that batch: every future settles."""
    dev = ctl.devices()[0]
    gate = str(tmp_path / "gate")
    first = hs.block.specialize(devices=[dev])(gate)
    tok = hs.token.specialize(devices=[dev])
    futs = [tok(i) for i in range(60)]  # queued behind the gate: they end back to back
    for f in futs:
        f.add_done_callback(_boom)
    _touch(gate)
    first.result(timeout=30)
    for i, f in enumerate(futs):
        out = f.result(timeout=30)  # TimeoutError: its reply was lost with the batch
        assert int(np.asarray(cb.device_get(out).result(timeout=30))) == i


async def test_1_raising_callback_never_kills_the_liveness_tick(tmp_path: Path) -> None:
    """A callback raising ``BaseException`` when the liveness tick fails a lost host's call
    does not end the liveness task: the healthy host stays, and its calls still work."""
    live = 1.5
    async with cb.local_cluster(hosts=2, heartbeat_interval=0.2, liveness_timeout=live) as ctl:
        gate = str(tmp_path / "gate")
        pid = ctl.hosts()[1].pid
        fut = hs.block.specialize(devices=[ctl.devices()[1]])(gate)
        fut.add_done_callback(_boom)
        os.kill(pid, signal.SIGSTOP)  # silent, connection open: the tick declares it lost
        try:
            err = await outcome(fut, 30, "the stopped host's call")
            assert isinstance(err, cb.HostLostError), repr(err)
            deadline = time.monotonic() + 3 * live
            while time.monotonic() < deadline:  # time for a dead tick to cost host 0
                assert ctl.hosts()[0].state == "alive"
                await asyncio.sleep(0.1)
            assert not ctl._tasks[0].done(), "the liveness task ended"
            out = await bounded(hs.token.specialize(devices=[ctl.devices()[0]])(5))
            assert int(np.asarray(await bounded(cb.device_get(out)))) == 5
            assert ctl.hosts()[0].state == "alive"
        finally:
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)
            _touch(gate)


async def test_1_a_dead_background_task_closes_the_controller_saying_why(
        tmp_path: Path) -> None:
    """The controller's liveness loop dying unexpectedly is logged and closes the
    controller: pending calls fail with ``ControllerClosedError`` that says why."""
    async with cb.local_cluster(hosts=1, heartbeat_interval=0.2) as ctl:
        gate = str(tmp_path / "gate")
        fut = hs.block.specialize(devices=[ctl.devices()[0]])(gate)
        try:
            ctl.heartbeat_interval = "not a number"  # type: ignore[assignment]
            err = await outcome(fut, 30, "a call of a controller whose liveness loop died")
            assert isinstance(err, cb.ControllerClosedError), repr(err)
            assert "liveness loop died" in str(err), str(err)
        finally:
            _touch(gate)
