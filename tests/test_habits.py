"""JAX's habits off the controller's loop thread, on the shared ``with`` cluster.

- ``cb.block_until_ready(y)`` as a statement waits; ``y.is_ready()`` is a bool;
  ``cb.device_get`` returns numbers and takes calls' futures in the tree; a call returns
  its arrays; so on every thread but the controller's own loop thread (a thread running
  another event loop, as a notebook's, included: there ``await arr`` waits for its call);
  on that thread all four are futures to await.
- The first call of a function or method whose output specs are unknown returns once its
  hosts have run it; later calls, and calls with ``out_specs_fn``, return at once; two
  first calls from a thread pool run at the same time on the hosts.
- A failed call whose future goes unread is logged once, naming the function and host.
- ``cb.Array.addressable_data``; ``axis_types`` on ``cb.make_mesh`` and ``cb.Mesh``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import habits_hostside as hh
import jax
import numpy as np
import pytest
import ready_hostside as rh
from jax.sharding import AxisType

import colobus as cb
from colobus._model.devices import jax_axis_types

P = cb.PartitionSpec


def _over_hosts(x: np.ndarray[Any, Any]) -> cb.Array:
    """``x`` (first dim 2) split between the two hosts, replicated on each host's devices."""
    mesh = cb.Mesh(np.array(cb.devices()).reshape(2, 4), ("hosts", "devices"))
    return cb.device_put(x, cb.NamedSharding(mesh, P("hosts")))


# -- device_get, block_until_ready, is_ready ------------------------------------------------


def test_block_until_ready_as_a_statement_waits(ctl: cb.Controller, tmp_path: Path) -> None:
    marks = [tmp_path / "host-0", tmp_path / "host-1"]

    @cb.colocated_python
    def slow_mark(x: Any, folder: str) -> Any:
        time.sleep(0.3)  # (makes a wait that returned early see no mark)
        Path(folder, f"host-{cb.host_index()}").write_text("done")
        return x * 2

    step = slow_mark.specialize(out_specs_fn=lambda x, folder: x)  # calls return at once
    y = step(_over_hosts(np.ones((2, 3), np.float32)), str(tmp_path))
    cb.block_until_ready(y)  # a statement, as in a JAX script: it waits
    assert all(m.read_text() == "done" for m in marks)
    assert cb.block_until_ready(y) is y  # an array: the same object back, ready
    assert jax.block_until_ready(y) is y and y.block_until_ready() is y  # JAX's, as JAX


def test_is_ready_is_a_bool_in_plain_code(ctl: cb.Controller) -> None:
    dev = next(d for d in cb.devices() if d.host == 1)
    x = cb.device_put(np.arange(4, dtype=np.float32), cb.SingleDeviceSharding(dev))
    try:
        y = rh.hold(x)  # (a first call: once it ran) its value "still computing" until released
        taken = []
        if y.is_ready():  # a Future here would always be taken (it is truthy)
            taken.append("ready")
        assert taken == [] and y.is_ready() is False
        cb.block_until_ready(rh.release(x))
        cb.block_until_ready(y)
        assert y.is_ready() is True
    finally:
        cb.block_until_ready(rh.release(x))
        cb.block_until_ready(rh.unpatch(x))


