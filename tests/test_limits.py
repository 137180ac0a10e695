"""The wire's limits (``colobus/_wire/limits.py``) hold on every path, star and relay.

Each limit is crossed at its real value, cheaply: many small buffers for the buffer
limits, two 8 MiB blocks for the byte limit. The real-stack tests run twice, on a
star and with every host behind one relay; ``put.SLICE_S`` is raised where a test
needs a whole put to leave in one loop step (what a relay gathers into one FORWARD).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from lifecycle import eventually

import colobus as cb
from colobus._api import put as put_module
from colobus._api import treeput
from colobus._controller.controller import _pop_current, _push_current
from colobus._wire import limits as L
from colobus._wire.channel import DRAIN_BUDGET_S, Channel
from colobus._wire.relaywire import Gather, entries

DOCS = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"
MiB = 1 << 20


# -- the table ----------------------------------------------------------------------------


def test_docs_state_every_limit_with_its_value() -> None:
    text = DOCS.read_text()
    rows = {m.group(1): m.group(2) for m in
            re.finditer(r"^\| `([A-Z_]+)` \| ([0-9,]+) \|", text, re.MULTILINE)}
    for limit in L.TABLE:
        assert limit.name in rows, f"docs/protocol.md has no row for {limit.name}"
        assert int(rows[limit.name].replace(",", "")) == limit.value, limit.name


# -- a gather closes before a limit (FORWARD and UP alike) ----------------------------------


def _messages(g: Gather) -> list[tuple[list[Any], bytes, list[Any]]]:
    return g.take()


@pytest.mark.parametrize("extra", [0, 1])
def test_a_gather_closes_at_the_buffer_limit(extra: int) -> None:
    g = Gather()
    n = L.GATHER_MAX_BUFFERS + extra
    bufs = [memoryview(bytes([i % 256])) for i in range(n)]
    for i, b in enumerate(bufs):
        g.add(i % 2, 9, b"\x90", b"", [b], 0)
    out = _messages(g)
    assert len(out) == 1 + extra
    assert [len(m[2]) for m in out] == [L.GATHER_MAX_BUFFERS] + [1] * extra
    # every message's entries describe its own buffers; each host's order holds
    seen: dict[int, list[int]] = {0: [], 1: []}
    for body, payload, buffers in out:
        for hosts, *_, got, _pbufs, _x in entries(body, payload, buffers):
            for h in hosts:
                seen[h].append(bytes(got[0])[0])
    assert seen[0] == [i % 256 for i in range(0, n, 2)]
    assert seen[1] == [i % 256 for i in range(1, n, 2)]


@pytest.mark.parametrize("extra", [0, 1])
def test_a_gather_closes_at_the_byte_limit_and_a_large_message_goes_alone(extra: int) -> None:
    g = Gather()
    half = L.GATHER_MAX_BYTES // 2
    a, b = memoryview(bytearray(half)), memoryview(bytearray(half + extra))
    g.add(0, 9, b"\x90", b"", [a], 0)
    g.add(1, 9, b"\x90", b"", [b], 0)
    big = memoryview(bytearray(L.GATHER_MAX_BYTES + 1))
    g.add(0, 9, b"\x90", b"", [big], 0)
    g.add(1, 9, b"\x90", b"x", (), 0)
    sizes = [sum(x.nbytes for x in m[2]) for m in _messages(g)]
    want = [2 * half] if not extra else [half, half + 1]
    assert sizes == [*want, big.nbytes, 0]


def test_a_shared_buffer_counts_once_and_bodies_close_a_message() -> None:
    g = Gather()
    shared = [memoryview(bytearray(L.GATHER_MAX_BYTES))]
    for h in range(8):  # a fan-out's one payload: placed once, however many hosts
        g.add(h, 9, b"\x90", b"", shared, 0)
    body = b"\xc5\x03\xe8" + b"\x00" * 1000  # 1 KiB bodies (msgpack bin 16)
    for i in range(2 * L.GATHER_MAX_BODY // len(body)):
        g.add(i % 3, 4, body, b"", (), 0, alone=True)
    out = g.take()
    assert len(out[0][2]) == 1  # the shared buffer, once
    assert len(out) >= 2  # the bodies passed GATHER_MAX_BODY: another message
    for entries_, _, _ in out:  # each closed once its bodies passed the limit
        assert sum(len(e[2]) for e in entries_) <= L.GATHER_MAX_BODY + len(body)


# -- a drain lets the loop run ------------------------------------------------------------


async def test_a_drain_lets_the_loop_run_after_an_envelope_past_its_budget(
        tmp_path: Path) -> None:
    """One BATCH can hold 256 messages that each take a while (a host storing small
    PUTs): the drain checks its budget after every envelope, so a heartbeat waiting
    on the loop runs after the first envelope that passed it, not after 64."""
    ctx: zmq.Context[Any] = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    addr = f"ipc://{tmp_path}/drain.sock"
    b.bind(addr)
    a.connect(addr)
    seen: list[int] = []

    def slow(frames: list[Any]) -> None:
        seen.append(len(seen))
        time.sleep(DRAIN_BUDGET_S)  # (at least) the whole budget: it is passed now

    loop = asyncio.get_running_loop()
    for i in range(10):
        a.send_multipart([b"h", b"p", bytes([i])])
    await eventually(lambda: b.poll(0), 30, "the messages to arrive")
    chan = Channel(b, b"k" * 32, loop, slow)  # (reading from now on)
    try:
        ran: list[int] = []
        loop.call_soon(lambda: ran.append(len(seen)))
        chan.drain()
        await eventually(lambda: len(seen) == 10, 30, "the drain to go on")
        assert ran == [1]  # the waiting callback ran after the first envelope
    finally:
        chan.close()
        a.close(0)
        ctx.term()


# -- the real stack, star and relay ---------------------------------------------------------


@pytest.fixture(scope="module", params=[0, 1], ids=["star", "relay"])
def pair(request: pytest.FixtureRequest) -> Iterator[cb.Controller]:
    with cb.local_cluster(hosts=2, devices_per_host=1, relays=request.param) as ctl:
        _push_current(ctl)
        try:
            yield ctl
        finally:
            _pop_current(ctl)


def _relay_stats(ctl: cb.Controller) -> dict[str, Any] | None:
    relays = ctl.stats()["relays"]
    return relays[0] if relays else None


@pytest.mark.parametrize("extra", [0, 1])
def test_a_put_at_and_past_the_buffer_limit_in_one_step(
        pair: cb.Controller, extra: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 hosts x (2048 + extra) leaves in one loop step: 4096 or 4098 buffers for the
    relay; its FORWARDs carry at most GATHER_MAX_BUFFERS, and every leaf arrives."""
    monkeypatch.setattr(put_module, "SLICE_S", 600.0)  # the whole put in one step
    ctl = pair
    sharding = cb.NamedSharding(cb.Mesh(np.array(ctl.devices()), ("h",)), cb.PartitionSpec("h"))
    n = L.GATHER_MAX_BUFFERS // 2 + extra
    before = _relay_stats(ctl)
    out = cb.device_put([np.array([i, -i], np.int32) for i in range(n)], sharding)
    got = cb.device_get(out)
    assert [list(x) for x in got] == [[i, -i] for i in range(n)]
    after = _relay_stats(ctl)
    if after is not None:  # (the step's first message leaves at once, alone)
        assert before is not None and after["forwards"] - before["forwards"] >= 2 + extra
        assert after["most_buffers"] <= L.GATHER_MAX_BUFFERS  # FORWARDs and UPs
        if extra:
            assert after["most_buffers"] == L.GATHER_MAX_BUFFERS  # one full, then more


