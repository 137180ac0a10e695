"""Broadcast trees: a block many hosts hold leaves the controller twice, then goes host to host.

Real worker subprocesses, each with its real data plane (a ZeroMQ ROUTER of its
own, at an ipc:// path like the local cluster's controller); nothing of the
transport is replaced. What is checked from outside: the bytes on every host (a
colocated function hashes its block), what the controller sent (``bytes_put``)
and what hosts relayed (``bytes_relayed``), frees, and a relay that is stopped
and then killed mid-put.
"""

from __future__ import annotations

import collections.abc
import contextlib
import gc
import hashlib
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
from netbed import NetBed, loss_unavailable_reason, unavailable_reason

import colobus as cb

P = cb.PartitionSpec
MiB = 1 << 20
HOSTS = 6


def checker(wanted: set[bytes]) -> Any:
    """A colocated identity that fails on a host whose block hashes to none of ``wanted``."""

    @cb.colocated_python
    def check(x: Any) -> Any:
        import hashlib

        import numpy as np

        got = hashlib.sha256(np.ascontiguousarray(np.asarray(x)).tobytes()).digest()
        if got not in wanted:
            raise ValueError("a host holds bytes the controller did not put")
        return x

    return check


def sha(a: np.ndarray[Any, Any]) -> bytes:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).digest()


def wait_until(cond: collections.abc.Callable[[], bool], what: str, timeout: float = 60.0
               ) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def six_hosts() -> collections.abc.Iterator[cb.Controller]:
    with cb.local_cluster(hosts=HOSTS, devices_per_host=1, broadcast_tree=2,
                          jax_distributed=False) as ctl:
        yield ctl


@pytest.fixture
def six(six_hosts: cb.Controller) -> collections.abc.Iterator[cb.Controller]:
    """The 6-host cluster, made the default controller for this test."""
    from colobus._controller.controller import _pop_current, _push_current

    _push_current(six_hosts)
    try:
        yield six_hosts
    finally:
        _pop_current(six_hosts)


def test_every_host_has_a_data_plane(six: cb.Controller) -> None:
    # local_cluster's controller is at an ipc:// path: the data planes sit beside it
    assert all(h.data.startswith("ipc://") for h in six._hosts.hosts), six._hosts.hosts


