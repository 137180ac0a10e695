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
import pytest
from lifecycle import bounded, eventually, in_async, outcome

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
    fut = in_async(lambda: hs.block.specialize(devices=[ctl.devices()[0]])(gate))
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
        while fut._waiter is None:  # the awaiting thread's waiter is registered
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
    tok = hs.token.specialize(devices=[dev])
    # queued behind the gate (one task: one stream): they end back to back
    first, futs = in_async(lambda: (hs.block.specialize(devices=[dev])(gate),
                                    [tok(i) for i in range(60)]))
    for f in futs:
        f.add_done_callback(_boom)
    _touch(gate)
    first.result(timeout=30)
    for i, f in enumerate(futs):
        out = f.result(timeout=30)  # TimeoutError: its reply was lost with the batch
        assert int(np.asarray(cb.device_get(out))) == i


async def test_1_raising_callback_never_kills_the_liveness_tick(tmp_path: Path) -> None:
    """A callback raising ``BaseException`` when the liveness tick fails a lost host's call
    does not end the liveness task: the healthy host stays, and its calls still work."""
    live = 1.5
    # (the block view: there a lost host costs only its own calls; in a job, every host's)
    async with cb.local_cluster(hosts=2, heartbeat_interval=0.2, liveness_timeout=live,
                                jax_distributed=False) as ctl:
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


# -- 2: a handle belongs to the controller that made it ------------------------------------


async def test_2_handles_of_another_controller_are_refused() -> None:
    """A ``cb.Array`` or ``cb.Future`` made on a controller that has since closed, used with
    the next one, raises ``ValueError`` naming both (ids restart per controller: it used to
    resolve to whatever the new hosts held under the same number)."""
    async with cb.local_cluster(hosts=1, devices_per_host=2) as old:
        dev = old.devices()[0]
        stale = cb.device_put(np.zeros(4, np.int32), dev)
        stale_fut = hs.token.specialize(devices=[dev])(3)
        await bounded(stale_fut)
    async with cb.local_cluster(hosts=1, devices_per_host=2) as ctl:
        dev = ctl.devices()[0]
        mine = cb.device_put(np.full(4, 7, np.int32), dev)
        await bounded(cb.block_until_ready(mine))
        for handle, kind in ((stale, "cb.Array"), (stale_fut, "cb.Future")):
            with pytest.raises(ValueError, match=f"this {kind} belongs to the controller") as e:
                hs.ident(handle)
            assert repr(old) in str(e.value) and repr(ctl) in str(e.value), str(e.value)
            with pytest.raises(ValueError, match="belongs to the controller"):
                hs.ident.specialize(devices=[dev])([handle])  # inside a pytree
            with pytest.raises(ValueError, match="belongs to the controller"):
                hs.unbox.specialize(devices=[dev])(hs.Box(handle))  # inside a plain object
        with pytest.raises(ValueError, match="belongs to the controller"):
            cb.device_get([mine, stale])
        with pytest.raises(ValueError, match="belongs to the controller"):
            cb.device_put(stale, cb.SingleDeviceSharding(ctl.devices()[1]))  # a reshard
        out = await bounded(hs.ident(mine))  # the controller's own handles still work
        assert list(np.asarray(await bounded(cb.device_get(out)))) == [7, 7, 7, 7]


# -- 3: sharded outputs must agree on their dtype across hosts -----------------------------


def test_3_sharded_outputs_with_different_dtypes_are_refused(ctl: cb.Controller) -> None:
    """A sharded output whose hosts return different dtypes fails as a replicated one does,
    instead of taking host 0's dtype and casting the others' blocks on fetch."""
    mesh = cb.Mesh(np.array(ctl.devices(), dtype=object), ("x",))
    x = cb.device_put(np.full(8, 300.75, np.float32),
                      cb.NamedSharding(mesh, cb.PartitionSpec("x")))
    with pytest.raises(ValueError, match=r"output 0 is sharded, so all hosts must agree on its "
                                         r"dtype.*float32.*uint8"):
        cb.block_until_ready(hs.cast_on(x, ctl.hosts()[1].pid))
    same = cb.block_until_ready(hs.cast_on(x, -1))  # every host float32: accepted
    assert same.dtype == np.float32
    assert list(np.asarray(cb.device_get(same))) == [300.75] * 8


# -- 4: an array inside a plain object is checked against the call's device set ------------


