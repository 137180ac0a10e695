"""Faults: lost hosts, cut links, a controller that dies, hung user code, hostile peers.

Tests marked ``netns`` run each worker in its own network namespace (``netbed``)
so hosts have their own addresses and a link can be cut; they skip where
namespaces cannot be made (not root). The others use local worker
subprocesses, or a raw pyzmq DEALER speaking the wire protocol by hand.
Timings are short (heartbeat 0.2 s, liveness 1.5 s) to keep the file fast.
"""

from __future__ import annotations

import asyncio
import collections.abc
import json
import logging
import os
import random
import secrets
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.asyncio
from netbed import NetBed, cpu_seconds, eventually, loss_unavailable_reason, unavailable_reason

import colobus as cb
from colobus._wire import protocol as P
from colobus._wire.envelope import Envelope, decode, encode
from colobus._wire.keys import write_key
from colobus._wire.protocol import Kind
from colobus._wire.versions import local_versions

HB = 0.2  # heartbeat interval, both directions
LIVE = 1.5  # liveness timeout (short, with room for a loaded 2-core CI machine)
FAST = {"heartbeat_interval": HB, "liveness_timeout": LIVE}
LOST_WITHIN = LIVE + 10 * HB + 5.0  # generous bound for "declared lost within the timeout"

netns = pytest.mark.netns


# -- code that runs on hosts (module level: travels by reference) ---------------------------


@cb.colocated_python
def nap(x: Any, seconds: float, marker: str | None = None) -> Any:
    """Touch ``marker`` (so the test knows the call started), sleep, return ``x``."""
    if marker:
        with open(marker, "w"):
            pass
    time.sleep(seconds)
    return x


@cb.colocated_python
def plus_one(x: Any) -> Any:
    return x + 1


@cb.colocated_python
def hang_sleeping(x: Any, flag: str, marker: str) -> Any:
    """Hang (sleeping, GIL released) until ``flag`` exists; at most 60 s."""
    with open(marker, "w"):
        pass
    end = time.monotonic() + 60
    while not os.path.exists(flag) and time.monotonic() < end:
        time.sleep(0.02)
    return x * 2


@cb.colocated_python
def hang_spinning(x: Any, flag: str, marker: str) -> Any:
    """Hang in a tight pure-Python loop (holding the GIL) until ``flag`` exists; at most 60 s."""
    with open(marker, "w"):
        pass
    end = time.monotonic() + 60
    n = 0
    while time.monotonic() < end:
        n += 1
        if n % 1000 == 0 and os.path.exists(flag):
            break
    return x * 3


@cb.colocated_python_class
class Tally:
    """A host-side object: its state lives on the host."""

    def __init__(self) -> None:
        self.total = 0.0

    def add(self, x: Any) -> Any:
        self.total += float(x.sum())
        return x

    def total_like(self, x: Any) -> Any:
        return x * 0 + self.total


# -- fixtures and helpers -------------------------------------------------------------------


@pytest.fixture
def bed() -> collections.abc.Iterator[NetBed]:
    """A fresh 2-namespace bed per test, always torn down (also when the test fails)."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    b = NetBed(hosts=2)
    try:
        b.create()
        yield b
    finally:
        b.close()


class LocalWorkers:
    """Worker subprocesses on this machine (no namespaces); killed and reaped in finally."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, connect: str, key_file: str, name: str, devices: int = 1,
              log: str | None = None) -> subprocess.Popen[bytes]:
        """Start a worker; with ``log``, its stderr (its log) goes to that file."""
        env = dict(os.environ)
        paths = [p if p else os.getcwd() for p in sys.path]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env["COLOBUS_PARENT_PID"] = str(os.getpid())
        env.pop("COLOBUS_KEY_FILE", None)
        with open(log or os.devnull, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "colobus", "worker", "--connect", connect, "--devices",
                 str(devices), "--name", name, "--key-file", key_file],
                env=env, stdin=subprocess.DEVNULL, stderr=err if log else None)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(10)


@pytest.fixture
def local_workers() -> collections.abc.Iterator[LocalWorkers]:
    w = LocalWorkers()
    try:
        yield w
    finally:
        w.close()


def index_of(ctl: cb.Controller, name: str) -> int:
    """Host index by worker name (join order, hence indices, is not fixed)."""
    return {h.name: h.index for h in ctl.hosts()}[name]


def devices_of(ctl: cb.Controller, name: str) -> list[cb.Device]:
    return list(ctl.hosts()[index_of(ctl, name)].devices)


