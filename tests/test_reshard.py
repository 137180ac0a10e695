"""Resharding, make_mesh, memory kinds and host identity, on real local clusters.

``cb.device_put(arr, sharding)`` of a ``cb.Array`` moves only the blocks each
host lacks (``docs/moving_arrays.md``, "Resharding"); these tests check the values
against numpy, the bytes the controller moved (``ctl.stats()``), what each host
holds afterwards, and that a host lost mid-way fails exactly that operation.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from lifecycle import SHARED_LIVENESS_S, all_joined

import colobus as cb

P = cb.PartitionSpec


# -- make_mesh ------------------------------------------------------------------------------


def test_make_mesh_takes_devices_in_order(ctl: cb.Controller) -> None:
    mesh = cb.make_mesh((2, 4), ("hosts", "devices"))
    assert mesh.axis_names == ("hosts", "devices")
    assert mesh.device_ids.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    small = cb.make_mesh((3,), ("x",), devices=cb.devices()[::-1])
    assert small.device_ids.tolist() == [7, 6, 5]
    assert cb.make_mesh([2, 2], ["a", "b"], devices=cb.devices()[4:]).device_ids.tolist() == [
        [4, 5], [6, 7]]


@pytest.mark.parametrize("args", [((4, 3), ("x", "y")), ((2, 2), ("x",)),
                                  (("a", 2), ("x", "y")), ((16,), ("x",))])
def test_make_mesh_errors_are_jax_s(ctl: cb.Controller, args: tuple[Any, Any]) -> None:
    """The same ValueError texts as the installed jax.make_mesh (8 CPU devices here too)."""
    assert len(jax.devices()) == len(cb.devices()) == 8
    with pytest.raises(ValueError) as theirs:
        jax.make_mesh(*args)
    with pytest.raises(ValueError) as ours:
        cb.make_mesh(*args)
    assert str(ours.value) == str(theirs.value)


# -- memory kinds ---------------------------------------------------------------------------


def test_memory_kind_is_part_of_equality() -> None:
    from colobus._model.devices import Device

    devs = np.empty(2, dtype=object)
    devs[:] = [Device(0, 0, "cpu", "cpu", 0), Device(1, 0, "cpu", "cpu", 1)]
    mesh = cb.Mesh(devs, "x")
    plain = cb.NamedSharding(mesh, P("x"))
    host = cb.NamedSharding(mesh, P("x"), memory_kind="unpinned_host")
    assert plain.memory_kind is None and host.memory_kind == "unpinned_host"
    assert plain != host and hash(plain) != hash(host)
    # None is the default memory, "device", as JAX reads it
    assert plain == cb.NamedSharding(mesh, P("x"), memory_kind="device")
    assert hash(plain) == hash(cb.NamedSharding(mesh, P("x"), memory_kind="device"))
    one = cb.SingleDeviceSharding(devs[0], memory_kind="pinned_host")
    assert one.memory_kind == "pinned_host" and one != cb.SingleDeviceSharding(devs[0])
    assert "unpinned_host" in repr(host)
    import pickle

    assert pickle.loads(pickle.dumps(host)).memory_kind == "unpinned_host"
    with pytest.raises(TypeError):
        cb.NamedSharding(mesh, P(), memory_kind=3)  # type: ignore[arg-type]


@cb.colocated_python
def _memory_kinds(x: Any, sharding: Any) -> Any:
    import jax.numpy as jnp

    kinds = {x.sharding.memory_kind, sharding.memory_kind}
    assert kinds == {"unpinned_host"}, kinds
    return jax.device_put(jnp.asarray(x), x.sharding)


def test_memory_kind_reaches_host_code(ctl: cb.Controller) -> None:
    mesh = cb.make_mesh((2, 4), ("hosts", "devices"))
    sharding = cb.NamedSharding(mesh, P("hosts"), memory_kind="unpinned_host")
    x = np.arange(16.0, dtype=np.float32).reshape(8, 2)
    arr = cb.device_put(x, sharding)
    out = cb.block_until_ready(_memory_kinds(arr, sharding))
    assert out.sharding.memory_kind == "unpinned_host" and out.sharding == sharding
    np.testing.assert_array_equal(np.asarray(out), x)


# -- host identity --------------------------------------------------------------------------


def test_host_index_on_the_controller_raises() -> None:
    with pytest.raises(RuntimeError, match="host code"):
        cb.host_index()
    with pytest.raises(RuntimeError, match="host code"):
        cb.host_count()


@cb.colocated_python
def _write_host_file(x: Any, folder: str) -> Any:
    name = f"host-{cb.host_index()}-of-{cb.host_count()}-pid{jax.process_index()}.txt"
    Path(folder, name).write_text(str(np.asarray(x).sum()))
    return x


def test_one_file_per_host_named_by_host_index(ctl: cb.Controller, tmp_path: Path) -> None:
    mesh = cb.make_mesh((2, 4), ("hosts", "devices"))
    x = cb.device_put(np.arange(8.0, dtype=np.float32), cb.NamedSharding(mesh, P("hosts")))
    cb.block_until_ready(_write_host_file(x, str(tmp_path)))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "host-0-of-2-pid0.txt", "host-1-of-2-pid1.txt"]  # jax.process_index(): the host's
    assert (tmp_path / "host-1-of-2-pid1.txt").read_text() == str(4.0 + 5 + 6 + 7)


# -- resharding -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def four_cluster() -> Iterator[cb.Controller]:
    """4 hosts x 2 CPU devices (ids 2h, 2h+1 on host h), in the block view: the tests read
    each host's block in host code."""
    with cb.local_cluster(hosts=4, devices_per_host=2, liveness_timeout=SHARED_LIVENESS_S,
                          jax_distributed=False) as c:
        yield c


