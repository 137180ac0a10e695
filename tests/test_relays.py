"""Relays (issue 25): real relay processes carry real workers' sessions.

What a relay must keep: every host's messages in order, equal replies coalesced
and still read per host; a relay lost (SIGKILL, or silent: SIGSTOP, as a
partition looks from the controller) costs exactly the hosts it carried, whose
workers join again and work. The semantics suites run through a relay in
``tests/test_relayed_*.py``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
from lifecycle import eventually

import colobus as cb
from colobus._controller.relays import relay_count
from colobus._wire.envelope import pack_body
from colobus._wire.relaywire import Gather, entries

HB, LIVENESS = 0.2, 4.0


@cb.colocated_python
def where(x: Any) -> Any:
    return x * 0 + cb.host_index()


@cb.colocated_python
def wait_for_file(x: Any, path: str) -> Any:
    """Runs until ``path`` exists (a gate the test opens), then returns x."""
    deadline = time.monotonic() + 120
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    return x


def test_relay_count_follows_the_cluster_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLOBUS_RELAYS", raising=False)
    assert relay_count(None, 128, 8) == 0  # a star for a few hosts
    assert relay_count(None, 128, 127) == 0
    cores = os.cpu_count() or 2
    assert relay_count(None, 128, 128) == 1
    assert relay_count(None, 128, 1024) == max(1, min(4, cores - 1))
    assert relay_count(None, 0, 4096) == 0  # threshold 0: never by themselves
    assert relay_count(3, 128, 2) == 3  # asked for: always
    monkeypatch.setenv("COLOBUS_RELAYS", "2")
    assert relay_count(None, 128, 2) == 2
    with pytest.raises(ValueError, match="relays must be >= 0"):
        relay_count(-1, 128, 2)


def test_equal_replies_coalesce_and_each_host_keeps_its_order() -> None:
    g = Gather()
    ok = pack_body([7, 0, 0])
    for h in range(4):  # the same reply to call 7 from four hosts, each with its own times
        g.add(h, 7, ok, b"desc", (), 0, [h, h])
    g.add(1, 4, b"\x90", b"", (), 0, alone=True)  # host 1 says something else
    g.add(1, 7, pack_body([8, 0, 0]), b"desc", (), 0, [9, 9])
    g.add(2, 7, pack_body([8, 0, 0]), b"desc", (), 0, [5, 5])
    [(body, payload, bufs)] = g.take()
    got = list(entries(body, payload, bufs))
    assert [e[0] for e in got] == [[0, 1, 2, 3], [1], [1, 2]]
    assert got[0][6] == [[0, 0], [1, 1], [2, 2], [3, 3]] and bytes(got[0][3]) == b"desc"
    assert payload == b"desc"  # the equal payloads travel once
    # host 2's second reply may share an entry only after its first: order per host holds
    g.add(2, 7, ok, b"", (), 0, [1])
    g.add(2, 4, b"\x90", b"", (), 0, alone=True)
    g.add(3, 7, ok, b"", (), 0, [1])
    g.add(3, 7, pack_body([9, 0, 0]), b"", (), 0, [1])
    g.add(2, 7, pack_body([9, 0, 0]), b"", (), 0, [1])
    [(body, payload, bufs)] = g.take()
    order: dict[int, list[int]] = {}
    for i, e in enumerate(entries(body, payload, bufs)):
        for h in e[0]:
            order.setdefault(h, []).append(i)
    assert all(v == sorted(v) for v in order.values())


async def test_hosts_move_to_relays_and_fan_out_calls_work() -> None:
    async with cb.local_cluster(hosts=4, relays=2, heartbeat_interval=HB,
                                liveness_timeout=LIVENESS) as ctl:
        relays = ctl.stats()["relays"]
        assert len(relays) == 2 and sorted(sum((r["hosts"] for r in relays), [])) == [0, 1, 2, 3]
        assert all(len(r["hosts"]) == 2 for r in relays)  # the one carrying fewest takes it
        devs = ctl.devices()
        x = cb.device_put(np.zeros(8, np.float32),
                          cb.NamedSharding(cb.Mesh(np.array(devs), ("d",)), cb.PartitionSpec("d")))
        for _ in range(20):
            out = np.asarray(await cb.device_get(await where(x)))
            assert out.tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
        after = ctl.stats()["relays"]
        assert all(r["forwards"] >= 20 and r["carried_up"] >= 40 for r in after)
        assert ctl.stats()["dropped"].get("relayed", 0) == 0


async def _one_relay_lost(stop: signal.Signals, tmp_path: Any) -> None:
    files: list[str] = []  # every ipc socket file this cluster binds
    async with cb.local_cluster(hosts=4, relays=2, jax_distributed=False, heartbeat_interval=HB,
                                liveness_timeout=LIVENESS) as ctl:
        doomed = ctl.stats()["relays"][0]
        files += [r["endpoint"][6:] for r in ctl.stats()["relays"]]
        files += [h.data[6:] for h in ctl._hosts.hosts if h.data.startswith("ipc://")]
        assert len(files) == 6 and all(os.path.exists(f) for f in files)
        lost, kept = doomed["hosts"], ctl.stats()["relays"][1]["hosts"]
        xs = {h.index: cb.device_put(np.full(2, h.index, np.float32), h.devices[0])
              for h in ctl.hosts()}
        gate = str(tmp_path / "gate")
        held = {i: wait_for_file(xs[i], gate) for i in range(4)}
        await asyncio.sleep(0.2)  # the calls are on their way (they wait for the gate)
        os.kill(doomed["pid"], stop)
        try:
            for i in lost:
                with pytest.raises(cb.HostLostError, match=f"Host {i}"):
                    await asyncio.wait_for(held[i], 30)
            open(gate, "w").close()
            for i in kept:  # the other relay's hosts never noticed
                assert np.asarray(await cb.device_get(await asyncio.wait_for(held[i], 30))
                                  ).tolist() == [i, i]
            # (its hosts may be lost for their own silence a tick before the relay is)
            await eventually(lambda: not ctl.stats()["relays"][0]["alive"], 10,
                             "the silent relay declared lost")
            # The lost hosts' workers notice the silence and join again (the live relay
            # carries them), as the next generation of their host.
            await eventually(lambda: all(h.state == "alive" for h in ctl.hosts()), 60,
                             "the lost hosts to rejoin")
            assert sorted(ctl.stats()["relays"][1]["hosts"]) == [0, 1, 2, 3]
            devs = ctl.devices()
            x = cb.device_put(np.zeros(4, np.float32), cb.NamedSharding(
                cb.Mesh(np.array(devs), ("d",)), cb.PartitionSpec("d")))
            assert np.asarray(await cb.device_get(await where(x))).tolist() == [0, 1, 2, 3]
        finally:
            if stop is signal.SIGSTOP:
                try:
                    os.kill(doomed["pid"], signal.SIGCONT)
                except ProcessLookupError:
                    pass
    # A killed relay leaves its socket file behind, and a worker's data plane its own,
    # unless colobus removes them: none may outlive the cluster.
    assert [f for f in files if os.path.exists(f)] == []


async def test_a_relay_killed_costs_exactly_its_hosts(tmp_path: Any) -> None:
    await _one_relay_lost(signal.SIGKILL, tmp_path)


async def test_a_silent_relay_is_lost_after_the_liveness_timeout(tmp_path: Any) -> None:
    """SIGSTOP: the relay's process lives but says nothing (a partition, as seen from
    the controller): after the liveness timeout it is lost, and its hosts with it."""
    await _one_relay_lost(signal.SIGSTOP, tmp_path)


async def test_relays_start_by_themselves_from_the_threshold(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLOBUS_RELAYS", raising=False)
    async with cb.local_cluster(hosts=2, relay_threshold=2) as ctl:
        assert len(ctl.stats()["relays"]) == 1
        assert ctl.stats()["relays"][0]["hosts"] == [0, 1]
    async with cb.local_cluster(hosts=2, relay_threshold=3) as ctl:
        assert ctl.stats()["relays"] == []


@cb.colocated_python
def sleep_by_host(x: Any) -> Any:
    """Host h runs 40 * h ms: each host's own run time tells the hosts apart."""
    time.sleep(0.04 * cb.host_index())
    return None


