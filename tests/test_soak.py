"""A short soak (the long one is benchmarks/soak.py): host stores end empty.

Many calls whose results are dropped, and array put/delete cycles (deleted at
once, deleted after upload, or left to the garbage collector), on a fresh
one-host cluster so that "empty" means empty. Memory and time are printed by the
benchmark, never asserted here.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from typing import Any

import numpy as np

import colobus as cb

CALLS = 600
CYCLES = 300


@cb.colocated_python
def bump(x: Any) -> Any:
    return x + 1


def test_short_soak_stores_end_empty() -> None:
    with cb.local_cluster(hosts=1, devices_per_host=2) as ctl:
        mesh = cb.Mesh(np.array(cb.devices()).reshape(1, 2), ("hosts", "devices"))
        sharding = cb.NamedSharding(mesh, cb.PartitionSpec("hosts", "devices"))
        x = cb.device_put(np.arange(32, dtype=np.float32).reshape(2, 16), sharding)
        window: deque[cb.Array] = deque()
        for _ in range(CALLS):
            window.append(bump(x))  # its array at once
            if len(window) >= 64:
                cb.block_until_ready(window.popleft())
        last = None
        while window:
            last = cb.block_until_ready(window.popleft())
        assert last is not None
        np.testing.assert_array_equal(np.asarray(last), np.arange(32).reshape(2, 16) + 1)
        del last
        data = np.arange(512, dtype=np.float32).reshape(2, 256)
        for i in range(CYCLES):
            a = cb.device_put(data, sharding)
            if i % 3 == 0:
                a.delete()  # before its upload finished
            elif i % 3 == 1:
                cb.block_until_ready(a)
                a.delete()
            else:
                del a  # the garbage collector frees it
        x.delete()
        del x
        gc.collect()
        deadline = time.monotonic() + 30
        while True:  # frees are batched and asynchronous
            hosts = ctl.refresh_stats().result(60)["hosts"]
            if hosts[0]["arrays"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert hosts[0]["arrays"] == 0, hosts
        assert hosts[0]["bytes"] == 0 and hosts[0]["objects"] == 0
        assert ctl.stats()["pending"] == 0
        assert ctl.stats()["queued"] == 0
        assert ctl.stats()["dropped_total"] == 0
