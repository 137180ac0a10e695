"""Side by side with ``jax.experimental.colocated_python``: the same bodies, the same answers.

Each check runs one function body under real JAX colocated Python in this
process (8 CPU devices, see conftest) and under colobus, and compares
shardings, device lists, dtypes and values. The shared 2-host x 4-device
cluster runs most of them; a module-scoped 8-host x 1-device cluster runs the
walk through upstream's list where each host has a single device.
"""

from __future__ import annotations

import base64
import collections.abc
import struct
import threading
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import colocated_python as cp

import colobus as cb
from colobus._controller.controller import _pop_current, _push_current

P = cb.PartitionSpec

# -- helpers that keep state on the hosts (module level: pickled by reference) -------------

_host_state: dict[str, Any] = {}


@cb.colocated_python
def seq_set(x: jax.Array) -> jax.Array:
    _host_state["seq"] = 100
    return x


@cb.colocated_python
def seq_bump(x: jax.Array) -> jax.Array:
    assert _host_state.get("seq") == 100, _host_state.get("seq")
    _host_state["seq"] += 1
    return x


@cb.colocated_python
def seq_check(x: jax.Array) -> jax.Array:
    assert _host_state.get("seq") == 101, _host_state.get("seq")
    return x


@cb.colocated_python
def barrier_init(x: jax.Array) -> jax.Array:
    _host_state["barrier"] = threading.Barrier(3)
    return x


@cb.colocated_python
def barrier_wait(x: jax.Array) -> jax.Array:
    _host_state["barrier"].wait(timeout=30)
    return x


@cb.colocated_python
def state_cleanup(x: jax.Array) -> jax.Array:
    _host_state.clear()
    return x


@cb.colocated_python
def set_global(x: jax.Array) -> jax.Array:
    _host_state["value"] = x
    return x + 1


@cb.colocated_python
def get_global(x: jax.Array) -> jax.Array:
    del x
    value: jax.Array = _host_state["value"]
    return value


@cb.colocated_python_class
class Accumulator:
    """JAX's ``test_stateful_object``: state kept per host between method calls."""

    def __init__(self, initial: np.ndarray[Any, Any]) -> None:
        self.value = initial

    def add(self, x: jax.Array) -> jax.Array:
        self.value = self.value + np.asarray(x)
        return jax.device_put(self.value, x.sharding)


@cb.colocated_python_class
class CapturedSharding:
    """JAX's ``test_object_with_captured_sharding``, verbatim: shardings stored by __init__."""

    def __init__(self, initial: np.ndarray[Any, Any], sharding1: Any, sharding2: Any) -> None:
        self.value = initial
        self.sharding1 = sharding1
        self.sharding2 = sharding2

    def add_sharding1(self, x: jax.Array) -> jax.Array:
        self.value = self.value + np.asarray(x)
        return jax.device_put(self.value, self.sharding1)

    def add_sharding2(self, x: jax.Array) -> jax.Array:
        self.value = self.value + np.asarray(x)
        return jax.device_put(self.value, self.sharding2)


@cb.colocated_python_class
class Fetcher:
    """JAX's ``test_object_method_specialization``: the sharding is a constructor argument."""

    def __init__(self, sharding: Any) -> None:
        self.sharding = sharding

    def fetch(self) -> jax.Array:
        return jax.device_put(np.array(1, dtype=np.int32), self.sharding)


# -- the two device models, as one namespace each ----------------------------------------------


def _jax_model() -> SimpleNamespace:
    return SimpleNamespace(
        devices=cp.colocated_cpu_devices(jax.local_devices()), Mesh=jax.sharding.Mesh,
        NamedSharding=jax.sharding.NamedSharding,
        SingleDeviceSharding=jax.sharding.SingleDeviceSharding,
        ShapeDtypeStruct=jax.ShapeDtypeStruct, device_put=jax.device_put,
        colocated_python=cp.colocated_python, get=jax.device_get)


def _cb_model() -> SimpleNamespace:
    return SimpleNamespace(
        devices=cb.colocated_cpu_devices(cb.devices()), Mesh=cb.Mesh,
        NamedSharding=cb.NamedSharding, SingleDeviceSharding=cb.SingleDeviceSharding,
        ShapeDtypeStruct=cb.ShapeDtypeStruct, device_put=cb.device_put,
        colocated_python=cb.colocated_python,
        get=lambda x: cb.device_get(x))


