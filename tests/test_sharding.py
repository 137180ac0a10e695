"""Tests for colobus._model.sharding: layouts must match JAX's, host blocks must be exact."""

from __future__ import annotations

import os

# Eight CPU devices for the JAX side of the comparisons; must precede importing jax.
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import pickle
import re
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colobus._model.blocks import HostBlock, assemble, global_shape_from_host, host_blocks
from colobus._model.devices import Device, Mesh, colocated_cpu_devices_from
from colobus._model.sharding import (
    NamedSharding,
    PartitionSpec,
    ShapeDtypeStruct,
    Sharding,
    SingleDeviceSharding,
)

P = PartitionSpec
SETTINGS = settings(max_examples=100, deadline=None)
AXES = ("x", "y", "z")


def cpu_devices(n: int = 8, per_host: int = 4) -> list[Device]:
    return [Device(i, i // per_host, "cpu", "cpu", i % per_host) for i in range(n)]


DEVS = cpu_devices()
JAX_DEVS = jax.devices()


def jax_devices_like(ids: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.vectorize(lambda i: JAX_DEVS[i], otypes=[object])(ids)


def mesh_pair(ids: np.ndarray[Any, Any], names: tuple[str, ...]) -> tuple[Mesh, jax.sharding.Mesh]:
    cb_devs = np.vectorize(lambda i: DEVS[i], otypes=[object])(ids)
    return Mesh(cb_devs, names), jax.sharding.Mesh(jax_devices_like(ids), names)


def by_id(index_map: dict[Any, tuple[slice, ...]]) -> dict[int, tuple[slice, ...]]:
    return {d.id: idx for d, idx in index_map.items()}


def spans(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


# --------------------------------------------------------------------------- strategies


def factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    if k == 1:
        return [(n,)]
    return [
        (f, *rest) for f in range(1, n + 1) if n % f == 0 for rest in factorizations(n // f, k - 1)
    ]


@st.composite
def meshes(draw: st.DrawFn, max_devices: int = 8) -> tuple[np.ndarray[Any, Any], tuple[str, ...]]:
    ndim = draw(st.integers(1, 3))
    n = draw(st.sampled_from([k for k in (1, 2, 4, 8) if k <= max_devices]))
    shape = draw(st.sampled_from(factorizations(n, ndim)))
    ids = draw(st.permutations(range(8)))[:n]
    return np.array(ids).reshape(shape), AXES[:ndim]


@st.composite
def specs(draw: st.DrawFn, names: tuple[str, ...], max_rank: int = 3) -> PartitionSpec:
    free = list(draw(st.permutations(names)))
    length = draw(st.integers(0, max_rank))
    entries: list[Any] = []
    for _ in range(length):
        kind = draw(st.sampled_from(["none", "one", "many"]))
        if kind == "none" or not free:
            entries.append(None)
        elif kind == "one":
            entries.append(free.pop())
        else:
            k = draw(st.integers(1, len(free)))
            entries.append(tuple(free.pop() for _ in range(k)))
    return P(*entries)


@st.composite
def layouts(draw: st.DrawFn) -> tuple[Mesh, jax.sharding.Mesh, PartitionSpec, tuple[int, ...]]:
    ids, names = draw(meshes())
    spec = draw(specs(names))
    cb_mesh, jax_mesh = mesh_pair(ids, names)
    sizes = dict(zip(names, ids.shape, strict=True))
    rank = draw(st.integers(len(spec), 3))
    shape = []
    for d in range(rank):
        entry = spec[d] if d < len(spec) else None
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        factor = int(np.prod([sizes[a] for a in axes]))
        shape.append(factor * draw(st.integers(0, 3)))
    return cb_mesh, jax_mesh, spec, tuple(shape)


# --------------------------------------------------------------------------- devices and meshes


def test_device_identity_order_and_repr() -> None:
    a = Device(3, 0, "cpu", "cpu", 3)
    assert a == Device(3, 9, "gpu", "other", 0)  # by id only
    assert hash(a) == hash(Device(3, 1, "tpu", "x", 7))
    assert a != Device(4, 0, "cpu", "cpu", 3)
    assert sorted([DEVS[5], DEVS[1], DEVS[3]]) == [DEVS[1], DEVS[3], DEVS[5]]
    assert DEVS[1] < DEVS[2] <= DEVS[2] < DEVS[7] and DEVS[7] >= DEVS[6] > DEVS[5]
    assert repr(a) == "Device(id=3, host=0, platform='cpu')"
    assert DEVS[6].process_index == 1
    assert pickle.loads(pickle.dumps(DEVS[6])) == DEVS[6]


def test_mesh_properties() -> None:
    mesh = Mesh(np.array(DEVS).reshape(2, 4), ("hosts", "devices"))
    assert mesh.axis_names == ("hosts", "devices")
    assert mesh.shape == {"hosts": 2, "devices": 4}
    assert list(mesh.shape) == ["hosts", "devices"]
    assert mesh.size == 8 and mesh.axis_sizes == (2, 4)
    assert mesh.device_ids.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh.devices.dtype == object and mesh.devices[1, 2] == DEVS[6]
    assert Mesh([[d for d in DEVS[:4]], DEVS[4:]], ["hosts", "devices"]) == mesh
    assert hash(Mesh(np.array(DEVS).reshape(2, 4), ("hosts", "devices"))) == hash(mesh)
    assert mesh != Mesh(np.array(DEVS).reshape(4, 2), ("hosts", "devices"))
    assert mesh != Mesh(np.array(DEVS).reshape(2, 4), ("a", "b"))
    assert Mesh(DEVS, "x").axis_names == ("x",)
    assert pickle.loads(pickle.dumps(mesh)) == mesh
    with pytest.raises(ValueError):
        mesh.devices[0, 0] = DEVS[7]  # read-only


def test_mesh_errors_like_jax() -> None:
    arr = np.array(DEVS).reshape(2, 4)
    with pytest.raises(ValueError) as jax_err:
        jax.sharding.Mesh(np.array(JAX_DEVS).reshape(2, 4), ("x",))
    with pytest.raises(ValueError) as cb_err:
        Mesh(arr, ("x",))
    assert str(cb_err.value) == str(jax_err.value)
    with pytest.raises(ValueError, match="unique"):
        Mesh([DEVS[0], DEVS[0]], "x")
    with pytest.raises(ValueError, match="unique"):
        Mesh(arr, ("x", "x"))
    with pytest.raises(TypeError):
        Mesh([JAX_DEVS[0]], "x")
    with pytest.raises(ValueError):
        Mesh(np.empty((0,), dtype=object), "x")


def test_shape_dtype_struct() -> None:
    s = ShapeDtypeStruct([2, np.int64(3)], "float32")
    assert s.shape == (2, 3) and isinstance(s.shape[1], int)
    assert s.dtype == np.dtype(np.float32) and isinstance(s.dtype, np.dtype)
    assert s.ndim == 2 and s.size == 6 and s.sharding is None
    assert s == ShapeDtypeStruct((2, 3), np.float32)
    sharding = SingleDeviceSharding(DEVS[0])
    assert ShapeDtypeStruct((), bool, sharding).sharding == sharding
    key = ShapeDtypeStruct((2,), jax.random.key(0).dtype)
    assert key.dtype == jax.random.key(0).dtype
    with pytest.raises(TypeError):
        ShapeDtypeStruct((2,), "not a dtype")
    with pytest.raises(ValueError):
        ShapeDtypeStruct((-1,), np.int8)


# --------------------------------------------------------------------------- JAX equivalence


@SETTINGS
@given(layouts())
def test_devices_indices_map_matches_jax(
    layout: tuple[Mesh, jax.sharding.Mesh, PartitionSpec, tuple[int, ...]],
) -> None:
    cb_mesh, jax_mesh, spec, shape = layout
    cb = NamedSharding(cb_mesh, spec)
    jx = jax.sharding.NamedSharding(jax_mesh, spec)
    cb_map = cb.devices_indices_map(shape)
    assert by_id(cb_map) == by_id(jx.devices_indices_map(shape))
    assert list(cb_map) == list(cb.device_list)
    assert [d.id for d in cb.device_list] == [d.id for d in jx._device_assignment]
    assert cb.device_set == set(cb_mesh.devices.flat)
    assert cb.shard_shape(shape) == jx.shard_shape(shape)
    assert cb.is_fully_replicated == jx.is_fully_replicated


@SETTINGS
@given(st.data())
def test_jax_rejections_are_value_errors(data: st.DataObject) -> None:
    ids, names = data.draw(meshes())
    cb_mesh, jax_mesh = mesh_pair(ids, names)
    spec = data.draw(specs(names))
    shape = tuple(data.draw(st.lists(st.integers(0, 9), max_size=3)))
    jx = jax.sharding.NamedSharding(jax_mesh, spec)
    expected: dict[Any, tuple[slice, ...]] | None
    try:
        expected = jx.devices_indices_map(shape)
    except (ValueError, IndexError):
        expected = None
    if len(spec) > len(shape):
        # devices_indices_map tolerates trailing None entries past the rank, but
        # jax.device_put rejects any spec longer than the rank; colobus does too.
        with pytest.raises(ValueError):
            jax.device_put(np.zeros(shape), jx)
        expected = None
    cb = NamedSharding(cb_mesh, spec)
    if expected is not None:
        assert by_id(cb.devices_indices_map(shape)) == by_id(expected)
        return
    with pytest.raises(ValueError, match=r"rank at least|evenly divide the shape"):
        cb.devices_indices_map(shape)
    with pytest.raises(ValueError, match=r"rank at least|evenly divide the shape"):
        cb.shard_shape(shape)


def test_rejection_messages() -> None:
    cb_mesh, jax_mesh = mesh_pair(np.arange(8).reshape(2, 4), ("x", "y"))
    # Indivisible: the same text as JAX's, but for the sharding's own repr.
    with pytest.raises(ValueError) as jax_err:
        jax.sharding.NamedSharding(jax_mesh, P("x")).devices_indices_map((3,))
    with pytest.raises(ValueError) as cb_err:
        NamedSharding(cb_mesh, P("x")).devices_indices_map((3,))
    tail = "implies that array axis 0 is partitioned 2 times, but the dimension size is 3"
    assert tail in str(jax_err.value) and tail in str(cb_err.value)
    assert str(cb_err.value).endswith(str(jax_err.value).split("memory_kind=device) ")[1])
    # Unknown axis and duplicate axis: JAX's texts exactly.
    for bad in (P("z"), P("x", "x"), P(("x", "y"), "x"), P(None, ("y", "y"))):
        # JAX raises DuplicateSpecError (not a ValueError) for the duplicates.
        with pytest.raises(Exception) as jax_err:
            jax.sharding.NamedSharding(jax_mesh, bad)
        with pytest.raises(ValueError) as cb_err:
            NamedSharding(cb_mesh, bad)
        assert str(cb_err.value) == str(jax_err.value)
    # Spec longer than the rank: JAX's device_put text.
    with pytest.raises(ValueError, match=re.escape("is only valid for values of rank at least 3")):
        NamedSharding(cb_mesh, P("x", None, "y")).devices_indices_map((4,))
    with pytest.raises(ValueError, match="UNCONSTRAINED"):
        NamedSharding(cb_mesh, P(P.UNCONSTRAINED))
    with pytest.raises(TypeError):
        NamedSharding(jax_mesh, P())  # type: ignore[arg-type]


def test_single_device_sharding_matches_jax() -> None:
    cb = SingleDeviceSharding(DEVS[3])
    jx = jax.sharding.SingleDeviceSharding(JAX_DEVS[3])
    for shape in [(), (5,), (4, 0, 2)]:
        assert by_id(cb.devices_indices_map(shape)) == by_id(jx.devices_indices_map(shape))
        assert cb.shard_shape(shape) == shape
    assert cb.device_list == (DEVS[3],) and cb.device_set == {DEVS[3]}
    assert cb.is_fully_replicated and cb.device == DEVS[3]
    assert pickle.loads(pickle.dumps(cb)) == cb


# --------------------------------------------------------------------------- equality by layout


def layout_signature(sharding: Sharding, rank: int) -> dict[int, tuple[tuple[int, int], ...]]:
    shape = (8,) * rank  # every tiling factor of an 8-device mesh divides 8
    return {d.id: spans(idx, shape) for d, idx in sharding.devices_indices_map(shape).items()}


@st.composite
def small_shardings(draw: st.DrawFn) -> Sharding:
    if draw(st.integers(0, 5)) == 0:
        return SingleDeviceSharding(DEVS[draw(st.sampled_from([0, 1]))])
    n = draw(st.sampled_from([1, 2]))
    ndim = draw(st.integers(1, 2))
    shape = draw(st.sampled_from(factorizations(n, ndim)))
    ids = draw(st.sampled_from([[0, 1], [1, 0]]))[:n]
    names = AXES[:ndim]
    mesh = Mesh(np.array([DEVS[i] for i in ids], dtype=object).reshape(shape), names)
    return NamedSharding(mesh, draw(specs(names, max_rank=2)))


@SETTINGS
@given(small_shardings(), small_shardings())
def test_equality_is_by_layout(a: Sharding, b: Sharding) -> None:
    rank = 2
    same = layout_signature(a, rank) == layout_signature(b, rank)
    assert (a == b) == same
    if same:
        assert hash(a) == hash(b)


def test_equality_examples() -> None:
    mesh = Mesh(np.array(DEVS).reshape(2, 4), ("x", "y"))
    assert NamedSharding(mesh, P("x", None)) == NamedSharding(mesh, P("x"))
    assert NamedSharding(mesh, P(("x",))) == NamedSharding(mesh, P("x"))
    assert NamedSharding(mesh, P(("x", "y"))) == NamedSharding(Mesh(DEVS, "z"), P("z"))
    assert NamedSharding(mesh, P()) == NamedSharding(Mesh(DEVS, "z"), P(None))
    assert NamedSharding(mesh, P("x")) != NamedSharding(mesh, P("y"))
    assert NamedSharding(mesh, P("x")) != NamedSharding(mesh, P(None, "x"))
    one = Mesh([[DEVS[2]]], ("a", "b"))
    assert SingleDeviceSharding(DEVS[2]) == NamedSharding(one, P("a", ("b",)))
    assert hash(SingleDeviceSharding(DEVS[2])) == hash(NamedSharding(one, P()))
    assert SingleDeviceSharding(DEVS[2]) != SingleDeviceSharding(DEVS[3])
    assert len({NamedSharding(mesh, P("x", None)), NamedSharding(mesh, P("x"))}) == 1
    assert pickle.loads(pickle.dumps(NamedSharding(mesh, P("x")))) == NamedSharding(mesh, P("x"))


# --------------------------------------------------------------------------- host blocks


MESH_2x4 = Mesh(np.array(DEVS).reshape(2, 4), ("hosts", "devices"))


def test_host_blocks_rows_per_host() -> None:
    blocks = host_blocks(NamedSharding(MESH_2x4, P("hosts")), (8, 6))
    assert list(blocks) == [0, 1]
    for h, block in blocks.items():
        assert block.host == h
        assert block.index == (slice(4 * h, 4 * h + 4), slice(0, 6))
        assert block.shape == (4, 6)
        assert block.local_devices.shape == (1, 4)
        assert [d.id for d in block.local_devices.flat] == [4 * h + i for i in range(4)]
        local_mesh = Mesh(block.local_devices, ("hosts", "devices"))
        assert block.local_sharding == NamedSharding(local_mesh, P("hosts"))
        assert isinstance(block.local_sharding, NamedSharding)
        assert block.local_sharding.mesh == local_mesh
        assert block.local_sharding.spec == P("hosts")


def test_host_blocks_replicated_across_hosts() -> None:
    sharding = NamedSharding(MESH_2x4, P(None, "devices"))
    blocks = host_blocks(sharding, (3, 8))
    for h, block in blocks.items():
        assert block.index == (slice(0, 3), slice(0, 8)) and block.shape == (3, 8)
        assert block.local_sharding.shard_shape(block.shape) == (3, 2)
        assert [d.host for d in block.local_devices.flat] == [h] * 4


def test_host_blocks_both_axes() -> None:
    blocks = host_blocks(NamedSharding(MESH_2x4, P("hosts", "devices")), (2, 8))
    assert blocks[0].index == (slice(0, 1), slice(0, 8))
    assert blocks[1].index == (slice(1, 2), slice(0, 8))
    assert blocks[1].local_sharding.shard_shape((1, 8)) == (1, 2)


def test_host_blocks_non_rectangular_is_an_error() -> None:
    sharding = NamedSharding(MESH_2x4, P(("devices", "hosts")))
    with pytest.raises(ValueError, match="do not form one rectangular block"):
        host_blocks(sharding, (8,))
    # Host-major order is fine.
    blocks = host_blocks(NamedSharding(MESH_2x4, P(("hosts", "devices"))), (8,))
    assert blocks[1].index == (slice(4, 8),)


def test_host_blocks_not_a_sub_box_is_an_error() -> None:
    ids = [[0, 1, 2, 4], [3, 5, 6, 7]]
    mesh = Mesh(np.vectorize(lambda i: DEVS[i], otypes=[object])(np.array(ids)), ("a", "b"))
    with pytest.raises(ValueError, match="sub-box"):
        host_blocks(NamedSharding(mesh, P()), (4,))


def test_host_blocks_interleaved_hosts() -> None:
    # Hosts alternate along a 1-D mesh: fine when replicated, an error when partitioned.
    mesh = Mesh([DEVS[i] for i in (0, 4, 1, 5, 2, 6, 3, 7)], "x")
    blocks = host_blocks(NamedSharding(mesh, P()), (5,))
    assert [d.id for d in blocks[1].local_devices.flat] == [4, 5, 6, 7]
    assert blocks[1].index == (slice(0, 5),)
    with pytest.raises(ValueError, match="rectangular"):
        host_blocks(NamedSharding(mesh, P("x")), (8,))


def test_host_blocks_validates_shape() -> None:
    with pytest.raises(ValueError, match="evenly divide"):
        host_blocks(NamedSharding(MESH_2x4, P("hosts")), (3,))
    with pytest.raises(ValueError, match="rank at least 2"):
        host_blocks(NamedSharding(MESH_2x4, P("hosts", "devices")), (4,))


def test_host_blocks_single_device() -> None:
    sharding = SingleDeviceSharding(DEVS[5])
    blocks = host_blocks(sharding, (2, 3))
    assert list(blocks) == [1]
    block = blocks[1]
    assert block.index == (slice(0, 2), slice(0, 3)) and block.shape == (2, 3)
    assert block.local_devices.shape == (1,) and block.local_devices[0] == DEVS[5]
    assert block.local_sharding == sharding
    assert block == host_blocks(sharding, (2, 3))[1]
    assert hash(block) == hash(host_blocks(sharding, (2, 3))[1])
    assert "local_device_ids=[5]" in repr(block)


@st.composite
def host_layouts(draw: st.DrawFn) -> tuple[NamedSharding, tuple[int, ...]]:
    per_host = draw(st.sampled_from([1, 2, 4, 8]))
    devs = cpu_devices(8, per_host)
    ids, names = draw(meshes())
    mesh = Mesh(np.vectorize(lambda i: devs[i], otypes=[object])(ids), names)
    spec = draw(specs(names))
    sharding = NamedSharding(mesh, spec)
    factors = sharding.shard_shape((8,) * len(spec))
    rank = draw(st.integers(len(spec), 3))
    shape = [
        (8 // factors[d] if d < len(spec) else 1) * draw(st.integers(1, 2)) for d in range(rank)
    ]
    return sharding, tuple(shape)


@SETTINGS
@given(host_layouts())
def test_host_blocks_agree_with_devices_indices_map(
    layout: tuple[NamedSharding, tuple[int, ...]],
) -> None:
    sharding, shape = layout
    try:
        blocks = host_blocks(sharding, shape)
    except ValueError as exc:
        assert re.search("sub-box|rectangular", str(exc))
        return
    global_map = sharding.devices_indices_map(shape)
    assert sorted(blocks) == sorted({d.host for d in sharding.device_list})
    for h, block in blocks.items():
        origin = [s.start for s in block.index]
        assert all(s.step is None and isinstance(s.stop, int) for s in block.index)
        # The host's shards exactly cover its block.
        covered = np.zeros(shape, dtype=bool)
        for dev, idx in global_map.items():
            if dev.host == h:
                covered[idx] = True
        expected = np.zeros(shape, dtype=bool)
        expected[block.index] = True
        assert (covered == expected).all()
        # The local sharding places the same slices, offset by the origin, on the same devices.
        local_map = block.local_sharding.devices_indices_map(block.shape)
        assert set(local_map) == {d for d in sharding.device_list if d.host == h}
        assert block.local_devices.ndim == sharding.mesh.devices.ndim
        for dev, idx in local_map.items():
            local = spans(idx, block.shape)
            shifted = tuple((a + o, b + o) for (a, b), o in zip(local, origin, strict=True))
            assert shifted == spans(global_map[dev], shape)
        # Inverse and roundtrip.
        assert global_shape_from_host(sharding, h, block.shape) == shape
    x = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    parts = {h: x[b.index] for h, b in blocks.items()}
    np.testing.assert_array_equal(assemble(shape, x.dtype, parts, blocks), x)


# --------------------------------------------------------------------------- inverse


def test_global_shape_from_host() -> None:
    sharding = NamedSharding(MESH_2x4, P("hosts", "devices"))
    assert global_shape_from_host(sharding, 0, (3, 8, 5)) == (6, 8, 5)
    assert global_shape_from_host(NamedSharding(MESH_2x4, P(None, "devices")), 1, (3, 4)) == (3, 4)
    assert global_shape_from_host(NamedSharding(MESH_2x4, P(("hosts", "devices"))), 1, (4,)) == (8,)
    with pytest.raises(ValueError, match="evenly divide"):
        global_shape_from_host(sharding, 0, (3, 6))
    with pytest.raises(ValueError, match="rank at least 2"):
        global_shape_from_host(sharding, 0, (3,))
    with pytest.raises(ValueError, match="no device"):
        global_shape_from_host(sharding, 7, (3, 8))


# --------------------------------------------------------------------------- assemble


@pytest.mark.parametrize(
    ("spec", "shape"),
    [
        (P("hosts"), (8, 3)),
        (P(None, "devices"), (2, 8)),
        (P("hosts", "devices"), (4, 8)),
        (P(("hosts", "devices")), (16,)),
        (P(), ()),
        (P(None, "hosts"), (3, 2, 5)),
    ],
)
def test_assemble_roundtrip(spec: PartitionSpec, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    blocks = host_blocks(NamedSharding(MESH_2x4, spec), shape)
    parts = {h: np.array(x[b.index]) for h, b in blocks.items()}
    np.testing.assert_array_equal(assemble(shape, np.float32, parts, blocks), x)
    out = np.empty(shape, np.float32)
    assert assemble(shape, np.float32, parts, blocks, out=out) is out
    np.testing.assert_array_equal(out, x)


def test_assemble_whole_block_is_returned_without_copy() -> None:
    x = np.arange(6.0).reshape(2, 3)
    blocks = host_blocks(SingleDeviceSharding(DEVS[0]), (2, 3))
    assert assemble((2, 3), x.dtype, {0: x}, blocks) is x
    replicated = host_blocks(NamedSharding(MESH_2x4, P()), (2, 3))
    assert assemble((2, 3), x.dtype, {0: x, 1: x + 1}, replicated) is x


def test_assemble_replicated_takes_first_host() -> None:
    sharding = NamedSharding(MESH_2x4, P(None, "hosts"))  # hosts split columns
    blocks = host_blocks(sharding, (2, 4))
    parts = {0: np.zeros((2, 2)), 1: np.ones((2, 2))}
    got = assemble((2, 4), np.float64, parts, blocks)
    np.testing.assert_array_equal(got, [[0, 0, 1, 1], [0, 0, 1, 1]])
    # A host may be left out when another one holds the same region.
    rep = host_blocks(NamedSharding(MESH_2x4, P("devices")), (8,))
    only_one = assemble((8,), np.int64, {1: np.arange(8)}, rep)
    np.testing.assert_array_equal(only_one, np.arange(8))
    out = np.empty((8,), np.int64)
    assemble((8,), np.int64, {0: np.arange(8), 1: -np.arange(8)}, rep, out=out)
    np.testing.assert_array_equal(out, np.arange(8))


def test_assemble_errors() -> None:
    blocks = host_blocks(NamedSharding(MESH_2x4, P("hosts")), (4,))
    with pytest.raises(ValueError, match="No block"):
        assemble((4,), np.int8, {0: np.zeros(2, np.int8)}, blocks)
    with pytest.raises(ValueError, match="shape"):
        assemble((4,), np.int8, {0: np.zeros(3, np.int8), 1: np.zeros(2, np.int8)}, blocks)
    with pytest.raises(ValueError, match="hold no part"):
        assemble((4,), np.int8, {0: np.zeros(2), 1: np.zeros(2), 5: np.zeros(2)}, blocks)
    with pytest.raises(ValueError, match="out has shape"):
        parts = {0: np.zeros(2, np.int8), 1: np.zeros(2, np.int8)}
        assemble((4,), np.int8, parts, blocks, out=np.empty(4, np.int16))


def test_host_block_is_frozen() -> None:
    block = host_blocks(SingleDeviceSharding(DEVS[0]), (1,))[0]
    assert isinstance(block, HostBlock)
    with pytest.raises(AttributeError):
        block.host = 3  # type: ignore[misc]


# --------------------------------------------------------------------------- colocated CPUs


def accel_cluster() -> list[Device]:
    """Two hosts, each with 2 GPUs (ids first) and 2 CPUs."""
    devs: list[Device] = []
    for h in range(2):
        base = 4 * h
        devs += [Device(base + i, h, "gpu", "H100", i) for i in range(2)]
        devs += [Device(base + 2 + i, h, "cpu", "cpu", i) for i in range(2)]
    return devs


def test_colocated_cpu_devices_from_devices() -> None:
    devs = accel_cluster()
    gpus = [d for d in devs if d.platform == "gpu"]
    got = colocated_cpu_devices_from([gpus[3], gpus[0], gpus[2], gpus[1]], devs)
    assert [d.id for d in got] == [6, 2, 7, 3]
    assert all(d.platform == "cpu" for d in got)
    assert colocated_cpu_devices_from([devs[3], devs[2]], devs) == [devs[3], devs[2]]
    assert colocated_cpu_devices_from([], devs) == []


def test_colocated_cpu_devices_from_mesh() -> None:
    devs = accel_cluster()
    gpus = np.array([d for d in devs if d.platform == "gpu"], dtype=object).reshape(2, 2)
    mesh = Mesh(gpus, ("hosts", "local"))
    cpu_mesh = colocated_cpu_devices_from(mesh, devs)
    assert isinstance(cpu_mesh, Mesh)
    assert cpu_mesh.axis_names == ("hosts", "local")
    assert cpu_mesh.device_ids.tolist() == [[2, 3], [6, 7]]


def test_colocated_cpu_devices_from_exhausted() -> None:
    devs = accel_cluster()
    extra = Device(8, 1, "gpu", "H100", 2)
    gpus = [d for d in devs if d.platform == "gpu" and d.host == 1] + [extra]
    with pytest.raises(ValueError, match=r"^Process 1 does not have enough local CPU devices$"):
        colocated_cpu_devices_from(gpus, [*devs, extra])
