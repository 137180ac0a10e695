"""The transport under pressure: names and cluster size, send-path failures, receivers'
limits, bounded decoding, a peer that never acknowledges, unknown peers, slow links.

Each test runs the real stack: a controller on real sockets with real worker
subprocesses, or an authenticated raw peer (pyzmq plus colobus's wire module)
where a hostile worker is needed. Waits poll with a deadline, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextlib
import os
import pathlib
import secrets
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
import zmq
from fakeworker import FakeWorker
from netbed import eventually

import colobus as cb
from colobus._controller.controller import _pop_current, _push_current
from colobus._wire import protocol as P
from colobus._wire.envelope import Envelope, encode
from colobus._wire.keys import write_key
from colobus._wire.protocol import Kind

HB = 0.2
LIVE = 2.0
FAST: dict[str, Any] = {"heartbeat_interval": HB, "liveness_timeout": LIVE}


class Workers:
    """Worker subprocesses on this machine, each logging to a file; killed in finally."""

    def __init__(self, tmp: pathlib.Path, key_file: str) -> None:
        self.tmp = tmp
        self.key_file = key_file
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, connect: str, name: str, devices: int = 1,
              parent: bool = True) -> subprocess.Popen[bytes]:
        """``parent=False``: a long-running worker (no ``COLOBUS_PARENT_PID``), as a
        user starts one; else one tied to this process, as a launcher's."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p or os.getcwd() for p in sys.path))
        if parent:
            env["COLOBUS_PARENT_PID"] = str(os.getpid())
        env.pop("COLOBUS_KEY_FILE", None)
        log = self.tmp / f"worker-{len(self.procs)}.log"
        with open(log, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "colobus", "worker", "--connect", connect, "--devices",
                 str(devices), "--name", name, "--key-file", self.key_file],
                env=env, stdin=subprocess.DEVNULL, stdout=err, stderr=err)
        proc.log = log  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    @staticmethod
    def log(proc: subprocess.Popen[bytes]) -> str:
        return pathlib.Path(proc.log).read_text(errors="replace")  # type: ignore[attr-defined]

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(30)


@pytest.fixture
def workers(tmp_path: pathlib.Path) -> collections.abc.Iterator[Workers]:
    key_file = str(tmp_path / "key")
    write_key(key_file)
    w = Workers(tmp_path, key_file)
    try:
        yield w
    finally:
        w.close()


def _key(w: Workers) -> bytes:
    return bytes.fromhex(pathlib.Path(w.key_file).read_text().strip())


@cb.colocated_python
def plus_one(x: Any) -> Any:
    return x + 1


# -- 1. names and hosts=N ------------------------------------------------------------------


async def test_a_live_hosts_name_is_refused_and_hosts_n_bounds_the_cluster(
        workers: Workers) -> None:
    ctl = cb.Controller("tcp://127.0.0.1:*", hosts=1, key=_key(workers), **FAST)
    await ctl.start()
    _push_current(ctl)
    try:
        first = workers.start(ctl.address, "twin")
        await ctl.wait_for_hosts(1, timeout=120)
        dev = ctl.devices()[0]
        x = cb.device_put(np.arange(4.0), dev)
        np.testing.assert_array_equal(await cb.device_get(x), np.arange(4.0))

        # A second live worker under the same name is refused, and keeps retrying;
        # the first keeps its host, its session and its arrays.
        second = workers.start(ctl.address, "twin")
        await eventually(lambda: ctl.stats()["dropped"].get("name_in_use", 0) >= 2, 60,
                         "two refusals of the second 'twin'")
        assert "is alive under this name" in Workers.log(second)
        assert second.poll() is None
        [info] = ctl.hosts()
        assert (info.state, info.pid) == ("alive", first.pid)
        np.testing.assert_array_equal(await cb.device_get(await plus_one(x)), np.arange(4.0) + 1)

        # A new name beyond hosts=1 is refused with a message saying so; it exits non-zero.
        extra = workers.start(ctl.address, "extra")
        await eventually(lambda: extra.poll() is not None, 60, "the extra worker to exit")
        assert extra.returncode != 0
        assert "hosts=1" in Workers.log(extra) and "new name" in Workers.log(extra)
        assert [h.name for h in ctl.hosts()] == ["twin"]

        # Once the first is gone, the second is welcome under its name (same index).
        first.send_signal(signal.SIGKILL)
        await eventually(lambda: ctl.hosts()[0].pid == second.pid
                         and ctl.hosts()[0].state == "alive", 60, "the second twin to join")
        assert len(ctl.hosts()) == 1
        with pytest.raises(cb.HostLostError):
            await cb.device_get(x)
    finally:
        _pop_current(ctl)
        await ctl.aclose()


