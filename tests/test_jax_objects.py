"""JAX's objects, not colobus's: real clients' patterns with only their import changed.

The driver code below is written as JAX's colocated-Python clients write it (orbax's
multi-tier checkpointing, axlearn's restore, maxtext's loader, a script's
``jax.block_until_ready``), with ``import colobus as colocated_python`` for
``from jax.experimental import colocated_python`` and colobus's placement calls where
they place data (``docs/jax_comparison.md``, "Porting a real client"). Host code is in
``jaxobjects_hostside.py``. Also here: a dependent of a failed call fails with that
call's error, whatever the failure (SPEC 5).
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jaxobjects_hostside as hs
import numpy as np
import pytest
from lifecycle import in_async

import colobus as cb
import colobus as colocated_python  # was: from jax.experimental import colocated_python

P = cb.PartitionSpec

WorkerCheckpointManager = colocated_python.colocated_python_class(hs.CheckpointWorker)
plus_one = colocated_python.colocated_python(hs.plus_one)
pair = colocated_python.colocated_python(hs.pair)
slow_write = colocated_python.colocated_python(hs.slow_write)


def _cpu_dummy() -> cb.Array:
    """A dummy array on every host's CPU devices, replicated (orbax's dummy)."""
    cpu_mesh = colocated_python.colocated_cpu_devices(
        cb.make_mesh((2, 4), ("hosts", "devices")))
    return cb.device_put(np.zeros((), np.int32), cb.NamedSharding(cpu_mesh, P()))


def _values(result: Any) -> list[Any]:
    """Each worker's scalar, read shard by shard (as orbax reads a replicated result)."""
    values = []
    for shard in result.addressable_shards:
        value = np.asarray(shard.data)
        assert value.size == 1, value.shape
        values.append(value.item())
    return values