async def expect_host_lost(make: collections.abc.Callable[[], Any], host: int) -> str:
    """``make()`` (a call) raises HostLostError for ``host``, at the call or from its future."""
    with pytest.raises(cb.HostLostError) as info:
        fut = make()
        await asyncio.wait_for(fut, LOST_WITHIN)
    assert f"Host {host}" in str(info.value)
    return str(info.value)


async def in_own_task(make: collections.abc.Callable[[], cb.Future[Any]]) -> cb.Future[Any]:
    """Make a call from a task of its own: a stream of its own, not ordered after ours."""

    async def call() -> cb.Future[Any]:
        return make()

    return await asyncio.create_task(call())


async def wait_file(path: str, timeout: float = 30.0) -> None:
    await eventually(lambda: os.path.exists(path), timeout, f"{path} to appear")


def dropped(ctl: cb.Controller) -> dict[str, int]:
    return dict(ctl.stats()["dropped"])


# -- SIGKILL a worker mid-call ----------------------------------------------------------------


@netns
async def test_sigkill_mid_call_fails_its_calls_and_only_them(bed: NetBed, tmp_path: Any) -> None:
    async with cb.Controller(bed.bind(), hosts=0, key=bed.key, **FAST) as ctl:
        procs = [bed.start_worker(i, ctl.address, name=f"nb-{i}") for i in range(2)]
        await ctl.wait_for_hosts(2, timeout=60)
        h0, _h1 = index_of(ctl, "nb-0"), index_of(ctl, "nb-1")
        d0, d1 = devices_of(ctl, "nb-0"), devices_of(ctl, "nb-1")
        ids0 = [d.id for d in d0]
        mesh = cb.Mesh(np.array([d0, d1], dtype=object), ("hosts", "devices"))
        both = cb.device_put(np.arange(8.0).reshape(2, 4),
                             cb.NamedSharding(mesh, cb.PartitionSpec("hosts", "devices")))
        a0 = cb.device_put(np.full(4, 5.0), d0[0])
        a1 = cb.device_put(np.full(4, 7.0), d1[0])
        tally = Tally()
        await tally.add(a0)
        await tally.add(a1)

        marker = str(tmp_path / "started")
        long_call = nap(a0, 60.0, marker)  # only on host 0
        spanning = await in_own_task(lambda: nap(both, 60.0))  # on both hosts
        short_other = nap(a1, 1.0)  # only on host 1
        await wait_file(marker)

        bed.kill(procs[0])  # SIGKILL while host 0 sleeps in user code
        text = await expect_host_lost(lambda: long_call, h0)
        assert "'nb-0'" in text
        await expect_host_lost(lambda: spanning, h0)
        np.testing.assert_array_equal(await cb.device_get(await short_other), np.full(4, 7.0))

        assert [h.state for h in ctl.hosts()] == [
            "lost" if h.index == h0 else "alive" for h in ctl.hosts()]
        assert cb.devices() == d1
        assert not set(ids0) & {d.id for d in cb.devices()}
        # Data that lived on host 0 raises HostLostError when used.
        await expect_host_lost(lambda: cb.device_get(a0), h0)
        await expect_host_lost(lambda: plus_one(a0), h0)
        await expect_host_lost(lambda: cb.device_get(both), h0)
        await expect_host_lost(lambda: tally.total_like.specialize(devices=[d0[0]])(), h0)
        # The other host, its data and its part of the object keep working.
        np.testing.assert_array_equal(await cb.device_get(await plus_one(a1)), np.full(4, 8.0))
        np.testing.assert_array_equal(await cb.device_get(await tally.total_like(a1)),
                                      np.full(4, 28.0))  # host 1's instance: 4 * 7

        # A worker restarted under the same name gets the same index and device ids back.
        bed.start_worker(0, ctl.address, name="nb-0")
        await eventually(lambda: ctl.hosts()[h0].state == "alive", 60, "nb-0 to rejoin")
        assert [d.id for d in ctl.hosts()[h0].devices] == ids0
        assert ctl.hosts()[h0].pid != procs[0].pid
        await expect_host_lost(lambda: cb.device_get(a0), h0)  # old data stays gone
        fresh = cb.device_put(np.arange(4.0), d0[1])
        np.testing.assert_array_equal(await cb.device_get(await plus_one(fresh)),
                                      np.arange(4.0) + 1)
        assert ctl.stats()["pending"] == 0


