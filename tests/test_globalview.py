"""The global view as the default (SPEC 13): calls of a job that never mix, device ids as
JAX's, orbax's writer at ``shard.index``, the fallback said in one line, and the guards
that tell host code written for the other view (``docs/jax_job.md``).

The default view's cluster is the session's job cluster (``job`` in tests/conftest.py: no
option given, its hosts formed a JAX job); the block view's is the shared ``ctl``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import numpy as np
import pytest
from globalview_hostside import (
    add_by_device,
    block_and_devices,
    build_global,
    build_over_struct,
    centered,
    fetch_whole,
    find_devices,
    save_at_index,
    upper,
)
from lifecycle import SETTLE_S, in_async

import colobus as cb

P = cb.PartitionSpec
_centered = cb.colocated_python(centered)


def _spread(ctl: cb.Controller, k: float = 1.0, n: int = 8) -> cb.Array:
    mesh = cb.make_mesh((len(ctl.devices()),), ("x",))
    return cb.device_put(np.arange(n, dtype=np.float32) * k, cb.NamedSharding(mesh, P("x")))


def test_threads_with_collectives_never_mix(job: cb.Controller) -> None:
    """Four driver threads, each calling a function whose host code runs a collective
    across the hosts: every result exact (before, 4 to 50 of every 30-50 were wrong)."""
    arrays = [_spread(job, k + 1) for k in range(4)]
    wants = [np.asarray(a) - np.asarray(a).sum() for a in arrays]
    np.testing.assert_array_equal(cb.device_get(_centered(arrays[0])), wants[0])
    wrong: list[tuple[int, int]] = []

    def drive(t: int) -> None:
        outs = [(i, _centered(arrays[(t + i) % 4])) for i in range(8)]
        for i, out in outs:
            if not np.array_equal(cb.device_get(out), wants[(t + i) % 4]):
                wrong.append((t, i))

    threads = [threading.Thread(target=drive, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(SETTLE_S)
    assert not any(th.is_alive() for th in threads)
    assert wrong == []


def test_tasks_with_collectives_never_mix(job: cb.Controller) -> None:
    """Ten asyncio tasks on the controller's loop, the same collective: every result exact."""
    arrays = [_spread(job, k + 1) for k in range(5)]
    wants = [np.asarray(a) - np.asarray(a).sum() for a in arrays]

    async def main() -> int:
        async def task(t: int) -> int:
            bad = 0
            for i in range(3):
                got = await cb.device_get(await _centered(arrays[(t + i) % 5]))
                bad += not np.array_equal(got, wants[(t + i) % 5])
            return bad

        return sum(await asyncio.gather(*[task(t) for t in range(10)]))

    assert job.run_sync(asyncio.wait_for(main(), SETTLE_S)) == 0


def test_cancelling_a_spread_call_leaves_the_job_in_step(job: cb.Controller) -> None:
    """A spread call's Future cancelled as it leaves: its hosts run it all the same (a
    host cancelling it and another running it would pair the next call's collectives
    with it), and the next calls are exact."""
    x = _spread(job, 3)
    want = np.asarray(x) - np.asarray(x).sum()
    for _ in range(3):
        first = in_async(lambda: _centered(x), job)  # (its Future: made as async code does)
        first.cancel()
        np.testing.assert_array_equal(cb.device_get(_centered(x)), want)


def test_device_ids_are_jaxs(job: cb.Controller) -> None:
    """An id sent to a host finds its device there: ``Device.id`` is the id host code's
    JAX gives the same device (and ``local_id`` the same)."""
    devices = job.devices()
    assert all(d.id == d.local_id for d in devices)
    ids = [d.id for d in devices]
    found = np.asarray(cb.colocated_python(find_devices)(_spread(job), ids))
    assert found.tolist() == [[d.id, d.host] for d in devices]  # (host 0's: each finds all)


def test_a_writer_at_shard_index_writes_every_row_once(job: cb.Controller,
                                                       tmp_path: Path) -> None:
    """orbax's colocated save: each host writes its shards at ``shard.index`` into one
    file of the global shape. In the default view every row is written exactly once (in
    the block view host 1 wrote over host 0's rows)."""
    rows = 8
    x = cb.device_put(np.arange(rows * 3, dtype=np.float32).reshape(rows, 3),
                      cb.NamedSharding(cb.make_mesh((4,), ("x",)), P("x")))
    np.memmap(tmp_path / "data", dtype=np.float32, mode="w+", shape=(rows, 3)).flush()
    np.memmap(tmp_path / "counts", dtype=np.int32, mode="w+", shape=(rows,)).flush()
    shards = np.asarray(cb.colocated_python(save_at_index)(x, str(tmp_path)))
    assert int(shards) == 2  # (host 0's count: its own two shards)
    counts = np.memmap(tmp_path / "counts", dtype=np.int32, mode="r", shape=(rows,))
    data = np.memmap(tmp_path / "data", dtype=np.float32, mode="r", shape=(rows, 3))
    assert counts.tolist() == [1] * rows
    np.testing.assert_array_equal(data, np.arange(rows * 3).reshape(rows, 3))


def test_a_global_output_laid_out_like_an_argument_keeps_its_device_order(
        job: cb.Controller) -> None:
    """A global output over an argument's mesh whose device order is not the call's: it
    comes back over that mesh, each element in its place (it came back over the call's
    mesh, its blocks swapped between the hosts)."""
    devs = job.devices()
    s1 = cb.NamedSharding(cb.Mesh(devs, ("x",)), P("x"))
    s2 = cb.NamedSharding(cb.Mesh(devs[2:] + devs[:2], ("x",)), P("x"))
    x = cb.device_put(np.zeros(8, np.int32), s1)
    y = cb.device_put(np.arange(8, dtype=np.int32), s2)
    out = cb.colocated_python(add_by_device).specialize(devices=devs)(x, y)
    assert out.sharding == s2
    np.testing.assert_array_equal(np.asarray(out), np.arange(8))