@pytest.fixture
def four(four_cluster: cb.Controller) -> Iterator[cb.Controller]:
    from colobus._controller.controller import _pop_current, _push_current

    all_joined(four_cluster)
    _push_current(four_cluster)
    try:
        yield four_cluster
    finally:
        _pop_current(four_cluster)


def _mesh(ids: list[int], shape: tuple[int, ...], names: tuple[str, ...]) -> cb.Mesh:
    by_id = {d.id: d for d in cb.devices()}
    devs = np.empty(len(ids), dtype=object)
    devs[:] = [by_id[i] for i in ids]
    return cb.Mesh(devs.reshape(shape), names)


def _moved(ctl: cb.Controller, before: dict[str, Any]) -> int:
    return int(ctl.stats()["bytes_resharded"] - before["bytes_resharded"])


def _host_arrays(ctl: cb.Controller) -> dict[int, int]:
    stats = ctl.refresh_stats().result(timeout=30)
    return {h: s["arrays"] for h, s in stats["hosts"].items() if s["state"] == "alive"}


def test_sharded_to_replicated_moves_each_host_what_it_lacks(four: cb.Controller) -> None:
    mesh = cb.make_mesh((4, 2), ("hosts", "devices"))
    x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    arr = cb.device_put(x, cb.NamedSharding(mesh, P("hosts")))
    before = four.stats()
    rep = cb.device_put(arr, cb.NamedSharding(mesh, P()))
    assert rep.sharding == cb.NamedSharding(mesh, P()) and rep.shape == x.shape
    np.testing.assert_array_equal(cb.device_get(rep), x)
    # each of 4 hosts lacks 3 quarters; each quarter was fetched once (for 3 hosts)
    assert _moved(four, before) == 4 * 3 * x.nbytes // 4
    assert four.stats()["bytes_fetched"] - before["bytes_fetched"] == x.nbytes + x.nbytes
    assert rep.is_fully_replicated


def test_replicated_to_sharded_on_another_mesh_moves_nothing(four: cb.Controller) -> None:
    x = np.arange(8 * 8, dtype=np.int32).reshape(8, 8)
    rep = cb.device_put(x, cb.NamedSharding(cb.make_mesh((8,), ("x",)), P()))
    other = _mesh([5, 4, 1, 0, 7, 6, 3, 2], (4, 2), ("a", "b"))
    before = four.stats()
    out = cb.device_put(rep, cb.NamedSharding(other, P("a", "b")))
    np.testing.assert_array_equal(cb.device_get(out), x)
    assert _moved(four, before) == 0  # every host had every element


