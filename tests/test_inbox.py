"""Work handed to a loop from other threads (colobus/_controller/inbox.py): a burst of posts
wakes the loop once, runs in order, and a closed loop refuses like call_soon_threadsafe."""

from __future__ import annotations

import asyncio
import collections.abc
import threading
from typing import Any

import numpy as np
import pytest

import colobus as cb
from colobus._controller.inbox import Inbox, inbox_of


class LoopThread:
    """An event loop running on a thread of its own; ``hold()`` blocks it until released."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.wakes = 0  # call_soon_threadsafe calls made on this loop
        real = self.loop.call_soon_threadsafe

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.wakes += 1
            return real(*args, **kwargs)

        self.loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def hold(self) -> threading.Event:
        held, release = threading.Event(), threading.Event()

        def block() -> None:
            held.set()
            release.wait(30)

        self.loop.call_soon_threadsafe(block)
        assert held.wait(30)
        self.wakes = 0
        return release

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture
def lt() -> collections.abc.Iterator[LoopThread]:
    t = LoopThread()
    yield t
    if not t.loop.is_closed():
        t.stop()


def test_a_burst_wakes_the_loop_once_and_runs_in_order(lt: LoopThread) -> None:
    inbox = Inbox(lt.loop)
    seen: list[int] = []
    done = threading.Event()
    release = lt.hold()
    for i in range(100):
        inbox.post(seen.append, i)
    inbox.post(done.set)
    release.set()
    assert done.wait(30)
    assert seen == list(range(100))
    assert lt.wakes == 1


def test_a_post_made_while_the_loop_drains_waits_for_the_next_drain(lt: LoopThread) -> None:
    """A thread posting without pause gets one wake per drain: the loop returns to its
    sockets between drains instead of running the new items in the same callback."""
    inbox = Inbox(lt.loop)
    order: list[str] = []
    done = threading.Event()

    def first() -> None:
        order.append("first")
        lt.loop.call_soon(order.append, "loop's own callback")
        # posted after it: run in this drain, it would come first
        inbox.post(order.append, "posted while draining")
        inbox.post(done.set)

    release = lt.hold()
    inbox.post(first)
    release.set()
    assert done.wait(30)
    assert order == ["first", "loop's own callback", "posted while draining"]


def test_an_item_that_raises_is_reported_and_the_rest_still_run(lt: LoopThread) -> None:
    inbox = Inbox(lt.loop)
    reported: list[BaseException] = []
    lt.loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx["exception"]))
    done = threading.Event()

    def boom() -> None:
        raise ValueError("boom")

    release = lt.hold()
    inbox.post(boom)
    inbox.post(done.set)
    release.set()
    assert done.wait(30)
    assert [str(e) for e in reported] == ["boom"]


def test_a_closed_loop_refuses_the_post(lt: LoopThread) -> None:
    inbox = Inbox(lt.loop)
    lt.stop()
    with pytest.raises(RuntimeError):
        inbox.post(print, "never")
    with pytest.raises(RuntimeError):  # and again: nothing was left half-posted
        inbox.post(print, "never")


def test_a_loop_closed_while_a_drain_was_on_its_way_refuses_the_next_post(
        lt: LoopThread) -> None:
    inbox = Inbox(lt.loop)
    release = lt.hold()
    inbox.post(lambda: None)  # its drain is posted, not yet run
    release.set()
    lt.loop.call_soon_threadsafe(lt.loop.stop)
    lt.thread.join(30)
    lt.loop.close()
    inbox._posted = True  # as if the drain had been posted and the loop closed first
    with pytest.raises(RuntimeError):
        inbox.post(print, "never")


def test_call_runs_at_once_on_the_loop_posts_from_elsewhere_drops_once_closed() -> None:
    seen: list[str] = []

    async def on_loop() -> Inbox:
        inbox = inbox_of(asyncio.get_running_loop())
        inbox.call(seen.append, "at once")
        assert seen == ["at once"]  # not deferred to a later callback
        t = threading.Thread(target=inbox.call, args=(seen.append, "posted"))
        t.start()
        t.join(30)
        assert seen == ["at once"]  # waits for the loop
        while len(seen) < 2:
            await asyncio.sleep(0.01)
        return inbox

    inbox = asyncio.run(on_loop())
    assert seen == ["at once", "posted"]
    t = threading.Thread(target=inbox.call, args=(seen.append, "never"))
    t.start()  # from another thread, to a closed loop: dropped, no error
    t.join(30)
    assert seen == ["at once", "posted"]


def test_inbox_of_is_one_per_thread_and_loop() -> None:
    async def mine() -> Inbox:
        return inbox_of(asyncio.get_running_loop())

    loop = asyncio.new_event_loop()
    try:
        a, b = loop.run_until_complete(mine()), loop.run_until_complete(mine())
    finally:
        loop.close()
    assert a is b
    assert asyncio.run(mine()) is not a


@cb.colocated_python
def _ident(x: Any) -> Any:
    return x


def test_many_tasks_awaiting_calls_from_another_loop_all_get_their_own_results() -> None:
    """The sync face's controller settles on its loop thread; the tasks await on this
    thread's loop, woken per burst through its inbox, each with its own call's value."""
    with cb.local_cluster(hosts=2, devices_per_host=1) as ctl:
        xs = [cb.device_put(np.full(3, i), ctl.devices()[i % 2]) for i in range(40)]

        async def main() -> list[Any]:
            sem = asyncio.Semaphore(8)

            async def one(x: Any) -> Any:
                async with sem:
                    return cb.device_get(await _ident(x))  # not the controller's loop: a value

            return await asyncio.gather(*[asyncio.create_task(one(x)) for x in xs])

        out = asyncio.run(main())
    for i, v in enumerate(out):
        np.testing.assert_array_equal(v, np.full(3, i))
