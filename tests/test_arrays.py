"""Arrays end to end: device_put / cb.Array / device_get against a real 2x4 cluster.

Every test here talks to real worker subprocesses over real sockets. The shared
``ctl`` fixture is a 2-host x 4-CPU-device local cluster (device ids 0-3 on host
0, 4-7 on host 1); tests that must kill or restart hosts start their own.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest

import colobus as cb

P = cb.PartitionSpec

# -- helpers ----------------------------------------------------------------------------------

STRUCT = np.dtype([("a", "<i4"), ("b", "<f8", (2,)), ("c", "S3")])

DTYPES: list[Any] = [
    np.dtype(np.bool_),
    np.dtype(np.int8), np.dtype(np.int16), np.dtype(np.int32), np.dtype(np.int64),
    np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32), np.dtype(np.uint64),
    np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.complex64), np.dtype(np.complex128),
    STRUCT,
    np.dtypes.StringDType(),
    "key",
]


def _dtype_id(d: Any) -> str:
    if isinstance(d, str):
        return d
    if d is STRUCT:
        return "struct"
    if isinstance(d, np.dtypes.StringDType):
        return "StringDType"
    return str(d)


def make(dtype: Any, shape: tuple[int, ...]) -> Any:
    """Distinctive values of ``dtype`` (a JAX typed key array for ``"key"``)."""
    n = int(np.prod(shape, dtype=np.int64))
    i = np.arange(n)
    if dtype == "key":
        keys = jax.random.split(jax.random.key(42), max(n, 1))[:n]
        return keys.reshape(shape)
    if isinstance(dtype, np.dtypes.StringDType):
        words = np.array([f"s{k}-" + "é" * (k % 4) + "x" * (k % 7) for k in range(n)],
                         dtype=np.dtypes.StringDType())
        return words.reshape(shape)
    if dtype is STRUCT:
        out = np.zeros(n, STRUCT)
        out["a"] = i - 5
        out["b"][:, 0] = i * 0.5
        out["b"][:, 1] = -i * 1.25
        out["c"] = [f"{k % 1000}".encode() for k in range(n)]
        return out.reshape(shape)
    if dtype.kind == "b":
        return (i % 3 == 0).reshape(shape)
    if dtype.kind == "c":
        return (i * 1.5 - 1j * i).astype(dtype).reshape(shape)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        span = int(info.max) - int(info.min) + 1
        vals = [(k * 7919 * 104729) % span + int(info.min) for k in range(n)]
        vals[:2] = [int(info.max), int(info.min)][:n]  # the extremes travel too
        return np.array(vals, dtype=dtype).reshape(shape)
    return ((i - n / 2) * 0.375).astype(dtype).reshape(shape)


def assert_same(got: Any, want: Any) -> None:
    """Exactly the same values, dtype and shape (keys: same impl and key data)."""
    if jax.dtypes.issubdtype(getattr(want, "dtype", np.float32), jax.dtypes.prng_key):
        assert isinstance(got, jax.Array)
        assert jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key)
        assert str(jax.random.key_impl(got)) == str(jax.random.key_impl(want))
        assert got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(got)),
                                      np.asarray(jax.random.key_data(want)))
        return
    want = np.asarray(want)
    assert isinstance(got, np.ndarray), type(got)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape
    if isinstance(want.dtype, np.dtypes.StringDType):
        assert got.tolist() == want.tolist()
    else:  # bitwise: catches -0.0, NaN payloads, bfloat16 rounding...
        assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


def layouts(devs: list[cb.Device]) -> dict[str, tuple[Any, tuple[int, ...]]]:
    """Name -> (sharding, global shape), over both hosts of the 2x4 cluster."""
    m1 = cb.Mesh(np.array(devs), ("x",))
    m2 = cb.Mesh(np.array(devs).reshape(2, 4), ("hosts", "devices"))
    return {
        "1d-x": (cb.NamedSharding(m1, P("x")), (16,)),
        "2d-hosts": (cb.NamedSharding(m2, P("hosts")), (4, 3)),
        "2d-hosts-devices": (cb.NamedSharding(m2, P("hosts", "devices")), (4, 8)),
        "2d-repl-across-hosts": (cb.NamedSharding(m2, P(None, "devices")), (3, 8)),
        "2d-replicated": (cb.NamedSharding(m2, P()), (3, 5)),
        "single-device": (cb.SingleDeviceSharding(devs[5]), (3, 5)),
    }


LAYOUTS = ["1d-x", "2d-hosts", "2d-hosts-devices", "2d-repl-across-hosts",
           "2d-replicated", "single-device"]


def wait_until(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


async def await_until(cond: Callable[[], Any], timeout: float = 30.0,
                      what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


# -- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_round_trip_every_dtype(ctl: cb.Controller, dtype: Any, layout: str) -> None:
    sharding, shape = layouts(cb.devices())[layout]
    x = make(dtype, shape)
    arr = cb.device_put(x, sharding)
    assert isinstance(arr, cb.Array)
    assert arr.shape == shape
    assert arr.sharding == sharding
    assert arr.dtype == x.dtype
    got = cb.device_get(arr)
    assert_same(got, x)
    if dtype == "key":
        with pytest.raises(TypeError, match="key"):
            np.asarray(arr)
    else:
        assert_same(np.asarray(arr), x)


def test_round_trip_scalars(ctl: cb.Controller) -> None:
    devs = cb.devices()
    mesh = cb.Mesh(np.array(devs).reshape(2, 4), ("hosts", "devices"))
    repl = cb.NamedSharding(mesh, P())
    cases: list[Any] = [np.float32(3.5), np.int8(-7), np.bool_(True), np.complex64(1 - 2j),
                        np.array(2.5, ml_dtypes.bfloat16),
                        np.array("héllo", np.dtypes.StringDType())]
    for x in cases:
        for target in (repl, devs[6]):
            arr = cb.device_put(x, target)
            assert arr.shape == () and arr.ndim == 0 and arr.size == 1
            assert_same(cb.device_get(arr), np.asarray(x))
    # Python scalars travel as numpy makes them (int64 / float64 / bool / complex128).
    for py in (7, -2.25, True, 1 + 1j):
        arr = cb.device_put(py, repl)
        assert_same(np.asarray(arr), np.asarray(py))
    key = jax.random.key(3)
    arr = cb.device_put(key, devs[1])
    assert arr.shape == ()
    assert_same(cb.device_get(arr), key)


def test_round_trip_empty(ctl: cb.Controller) -> None:
    devs = cb.devices()
    mesh = cb.Mesh(np.array(devs).reshape(2, 4), ("hosts", "devices"))
    for shape, spec in [((0, 8), P("hosts", "devices")), ((4, 0), P("hosts")),
                        ((0,), P()), ((2, 0), P(None, "devices"))]:
        for dtype in (np.dtype(np.float32), STRUCT, np.dtypes.StringDType()):
            x = np.zeros(shape, dtype)
            arr = cb.device_put(x, cb.NamedSharding(mesh, spec))
            assert arr.size == 0 and arr.nbytes == 0
            assert_same(cb.device_get(arr), x)


def test_round_trip_non_contiguous_and_fortran(ctl: cb.Controller) -> None:
    devs = cb.devices()
    mesh = cb.Mesh(np.array(devs).reshape(2, 4), ("hosts", "devices"))
    sh = cb.NamedSharding(mesh, P("hosts", "devices"))
    base = np.arange(16 * 24, dtype=np.float32).reshape(16, 24)
    inputs = {
        "transposed": base.T[:8],                              # (8, 16), F-ordered view
        "strided": base[::2, ::3],                             # (8, 8)
        "negative-stride": base[::-2, ::-3],                   # (8, 8)
        "fortran": np.asfortranarray(base[:4, :8]),            # (4, 8)
        "struct-field": make(STRUCT, (4, 8))["b"][..., 1],     # a strided field view
    }
    for name, x in inputs.items():
        assert not x.flags.c_contiguous, name
        got = np.asarray(cb.device_put(x, sh))
        assert_same(got, np.ascontiguousarray(x))
    keys = make("key", (8, 4)).T  # a transposed key array
    got = cb.device_get(cb.device_put(keys, sh))
    assert_same(got, keys)


def test_round_trip_pytrees(ctl: cb.Controller) -> None:
    devs = cb.devices()
    mesh = cb.Mesh(np.array(devs).reshape(2, 4), ("hosts", "devices"))
    rows = cb.NamedSharding(mesh, P("hosts"))
    both = cb.NamedSharding(mesh, P("hosts", "devices"))
    tree = {
        "a": np.arange(8.0, dtype=np.float32).reshape(2, 4),
        "b": [np.arange(16, dtype=np.int16).reshape(2, 8),
              (make(np.dtypes.StringDType(), (4,)), make("key", (2,)))],
    }
    shardings = {"a": rows, "b": [both, (cb.SingleDeviceSharding(devs[2]), rows)]}
    put = cb.device_put(tree, shardings)
    assert isinstance(put, dict) and isinstance(put["b"], list) and isinstance(put["b"][1], tuple)
    assert put["a"].sharding == rows and put["b"][0].sharding == both
    assert put["b"][1][0].sharding == cb.SingleDeviceSharding(devs[2])
    got = cb.device_get(put)
    assert set(got) == {"a", "b"}
    assert_same(got["a"], tree["a"])
    assert_same(got["b"][0], tree["b"][0])
    assert_same(got["b"][1][0], tree["b"][1][0])
    assert_same(got["b"][1][1], tree["b"][1][1])
    # One sharding for the whole tree; non-array leaves of device_get pass through.
    put2 = cb.device_put([np.ones(4, np.float32), np.zeros((2, 2), np.int32)], rows)
    assert all(a.sharding == rows for a in put2)
    got2 = cb.device_get({"x": put2, "note": "kept", "n": None})
    assert got2["note"] == "kept" and got2["n"] is None
    assert_same(got2["x"][1], np.zeros((2, 2), np.int32))
    # A pytree of shardings that does not match the data is an error.
    with pytest.raises(ValueError):
        cb.device_put({"a": np.ones(2)}, {"b": rows})


# -- each host receives only its own block -------------------------------------------------

# Module state on the hosts: this module is importable there, so the functions below
# are pickled by reference and ``_SEEN`` persists between calls on each host.
_SEEN: dict[str, list[int]] = {}


@cb.colocated_python
def record_block(x: Any) -> Any:
    _SEEN["last"] = [*x.shape, len(x.sharding.device_set), len(x.addressable_shards)]
    return x


@cb.colocated_python
def read_seen() -> Any:
    return np.asarray(_SEEN.pop("last", [-1]), dtype=np.int32)


@pytest.mark.parametrize("layout,host_shape", [
    ("1d-x", (8,)),
    ("2d-hosts", (2, 3)),
    ("2d-hosts-devices", (2, 8)),
    ("2d-repl-across-hosts", (3, 8)),
    ("2d-replicated", (3, 5)),
])
def test_each_host_gets_only_its_block(ctl: cb.Controller, layout: str,
                                       host_shape: tuple[int, ...]) -> None:
    devs = cb.devices()
    sharding, shape = layouts(devs)[layout]
    x = make(np.dtype(np.float32), shape)
    arr = cb.device_put(x, sharding)
    out = record_block(arr)  # its arrays at once, as JAX's
    assert isinstance(out, cb.Array)
    assert out.shape == shape and out.sharding == sharding
    assert_same(np.asarray(out), x)
    for h in (0, 1):
        probe = read_seen.specialize(devices=[devs[4 * h]])
        seen = np.asarray(probe()).tolist()
        # the host's block shape, over its 4 local devices, one shard per device
        assert seen == [*host_shape, 4, 4], (h, seen)


def test_single_device_array_reaches_only_its_host(ctl: cb.Controller) -> None:
    devs = cb.devices()
    for h in (0, 1):
        cb.block_until_ready(read_seen.specialize(devices=[devs[4 * h]])())  # clear
    arr = cb.device_put(np.arange(6.0, dtype=np.float32).reshape(2, 3), devs[6])
    out = record_block(arr)
    assert out.sharding == cb.SingleDeviceSharding(devs[6])
    assert np.asarray(read_seen.specialize(devices=[devs[4]])()).tolist() \
        == [2, 3, 1, 1]
    # host 0 never saw it
    assert np.asarray(read_seen.specialize(devices=[devs[0]])()).tolist() \
        == [-1]


# -- the handle -----------------------------------------------------------------------------


def test_array_attributes(ctl: cb.Controller) -> None:
    devs = cb.devices()
    mesh = cb.Mesh(np.array(devs).reshape(2, 4), ("hosts", "devices"))
    sh = cb.NamedSharding(mesh, P("hosts", "devices"))
    arr = cb.device_put(np.zeros((4, 8), np.complex64), sh)
    assert arr.shape == (4, 8)
    assert arr.dtype == np.complex64
    assert arr.sharding is sh
    assert arr.ndim == 2 and arr.size == 32 and arr.nbytes == 32 * 8
    assert arr.devices() == set(devs)
    assert not arr.is_deleted()
    assert "shape=(4, 8)" in repr(arr)
    one = cb.device_put(np.zeros((3,), np.int16), devs[3])
    assert one.devices() == {devs[3]} and one.nbytes == 6
    jkeys = make("key", (4,))
    keys = cb.device_put(jkeys, sh.mesh.devices.flat[7])
    assert keys.shape == (4,) and keys.ndim == 1 and keys.size == 4
    assert keys.dtype == jkeys.dtype and keys.nbytes == jkeys.nbytes
    assert jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key)


def test_deleted_array_raises(ctl: cb.Controller) -> None:
    devs = cb.devices()
    arr = cb.device_put(np.arange(4.0), devs[0])
    cb.block_until_ready(arr)
    arr.delete()
    assert arr.is_deleted()
    arr.delete()  # idempotent
    assert "deleted" in repr(arr)
    with pytest.raises(RuntimeError, match="deleted"):
        cb.device_get(arr)
    with pytest.raises(RuntimeError, match="deleted"):
        np.asarray(arr)
    with pytest.raises(RuntimeError, match="deleted"):
        cb.block_until_ready([arr])
    with pytest.raises(RuntimeError, match="deleted"):
        record_block(arr)


def test_device_get_block_until_ready_is_ready_are_values_off_the_loop_futures_on_it(
        ctl: cb.Controller) -> None:
    devs = cb.devices()
    mesh = cb.Mesh(np.array(devs).reshape(2, 4), ("hosts", "devices"))
    x = np.arange(32, dtype=np.int32).reshape(4, 8)
    arr = cb.device_put(x, cb.NamedSharding(mesh, P("hosts", "devices")))
    tree = {"x": arr, "k": [1, "two"]}
    # Off the controller's loop thread (this thread: a `with` cluster), as JAX's: they block
    # and return values.
    assert cb.block_until_ready(tree) is tree
    value = cb.device_get(tree)
    assert_same(value["x"], x) and value["k"] == [1, "two"]
    assert arr.is_ready() is True
    assert cb.device_get({"a": 1}) == {"a": 1}  # an empty tree at once

    async def on_the_loop() -> None:  # async code on the controller's own loop: futures
        ready = cb.block_until_ready(tree)
        assert isinstance(ready, cb.Future)
        assert (await ready) is tree
        got = cb.device_get(tree)
        assert isinstance(got, cb.Future)
        assert_same((await got)["x"], x)
        probe = arr.is_ready()
        assert isinstance(probe, cb.Future) and (await probe) is True
        with pytest.raises(RuntimeError, match="await"):
            cb.device_get(arr).result()  # (pending: .result() would block the loop)

    assert ctl._loop is not None
    asyncio.run_coroutine_threadsafe(on_the_loop(), ctl._loop).result(60)


async def test_asarray_on_controller_loop_raises() -> None:
    async with cb.local_cluster(hosts=1) as c:
        arr = cb.device_put(np.arange(3.0), c.devices()[0])
        with pytest.raises(RuntimeError, match=r"await cb\.device_get"):
            np.asarray(arr)
        assert_same(await cb.device_get(arr), np.arange(3.0))
        with pytest.raises(RuntimeError, match="await"):
            cb.device_get(arr).result()


async def test_gc_frees_host_memory(ctl: cb.Controller) -> None:
    devs = cb.devices()
    mesh = cb.Mesh(np.array(devs).reshape(2, 4), ("hosts", "devices"))
    rows = cb.NamedSharding(mesh, P("hosts"))

    async def settled() -> dict[int, tuple[int, int]]:
        """Per-host (arrays, bytes) once two refreshes in a row agree."""
        gc.collect()
        prev = None
        for _ in range(100):
            s = await ctl.refresh_stats()
            cur = {h: (s["hosts"][h]["arrays"], s["hosts"][h]["bytes"]) for h in (0, 1)}
            if cur == prev:
                return cur
            prev = cur
            await asyncio.sleep(0.05)
        raise AssertionError("host stores never settled")

    base = await settled()
    n, nbytes = 3, 2 << 20  # three 2 MiB arrays: 1 MiB per host each
    arrs = [cb.device_put(np.full((2, nbytes // 8), k, np.float32), rows) for k in range(n)]
    cb.block_until_ready(arrs)
    s = await ctl.refresh_stats()
    for h in (0, 1):
        assert s["hosts"][h]["arrays"] >= base[h][0] + n
        assert s["hosts"][h]["bytes"] >= base[h][1] + n * (nbytes // 2)
    del arrs
    gc.collect()

    async def freed() -> bool:
        s = await ctl.refresh_stats()
        return all(s["hosts"][h]["arrays"] <= base[h][0]
                   and s["hosts"][h]["bytes"] <= base[h][1] for h in (0, 1))

    deadline = time.monotonic() + 30
    while not await freed():
        assert time.monotonic() < deadline, "hosts never freed the arrays"
        await asyncio.sleep(0.05)
    # delete() frees at once too, without waiting for GC
    keep = cb.device_put(np.ones((2, 1 << 18), np.float32), rows)
    cb.block_until_ready(keep)
    s = await ctl.refresh_stats()
    assert s["hosts"][0]["bytes"] >= base[0][1] + (1 << 20)
    keep.delete()
    deadline = time.monotonic() + 30
    while not await freed():
        assert time.monotonic() < deadline, "delete() never freed the array"
        await asyncio.sleep(0.05)
    del keep


# -- bad input: a clear error at the call, nothing sent ------------------------------------


@pytest.fixture
def no_send(ctl: cb.Controller, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Records every background send device_put schedules (none must be scheduled)."""
    posted: list[Any] = []
    real_post = ctl._ops.post

    def spy(fn: Callable[[], None]) -> None:
        posted.append(fn)
        real_post(fn)

    monkeypatch.setattr(ctl._ops, "post", spy)
    yield posted