@pytest.mark.parametrize("case", ["2d-transpose", "uneven-permutation", "to-one-device",
                                  "from-one-device", "rows-to-columns"])
def test_reshard_layouts(four: cb.Controller, case: str) -> None:
    m = cb.make_mesh((4, 2), ("hosts", "devices"))
    perm = _mesh([6, 7, 2, 3, 0, 1, 4, 5], (4, 2), ("p", "q"))
    flat_perm = _mesh([3, 2, 7, 6, 1, 0, 5, 4], (8,), ("x",))
    old, new = {
        "2d-transpose": (cb.NamedSharding(m, P("hosts", "devices")),
                         cb.NamedSharding(_mesh(list(range(8)), (2, 4), ("a", "b")),
                                          P("b", "a"))),
        "uneven-permutation": (cb.NamedSharding(m, P("hosts", "devices")),
                               cb.NamedSharding(perm, P("p", "q"))),
        "to-one-device": (cb.NamedSharding(flat_perm, P("x")),
                          cb.SingleDeviceSharding(cb.devices()[5])),
        "from-one-device": (cb.SingleDeviceSharding(cb.devices()[2]),
                            cb.NamedSharding(m, P(None, ("hosts", "devices")))),
        "rows-to-columns": (cb.NamedSharding(m, P("hosts")),
                            cb.NamedSharding(m, P(None, "hosts"))),
    }[case]
    x = (np.arange(16 * 8, dtype=np.float64) * 1.5).reshape(16, 8)
    arr = cb.device_put(x, old)
    out = cb.device_put(arr, new)
    np.testing.assert_array_equal(cb.device_get(out), x)
    assert out.sharding == new and out.sharding.device_list == new.device_list
    # and back again
    np.testing.assert_array_equal(np.asarray(cb.device_put(out, old)), x)


def test_a_mesh_to_its_colocated_cpu_mesh_moves_nothing(four: cb.Controller) -> None:
    mesh = cb.make_mesh((4, 2), ("hosts", "devices"))
    sharding = cb.NamedSharding(mesh, P("hosts", "devices"))
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    arr = cb.device_put(x, sharding)
    cpu = cb.NamedSharding(cb.colocated_cpu_devices(mesh), sharding.spec,
                           memory_kind=sharding.memory_kind)
    assert cb.device_put(arr, cpu) is arr  # the same devices, the same layout
    cb.block_until_ready(arr)  # its PUTs counted
    before = four.stats()
    # the host's devices in another order, and another memory kind: rebuilt where it is
    swapped = _mesh([1, 0, 3, 2, 5, 4, 7, 6], (4, 2), ("hosts", "devices"))
    for target in (cb.NamedSharding(swapped, sharding.spec),
                   cb.NamedSharding(mesh, sharding.spec, memory_kind="unpinned_host")):
        out = cb.device_put(arr, target)
        np.testing.assert_array_equal(np.asarray(out), x)
    assert _moved(four, before) == 0
    # host code sees the memory kind the reshard asked for
    assert cb.block_until_ready(_memory_kinds(out, target)).sharding == target
    assert four.stats()["bytes_put"] == before["bytes_put"]


@cb.colocated_python
def _plus_one(x: Any) -> Any:
    return x + 1


def test_reshard_is_ordered_and_holds_its_source(four: cb.Controller) -> None:
    """Usable at once; deleting the source right after the call does not break it; the
    new array is freed with its handle, and the reshard leaves nothing behind."""
    mesh = cb.make_mesh((4, 2), ("hosts", "devices"))
    x = np.arange(64, dtype=np.float32).reshape(16, 4)
    start = _host_arrays(four)
    src = cb.device_put(x, cb.NamedSharding(mesh, P("hosts")))
    out = cb.device_put(src, cb.NamedSharding(mesh, P(None, "devices")))
    src.delete()
    y = _plus_one(out)  # sent at once; the hosts wait for the reshard
    np.testing.assert_array_equal(np.asarray(y), x + 1)
    np.testing.assert_array_equal(np.asarray(out), x)
    assert cb.block_until_ready(out) is out
    del y
    assert _host_arrays(four) == {h: n + 1 for h, n in start.items()}  # out alone
    out.delete()
    assert _host_arrays(four) == start