async def test_coalesced_results_settle_once_and_keep_each_hosts_times() -> None:
    """Equal RESULTs of a call's hosts reach the controller as one entry (their times
    beside it) and are settled as a group: the call ends once, with every host's part,
    and a traced call still shows each host's own run time."""
    async with cb.local_cluster(hosts=4, relays=1, heartbeat_interval=HB,
                                liveness_timeout=LIVENESS, trace=True) as ctl:
        devs = ctl.devices()
        x = cb.device_put(np.zeros(4, np.float32),
                          cb.NamedSharding(cb.Mesh(np.array(devs), ("d",)), cb.PartitionSpec("d")))
        up0 = ctl.stats()["relays"][0]
        for _ in range(5):
            out = np.asarray(await cb.device_get(await where(x)))
            assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
        up1 = ctl.stats()["relays"][0]
        # replies of several hosts rode in one UP (the relay coalesces what one drain read)
        assert up1["carried_up"] - up0["carried_up"] > up1["ups"] - up0["ups"]
        fut = sleep_by_host(x)
        assert await fut is None
        t = fut.timings()
        assert t is not None and t.outcome == "finished"
        assert [h.host for h in t.hosts] == [0, 1, 2, 3]
        runs = [h.run for h in t.hosts]
        assert runs == sorted(runs) and runs[3] >= 0.1 > runs[0], runs
        assert ctl._ops.pending == {} and all(not h.inflight for h in ctl._hosts.hosts)
        assert ctl.stats()["dropped"].get("unsolicited", 0) == 0
        # Replicas through the relay: hosts 0, 1 and 3 agree (their equal replies
        # coalesce), host 2 differs in its last element, above the old 64 KiB limit. Kept
        # per host as JAX keeps them; compared where asked (check_replicas=True).
        odd = await odd_one(x, 128 << 10)
        lasts = [float((await s.data)[-1]) for s in odd.addressable_shards]
        assert lasts == [0.0, 0.0, 1.0, 0.0], lasts
        with pytest.raises(ValueError, match=r"odd_one: the output is replicated over hosts "
                                             r"\[0, 1, 2, 3\].*hosts by value: 0, 1, 3; 2"):
            await odd_one.specialize(check_replicas=True)(x, 128 << 10)