def test_device_get_prints_numbers_and_takes_futures(ctl: cb.Controller,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    @cb.colocated_python
    def plus(x: Any, n: int) -> Any:
        return x + n

    x = _over_hosts(np.arange(6, dtype=np.float32).reshape(2, 3))
    print(cb.device_get(x))
    assert "[[0. 1. 2.]\n [3. 4. 5.]]" in capsys.readouterr().out
    got = cb.device_get({"a": plus(x, 1), "b": [x, "kept"], "c": plus(plus(x, 1), 1)})
    np.testing.assert_array_equal(got["a"], np.arange(6).reshape(2, 3) + 1)
    np.testing.assert_array_equal(got["b"][0], np.arange(6).reshape(2, 3))
    assert got["b"][1] == "kept"
    np.testing.assert_array_equal(got["c"], np.arange(6).reshape(2, 3) + 2)
    ready = cb.block_until_ready([plus(x, 3)])  # a future in the tree: its value, ready
    assert isinstance(ready[0], cb.Array) and ready[0].is_ready() is True


def _saver() -> Any:
    """A fresh function (its first call still to come) that leaves a file per host."""

    @cb.colocated_python
    def save(x: Any, folder: str) -> Any:
        time.sleep(0.2)  # (makes a first call that returned early see no file)
        Path(folder, f"saved-{cb.host_index()}").write_text("done")
        return x

    return save


async def _in_a_loop_of_its_own(x: cb.Array, folder: Path) -> dict[str, Any]:
    """What a thread running an event loop other than the controller's sees."""
    asyncio.get_running_loop()  # (raises where no loop runs: this must be async code)
    save = _saver()
    first = save(x, str(folder))  # its array, once its hosts ran it (a first call)
    seen = {"first": first, "files": sorted(p.name for p in folder.glob("saved-*")),
            "got": cb.device_get(x), "ready": cb.block_until_ready(x), "probe": x.is_ready()}
    seen["awaited"] = await first  # an array is awaitable in any loop (colobus's)
    later = save(x, str(folder))  # its array at once, the call running
    seen["later"] = later
    seen["later_awaited"] = await later
    return seen


async def test_a_thread_running_another_event_loop_blocks_as_jax(
        ctl: cb.Controller, tmp_path: Path) -> None:
    """A ``with`` cluster's controller runs on a loop thread of its own: a thread running
    some other event loop (pytest's here, a Jupyter kernel's in a notebook, an
    ``asyncio.run`` in a plain thread) is not that thread, so the helpers block and
    return values, a call returns its arrays and a first call waits for its hosts, as
    JAX's; ``await`` of an array waits for its call there without blocking the loop."""
    x = _over_hosts(np.ones((2, 2), np.float32))
    here = tmp_path / "here"
    there = tmp_path / "there"
    here.mkdir()
    there.mkdir()
    for seen in (await _in_a_loop_of_its_own(x, here),  # pytest's loop, the notebook's case
                 await asyncio.to_thread(asyncio.run, _in_a_loop_of_its_own(x, there))):
        assert isinstance(seen["first"], cb.Array) and seen["first"].is_ready() is True
        assert seen["files"] == ["saved-0", "saved-1"], seen
        assert isinstance(seen["got"], np.ndarray)
        np.testing.assert_array_equal(seen["got"], np.ones((2, 2)))
        assert seen["ready"] is x and seen["probe"] is True
        assert seen["awaited"] is seen["first"]
        assert isinstance(seen["later"], cb.Array) and seen["later_awaited"] is seen["later"]
        np.testing.assert_array_equal(cb.device_get(seen["later"]), np.ones((2, 2)))


async def test_an_array_awaited_on_another_loop_waits_for_its_call_without_blocking_it(
        ctl: cb.Controller, tmp_path: Path) -> None:
    """colobus's ``await arr`` (pytest's loop here, beside the ``with`` cluster): it waits
    until the array's call ended while the loop runs on, returns the array, raises the
    call's error; a task cancelled while it awaits leaves the call running."""
    gate = tmp_path / "gate"

    @cb.colocated_python
    def gated(x: Any, path: str) -> Any:
        hh.wait_for_file(path)
        return x * 2

    @cb.colocated_python
    def broken(x: Any) -> Any:
        raise KeyError("awaited on purpose")

    x = _over_hosts(np.ones((2, 2), np.float32))
    assert await x is x  # an upload: at once
    y = gated.specialize(out_specs_fn=lambda x, path: x)(x, str(gate))  # at once, pending

    async def wait_for(a: cb.Array) -> cb.Array:
        return await a

    waiting, quitter = asyncio.ensure_future(wait_for(y)), asyncio.ensure_future(wait_for(y))
    await asyncio.sleep(0.05)  # this loop runs on while both wait (the gate is closed)
    assert not waiting.done() and y.is_ready() is False
    quitter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await quitter
    gate.write_text("open")  # written by this loop, while `waiting` awaits
    assert await asyncio.wait_for(waiting, 60) is y  # (its call was not cancelled)
    np.testing.assert_array_equal(cb.device_get(y), np.full((2, 2), 2.0))
    with pytest.raises(KeyError, match="awaited on purpose"):
        await broken.specialize(out_specs_fn=lambda x: x)(x)


def test_the_controllers_loop_thread_gets_futures_and_first_calls_return_at_once(
        ctl: cb.Controller, tmp_path: Path) -> None:
    """On the controller's own loop thread (async code under ``async with``; here a
    coroutine run there) nothing blocks: every helper is a future to await."""
    gate = tmp_path / "gate"

    @cb.colocated_python
    def gated(x: Any, path: str) -> Any:
        hh.wait_for_file(path)
        return x

    x = _over_hosts(np.ones((2, 2), np.float32))

    async def on_the_loop() -> None:
        assert ctl._on_loop_thread()
        fut = gated(x, str(gate))  # a first call: returns at once here, pending
        assert isinstance(fut, cb.Future) and not fut.done()
        got, ready, probe = cb.device_get(x), cb.block_until_ready(x), x.is_ready()
        assert all(isinstance(f, cb.Future) for f in (got, ready, probe))
        np.testing.assert_array_equal(await got, np.ones((2, 2)))
        assert (await ready) is x and (await probe) is True
        gate.write_text("open")
        assert isinstance(await fut, cb.Array)

    ctl.run_sync(on_the_loop(), timeout=120)


# -- the first call --------------------------------------------------------------------------


def test_a_first_call_returns_once_its_hosts_ran_it(ctl: cb.Controller, tmp_path: Path) -> None:
    gate = tmp_path / "gate"

    @cb.colocated_python
    def save_state(x: Any, folder: str, gate: str | None = None) -> Any:
        if gate is not None:
            hh.wait_for_file(gate)
        Path(folder, f"state-{cb.host_index()}.json").write_text("{}")
        return x

    x = _over_hosts(np.zeros((2, 1), np.float32))
    opened = tmp_path / "opened"
    opened.write_text("open")
    first = save_state(x, str(tmp_path), str(opened))  # for its side effect, as maxtext
    assert isinstance(first, cb.Array)
    assert sorted(p.name for p in tmp_path.glob("state-*")) == ["state-0.json",
                                                                "state-1.json"]
    # the same input specs again: its specs are known, its arrays come at once (pending)
    later = save_state(x, str(tmp_path / "later"), str(gate))
    assert later.is_ready() is False  # its call waits at the gate
    (tmp_path / "later").mkdir()
    gate.write_text("open")
    assert cb.block_until_ready(later) is later and later.is_ready() is True
    # A specialization is a function of its own; with out_specs_fn it never waits.
    gate.unlink()
    known = save_state.specialize(out_specs_fn=lambda x, folder, gate: x)
    out = known(x, str(tmp_path), str(gate))
    assert out.is_ready() is False
    gate.write_text("open")
    cb.block_until_ready(out)


def test_a_failed_first_call_teaches_nothing(ctl: cb.Controller, tmp_path: Path) -> None:
    @cb.colocated_python
    def picky(x: Any, fail: bool, folder: str) -> Any:
        time.sleep(0.2)  # (makes a call that returned early see no file)
        Path(folder, f"{fail}-{cb.host_index()}").write_text("ran")
        if fail:
            raise ValueError("not this time")
        return x

    x = _over_hosts(np.zeros((2, 1), np.float32))
    with pytest.raises(ValueError, match="not this time"):  # raised at the call, as JAX's
        picky(x, True, str(tmp_path))
    assert isinstance(picky(x, False, str(tmp_path)), cb.Array)  # a first call too: waits
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "False-0", "False-1", "True-0", "True-1"]