def test_a_spare_worker_refused_as_full_waits_and_joins_the_next_driver(
        workers: Workers) -> None:
    """A long-running ``colobus worker`` refused because the cluster is full says so once
    and waits (as it waits when no controller is up); the next driver that wants more
    hosts gets it. A worker a launcher started (``COLOBUS_PARENT_PID``) exits, status 2."""
    key = _key(workers)
    first = cb.Controller("tcp://127.0.0.1:*", hosts=1, key=key, heartbeat_interval=HB,
                          liveness_timeout=60.0)
    first.start_in_thread()
    address = first.address
    zctx: zmq.Context[Any] = zmq.Context()
    resident = FakeWorker(zctx, address, key, "resident", channel=True)
    try:
        resident.join()  # hosts=1: the cluster is full
        spare = workers.start(address, "spare", parent=False)
        launched = workers.start(address, "launched")
        asyncio.run(eventually(lambda: launched.poll() is not None, 120,
                               "the launched worker to exit"))
        assert launched.returncode == 2, Workers.log(launched)
        assert "a worker under a new name ('launched') is refused" in Workers.log(launched)
        asyncio.run(eventually(lambda: first.stats()["dropped"].get("too_many_hosts", 0) >= 3,
                               120, "the spare worker refused twice"))
        assert spare.poll() is None
        said = Workers.log(spare)
        assert said.count("refused this worker") == 1, said  # once, however many rounds
        assert "waits for a place or for the next controller" in said
        assert [h.name for h in first.hosts()] == ["resident"]
    finally:
        resident.close()
        first.close()
        zctx.term()
    second = cb.Controller(address, hosts=1, key=key, **FAST)  # the next driver, same address
    second.start_in_thread()
    _push_current(second)
    try:
        second.run_sync(second.wait_for_hosts(1, timeout=120))
        [info] = second.hosts()
        assert (info.name, info.pid, info.state) == ("spare", spare.pid, "alive")
        x = cb.device_put(np.arange(3.0), second.devices()[0])
        np.testing.assert_array_equal(cb.device_get(plus_one(x)), [1.0, 2.0, 3.0])
    finally:
        _pop_current(second)
        second.close()


# -- 2. send-path failures are the caller's ------------------------------------------------


class _Title:
    """An arbitrary object as a structured dtype's field title: msgpack cannot write it."""


@pytest.fixture(scope="module")
def big_cluster() -> collections.abc.Iterator[cb.Controller]:
    """One host, 64 MiB max_message_bytes (the issue's fetch case)."""
    with cb.local_cluster(hosts=1, devices_per_host=1, max_message_bytes=64 << 20) as ctl:
        yield ctl


@pytest.fixture
def bctl(big_cluster: cb.Controller) -> collections.abc.Iterator[cb.Controller]:
    _push_current(big_cluster)
    try:
        yield big_cluster
    finally:
        _pop_current(big_cluster)
    assert [h.state for h in big_cluster.hosts()] == ["alive"]
    assert big_cluster.stats()["hosts_dropped"] == 0