@cb.colocated_python
def odd_one(x: Any, nbytes: int) -> Any:
    value = np.zeros(nbytes // 4, np.float32)
    value[-1] = cb.host_index() == 2
    return value


def test_a_relay_holds_a_calls_replies_until_its_last_host_answered() -> None:
    from colobus._relay.hold import ReplyHold

    hold = ReplyHold()
    hold.forwarded(7, 3)  # a CALL to three of this relay's hosts
    hold.answered(7)
    assert hold.holding  # two more to come
    hold.answered(99)  # a call it never forwarded (a FETCH, a direct one): no wait
    hold.answered(7)
    assert hold.holding
    hold.answered(7)
    assert not hold.holding  # the last one: everything goes up now
    hold.forwarded(8, 2)
    hold.answered(8)
    hold.urgent = True  # a transfer's part in the same UP waits for nothing
    assert not hold.holding
    hold.sent()
    hold.answered(8)
    assert not hold.holding
    hold.forwarded(9, 2)
    hold.answered(9)
    hold.prune(-1.0)  # expected for too long (a host lost): forgotten
    assert not hold.holding


@cb.colocated_python
def gated(x: Any, path: str) -> Any:
    """Host 3 runs until ``path`` exists; the others return at once."""
    if cb.host_index() == 3:
        deadline = time.monotonic() + 120
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)
    return x * 0 + cb.host_index()


async def test_held_replies_go_up_while_a_slow_host_runs(tmp_path: Any) -> None:
    """The hold is bounded: the quick hosts' replies reach the controller while host 3
    still runs, and the call ends once it answers. (The relay forgets what it expects
    after the liveness timeout: a long one here, so that only the bound lets them go.)"""
    async with cb.local_cluster(hosts=4, relays=1, heartbeat_interval=HB,
                                liveness_timeout=60.0) as ctl:
        devs = ctl.devices()
        x = cb.device_put(np.zeros(4, np.float32),
                          cb.NamedSharding(cb.Mesh(np.array(devs), ("d",)), cb.PartitionSpec("d")))
        await cb.block_until_ready(x)

        gate = tmp_path / "gate"
        fut = gated(x, str(gate))

        def waits_for() -> list[int]:  # the hosts the call's operation still waits for
            ops = [op for op in ctl._ops.pending.values() if op.future is fut]
            return ops[0].waiting_for() if ops else [-1]

        await eventually(lambda: waits_for() == [3], 45, "the quick hosts' replies")
        assert not fut.done()
        gate.touch()
        out = np.asarray(await cb.device_get(await fut))
        assert out.tolist() == [0.0, 1.0, 2.0, 3.0]