def test_bad_input_errors_and_sends_nothing(ctl: cb.Controller, no_send: list[Any]) -> None:
    devs = cb.devices()
    m1 = cb.Mesh(np.array(devs), ("x",))
    m2 = cb.Mesh(np.array(devs).reshape(2, 4), ("hosts", "devices"))
    with pytest.raises(ValueError, match=r"divisible|divide"):
        cb.device_put(np.zeros(12), cb.NamedSharding(m1, P("x")))
    with pytest.raises(ValueError, match=r"divisible|divide"):
        cb.device_put(np.zeros((4, 6)), cb.NamedSharding(m2, P("hosts", "devices")))
    with pytest.raises(ValueError, match="nope"):
        cb.device_put(np.zeros(8), cb.NamedSharding(m1, P("nope")))
    with pytest.raises(ValueError, match="object"):
        cb.device_put(np.array([1, "a", None], dtype=object), devs[0])
    with pytest.raises(ValueError, match="object"):
        cb.device_put([np.zeros(2), np.array([{}], dtype=object)], devs[0])
    with pytest.raises(ValueError, match="ml_dtypes field"):
        cb.device_put(np.zeros(2, [("a", ml_dtypes.bfloat16)]), devs[0])
    stranger = cb.Device(id=99, host=0, platform="cpu", device_kind="cpu", local_id=0)
    with pytest.raises(ValueError, match="not a device of this controller"):
        cb.device_put(np.zeros(2), stranger)
    wrong_host = cb.Device(id=1, host=1, platform="cpu", device_kind="cpu", local_id=1)
    with pytest.raises(ValueError, match="not a device of this controller"):
        cb.device_put(np.zeros(2), wrong_host)
    with pytest.raises(ValueError):  # rank larger than the array's
        cb.device_put(np.zeros(8), cb.NamedSharding(m2, P("hosts", "devices")))
    with pytest.raises(TypeError, match="Device or Sharding"):
        cb.device_put(np.zeros(2), "cpu:0")
    assert no_send == []
    # The first leaf of a tree is fine, the second bad: nothing of the tree is sent.
    with pytest.raises(ValueError, match="object"):
        cb.device_put({"a": np.zeros(2), "b": np.array([None], dtype=object)}, devs[0])
    assert no_send == []


