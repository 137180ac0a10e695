"""How a task awaiting a colobus Future wakes (``colobus._controller.wakeups``).

On a real loop with real threads; the drain hooks are called as the controller's
channel calls them. End to end, awaiting calls is covered everywhere else (and
cancellation by test_cancel, other loops by test_loops).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from colobus._controller import wakeups
from colobus._controller.future import Future

WAIT_S = 30.0


async def test_a_future_settled_in_a_drain_wakes_its_task_before_the_drain_sends() -> None:
    fut: Future[int] = Future()
    after: list[int] = []
    seen: list[list[int]] = []

    async def waits() -> None:
        after.append(await fut)

    def drain() -> None:  # a loop callback, as the channel's drain is
        wakeups.drain_starts()
        try:
            fut.set_result(7)  # as a RESULT read by the drain settles it
            seen.append(list(after))  # held while the drain reads
            wakeups.drain_reads_done()
            seen.append(list(after))  # the task ran its next step here, in the same turn
        finally:
            wakeups.drain_ends()

    task = asyncio.create_task(waits())
    await asyncio.sleep(0)  # the task now waits on the future
    asyncio.get_running_loop().call_soon(drain)
    await asyncio.wait_for(task, WAIT_S)
    assert seen == [[], [7]]


async def test_a_future_settled_outside_a_drain_wakes_its_task_soon() -> None:
    fut: Future[str] = Future()
    task = asyncio.ensure_future(_await(fut))
    await asyncio.sleep(0)
    fut.set_result("x")
    assert not task.done()  # as an asyncio.Future: the wake-up is scheduled
    assert await asyncio.wait_for(task, WAIT_S) == "x"


async def test_a_future_settled_on_another_thread_wakes_its_task() -> None:
    fut: Future[str] = Future()
    task = asyncio.ensure_future(_await(fut))
    await asyncio.sleep(0)
    t = threading.Thread(target=fut.set_result, args=("from a thread",))
    t.start()
    assert await asyncio.wait_for(task, WAIT_S) == "from a thread"
    t.join()


async def test_exceptions_reach_the_awaiting_task() -> None:
    fut: Future[None] = Future()
    task = asyncio.ensure_future(_await(fut))
    await asyncio.sleep(0)
    fut.set_exception(KeyError("gone"))
    with pytest.raises(KeyError, match="gone"):
        await asyncio.wait_for(task, WAIT_S)


async def test_cancelling_the_task_cancels_the_operation() -> None:
    fut: Future[None] = Future()
    task = asyncio.ensure_future(_await(fut))
    await asyncio.sleep(0)
    task.cancel("stop")
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    assert fut.cancelled()


async def test_a_task_cancelled_after_its_future_settled_is_still_cancelled() -> None:
    fut: Future[int] = Future()
    task = asyncio.ensure_future(_await(fut))
    await asyncio.sleep(0)
    fut.set_result(1)  # its wake-up is scheduled, not run
    task.cancel()  # as with an asyncio.Future: the task still ends cancelled
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not fut.cancelled()


async def test_wakeups_held_by_a_drain_inside_a_task_are_scheduled() -> None:
    fut: Future[int] = Future()
    other = asyncio.ensure_future(_await(fut))
    await asyncio.sleep(0)
    wakeups.drain_starts()  # a drain run from inside this task (no task may enter another)
    try:
        fut.set_result(3)
        wakeups.drain_reads_done()
        assert not other.done()
    finally:
        wakeups.drain_ends()
    assert await asyncio.wait_for(other, WAIT_S) == 3


async def test_wait_for_and_gather_take_it() -> None:
    a: Future[int] = Future()
    b: Future[int] = Future()
    later = asyncio.get_running_loop().call_later
    later(0, a.set_result, 1)
    later(0, b.set_result, 2)
    assert await asyncio.wait_for(asyncio.gather(a, b), WAIT_S) == [1, 2]
    c: Future[int] = Future()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(c, 0.01)
    assert c.cancelled()  # wait_for cancels what it waited for


async def _await(fut: Future[object]) -> object:
    return await fut


async def test_a_drain_wakes_at_most_a_chunk_per_turn_and_every_task_runs() -> None:
    """One drain settling many futures runs WAKE_CHUNK of their tasks in its turn and
    the rest that many per later turn (CPython's Semaphore scans, per release, the
    waiters woken in the same turn): each task runs once, in the order settled."""
    n = wakeups.WAKE_CHUNK * 3 + 5
    futs: list[Future[int]] = [Future() for _ in range(n)]
    ran: list[int] = []
    turns: list[int] = []

    async def waits(i: int) -> None:
        ran.append(await futs[i])

    def drain() -> None:
        wakeups.drain_starts()
        try:
            for i, f in enumerate(futs):
                f.set_result(i)
            wakeups.drain_reads_done()
            turns.append(len(ran))  # what ran in the drain's own turn
        finally:
            wakeups.drain_ends()

    tasks = [asyncio.create_task(waits(i)) for i in range(n)]
    await asyncio.sleep(0)
    asyncio.get_running_loop().call_soon(drain)
    await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
    assert turns == [wakeups.WAKE_CHUNK]
    assert ran == list(range(n))


async def test_tasks_under_a_semaphore_all_finish_through_a_real_cluster() -> None:
    """The pattern users write for bounded concurrency, with more tasks than a drain
    wakes in one turn: every call returns its own value."""
    import numpy as np

    import colobus as cb

    @cb.colocated_python
    def ident(x: cb.Array) -> cb.Array:
        return x

    async with cb.local_cluster(hosts=1) as ctl:
        dev = ctl.devices()[0]
        xs = [cb.device_put(np.full(2, i, np.int32), dev) for i in range(300)]
        sem = asyncio.Semaphore(200)

        async def one(x: cb.Array) -> int:
            async with sem:
                out = await ident(x)
            return int(np.asarray(await cb.device_get(out))[0])

        got = await asyncio.wait_for(asyncio.gather(*[one(x) for x in xs]), 120)
    assert got == list(range(300))