def test_replicated_put_leaves_the_controller_twice(six: cb.Controller) -> None:
    sharding = cb.NamedSharding(cb.Mesh(np.array(six.devices()), ("h",)), P())
    # 9 MiB + 12 bytes: two whole 4 MiB chunks and a short one
    data = np.random.default_rng(1).standard_normal((9 * MiB + 12) // 4).astype(np.float32)
    before = six.stats()
    a = cb.device_put(data, sharding)
    out = cb.block_until_ready(checker({sha(data)})(a))  # right away: waits on the hosts
    np.testing.assert_array_equal(cb.device_get(out), data)
    after = six.refresh_stats().result(timeout=60)
    assert after["bytes_put"] - before["bytes_put"] == 2 * data.nbytes
    # 4 of the 6 hosts took it from another host
    assert after["bytes_relayed"] - before["bytes_relayed"] == (HOSTS - 2) * data.nbytes
    for h in after["hosts"].values():
        assert "data_bad_chunk" not in h["dropped"], h
    del a, out
    gc.collect()
    wait_until(lambda: all(h["arrays"] == 0 for h in
                           six.refresh_stats().result(timeout=60)["hosts"].values()),
               "the hosts to free the array")


@pytest.mark.parametrize("kind", ["float64", "bfloat16", "strings"])
def test_dtypes_down_the_tree(six: cb.Controller, kind: str) -> None:
    """float64 (x64 off: not held by JAX as is, made whole on arrival), bfloat16 (kept as
    its chunks until read) and strings (their own wire layout): each exact on every host."""
    import ml_dtypes

    sharding = cb.NamedSharding(cb.Mesh(np.array(six.devices()), ("h",)), P())
    n = 5 * MiB // 8
    if kind == "strings":
        data: Any = np.array([f"s{i}" * (i % 7) for i in range(n // 4)],
                             dtype=np.dtypes.StringDType())
    elif kind == "bfloat16":
        data = np.arange(n * 2, dtype=np.float32).astype(ml_dtypes.bfloat16)
    else:
        data = np.arange(n, dtype=np.float64) / 3
    before = six.stats()["bytes_put"]
    a = cb.device_put(data, sharding)
    got = cb.device_get(a)
    assert got.dtype == data.dtype
    np.testing.assert_array_equal(got, data)
    from colobus._wire.codec import to_buffer

    wire = to_buffer(data)[1].nbytes  # strings travel as lengths and UTF-8
    assert six.stats()["bytes_put"] - before == 2 * wire  # the two roots' copies


def test_partly_replicated_blocks_each_take_a_tree(six: cb.Controller) -> None:
    mesh = cb.Mesh(np.array(six.devices()).reshape(2, 3), ("a", "b"))
    data = np.arange(2 * MiB, dtype=np.int32).reshape(2, MiB)  # 4 MiB rows
    before = six.stats()["bytes_put"]
    a = cb.device_put(data, cb.NamedSharding(mesh, P("a")))
    cb.block_until_ready(checker({sha(data[0:1]), sha(data[1:2])})(a))
    np.testing.assert_array_equal(cb.device_get(a), data)
    # two blocks, each held by 3 hosts: each sent to its 2 roots
    assert six.stats()["bytes_put"] - before == 2 * data.nbytes


def test_small_blocks_and_trees_off_take_the_star(six: cb.Controller) -> None:
    sharding = cb.NamedSharding(cb.Mesh(np.array(six.devices()), ("h",)), P())
    small = np.arange(1000, dtype=np.float32)
    before = six.stats()["bytes_put"]
    cb.block_until_ready(checker({sha(small)})(cb.device_put(small, sharding)))
    assert six.stats()["bytes_put"] - before == HOSTS * small.nbytes
    big = np.ones(MiB, dtype=np.float32)
    six.broadcast_tree = 0
    try:
        before = six.stats()["bytes_put"]
        cb.block_until_ready(checker({sha(big)})(cb.device_put(big, sharding)))
        assert six.stats()["bytes_put"] - before == HOSTS * big.nbytes
    finally:
        six.broadcast_tree = 2


def test_a_lost_relay_costs_only_its_own_host() -> None:
    """Root 0 is stopped before the put (its children wait on it), then killed: it is
    lost, its children get the block whole from the controller, and every other host
    stores the right bytes; only the lost host's part fails."""
    lc = cb.local_cluster(hosts=5, devices_per_host=1, broadcast_tree=2, jax_distributed=False,
                          heartbeat_interval=0.2, liveness_timeout=2.0)
    with lc as ctl:
        devices = ctl.devices()
        sharding = cb.NamedSharding(cb.Mesh(np.array(devices), ("h",)), P())
        data = np.random.default_rng(2).integers(0, 1 << 30, 3 * MiB, dtype=np.int32)
        relay = ctl.hosts()[0]
        (proc,) = [p for p in lc.procs if p.pid == relay.pid]
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            a = cb.device_put(data, sharding)
            # the controller handed the roots their copies; hosts 2 and 3 wait on host 0
            wait_until(lambda: ctl.stats()["bytes_put"] >= 2 * data.nbytes, "the roots' copies")
        finally:
            proc.kill()
            with contextlib.suppress(ProcessLookupError):  # (reaped already)
                os.kill(proc.pid, signal.SIGCONT)
        wait_until(lambda: ctl.hosts()[0].state == "lost", "host 0 to be lost")
        with pytest.raises(cb.HostLostError):
            cb.block_until_ready(a)
        # the failed part settles the array; the live hosts' blocks may still be landing
        # (host 4's comes through root 1), so wait for each host to report its block
        def stored() -> bool:
            hosts = ctl.refresh_stats().result(timeout=60)["hosts"]
            return all(hosts[i]["arrays"] == 1 and hosts[i]["bytes"] >= data.nbytes
                       for i in range(1, 5))
        wait_until(stored, "every live host to store its block")
        # the two roots, then hosts 2 and 3 whole once their parent was lost
        assert ctl.stats()["bytes_put"] == 4 * data.nbytes
        # the live hosts hold the right bytes: a new array over them, from their blocks
        live = cb.NamedSharding(cb.Mesh(np.array(devices[1:]), ("h",)), P())
        again = cb.device_put(data, live)
        cb.block_until_ready(checker({sha(data)})(again))


@pytest.fixture
def bed() -> collections.abc.Iterator[NetBed]:
    reason = unavailable_reason() or loss_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    b = NetBed(hosts=5)
    try:
        b.create()
        yield b
    finally:
        b.close()


async def test_a_relay_cut_off_from_its_children_only(bed: NetBed,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Hosts with their own addresses (network namespaces), each data plane on its own
    address. Root 0 reaches the controller but not its children (iptables): they get
    the block whole from the controller once overdue, and every host stores it."""
    from colobus._api import treeput

    # overdue sooner than 5 s; long enough that host 4 (served by root 1) is not, under load
    monkeypatch.setattr(treeput, "PATIENCE_S", 2.5)
    async with cb.Controller(bed.bind(), hosts=0, key=bed.key, broadcast_tree=2,
                             heartbeat_interval=0.2, liveness_timeout=3.0) as ctl:
        for i in range(5):
            bed.start_worker(i, ctl.address, name=f"nb-{i}", devices=1)
        await ctl.wait_for_hosts(5, timeout=120)
        hosts = ctl.hosts()
        by_name = {h.name: h.index for h in hosts}
        for h in ctl._hosts.hosts:  # each announced its own address
            assert h.data.startswith(f"tcp://{bed.hosts[int(h.name[3:])].ip}:"), h.data
        bed_of = {v: int(k[3:]) for k, v in by_name.items()}
        # positions follow host indices: root 0 serves 2 and 3, root 1 serves 4
        for child in (2, 3):
            bed.part(bed_of[0], bed_of[child])
        devices = sorted(ctl.devices(), key=lambda d: d.host)
        sharding = cb.NamedSharding(cb.Mesh(np.array(devices), ("h",)), P())
        data = np.random.default_rng(3).integers(0, 1 << 30, 2 * MiB, dtype=np.int32)
        a = cb.device_put(data, sharding)
        await checker({sha(data)})(a)
        stats = await ctl.refresh_stats()
        assert stats["tree_overdue"] == 2
        assert stats["bytes_put"] == 4 * data.nbytes  # two roots, then hosts 2 and 3 whole
        assert stats["bytes_relayed"] == data.nbytes  # host 4, from host 1