def test_a_large_reshard_goes_in_bounded_chunks(four: cb.Controller,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from colobus._api import reshard
    from colobus._model import moves

    monkeypatch.setattr(moves, "CHUNK_BYTES", 64 << 10)
    monkeypatch.setattr(reshard, "WINDOW_MOVES", 3)
    mesh = cb.make_mesh((4, 2), ("hosts", "devices"))
    x = np.random.default_rng(0).standard_normal((1024, 96)).astype(np.float32)
    arr = cb.device_put(x, cb.NamedSharding(mesh, P("hosts", "devices")))
    before = four.stats()
    out = cb.device_put(arr, cb.NamedSharding(mesh, P()))
    np.testing.assert_array_equal(np.asarray(out), x)
    assert _moved(four, before) == 3 * x.nbytes


def test_reshard_of_a_pytree_and_of_key_arrays(ctl: cb.Controller) -> None:
    mesh = cb.make_mesh((2, 4), ("hosts", "devices"))
    keys = jax.random.split(jax.random.key(7), 8)
    tree = {"k": cb.device_put(keys, cb.NamedSharding(mesh, P(("hosts", "devices")))),
            "s": cb.device_put(np.array(["a", "bb", "ccc", "d"], dtype=np.dtypes.StringDType()),
                               cb.NamedSharding(mesh, P("hosts")))}
    out = cb.device_put(tree, cb.NamedSharding(mesh, P()))
    got = cb.device_get(out)
    np.testing.assert_array_equal(jax.random.key_data(got["k"]), jax.random.key_data(keys))
    assert got["s"].tolist() == ["a", "bb", "ccc", "d"]


def test_reshard_checks_at_the_call(ctl: cb.Controller) -> None:
    mesh = cb.make_mesh((2, 4), ("hosts", "devices"))
    arr = cb.device_put(np.arange(8.0), cb.NamedSharding(mesh, P("hosts")))
    with pytest.raises(ValueError, match="partitioned 8 times"):
        cb.device_put(cb.device_put(np.arange(4.0), cb.devices()[0]),
                      cb.NamedSharding(mesh, P(("hosts", "devices"))))
    gone = cb.device_put(np.arange(8.0), cb.NamedSharding(mesh, P("hosts")))
    gone.delete()
    with pytest.raises(RuntimeError, match="deleted"):
        cb.device_put(gone, cb.NamedSharding(mesh, P()))
    np.testing.assert_array_equal(np.asarray(cb.device_put(arr, cb.devices()[7])),
                                  np.arange(8.0))


# -- a host lost in the middle ----------------------------------------------------------------


async def _until(cond: Any, what: str, timeout: float = 60.0) -> None:
    """Wait (re-checking on each heartbeat-ish tick) until ``await cond()`` is true."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def test_a_host_lost_mid_reshard_fails_that_operation_and_leaves_nothing() -> None:
    # (the block view: one host lost costs only what it holds)
    async with cb.local_cluster(hosts=4, devices_per_host=1, heartbeat_interval=0.2,
                                jax_distributed=False) as c:
        mesh = cb.make_mesh((4,), ("x",))
        x = np.arange(4 * 4096, dtype=np.float32).reshape(4, 4096)
        src = cb.device_put(x, cb.NamedSharding(mesh, P("x")))
        keep = cb.device_put(np.arange(3.0), cb.SingleDeviceSharding(cb.devices()[2]))
        await cb.block_until_ready([src, keep])
        base = {h: s["arrays"] for h, s in (await c.refresh_stats())["hosts"].items()}
        pid = c.hosts()[1].pid
        os.kill(pid, signal.SIGSTOP)  # host 1 takes the RESHARD but never answers
        try:
            out = cb.device_put(src, cb.NamedSharding(mesh, P()))

            async def others_started() -> bool:  # their new blocks exist (heartbeats say)
                hosts = c.stats()["hosts"]
                return all(hosts[h]["arrays"] > base[h] for h in (0, 2, 3))

            await _until(others_started, "the other hosts to start the reshard")
        finally:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(cb.HostLostError):
            await cb.block_until_ready(out)
        with pytest.raises(cb.HostLostError):
            cb.device_get(out)

        async def nothing_left() -> bool:
            hosts = (await c.refresh_stats())["hosts"]
            return all(hosts[h]["arrays"] == base[h] for h in (0, 2, 3))

        await _until(nothing_left, "the survivors to drop the reshard's blocks and holds")
        # only that operation failed: the survivors' data and the cluster still work
        np.testing.assert_array_equal(await cb.device_get(keep), np.arange(3.0))
        moved = cb.device_put(keep, cb.SingleDeviceSharding(cb.devices()[0]))
        np.testing.assert_array_equal(await cb.device_get(moved), np.arange(3.0))


@cb.colocated_python
def _host_1_waits_for(x: Any, go: str) -> Any:
    while cb.host_index() == 1 and not Path(go).exists():  # the test's cue
        time.sleep(0.01)
    return x


async def test_replies_owed_by_survivors_are_no_violation_once_closing_began(
        tmp_path: Path) -> None:
    from colobus._wire.protocol import Kind

    # (the block view: the survivors stay)
    async with cb.local_cluster(hosts=3, devices_per_host=1, heartbeat_interval=0.2,
                                jax_distributed=False) as c:
        x = cb.device_put(np.arange(3.0), cb.NamedSharding(cb.make_mesh((3,), ("x",)), P("x")))
        await cb.block_until_ready(x)
        replies: list[tuple[int, int]] = []
        on_result = c._sessions._handlers[Kind.RESULT]

        def seen(host: Any, body: Any, env: Any) -> None:
            replies.append((host.index, body.call_id))
            on_result(host, body, env)

        c._sessions._handlers[Kind.RESULT] = seen
        pid = c.hosts()[0].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            out = _host_1_waits_for(x, str(tmp_path / "go"))
        finally:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(cb.HostLostError):  # host 0 lost: the call fails, host 1 owes
            await out
        (call_id,) = [k for k, mask in c._ops.late.items() if mask & 2]
        c._ops.close("closing")  # what leaving the context does first: every operation ends
        (tmp_path / "go").touch()

        async def answered() -> bool:  # host 2's reply may come after host 1's (a loaded box)
            return (1, call_id) in replies and not c._ops.late

        await _until(answered, "host 1's reply, and every reply owed")
        assert [h.state for h in c.hosts()] == ["lost", "alive", "alive"]
        assert c._sessions.dropped["unsolicited"] == 0 and not c._ops.late


# -- a checkpoint dispatcher ----------------------------------------------------------------


def test_a_checkpoint_dispatcher(ctl: cb.Controller, tmp_path: Path) -> None:
    """Orbax's colocated-python dispatcher pattern: the arrays go to the colocated CPU
    devices, a dummy replicated array picks the devices, ``out_specs_fn`` makes the
    call's outputs known up front, each host writes its own file (named by
    ``cb.host_index()``), and a replicated token says it is done."""
    mesh = cb.make_mesh((2, 4), ("hosts", "devices"))
    x = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    arr = cb.device_put(x, cb.NamedSharding(mesh, P("hosts", "devices")))
    cpu_mesh = cb.colocated_cpu_devices(mesh)
    cpu_arr = cb.device_put(arr, cb.NamedSharding(cpu_mesh, arr.sharding.spec,
                                                  memory_kind=arr.sharding.memory_kind))
    replicated = cb.NamedSharding(cpu_mesh, P())
    dummy = cb.device_put(np.array(True), replicated)
    folder = str(tmp_path)

    def save(token: Any, value: Any) -> Any:
        np.save(Path(folder, f"host-{cb.host_index()}-of-{cb.host_count()}.npy"),
                np.asarray(value))
        return token

    def out_specs(token: Any, value: Any) -> Any:
        assert value.shape == x.shape
        return token

    dispatch = cb.colocated_python(save).specialize(out_specs_fn=out_specs)
    done = dispatch(dummy, cpu_arr)
    token = cb.block_until_ready(done)  # (its arrays at once, as JAX's: waited for here)
    assert isinstance(token, cb.Array) and token.sharding == replicated
    assert np.asarray(token).item() is True
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["host-0-of-2.npy", "host-1-of-2.npy"]
    np.testing.assert_array_equal(np.load(tmp_path / "host-1-of-2.npy"), x[4:])
    np.testing.assert_array_equal(np.load(tmp_path / "host-0-of-2.npy"), x[:4])


def test_large_blocks_stay_in_their_pieces_until_read(four: cb.Controller,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A large new block is kept as the frames it came in (docs/moving_arrays.md): a fetch, a
    call and another reshard of it each read it whole, with the right values."""
    from colobus._model import moves

    monkeypatch.setattr(moves, "CHUNK_BYTES", 256 << 10)
    mesh = cb.make_mesh((4, 2), ("hosts", "devices"))
    x = np.random.default_rng(1).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB
    src = cb.device_put(x, cb.NamedSharding(mesh, P("hosts")))
    rep = cb.device_put(src, cb.NamedSharding(mesh, P()))
    cb.block_until_ready(rep)
    hosts = four.refresh_stats().result()["hosts"]
    assert all(hosts[h]["bytes"] >= x.nbytes for h in range(4))  # counted whole, as pieces
    back = cb.device_put(rep, cb.NamedSharding(mesh, P(None, "hosts")))  # read by a reshard
    np.testing.assert_array_equal(np.asarray(_plus_one(rep)), x + 1)  # read by a call
    np.testing.assert_array_equal(np.asarray(rep), x)  # and by a fetch
    np.testing.assert_array_equal(np.asarray(back), x)
    again = cb.device_put(rep, cb.SingleDeviceSharding(cb.devices()[3]))
    np.testing.assert_array_equal(np.asarray(again), x)