def _layout(sharding: Any) -> tuple[Any, ...]:
    """A sharding as plain data: kind, device ids in order, mesh shape and names, spec."""
    if isinstance(sharding, cb.SingleDeviceSharding | jax.sharding.SingleDeviceSharding):
        return ("single", [next(iter(sharding.device_set)).id])
    mesh = sharding.mesh
    ids = [d.id for d in np.asarray(mesh.devices).flat]
    return ("named", ids, tuple(mesh.devices.shape), tuple(mesh.axis_names), sharding.spec)


def _both(ctl: cb.Controller, test: Any) -> tuple[Any, Any]:
    """Run ``test(model)`` under JAX and under colobus (sync face)."""
    return test(_jax_model()), test(_cb_model())


# -- 1. device-model objects reaching host code ---------------------------------------------------


def _probe_objects(m: SimpleNamespace) -> Any:
    d0, d1 = m.devices[:2]
    s = m.SingleDeviceSharding(d0)
    mesh = m.Mesh(np.array([d0, d1]), ("x",))
    named = m.NamedSharding(mesh, P("x"))
    sds = m.ShapeDtypeStruct((4,), np.float32, sharding=named)

    class Holder:
        SHARDING = named  # a class attribute

    # (JAX's own pickler refuses a bare jax.Device in host code; colobus carries one,
    # see the next test. Devices reach this body inside meshes and shardings.)
    def probe(x: jax.Array, box: Any = {"shardings": [s], "sds": sds}) -> jax.Array:  # noqa: B006
        checks = [
            isinstance(s, jax.sharding.SingleDeviceSharding),
            isinstance(s.device_set.pop(), jax.Device),
            isinstance(mesh, jax.sharding.Mesh) and mesh.devices.shape == (2,),
            isinstance(named, jax.sharding.NamedSharding) and named.spec == P("x"),
            isinstance(Holder.SHARDING, jax.sharding.NamedSharding),
            isinstance(box["shardings"][0], jax.sharding.SingleDeviceSharding),
            isinstance(box["sds"], jax.ShapeDtypeStruct) and box["sds"].shape == (4,),
            int(jax.device_put(np.int32(1), s)) == 1,  # the repro
            int(jax.device_put(np.arange(2), named)[1]) == 1,
        ]
        return jax.device_put(np.array(checks), x.sharding)

    fn = m.colocated_python(probe)
    x = m.device_put(np.int32(0), d0)
    out = fn(x)
    return _layout(out.sharding), np.asarray(m.get(out))


def test_device_model_objects_arrive_as_jax_objects(ctl: cb.Controller) -> None:
    in_jax, in_cb = _both(ctl, _probe_objects)
    assert in_jax[1].all(), in_jax
    assert in_cb[0] == in_jax[0]
    np.testing.assert_array_equal(in_cb[1], in_jax[1])


async def test_device_model_objects_as_arguments_and_in_constructors(
        ctl: cb.Controller) -> None:
    d0, d1 = cb.devices()[:2]
    mesh = cb.Mesh(np.array([d0, d1]), ("x",))
    sharding1 = cb.NamedSharding(mesh, P())
    sharding2 = cb.NamedSharding(mesh, P("x"))

    @cb.colocated_python
    def as_args(x: jax.Array, objs: dict[str, Any], dev: Any = d1) -> jax.Array:
        ok = [isinstance(d0, jax.Device), isinstance(dev, jax.Device),  # closure, default
              d0 in x.sharding.device_set, isinstance(objs["mesh"], jax.sharding.Mesh),
              all(isinstance(d, jax.Device) for d in objs["devices"]),
              isinstance(objs["shardings"][1], jax.sharding.NamedSharding)]
        return jax.device_put(np.array(ok), x.sharding)

    x = cb.device_put(np.int32(0), d0)
    got = cb.device_get(await as_args(
        x, {"mesh": mesh, "devices": (d0, d1), "shardings": [sharding1, sharding2]}))
    assert got.all()

    # Upstream's test_object_with_captured_sharding, verbatim on the host side.
    value = CapturedSharding(np.array([5, 15], np.int32), sharding1, sharding2)
    y = cb.device_put(np.array([1], np.int32), sharding1)
    out = await value.add_sharding1(y)
    assert out.sharding == sharding1
    np.testing.assert_array_equal(cb.device_get(out), [6, 16])
    out = await value.add_sharding2(y)
    assert out.sharding == sharding2 and _layout(out.sharding) == _layout(sharding2)
    np.testing.assert_array_equal(cb.device_get(out), [7, 17])
    cb.close(value)

    # Upstream's test_object_method_specialization: a sharding given to __init__.
    obj = Fetcher(cb.SingleDeviceSharding(d0))
    obj.fetch = obj.fetch.specialize(devices=[d0])
    out = await obj.fetch()
    assert out.sharding == cb.SingleDeviceSharding(d0) and out.dtype == np.int32
    assert int(cb.device_get(out)) == 1
    cb.close(obj)


