"""local_cluster owns its worker processes: names give host numbers, output comes
back labelled with its host, and a death is reported at once with its cause."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np
import pytest

import colobus as cb


@cb.colocated_python
def say_where(x: Any) -> Any:
    print(f"host pid {os.getpid()} says hi", flush=True)
    return x


@cb.colocated_python
def nap(x: Any) -> Any:
    time.sleep(60)
    return x


def test_local_cluster_numbers_labels_and_reports_a_killed_host(
        capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    with cb.local_cluster(hosts=3, devices_per_host=1, liveness_timeout=30.0) as ctl:
        hosts = ctl.hosts()
        assert [(h.index, h.name) for h in hosts] == [(0, "local-0"), (1, "local-1"),
                                                      (2, "local-2")]
        mesh = cb.Mesh(np.array(ctl.devices()), ("h",))
        x = cb.device_put(np.arange(3.0), cb.NamedSharding(mesh, cb.PartitionSpec("h")))
        cb.device_get(say_where(x))
        out = ""
        deadline = time.monotonic() + 10  # the relay threads copy the lines soon after
        while out.count("says hi") < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
            out += capfd.readouterr().out
        for h in hosts:
            assert f"[stdout:{h.index}] host pid {h.pid} says hi" in out, out

        pending = nap(x)
        time.sleep(0.5)
        t0 = time.monotonic()
        os.kill(hosts[1].pid, signal.SIGKILL)
        with pytest.raises(cb.HostLostError, match=r"killed by SIGKILL \(out of memory\?\)"):
            pending.result(timeout=20)
        # The process's end, not the 30 s liveness timeout, declared it lost.
        assert time.monotonic() - t0 < 10
        assert [h.state for h in ctl.hosts()] == ["alive", "lost", "alive"]
    said = [r.getMessage() for r in caplog.records if r.name == "colobus.cluster"]
    assert any("local host 1 ('local-1'" in m and "was killed by SIGKILL" in m
               for m in said), said