# -- cut a host's link, then restore it -------------------------------------------------------


@netns
async def test_cut_link_loses_host_and_restored_link_rejoins(bed: NetBed, tmp_path: Any) -> None:
    async with cb.Controller(bed.bind(), hosts=0, key=bed.key, **FAST) as ctl:
        procs = [bed.start_worker(i, ctl.address, name=f"nb-{i}") for i in range(2)]
        await ctl.wait_for_hosts(2, timeout=60)
        h1 = index_of(ctl, "nb-1")
        d0, d1 = devices_of(ctl, "nb-0"), devices_of(ctl, "nb-1")
        ids1 = [d.id for d in d1]
        a0 = cb.device_put(np.ones(4), d0[0])
        a1 = cb.device_put(np.full(4, 3.0), d1[0])
        tally = Tally()
        await tally.add(a1)
        await ctl.refresh_stats()
        assert ctl.stats()["hosts"][h1]["arrays"] >= 1
        assert ctl.stats()["hosts"][h1]["objects"] == 1
        marker = str(tmp_path / "started")
        running = nap(a1, 30.0, marker)
        await wait_file(marker)

        with bed.cut_off(1):
            await expect_host_lost(lambda: running, h1)
            assert ctl.hosts()[h1].state == "lost"
            assert cb.devices() == d0
            # The rest of the cluster works while host 1 is cut off.
            np.testing.assert_array_equal(await cb.device_get(await plus_one(a0)),
                                          np.full(4, 2.0))
            await asyncio.sleep(2 * LIVE)  # the worker notices the silence and gives up too

        await eventually(lambda: ctl.hosts()[h1].state == "alive", 60, "nb-1 to rejoin")
        info = ctl.hosts()[h1]
        assert info.name == "nb-1" and info.pid == procs[1].pid  # the same process came back
        assert [d.id for d in info.devices] == ids1
        assert sorted(d.id for d in cb.devices()) == sorted([d.id for d in d0] + ids1)
        # The old session's data is gone on both sides.
        await expect_host_lost(lambda: cb.device_get(a1), h1)
        await expect_host_lost(lambda: tally.add(a1), h1)
        await ctl.refresh_stats()
        assert ctl.stats()["hosts"][h1]["arrays"] == 0
        assert ctl.stats()["hosts"][h1]["objects"] == 0
        # Calls to it work again.
        b1 = cb.device_put(np.full(4, 9.0), d1[1])
        np.testing.assert_array_equal(await cb.device_get(await plus_one(b1)), np.full(4, 10.0))
        # Whatever old-session traffic arrived late was dropped, never handled.
        drops = dropped(ctl)
        assert set(drops) <= {"stale", "unknown_peer", "replay"}, drops


# -- the controller dies; a standalone worker waits with back-off and joins the next one ---

_CONTROLLER_SCRIPT = r"""
import json, sys, time
import numpy as np
import colobus as cb

@cb.colocated_python_class
class Keeper:
    def __init__(self):
        self.n = 0
    def touch(self, x):
        self.n += 1
        return x

bind, key_file = sys.argv[1], sys.argv[2]
with cb.Controller(bind, hosts=1, key=cb.load_key(key_file), heartbeat_interval=0.2,
                   liveness_timeout=1.0, join_timeout=60) as ctl:
    d = ctl.devices()
    arrs = [cb.device_put(np.arange(1000.0) + i, d[i % len(d)]) for i in range(3)]
    keeper = Keeper()
    cb.block_until_ready(keeper.touch(arrs[0]))
    stats = ctl.refresh_stats().result(30)
    print("READY", json.dumps({"arrays": stats["hosts"][0]["arrays"],
                               "objects": stats["hosts"][0]["objects"],
                               "pid": ctl.hosts()[0].pid}), flush=True)
    time.sleep(600)
"""


