"""colocated_python against a real 2-host x 4-CPU-device local cluster.

The first half mirrors JAX's own ``tests/colocated_python_test.py`` (simple
function, trees, specialization, ordering, module state, strings, binary data,
PRNG keys); the second half covers what JAX's single-process fallback cannot
show: host blocks of arrays sharded over several hosts, errors coming back from
several hosts, code shipping, futures as arguments.

Helpers that keep state on the hosts are defined at module level: they travel
by reference, so the hosts import this module and its globals persist there
between calls.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import dataclasses
import functools
import struct
import sys
import tempfile
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import colobus as cb

P = cb.PartitionSpec
_THIS_MODULE = sys.modules[__name__]

# -- helpers that run on the hosts (module level: pickled by reference) ----------------

_host_state: dict[str, Any] = {}


@cb.colocated_python
def add_one(x: Any) -> Any:
    return jax.tree.map(lambda v: v + 1, x)


@cb.colocated_python
def seq_func0(x: jax.Array) -> jax.Array:
    _host_state["seq"] = 100
    return x


@cb.colocated_python
def seq_func1(x: jax.Array) -> jax.Array:
    assert _host_state.get("seq") == 100, _host_state.get("seq")
    _host_state["seq"] += 1
    return x


@cb.colocated_python
def seq_func2(x: jax.Array) -> jax.Array:
    assert _host_state.get("seq") == 101, _host_state.get("seq")
    return x


@cb.colocated_python
def state_cleanup(x: jax.Array) -> jax.Array:
    _host_state.clear()
    return x


@cb.colocated_python
def barrier_init(x: jax.Array) -> jax.Array:
    _host_state["barrier"] = threading.Barrier(3)
    return x


@cb.colocated_python
def barrier_wait(x: jax.Array) -> jax.Array:
    _host_state["barrier"].wait(timeout=20)
    return x


@cb.colocated_python
def host_view(x: jax.Array) -> Any:
    """What a host sees of ``x``: its block's shape, its local device count, its values."""
    return (np.array(x.shape), np.array(len(x.sharding.device_set)), x * 10)


@cb.colocated_python
def first_value(x: jax.Array) -> Any:
    """The first value of the host's block, as an unsharded (replicated) output."""
    return np.asarray(x).reshape(-1)[:1]


Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Box:
    """A registered pytree node with static (plain) auxiliary data."""

    x: Any
    tag: str


jax.tree_util.register_dataclass(Box, data_fields=["x"], meta_fields=["tag"])


@cb.colocated_python
def fancy_tree(x: jax.Array) -> Any:
    return {"p": Pair(x, x + 1), "o": collections.OrderedDict(b=x, a=x * 2),
            "box": Box(x * 3, "t"), "none": None}


class CustomError(Exception):
    """Raised on a host; importable here, so it comes back with its own type."""


class NoRebuildError(Exception):
    """Pickles, but does not unpickle (its ``__init__`` needs two arguments)."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a}/{b}")


@cb.colocated_python
def raise_custom(x: jax.Array) -> jax.Array:
    raise CustomError(f"custom failure with block {np.asarray(x).tolist()}")


@cb.colocated_python
def raise_per_host(x: jax.Array) -> jax.Array:
    first = int(np.asarray(x).reshape(-1)[0])
    if first == 0:
        raise KeyError(f"block starting at {first}")
    raise ValueError(f"block starting at {first}")


@cb.colocated_python
def raise_on_second_host(x: jax.Array) -> jax.Array:
    if int(np.asarray(x).reshape(-1)[0]) != 0:
        raise CustomError("only the second host fails")
    return x


@cb.colocated_python
def raise_no_rebuild(x: jax.Array) -> jax.Array:
    raise NoRebuildError("left", "right")


@cb.colocated_python
def exit_host(x: jax.Array) -> jax.Array:
    sys.exit(3)


@cb.colocated_python
async def async_double(x: jax.Array) -> jax.Array:
    asyncio.get_running_loop()  # runs on the worker's event loop
    await asyncio.sleep(0)
    return x * 2


@cb.colocated_python
def with_metadata(x: jax.Array) -> jax.Array:
    """Docstring that functools.wraps keeps."""
    return x


# -- fixtures and small helpers -------------------------------------------------------------


def _mesh2x4() -> cb.Mesh:
    return cb.Mesh(np.array(cb.devices()).reshape(2, 4), ("hosts", "devices"))


def _put_over_hosts(x: np.ndarray[Any, Any]) -> cb.Array:
    """``x`` (first dim 2) split between the two hosts, replicated on each host's 4 devices."""
    return cb.device_put(x, cb.NamedSharding(_mesh2x4(), P("hosts")))


def _notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


# -- mirrored from JAX's colocated_python_test ----------------------------------------------


async def test_simple_function(ctl: cb.Controller) -> None:
    x = cb.device_put(np.array(1), cb.devices()[0])
    out = await add_one(x)
    assert isinstance(out, cb.Array)
    assert out.sharding == cb.SingleDeviceSharding(cb.devices()[0])
    assert cb.device_get(out) == np.array(2)
    out = await add_one(x)
    assert cb.device_get(out) == np.array(2)