def test_4_array_inside_a_plain_object_must_match_the_call(ctl: cb.Controller) -> None:
    """A ``cb.Array`` inside an argument that is no pytree node (an attribute of a plain
    object) must live on the call's devices: a call on host 0 alone used to receive host 0's
    half of a two-host array as if it were the whole."""
    devs = ctl.devices()
    mesh = cb.Mesh(np.array(devs, dtype=object), ("x",))
    x = cb.device_put(np.arange(8, dtype=np.int32),
                      cb.NamedSharding(mesh, cb.PartitionSpec("x")))
    host0 = [d for d in devs if d.host == 0]
    with pytest.raises(ValueError, match=r"not a pytree node.*pass it as a pytree leaf"):
        hs.unbox.specialize(devices=host0)(hs.Box(x))
    # On the call's own devices it travels as before: each host gets its block.
    out = cb.block_until_ready(hs.unbox_beside(x, hs.Box(x)))
    assert list(np.asarray(cb.device_get(out))) == list(range(8))


# -- 6: a call whose input future was cancelled ends cancelled -----------------------------


def test_6_input_cancelled_before_the_call(ctl: cb.Controller, tmp_path: Path) -> None:
    """An input cancelled before the dependent call is made: the call is cancelled (and
    never sent), instead of failing with ``KeyError('call result N is not on host 0')``."""
    dev = ctl.devices()[0]
    gate = str(tmp_path / "gate")
    try:
        a = in_async(lambda: hs.block.specialize(devices=[dev])(gate))
        assert a.cancel()
        b = in_async(lambda: hs.ident(a))
        assert b.cancelled()
        with pytest.raises(asyncio.CancelledError):
            b.result(timeout=30)
    finally:
        _touch(gate)


@pytest.mark.parametrize("where", ["same_stream", "other_stream"])
def test_6_input_cancelled_after_the_call(ctl: cb.Controller, tmp_path: Path,
                                          where: str) -> None:
    """An input cancelled after the dependent call was sent (it waits on the host, in the
    input's stream or another one): the call ends cancelled, not with a ``RemoteError``
    (``CancelledError``) or a ``KeyError``."""
    dev = ctl.devices()[0]
    gate = str(tmp_path / "gate")
    try:
        if where == "same_stream":
            def both() -> tuple[cb.Future[Any], cb.Future[Any]]:
                first = hs.block.specialize(devices=[dev])(gate)
                return first, hs.ident(first)

            a, b = in_async(both)
        else:
            a = in_async(lambda: hs.block.specialize(devices=[dev])(gate))
            box: list[cb.Future[Any]] = []
            t = threading.Thread(target=lambda: box.append(in_async(lambda: hs.ident(a))))
            t.start()
            t.join(30)
            b = box[0]
        assert a.cancel()
        _touch(gate)
        try:
            b.result(timeout=30)
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            raise AssertionError(f"the dependent call ended with {exc!r}, not cancelled") from exc
        assert b.cancelled()
        # The stream goes on: a later call runs.
        out = cb.block_until_ready(hs.token.specialize(devices=[dev])(9))
        assert int(np.asarray(cb.device_get(out))) == 9
    finally:
        _touch(gate)


# -- 8: output layouts of calls without array arguments ------------------------------------


def test_8_method_without_arguments_returns_sharded_state(ctl: cb.Controller) -> None:
    """A method without arguments (specialized with ``devices=``) returning state built from
    a sharded input gets the global array back from the hosts' own shardings (it used to
    fail with an internal ``Resource axis: x ... not found in mesh: ('devices',)``)."""
    devs = ctl.devices()
    mesh = cb.Mesh(np.array(devs, dtype=object), ("x",))
    x = cb.device_put(np.arange(8, dtype=np.float32), cb.NamedSharding(mesh, cb.PartitionSpec("x")))
    h = hs.Holder()
    cb.block_until_ready(h.keep(x))
    out = h.read.specialize(devices=devs)()
    assert out.shape == (8,) and out.sharding == x.sharding, out.sharding
    assert list(np.asarray(cb.device_get(out))) == [2.0 * i for i in range(8)]
    cb.close(h)


def test_8_function_without_arguments_on_a_captured_2d_mesh(ctl: cb.Controller) -> None:
    """A function without array arguments returning per-host blocks on a captured 2-D mesh
    gets one global array on that mesh."""
    devs = ctl.devices()
    mesh = cb.Mesh(np.array(devs, dtype=object).reshape(2, -1), ("hosts", "d"))
    sharding = cb.NamedSharding(mesh, cb.PartitionSpec("hosts", "d"))
    out = hs.fill_on.specialize(devices=devs)(sharding)
    assert out.shape == (2, 4) and out.sharding == sharding, out.sharding
    got = np.asarray(cb.device_get(out))
    first = [min(d.id for d in devs if d.host == h) for h in (0, 1)]
    assert got.tolist() == [[first[0]] * 4, [first[1]] * 4]


