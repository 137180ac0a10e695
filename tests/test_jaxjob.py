"""The hosts as one JAX job (the default view): host code's global view, collectives
across hosts, global outputs, and a lost host (``docs/jax_job.md``); who asks for a job,
and the fallback, in tests/test_globalview.py.

The session's job cluster (``job`` in tests/conftest.py: 2 hosts x 2 CPU devices, no
option given, each worker restartable once); the loss test runs last and leaves the job
formed again.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from hostview_hostside import (
    block_output,
    cross_host_sum,
    devices_seen,
    global_view,
    my_shards,
    on_a_mesh_of_its_own,
    plus_one_global,
    process_numbers,
    psum_shard_map,
    wait_for_file,
    wait_or_collect,
)

import colobus as cb

P = cb.PartitionSpec


def _over_all(ctl: cb.Controller, n: int = 8, dtype: object = np.float32) -> cb.Array:
    mesh = cb.make_mesh((4,), ("x",))
    return cb.device_put(np.arange(n, dtype=dtype), cb.NamedSharding(mesh, P("x")))


def test_the_job_formed(job: cb.Controller) -> None:
    info = job.stats()["jax_job"]
    assert info["state"] == "formed" and info["processes"] == 2, info
    # each colobus device is one JAX device of the job: local_id is its JAX id there
    devices = job.devices()
    assert [d.host for d in devices] == [0, 0, 1, 1]
    assert len({d.local_id for d in devices}) == 4


def test_process_index_and_count(job: cb.Controller) -> None:
    x = _over_all(job, 4)
    got = np.asarray(process_numbers(x))
    np.testing.assert_array_equal(got[:2], [[0, 2, 0, 2, 0, 2, 2]] * 2)
    np.testing.assert_array_equal(got[2:], [[1, 2, 1, 2, 1, 2, 2]] * 2)


def test_arguments_are_global_arrays(job: cb.Controller) -> None:
    x = _over_all(job)
    view = np.asarray(global_view(x))
    # the global length, not the host's block; not fully addressable; every host's devices
    assert view[0].tolist() == [8, 0, 2, 4]
    want = [[d.local_id, d.host] for d in x.sharding.mesh.devices.flat]
    assert view[1:, :2].tolist() == want
    # every call form sends the layout: a specialized function too (and methods:
    # tests/test_clients.py), whatever path the call takes to its hosts
    fixed = global_view.specialize(devices=list(x.sharding.mesh.devices.flat))
    np.testing.assert_array_equal(np.asarray(fixed(x)), view)
    # each host's addressable shards are its own devices' shards, at their global place
    shards = np.asarray(my_shards(x))
    ids = {d.id: d.local_id for d in job.devices()}
    want_rows = [[ids[d.id], idx[0].start, idx[0].stop]
                 for d, idx in x.sharding.devices_indices_map((8,)).items()]
    assert sorted(shards.tolist()) == sorted(want_rows)


def test_a_meshs_axis_types_reach_the_global_view(job: cb.Controller) -> None:
    explicit = jax.sharding.AxisType.Explicit
    mesh = cb.make_mesh((4,), ("x",), axis_types=(explicit,))
    x = cb.device_put(np.arange(8, dtype=np.float32), cb.NamedSharding(mesh, P("x")))

    @cb.colocated_python
    def seen(x: Any) -> Any:  # the global array's mesh, as on any JAX job
        import jax

        return np.asarray([t == jax.sharding.AxisType.Explicit
                           for t in x.sharding.mesh.axis_types], np.int32)

    np.testing.assert_array_equal(np.asarray(seen(x)), [1])
    # a global output over that mesh comes back as the same layout, axis types and all
    y = cb.block_until_ready(plus_one_global(x))
    assert y.sharding == x.sharding and y.sharding.mesh.axis_types == (explicit,)
    np.testing.assert_array_equal(np.asarray(seen(y)), [1])
    np.testing.assert_array_equal(np.asarray(y), np.arange(8) + 1)


def test_devices_arrive_as_the_jobs_devices(job: cb.Controller) -> None:
    x = _over_all(job)
    seen = np.asarray(devices_seen(x, job.devices()))
    assert seen.tolist() == [[d.local_id, d.host] for d in job.devices()]


def test_a_collective_across_hosts(job: cb.Controller) -> None:
    x = _over_all(job)
    total = cb.block_until_ready(cross_host_sum(x))
    assert isinstance(total, cb.Array) and total.shape == ()
    assert float(np.asarray(total)) == float(np.arange(8).sum())
    # a psum in shard_map: every shard holds the sum of all shards
    psummed = np.asarray(psum_shard_map(x))
    shards = np.arange(8, dtype=np.float32).reshape(4, 2)
    np.testing.assert_array_equal(psummed, np.tile(shards.sum(0), 4))


def test_global_arrays_out(job: cb.Controller) -> None:
    x = _over_all(job)
    y = cb.block_until_ready(plus_one_global(x))
    assert isinstance(y, cb.Array) and y.shape == (8,) and y.sharding == x.sharding
    np.testing.assert_array_equal(np.asarray(y), np.arange(8) + 1)
    # passed on unawaited, the output arrives global again
    z = np.asarray(plus_one_global(plus_one_global(x)))
    np.testing.assert_array_equal(z, np.arange(8) + 2)


def test_a_global_output_keeps_its_own_mesh(job: cb.Controller) -> None:
    y = cb.block_until_ready(on_a_mesh_of_its_own(_over_all(job)))
    assert y.shape == (4, 6) and y.sharding.spec == cb.PartitionSpec("a", "b")
    assert y.sharding.mesh.axis_names == ("a", "b") and y.sharding.mesh.devices.shape == (2, 2)
    assert [d.id for d in y.sharding.mesh.devices.flat] == [d.id for d in job.devices()]
    np.testing.assert_array_equal(np.asarray(y), np.arange(24).reshape(4, 6))


def test_block_outputs_still_work(job: cb.Controller) -> None:
    x = _over_all(job)
    y = cb.block_until_ready(block_output(x))
    assert y.shape == (8,) and y.sharding == x.sharding
    np.testing.assert_array_equal(np.asarray(y), np.arange(8) * 10)


def test_one_hosts_array_is_whole_there(job: cb.Controller) -> None:
    # an array on one host's devices is a global array that host addresses whole
    mesh = cb.Mesh(np.array(job.devices()[2:]), ("x",))
    x = cb.device_put(np.arange(4, dtype=np.float32), cb.NamedSharding(mesh, P("x")))
    view = np.asarray(global_view(x))
    assert view[0].tolist() == [4, 1, 2, 4]
    np.testing.assert_array_equal(np.asarray(plus_one_global(x)),
                                  np.arange(4) + 1)


def test_a_lost_host_ends_the_job_and_it_forms_again(job: cb.Controller,
                                                     tmp_path: Path) -> None:
    x = _over_all(job)
    # in flight on both hosts (host 0 in a collective with host 1), and on host 0 alone;
    # their output specs given, so these first calls return their arrays at once (SPEC 5)
    collect = wait_or_collect.specialize(out_specs_fn=lambda x, folder: cb.ShapeDtypeStruct(
        (), x.dtype, sharding=cb.NamedSharding(x.sharding.mesh, P())))
    both = collect(x, str(tmp_path))
    mesh0 = cb.Mesh(np.array(job.devices()[:2]), ("x",))
    waits = wait_for_file.specialize(out_specs_fn=lambda x, path: x)
    only0 = waits(cb.device_put(np.zeros(2, np.float32), cb.NamedSharding(mesh0, P("x"))),
                  str(tmp_path / "never"))
    started = tmp_path / "started"
    deadline = 60.0
    import time

    t0 = time.monotonic()
    while not started.exists():
        assert time.monotonic() - t0 < deadline, "host 1 never started the call"
        time.sleep(0.01)
    before = job.stats()["jax_job"]["generation"]
    survivor = job.hosts()[0].pid
    os.kill(job.hosts()[1].pid, signal.SIGKILL)
    errors = []
    for out in (both, only0):  # both fail, naming host 1: none hangs
        with pytest.raises(cb.HostLostError, match=r"Host 1 \('local-1'\) was lost") as err:
            cb.block_until_ready(out)
        assert err.value.host == 1
        errors.append(err.value)
    assert "JAX job" in str(errors[1])  # (the fan-out failed with host 1 itself)
    # the launcher starts host 1 again; host 0 left the job and joined again: it forms
    job.run_sync(job.wait_for_hosts(timeout=120))
    info = job.stats()["jax_job"]
    assert info["state"] == "formed" and info["generation"] > before, info
    assert all(h.state == "alive" for h in job.hosts())
    assert job.hosts()[0].pid == survivor  # left the job and joined again: JAX ended nobody
    # the old array is gone with the old job; a new one computes across the hosts
    with pytest.raises(cb.HostLostError):
        cb.block_until_ready(cross_host_sum(x))
    y = _over_all(job)
    assert float(np.asarray(cross_host_sum(y))) == 28.0


def test_a_job_that_cannot_form_says_why(monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    """The coordination service's Unix socket cannot be made (a temporary directory too
    long for a socket's path): entering the cluster raises, saying what to change.
    (jaxlib's service ended the controller's process once, on a port already taken.)"""
    import tempfile

    cluster = cb.local_cluster(hosts=1, jax_distributed=True, relays=0)  # (its socket made)
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))  # (this process's: the controller's)
    with pytest.raises(RuntimeError, match=r"coordination service.*over 107 bytes: set TMPDIR"):
        with cluster:
            pass