def test_strings_arrive_as_the_hosts_block_in_a_job(job: cb.Controller) -> None:
    """JAX makes no global array of strings: a string argument arrives as the host's
    block, as in the block view (it failed with JAX's "Unknown NumPy dtype")."""
    words = np.array([f"w{i}x" for i in range(4)], dtype=np.dtypes.StringDType())
    rows = cb.NamedSharding(cb.Mesh(job.devices(), ("x",)), P("x"))
    got = np.asarray(cb.colocated_python(upper)(cb.device_put(words, rows)))
    assert got.tolist() == [f"W{i}X" for i in range(4)]


def test_block_view_code_in_a_job_is_told_the_view(job: cb.Controller) -> None:
    """Host code of the block view (``np.asarray`` of an argument) fails in a job inside
    JAX: the error carries one note naming the global view and ``jax_distributed=False``."""
    with pytest.raises(Exception) as err:
        cb.device_get(cb.colocated_python(fetch_whole)(_spread(job)))
    notes = getattr(err.value, "__notes__", [])
    assert any("global view" in n and "jax_distributed=False" in n for n in notes), notes


def test_global_view_code_in_the_block_view_is_told_the_view(ctl: cb.Controller) -> None:
    """The mirror: host code that builds the global array from its shards fails in the
    block view inside JAX, with a note naming the block view and ``jax_distributed``."""
    x = _spread(ctl, n=16)
    with pytest.raises(Exception) as err:
        cb.device_get(cb.colocated_python(build_global)(x, 16))
    notes = getattr(err.value, "__notes__", [])
    assert any("block view" in n and "jax_distributed=True" in n for n in notes), notes


def test_the_block_view_warns_of_a_global_shape_over_a_block(ctl: cb.Controller) -> None:
    """A loader given a ``cb.ShapeDtypeStruct`` (its block's shape on each host in the
    block view) that builds the struct's global shape over its sharding is warned once,
    naming ``jax_distributed``; building the block says nothing."""
    x = _spread(ctl, n=16)
    struct = cb.ShapeDtypeStruct((16,), np.float32, sharding=x.sharding)
    said = np.asarray(cb.colocated_python(build_over_struct)(x, struct, (16,)))
    assert said.tolist() == [1, 1, 1], said


def test_who_asks_for_a_job(monkeypatch: pytest.MonkeyPatch,
                            caplog: pytest.LogCaptureFixture) -> None:
    """The default: a job where the size is known and above one; ``False`` or ``=0``: the
    block view; ``True`` or ``=1`` insists; a size unknown and nobody choosing is said in
    one line. (Controllers made, never started.)"""
    monkeypatch.delenv("COLOBUS_JAX_DISTRIBUTED", raising=False)
    assert cb.Controller(hosts=2)._job is not None
    assert cb.Controller(hosts=1)._job is None  # one host: no job needed
    assert cb.Controller(hosts=2, jax_distributed=False)._job is None
    assert cb.Controller(hosts=1, jax_distributed=True)._job is not None
    monkeypatch.setenv("COLOBUS_JAX_DISTRIBUTED", "0")
    assert cb.Controller(hosts=2)._job is None
    assert cb.Controller(hosts=2, jax_distributed=True)._job is not None
    monkeypatch.setenv("COLOBUS_JAX_DISTRIBUTED", "1")
    with pytest.raises(ValueError, match="hosts=N"):
        cb.Controller(hosts=0)
    monkeypatch.delenv("COLOBUS_JAX_DISTRIBUTED")
    with caplog.at_level(logging.WARNING, logger="colobus.controller"):
        cb.Controller(hosts=0)
        cb.Controller(hosts=0, jax_distributed=False)  # chosen: nothing said
    said = [r.getMessage() for r in caplog.records if r.name == "colobus.controller"]
    assert len(said) == 1 and "block view" in said[0] and "size is unknown" in said[0], said


def test_a_cluster_that_cannot_form_says_so_in_one_line(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        tmp_path: Path) -> None:
    """Forming fails (the coordination service's Unix socket cannot be made: a temporary
    directory too long for a socket's path) and nobody insisted: one WARNING line says the
    cluster runs the block view and why, and it does."""
    import tempfile

    cluster = cb.local_cluster(hosts=2, devices_per_host=1, relays=0)  # (its socket made)
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))  # (this process's: the controller's)
    with caplog.at_level(logging.WARNING, logger="colobus.controller"), cluster as ctl:
        # (not another controller's periodic count of dropped garbage: this process may
        # hold one from an earlier test, and it says so every minute under this logger)
        said = [r.getMessage() for r in caplog.records
                if r.name == "colobus.controller" and r.levelno >= logging.WARNING
                and not r.getMessage().startswith("dropped ")]
        assert len(said) == 1, said
        assert "run the block view" in said[0] and "the Unix socket path" in said[0], said
        assert "jax_distributed=False" in said[0] and "\n" not in said[0]
        assert ctl.stats()["jax_job"]["state"] == "off"
        # the block view: each host sees its block, its own devices only
        x = _spread(ctl, n=4)
        seen = cb.colocated_python(block_and_devices)(x)
        assert np.asarray(seen).tolist() == [2, 1]
        assert [d.id for d in ctl.devices()] == [0, 1]