def test_8_no_fitting_layout_names_the_output_and_what_to_return(ctl: cb.Controller) -> None:
    """Where the hosts' layouts form no global sharding, the error names the output and
    says what to return instead (and the 1-D mesh's axis a call without arguments gets)."""
    with pytest.raises(ValueError, match=r"output 0: the hosts returned layouts that do not "
                                         r"form one global sharding.*axis 'devices'"):
        cb.block_until_ready(hs.own_axis_names.specialize(devices=ctl.devices())())


# -- also: what a worker's error may be rebuilt as; run_sync's timeout; long keys ----------


@pytest.mark.parametrize("which", ["host_lost", "stop", "key"])
def test_also_a_worker_never_raises_colobus_errors_or_stopiteration(ctl: cb.Controller,
                                                                     which: str) -> None:
    """Errors of colobus itself and ``StopIteration`` raised by host code reach the caller
    as ``cb.RemoteError`` (a worker cannot fake a lost host or end the caller's loop);
    builtins and user ``Exception`` classes keep their type."""
    expected = KeyError if which == "key" else cb.RemoteError
    with pytest.raises(expected) as info:
        cb.block_until_ready(hs.raise_named.specialize(devices=ctl.devices())(which))
    assert type(info.value) is expected
    if which == "host_lost":
        assert "HostLostError" in str(info.value)


def test_also_an_init_that_raises_stopiteration_fails_the_objects_calls(
        ctl: cb.Controller) -> None:
    """An ``__init__`` raising StopIteration fails the object's calls with that error's
    stand-in (asyncio refuses StopIteration in a future: the construction hung)."""
    dev = ctl.devices()[0]
    x = cb.device_put(np.zeros(1, np.float32), cb.SingleDeviceSharding(dev))
    obj = hs.StopsInInit()
    with pytest.raises(RuntimeError, match="StopIteration: forged in __init__"):
        obj.get(x).result(timeout=60)


def test_also_run_sync_cancels_the_coroutine_on_timeout(ctl: cb.Controller) -> None:
    """``ctl.run_sync(coro, timeout=)`` that times out cancels ``coro`` on the loop instead
    of leaving it running unseen."""
    cancelled = threading.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError):
        ctl.run_sync(slow(), timeout=0.2)
    assert cancelled.wait(20), "the coroutine kept running after run_sync timed out"


def test_also_every_byte_of_a_long_key_counts() -> None:
    """Keys longer than BLAKE2b's 64-byte key are hashed into the MAC key, not cut: two
    keys that differ only after byte 64 authenticate different messages."""
    from colobus._wire.envelope import mac

    a = bytes(range(64)) + b"A" * 16
    b = bytes(range(64)) + b"B" * 16
    assert mac(a, b"header", b"payload") != mac(b, b"header", b"payload")
    assert mac(a, b"header", b"payload") == mac(bytes(a), b"header", b"payload")
    short = bytes(range(40))
    assert mac(short, b"h", b"p") != mac(short + b"x", b"h", b"p")


# -- 5: calls stuck in an ended session cost the next session nothing ----------------------


async def _in_task(fn: Any, *args: Any) -> cb.Future[Any]:
    """Call ``fn`` from a task of its own: its own stream, so its own pool job on the host."""
    return fn(*args)  # type: ignore[no-any-return]