def test_reshards_chain_and_overlap_without_waiting(four: cb.Controller) -> None:
    """A reshard of an array still being resharded, and many at once, each see their
    source complete (the hosts wait for it), with the right values."""
    mesh = cb.make_mesh((4, 2), ("hosts", "devices"))
    other = _mesh([7, 6, 5, 4, 3, 2, 1, 0], (2, 4), ("a", "b"))
    layouts = [cb.NamedSharding(mesh, P("hosts")), cb.NamedSharding(other, P("b", "a")),
               cb.NamedSharding(mesh, P()), cb.SingleDeviceSharding(cb.devices()[6]),
               cb.NamedSharding(other, P(None, ("a", "b")))]
    xs = [np.arange(16 * 8, dtype=np.int32).reshape(16, 8) * (k + 1) for k in range(6)]
    outs = []
    for x in xs:
        y: Any = cb.device_put(x, layouts[0])
        for s in layouts[1:]:
            y = cb.device_put(y, s)  # each from the one before, none awaited
        outs.append(y)
    got = cb.device_get(outs)
    for x, g in zip(xs, got, strict=True):
        np.testing.assert_array_equal(g, x)


@cb.colocated_python
def _checksum(x: Any) -> Any:
    return np.asarray(np.asarray(x, dtype=np.float64).sum())


async def test_boxes_fit_a_small_max_message_bytes() -> None:
    """Every box is one FETCH reply: it stays under what the controller accepts."""
    async with cb.local_cluster(hosts=2, devices_per_host=1, max_message_bytes=4 << 20) as c:
        mesh = cb.make_mesh((2,), ("x",))
        x = np.arange(2 << 20, dtype=np.float32).reshape(2048, 1024)  # 8 MiB, 4 per host
        src = cb.device_put(x, cb.NamedSharding(mesh, P("x")))
        with pytest.raises(ValueError, match="too large to fetch"):
            await cb.device_get(src)  # a whole block does not fit in one reply
        rep = cb.device_put(src, cb.NamedSharding(mesh, P()))
        sums = await _checksum(rep)  # the hosts hold it whole
        assert float(np.asarray(await cb.device_get(sums))) == float(x.astype(np.float64).sum())
        assert c.stats()["bytes_resharded"] == x.nbytes