async def test_mesh_over_hosts_becomes_the_hosts_sub_mesh(ctl: cb.Controller) -> None:
    mesh = cb.Mesh(np.array(cb.devices()).reshape(2, 4), ("hosts", "devices"))
    rows = cb.NamedSharding(mesh, P("hosts"))
    sds = cb.ShapeDtypeStruct((2, 8), np.float32, sharding=rows)
    other = cb.devices()[5]  # on host 1

    @cb.colocated_python
    def view(x: jax.Array) -> jax.Array:
        sub = rows.mesh  # this host's part of the mesh, as JAX multi-controller lays blocks
        seen = [sub.devices.shape == (1, 4), sub.axis_names == ("hosts", "devices"),
                [d.id for d in sub.devices.flat] == [d.id for d in x.sharding.mesh.devices.flat],
                sds.shape == (1, 8), sds.sharding == x.sharding,
                isinstance(other, jax.Device), other.id, other.process_index]
        return jax.device_put(np.array([seen], np.int32), rows)  # laid out as captured

    x = cb.device_put(np.zeros((2, 8), np.float32), rows)
    out = await view(x)
    assert out.sharding == rows and out.shape == (2, 8)
    got = cb.device_get(out)
    # Host 0 cannot address device 5: it gets the colobus Device, a stand-in with the
    # global id and host. Host 1 gets its jax.Device, whose id and process_index are
    # that worker's own JAX numbering (its second device; one process per host).
    np.testing.assert_array_equal(got, [[1, 1, 1, 1, 1, 0, 5, 1], [1, 1, 1, 1, 1, 1, 1, 0]])


