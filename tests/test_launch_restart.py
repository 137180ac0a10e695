"""``restart=N``: a worker process that dies is started again and rejoins under its name."""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

import numpy as np
import pytest

import colobus as cb


@cb.colocated_python
def nap(x: Any) -> Any:
    time.sleep(60)
    return x


@cb.colocated_python
def where(x: Any) -> Any:
    return x * 0 + os.getpid()


def _wait(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def test_restart_brings_a_killed_worker_back_under_its_name(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "colobus")
    with cb.local_cluster(hosts=2, devices_per_host=2, restart=1,
                          liveness_timeout=30.0) as ctl:
        before = ctl.hosts()
        ids1 = [d.id for d in before[1].devices]
        d1 = before[1].devices
        held = cb.device_put(np.arange(2.0), cb.NamedSharding(
            cb.Mesh(np.array(d1), ("d",)), cb.PartitionSpec("d")))
        pending = nap(held)
        time.sleep(0.3)  # let the call reach the host (the proof is HostLostError below)
        os.kill(before[1].pid, signal.SIGKILL)
        with pytest.raises(cb.HostLostError, match="killed by SIGKILL"):
            pending.result(timeout=20)
        _wait(lambda: ctl.hosts()[1].state == "alive" and ctl.hosts()[1].pid != before[1].pid,
              60, "host 1 to come back")
        after = ctl.hosts()
        assert [(h.index, h.name) for h in after] == [(0, "local-0"), (1, "local-1")]
        assert [d.id for d in after[1].devices] == ids1
        # What the dead process held is gone; new calls on the new process work.
        with pytest.raises(cb.HostLostError):
            cb.device_get(held).result(timeout=20)
        fresh = cb.device_put(np.zeros(2), cb.NamedSharding(
            cb.Mesh(np.array(after[1].devices), ("d",)), cb.PartitionSpec("d")))
        got = cb.device_get(where(fresh)).result(timeout=30)
        np.testing.assert_array_equal(got, np.full(2, after[1].pid))
        # Restarts are counted: a second death is final.
        os.kill(after[1].pid, signal.SIGKILL)
        _wait(lambda: ctl.hosts()[1].state == "lost", 20, "host 1 lost for good")
        time.sleep(1.0)  # a restart would have begun by now (it starts within ms)
        assert ctl.hosts()[1].state == "lost"
        assert ctl.hosts()[0].state == "alive"
    said = [r.getMessage() for r in caplog.records]
    assert sum("restarting local host 1 ('local-1') (restart 1 of 1)" in m for m in said) == 1, said


def test_restart_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="restart must be >= 0"):
        cb.local_cluster(hosts=1, restart=-1)
