"""Back-pressure: a caller faster than its hosts waits instead of queueing without end.

Each test runs its own one-host cluster with tiny bounds (``max_inflight=2``,
``max_backlog=3``) and a gate on the host (``wait_gate``) that holds it busy
until the test opens it, so "the caller is blocked" is a fact to observe, not
a race against a clock.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import sec_hostside as hs

import colobus as cb

MAX_INFLIGHT = 2
MAX_BACKLOG = 3


@pytest.fixture(autouse=True, scope="module")
def _gates() -> Iterator[None]:
    yield
    hs.remove_gates()


@pytest.fixture
def small() -> Iterator[cb.Controller]:
    with cb.local_cluster(hosts=1, devices_per_host=1, max_inflight=MAX_INFLIGHT,
                          max_backlog=MAX_BACKLOG) as ctl:
        yield ctl


def _wait_until(pred: object, what: str) -> None:
    for _ in range(1500):
        if pred():  # type: ignore[operator]
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_sync_caller_blocks_at_the_bound_and_all_complete_in_order(
        small: cb.Controller) -> None:
    ctl = small
    dev = cb.devices()[0]
    wait_gate = hs.wait_gate.specialize(devices=[dev])
    slow_mark = hs.slow_mark.specialize(devices=[dev])
    events = hs.events.specialize(devices=[dev])
    gate, n = 77, 40
    tokens = list(range(5000, 5000 + n))
    gated: list[cb.Array] = []
    submitted: list[cb.Array] = []
    done = [0]
    peak = {"inflight": 0, "queued": 0, "outstanding": 0}
    lock = threading.Lock()

    def on_done(_: object) -> None:
        with lock:
            done[0] += 1

    def when_done(arr: cb.Array) -> None:
        call = arr._call  # the call behind a pending array (colobus._api.pending)
        if call is None:
            on_done(None)
        else:
            call.add_done_callback(on_done)

    def fire() -> None:
        # The gate holds this stream on the host: the marks queue behind it,
        # one in the host's second slot, the rest here.
        gated.append(wait_gate(gate))
        for tok in tokens:
            f = slow_mark(tok, 2)  # its array at once, as JAX's (or here, at the bound)
            when_done(f)
            submitted.append(f)
            with lock:
                peak["outstanding"] = max(peak["outstanding"], len(submitted) - done[0])
            peak["inflight"] = max(peak["inflight"], len(ctl._hosts[0].inflight))
            peak["queued"] = max(peak["queued"], ctl.stats()["queued"])

    firer = threading.Thread(target=fire)
    firer.start()
    # With the gate shut, the host holds the gated call and one mark, the backlog
    # MAX_BACKLOG marks: the firing thread stops after exactly 1 + MAX_BACKLOG marks.
    _wait_until(lambda: len(submitted) >= 1 + MAX_BACKLOG, "the backlog to fill")
    _wait_until(lambda: len(ctl._hosts[0].inflight) == MAX_INFLIGHT, "the host slots to fill")
    for _ in range(30):  # the caller stays blocked while the host is busy
        assert len(submitted) == 1 + MAX_BACKLOG
        assert firer.is_alive()
        assert len(ctl._hosts[0].inflight) <= MAX_INFLIGHT
        time.sleep(0.01)
    assert ctl.stats()["queued"] == MAX_BACKLOG
    assert ctl.stats()["backlog"] == MAX_BACKLOG

    hs.open_gate(gate)
    firer.join(120)
    assert not firer.is_alive()
    results = [int(np.asarray(f)) for f in submitted]
    assert results == tokens
    cb.block_until_ready(gated[0])
    assert peak["inflight"] <= MAX_INFLIGHT
    assert peak["queued"] <= MAX_BACKLOG
    assert peak["outstanding"] <= MAX_INFLIGHT + MAX_BACKLOG
    log = [int(x) for x in np.asarray(events())]
    assert [x for x in log if x >= 5000 and x < 5000 + n] == tokens  # ran in order
    _wait_until(lambda: ctl.stats()["queued"] == 0 and not ctl._hosts[0].inflight,
                "the queue to drain")


def test_async_caller_on_controller_loop_awaits_capacity(small: cb.Controller) -> None:
    ctl = small
    dev = cb.devices()[0]
    slow_mark = hs.slow_mark.specialize(devices=[dev])

    async def fire() -> tuple[list[int], int]:
        futs = []
        peak = 0
        for tok in range(100, 130):
            await ctl.wait_capacity()
            futs.append(slow_mark(tok, 2))  # never blocks on the loop thread
            peak = max(peak, ctl.stats()["queued"])
        return [int(np.asarray(await cb.device_get(await f))) for f in futs], peak

    out, peak = ctl.run_sync(fire(), timeout=120)
    assert out == list(range(100, 130))
    assert peak <= MAX_BACKLOG


async def test_wait_capacity_from_another_loop(small: cb.Controller) -> None:
    ctl = small
    dev = cb.devices()[0]
    wait_gate = hs.wait_gate.specialize(devices=[dev])
    await ctl.wait_capacity()  # room now: returns at once
    gated = [wait_gate(g) for g in (301, 302)]  # both host slots busy
    queued = [asyncio.create_task(asyncio.to_thread(wait_gate, 303 + i))
              for i in range(MAX_BACKLOG)]
    for q in queued:
        await q
    assert ctl.stats()["queued"] == MAX_BACKLOG
    waiter = asyncio.create_task(ctl.wait_capacity())
    await asyncio.sleep(0.05)
    assert not waiter.done()
    for g in range(301, 303 + MAX_BACKLOG):
        hs.open_gate(g)
    await asyncio.wait_for(waiter, 60)
    for f in gated:
        await f
    for q in queued:  # (made on plain threads: their arrays)
        await asyncio.to_thread(cb.block_until_ready, q.result())


def test_close_wakes_a_blocked_caller() -> None:
    cluster = cb.local_cluster(hosts=1, devices_per_host=1, max_inflight=1, max_backlog=1)
    ctl = cluster.__enter__()
    try:
        dev = cb.devices()[0]
        wait_gate = hs.wait_gate.specialize(devices=[dev])
        errors: list[BaseException] = []

        def fire() -> None:
            try:
                for g in range(401, 410):
                    wait_gate(g)
            except BaseException as exc:
                errors.append(exc)

        firer = threading.Thread(target=fire)
        firer.start()
        _wait_until(lambda: ctl.stats()["queued"] == 1, "the backlog to fill")
        assert firer.is_alive()
        ctl.close()  # the controller only: the blocked caller wakes with an error
        firer.join(30)
        assert not firer.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], cb.ControllerClosedError)
    finally:
        for g in range(401, 410):  # let the host's worker thread go
            hs.open_gate(g)
        cluster.close()