async def test_simple_function_with_tree(ctl: cb.Controller) -> None:
    x = [np.array(1), (np.array(2), {"v": np.array(3)})]
    x = cb.device_put(x, cb.SingleDeviceSharding(cb.devices()[0]))
    out = add_one(x)  # (a list of arrays: not awaitable, unlike one array or a Future)
    assert jax.tree.structure(out) == jax.tree.structure([0, (0, {"v": 0})])
    got = cb.device_get(out)
    assert got == [np.array(2), (np.array(3), {"v": np.array(4)})]


def test_empty_input_fails_without_specialization(ctl: cb.Controller) -> None:
    @cb.colocated_python
    def make_zero() -> jax.Array:
        return jnp.array(0)

    calls = ctl.stats()["calls"]
    with pytest.raises(ValueError, match=(
            r"^No devices found\. colocated_python function without input arguments must be "
            r"first specialized with devices\.$")):
        make_zero()
    assert ctl.stats()["calls"] == calls


async def test_empty_input_with_devices_specialization(ctl: cb.Controller) -> None:
    @cb.colocated_python
    def make_zero() -> jax.Array:
        return jnp.array(0)

    one = make_zero.specialize(devices=cb.devices()[:1])
    out = await one()
    assert out.sharding == cb.SingleDeviceSharding(cb.devices()[0])
    assert cb.device_get(out) == np.array(0)
    assert cb.device_get(await one()) == np.array(0)

    # Over every device of both hosts: one replicated output over the call's mesh.
    every = make_zero.specialize(devices=cb.devices())
    out = await every()
    assert out.shape == ()
    assert out.devices() == set(cb.devices())
    assert out.sharding.is_fully_replicated
    assert cb.device_get(out) == np.array(0)


async def test_input_polymorphism_without_out_specs_fn(ctl: cb.Controller) -> None:
    d0 = cb.devices()[0]
    x = cb.device_put(np.array(1), d0)
    assert cb.device_get(await add_one(x)) == np.array(2)
    tree = cb.device_put([np.array(1), (np.array(2), {"v": np.array(3)})],
                         cb.SingleDeviceSharding(d0))
    got = cb.device_get(add_one(tree))
    assert got == [np.array(2), (np.array(3), {"v": np.array(4)})]
    # Different shape and dtype again.
    y = cb.device_put(np.arange(6, dtype=np.int16).reshape(2, 3), d0)
    out = await add_one(y)
    assert (out.shape, out.dtype) == ((2, 3), np.dtype(np.int16))
    np.testing.assert_array_equal(cb.device_get(out), np.arange(6).reshape(2, 3) + 1)


async def test_input_polymorphism_allowed_with_out_specs_fn(ctl: cb.Controller) -> None:
    seen: list[Any] = []

    def same_as_input(x: Any) -> Any:
        seen.append(x)
        return x

    f = add_one.specialize(out_specs_fn=same_as_input)
    d0 = cb.devices()[0]
    x = cb.device_put(np.array(1), d0)
    assert cb.device_get(await f(x)) == np.array(2)
    assert isinstance(seen[-1], cb.ShapeDtypeStruct)
    assert seen[-1].shape == () and seen[-1].sharding == cb.SingleDeviceSharding(d0)
    tree = cb.device_put([np.array(1), (np.array(2), {"v": np.array(3)})],
                         cb.SingleDeviceSharding(d0))
    got = cb.device_get(f(tree))
    assert got == [np.array(2), (np.array(3), {"v": np.array(4)})]
    assert len(seen) == 2


async def test_out_specs_fn_mismatch_fails_the_call(ctl: cb.Controller) -> None:
    f = add_one.specialize(
        out_specs_fn=lambda x: cb.ShapeDtypeStruct((3,), np.int32))
    x = cb.device_put(np.arange(4, dtype=np.int32), cb.devices()[0])
    with pytest.raises(ValueError, match=r"outputs of add_one.*expected shape \(3,\), got \(4,\)"):
        await f(x)
    f = add_one.specialize(
        out_specs_fn=lambda x: cb.ShapeDtypeStruct((4,), np.float32))
    with pytest.raises(ValueError, match=r"outputs of add_one.*expected dtype float32, got int32"):
        await f(x)


async def test_in_specs_checked(ctl: cb.Controller) -> None:
    spec = ((cb.ShapeDtypeStruct((4,), np.float32),), {})
    f = add_one.specialize(in_specs=spec)
    d0 = cb.devices()[0]
    ok = cb.device_put(np.zeros(4, np.float32), d0)
    np.testing.assert_array_equal(cb.device_get(await f(ok)), np.ones(4))
    calls = ctl.stats()["calls"]
    with pytest.raises(ValueError, match=r"inputs of add_one: args\[0\]: expected shape \(4,\), "
                                         r"got \(5,\)"):
        f(cb.device_put(np.zeros(5, np.float32), d0))
    with pytest.raises(ValueError, match=r"inputs of add_one: args\[0\]: expected dtype float32, "
                                         r"got int32"):
        f(cb.device_put(np.zeros(4, np.int32), d0))
    with pytest.raises(ValueError, match=r"inputs of add_one do not match the specs: expected "
                                         r"structure"):
        f(ok, ok)
    # A numpy argument is checked the same way.
    with pytest.raises(ValueError, match=r"args\[0\]: expected shape \(4,\), got \(2, 2\)"):
        f.specialize(devices=[d0])(np.zeros((2, 2), np.float32))
    assert ctl.stats()["calls"] == calls

    # A tree: the first difference is named by its path.
    g = add_one.specialize(in_specs=(({"a": cb.ShapeDtypeStruct((2,), np.int32),
                                       "b": cb.ShapeDtypeStruct((3,), np.int32)},), {}))
    with pytest.raises(ValueError, match=r"args\[0\]\['b'\]: expected shape \(3,\), got \(4,\)"):
        g({"a": cb.device_put(np.zeros(2, np.int32), d0),
           "b": cb.device_put(np.zeros(4, np.int32), d0)})