def _host_drops(ctl: cb.Controller) -> dict[str, int]:
    """What the worker dropped, from a heartbeat that is current."""
    ctl.refresh_stats().result(30)
    return dict(ctl.stats()["hosts"][0].get("dropped") or {})


def test_an_unencodable_put_fails_at_the_call_and_spends_nothing(bctl: cb.Controller) -> None:
    dev = bctl.devices()[0]
    bad = np.zeros(3, np.dtype([((_Title(), "a"), "<f4"), ("b", "<i4")]))

    def one_step() -> tuple[cb.Array, cb.Array, BaseException | None]:
        """On the controller's loop: the three puts are queued in one step (one batch)."""
        first = cb.device_put(np.arange(3.0), dev)
        err: BaseException | None = None
        try:
            cb.device_put(bad, dev)
        except BaseException as exc:
            err = exc
        second = cb.device_put(np.arange(3.0) + 10, dev)
        return first, second, err

    async def on_loop() -> tuple[cb.Array, cb.Array, BaseException | None]:
        return one_step()

    first, second, err = bctl.run_sync(on_loop())
    assert isinstance(err, cb.SerializationError), repr(err)
    np.testing.assert_array_equal(np.asarray(plus_one(first)), np.arange(3.0) + 1)
    np.testing.assert_array_equal(cb.device_get(second), np.arange(3.0) + 10)
    assert not {"gap", "oversized", "malformed"} & set(_host_drops(bctl))


# -- 3. no legal operation makes a message its receiver refuses -------------------------


def test_six_large_fetch_replies_are_never_one_oversized_batch(bctl: cb.Controller) -> None:
    dev = bctl.devices()[0]
    n = (24 << 20) // 8
    arrays = [cb.device_put(np.full(n, float(i)), dev) for i in range(6)]
    got = cb.device_get(arrays)  # the host answers all six in one loop step
    assert [float(a[0]) for a in got] == [float(i) for i in range(6)]
    assert all(a.shape == (n,) for a in got)
    assert bctl.stats()["dropped"].get("oversized", 0) == 0


@cb.colocated_python
def first_plus_one(xs: Any) -> Any:
    return xs[0] + 1 + (0 if xs[0] is xs[-1] else 100)  # one array named twice: one object


def test_calls_with_many_handles_and_frees_of_many_arrays_fit(bctl: cb.Controller) -> None:
    dev = bctl.devices()[0]
    x = cb.device_put(np.arange(2.0), dev)
    # A CALL listing 150k handles (1.5 MB of refs): its body travels in the payload. The
    # host makes the array host code sees once, as JAX passes one object named twice.
    y = cb.block_until_ready(first_plus_one([x] * 150_000))
    np.testing.assert_array_equal(np.asarray(y), np.arange(2.0) + 1)
    # 262k frees at once: one RELEASE listing them all, never refused by the worker.
    gen = bctl._hosts[0].generation
    ref0 = bctl._ops.next_id() << 16

    def free_all() -> None:
        bctl._frees._queue_many([({0: gen}, ref0 + i, 0) for i in range(262_144)])

    bctl._call_soon(free_all)
    z = cb.block_until_ready(plus_one(x))  # queued behind the RELEASE: it arrives, in sequence
    np.testing.assert_array_equal(np.asarray(z), np.arange(2.0) + 1)
    assert not {"gap", "oversized", "malformed"} & set(_host_drops(bctl))


# -- raw authenticated peers (hostile workers) and a stall probe ----------------------------


class StallProbe:
    """The longest gap between 5 ms ticks of a controller's loop (its longest stall),
    in wall time and in the loop thread's CPU time (which a loaded machine's
    scheduling does not inflate: it is what the loop itself spent)."""

    def __init__(self, ctl: cb.Controller) -> None:
        self.longest = self.longest_cpu = 0.0
        self._ctl = ctl
        self._stop = False
        assert ctl._loop is not None
        ctl._loop.call_soon_threadsafe(self._tick, time.monotonic(), -1.0)

    def _tick(self, then: float, cpu_then: float) -> None:
        now, cpu = time.monotonic(), time.thread_time()
        self.longest = max(self.longest, now - then - 0.005)
        if cpu_then >= 0:
            self.longest_cpu = max(self.longest_cpu, cpu - cpu_then)
        if not self._stop and self._ctl._loop is not None:
            self._ctl._loop.call_later(0.005, self._tick, time.monotonic(), time.thread_time())

    def reset(self) -> None:
        self.longest = self.longest_cpu = 0.0

    def stop(self) -> None:
        self._stop = True