def test_localize_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_hostside`` as host 1 of a 2 x 2 cluster, on this process's JAX devices."""
    from colobus._api.func import pickle_args
    from colobus._model import jaxside as _hostside
    from colobus._wire.envelope import loads

    jdevs = jax.devices()[:2]
    monkeypatch.setattr(_hostside, "_host", 1)
    monkeypatch.setattr(_hostside, "_devices", {2: jdevs[0], 3: jdevs[1]})
    monkeypatch.setattr(_hostside, "_ids", {jdevs[0]: 2, jdevs[1]: 3})
    monkeypatch.setattr(_hostside, "_meshes", {})
    devs = [cb.Device(i, i // 2, "cpu", "cpu", i % 2) for i in range(4)]
    mesh = cb.Mesh(np.array(devs).reshape(2, 2), ("hosts", "devices"))
    rows = cb.NamedSharding(mesh, P("hosts"))
    objs = (devs[3], devs[0], mesh, rows, cb.SingleDeviceSharding(devs[1]),
            cb.ShapeDtypeStruct((4, 6), np.float32, rows), cb.ShapeDtypeStruct((3,), np.int8),
            cb.Mesh(np.array(devs[:2]), "x"))
    pickled = pickle_args((objs, {}), "f")
    (dev, other, sub, local, remote_single, sds, plain, remote_mesh), _ = loads(pickled.payload)
    assert dev is jdevs[1]
    # Another host's device: the colobus Device, a stand-in (so are meshes and shardings
    # with no device here).
    assert isinstance(other, cb.Device) and (other.id, other.process_index) == (0, 0)
    assert isinstance(sub, jax.sharding.Mesh) and sub.axis_names == ("hosts", "devices")
    assert list(sub.devices.flat) == jdevs and sub.devices.shape == (1, 2)
    assert local == jax.sharding.NamedSharding(sub, P("hosts"))
    assert isinstance(remote_single, cb.SingleDeviceSharding) and remote_single == objs[4]
    assert isinstance(remote_mesh, cb.Mesh) and remote_mesh == objs[7]
    assert sds == jax.ShapeDtypeStruct((2, 6), np.float32, sharding=local)  # the host's block
    assert plain == jax.ShapeDtypeStruct((3,), np.int8)
    # The host's devices must form a sub-box of the mesh.
    diagonal = cb.Mesh(np.array([devs[0], devs[2], devs[3], devs[1]]).reshape(2, 2), ("a", "b"))
    with pytest.raises(ValueError, match="do not form a sub-box"):
        loads(pickle_args(((diagonal,), {}), "f").payload)


# -- 2 and 3. outputs keep their sharding; cb.Array answers like jax.Array ----------------------


def _different_device_orders(m: SimpleNamespace) -> Any:
    # Upstream's test_inputs_with_different_device_orders, the body verbatim.
    def add(x: jax.Array, y: jax.Array) -> jax.Array:
        arrays = [
            x.addressable_shards[1].data + y.addressable_shards[0].data,
            x.addressable_shards[0].data + y.addressable_shards[1].data,
        ]
        return jax.make_array_from_single_device_arrays(y.shape, y.sharding, arrays)

    devs = m.devices[:2]
    fn = m.colocated_python(add).specialize(devices=devs)
    sharding1 = m.NamedSharding(m.Mesh([devs[0], devs[1]], "x"), P("x"))
    sharding2 = m.NamedSharding(m.Mesh([devs[1], devs[0]], "x"), P("x"))
    x = m.device_put(np.array([0, 2], np.int32), sharding1)
    y = m.device_put(np.array([4, 8], np.int32), sharding2)
    out = fn(x, y)
    return (_layout(out.sharding), [s.device.id for s in out.addressable_shards],
            out.dtype, np.asarray(m.get(out)))


def test_output_keeps_the_sharding_it_was_made_with(ctl: cb.Controller) -> None:
    in_jax, in_cb = _both(ctl, _different_device_orders)
    assert in_jax[1] == [1, 0]
    assert in_cb[:3] == in_jax[:3]
    np.testing.assert_array_equal(in_cb[3], in_jax[3])
    np.testing.assert_array_equal(in_cb[3], [2 + 4, 0 + 8])


@cb.colocated_python
def same_or_fresh(x: jax.Array) -> Any:
    return x, jax.device_put(np.arange(3, dtype=np.int32), x.sharding) + 1


def test_one_device_outputs_keep_their_device(ctl: cb.Controller) -> None:
    """The one-device fast path: ``return x`` keeps x's sharding object, like JAX."""
    d = ctl.devices()[1]
    x = cb.device_put(np.arange(4, dtype=np.float32), d)
    same, fresh = same_or_fresh(x)
    assert same.sharding is x.sharding
    assert fresh.sharding == cb.SingleDeviceSharding(d) and fresh.shape == (3,)
    np.testing.assert_array_equal(np.asarray(same), np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(fresh), np.arange(3) + 1)


def _array_answers(arr: Any, fetch: Any) -> dict[str, Any]:
    return {
        "shape": arr.shape, "ndim": arr.ndim, "size": arr.size, "nbytes": arr.nbytes,
        "itemsize": arr.itemsize, "len": len(arr) if arr.ndim else None,
        "dtype": arr.dtype, "replicated": arr.is_fully_replicated,
        "addressable": arr.is_fully_addressable,
        "devices": sorted(d.id for d in arr.devices()),
        "shards": [(s.device.id, s.index, s.replica_id) for s in arr.addressable_shards],
        "data": [np.asarray(fetch(s.data)).tolist() for s in arr.addressable_shards],
        "leaf": jax.tree_util.tree_leaves([arr]) == [arr],
    }


@pytest.mark.parametrize("layout", ["rows", "both", "replicated", "single"])
def test_array_answers_like_jax_array(ctl: cb.Controller, layout: str) -> None:
    data = np.arange(16, dtype=np.float32).reshape(2, 8)
    spec = {"rows": P("hosts"), "both": P("hosts", "devices"), "replicated": P()}

    def make(m: SimpleNamespace) -> Any:
        if layout == "single":
            return m.device_put(data, m.SingleDeviceSharding(m.devices[6]))
        mesh = m.Mesh(np.array(m.devices).reshape(2, 4), ("hosts", "devices"))
        return m.device_put(data, m.NamedSharding(mesh, spec[layout]))

    jarr, carr = make(_jax_model()), make(_cb_model())
    assert _array_answers(carr, lambda d: d) == _array_answers(jarr, lambda a: a)
    assert f"hosts={sorted({d.host for d in carr.devices()})}" in repr(carr)
    if layout == "replicated":
        np.testing.assert_array_equal(np.asarray(carr.addressable_shards[7].data), data)


# -- 7. replicated outputs whose hosts disagree --------------------------------------------------


async def test_replicated_output_hosts_disagree(ctl: cb.Controller) -> None:
    mesh = cb.Mesh(np.array(cb.devices()).reshape(2, 4), ("hosts", "devices"))
    x = cb.device_put(np.arange(8, dtype=np.float32).reshape(2, 4),
                      cb.NamedSharding(mesh, P("hosts", "devices")))

    @cb.colocated_python
    def stats(x: jax.Array) -> jax.Array:
        return jnp.stack([x.mean()])  # each host's own mean: not the same value

    # As JAX keeps replicas: each device's shard holds its host's mean, the array's value
    # is the first shard's (JAX never compares them).
    means = await stats(x)
    assert [float(s.data[0]) for s in means.addressable_shards] == [1.5] * 4 + [5.5] * 4
    np.testing.assert_array_equal(cb.device_get(means), [1.5])
    # Asked for, they are compared (colobus's check_replicas=True): the call fails.
    with pytest.raises(ValueError, match=r"replicated over hosts \[0, 1\]") as info:
        await stats.specialize(check_replicas=True)(x)
    text = str(info.value)
    assert "host 0 and host 1 returned different values" in text
    assert "shard the output over the hosts" in text
    assert "return the same value on every host" in text

    @cb.colocated_python
    def same(x: jax.Array) -> jax.Array:
        return jnp.stack([jnp.float32(x.shape[0])])  # the same on both hosts

    np.testing.assert_array_equal(cb.device_get(await same(x)), [1.0])

    @cb.colocated_python
    def per_host(x: jax.Array) -> jax.Array:  # the fix: shard it over the hosts
        return jax.device_put(jnp.reshape(x.mean(), (1,)),
                              jax.sharding.NamedSharding(x.sharding.mesh, P("hosts")))

    np.testing.assert_array_equal(cb.device_get(await per_host(x)), [1.5, 5.5])


# -- 8 and 9. numpy meets futures; hints on JAX's errors ----------------------------------------


def test_numpy_of_futures(ctl: cb.Controller) -> None:
    @cb.colocated_python
    def plus_one(x: jax.Array) -> jax.Array:
        return x + 1

    x = cb.device_put(np.arange(4, dtype=np.int32), cb.devices()[0])
    np.testing.assert_array_equal(np.asarray(cb.device_get(x)), np.arange(4))
    np.testing.assert_array_equal(np.asarray(plus_one(x)), np.arange(4) + 1)
    assert np.asarray(cb.device_get(x), dtype=np.float64).dtype == np.float64

    # On the controller's loop thread: the same RuntimeError as .result().
    fut: cb.Future[Any] = cb.Future(loop_thread=threading.get_ident())
    with pytest.raises(RuntimeError) as from_result:
        fut.result()
    with pytest.raises(RuntimeError) as from_numpy:
        np.asarray(fut)
    assert str(from_numpy.value) == str(from_result.value)


def test_plain_numpy_arguments_get_a_note(ctl: cb.Controller) -> None:
    @cb.colocated_python
    def plus_one(x: Any) -> Any:
        return x + 1

    no_devices = ("No devices found. colocated_python function without input arguments must "
                  "be first specialized with devices.")
    for arg in (np.arange(3), [1, 2]):
        with pytest.raises(ValueError) as info:
            plus_one(arg)
        # JAX's text first, and what to do in the message too (print(e) shows no notes)
        assert str(info.value).startswith(no_devices + " colobus: ")
        assert "cb.device_put" in str(info.value)
        assert "cb.device_put" in "\n".join(info.value.__notes__)
    with pytest.raises(ValueError) as info:
        plus_one()
    assert str(info.value) == no_devices  # no arguments: JAX's text alone
    assert not getattr(info.value, "__notes__", None)


# -- 5. specialization and caching observable ------------------------------------------------------


def test_cache_info_counts_like_jax(ctl: cb.Controller) -> None:
    # Upstream's test_input_polymorphism_without_out_specs_fn: misses 1, 1, 2, 2.
    @cb.colocated_python
    def add_one(x: Any) -> Any:
        return jax.tree.map(lambda v: v + 1, x)

    d0 = cb.devices()[0]
    x = cb.device_put(np.array(1), d0)
    misses = []
    for arg in (x, x, cb.device_put([np.array(1), (np.array(2), {"v": np.array(3)})], d0)):
        cb.block_until_ready(add_one(arg))
        misses.append(add_one.cache_info().misses)
    cb.block_until_ready(add_one(cb.device_put([np.array(1), (np.array(2), {"v": np.array(3)})],
                                               d0)))
    misses.append(add_one.cache_info().misses)
    assert misses == [1, 1, 2, 2]
    info = add_one.cache_info()
    assert info.hits == 2 and info.code_shipped == {0: 1}

    everywhere = add_one.specialize(devices=cb.devices())
    x_all = cb.device_put(np.array(1), cb.NamedSharding(cb.Mesh(np.array(cb.devices()), "d"),
                                                        P()))
    cb.block_until_ready(everywhere(x_all))
    cb.block_until_ready(everywhere(x_all))
    assert everywhere.cache_info().misses == 1
    assert add_one.cache_info().code_shipped == {0: 1, 1: 1}  # shared code, once per host
    assert all(h["code_sent"] >= 1 for h in ctl.stats()["hosts"].values())


# -- 6. upstream's list on 8 hosts x 1 device ---------------------------------------------


@pytest.fixture(scope="module")
def eight() -> collections.abc.Iterator[cb.Controller]:
    # The block view: these assert what each host sees of its own block (a one-device
    # sub-mesh, its own device numbering, three threads' calls meeting on every host);
    # the global view's are tests/test_jaxjob.py and tests/test_globalview.py.
    with cb.local_cluster(hosts=8, devices_per_host=1, jax_distributed=False) as ctl:
        _push_current(ctl)
        try:
            yield ctl
        finally:
            _pop_current(ctl)


def test_eight_hosts_outputs_and_objects(eight: cb.Controller) -> None:
    devs = cb.devices()
    assert len(devs) == 8 and len({d.host for d in devs}) == 8
    d0, d1 = devs[:2]

    # Different device orders, where each host has one device: upstream indexes
    # addressable_shards[1], which (as in JAX multi-controller) a one-device host
    # does not have; pairing shards by device is the portable body.
    @cb.colocated_python
    def add(x: jax.Array, y: jax.Array) -> jax.Array:
        by_device = {s.device: s.data for s in x.addressable_shards}
        arrays = [s.data + by_device[s.device] for s in y.addressable_shards]
        return jax.make_array_from_single_device_arrays(y.shape, y.sharding, arrays)

    sharding1 = cb.NamedSharding(cb.Mesh([d0, d1], "x"), P("x"))
    sharding2 = cb.NamedSharding(cb.Mesh([d1, d0], "x"), P("x"))
    x = cb.device_put(np.array([0, 2], np.int32), sharding1)
    y = cb.device_put(np.array([4, 8], np.int32), sharding2)
    out = add.specialize(devices=[d0, d1])(x, y)
    assert _layout(out.sharding) == _layout(sharding2)
    assert [s.device for s in out.addressable_shards] == [d1, d0]
    np.testing.assert_array_equal(np.asarray(out), [2 + 4, 0 + 8])

    # A mesh over all hosts, captured: each host sees its one-device sub-mesh.
    mesh = cb.Mesh(np.array(devs), ("hosts",))
    rows = cb.NamedSharding(mesh, P("hosts"))

    @cb.colocated_python
    def where(x: jax.Array) -> jax.Array:
        sub = rows.mesh
        row = [sub.devices.shape[0], sub.devices.flat[0].id, int(np.asarray(x)[0])]
        return jax.device_put(np.array([row], np.int32), rows)

    out = where(cb.device_put(np.arange(8, dtype=np.int32), rows))
    assert out.sharding == rows
    # (a host's jax.Device ids are its own JAX numbering: 0 on every one-device host)
    np.testing.assert_array_equal(np.asarray(out), [[1, 0, h] for h in range(8)])

    # Replicas that disagree: each host's on its shard, as JAX keeps them; compared where
    # asked (check_replicas=True), they name the hosts.
    @cb.colocated_python
    def own(x: jax.Array) -> jax.Array:
        return jnp.stack([x.sum()])  # each host's own block: replicas that differ

    sums = own(cb.device_put(np.arange(8, dtype=np.int32), rows))
    assert [int(s.data[0]) for s in sums.addressable_shards] == list(range(8))
    with pytest.raises(ValueError, match=r"replicated over hosts \[0, 1, 2, 3, 4, 5, 6, 7\]"):
        cb.block_until_ready(own.specialize(check_replicas=True)(
            cb.device_put(np.arange(8, dtype=np.int32), rows)))

    # Stateful objects and method specialization, per host.
    acc = Accumulator(np.array(5, np.int32))
    k = cb.device_put(np.array(1, np.int32), devs[7])
    assert int(np.asarray(acc.add(k))) == 6
    assert int(np.asarray(acc.add(k))) == 7
    cb.close(acc)
    obj = Fetcher(cb.SingleDeviceSharding(devs[3]))
    obj.fetch = obj.fetch.specialize(devices=[devs[3]])
    out = obj.fetch()
    assert out.sharding == cb.SingleDeviceSharding(devs[3]) and int(np.asarray(out)) == 1
    cb.close(obj)


def test_eight_hosts_execution_strings_and_keys(eight: cb.Controller) -> None:
    devs = cb.devices()
    everywhere = cb.NamedSharding(cb.Mesh(np.array(devs), ("hosts",)), P())
    x = cb.device_put(np.int32(1), everywhere)
    try:
        # Sequential: calls from one thread run in order on every host, unawaited.
        f0, f1, f2 = (f.specialize(out_specs_fn=lambda v: v) for f in (seq_set, seq_bump,
                                                                       seq_check))
        f0(x)
        f1(x)
        cb.block_until_ready(f2(x))
        # Concurrent: three threads meet at a barrier on every host.
        cb.block_until_ready(barrier_init(x))
        threads = [threading.Thread(target=lambda: cb.block_until_ready(barrier_wait(x)))
                   for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        # Module variable access.
        cb.block_until_ready(set_global(x))
        assert int(np.asarray(get_global(cb.device_put(np.int32(2), everywhere)))) == 1
    finally:
        cb.block_until_ready(state_cleanup(x))

    # Strings, one per host, upper-cased where they live.
    @cb.colocated_python
    def upper(s: jax.Array) -> jax.Array:
        out = [jax.device_put(np.vectorize(str.upper, otypes=[np.dtypes.StringDType()])(
            np.asarray(shard.data)), shard.device) for shard in s.addressable_shards]
        return jax.make_array_from_single_device_arrays(s.shape, s.sharding, out)

    words = np.array([f"w{i}x" for i in range(8)], dtype=np.dtypes.StringDType())
    rows = cb.NamedSharding(cb.Mesh(np.array(devs), ("hosts",)), P("hosts"))
    got = np.asarray(upper(cb.device_put(words, rows)))
    assert got.tolist() == [f"W{i}X" for i in range(8)]

    # Binary data as base64 text.
    @cb.colocated_python
    def bump(s: jax.Array) -> jax.Array:
        a, b = struct.unpack("<ii", base64.b64decode(str(np.asarray(s)[0]).encode("ascii")))
        text = base64.b64encode(struct.pack("<ii", a + 1, b + 1)).decode("ascii")
        return jax.device_put(np.array([text], dtype=np.dtypes.StringDType()), s.sharding)

    packed = base64.b64encode(struct.pack("<ii", 1001, 1002)).decode("ascii")
    s = cb.device_put(np.array([packed], dtype=np.dtypes.StringDType()), devs[6])
    back = np.asarray(bump(s))
    assert struct.unpack("<ii", base64.b64decode(str(back[0]).encode("ascii"))) == (1002, 1003)

    # PRNG keys in, out and round-tripped, in a mixed tree, on every host.
    @cb.colocated_python
    def step(tree: Any) -> Any:
        k1, k2 = jax.random.split(tree["key"])
        return {"key": k1, "noise": jax.random.normal(k2, (2,)), "none": None}

    key = jax.random.key(1)
    out = step({"key": cb.device_put(key, everywhere)})
    assert out["none"] is None and out["key"].sharding == everywhere
    got = cb.device_get(out)
    k1, k2 = jax.random.split(key)
    np.testing.assert_array_equal(jax.random.key_data(got["key"]), jax.random.key_data(k1))
    np.testing.assert_allclose(got["noise"], np.asarray(jax.random.normal(k2, (2,))))