async def test_lost_host_arrays_raise() -> None:
    # (the block view: a lost host costs only its own data and calls; in a JAX job, the
    # default view, it ends the job for every host: tests/test_jaxjob.py)
    lc = cb.local_cluster(hosts=2, devices_per_host=1, heartbeat_interval=0.2,
                          liveness_timeout=1.0, jax_distributed=False)
    async with lc as c:
        d0, d1 = c.devices()
        on1 = cb.device_put(np.arange(4.0), d1)
        both = cb.device_put(np.arange(4.0),
                             cb.NamedSharding(cb.Mesh(np.array([d0, d1]), ("x",)), P("x")))
        await cb.block_until_ready([on1, both])
        # hosts are numbered in join order, which need not be the spawn order
        (proc,) = [p for p in lc.procs if p.pid == c.hosts()[1].pid]
        proc.kill()
        await await_until(lambda: c.hosts()[1].state == "lost", what="host 1 lost")
        assert d1 not in c.devices()
        with pytest.raises(cb.HostLostError):
            cb.device_put(np.zeros(2), d1)
        with pytest.raises(cb.HostLostError):
            cb.device_put(np.zeros(2), cb.NamedSharding(
                cb.Mesh(np.array([d0, d1]), ("x",)), P("x")))
        with pytest.raises(cb.HostLostError):
            cb.device_get(on1)
        with pytest.raises(cb.HostLostError):
            cb.device_get(both)
        with pytest.raises(cb.HostLostError):
            record_block(on1)
        # host 0 is fine
        assert_same(await cb.device_get(cb.device_put(np.arange(2), d0)), np.arange(2))