async def test_5_stuck_calls_never_poison_a_standalone_worker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A standalone worker left with calls still running from a controller that went (blocked
    for good, then the driver left) serves the next controller: its call pool grows past the
    stuck threads, ``ctl.stats()`` reports them, and a plain call that finds every thread
    busy fails with a ``TimeoutError`` after the documented time instead of waiting forever."""
    from lifecycle import workers

    from colobus._wire.keys import write_key

    n = 64  # the pool's threads (the default): a driver left that many calls behind
    monkeypatch.setenv("COLOBUS_CALL_START_TIMEOUT", "3")
    key_file = str(tmp_path / "key")
    key = write_key(key_file)
    never = str(tmp_path / "never")  # no test opens it: those calls stay stuck
    gate = str(tmp_path / "gate")
    with workers(key_file) as w:
        async with cb.Controller("tcp://127.0.0.1:*", hosts=0, key=key, join_timeout=60) as a:
            bind = a.address
            w.start(bind, "stay")
            await a.wait_for_hosts(1, timeout=60)
            block = hs.block_marked.specialize(devices=a.devices())
            started = [str(tmp_path / f"started{i}") for i in range(n)]
            stuck = [await asyncio.create_task(_in_task(block, never, s)) for s in started]
            await eventually(lambda: all(os.path.exists(s) for s in started), 60,
                             "every call running on the host")
        for f in stuck:
            assert isinstance(await outcome(f, 20), cb.ControllerClosedError)
        async with cb.Controller(bind, hosts=1, key=key, join_timeout=60) as b:
            dev = b.devices()
            out = await bounded(hs.token.specialize(devices=dev)(7), 20,
                                "a plain call on a worker with stuck threads")
            assert int(np.asarray(await bounded(cb.device_get(out)))) == 7
            await eventually(lambda: b.stats()["hosts"][0]["stuck"] == n, 20,
                             "the host's heartbeat reporting its stuck threads")
            host = b.stats()["hosts"][0]
            # (the token call may have run inline, on the thread that received it)
            assert host["stuck"] == n and host["threads"] >= n, host
            # Every thread this session may use busy: the next call fails, clearly.
            block = hs.block_marked.specialize(devices=dev)
            started = [str(tmp_path / f"busy{i}") for i in range(n)]
            busy = [await asyncio.create_task(_in_task(block, gate, s)) for s in started]
            await eventually(lambda: all(os.path.exists(s) for s in started), 60,
                             "this session's calls running on the host")
            # the pool grew past the stuck threads: n more calls run beside them
            await eventually(lambda: b.stats()["hosts"][0]["threads"] >= 2 * n, 20,
                             "the host's heartbeat reporting its grown pool")
            try:
                late = await asyncio.create_task(_in_task(hs.token.specialize(devices=dev), 2))
                err = await outcome(late, 30, "a call that cannot start")
                assert isinstance(err, TimeoutError), repr(err)
                assert "could not start within 3 s" in str(err) and f"{n} of them stuck" in str(
                    err), str(err)
            finally:
                _touch(gate)
            for f in busy:
                await bounded(f)
            out = await bounded(hs.token.specialize(devices=dev)(8))  # the host serves on
            assert int(np.asarray(await bounded(cb.device_get(out)))) == 8


# -- 7: code is freed on hosts when its function goes --------------------------------------


def _closure(i: int) -> Any:
    data = np.full(1 << 18, i, np.float32)  # 1 MiB, captured: pickled with the code

    @cb.colocated_python
    def first() -> Any:
        return np.float32(data[0])

    return first


def test_7_code_is_freed_on_hosts_when_its_function_goes(ctl: cb.Controller) -> None:
    """Closures pickled by value (with what they captured) stay on hosts only while the
    controller holds their function (or a call made with it); ``ctl.stats()`` counts the
    code each host holds (objects and bytes)."""
    import gc

    def held() -> dict[int, tuple[int, int]]:
        """What each host reported holding in its latest heartbeat (one a second)."""
        hosts = ctl.stats()["hosts"]
        return {i: (h["code"], h["code_bytes"]) for i, h in hosts.items() if h["state"] == "alive"}

    def beat() -> None:
        """Wait for every host's next heartbeat: its figures are current after it."""
        before = {i: id(h.health) for i, h in enumerate(ctl._hosts.hosts)}
        deadline = time.monotonic() + 20
        while any(id(h.health) == before[i] for i, h in enumerate(ctl._hosts.hosts)
                  if h.alive):
            assert time.monotonic() < deadline, "no heartbeat from the hosts"
            time.sleep(0.05)

    beat()
    base = held()
    devs = ctl.devices()
    fns = [_closure(i) for i in range(5)]
    for i, f in enumerate(fns):
        out = f.specialize(devices=devs)()
        assert float(np.asarray(cb.device_get(out))) == i
    beat()
    grown = held()
    for i, (n, nbytes) in grown.items():
        assert n >= base[i][0] + 5 and nbytes >= base[i][1] + 5 * (1 << 20), (base, grown)
    del fns, f, out
    deadline = time.monotonic() + 30
    while True:
        gc.collect()
        now = held()
        if all(now[i][1] < base[i][1] + (1 << 20) for i in now):
            break
        assert time.monotonic() < deadline, f"code not freed on hosts: {base} -> {now}"
        time.sleep(0.1)
    assert all(now[i][0] <= base[i][0] for i in now), (base, now)


async def test_1_a_dead_heartbeats_task_of_a_worker_is_restarted() -> None:
    """A worker's heartbeats task that dies unexpectedly is logged and started again: the
    host keeps its session (it used to fall silent and be declared lost)."""
    live = 1.5
    async with cb.local_cluster(hosts=1, heartbeat_interval=0.2, liveness_timeout=live) as ctl:
        dev = ctl.devices()
        out = await bounded(hs.break_heartbeats_once.specialize(devices=dev)())
        assert int(np.asarray(await bounded(cb.device_get(out)))) == 1
        deadline = time.monotonic() + 3 * live
        while time.monotonic() < deadline:  # time for a silent host to be declared lost
            assert ctl.hosts()[0].state == "alive"
            await asyncio.sleep(0.1)
        out = await bounded(hs.token.specialize(devices=ctl.devices())(3))
        assert int(np.asarray(await bounded(cb.device_get(out)))) == 3
        assert len(ctl.hosts()) == 1 and ctl.hosts()[0].state == "alive"