def test_specialize_twice_raises(ctl: cb.Controller) -> None:
    spec = ((cb.ShapeDtypeStruct((4,), np.float32),), {})
    f = add_one.specialize(in_specs=spec, out_specs_fn=lambda x: x, devices=cb.devices()[:1])
    with pytest.raises(ValueError, match=r"^in_specs already specified$"):
        f.specialize(in_specs=spec)
    with pytest.raises(ValueError, match=r"^out_specs_fn already specified$"):
        f.specialize(out_specs_fn=lambda x: x)
    with pytest.raises(ValueError, match=r"^devices already specified$"):
        f.specialize(devices=cb.devices()[:1])
    # Each can be added in steps, on new callables; the original is untouched.
    g = add_one.specialize(in_specs=spec).specialize(devices=cb.devices()[:1])
    assert g is not add_one
    add_one.specialize(in_specs=spec)


@pytest.mark.parametrize("on_main_thread", [True, False], ids=["main_thread", "other_thread"])
def test_sequential_execution(ctl: cb.Controller, on_main_thread: bool) -> None:
    x = _put_over_hosts(np.zeros((2, 4), np.float32))
    func0 = seq_func0.specialize(out_specs_fn=lambda x: x)
    func1 = seq_func1.specialize(out_specs_fn=lambda x: x)
    func2 = seq_func2.specialize(out_specs_fn=lambda x: x)
    errors: list[BaseException] = []

    def calls() -> None:
        try:
            # No waiting between calls: each host must run them in the order issued.
            func0(x)
            func1(x)
            cb.block_until_ready(func2(x))  # the arrays of a call: waited for, as JAX's
        except BaseException as exc:
            errors.append(exc)

    try:
        if on_main_thread:
            calls()
        else:
            t = threading.Thread(target=calls)
            t.start()
            t.join()
        assert not errors, errors
    finally:
        cb.block_until_ready(state_cleanup(x))


async def test_sequential_execution_in_one_task(ctl: cb.Controller) -> None:
    x = _put_over_hosts(np.zeros((2, 4), np.float32))
    try:
        seq_func0(x)
        seq_func1(x)
        await seq_func2(x)  # one asyncio task, one stream: in order on each host
    finally:
        await state_cleanup(x)


async def test_array_keyword_arguments(ctl: cb.Controller) -> None:
    @cb.colocated_python
    def scaled(x: jax.Array, *, by: jax.Array, label: str) -> jax.Array:
        assert label == "kw"
        return x * by

    x = _put_over_hosts(np.arange(4, dtype=np.int32).reshape(2, 2))
    by = _put_over_hosts(np.full((2, 2), 3, np.int32))
    out = await scaled(x, by=by, label="kw")
    np.testing.assert_array_equal(cb.device_get(out), np.arange(4).reshape(2, 2) * 3)


