"""The host's shared run queue (``colobus._host.runners``) on real threads and a real loop.

End to end, the streams' calls are covered by test_functions (calls of three
streams that meet at a barrier), test_streams and test_cancel; here the queue's
own promises: quick runs of many streams share a thread, a run blocked on a later
one gets a runner of its own, and a session's end stops its runners.
"""

from __future__ import annotations

import asyncio
import threading

from colobus._host.pool import CallPool
from colobus._host.runners import Runners

WAIT_S = 30.0  # generous: every wait below ends on an event


async def test_quick_runs_of_many_streams_share_a_thread() -> None:
    pool = CallPool(256, "test-runners")
    runners = Runners(pool)
    loop = asyncio.get_running_loop()
    ran: list[int] = []
    done = asyncio.Event()
    n = 400

    def one() -> None:
        ran.append(threading.get_ident())
        if len(ran) == n:
            loop.call_soon_threadsafe(done.set)

    for _ in range(n):  # one loop callback: as a drain queues many streams' runs
        runners.add(one, loop)
    await asyncio.wait_for(done.wait(), WAIT_S)
    # A pool job per run would have started a thread per run here (none was idle).
    assert len(set(ran)) <= n // 8, f"{len(set(ran))} threads for {n} quick runs"
    pool.shutdown()


async def test_a_run_blocked_on_a_later_one_gets_help() -> None:
    pool = CallPool(8, "test-runners")
    runners = Runners(pool)
    loop = asyncio.get_running_loop()
    later_ran = threading.Event()
    finished = asyncio.Event()

    def first() -> None:  # waits for the run queued after it (another stream's call)
        assert later_ran.wait(WAIT_S), "the later run never ran: no runner came to help"
        loop.call_soon_threadsafe(finished.set)

    runners.add(first, loop)
    runners.add(later_ran.set, loop)
    await asyncio.wait_for(finished.wait(), WAIT_S)
    pool.shutdown()


async def test_a_new_session_does_not_wait_behind_the_old_ones_runs() -> None:
    pool = CallPool(8, "test-runners")
    runners = Runners(pool)
    loop = asyncio.get_running_loop()
    release = threading.Event()
    started = threading.Event()
    stale_ran = threading.Event()
    fresh = asyncio.Event()

    def stuck() -> None:
        started.set()
        release.wait(WAIT_S)

    runners.add(stuck, loop)
    assert await asyncio.to_thread(started.wait, WAIT_S)
    runners.add(stale_ran.set, loop)  # waits behind the stuck run...
    runners.clear()  # ...and the session ends: it never runs
    runners.add(lambda: loop.call_soon_threadsafe(fresh.set), loop)
    await asyncio.wait_for(fresh.wait(), WAIT_S)  # a runner of its own, at once
    release.set()
    assert not stale_ran.is_set()
    pool.shutdown()


async def test_many_runs_that_wait_for_each_other_all_get_threads() -> None:
    n = 50
    pool = CallPool(n, "test-runners")
    runners = Runners(pool)
    loop = asyncio.get_running_loop()
    barrier = threading.Barrier(n, timeout=WAIT_S)  # each run waits until all n run at once
    done: list[int] = []
    all_done = asyncio.Event()

    def one() -> None:
        barrier.wait()
        done.append(1)
        if len(done) == n:
            loop.call_soon_threadsafe(all_done.set)

    for _ in range(n):
        runners.add(one, loop)
    await asyncio.wait_for(all_done.wait(), WAIT_S)
    pool.shutdown()