@pytest.mark.parametrize("extra", [0, 8])
def test_a_put_at_and_past_the_byte_limit_in_one_step(
        pair: cb.Controller, extra: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two blocks of GATHER_MAX_BYTES / 2 (+ extra) for two hosts of one relay, sent in
    one step: one FORWARD at the limit, two past it; the data arrives exact."""
    monkeypatch.setattr(put_module, "SLICE_S", 600.0)
    ctl = pair
    d0, d1 = sorted(ctl.devices(), key=lambda d: d.host)
    half = L.GATHER_MAX_BYTES // 2
    x0 = np.arange(half // 8, dtype=np.int64)
    x1 = np.arange((half + extra) // 8, dtype=np.int64)[::-1].copy()
    before = _relay_stats(ctl)
    # the step's first message leaves at once, alone: the two blocks gather after it
    _, a0, a1 = cb.device_put([np.zeros(1), x0, x1], [d0, d0, d1])
    np.testing.assert_array_equal(cb.device_get(a0), x0)
    np.testing.assert_array_equal(cb.device_get(a1), x1)
    after = _relay_stats(ctl)
    if after is not None:
        assert before is not None
        assert after["most_bytes"] <= L.GATHER_MAX_BYTES
        assert after["forwards"] - before["forwards"] >= (2 if not extra else 3)
        if not extra:
            assert after["most_bytes"] == L.GATHER_MAX_BYTES  # both in one FORWARD


def test_what_is_asked_after_a_put_in_slices_waits_for_all_of_it(
        pair: cb.Controller, monkeypatch: pytest.MonkeyPatch) -> None:
    """A put's messages leave in slices (here one leaf each), the loop running between
    them: a read and a call asked right after the put still find every leaf there."""
    monkeypatch.setattr(put_module, "SLICE_S", 0.0)
    ctl = pair
    sharding = cb.NamedSharding(cb.Mesh(np.array(ctl.devices()), ("h",)), cb.PartitionSpec("h"))
    n = 300
    out = cb.device_put([np.array([i, i], np.int32) for i in range(n)], sharding)
    last = cb.device_get(out[-1])  # asked while the slices are still leaving
    assert list(last) == [n - 1, n - 1]
    assert [int(x[0]) for x in cb.device_get(out)] == list(range(n))


@pytest.mark.slow
def test_a_put_of_more_buffers_than_a_message_takes_through_one_relay(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The review's probe: 2 hosts x 33,000 leaves in one step, 66,000 buffers for one
    relay (over MAX_FRAMES): refused as one FORWARD before, in capped FORWARDs now."""
    monkeypatch.setattr(put_module, "SLICE_S", 600.0)
    n = L.MAX_FRAMES // 2 + 232
    with cb.local_cluster(hosts=2, devices_per_host=1, relays=1) as ctl:
        sharding = cb.NamedSharding(cb.Mesh(np.array(ctl.devices()), ("h",)),
                                    cb.PartitionSpec("h"))
        out = cb.device_put([np.full(2, i, np.int32) for i in range(n)], sharding)
        assert list(cb.device_get(out[-1])) == [n - 1, n - 1]
        assert ctl.stats()["relays"][0]["most_buffers"] <= L.GATHER_MAX_BUFFERS
        assert [h.state for h in ctl.hosts()] == ["alive", "alive"]


@pytest.mark.parametrize("relays", [0, 1], ids=["star", "relay"])
def test_puts_to_a_stopped_host_wait_for_room(relays: int) -> None:
    """A host stopped (SIGSTOP, inside the liveness window): puts to it wait once it
    holds ``max_queued_bytes``, through a relay as on the star (a relay acknowledges a
    FORWARD on reading it: its hosts' unacknowledged bytes still count)."""
    bound, size = 2 * MiB, MiB
    with cb.local_cluster(hosts=2, devices_per_host=1, relays=relays,
                          max_queued_bytes=bound, liveness_timeout=30.0) as ctl:
        dev = next(d for d in ctl.devices() if d.host == 1)
        pid = ctl.hosts()[1].pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        returned: list[cb.Array] = []
        try:
            def puts() -> None:
                _push_current(ctl)
                try:
                    for i in range(12):
                        returned.append(cb.device_put(np.full(size // 8, float(i)), dev))
                finally:
                    _pop_current(ctl)

            thread = threading.Thread(target=puts, daemon=True)
            thread.start()
            asyncio.run(eventually(lambda: ctl._uploads._blocked == 1, 60,
                                   "a put to wait for room"))
            assert len(returned) <= bound // size + 1  # not all 12
            # at most the bound and the one put let in under it, with their envelopes
            # (headers, a relay's FORWARD: bytes, not puts)
            assert ctl.stats()["hosts"][1]["queued_bytes"] <= bound + size + 64 * 1024
        finally:
            os.kill(pid, signal.SIGCONT)
        thread.join(120)
        assert not thread.is_alive() and len(returned) == 12
        last = cb.device_get(returned[-1])
        assert float(last[0]) == 11.0
        assert [h.state for h in ctl.hosts()] == ["alive", "alive"]
        if relays:
            asyncio.run(eventually(lambda: ctl.stats()["hosts"][1]["queued_bytes"] == 0, 60,
                                   "the relay to say the host has it all"))


@pytest.mark.parametrize("relays", [0, 1], ids=["star", "relay"])
async def test_a_tree_put_on_the_loop_hashes_off_it(relays: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``async with``, a replicated put that takes the tree computes its digests
    on another thread: the loop goes on meanwhile (the hashing waits for this test's
    coroutine to run again), and a call made right after the put still sees it."""
    go_on = threading.Event()
    on_loop: list[bool] = []
    real = treeput.chunk_digests

    def digests(buf: memoryview, chunk: int) -> list[bytes]:
        on_loop.append(threading.current_thread() is loop_thread)
        if not go_on.wait(60):
            raise AssertionError("the loop never ran while the digests were computed")
        return real(buf, chunk)

    monkeypatch.setattr(treeput, "chunk_digests", digests)
    loop_thread = threading.current_thread()
    async with cb.local_cluster(hosts=2, devices_per_host=1, broadcast_tree=2,
                                relays=relays) as ctl:
        sharding = cb.NamedSharding(cb.Mesh(np.array(ctl.devices()), ("h",)),
                                    cb.PartitionSpec())
        data = np.arange(treeput.TREE_MIN_BYTES // 4, dtype=np.float32)
        x = cb.device_put(data, sharding)  # returns with the hashing still to do
        await asyncio.sleep(0)  # the loop runs: this coroutine goes on
        await eventually(lambda: bool(on_loop), 30, "the hashing to start")
        assert on_loop == [False]
        pending = cb.device_get(x)  # asked before the put's messages left: waits for them
        hosts_before = [h.state for h in ctl.hosts()]
        go_on.set()
        np.testing.assert_array_equal(await pending, data)
        assert hosts_before == ["alive", "alive"]
        assert ctl.stats()["tree_overdue"] == 0


def test_a_put_to_a_lost_hosts_devices_says_they_are_gone() -> None:
    """The error agrees in number (it said "its devices is gone")."""
    with cb.local_cluster(hosts=2, devices_per_host=1, relays=0) as ctl:
        dev = next(d for d in ctl.devices() if d.host == 1)
        pid = ctl.hosts()[1].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        asyncio.run(eventually(lambda: ctl.hosts()[1].state != "alive", 60,
                               "host 1 to be lost"))
        with pytest.raises(cb.HostLostError, match="its devices are gone"):
            cb.device_put(np.zeros(4), dev)
