"""Coalesced messages (issue 7): a burst of calls leaves as BATCH envelopes, and
the replies come back batched, without changing what any call returns or raises.

Real controller, real workers, real sockets; the counters in ``ctl.stats()`` say
how many BATCH envelopes went each way.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from lifecycle import in_async

import colobus as cb


@cb.colocated_python
def tag(x: Any, i: int) -> Any:
    """``x * 0 + i``; raises for multiples of 7 so errors sit between results."""
    if i % 7 == 3:
        raise ValueError(f"call {i} fails")
    return x * 0 + i


@cb.colocated_python
def gate(x: Any, path: str) -> None:
    """Returns once ``path`` exists (at most 60 s): the calls behind it wait."""
    import os
    import time

    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.002)


@cb.colocated_python
def record(x: Any, i: int) -> None:
    """Appends ``i`` to a host-side list: the order calls ran in on that host."""
    import sys

    sys.modules[__name__].__dict__.setdefault("_ran", []).append(i)


@cb.colocated_python
def ran() -> Any:
    import sys

    import jax.numpy as jnp

    return jnp.asarray(sys.modules[__name__].__dict__.pop("_ran", []), dtype=jnp.int32)


def _x(ctl: cb.Controller) -> cb.Array:
    devs = ctl.devices()
    mesh = cb.Mesh(np.array(devs), ("d",))
    return cb.device_put(np.zeros(len(devs), np.float32),
                         cb.NamedSharding(mesh, cb.PartitionSpec("d")))


async def test_a_burst_of_calls_travels_in_batches_and_every_outcome_is_kept(
        ctl: cb.Controller) -> None:
    x = _x(ctl)
    cb.block_until_ready(x)
    before = ctl.stats()
    futs = [tag(x, i) for i in range(300)]  # one step of this task: one flush
    outcomes = await asyncio.gather(*futs, return_exceptions=True)
    after = ctl.stats()
    assert after["batches"] > before["batches"]
    assert after["batches_received"] > before["batches_received"]
    for i, out in enumerate(outcomes):
        if i % 7 == 3:
            assert isinstance(out, ValueError) and str(out) == f"call {i} fails"
        else:
            assert isinstance(out, cb.Array)
    values = cb.device_get([o for o in outcomes if isinstance(o, cb.Array)])
    expected = [i for i in range(300) if i % 7 != 3]
    assert [float(np.asarray(v)[0]) for v in values] == expected
    assert all(np.all(np.asarray(v) == e) for v, e in zip(values, expected, strict=True))


async def test_batched_calls_run_in_the_order_issued_on_every_host(ctl: cb.Controller) -> None:
    x = _x(ctl)
    for i in range(500):
        record(x, i)  # returns nothing (as JAX's): one stream, this task's
    for host in range(len(ctl.hosts())):
        devs = [d for d in ctl.devices() if d.host == host]
        order = cb.device_get(ran.specialize(devices=devs)())  # (behind them: same stream)
        assert np.asarray(order).tolist() == list(range(500)), f"host {host}"


def test_sync_callers_from_threads_keep_working_with_batches(ctl: cb.Controller) -> None:
    x = _x(ctl)
    outs = [tag(x, i) for i in range(50)]  # their arrays (the first call's once it ran)

    def error_of(out: Any) -> BaseException | None:
        try:
            cb.block_until_ready(out)
        except Exception as exc:
            return exc
        return None

    done = [error_of(o) for o in outs]
    assert [type(e) for e in done].count(ValueError) == len([i for i in range(50) if i % 7 == 3])


@pytest.mark.parametrize("n", [1, 2])
async def test_cancelling_calls_inside_a_batch_cancels_just_those(ctl: cb.Controller,
                                                                  n: int, tmp_path: Path
                                                                  ) -> None:
    x = _x(ctl)
    opened = tmp_path / "open"
    # (Futures: cancelled here) The calls wait on every host behind a gate that opens
    # once the victims are cancelled: without it, a quick host can have answered them
    # before the cancel leaves (then they are not cancelled: they ended).
    futs = in_async(lambda: [gate(x, str(opened)), *(tag(x, i) for i in range(40))])
    gated, futs = futs[0], futs[1:]
    victims = futs[10:10 + n]
    for f in victims:
        assert f.cancel()
    opened.touch()
    assert await gated is None
    outcomes = await asyncio.gather(*futs, return_exceptions=True)
    for i, out in enumerate(outcomes):
        if 10 <= i < 10 + n:
            assert isinstance(out, asyncio.CancelledError)
        elif i % 7 == 3:
            assert isinstance(out, ValueError)
        else:
            assert isinstance(out, cb.Array)


async def test_a_free_asked_for_before_a_message_reaches_the_host_before_it(
        ctl: cb.Controller) -> None:
    """Frees wait to ride along with other messages, but never behind later ones."""
    dev = ctl.devices()[0]
    base = (await ctl.refresh_stats())["hosts"][0]["arrays"]
    for _ in range(5):
        x = cb.device_put(np.arange(8.0), dev)
        cb.block_until_ready(x)
        assert (await ctl.refresh_stats())["hosts"][0]["arrays"] == base + 1
        x.delete()  # queued; the STATS below must not overtake it
        assert (await ctl.refresh_stats())["hosts"][0]["arrays"] == base


@cb.colocated_python
def inc(x: Any) -> Any:
    return x + 1


async def test_chains_with_frees_in_between_never_wait_for_a_heartbeat() -> None:
    """Every send outside a drain is followed by reading the socket (its FD is
    edge-triggered): with heartbeats 60 s apart, a reply missed after a send (the
    timed RELEASE flush did this) would stall a chain until the next heartbeat."""
    async with cb.local_cluster(hosts=1, devices_per_host=1, heartbeat_interval=60.0,
                                liveness_timeout=300.0) as ctl:
        x = cb.device_put(np.zeros(4, np.float32), ctl.devices()[0])

        async def chain() -> Any:
            z = x
            for _ in range(50):
                z = inc(z)  # each link's Future dies here: its free is queued
            return await z

        for i in range(30):
            out = await asyncio.wait_for(chain(), 20)
            assert float(np.asarray(await cb.device_get(out))[0]) == 50.0, i
            await asyncio.sleep(0.003)  # let the 2 ms free timer fire between chains