# -- devices --------------------------------------------------------------------------------


def test_colocated_cpu_devices(ctl: cb.Controller) -> None:
    devs = cb.devices()
    assert [d.id for d in devs] == list(range(8))
    assert [d.host for d in devs] == [0] * 4 + [1] * 4
    assert cb.colocated_cpu_devices(devs) == devs
    assert cb.colocated_cpu_devices(devs[::-1]) == devs[::-1]  # order kept
    mesh = cb.Mesh(np.array(devs).reshape(2, 4), ("hosts", "devices"))
    cpu_mesh = cb.colocated_cpu_devices(mesh)
    assert isinstance(cpu_mesh, cb.Mesh)
    assert cpu_mesh.axis_names == mesh.axis_names
    assert cpu_mesh.devices.shape == (2, 4)
    assert [d.id for d in cpu_mesh.devices.flat] == list(range(8))
    arr = cb.device_put(np.arange(8.0), cb.NamedSharding(cpu_mesh, P("devices")))
    assert_same(np.asarray(arr), np.arange(8.0))


@pytest.fixture
def workers() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Standalone worker processes started by a test; killed and reaped at the end."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait(timeout=30)


async def test_ids_stable_when_host_rejoins(workers: list[subprocess.Popen[bytes]]) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
    env.pop("COLOBUS_KEY_FILE", None)

    key_file: list[str] = []

    def spawn(address: str, name: str, n: int) -> subprocess.Popen[bytes]:
        p = subprocess.Popen([sys.executable, "-m", "colobus", "worker", "--connect", address,
                              "--devices", str(n), "--name", name, "--key-file", key_file[0]],
                             env=env, stdin=subprocess.DEVNULL)
        workers.append(p)
        return p

    # No key given: the controller makes one and writes it to c.key_file for workers.
    async with cb.Controller("tcp://127.0.0.1:*", hosts=0, heartbeat_interval=0.2,
                             liveness_timeout=1.0) as c:
        assert c.key_file is not None
        key_file.append(c.key_file)
        first = spawn(c.address, "w0", 1)
        await await_until(lambda: len(c.hosts()) == 1, what="w0 joined")
        w1 = spawn(c.address, "w1", 2)
        await await_until(lambda: len(c.hosts()) == 2, what="w1 joined")
        before = c.hosts()[1]
        assert before.name == "w1" and [d.id for d in before.devices] == [1, 2]
        arr = cb.device_put(np.arange(4.0), before.devices[1])
        await cb.block_until_ready(arr)
        w1.send_signal(signal.SIGKILL)
        await asyncio.to_thread(w1.wait, 30)
        await await_until(lambda: c.hosts()[1].state == "lost", what="w1 lost")
        spawn(c.address, "w1", 2)
        await await_until(lambda: c.hosts()[1].state == "alive", what="w1 rejoined")
        after = c.hosts()[1]
        assert after.index == 1 and after.name == "w1"
        assert [d.id for d in after.devices] == [d.id for d in before.devices]
        assert [d.host for d in after.devices] == [1, 1]
        assert len(c.hosts()) == 2 and first.poll() is None
        # the old array's data is gone with the old session; new puts work on the same ids
        with pytest.raises(cb.HostLostError):
            cb.device_get(arr)
        again = cb.device_put(np.arange(4.0), after.devices[1])
        assert_same(await cb.device_get(again), np.arange(4.0))