@pytest.fixture
def hostile() -> collections.abc.Iterator[dict[str, Any]]:
    """A controller on its own loop thread (no hosts needed) and a ZeroMQ context."""
    key = secrets.token_bytes(32)
    ctl = cb.Controller("tcp://127.0.0.1:*", hosts=0, key=key, max_message_bytes=64 << 20,
                        heartbeat_interval=0.5, liveness_timeout=60.0)
    ctl.start_in_thread()
    zctx: zmq.Context[Any] = zmq.Context()
    _push_current(ctl)
    try:
        yield {"ctl": ctl, "key": key, "zctx": zctx}
    finally:
        _pop_current(ctl)
        ctl.close()
        zctx.term()


@cb.colocated_python
def make_one() -> Any:
    return np.ones(2, np.float32)


def _make_one_specs() -> cb.ShapeDtypeStruct:
    """``make_one``'s output specs: its calls return at once (a fake host answers them
    after; a first call without them would wait for that answer)."""
    return cb.ShapeDtypeStruct((2,), np.float32)


# -- 4. bounded decoding ----------------------------------------------------------------


def _nested_empty_lists(nbytes: int) -> bytes:
    """msgpack: an array of 2^18 arrays, each of empty arrays: one list per byte."""
    outer = 1 << 18
    inner = nbytes // outer - 1
    return b"\xdd" + outer.to_bytes(4, "big") + (b"\xdc" + inner.to_bytes(2, "big")
                                                 + b"\x90" * inner) * outer


def test_a_hostile_description_costs_a_small_multiple_of_its_size(
        hostile: dict[str, Any]) -> None:
    ctl: cb.Controller = hostile["ctl"]
    fake = FakeWorker(hostile["zctx"], ctl.address, hostile["key"], "nested", channel=True)
    try:
        fake.join()
        probe = StallProbe(ctl)
        dev = [d for d in ctl.devices() if d.host == fake.index]
        bomb = _nested_empty_lists(16 << 20)
        for status, meta in ((P.Status.ERROR, None), (P.Status.OK, 1)):
            fut = make_one.specialize(devices=dev, out_specs_fn=_make_one_specs)()
            call = fake.expect(Kind.CALL)
            probe.reset()
            fake.send(Kind.RESULT, [call.body[0], int(status), meta], bomb)
            with pytest.raises(cb.ProtocolError, match="malformed reply"):
                cb.block_until_ready(fut)
            assert probe.longest < 0.5, f"the loop stalled {probe.longest:.2f} s"
            # The host broke the protocol: dropped. A new session for the next round.
            fake.close()
            fake = FakeWorker(hostile["zctx"], ctl.address, hostile["key"], f"n{status}",
                              channel=True)
            fake.join()
            dev = [d for d in ctl.devices() if d.host == fake.index]
        probe.stop()
    finally:
        fake.close()


def test_bounded_readers_stop_early() -> None:
    """The readers' own cost: a 16 MiB document of empty lists is refused after at most
    MAX_NODES + 16 lists (outputs) or at once by its size (errors)."""
    import tracemalloc

    from colobus._wire import describe, failures

    bomb = _nested_empty_lists(16 << 20)
    tracemalloc.start()
    try:
        t0 = time.process_time()  # (this process's CPU: what the reading cost, whatever
        for read in (lambda: describe.read_outputs(bomb, 1), lambda: failures.read_error(bomb)):
            with pytest.raises(describe.BadReply):  # else runs on the machine meanwhile)
                read()
        took = time.process_time() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * len(bomb), f"{peak} bytes for a {len(bomb)}-byte document"
    assert took < 1.0