@cb.colocated_python
def host1_waits(x: Any, path: str) -> None:
    """Host 1 runs until ``path`` exists; host 0 returns at once. Returns nothing (no
    output data that a lost host would take with it)."""
    if cb.host_index() == 1:
        deadline = time.monotonic() + 120
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)


@cb.colocated_python
def break_the_protocol(x: Any) -> Any:
    """On its host: queue an authenticated but malformed BATCH on the worker's own
    channel, behind everything the worker sent before (a protocol break, which makes
    its relay drop the host with a GONE)."""
    import sys

    from colobus._host.sched import Scheduler
    from colobus._wire.envelope import BATCH_KIND

    frame = sys._getframe(1)  # up to the scheduler running this call, and its worker
    while not isinstance(frame.f_locals.get("self"), Scheduler):
        frame = frame.f_back
    w = frame.f_locals["self"]._w
    w.loop.call_soon_threadsafe(w._chan.send_packed, w._peer, BATCH_KIND, pack_body([[1]]))
    return x


async def test_a_host_lost_right_after_answering_keeps_its_answer(tmp_path: Any) -> None:
    """A relay sends up what it holds for a host before that host's GONE: a fan-out
    call the host answered just before its relay dropped it does not fail.

    Host 0 answers ``a`` while host 1 still runs it, so the relay holds host 0's reply;
    then ``b``, ordered after ``a`` on host 0 (one stream), breaks the protocol there.
    """
    async with cb.local_cluster(hosts=2, relays=1, jax_distributed=False, heartbeat_interval=HB,
                                liveness_timeout=LIVENESS) as ctl:
        devs = ctl.devices()
        x = cb.device_put(np.zeros(2, np.float32),
                          cb.NamedSharding(cb.Mesh(np.array(devs), ("d",)), cb.PartitionSpec("d")))
        x0 = cb.device_put(np.zeros(1, np.float32), devs[0])
        await cb.block_until_ready([x, x0])
        host0 = ctl._hosts.hosts[0]
        generation = host0.generation

        gate = tmp_path / "gate"
        a = host1_waits(x, str(gate))
        b = break_the_protocol(x0)
        try:  # it answered before its break, or it is lost with its host
            await b
        except cb.HostLostError:
            pass
        await eventually(lambda: not host0.alive or host0.generation != generation, 30,
                         "host 0 to be dropped for its protocol break")
        assert not a.done(), "host 1 still runs it"
        gate.touch()
        assert await a is None  # host 0's answer came before its loss: it counts


async def test_a_host_that_cannot_reach_its_relay_is_served_directly(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from colobus._controller.relays import Relays

    start = Relays.start

    async def start_unreachable(self: Relays) -> None:
        await start(self)
        for r in self.relays:  # the relay runs, but no host can connect to it
            os.unlink(r.endpoint[len("ipc://"):])

    monkeypatch.setattr(Relays, "start", start_unreachable)
    async with cb.local_cluster(hosts=2, relays=1, jax_distributed=False, heartbeat_interval=HB,
                                liveness_timeout=2.0) as ctl:
        # Each joins, moves to the relay, is never heard there and is lost; it joins
        # again, and from then on the controller serves it without the relay.
        await eventually(lambda: ctl.stats()["relays"][0]["hosts"] == [] and all(
            h.alive and h.generation > 0 and h.peer.via is None for h in ctl._hosts.hosts),
            60, "both hosts served directly")
        x = cb.device_put(np.zeros(2, np.float32), cb.NamedSharding(
            cb.Mesh(np.array(ctl.devices()), ("d",)), cb.PartitionSpec("d")))
        assert np.asarray(await cb.device_get(await where(x))).tolist() == [0, 1]
        assert all(h.generation == 1 for h in ctl._hosts.hosts)  # lost once, not cycling
    said = [r.getMessage() for r in caplog.records]
    assert sum("never reached its relay" in m for m in said) == 2, said