def test_concurrent_execution(ctl: cb.Controller) -> None:
    x = _put_over_hosts(np.zeros((2, 4), np.float32))
    func = barrier_wait.specialize(out_specs_fn=lambda x: x)
    results: list[Any] = []

    def one() -> None:
        try:
            results.append(cb.block_until_ready(func(x)))
        except BaseException as exc:
            results.append(exc)

    try:
        cb.block_until_ready(barrier_init(x))
        # Three threads, three streams: the calls meet at the barrier on each host.
        threads = [threading.Thread(target=one) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 3
        assert all(isinstance(r, cb.Array) for r in results), results
    finally:
        cb.block_until_ready(state_cleanup(x))


async def test_concurrent_execution_from_asyncio_tasks(ctl: cb.Controller) -> None:
    x = _put_over_hosts(np.zeros((2, 4), np.float32))
    try:
        await barrier_init(x)
        # Output specs known: calls return at once (this loop is not the controller's, so
        # a first call without them would wait for the barrier here, holding the others).
        wait = barrier_wait.specialize(out_specs_fn=lambda a: a)

        async def one() -> cb.Array:
            return await wait(x)  # each task is its own stream

        results = await asyncio.gather(one(), one(), one())
        assert all(isinstance(r, cb.Array) for r in results)
    finally:
        await state_cleanup(x)


async def test_inputs_with_different_device_orders(ctl: cb.Controller) -> None:
    d0, d1 = cb.devices()[:2]

    @cb.colocated_python
    def add(x: jax.Array, y: jax.Array) -> jax.Array:
        by_device = {s.device: s.data for s in y.addressable_shards}
        arrays = [s.data + by_device[s.device] for s in x.addressable_shards]
        return jax.make_array_from_single_device_arrays(x.shape, x.sharding, arrays)

    # Inputs use the same devices in different orders: specialize with devices.
    add = add.specialize(devices=[d0, d1])
    sharding1 = cb.NamedSharding(cb.Mesh([d0, d1], ("x",)), P("x"))
    sharding2 = cb.NamedSharding(cb.Mesh([d1, d0], ("x",)), P("x"))
    x = cb.device_put(np.array([0, 2], np.int32), sharding1)   # d0: 0, d1: 2
    y = cb.device_put(np.array([4, 8], np.int32), sharding2)   # d1: 4, d0: 8
    out = await add(x, y)
    # The call's mesh is the first array argument's.
    assert out.sharding == sharding1
    assert out.sharding.device_list == (d0, d1)
    np.testing.assert_array_equal(cb.device_get(out), [0 + 8, 2 + 4])

    # Without the specialization the two device lists are an error, as in JAX.
    @cb.colocated_python
    def plain_add(x: jax.Array, y: jax.Array) -> jax.Array:
        return x + y

    with pytest.raises(ValueError, match=r"^All arguments must use the same device list, but "
                                         r"got multiple device lists: "):
        plain_add(x, y)


def test_module_variable_access(ctl: cb.Controller) -> None:
    # JAX's pattern: locally defined functions (pickled by value) keep state in an
    # importable module, which travels by reference. The module is poisoned with
    # an object that cannot be pickled, to catch any attempt to pickle the module.
    _THIS_MODULE._non_serializable = tempfile.TemporaryFile()  # type: ignore[attr-defined]
    try:
        @cb.colocated_python
        def set_global_state(x: jax.Array) -> jax.Array:
            _THIS_MODULE._host_state["module_var"] = x
            return x + 1

        @cb.colocated_python
        def get_global_state(x: jax.Array) -> jax.Array:
            del x
            return _THIS_MODULE._host_state["module_var"]

        d0 = cb.devices()[0]
        x = cb.device_put(np.array(1), d0)
        y = cb.device_put(np.array(2), d0)
        cb.block_until_ready(set_global_state(x))
        out = cb.device_get(get_global_state(y))
        np.testing.assert_equal(out, np.array(1))
    finally:
        _THIS_MODULE._non_serializable.close()  # type: ignore[attr-defined]
        del _THIS_MODULE._non_serializable  # type: ignore[attr-defined]
        cb.block_until_ready(state_cleanup(cb.device_put(np.array(0), cb.devices()[0])))


async def test_string_processing(ctl: cb.Controller) -> None:
    @cb.colocated_python
    def upper(x: jax.Array) -> jax.Array:
        upper_caser = np.vectorize(lambda s: s.upper(), otypes=[np.dtypes.StringDType()])
        arrays = [jax.device_put(upper_caser(jax.device_get(s.data)), s.device)
                  for s in x.addressable_shards]
        return jax.make_array_from_single_device_arrays(x.shape, x.sharding, arrays)

    strings = np.array([["abcd", "efgh"], ["ijkl", "mnop"]], dtype=np.dtypes.StringDType())
    # One row on each host.
    d = cb.devices()
    sharding = cb.NamedSharding(cb.Mesh(np.array([d[0], d[4]]).reshape(2, 1), ("x", "y")),
                                P("x"))
    x = cb.device_put(strings, sharding)
    out = await upper(x)
    assert out.sharding == sharding
    got = cb.device_get(out)
    assert isinstance(got.dtype, np.dtypes.StringDType)
    np.testing.assert_array_equal(
        got, np.array([["ABCD", "EFGH"], ["IJKL", "MNOP"]], dtype=np.dtypes.StringDType()))


async def test_replicated_strings_arrive_as_numpy(ctl: cb.Controller) -> None:
    # JAX cannot replicate string arrays over devices: hosts get numpy blocks.
    @cb.colocated_python
    def upper(x: Any) -> Any:
        assert isinstance(x, np.ndarray) and isinstance(x.dtype, np.dtypes.StringDType)
        return np.strings.upper(x)

    strings = np.array([["ab", "cd"], ["ef", "gh"]], dtype=np.dtypes.StringDType())
    x = cb.device_put(strings, cb.NamedSharding(_mesh2x4(), P()))
    out = await upper(x)
    assert out.devices() == set(cb.devices()) and out.sharding.is_fully_replicated
    np.testing.assert_array_equal(cb.device_get(out), np.strings.upper(strings))


async def test_binary_data_processing(ctl: cb.Controller) -> None:
    @cb.colocated_python
    def f(x: jax.Array) -> jax.Array:
        arrays = []
        for shard in x.addressable_shards:
            data = jax.device_get(shard.data)
            a, b = struct.unpack("<ii", base64.b64decode(data[0].encode("ascii")))
            text = base64.b64encode(struct.pack("<ii", a + 1, b + 1)).decode("ascii")
            arrays.append(jax.device_put(np.array([text], dtype=np.dtypes.StringDType()),
                                         shard.device))
        return jax.make_array_from_single_device_arrays(x.shape, x.sharding, arrays)

    text = base64.b64encode(struct.pack("<ii", 1001, 1002)).decode("ascii")
    x = cb.device_put(np.array([text], dtype=np.dtypes.StringDType()),
                      cb.SingleDeviceSharding(cb.devices()[0]))
    out = cb.device_get(await f(x))
    assert struct.unpack("<ii", base64.b64decode(out[0].encode("ascii"))) == (1002, 1003)


@cb.colocated_python
def key_split(k: jax.Array) -> jax.Array:
    return jax.random.split(k, 3)


@cb.colocated_python
def key_identity(k: Any) -> Any:
    return k


async def test_prng_key_input(ctl: cb.Controller) -> None:
    @cb.colocated_python
    def sample(k: jax.Array) -> jax.Array:
        assert jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key)
        return jax.random.uniform(k, (3,))

    key = jax.random.key(42)
    k = cb.device_put(key, cb.devices()[0])
    assert jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key)
    got = cb.device_get(await sample(k))
    np.testing.assert_array_equal(got, np.asarray(jax.random.uniform(key, (3,))))


