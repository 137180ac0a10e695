"""Fast paths of issue 7 that must not change behaviour: stdlib pickling, lazy puts.

The stdlib pickler takes plain arguments and results; what cloudpickle sends
by value (classes and functions of ``__main__``, local ones) must still travel
by value. Large ``device_put`` blocks stay as numpy on the host until a call
needs them as ``jax.Array``.
"""

from __future__ import annotations

import io
import pickle
import sys
from typing import Any

import numpy as np
import pytest

import colobus as cb
from colobus._wire.envelope import ByValue, StdPickler, dumps, loads


@cb.colocated_python
def describe(x: Any, extra: Any) -> Any:
    """Reports what the host received: the block's type and ``extra`` applied to it."""
    import jax

    value = extra(x) if callable(extra) else extra.apply(x)
    return jax.numpy.asarray(value), np.asarray(isinstance(x, jax.Array))


def _main_class() -> type:
    """A class that pickles by reference as ``__main__.<name>`` in this process only."""

    class Scale:
        def __init__(self, k: float) -> None:
            self.k = k

        def apply(self, x: Any) -> Any:
            return x * self.k

    Scale.__module__ = "__main__"
    Scale.__qualname__ = Scale.__name__ = "ColobusTestScale"
    return Scale


def test_std_pickler_refuses_what_cloudpickle_sends_by_value() -> None:
    scale = _main_class()
    main = sys.modules["__main__"]
    main.ColobusTestScale = scale  # type: ignore[attr-defined]
    try:
        with pytest.raises(ByValue):
            StdPickler(io.BytesIO(), protocol=5).dump(scale(2.0))
        with pytest.raises(ByValue):
            StdPickler(io.BytesIO(), protocol=5).dump(lambda v: v)
        # plain data and importable classes go through the stdlib pickler
        f = io.BytesIO()
        StdPickler(f, protocol=5).dump({"a": np.arange(3), "b": (1, 2.0, "x"), "c": ValueError})
        out = pickle.loads(f.getvalue())
        assert out["c"] is ValueError and out["a"].tolist() == [0, 1, 2]
        # dumps falls back to cloudpickle for them
        payload, bufs = dumps(scale(3.0))
        assert loads(payload, bufs).apply(2) == 6.0
    finally:
        del main.ColobusTestScale  # type: ignore[attr-defined]


async def test_main_and_local_arguments_travel_by_value(ctl: cb.Controller) -> None:
    dev = cb.devices()[0]
    x = cb.device_put(np.arange(4, dtype=np.float32), dev)
    scale = _main_class()
    main = sys.modules["__main__"]
    main.ColobusTestScale = scale  # type: ignore[attr-defined]
    try:
        # by reference, `__main__.ColobusTestScale` would not load on the host
        out, is_jax = describe(x, scale(2.0))  # (a tuple: plain-call form)
        assert np.asarray(cb.device_get(out)).tolist() == [0, 2, 4, 6]
        assert bool(np.asarray(cb.device_get(is_jax)))
        k = 5.0
        out, _ = describe(x, lambda v: v + k)  # a closure: by value too
        assert np.asarray(cb.device_get(out)).tolist() == [5, 6, 7, 8]
    finally:
        del main.ColobusTestScale  # type: ignore[attr-defined]


@cb.colocated_python
def block_info(x: Any) -> Any:
    """The host's view of ``x``: is it a jax.Array, its dtype, its per-device shard sizes."""
    import jax

    shards = sorted(s.data.shape[0] for s in x.addressable_shards)
    return (np.asarray(isinstance(x, jax.Array)), np.asarray(str(x.dtype) == "float32"),
            np.asarray(shards, np.int32))


@cb.colocated_python
def plus_one(x: Any) -> Any:
    return x + 1


