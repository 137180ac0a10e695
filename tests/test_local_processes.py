"""local_cluster owns its worker processes: names give host numbers, output comes
back labelled with its host, and a death is reported at once with its cause."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import colobus as cb
from colobus._launch.local import LocalLauncher


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
    # (the block view: hosts 0 and 2 stay when host 1 is killed; in a JAX job all leave)
    with cb.local_cluster(hosts=3, devices_per_host=1, liveness_timeout=30.0,
                          jax_distributed=False) as ctl:
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

        pending = nap.specialize(out_specs_fn=lambda x: x)(x)  # returns at once
        time.sleep(0.5)
        t0 = time.monotonic()
        os.kill(hosts[1].pid, signal.SIGKILL)
        with pytest.raises(cb.HostLostError, match=r"killed by SIGKILL \(out of memory\?\)"):
            cb.block_until_ready(pending)
        # The process's end, not the 30 s liveness timeout, declared it lost.
        assert time.monotonic() - t0 < 10
        assert [h.state for h in ctl.hosts()] == ["alive", "lost", "alive"]
    said = [r.getMessage() for r in caplog.records if r.name == "colobus.cluster"]
    assert any("local host 1 ('local-1'" in m and "was killed by SIGKILL" in m
               for m in said), said



class SlowLauncher(LocalLauncher):
    """Local workers, host ``slow``'s stopped from its start (SIGSTOP): a slow node."""

    def __init__(self, hosts: int, slow: int) -> None:
        super().__init__(hosts, 1)
        self.slow = slow
        self.stopped: list[int] = []

    def start(self, i: int, connect: str, key: bytes) -> subprocess.Popen[bytes]:
        proc = super().start(i, connect, key)
        if i == self.slow:
            os.kill(proc.pid, signal.SIGSTOP)
            self.stopped.append(proc.pid)
        return proc


async def test_a_slow_host_holds_up_no_other_join_and_the_timeout_names_it() -> None:
    # (the block view's ids: handed out by the names' numbers; a job's are JAX's)
    cluster = cb.local_cluster(hosts=2, jax_distributed=False)
    cluster.launcher = launcher = SlowLauncher(2, slow=0)  # host 0: the first name waits
    entry = asyncio.create_task(cluster.__aenter__())
    try:
        while cluster.workers is None and not entry.done():
            await asyncio.sleep(0.01)
        ctl = cluster.controller
        await ctl.wait_for_hosts(1, timeout=120)  # host 1 joins while host 0 is stopped
        assert [(h.index, h.name, h.state, [d.id for d in h.devices]) for h in ctl.hosts()] == [
            (0, "local-0", "joining", []), (1, "local-1", "alive", [1])]
        assert not entry.done()
        text = str(cluster.join_timed_out())
        assert "only 1 of 2 local workers joined" in text, text
        assert text.split("missing: ")[1].startswith("local host 0 ('local-0')"), text
        assert "local-1" not in text, text
    finally:
        for pid in launcher.stopped:
            os.kill(pid, signal.SIGCONT)
    ctl = await asyncio.wait_for(entry, 120)
    try:
        assert [(h.index, h.name, h.state, [d.id for d in h.devices]) for h in ctl.hosts()] == [
            (0, "local-0", "alive", [0]), (1, "local-1", "alive", [1])]
    finally:
        await cluster.__aexit__(None, None, None)


@cb.colocated_python
def which_msgpack(x: Any) -> Any:
    import msgpack

    assert msgpack.packb([1]) == b"\x91\x01"
    return x


def test_a_module_in_the_drivers_directory_runs_in_no_worker_and_no_relay(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "msgpack.py").write_text(
        f"open({str(marker)!r}, 'a').write('planted msgpack imported\\n')\n")
    monkeypatch.chdir(tmp_path)
    # The driver's own path names its directory too (as under `python -c` or `-m`).
    monkeypatch.setattr(sys, "path", ["", str(tmp_path), *sys.path])
    with cb.local_cluster(hosts=1, relays=1) as ctl:
        assert [r["hosts"] for r in ctl.stats()["relays"]] == [[0]]  # the relay carries it
        x = cb.device_put(np.arange(2.0), ctl.devices()[0])
        assert cb.device_get(which_msgpack(x)).tolist() == [0.0, 1.0]
    assert not marker.exists(), marker.read_text()