# -- 5. a worker that heartbeats but never acknowledges -----------------------------------


@contextlib.contextmanager
def _keyed_fake(key: bytes, name: str, **options: Any
                ) -> collections.abc.Iterator[tuple[cb.Controller, FakeWorker]]:
    """A TCP controller in its own thread (the default controller meanwhile) and a joined
    fake worker holding the key that sends like a real worker's channel."""
    ctl = cb.Controller("tcp://127.0.0.1:*", hosts=0, key=key, **options)
    ctl.start_in_thread()
    zctx: zmq.Context[Any] = zmq.Context()
    fake = FakeWorker(zctx, ctl.address, key, name, channel=True)
    _push_current(ctl)
    try:
        fake.join()
        yield ctl, fake
    finally:
        _pop_current(ctl)
        fake.close()
        ctl.close()
        zctx.term()


def test_a_nack_makes_the_sender_go_back_once_per_place() -> None:
    """A gap is answered with a NACK (an ACK with body [1]) and the controller resends from
    it at once; the same NACK again resends nothing (a peer with the key cannot make the
    controller resend at will), and a NACK further on goes back from there."""
    key = secrets.token_bytes(32)
    # Heartbeats rare enough that only the test's NACKs move ``resent``: the resend
    # timer (max(2 x heartbeat, liveness / 3) = 20 s) does not fire within the test.
    with _keyed_fake(key, "nacker", heartbeat_interval=10.0, liveness_timeout=60.0) as (
            ctl, fake):
        host = ctl._hosts[fake.index]
        dev = [d for d in ctl.devices() if d.host == fake.index]
        arrays = [cb.device_put(np.full(4, float(i)), dev[0]) for i in range(3)]
        deadline = time.monotonic() + 30
        while len(host.peer.unacked) < 3:  # the PUTs left and wait for an ack
            assert time.monotonic() < deadline, "the PUTs never left"
            fake.poll_in(0.05)
        head, waiting = host.peer.unacked[0][0], len(host.peer.unacked)
        base = ctl.stats()["resent"]

        def nack(ack: int) -> None:
            fake.sock.send_multipart([bytes(f) for f in encode(key, Envelope(
                int(Kind.ACK), fake.session, fake.ctl_session, 0, [1], ack=ack))])

        def resent_reaches(n: int) -> None:
            while ctl.stats()["resent"] < n:
                assert time.monotonic() < deadline, f"resent stayed below {n}"
                fake.poll_in(0.05)

        nack(head - 1)  # a gap right after what it acknowledged: all of it comes again
        resent_reaches(base + waiting)
        nack(head - 1)
        nack(head - 1)  # the same place twice more: nothing
        nack(head)  # one further on (the head arrived): the rest, once
        resent_reaches(base + 2 * waiting - 1)  # the four NACKs were taken, in order
        assert ctl.stats()["resent"] == base + 2 * waiting - 1
        assert ctl.hosts()[fake.index].state == "alive"
        del arrays


def test_a_peer_that_never_acknowledges_is_bounded_and_then_lost() -> None:
    key = secrets.token_bytes(32)
    window = 4 << 20
    with _keyed_fake(key, "deaf", heartbeat_interval=0.2, liveness_timeout=3.0,
                     send_window_bytes=window) as (ctl, fake):
        dev = [d for d in ctl.devices() if d.host == fake.index]
        arrays = [cb.device_put(np.full(1 << 19, float(i)), dev[0]) for i in range(16)]  # 64 MB
        del arrays  # dropped by the user: their frees queue behind the puts
        host = ctl._hosts[fake.index]
        held = 0
        deadline = time.monotonic() + 30
        while ctl.hosts()[fake.index].state == "alive":
            assert time.monotonic() < deadline, "a peer that never acknowledges stayed alive"
            fake.send(Kind.HEARTBEAT, P.Heartbeat(0, 0, 0, 0).to_wire(), ack=False)
            while fake.poll_in(0.05):
                pass
            held = max(held, host.peer.inflight)
        assert held <= window + (1 << 20), f"{held} bytes kept unacknowledged"
        assert ctl.stats()["resent"] < 40
        assert not host.peer.unacked and not host.peer.pending  # forgotten once lost