def test_orbax_checkpoint_workers_read_shard_by_shard_and_close(ctl: cb.Controller,
                                                                 tmp_path: Path) -> None:
    dummy = _cpu_dummy()
    manager = WorkerCheckpointManager(str(tmp_path))
    step = cb.device_put(np.array(1, np.int32), dummy.sharding)
    assert all(_values(manager.save(step, -1)))  # both workers saved step 1
    step2 = cb.device_put(np.array(2, np.int32), dummy.sharding)
    saved = manager.save(step2, 1)  # step 2 reached host 1 only, still in progress there
    assert _values(saved) == [False] * 4 + [True] * 4
    # Replicas as JAX keeps them: each worker's own value on its devices' shards.
    latest = manager.latest_step(dummy)
    assert _values(latest) == [1] * 4 + [2] * 4
    assert min(_values(latest)) == 1  # the newest step every worker holds
    assert any(_values(manager.is_saving_in_progress(dummy)))
    assert int(np.asarray(latest)) == 1  # the whole array's value: the first shard's
    # The user's close(dummy) is the user's method (colobus's own is cb.close(obj)).
    assert all(_values(manager.close(dummy)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["closed-0", "closed-1"]
    colocated_python.close(manager)
    with pytest.raises(RuntimeError, match="was closed"):
        manager.latest_step(dummy)


def test_a_calls_outputs_are_arrays_at_once_with_jaxs_methods(ctl: cb.Controller,
                                                              tmp_path: Path) -> None:
    x = cb.device_put(np.arange(8, dtype=np.int32),
                      cb.NamedSharding(cb.make_mesh((8,), ("x",)), P("x")))
    y = plus_one(x)  # (a first call: once it ran) its array, as JAX's
    assert y.sharding == x.sharding and y.shape == (8,)
    a, b = pair(y)  # unpacked at once; the call may still run
    assert jax.tree.map(lambda v: v.shape, {"a": a, "b": b}) == {"a": (8,), "b": (8,)}
    np.testing.assert_array_equal(np.asarray(b), (np.arange(8) + 1) * 2)
    assert a.addressable_data(0)[0] == 1  # maxtext's habit: a value, off the loop
    # jax.block_until_ready waits (it calls each leaf's block_until_ready): the files
    # are there when it returns.
    (tmp_path / "later").mkdir()
    first = slow_write(x, str(tmp_path))  # its first call
    later = slow_write(x, str(tmp_path / "later"))  # at once: still running
    assert jax.block_until_ready({"w": later}) == {"w": later}
    assert sorted(p.name for p in (tmp_path / "later").iterdir()) == ["wrote-0", "wrote-1"]
    assert later.is_ready() is True
    got = jax.device_get({"first": first, "later": [later], "n": 3})
    assert isinstance(got["later"][0], np.ndarray) and got["n"] == 3
    np.testing.assert_array_equal(got["first"], np.arange(8) + 1)
    # A call's Future (async code's) has JAX's methods too: jax's functions take it.
    fut = in_async(lambda: plus_one(x))
    assert isinstance(fut, cb.Future)
    assert jax.block_until_ready(fut) is fut and fut.done()
    fut.copy_to_host_async()
    np.testing.assert_array_equal(jax.device_get(plus_one(x)), np.arange(8) + 1)
    # axlearn's restore: a CPU array placed, then block_until_ready() on it.
    restored = cb.device_put(np.ones((2, 4), np.float32), _cpu_dummy().sharding)
    assert restored.block_until_ready() is restored and restored.is_ready() is True


def test_arrays_deleted_while_their_call_runs_leave_nothing_on_the_host(
        ctl: cb.Controller, tmp_path: Path) -> None:
    """A call's arrays deleted before it ended (freed on the host before the outputs
    exist) are not kept when it ends; dropped, they live until it ended, then go."""
    dev = next(d for d in cb.devices() if d.host == 1)
    x = cb.device_put(np.zeros(2, np.int32), dev)
    slow = slow_write.specialize(out_specs_fn=lambda x, folder: x)  # its array at once

    def held() -> int:
        gc.collect()
        return int(ctl.refresh_stats().result(30)["hosts"][1]["arrays"])

    cb.block_until_ready(slow(x, str(tmp_path)))  # (code shipped, its output dropped)
    base = held()
    for _ in range(3):
        slow(x, str(tmp_path)).delete()  # freed at once, while it sleeps on the host
        slow(x, str(tmp_path))  # dropped at once
    assert cb.block_until_ready(plus_one(x)).shape == (2,)  # behind them on the host
    deadline = time.monotonic() + 20
    while held() > base:
        assert time.monotonic() < deadline, (held(), base)
        time.sleep(0.1)


def test_jaxs_own_functions_refuse_a_cb_array_clearly(ctl: cb.Controller) -> None:
    x = cb.device_put(np.arange(4, dtype=np.float32), cb.devices()[0])
    assert not isinstance(x, jax.Array)  # by choice: docs/moving_arrays.md
    with pytest.raises(TypeError, match="requires ndarray or scalar arguments"):
        jnp.add(x, 1)
    with pytest.raises(TypeError, match="not a valid JAX type"):
        jax.jit(lambda v: v * 2)(x)
    with pytest.raises(ValueError, match=r"cb\.device_put"):
        jax.device_put(np.arange(4), cb.NamedSharding(cb.make_mesh((8,), ("x",)), P("x")))
    with pytest.raises(ValueError, match=r"cb\.device_put"):
        jax.device_put(np.arange(4), cb.devices()[0])


# -- a dependent of a failed call fails with that call's error -----------------------------


def _wrong(x: Any) -> Any:
    return cb.ShapeDtypeStruct((x.shape[0] + 1,), x.dtype, x.sharding)


def test_a_dependent_of_a_call_whose_output_check_failed(ctl: cb.Controller) -> None:
    """The hosts ran the call; the controller refused its outputs. A dependent sent
    before (its hosts had its input) and one made after (the outputs freed) both fail
    with that error, never an internal KeyError about a missing call result."""
    x = cb.device_put(np.arange(4, dtype=np.float32), cb.devices()[1])
    wrong = plus_one.specialize(out_specs_fn=_wrong)
    follow = plus_one.specialize(out_specs_fn=lambda v: v)
    a = wrong(x)  # its array at once, from the wrong specs
    b = follow(a)  # its array at once too, the call sent now, chained on the host
    with pytest.raises(ValueError, match="expected shape") as first:
        np.asarray(b)
    with pytest.raises(ValueError, match="expected shape") as again:
        follow(a)  # made after: never sent, its input's error at once
    assert again.value is first.value  # the input call's own error, each time

    async def futures() -> tuple[BaseException | None, BaseException | None]:
        fa = wrong(x)
        fb = follow(fa)  # sent at once, unawaited
        err_b = await asyncio.wait_for(_error(fb), 60)
        fc = follow(fa)  # fa failed by now: never sent
        assert fc.done()
        return err_b, fc.exception()

    err_b, err_c = ctl.run_sync(futures(), timeout=120)
    assert isinstance(err_b, ValueError) and err_b is err_c, (err_b, err_c)


async def _error(fut: cb.Future[Any]) -> BaseException | None:
    try:
        await fut
    except Exception as exc:
        return exc
    return None


def test_a_dependent_of_a_cancelled_call(ctl: cb.Controller, tmp_path: Path) -> None:
    """Made after its input was cancelled: it ends cancelled too, never sent (plain code:
    raised at the call, as its input's error)."""
    gate = str(tmp_path / "gate")
    a = in_async(lambda: hs_block(gate))
    assert a.cancel()
    with pytest.raises(asyncio.CancelledError):
        plus_one(a)
    b = in_async(lambda: plus_one(a))
    assert b.cancelled()
    Path(gate).touch()


def hs_block(gate: str) -> Any:
    import edges_hostside

    return edges_hostside.block.specialize(devices=cb.devices()[:1])(gate)


def test_a_dependent_of_a_call_whose_host_was_lost(tmp_path: Path) -> None:
    """Its input's host dies while both wait there: the dependent fails with its input's
    own HostLostError."""
    with cb.local_cluster(hosts=2, devices_per_host=1, liveness_timeout=2.0) as ctl:
        gate = str(tmp_path / "gate")
        mesh = cb.make_mesh((2,), ("x",))
        x = cb.device_put(np.arange(2, dtype=np.int32), cb.NamedSharding(mesh, P("x")))
        gated = slow_write.specialize(out_specs_fn=lambda x, folder: x)
        os.mkdir(gate)
        a = gated(x, gate)  # its array at once
        b = plus_one.specialize(out_specs_fn=lambda v: v)(a)  # chained, sent at once
        os.kill(ctl.hosts()[1].pid, signal.SIGKILL)
        with pytest.raises(cb.HostLostError) as first:
            cb.block_until_ready(a)
        with pytest.raises(cb.HostLostError) as dependent:
            cb.block_until_ready(b)
        assert first.value.host == dependent.value.host == 1