@netns
async def test_controller_killed_worker_backs_off_and_joins_next(bed: NetBed,
                                                                 tmp_path: Any) -> None:
    port = bed.free_port()
    bind = bed.bind(port)
    worker = bed.start_worker(0, bind, name="stay")
    script = tmp_path / "controller.py"
    script.write_text(_CONTROLLER_SCRIPT)
    old = subprocess.Popen([sys.executable, str(script), bind, bed.key_file],
                           stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        assert old.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(old.stdout.readline), 90)
        assert line.startswith(b"READY "), line
        before = json.loads(line[6:])
        assert before["arrays"] >= 3 and before["objects"] == 1
        assert before["pid"] == worker.pid
        old.kill()  # no goodbye: the worker must notice the silence itself
    finally:
        if old.poll() is None:
            old.kill()
        old.wait(10)
        if old.stdout is not None:
            old.stdout.close()

    # While no controller exists the worker retries with back-off, not in a busy loop.
    await asyncio.sleep(LIVE + 0.5)
    cpu0 = cpu_seconds(worker.pid)
    await asyncio.sleep(2.5)
    spent = cpu_seconds(worker.pid) - cpu0
    assert spent < 0.5, f"worker burned {spent:.2f} s of CPU in 2.5 s while reconnecting"
    assert worker.poll() is None

    async with cb.Controller(bind, hosts=1, key=bed.key, join_timeout=60, **FAST) as ctl:
        (info,) = ctl.hosts()
        assert info.name == "stay" and info.pid == worker.pid
        stats = await ctl.refresh_stats()
        assert stats["hosts"][0]["arrays"] == 0  # the old session's data was dropped
        assert stats["hosts"][0]["objects"] == 0
        x = cb.device_put(np.arange(3.0), ctl.devices()[0])
        np.testing.assert_array_equal(await cb.device_get(await plus_one(x)), np.arange(3.0) + 1)
        await ctl.refresh_stats()
        assert ctl.stats()["hosts"][0]["arrays"] >= 1

    # A controller that closes politely: the worker rejoins the next one just the same.
    async with cb.Controller(bind, hosts=1, key=bed.key, join_timeout=60, **FAST) as ctl:
        (info,) = ctl.hosts()
        assert info.pid == worker.pid
        stats = await ctl.refresh_stats()
        assert stats["hosts"][0]["arrays"] == 0
        assert stats["hosts"][0]["objects"] == 0
    assert worker.poll() is None


# -- a call that hangs in user code ------------------------------------------------------------


async def test_hung_user_code_keeps_heartbeating_and_is_cancellable(tmp_path: Any) -> None:
    live = 5.0  # the default timeout: this test asserts a host is *not* declared lost
    async with cb.local_cluster(hosts=1, devices_per_host=1, heartbeat_interval=HB,
                                liveness_timeout=live) as ctl:
        (dev,) = ctl.devices()
        x = cb.device_put(np.ones(3), dev)
        # Compile plus_one first: a JAX compile that has to share the GIL with a
        # pure-Python spinner takes seconds (the convoy effect), and stalls the
        # worker's loop thread with it (docs/reliability.md, "Hung calls").
        await plus_one(x)
        flag = str(tmp_path / "release")
        marks = [str(tmp_path / "m-sleep"), str(tmp_path / "m-spin")]

        hung = [await in_own_task(lambda: hang_sleeping(x, flag, marks[0])),
                await in_own_task(lambda: hang_spinning(x, flag, marks[1]))]
        for m in marks:
            await wait_file(m)
        await asyncio.sleep(1.2 * live)  # past a liveness timeout with both calls stuck
        assert ctl.hosts()[0].state == "alive"
        assert not any(f.done() for f in hung)

        # Other callers still get through: another task, and another thread.
        async def other_task() -> Any:
            return await cb.device_get(await plus_one(x))

        np.testing.assert_array_equal(await asyncio.create_task(other_task()), np.full(3, 2.0))
        from_thread = await asyncio.to_thread(
            lambda: np.asarray(plus_one(x)))
        np.testing.assert_array_equal(from_thread, np.full(3, 2.0))

        for f in hung:
            assert f.cancel() is True, (f, f.done() and f.exception())
            with pytest.raises(asyncio.CancelledError):
                await f
        assert ctl.hosts()[0].state == "alive"
        np.testing.assert_array_equal(await cb.device_get(await plus_one(x)), np.full(3, 2.0))

        # Let the hung code finish: its results are dropped on the host, not kept.
        with open(flag, "w"):
            pass

        async def only_x_left() -> bool:
            stats = await ctl.refresh_stats()
            return stats["hosts"][0]["arrays"] == 1 and stats["hosts"][0]["inflight"] == 0

        deadline = time.monotonic() + 30
        while not await only_x_left():
            assert time.monotonic() < deadline, ctl.stats()
            await asyncio.sleep(0.1)
        assert ctl.stats()["pending"] == 0


# -- hostile and confused peers (issue 2) -------------------------------------------------------