# -- dtype corners ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["2d-hosts-devices", "2d-hosts", "single-device"])
def test_strings_exact(ctl: cb.Controller, layout: str) -> None:
    sharding, _ = layouts(cb.devices())[layout]
    shape = (4, 8)
    words = ["", "a\x00", "\x00\x00", "trailing  ", "é" * 3, "🦊🐒", "x" * 10_000, "tab\tnl\n"]
    x = np.array([words[k % len(words)] + ("" if k % 3 else str(k)) for k in range(32)],
                 dtype=np.dtypes.StringDType()).reshape(shape)
    assert_same(np.asarray(cb.device_put(x, sharding)), x)
    for na in (None, np.nan):
        dt = np.dtypes.StringDType(na_object=na)
        y = np.array([na if k % 5 == 0 else f"v{k}" for k in range(32)], dtype=dt).reshape(shape)
        got = np.asarray(cb.device_put(y, sharding))
        assert got.dtype == dt
        assert [str(v) for v in got.ravel().tolist()] == [str(v) for v in y.ravel().tolist()]
        assert np.isnan(got).tolist() == np.isnan(y).tolist() if na is not None else True
    odd = np.dtypes.StringDType(na_object="NA")
    with pytest.raises(ValueError, match="na_object"):
        cb.device_put(np.array(["a"], dtype=odd), next(iter(sharding.device_set)))