async def test_large_put_is_a_jax_array_in_calls_and_fetches_exactly(
        ctl: cb.Controller) -> None:
    devs = cb.devices()
    mesh = cb.Mesh(np.array(devs).reshape(2, 4), ("hosts", "devices"))
    sharding = cb.NamedSharding(mesh, cb.PartitionSpec(("hosts", "devices")))
    data = np.arange(1 << 20, dtype=np.float32)  # 4 MiB: 512 KiB per device, 2 MiB per host
    base = (await ctl.refresh_stats())["hosts"]
    x = cb.device_put(data, sharding)
    cb.block_until_ready(x)
    stats = (await ctl.refresh_stats())["hosts"]
    for h in (0, 1):
        assert stats[h]["bytes"] - base[h]["bytes"] == data.nbytes // 2
    # fetched before any call used it (served from the received frame), exactly
    assert np.array_equal(np.asarray(cb.device_get(x)), data)
    is_jax, is_f32, shards = block_info(x)  # replicated: both hosts agree
    assert bool(np.asarray(cb.device_get(is_jax)))
    assert bool(np.asarray(cb.device_get(is_f32)))
    assert np.asarray(cb.device_get(shards)).tolist() == [1 << 17] * 4  # per device
    del is_jax, is_f32, shards
    y = await plus_one(x)
    assert np.array_equal(np.asarray(cb.device_get(y)), data + 1)
    # after a call made it a jax.Array: still there once, same bytes, fetches exactly
    stats = (await ctl.refresh_stats())["hosts"]
    for h in (0, 1):
        assert stats[h]["bytes"] - base[h]["bytes"] == 2 * (data.nbytes // 2)  # x and y
    assert np.array_equal(np.asarray(cb.device_get(x)), data)
    x.delete()
    y.delete()


async def test_large_put_64bit_stays_exact_and_is_seen_as_jax_would(
        ctl: cb.Controller) -> None:
    dev = cb.devices()[4]
    data = (np.arange(1 << 18, dtype=np.int64) << 33) + 7  # 2 MiB, beyond int32
    x = cb.device_put(data, dev)
    is_jax, _, _ = block_info(x)
    assert bool(np.asarray(cb.device_get(is_jax)))
    assert np.array_equal(np.asarray(cb.device_get(x)), data)  # exact bytes back


_FREEZE_PROBE = """
import asyncio, gc, sys
import colobus as cb

async def main(freeze: bool) -> None:
    before = gc.get_freeze_count()
    async with cb.local_cluster(hosts=1, freeze_gc=freeze) as ctl:
        frozen = gc.get_freeze_count()
        worker_frozen = await cb.device_get(await probe_worker.specialize(devices=ctl.devices())())
    print(before, frozen, int(worker_frozen))

@cb.colocated_python
def probe_worker():
    import gc
    import numpy as np
    return np.asarray(gc.get_freeze_count())

asyncio.run(main(sys.argv[1] == "1"))
"""


@pytest.mark.parametrize("freeze", [True, False])
def test_the_startup_objects_leave_the_collectors_scans(freeze: bool, tmp_path: Any) -> None:
    import subprocess

    script = tmp_path / "probe.py"
    script.write_text(_FREEZE_PROBE)
    out = subprocess.run([sys.executable, str(script), "1" if freeze else "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    before, frozen, worker_frozen = map(int, out.stdout.split())
    assert before == 0
    # JAX alone is tens of thousands of objects; the worker always freezes its own.
    assert (frozen > 10_000) if freeze else (frozen == 0)
    assert worker_frozen > 10_000


def test_array_only_arguments_reuse_one_payload(ctl: cb.Controller) -> None:
    """``f(x, y)`` of arrays skips the pickler: same bytes and refs as pickling them."""
    from colobus._api import serialization as S

    x = cb.device_put(np.zeros(4, np.float32), ctl.devices()[0])
    y = cb.device_put(np.ones(4, np.float32), ctl.devices()[1])
    for args in ((x,), (x, y), (x, y, x), ()):
        f = io.BytesIO()
        real = S._FastArgsPickler(f, [])
        real.dump((args, {}))
        fast = S.pickle_args((args, {}), "f")
        assert fast.payload == f.getvalue() and fast.refs == real.refs
        assert fast.keep == list(args) and not fast.buffers and not fast.objects
    x.delete()
    with pytest.raises(RuntimeError, match="deleted"):
        S.pickle_args(((x, y), {}), "f")


def test_a_quick_loop_keeps_asyncios_time_and_debug_without_python_frames() -> None:
    """colobus._process.quick_loop: a plain asyncio loop's ``time`` and ``get_debug`` are
    C callables giving what asyncio's give (its timers fire, ``set_debug`` is seen); a
    loop with a clock of its own keeps it."""
    import asyncio
    import time
    import types

    from colobus._process import quick_loop

    loop = asyncio.new_event_loop()
    try:
        assert quick_loop(loop) is loop
        assert not isinstance(loop.time, types.MethodType | types.FunctionType)
        assert not isinstance(loop.get_debug, types.MethodType | types.FunctionType)
        assert abs(loop.time() - time.monotonic()) < 1.0 and loop.get_debug() is False
        loop.set_debug(True)
        assert loop.get_debug() is True
        loop.set_debug(False)
        fired = loop.run_until_complete(asyncio.wait_for(asyncio.sleep(0.01, "fired"), 30))
        assert fired == "fired"
    finally:
        loop.close()

    class Virtual(asyncio.SelectorEventLoop):
        def time(self) -> float:
            return 42.0

    other = Virtual()
    try:
        quick_loop(other)
        assert other.time() == 42.0 and isinstance(other.get_debug, types.MethodType)
    finally:
        other.close()