def test_a_methods_first_call_waits_per_object(ctl: cb.Controller, tmp_path: Path) -> None:
    @cb.colocated_python_class
    class Saver:
        def __init__(self, folder: str) -> None:
            self.folder = folder

        def save(self, x: Any, name: str) -> Any:
            Path(self.folder, f"{name}-{cb.host_index()}").write_text("saved")
            return x

    x = _over_hosts(np.zeros((2, 1), np.float32))
    for name in ("a", "b"):  # each object's first call of the method waits
        saver = Saver(str(tmp_path))
        saver.save(x, name)
        assert (tmp_path / f"{name}-0").exists() and (tmp_path / f"{name}-1").exists()
        cb.close(saver)


def test_two_first_calls_from_a_thread_pool_run_at_the_same_time(ctl: cb.Controller) -> None:
    """JAX's user guide, cell 10, without out_specs_fn: each thread's first call waits
    for its own call, and the hosts run both at once (they meet at a barrier there)."""
    fn = hh.met.specialize(devices=list(np.array(cb.devices()).reshape(2, 4)[:, 0]))
    x = cb.device_put(np.zeros(2, np.float32), cb.NamedSharding(
        cb.Mesh(np.array(fn._devices), ("hosts",)), P("hosts")))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(fn, x, "thread pool") for _ in range(2)]
        done = [f.result(timeout=120) for f in futs]
    for d in done:
        np.testing.assert_array_equal(cb.device_get(d), [1.0, 1.0])


# -- a failed call's future dropped unread ---------------------------------------------------


def _unread(caplog: pytest.LogCaptureFixture) -> list[str]:
    gc.collect()
    return [r.getMessage() for r in caplog.records if r.name == "colobus.future"
            and "never read" in r.getMessage()]


def test_a_failed_calls_future_dropped_unread_is_logged_once(
        ctl: cb.Controller, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, "colobus.future")

    @cb.colocated_python
    def broken(x: Any) -> Any:
        raise KeyError("broken on purpose")

    @cb.colocated_python
    def ident(x: Any) -> Any:
        return x

    dev = next(d for d in cb.devices() if d.host == 1)
    x = cb.device_put(np.zeros(2, np.float32), cb.SingleDeviceSharding(dev))
    known = broken.specialize(out_specs_fn=lambda x: x)  # its arrays at once (pending)
    out = known(x)  # called for its side effect; the error never read
    cb.block_until_ready(ident(x))  # (behind it on its host: it failed by now)
    del out
    (line,) = _unread(caplog)
    assert "broken" in line and "host 1" in line and "broken on purpose" in line, line
    assert _unread(caplog) == [line]  # once
    caplog.clear()
    # Read (its array used) or handed to another call: never logged.
    f = known(x)
    with pytest.raises(KeyError):
        np.asarray(f)
    g = known(x)
    with pytest.raises(KeyError, match="broken on purpose"):
        jax.block_until_ready(g)
    h = ident(known(x))
    with pytest.raises(KeyError):
        cb.device_get(h)
    del f, g, h
    assert _unread(caplog) == []