async def test_prng_key_output(ctl: cb.Controller) -> None:
    @cb.colocated_python
    def make_key() -> jax.Array:
        return jax.random.key(7)

    out = await make_key.specialize(devices=cb.devices()[:1])()
    assert out.shape == ()
    assert jax.dtypes.issubdtype(out.dtype, jax.dtypes.prng_key)
    got = cb.device_get(out)
    np.testing.assert_array_equal(jax.random.key_data(got),
                                  jax.random.key_data(jax.random.key(7)))

    # Over both hosts: the keys agree, so the output is one replicated key array.
    out = await make_key.specialize(devices=cb.devices())()
    assert out.devices() == set(cb.devices())
    got = cb.device_get(out)
    np.testing.assert_array_equal(jax.random.key_data(got),
                                  jax.random.key_data(jax.random.key(7)))


async def test_prng_key_round_trip(ctl: cb.Controller) -> None:
    key = jax.random.key(3, impl="rbg")
    k = cb.device_put(key, cb.devices()[5])
    back = cb.device_get(await key_identity(k))
    assert jax.random.key_impl(back) == jax.random.key_impl(key)
    np.testing.assert_array_equal(jax.random.key_data(back), jax.random.key_data(key))

    split = await key_split(cb.device_put(jax.random.key(0), cb.devices()[1]))
    assert split.shape == (3,)
    np.testing.assert_array_equal(jax.random.key_data(cb.device_get(split)),
                                  jax.random.key_data(jax.random.split(jax.random.key(0), 3)))


async def test_mixed_tree_with_keys(ctl: cb.Controller) -> None:
    @cb.colocated_python
    def step(tree: Any, scale: float) -> Any:
        k1, k2 = jax.random.split(tree["key"])
        return {"key": k1, "noise": jax.random.normal(k2, tree["x"].shape) * scale,
                "x": tree["x"] + 1, "none": None, "tag": np.int32(len(tree["name"]))}

    d0 = cb.devices()[0]
    key = jax.random.key(1)
    tree = {"key": cb.device_put(key, d0), "x": cb.device_put(np.arange(4.0), d0),
            "name": "four"}
    out = step(tree, 2.0)
    assert out["none"] is None
    assert jax.dtypes.issubdtype(out["key"].dtype, jax.dtypes.prng_key)
    got = cb.device_get(out)
    k1, k2 = jax.random.split(key)
    np.testing.assert_array_equal(jax.random.key_data(got["key"]), jax.random.key_data(k1))
    np.testing.assert_allclose(got["noise"], np.asarray(jax.random.normal(k2, (4,)) * 2.0))
    np.testing.assert_array_equal(got["x"], np.arange(4.0) + 1)
    assert got["tag"] == 4


# -- what JAX's single-process fallback cannot show ----------------------------------------


async def test_array_sharded_over_both_hosts_arrives_as_host_blocks(
        ctl: cb.Controller) -> None:
    mesh = _mesh2x4()
    sharding = cb.NamedSharding(mesh, P("hosts", "devices"))
    data = np.arange(16.0, dtype=np.float32).reshape(2, 8)
    x = cb.device_put(data, sharding)

    @cb.colocated_python
    def inspect_block(x: jax.Array) -> Any:
        assert isinstance(x, jax.Array)
        sh = x.sharding
        assert isinstance(sh, jax.sharding.NamedSharding)
        assert sh.spec == P("hosts", "devices")
        assert sh.mesh.axis_names == ("hosts", "devices")
        return (np.array(x.shape), np.array(len(sh.device_set)),
                np.array(sh.mesh.devices.shape), x * 2)

    shape, ndev, mesh_shape, doubled = inspect_block(x)
    # Replicated per-host facts: every host agrees, so they come back replicated.
    np.testing.assert_array_equal(cb.device_get(shape), [1, 8])
    np.testing.assert_array_equal(cb.device_get(ndev), 4)
    np.testing.assert_array_equal(cb.device_get(mesh_shape), [1, 4])
    # An output on the host's part of the call's mesh is assembled as a global array.
    assert doubled.shape == (2, 8)
    assert doubled.sharding == sharding
    np.testing.assert_array_equal(cb.device_get(doubled), data * 2)


async def test_host_sees_only_its_block_values(ctl: cb.Controller) -> None:
    x = _put_over_hosts(np.arange(8, dtype=np.int32).reshape(2, 4))
    shape, ndev, tenfold = host_view(x)
    np.testing.assert_array_equal(cb.device_get(shape), [1, 4])
    np.testing.assert_array_equal(cb.device_get(ndev), 4)
    assert tenfold.sharding == x.sharding
    np.testing.assert_array_equal(cb.device_get(tenfold),
                                  np.arange(8).reshape(2, 4) * 10)

    # Hosts that disagree on a replicated output's value: as JAX keeps replicas, each
    # device's shard holds its host's value, and the array's value is the first shard's.
    first = await first_value(x)
    assert [int(s.data[0]) for s in first.addressable_shards] == [0] * 4 + [4] * 4
    np.testing.assert_array_equal(cb.device_get(first), [0])
    # Asked for (check_replicas=True), they are compared: the call fails instead.
    with pytest.raises(ValueError, match=r"replicated over hosts \[0, 1\].*host 0 and host 1 "
                                         r"returned different values"):
        await first_value.specialize(check_replicas=True)(x)


