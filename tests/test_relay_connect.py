"""Relays that run anywhere: ``colobus relay --connect``, and launchers' ``relays_on_hosts``.

A relay started by hand connects to the controller, proves the relay key (which
workers do not hold) and carries hosts as the controller's own relays do; killed, it
costs exactly its hosts, which come back directly. A relay without the right key, or
offering itself to a controller that takes none, is refused and exits. A fan-out
through relays on the hosts' machines gives results byte-equal to the star's.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from lifecycle import eventually, workers

import colobus as cb
from colobus._wire.keys import write_key

HB, LIVENESS = 0.2, 3.0


@cb.colocated_python
def where(x: Any) -> Any:
    return x * 0 + cb.host_index()


@cb.colocated_python
def mixed(x: Any) -> Any:
    """Outputs of several kinds, each host's its own: what a fan-out gives back."""
    h = cb.host_index()
    return {"scaled": x * (h + 1.5), "ints": (x * 0).astype(np.int32) + h,
            "same": np.arange(3, dtype=np.float64), "none": None}


def _relay(connect: str, key_file: str, relay_key_file: str, name: str,
           *extra: str, stderr: int | None = None) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p or os.getcwd() for p in sys.path))
    env.setdefault("COLOBUS_LOG_LEVEL", "WARNING")
    return subprocess.Popen(
        [sys.executable, "-m", "colobus", "relay", "--connect", connect, "--key-file", key_file,
         "--relay-key-file", relay_key_file, "--name", name, "--bind", "tcp://127.0.0.1:*",
         *extra], env=env, stdin=subprocess.DEVNULL, stderr=stderr)


@pytest.fixture
def keys(tmp_path: Any) -> Iterator[tuple[str, bytes, str, bytes]]:
    key_file, relay_file = str(tmp_path / "cluster.key"), str(tmp_path / "relay.key")
    write_key(key_file)
    write_key(relay_file)
    yield key_file, cb.load_key(key_file), relay_file, cb.load_key(relay_file)


async def test_a_relay_started_by_hand_carries_hosts_and_its_loss_costs_only_them(
        keys: tuple[str, bytes, str, bytes]) -> None:
    key_file, key, relay_file, relay_key = keys
    async with cb.Controller("tcp://127.0.0.1:*", hosts=0, key=key, relay_key=relay_key,
                             heartbeat_interval=HB, liveness_timeout=LIVENESS) as ctl:
        relay = _relay(ctl.address, key_file, relay_file, "by-hand")
        try:
            assert ctl._relays is not None
            await ctl._relays.wait_ready(1, 120)
            with workers(key_file) as w:
                for i in range(2):
                    w.start(ctl.address, f"h{i}")
                await ctl.wait_for_hosts(2, timeout=120)
                [r] = ctl.stats()["relays"]
                assert r["connected"] and r["name"].startswith("by-hand on ")
                await eventually(lambda: ctl.stats()["relays"][0]["hosts"] == [0, 1], 10,
                                 "both hosts carried by the relay")
                devs = ctl.devices()
                x = cb.device_put(np.zeros(2, np.float32), cb.NamedSharding(
                    cb.Mesh(np.array(devs), ("d",)), cb.PartitionSpec("d")))
                for _ in range(5):
                    assert np.asarray(await cb.device_get(await where(x))).tolist() == [0, 1]
                assert ctl.stats()["relays"][0]["forwards"] >= 5
                relay.kill()  # the relay's machine is gone
                relay.wait(10)
                with pytest.raises(cb.HostLostError):
                    await asyncio.wait_for(where(x), 60)
                await eventually(lambda: not ctl.stats()["relays"][0]["alive"], 30,
                                 "the silent relay declared lost")
                # its hosts' workers hear nothing, join again, and are served directly
                await eventually(lambda: all(h.alive and h.peer.via is None
                                             for h in ctl._hosts.hosts), 60,
                                 "the hosts back, directly")
                y = cb.device_put(np.zeros(2, np.float32), cb.NamedSharding(
                    cb.Mesh(np.array(ctl.devices()), ("d",)), cb.PartitionSpec("d")))
                assert np.asarray(await cb.device_get(await where(y))).tolist() == [0, 1]
        finally:
            if relay.poll() is None:
                relay.kill()
            relay.wait(10)


async def test_a_relay_is_refused_without_the_relay_key(
        keys: tuple[str, bytes, str, bytes], tmp_path: Any) -> None:
    """The cluster key alone (what every worker holds) is not enough to carry hosts;
    nor is a controller that takes no relays offered anything."""
    key_file, key, relay_file, relay_key = keys
    for controller_takes in (True, False):
        async with cb.Controller("tcp://127.0.0.1:*", hosts=0, key=key,
                                 relay_key=relay_key if controller_takes else None,
                                 heartbeat_interval=HB) as ctl:
            # a worker's key given as the relay key: refused (counted), the relay exits 2
            relay = _relay(ctl.address, key_file, key_file, "impostor", "--once",
                           stderr=subprocess.PIPE)
            _, err = await asyncio.to_thread(relay.communicate, None, 120)
            assert relay.returncode == 2, err
            said = err.decode()
            if controller_takes:
                assert "the relay key is not this controller's" in said, said
                assert ctl.stats()["dropped"].get("unauthenticated", 0) >= 1
            else:
                assert "takes no relays" in said, said
            assert ctl.stats()["relays"] == []


@pytest.fixture(scope="module")
def relayed_cluster() -> Iterator[cb.Controller]:
    """Two hosts of four devices, each carried by a relay beside it; the block view, as the
    star it is compared with (the shared cluster)."""
    with cb.local_cluster(hosts=2, devices_per_host=4, relays_on_hosts=1,
                          jax_distributed=False) as ctl:
        yield ctl


def test_relays_on_hosts_give_what_the_star_gives(ctl: cb.Controller,
                                                  relayed_cluster: cb.Controller) -> None:
    relays = relayed_cluster.stats()["relays"]
    assert len(relays) == 2 and all(r["connected"] for r in relays)
    assert sorted(sum((r["hosts"] for r in relays), [])) == [0, 1]
    from colobus._controller.controller import _pop_current, _push_current

    got = []
    for c in (ctl, relayed_cluster):
        _push_current(c)  # (each its own default: the put and the call go to its hosts)
        try:
            devs = c.devices()
            mesh = cb.Mesh(np.array(devs).reshape(2, 4), ("h", "d"))
            x = cb.device_put(np.arange(16, dtype=np.float32).reshape(8, 2),
                              cb.NamedSharding(mesh, cb.PartitionSpec(("h", "d"))), )
            out = cb.block_until_ready(mixed(x))
            assert x._ctl is c and all(v is None or v._ctl is c for v in out.values())
            got.append({k: (None if v is None else
                            (np.asarray(cb.device_get(v)).tobytes(),
                             str(v.dtype), v.shape, str(v.sharding.spec)))
                        for k, v in out.items()})
        finally:
            _pop_current(c)
    assert got[0] == got[1]
