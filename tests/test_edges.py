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
from lifecycle import bounded, outcome

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
    fut = hs.block.specialize(devices=[ctl.devices()[0]])(gate)
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
        while len(fut._callbacks or ()) < 3:  # the awaiting thread's waker is registered
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
    first = hs.block.specialize(devices=[dev])(gate)
    tok = hs.token.specialize(devices=[dev])
    futs = [tok(i) for i in range(60)]  # queued behind the gate: they end back to back
    for f in futs:
        f.add_done_callback(_boom)
    _touch(gate)
    first.result(timeout=30)
    for i, f in enumerate(futs):
        out = f.result(timeout=30)  # TimeoutError: its reply was lost with the batch
        assert int(np.asarray(cb.device_get(out).result(timeout=30))) == i


async def test_1_raising_callback_never_kills_the_liveness_tick(tmp_path: Path) -> None:
    """A callback raising ``BaseException`` when the liveness tick fails a lost host's call
    does not end the liveness task: the healthy host stays, and its calls still work."""
    live = 1.5
    async with cb.local_cluster(hosts=2, heartbeat_interval=0.2, liveness_timeout=live) as ctl:
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
        hs.cast_on(x, ctl.hosts()[1].pid).result(timeout=30)
    same = hs.cast_on(x, -1).result(timeout=30)  # every host float32: accepted
    assert same.dtype == np.float32
    assert list(np.asarray(cb.device_get(same).result(timeout=30))) == [300.75] * 8


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
    out = hs.unbox_beside(x, hs.Box(x)).result(timeout=30)
    assert list(np.asarray(cb.device_get(out).result(timeout=30))) == list(range(8))


# -- 6: a call whose input future was cancelled ends cancelled -----------------------------


def test_6_input_cancelled_before_the_call(ctl: cb.Controller, tmp_path: Path) -> None:
    """An input cancelled before the dependent call is made: the call is cancelled (and
    never sent), instead of failing with ``KeyError('call result N is not on host 0')``."""
    dev = ctl.devices()[0]
    gate = str(tmp_path / "gate")
    try:
        a = hs.block.specialize(devices=[dev])(gate)
        assert a.cancel()
        b = hs.ident(a)
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
        a = hs.block.specialize(devices=[dev])(gate)
        if where == "same_stream":
            b = hs.ident(a)
        else:
            box: list[cb.Future[Any]] = []
            t = threading.Thread(target=lambda: box.append(hs.ident(a)))
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
        out = hs.token.specialize(devices=[dev])(9).result(timeout=30)
        assert int(np.asarray(cb.device_get(out).result(timeout=30))) == 9
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
    h.keep(x).result(timeout=30)
    out = h.read.specialize(devices=devs)().result(timeout=30)
    assert out.shape == (8,) and out.sharding == x.sharding, out.sharding
    assert list(np.asarray(cb.device_get(out).result(timeout=30))) == [2.0 * i for i in range(8)]
    h.close()


def test_8_function_without_arguments_on_a_captured_2d_mesh(ctl: cb.Controller) -> None:
    """A function without array arguments returning per-host blocks on a captured 2-D mesh
    gets one global array on that mesh."""
    devs = ctl.devices()
    mesh = cb.Mesh(np.array(devs, dtype=object).reshape(2, -1), ("hosts", "d"))
    sharding = cb.NamedSharding(mesh, cb.PartitionSpec("hosts", "d"))
    out = hs.fill_on.specialize(devices=devs)(sharding).result(timeout=30)
    assert out.shape == (2, 4) and out.sharding == sharding, out.sharding
    got = np.asarray(cb.device_get(out).result(timeout=30))
    first = [min(d.id for d in devs if d.host == h) for h in (0, 1)]
    assert got.tolist() == [[first[0]] * 4, [first[1]] * 4]


def test_8_no_fitting_layout_names_the_output_and_what_to_return(ctl: cb.Controller) -> None:
    """Where the hosts' layouts form no global sharding, the error names the output and
    says what to return instead (and the 1-D mesh's axis a call without arguments gets)."""
    with pytest.raises(ValueError, match=r"output 0: the hosts returned layouts that do not "
                                         r"form one global sharding.*axis 'devices'"):
        hs.own_axis_names.specialize(devices=ctl.devices())().result(timeout=30)


# -- also: what a worker's error may be rebuilt as; run_sync's timeout; long keys ----------


@pytest.mark.parametrize("which", ["host_lost", "stop", "key"])
def test_also_a_worker_never_raises_colobus_errors_or_stopiteration(ctl: cb.Controller,
                                                                     which: str) -> None:
    """Errors of colobus itself and ``StopIteration`` raised by host code reach the caller
    as ``cb.RemoteError`` (a worker cannot fake a lost host or end the caller's loop);
    builtins and user ``Exception`` classes keep their type."""
    fut = hs.raise_named.specialize(devices=ctl.devices())(which)
    expected = KeyError if which == "key" else cb.RemoteError
    with pytest.raises(expected) as info:
        fut.result(timeout=30)
    assert type(info.value) is expected
    if which == "host_lost":
        assert "HostLostError" in str(info.value)


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