# -- 7. liveness never depends on one message's transfer time (shaped links) ---------------

netns = pytest.mark.netns


@pytest.fixture
def shaped() -> collections.abc.Iterator[Any]:
    from netbed import NetBed, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    bed = NetBed(hosts=1)
    try:
        bed.create()
        yield bed
    finally:
        bed.close()


@cb.colocated_python
def total(x: Any) -> Any:
    return x.sum(keepdims=True)


async def _shaped_round_trip(bed: Any, nbytes: int, *, rate: str | None = None,
                             delay: float = 0.0, loss: float = 0.0, liveness: float = 5.0,
                             during: Any = None) -> dict[str, Any]:
    """``nbytes`` up and down over host 0's shaped link; the controller's stats after.

    ``liveness`` is the liveness timeout (heartbeats at a fifth of it). ``rate`` shapes
    the link in the kernel (tbf), and so does ``loss`` (iptables drops that share of the
    worker's packets each way); ``delay`` (each way) goes through a
    :class:`netbed.Relay` between the worker and the controller."""
    from netbed import Relay

    relay = None
    async with cb.Controller(bed.bind(), hosts=0, key=bed.key, join_timeout=60,
                             liveness_timeout=liveness,
                             heartbeat_interval=liveness / 5) as ctl:
        connect = ctl.address
        if delay:
            port = int(ctl.address.rsplit(":", 1)[1])
            relay = Relay(bed.controller_ip, (bed.controller_ip, port), delay=delay)
            connect = f"tcp://{bed.controller_ip}:{relay.port}"
        try:
            if rate:
                bed.shape(0, rate)
            if loss:
                bed.lose(0, loss)
            bed.start_worker(0, connect, name="slow", devices=1)
            await ctl.wait_for_hosts(1, timeout=60)
            dev = ctl.devices()[0]
            data = np.arange(nbytes // 8, dtype=np.float64)
            x = cb.device_put(data, dev)
            if during is not None:
                await during()
            np.testing.assert_allclose(await cb.device_get(await total(x)), [data.sum()],
                                       rtol=1e-4)
            back = await cb.device_get(x)
            assert back.nbytes == nbytes and back[-1] == data[-1]
            assert [h.state for h in ctl.hosts()] == ["alive"]
            assert ctl.hosts()[0].pid == bed._procs[0].pid  # never rejoined
            stats = ctl.stats()
            if loss:
                stats["packets_dropped"] = bed.dropped(0)
            return stats
        finally:
            if relay is not None:
                relay.close()


@netns
async def test_a_transfer_of_1_7_liveness_timeouts_each_way_keeps_the_host(shaped: Any) -> None:
    """The issue's 80 MB at 80 Mbit/s (8.4 s) against a 5 s liveness timeout, at half
    the size and half the timeout: each way takes 1.7 timeouts, as there."""
    stats = await _shaped_round_trip(shaped, 40 << 20, rate="80mbit", liveness=2.5)
    assert stats["resent"] <= 8, stats["resent"]


@netns
async def test_200_ms_round_trip_with_1_percent_loss_keeps_the_host(shaped: Any) -> None:
    """The kernel drops 1 % of the worker's packets each way (real loss: TCP resends)."""
    from netbed import loss_unavailable_reason

    reason = loss_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    stats = await _shaped_round_trip(shaped, 40 << 20, rate="80mbit", delay=0.1, loss=0.01)
    assert stats["resent"] <= 16, stats["resent"]
    dropped = stats["packets_dropped"]
    assert dropped["INPUT"] > 0 and dropped["OUTPUT"] > 0, dropped


@netns
async def test_a_1_s_partition_in_the_middle_of_a_transfer_costs_nothing(shaped: Any) -> None:
    async def partition() -> None:
        await asyncio.sleep(1.0)  # the upload is under way (40 MB take 4 s at 80 Mbit/s)
        with shaped.cut_off(0):
            await asyncio.sleep(1.0)

    stats = await _shaped_round_trip(shaped, 40 << 20, rate="80mbit", during=partition)
    assert stats["resent"] <= 16, stats["resent"]


@netns
@pytest.mark.parametrize("relays", [0, 1], ids=["star", "relay"])
def test_uploads_faster_than_the_link_wait_with_bounded_bytes_queued(shaped: Any,
                                                                     relays: int) -> None:
    """A loop of puts over a 40 Mbit/s link: each waits while the host has
    ``max_queued_bytes`` queued, on a plain thread (in ``device_put``) and on an
    event loop (in ``wait_capacity``); what the controller holds stays bounded. Through
    a relay too: what it holds for the host until the host acknowledges it counts."""
    bound, size, n = 2 << 20, 1 << 19, 8
    ctl = cb.Controller(shaped.bind(), hosts=0, key=shaped.key, max_queued_bytes=bound,
                        relays=relays)
    ctl.start_in_thread()
    _push_current(ctl)
    try:
        shaped.shape(0, "40mbit")
        shaped.start_worker(0, ctl.address, name="slow", devices=1)
        ctl.run_sync(ctl.wait_for_hosts(1, timeout=60))
        assert [r["hosts"] for r in ctl.stats()["relays"]] == [[0]] * relays
        dev = ctl.devices()[0]
        queued: list[int] = []

        def put(i: int) -> cb.Array:
            x = cb.device_put(np.full(size // 8, float(i)), dev)
            queued.append(ctl.stats()["hosts"][0]["queued_bytes"])
            return x

        arrays = [put(i) for i in range(n)]  # a plain thread: device_put waits

        async def on_loop() -> list[cb.Array]:
            out = []
            for i in range(n, 2 * n):
                await ctl.wait_capacity()  # an event loop never blocks in device_put
                out.append(put(i))
            return out

        arrays += ctl.run_sync(on_loop())
        # Bounded by the bound plus the one put admitted below it (4 MiB without it).
        assert max(queued) <= bound + size, queued
        assert max(queued) >= bound // 2, f"the link never held the puts back: {queued}"
        sums = [cb.block_until_ready(total(x)) for x in arrays]
        assert [float(np.asarray(s)[0]) for s in sums] == [
            float(i) * (size // 8) for i in range(2 * n)]
        assert [h.state for h in ctl.hosts()] == ["alive"]
        assert ctl.hosts()[0].pid == shaped._procs[0].pid  # never rejoined
        assert ctl.stats()["hosts_dropped"] == 0
    finally:
        _pop_current(ctl)
        ctl.close()


@pytest.mark.parametrize("ending", ["host lost", "controller closed"])
def test_a_put_waiting_for_room_ends_when_its_host_is_lost_or_the_controller_closes(
        ending: str) -> None:
    """A plain thread blocked in ``device_put`` (its host never acknowledges: the
    worker is stopped) goes on when that host is lost, and fails with
    ``ControllerClosedError`` when the controller closes; nothing waits forever."""
    import threading

    bound = 1 << 20
    # (the host must stay alive, stopped, until the second put waits: 10 s, for a loaded
    # machine; then killed, it is lost at once: its connection closes)
    with cb.local_cluster(hosts=1, max_queued_bytes=bound, liveness_timeout=10.0) as ctl:
        dev, pid = ctl.devices()[0], ctl.hosts()[0].pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            first = cb.device_put(np.ones(bound // 8), dev)  # admitted, never acknowledged
            asyncio.run(eventually(lambda: ctl.stats()["hosts"][0]["queued_bytes"] >= bound,
                                   30, "the first put to be held"))
            ended: list[object] = []

            def second() -> None:
                _push_current(ctl)
                try:
                    ended.append(cb.device_put(np.ones(8), dev))
                except Exception as exc:  # the test reads which error it was
                    ended.append(exc)
                finally:
                    _pop_current(ctl)

            thread = threading.Thread(target=second, daemon=True)
            thread.start()
            asyncio.run(eventually(lambda: ctl._uploads._blocked == 1, 30,
                                   "the second put to wait for room"))
            assert ended == []
            if ending == "host lost":
                os.kill(pid, signal.SIGKILL)
                thread.join(60)
                assert len(ended) == 1 and isinstance(ended[0], cb.Array), ended
                with pytest.raises(cb.HostLostError):
                    cb.device_get(first)
            else:
                ctl.close()
                thread.join(60)
                assert len(ended) == 1 and isinstance(ended[0], cb.ControllerClosedError), ended
            assert not thread.is_alive()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# -- 6. unknown peers cost nothing --------------------------------------------------------


FLOOD = """
import sys, time, zmq
address, seconds = sys.argv[1], float(sys.argv[2])
ctx = zmq.Context()
socks = []
for _ in range(4):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 64)
    s.connect(address)
    socks.append(s)
big, small = bytes(64 << 20), bytes(1 << 19)
for s in socks:  # 3 x 64 MiB on each connection (one buffer, sent zero-copy)
    for _ in range(3):
        s.send_multipart([b"h", big, b"m" * 32], copy=False)
time.sleep(seconds / 2)  # time for them to cross (or to be refused)
sent, end = 0, time.monotonic() + seconds / 2
while time.monotonic() < end:  # then many messages just over an unknown peer's limit
    for s in socks:
        try:
            s.send_multipart([b"\\x99" + small[:100], small, b"m" * 32], zmq.NOBLOCK)
            sent += 1
        except zmq.Again:
            pass
print(sent)
for s in socks:
    s.close(0)
ctx.term()
"""


def test_an_unauthenticated_flood_costs_the_loop_nothing(workers: Workers) -> None:
    ctl = cb.Controller("tcp://127.0.0.1:*", hosts=0, key=_key(workers), **FAST)
    ctl.start_in_thread()
    zctx: zmq.Context[Any] = zmq.Context()
    _push_current(ctl)
    try:
        workers.start(ctl.address, "steady")
        ctl.run_sync(ctl.wait_for_hosts(1, timeout=120))
        probe = StallProbe(ctl)
        time.sleep(2.0)  # the loop's own longest stall, without a flood, as a baseline
        baseline, _ = probe.longest, probe.reset()
        # The flood comes from another process, as an attacker's would.
        flood = subprocess.run([sys.executable, "-c", FLOOD, ctl.address, "6"],
                               capture_output=True, text=True, timeout=120)
        assert flood.returncode == 0, flood.stderr[-2000:]
        assert int(flood.stdout) > 100, "the flood did not get going"
        # What the loop itself spent at a stretch (wall time includes a loaded
        # machine's scheduling: bounded loosely; it was 8.4 s in the issue).
        assert probe.longest_cpu < 0.05, f"the loop worked {probe.longest_cpu * 1e3:.0f} ms"
        assert probe.longest < 0.5 + baseline, (
            f"the loop stalled {probe.longest * 1e3:.0f} ms (baseline {baseline * 1e3:.0f} ms)")
        probe.stop()
        assert ctl.stats()["dropped"].get("oversized", 0) > 0
        assert ctl.hosts()[0].state == "alive"
        dev = ctl.devices()[0]
        x = cb.device_put(np.arange(3.0), dev)
        np.testing.assert_array_equal(np.asarray(plus_one(x)), np.arange(3.0) + 1)
    finally:
        _pop_current(ctl)
        ctl.close()
        zctx.term()