def test_ml_dtypes_keep_their_type(ctl: cb.Controller) -> None:
    devs = cb.devices()
    mesh = cb.Mesh(np.array(devs).reshape(2, 4), ("hosts", "devices"))
    sh = cb.NamedSharding(mesh, P("hosts", "devices"))
    for t in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
              ml_dtypes.int4, ml_dtypes.uint4):
        x = np.arange(-4, 4).repeat(4).reshape(4, 8).astype(t)
        arr = cb.device_put(x, sh)
        assert arr.dtype == np.dtype(t)
        got = np.asarray(arr)
        assert got.dtype == np.dtype(t), t
        assert_same(got, x)
        # on the hosts, a colocated function sees the real type too
        same = np.asarray(record_block(arr))
        assert same.dtype == np.dtype(t)


def test_string_buffer_checks() -> None:
    """String buffers come off the wire unauthenticated: bad lengths are rejected."""
    from colobus._wire.codec import from_buffer, to_buffer

    x = np.array(["ab", "", "cde"], dtype=np.dtypes.StringDType())
    descr, buf = to_buffer(x)
    assert from_buffer(descr, [3], buf).tolist() == ["ab", "", "cde"]
    raw = bytearray(buf)
    with pytest.raises(ValueError):
        from_buffer(descr, [3], raw[:-1])  # data cut short
    with pytest.raises(ValueError):
        from_buffer(descr, [4], raw)  # length table longer than the buffer
    bad = bytearray(raw)
    bad[0:8] = (-1).to_bytes(8, "little", signed=True)  # NA in a dtype without NA
    with pytest.raises(ValueError):
        from_buffer(descr, [3], bad)
    with pytest.raises(ValueError):
        from_buffer(["T", 7], [3], raw)


