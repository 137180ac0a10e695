"""``restart=N``: a worker process that dies is started again and rejoins under its name."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from nsprocs import wait_until

import colobus as cb


@cb.colocated_python
def nap(x: Any, started: str) -> Any:
    open(started, "w").close()  # the call runs on the host now
    time.sleep(60)
    return x


@cb.colocated_python
def where(x: Any) -> Any:
    return x * 0 + os.getpid()


def test_restart_brings_a_killed_worker_back_under_its_name(
        caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    caplog.set_level(logging.WARNING, "colobus")
    # (the block view: host 0 stays while host 1 restarts; in a JAX job both leave and the
    # job forms again: tests/test_jaxjob.py)
    cluster = cb.local_cluster(hosts=2, devices_per_host=2, restart=1, liveness_timeout=30.0,
                               jax_distributed=False)
    with cluster as ctl:
        before = ctl.hosts()
        ids1 = [d.id for d in before[1].devices]
        d1 = before[1].devices
        held = cb.device_put(np.arange(2.0), cb.NamedSharding(
            cb.Mesh(np.array(d1), ("d",)), cb.PartitionSpec("d")))
        started = tmp_path / "started"
        pending = nap.specialize(out_specs_fn=lambda x, s: x)(held, str(started))  # at once
        wait_until(started.exists, 30, "the call to run on host 1")
        os.kill(before[1].pid, signal.SIGKILL)
        with pytest.raises(cb.HostLostError, match="killed by SIGKILL"):
            cb.block_until_ready(pending)
        wait_until(lambda: ctl.hosts()[1].state == "alive"
                   and ctl.hosts()[1].pid != before[1].pid, 60, "host 1 to come back")
        after = ctl.hosts()
        assert [(h.index, h.name) for h in after] == [(0, "local-0"), (1, "local-1")]
        assert [d.id for d in after[1].devices] == ids1
        # What the dead process held is gone; new calls on the new process work.
        with pytest.raises(cb.HostLostError):
            cb.device_get(held)
        fresh = cb.device_put(np.zeros(2), cb.NamedSharding(
            cb.Mesh(np.array(after[1].devices), ("d",)), cb.PartitionSpec("d")))
        got = cb.device_get(where(fresh))
        np.testing.assert_array_equal(got, np.full(2, after[1].pid))
        # Restarts are counted: a second death is final.
        os.kill(after[1].pid, signal.SIGKILL)
        # The launcher decides at the process's end: host 1 is gone for good, not restarted.
        workers = cluster.workers
        assert workers is not None
        wait_until(lambda: 1 in workers.gone, 20, "the launcher to give host 1 up")
        assert workers.restarts == [0, 1]
        wait_until(lambda: ctl.hosts()[1].state == "lost", 20, "host 1 lost for good")
        assert ctl.hosts()[0].state == "alive"
    said = [r.getMessage() for r in caplog.records]
    assert sum("restarting local host 1 ('local-1') (restart 1 of 1)" in m for m in said) == 1, said


def test_restart_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="restart must be >= 0"):
        cb.local_cluster(hosts=1, restart=-1)


def test_a_host_whose_launcher_saw_it_end_is_told_to_exit_not_to_rejoin(
        caplog: pytest.LogCaptureFixture) -> None:
    # The far side of a dead ssh session lives on until it reads the end of its
    # standard input, and talks meanwhile. The controller, told by the launcher,
    # has declared the host lost; a RESET that said "join again" would bring the
    # dying worker back as alive. It is told to exit instead, and the host stays lost.
    from colobus._controller.cluster import host_process_ended
    caplog.set_level(logging.WARNING, "colobus")
    # (the block view: the host stays lost alone; in a JAX job host 0 would leave too)
    cluster = cb.local_cluster(hosts=2, heartbeat_interval=0.1, liveness_timeout=30.0,
                               jax_distributed=False)
    with cluster as ctl:
        before = ctl.hosts()
        workers = cluster.workers
        assert workers is not None
        proc1 = workers.procs[1]
        # As the ssh launcher reports it (pid None: the worker ran elsewhere), while
        # the worker process is alive and still connected.
        host_process_ended(ctl, before[1].name, None, "its launcher's session ended")
        assert proc1.wait(20) == 0  # it exited by itself, on the controller's word
        wait_until(lambda: 1 in workers.gone, 20, "the launcher to see host 1 end")
        assert [h.state for h in ctl.hosts()] == ["alive", "lost"]
        assert ctl.hosts()[1].pid == before[1].pid  # no second session joined meanwhile
        got = cb.device_get(where(cb.device_put(np.zeros(1), before[0].devices[0])))
        np.testing.assert_array_equal(got, [before[0].pid])
    said = [r.getMessage() for r in caplog.records]
    assert any("host 1 ('local-1') lost: its launcher's session ended" in m for m in said), said