# -- addressable_data, axis_types ------------------------------------------------------------


def test_addressable_data_is_the_shards_data(ctl: cb.Controller) -> None:
    x = np.arange(16, dtype=np.int32).reshape(2, 8)
    mesh = cb.make_mesh((2, 4), ("hosts", "devices"))
    arr = cb.device_put(x, cb.NamedSharding(mesh, P("hosts", "devices")))
    for i, shard in enumerate(arr.addressable_shards):
        np.testing.assert_array_equal(cb.device_get(arr.addressable_data(i)), x[shard.index])
        np.testing.assert_array_equal(np.asarray(arr.addressable_data(i)),
                                      np.asarray(shard.data))
    with pytest.raises(IndexError):
        arr.addressable_data(8)


def test_axis_types_are_kept_compared_and_reach_the_hosts(ctl: cb.Controller) -> None:
    types = (AxisType.Explicit, AxisType.Auto)
    mesh = cb.make_mesh((2, 4), ("hosts", "devices"), axis_types=types)
    assert mesh.axis_types == types and "axis_types=(Explicit, Auto)" in str(mesh)
    assert cb.make_mesh((2, 4), ("hosts", "devices"), types) == mesh  # JAX's position too
    plain = cb.make_mesh((2, 4), ("hosts", "devices"))
    assert plain.axis_types == (AxisType.Auto, AxisType.Auto)
    assert plain == cb.Mesh(plain.devices, plain.axis_names, (AxisType.Auto,) * 2)
    assert mesh != plain and hash(mesh) != hash(plain)
    assert cb.Mesh(mesh.devices, mesh.axis_names, axis_types=types) == mesh
    with pytest.raises(TypeError, match=r"must be of type `jax.sharding.AxisType`"):
        cb.Mesh(mesh.devices, mesh.axis_names, axis_types=(1, 2))
    with pytest.raises(ValueError, match="Number of axis names should match"):
        cb.Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Explicit,))

    @cb.colocated_python
    def seen(x: Any, m: Any) -> Any:  # the argument's mesh, and a mesh passed as is
        import jax

        explicit = jax.sharding.AxisType.Explicit
        return np.asarray([[t == explicit for t in x.sharding.mesh.axis_types],
                           [t == explicit for t in m.axis_types]], np.int32)

    x = cb.device_put(np.zeros((2, 4), np.float32), cb.NamedSharding(mesh, P("hosts")))
    got = cb.device_get(seen(x, mesh))
    np.testing.assert_array_equal(got, [[1, 0], [1, 0]])


def test_a_jax_without_axis_types_says_so() -> None:
    old = SimpleNamespace(__version__="0.4.35", sharding=SimpleNamespace())
    with pytest.raises(ValueError, match=r"JAX 0\.4\.35 has no mesh axis type 'Explicit'.*0\.5\.3"):
        jax_axis_types(old, ["Explicit"])
    assert jax_axis_types(jax, ["Auto", "Manual"]) == (AxisType.Auto, AxisType.Manual)


async def test_errors_gathered_count_as_read(ctl: cb.Controller,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """As asyncio.gather retrieves each child's exception: none is logged as unread, the
    calls' arrays (made here, beside a ``with`` cluster) or their Futures (made as async
    code under ``async with`` makes them, on the controller's loop thread)."""
    from lifecycle import in_async

    caplog.set_level(logging.ERROR, "colobus.future")

    @cb.colocated_python
    def broken(x: Any) -> Any:
        raise KeyError("gathered")

    known = broken.specialize(out_specs_fn=lambda x: x)  # its arrays at once
    dev = next(d for d in cb.devices() if d.host == 0)
    x = cb.device_put(np.zeros(2, np.float32), cb.SingleDeviceSharding(dev))
    for two in (lambda: (known(x), known(x)), lambda: in_async(lambda: (broken(x), broken(x)))):
        got = await cb.gather(*two(), return_exceptions=True)
        assert all(isinstance(e, KeyError) for e in got)
        with pytest.raises(KeyError):
            await cb.gather(*two())
        del got  # (the second gather's other one is read as it settles, whenever that is)
    assert _unread(caplog) == []