def test_jax_arrays_and_handles_as_input(ctl: cb.Controller) -> None:
    devs = cb.devices()
    mesh = cb.Mesh(np.array(devs).reshape(2, 4), ("hosts", "devices"))
    sh = cb.NamedSharding(mesh, P("hosts", "devices"))
    local = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b")), P("a", "b"))
    x = jax.device_put(np.arange(32, dtype=np.float32).reshape(4, 8), local)
    arr = cb.device_put(x, sh)
    assert_same(np.asarray(arr), np.arange(32, dtype=np.float32).reshape(4, 8))
    assert cb.device_put(arr, sh) is arr  # already there
    moved = cb.device_put(arr, devs[0])  # resharded (tests/test_reshard.py)
    assert moved.sharding == cb.SingleDeviceSharding(devs[0])
    assert_same(np.asarray(moved), np.arange(32, dtype=np.float32).reshape(4, 8))


@cb.colocated_python
def _describe_int64(x):
    import jax

    assert isinstance(x, jax.Array), type(x)
    return x * 2


async def test_int64_stored_exactly_but_seen_as_jax_would(ctl: cb.Controller) -> None:
    """A 64-bit block is kept exactly on the host and handed over as JAX would (int32)."""
    big = np.array([2**40 + 1, -3], dtype=np.int64)
    x = cb.device_put(big, cb.devices()[0])
    np.testing.assert_array_equal(cb.device_get(x), big)  # exact round trip
    y = await _describe_int64(cb.device_put(np.array([1, 2], dtype=np.int64), cb.devices()[4]))
    assert y.dtype == np.int32
    np.testing.assert_array_equal(cb.device_get(y), [2, 4])