async def test_wrong_key_worker_never_joins_and_is_logged_once(
        tmp_path: Any, local_workers: LocalWorkers, caplog: pytest.LogCaptureFixture) -> None:
    good, bad = str(tmp_path / "good.key"), str(tmp_path / "bad.key")
    key = write_key(good)
    write_key(bad)
    caplog.set_level(logging.WARNING, logger="colobus.controller")
    async with cb.Controller("tcp://127.0.0.1:*", hosts=0, key=key, **FAST) as ctl:
        local_workers.start(ctl.address, bad, "intruder")
        await eventually(lambda: dropped(ctl).get("unauthenticated", 0) >= 3, 60,
                         "several HELLOs with the wrong key")
        assert ctl.hosts() == []
        warnings = [r for r in caplog.records
                    if r.name == "colobus.controller" and "unauthenticated" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        # The controller goes on serving: a worker with the right key joins and works.
        local_workers.start(ctl.address, good, "rightful")
        await ctl.wait_for_hosts(1, timeout=60)
        assert [h.name for h in ctl.hosts()] == ["rightful"]
        x = cb.device_put(np.arange(2.0), ctl.devices()[0])
        np.testing.assert_array_equal(await cb.device_get(await plus_one(x)), [1.0, 2.0])
        assert len([r for r in caplog.records if "unauthenticated" in r.getMessage()]) == 1


async def test_worker_declared_lost_is_told_to_rejoin_at_once(
        tmp_path: Any, local_workers: LocalWorkers) -> None:
    """A worker the controller gave up on (while it still thinks all is well) gets a
    RESET on its next message and joins again, long before its own liveness timeout."""
    key_file = str(tmp_path / "key")
    key = write_key(key_file)
    log = str(tmp_path / "worker.log")
    async with cb.Controller("tcp://127.0.0.1:*", hosts=0, key=key, heartbeat_interval=HB,
                             liveness_timeout=60.0) as ctl:
        proc = local_workers.start(ctl.address, key_file, "paused", log=log)
        await ctl.wait_for_hosts(1, timeout=60)
        ids = [d.id for d in ctl.devices()]
        x = cb.device_put(np.arange(3.0), ctl.devices()[0])
        await cb.block_until_ready(x)
        ctl._declare_lost(0)
        await eventually(lambda: ctl.hosts()[0].state == "lost", 10, "the host declared lost")
        # Its heartbeats are now stale; the RESET they draw makes it rejoin (its own
        # liveness timeout, 60 s, is far away).
        await eventually(lambda: ctl.hosts()[0].state == "alive", 30, "the worker to rejoin")
        if ctl._relays is None:  # a relay tells it at once (GONE), before it speaks again
            assert dropped(ctl).get("stale", 0) >= 1
        info = ctl.hosts()[0]
        assert info.pid == proc.pid and [d.id for d in info.devices] == ids
        await expect_host_lost(lambda: cb.device_get(x), 0)
        y = cb.device_put(np.arange(3.0), ctl.devices()[0])
        np.testing.assert_array_equal(await cb.device_get(await plus_one(y)), [1.0, 2.0, 3.0])
    with open(log) as f:
        assert "session ended (reset)" in f.read()


class RawPeer:
    """A DEALER that speaks the wire protocol by hand, as a worker would."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, key: bytes) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.key = key
        self.session = secrets.token_bytes(16)
        self.ctl_session = b""
        self.seq = 0

    def frames(self, body: P.Body, *, version: int | None = None,
               seq: int | None = None) -> list[bytes | memoryview]:
        if seq is None:
            self.seq += 1
            seq = self.seq
        env = Envelope(body.kind, self.session, self.ctl_session, seq, body.to_wire())
        if version is not None:
            env.version = version
        return encode(self.key, env)

    async def send(self, frames: list[bytes | memoryview]) -> None:
        await self.sock.send_multipart(frames)

    async def recv(self, timeout: float = 10.0) -> Envelope:
        frames = await asyncio.wait_for(self.sock.recv_multipart(), timeout)
        return decode(self.key, frames)

    def hello(self, name: str, nonce: bytes, **kw: Any) -> list[bytes | memoryview]:
        return self.frames(P.Hello(name, os.getpid(), "raw", [["cpu", "cpu", 0]], nonce, "",
                                   local_versions()), **kw)

    async def challenge(self) -> bytes:
        """JOIN, and the nonce of the controller's CHALLENGE."""
        await self.send(self.frames(P.Join()))
        while (env := await self.recv()).kind != Kind.CHALLENGE:
            pass
        return bytes(env.body[0])

    def close(self) -> None:
        self.sock.close(0)


async def wait_drops(ctl: cb.Controller, reason: str, n: int) -> None:
    await eventually(lambda: dropped(ctl).get(reason, 0) >= n, 10, f"{n} {reason!r} drop(s)")


async def test_replayed_stale_and_other_version_envelopes_are_rejected() -> None:
    key = secrets.token_bytes(32)
    ctx = zmq.asyncio.Context()
    peers: list[RawPeer] = []
    try:
        # A long liveness timeout: the raw peer only speaks when the test says so (to
        # the controller itself: relays=0, a raw peer does not move to a relay).
        async with cb.Controller("tcp://127.0.0.1:*", hosts=0, key=key, heartbeat_interval=HB,
                                 liveness_timeout=60.0, relays=0) as ctl:
            peer = RawPeer(ctx, ctl.address, key)
            peers.append(peer)
            hello = peer.hello("raw-host", await peer.challenge())
            await peer.send(hello)
            welcome = await peer.recv()
            assert welcome.kind == Kind.WELCOME
            peer.ctl_session = welcome.sender
            body = P.parse(welcome.kind, welcome.body)
            assert isinstance(body, P.Welcome)
            index, ids = body.host, body.device_ids

            beat = peer.frames(P.Heartbeat(0, 0, 0, 0))
            await peer.send(beat)
            await peer.send(beat)  # the same envelope again: a replay
            await wait_drops(ctl, "replay", 1)
            await peer.send(peer.frames(P.Heartbeat(0, 0, 0, 0), seq=1))  # an old sequence number
            await wait_drops(ctl, "replay", 2)
            await peer.send(hello)  # the join resent on its own connection: ignored
            # Captured frames replayed from another connection: the join is a replay,
            # later messages come from no known peer.
            thief = RawPeer(ctx, ctl.address, key)
            peers.append(thief)
            await thief.send(hello)
            await wait_drops(ctl, "replay", 3)
            await thief.send(peer.frames(P.Heartbeat(0, 0, 0, 0)))
            await wait_drops(ctl, "unknown_peer", 1)
            assert [h.name for h in ctl.hosts()] == ["raw-host"]
            assert ctl.hosts()[index].state == "alive"

            # Declared lost: its next messages are stale and it is told to join again.
            ctl._declare_lost(index)
            await eventually(lambda: ctl.hosts()[index].state == "lost", 10, "raw host lost")
            await peer.send(peer.frames(P.Heartbeat(0, 0, 0, 0)))
            await wait_drops(ctl, "stale", 1)
            while True:
                env = await peer.recv()
                if env.kind == Kind.RESET:
                    break
                # sent before it was declared lost (the ACKs: answers to the replays,
                # which say again what the controller has)
                assert env.kind in (Kind.HEARTBEAT, Kind.ACK)
            await peer.send(peer.frames(P.Result(12345, P.Status.OK, 0)))  # a late result
            await wait_drops(ctl, "stale", 2)
            assert ctl.stats()["pending"] == 0

            # Joining again under the same name (a new session) restores index and ids.
            peer.session, peer.ctl_session, peer.seq = secrets.token_bytes(16), b"", 0
            await peer.send(peer.hello("raw-host", await peer.challenge()))
            while (env := await peer.recv()).kind != Kind.WELCOME:
                pass
            again = P.parse(env.kind, env.body)
            assert isinstance(again, P.Welcome)
            assert (again.host, again.device_ids) == (index, ids)
            assert ctl.hosts()[index].state == "alive"

            # A peer speaking another protocol version is told so at join.
            future = RawPeer(ctx, ctl.address, key)
            peers.append(future)
            await future.send(future.hello("from-the-future", b"n" * 16, version=999))
            reject = await future.recv()
            assert reject.kind == Kind.REJECT
            reason = P.parse(reject.kind, reject.body)
            assert isinstance(reason, P.Reject)
            assert "protocol version mismatch" in reason.reason and "999" in reason.reason
            assert dropped(ctl).get("version", 0) == 1
            assert "from-the-future" not in [h.name for h in ctl.hosts()]
            assert "handler_error" not in dropped(ctl)
    finally:
        for p in peers:
            p.close()
        ctx.term()


def _garbage(rng: random.Random, key: bytes) -> list[bytes]:
    """One random multipart message: noise, or broken versions of real envelopes."""
    kind = rng.randrange(6)
    if kind == 0:  # pure noise, 1-8 frames
        return [rng.randbytes(rng.choice((0, 1, 7, 32, 100, 2000)))
                for _ in range(rng.randint(1, 8))]
    env = Envelope(rng.choice(list(Kind)), rng.randbytes(16), rng.randbytes(16),
                   rng.randrange(1 << 40), [rng.randrange(100)], rng.randbytes(rng.randrange(64)))
    frames = [bytes(f) for f in encode(key if kind >= 4 else rng.randbytes(32), env)]
    if kind == 1:  # truncated
        return frames[: rng.randint(1, 2)]
    if kind == 2:  # one byte flipped
        i = rng.randrange(len(frames))
        if frames[i]:
            b = bytearray(frames[i])
            b[rng.randrange(len(b))] ^= 0xFF
            frames[i] = bytes(b)
        return frames
    if kind == 3:  # extra frames the header does not announce
        return [*frames, rng.randbytes(10)]
    if kind == 4:  # valid MAC, but from a peer that never joined
        return frames
    # a header over the 1 MiB limit (rarely: they are big), else a long one; wrong MAC
    size = (1 << 20) + 1 if rng.random() < 0.01 else 1 << 16
    return [rng.randbytes(size), *frames[1:]]


def test_random_garbage_is_dropped_counted_and_calls_keep_working(ctl: cb.Controller) -> None:
    rng = random.Random(20240611)
    key = ctl._key  # the shared cluster's key: also try validly signed nonsense
    n = 3000
    before = ctl.stats()["dropped_total"]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    try:
        sock.connect(ctl.address)
        for _ in range(n):
            sock.send_multipart(_garbage(rng, key))
        deadline = time.monotonic() + 60
        while ctl.stats()["dropped_total"] - before < n:
            assert time.monotonic() < deadline, ctl.stats()["dropped"]
            time.sleep(0.05)
        assert ctl.stats()["dropped_total"] - before == n
        assert "handler_error" not in ctl.stats()["dropped"]
    finally:
        sock.close(0)
        ctx.term()
    assert [h.state for h in ctl.hosts()] == ["alive", "alive"]
    for dev in (cb.devices()[0], cb.devices()[-1]):  # one device on each host
        x = cb.device_put(np.arange(4.0), dev)
        np.testing.assert_array_equal(np.asarray(plus_one(x)),
                                      np.arange(4.0) + 1)


async def test_batches_from_a_joined_peer_are_split_and_bad_ones_dropped_whole() -> None:
    """A BATCH is checked (MAC, session, sequence) once, then split: its messages are
    handled in order; a batch whose entries do not match its payload and buffers is
    dropped as malformed, none of its messages handled."""
    from colobus._wire.envelope import pack_batch

    key = secrets.token_bytes(32)
    ctx = zmq.asyncio.Context()
    peer: RawPeer | None = None
    try:
        async with cb.Controller("tcp://127.0.0.1:*", hosts=0, key=key, heartbeat_interval=HB,
                                 liveness_timeout=60.0, relays=0) as ctl:  # a raw peer: direct
            peer = RawPeer(ctx, ctl.address, key)
            await peer.send(peer.hello("batcher", await peer.challenge()))
            welcome = await peer.recv()
            peer.ctl_session = welcome.sender

            def batch(body: list[Any], payload: bytes = b"") -> list[bytes | memoryview]:
                peer.seq += 1
                env = Envelope(Kind.BATCH, peer.session, peer.ctl_session, peer.seq, body,
                               payload)
                return encode(key, env)

            beats = [(int(Kind.HEARTBEAT), P.Heartbeat(n, 10 * n, 0, 0).to_wire(), b"", [], 0)
                     for n in (3, 5)]
            body, payload, _ = pack_batch(beats)
            await peer.send(batch(body, payload))
            # Handled in order: the last heartbeat's store counts are the ones kept.
            await eventually(lambda: ctl.stats()["hosts"][0]["arrays"] == 5, 10, "batch handled")
            assert ctl.stats()["batches_received"] == 1
            bad = [[int(Kind.HEARTBEAT), P.Heartbeat(7, 70, 0, 0).to_wire(), 4, 0, 0]]
            await peer.send(batch(bad, b"abc"))  # says 4 payload bytes, carries 3
            await wait_drops(ctl, "malformed", 1)
            assert ctl.stats()["hosts"][0]["arrays"] == 5  # nothing of it was handled
            # A key holder that breaks the protocol is dropped (and counted).
            await eventually(lambda: ctl.hosts()[0].state == "lost", 10, "batcher dropped")
            assert ctl.stats()["hosts_dropped"] == 1
            # The same for a nested batch, from the host joined again.
            peer.session, peer.ctl_session, peer.seq = secrets.token_bytes(16), b"", 0
            await peer.send(peer.hello("batcher", await peer.challenge()))
            while (env := await peer.recv()).kind != Kind.WELCOME:
                pass
            peer.ctl_session = env.sender
            nested = [[int(Kind.BATCH), [], 0, 0, 0]]
            await peer.send(batch(nested))
            await wait_drops(ctl, "malformed", 2)
            await eventually(lambda: ctl.hosts()[0].state == "lost", 10, "batcher dropped")
            assert "handler_error" not in dropped(ctl)
    finally:
        if peer is not None:
            peer.close()
        ctx.term()


# -- the hosts as one JAX job, each with an address of its own -------------------------------


@netns
async def test_a_jax_job_across_hosts_with_their_own_addresses(bed: NetBed) -> None:
    """A job over two namespaces: the coordinator in the controller, reached through each
    host's colobus link (no port); gloo listening where each host reaches the controller
    from (JAX's own pick, the machine's name, is a loopback address here), so a jitted
    sum runs across."""
    from hostview_hostside import cross_host_sum

    from colobus._controller.controller import _pop_current, _push_current

    ctl = cb.Controller(bed.bind(), hosts=2, key=bed.key, jax_distributed=True,
                        join_timeout=90)
    await ctl.start()
    try:
        for i in range(2):
            bed.start_worker(i, ctl.address, name=f"nb-{i}")
        await ctl.wait_for_hosts(timeout=90)
        _push_current(ctl)  # (what entering it does: it is the default controller)
        job = ctl.stats()["jax_job"]
        assert job["state"] == "formed" and job["coordinator"].startswith("unix:"), job
        mesh = cb.Mesh(np.array(ctl.devices(), dtype=object), ("x",))
        x = cb.device_put(np.arange(8.0, dtype=np.float32),
                          cb.NamedSharding(mesh, cb.PartitionSpec("x")))
        total = await asyncio.wait_for(cross_host_sum(x), 60)
        assert float(await cb.device_get(total)) == 28.0
    finally:
        _pop_current(ctl)
        await ctl.aclose()


@netns
async def test_hosts_that_cannot_reach_each_other_run_the_block_view(
        bed: NetBed, caplog: pytest.LogCaptureFixture) -> None:
    """Each host reaches the controller but not the other (a firewall between them): the
    default view's job cannot form (its collectives would hang), and the controller says
    so in one line, naming the hosts, then runs the block view."""
    import logging

    from globalview_hostside import block_and_devices

    reason = loss_unavailable_reason()  # (parting two hosts takes iptables too)
    if reason is not None:
        pytest.skip(reason)
    bed.part(0, 1)
    ctl = cb.Controller(bed.bind(), hosts=2, key=bed.key, join_timeout=90)
    with caplog.at_level(logging.WARNING, logger="colobus.controller"):
        await ctl.start()
        try:
            for i in range(2):
                bed.start_worker(i, ctl.address, name=f"nb-{i}", devices=1)
            await ctl.wait_for_hosts(timeout=90)
            said = [r.getMessage() for r in caplog.records  # (beside the join's progress)
                    if r.name == "colobus.controller" and r.levelno >= logging.WARNING
                    and "block view" in r.getMessage()]
            assert len(said) == 1 and "run the block view" in said[0], said
            assert "cannot reach host" in said[0], said
            assert ctl.stats()["jax_job"]["state"] == "off"
            seen = await asyncio.wait_for(_block_call(ctl, block_and_devices), 60)
            assert seen == [2, 1]
        finally:
            await ctl.aclose()


async def _block_call(ctl: cb.Controller, fn: Any) -> list[int]:
    from colobus._controller.controller import _pop_current, _push_current

    _push_current(ctl)
    try:
        mesh = cb.Mesh(np.array(ctl.devices(), dtype=object), ("x",))
        x = cb.device_put(np.arange(4.0, dtype=np.float32),
                          cb.NamedSharding(mesh, cb.PartitionSpec("x")))
        out = await cb.colocated_python(fn)(x)
        return list(np.asarray(await cb.device_get(out)).tolist())
    finally:
        _pop_current(ctl)