async def test_one_dimensional_mesh_over_both_hosts(ctl: cb.Controller) -> None:
    mesh = cb.Mesh(np.array(cb.devices()), ("x",))
    x = cb.device_put(np.arange(16, dtype=np.int32), cb.NamedSharding(mesh, P("x")))
    shape, ndev, tenfold = host_view(x)
    np.testing.assert_array_equal(cb.device_get(shape), [8])
    np.testing.assert_array_equal(cb.device_get(ndev), 4)
    np.testing.assert_array_equal(cb.device_get(tenfold), np.arange(16) * 10)


async def test_two_dimensional_mesh(ctl: cb.Controller) -> None:
    mesh = _mesh2x4()
    data = np.arange(32, dtype=np.int32).reshape(4, 8)
    # Rows split over hosts, columns over each host's devices, and the transpose.
    for spec, block in ((P("hosts", "devices"), [2, 8]), (P("devices", "hosts"), [4, 4])):
        x = cb.device_put(data, cb.NamedSharding(mesh, spec))
        shape, ndev, tenfold = host_view(x)
        np.testing.assert_array_equal(cb.device_get(shape), block)
        np.testing.assert_array_equal(cb.device_get(ndev), 4)
        assert tenfold.sharding == cb.NamedSharding(mesh, spec)
        np.testing.assert_array_equal(cb.device_get(tenfold), data * 10)


async def test_replicated_input(ctl: cb.Controller) -> None:
    mesh = _mesh2x4()
    data = np.arange(16, dtype=np.float32).reshape(2, 8)
    x = cb.device_put(data, cb.NamedSharding(mesh, P()))

    @cb.colocated_python
    def total(x: jax.Array) -> jax.Array:
        assert x.shape == (2, 8)  # every host holds the whole array
        assert x.sharding.is_fully_replicated
        return jnp.sum(x)

    out = await total(x)
    assert out.shape == ()
    assert out.sharding == cb.NamedSharding(mesh, P())
    assert cb.device_get(out) == data.sum()


async def test_mixed_device_lists_rejected(ctl: cb.Controller) -> None:
    d = cb.devices()
    x = cb.device_put(np.zeros(4), cb.NamedSharding(cb.Mesh(d[:4], ("x",)), P("x")))
    y = cb.device_put(np.zeros(4), cb.NamedSharding(cb.Mesh(d[4:], ("x",)), P("x")))
    calls = ctl.stats()["calls"]

    @cb.colocated_python
    def both(x: jax.Array, y: jax.Array) -> jax.Array:
        return x

    with pytest.raises(ValueError, match=r"^All arguments must use the same device list, but "
                                         r"got multiple device lists: "):
        both(x, y)
    # Also when the specialized devices do not cover an argument's devices.
    with pytest.raises(ValueError, match=r"^All arguments must use the same device list"):
        both.specialize(devices=d[:4])(x, y)
    assert ctl.stats()["calls"] == calls


async def test_exception_keeps_type_and_notes(ctl: cb.Controller) -> None:
    x = cb.device_put(np.array([5]), cb.devices()[0])
    with pytest.raises(CustomError, match=r"custom failure with block \[5\]") as info:
        await raise_custom(x)
    notes = _notes(info.value)
    assert "host 0" in notes
    assert "remote traceback" in notes
    assert "raise_custom" in notes  # the remote frame is in the traceback text
    assert "CustomError" in notes


async def test_exception_that_does_not_unpickle_is_remote_error(ctl: cb.Controller) -> None:
    x = cb.device_put(np.array([5]), cb.devices()[4])
    with pytest.raises(cb.RemoteError) as info:
        await raise_no_rebuild(x)
    err = info.value
    assert err.type_name.endswith("NoRebuildError")
    assert err.message == "left/right"
    assert err.host == 1
    assert "raise_no_rebuild" in err.remote_traceback
    assert "host 1" in _notes(err)


async def test_several_hosts_failing_lowest_host_wins(ctl: cb.Controller) -> None:
    x = _put_over_hosts(np.array([[0, 1], [2, 3]]))
    with pytest.raises(KeyError, match="block starting at 0") as info:
        await raise_per_host(x)
    notes = _notes(info.value)
    assert "host 0" in notes
    assert "host 1 also failed: ValueError: block starting at 2" in notes

    # Only the second host fails: that host's exception, naming it.
    with pytest.raises(CustomError, match="only the second host fails") as info2:
        await raise_on_second_host(x)
    assert "host 1" in _notes(info2.value)
    assert "also failed" not in _notes(info2.value)


async def test_worker_survives_user_errors(ctl: cb.Controller) -> None:
    x = _put_over_hosts(np.array([[0, 1], [2, 3]], np.int32))
    for _ in range(2):
        with pytest.raises(KeyError):
            await raise_per_host(x)
    # Not an Exception subclass: never rebuilt in the controller (it would end the
    # caller's program there), so it comes back as a RemoteError naming it.
    with pytest.raises(cb.RemoteError, match=r"builtins\.SystemExit: 3"):
        await exit_host(x)
    out = await add_one(x)
    np.testing.assert_array_equal(cb.device_get(out), [[1, 2], [3, 4]])
    assert all(h.state == "alive" for h in ctl.hosts())


async def test_unpicklable_argument(ctl: cb.Controller) -> None:
    x = cb.device_put(np.array(1), cb.devices()[0])
    calls = ctl.stats()["calls"]
    with pytest.raises(cb.SerializationError, match=r"args\[1\]\['lock'\]") as info:
        add_one(x, {"fine": 1, "lock": threading.Lock()})
    assert "nothing was sent" in str(info.value)
    with pytest.raises(cb.SerializationError, match=r"kwargs\['k'\]"):
        add_one(x, k=threading.Lock())
    assert ctl.stats()["calls"] == calls


async def test_unpicklable_function(ctl: cb.Controller) -> None:
    lock = threading.Lock()

    @cb.colocated_python
    def uses_lock(x: jax.Array) -> jax.Array:
        with lock:
            return x

    x = cb.device_put(np.array(1), cb.devices()[0])
    calls, code = ctl.stats()["calls"], ctl.stats()["code_sent"]
    with pytest.raises(cb.SerializationError, match="uses_lock"):
        uses_lock(x)
    assert (ctl.stats()["calls"], ctl.stats()["code_sent"]) == (calls, code)


async def test_async_def_function(ctl: cb.Controller) -> None:
    x = _put_over_hosts(np.arange(4, dtype=np.int32).reshape(2, 2))
    out = await async_double(x)
    assert out.sharding == x.sharding
    np.testing.assert_array_equal(cb.device_get(out), np.arange(4).reshape(2, 2) * 2)


def test_await_from_another_event_loop(ctl: cb.Controller) -> None:
    x = _put_over_hosts(np.arange(4, dtype=np.int32).reshape(2, 2))
    got: list[Any] = []

    async def main() -> None:
        out = await add_one(x)  # a call's Future: awaited in any loop
        got.append(cb.device_get(out))  # not the controller's loop: it waits, as JAX's

    def in_thread() -> None:
        try:
            asyncio.run(main())  # a fresh loop, neither the controller's nor pytest's
        except BaseException as exc:
            got.append(exc)

    t = threading.Thread(target=in_thread)
    t.start()
    t.join(60)
    assert len(got) == 1
    np.testing.assert_array_equal(got[0], np.arange(4).reshape(2, 2) + 1)
    # And from a plain thread (this one): its arrays, as JAX's.
    np.testing.assert_array_equal(np.asarray(add_one(x)), np.arange(4).reshape(2, 2) + 1)


async def test_code_shipped_once_per_host(ctl: cb.Controller) -> None:
    @cb.colocated_python
    def shipped_once(x: jax.Array) -> jax.Array:
        return x * 3 + 17  # unique body: a digest no other test sends

    x = _put_over_hosts(np.ones((2, 2), np.int32))
    before = ctl.stats()["code_sent"]
    await shipped_once(x)
    assert ctl.stats()["code_sent"] == before + 2  # once to each host
    await shipped_once(x)
    await shipped_once.specialize(out_specs_fn=lambda x: x)(x)
    await shipped_once.specialize(devices=cb.devices()).specialize(in_specs=None)(x)
    assert ctl.stats()["code_sent"] == before + 2
    # A call that reaches only host 0 sends nothing new either.
    await shipped_once(cb.device_put(np.ones(2, np.int32), cb.devices()[0]))
    assert ctl.stats()["code_sent"] == before + 2


async def test_module_functions_travel_by_reference(ctl: cb.Controller) -> None:
    from colobus._api.func import Code

    _, blob = Code(with_metadata.__wrapped__).get()
    assert len(blob) < 200  # a reference (module + name), not the code
    assert b"test_functions" in blob


def test_functools_wraps_metadata() -> None:
    assert with_metadata.__name__ == "with_metadata"
    assert with_metadata.__qualname__ == "with_metadata"
    assert with_metadata.__doc__ == "Docstring that functools.wraps keeps."
    assert with_metadata.__module__ == __name__
    assert with_metadata.__wrapped__.__name__ == "with_metadata"
    spec = with_metadata.specialize(out_specs_fn=lambda x: x)
    assert spec.__name__ == "with_metadata"
    assert spec.__doc__ == with_metadata.__doc__
    assert functools.WRAPPER_ASSIGNMENTS  # the attributes above are the ones it copies


async def test_outputs_none_leaves_kept(ctl: cb.Controller) -> None:
    @cb.colocated_python
    def with_nones(x: jax.Array) -> Any:
        return (x, None, {"a": None, "b": x + 1})

    x = cb.device_put(np.array([1, 2]), cb.devices()[0])
    out = with_nones(x)
    assert out[1] is None and out[2]["a"] is None
    got = cb.device_get(out)
    np.testing.assert_array_equal(got[2]["b"], [2, 3])


async def test_outputs_unsupported_leaf_type(ctl: cb.Controller) -> None:
    @cb.colocated_python
    def returns_str(x: jax.Array) -> Any:
        return "not an array"

    x = cb.device_put(np.array([1, 2]), cb.devices()[0])
    with pytest.raises(ValueError, match=(
            r"^colocated_python only supports jax\.Array as input and output, but got "
            r"<class 'str'>\.")):
        await returns_str(x)


async def test_outputs_python_scalars_and_numpy(ctl: cb.Controller) -> None:
    @cb.colocated_python
    def scalars(x: jax.Array) -> Any:
        return 3, 2.5, True, np.arange(3, dtype=np.int16)

    x = _put_over_hosts(np.zeros((2, 2)))
    try:
        out = scalars(x)
    except KeyError as exc:  # seen twice in full runs: say what the hosts dropped
        # (the host's own message says whether its PUT arrived, or a RELEASE took it)
        stats = ctl.stats()
        exc.add_note(f"dropped by the hosts: "
                     f"{ {i: h['dropped'] for i, h in stats['hosts'].items()} }; "
                     f"by the controller: {stats['dropped']}")
        exc.add_note(f"the array: ref {x.ref}, made at host generations {x._gens}; the hosts "
                     f"now: { {h.index: (h.generation, h.alive) for h in ctl._hosts.hosts} }; "
                     f"backlog {stats['backlog']}, resent {stats['resent']}")
        raise
    assert all(isinstance(o, cb.Array) for o in out)
    assert all(o.devices() == set(cb.devices()) for o in out)  # replicated on the call's mesh
    got = cb.device_get(out)
    assert got[0] == 3 and got[1] == 2.5 and bool(got[2]) is True
    np.testing.assert_array_equal(got[3], np.arange(3))
    assert got[3].dtype == np.int16


async def test_a_call_naming_an_array_the_host_lacks_says_what_the_host_saw(
        ctl: cb.Controller) -> None:
    """The host's KeyError for an array it does not hold says whether its PUT came, or
    which RELEASE took it (the diagnosis for the scalars test's flake)."""
    from colobus._api.array import Array

    dev = cb.devices()[0]
    y = cb.device_put(np.arange(3.0), dev)
    cb.block_until_ready(y)
    ref = y.ref
    alias = Array(ctl, y.ref, y.shape, y.dtype, y.sharding, owns_ref=False)
    y.delete()  # its RELEASE leaves ahead of the call below
    with pytest.raises(KeyError, match=rf"array {ref} is not on host 0 \(named at "
                       r"seq \d+: released by the RELEASE at seq \d+; its PUT came at seq \d+"):
        await add_one(alias)
    never = Array(ctl, (ctl._ops.next_id()) << 16, (3,), np.dtype(np.float64),
                  cb.SingleDeviceSharding(dev), owns_ref=False)
    with pytest.raises(KeyError, match=r"no PUT of it among this session's last \d+; "
                       r"session \d+ of this worker"):
        await add_one(never)


async def test_replicated_outputs_must_agree_in_shape(ctl: cb.Controller) -> None:
    @cb.colocated_python
    def ragged(x: jax.Array) -> Any:
        return np.zeros(int(np.asarray(x).reshape(-1)[0]) + 1)

    x = _put_over_hosts(np.array([[0], [1]]))
    with pytest.raises(ValueError, match=r"all hosts must agree on its shape and dtype"):
        await ragged(x)


async def test_single_device_call_returns_single_device_sharding(ctl: cb.Controller) -> None:
    d = cb.devices()[6]
    x = cb.device_put(np.arange(3.0), d)
    out = await add_one(x)
    assert isinstance(out.sharding, cb.SingleDeviceSharding)
    assert out.sharding == cb.SingleDeviceSharding(d)
    assert out.devices() == {d}


async def test_future_as_argument(ctl: cb.Controller) -> None:
    x = _put_over_hosts(np.arange(4, dtype=np.int32).reshape(2, 2))
    first = add_one(x)             # not awaited (its array, its call running)
    second = add_one(first)        # sent at once; hosts resolve `first` locally
    out = add_one({"a": second, "b": [first]})
    np.testing.assert_array_equal(cb.device_get(out["a"]), np.arange(4).reshape(2, 2) + 3)
    np.testing.assert_array_equal(cb.device_get(out["b"][0]),
                                  np.arange(4).reshape(2, 2) + 2)
    assert out["a"].sharding == x.sharding


async def test_future_as_argument_error_propagates(ctl: cb.Controller) -> None:
    x = cb.device_put(np.array([7]), cb.devices()[0])
    failing = raise_custom.specialize(out_specs_fn=lambda x: x)(x)  # its array at once
    with pytest.raises(CustomError, match=r"custom failure with block \[7\]"):
        await add_one(failing)  # (its error at the call where add_one waits, else here)
    with pytest.raises(CustomError):
        await failing


async def test_output_trees_travel_without_pickle(ctl: cb.Controller) -> None:
    """namedtuples, OrderedDicts and registered pytree nodes come back as themselves
    from a msgpack description (their classes are imported here)."""
    x = cb.device_put(np.array([1.0]), cb.devices()[0])
    out = fancy_tree(x)
    assert isinstance(out["p"], Pair) and isinstance(out["box"], Box)
    assert out["box"].tag == "t" and out["none"] is None
    assert isinstance(out["o"], collections.OrderedDict) and list(out["o"]) == ["b", "a"]
    got = cb.device_get(out)
    assert got["p"].b.tolist() == [2.0] and got["o"]["a"].tolist() == [2.0]
    assert got["box"].x.tolist() == [3.0]
