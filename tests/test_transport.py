"""The transport under pressure: names and cluster size, send-path failures, receivers'
limits, bounded decoding, a peer that never acknowledges, unknown peers, slow links.

Each test runs the real stack: a controller on real sockets with real worker
subprocesses, or an authenticated raw peer (pyzmq plus colobus's wire module)
where a hostile worker is needed. Waits poll with a deadline, never a fixed sleep.
"""

from __future__ import annotations

import collections.abc
import os
import pathlib
import signal
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from netbed import eventually

import colobus as cb
from colobus._controller.controller import _pop_current, _push_current
from colobus._wire.keys import write_key

HB = 0.2
LIVE = 2.0
FAST: dict[str, Any] = {"heartbeat_interval": HB, "liveness_timeout": LIVE}


class Workers:
    """Worker subprocesses on this machine, each logging to a file; killed in finally."""

    def __init__(self, tmp: pathlib.Path, key_file: str) -> None:
        self.tmp = tmp
        self.key_file = key_file
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, connect: str, name: str, devices: int = 1) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p or os.getcwd() for p in sys.path))
        env["COLOBUS_PARENT_PID"] = str(os.getpid())
        env.pop("COLOBUS_KEY_FILE", None)
        log = self.tmp / f"worker-{len(self.procs)}.log"
        with open(log, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "colobus", "worker", "--connect", connect, "--devices",
                 str(devices), "--name", name, "--key-file", self.key_file],
                env=env, stdin=subprocess.DEVNULL, stdout=err, stderr=err)
        proc.log = log  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    @staticmethod
    def log(proc: subprocess.Popen[bytes]) -> str:
        return pathlib.Path(proc.log).read_text(errors="replace")  # type: ignore[attr-defined]

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(30)


@pytest.fixture
def workers(tmp_path: pathlib.Path) -> collections.abc.Iterator[Workers]:
    key_file = str(tmp_path / "key")
    write_key(key_file)
    w = Workers(tmp_path, key_file)
    try:
        yield w
    finally:
        w.close()


def _key(w: Workers) -> bytes:
    return bytes.fromhex(pathlib.Path(w.key_file).read_text().strip())


@cb.colocated_python
def plus_one(x: Any) -> Any:
    return x + 1


# -- 1. names and hosts=N ------------------------------------------------------------------


async def test_a_live_hosts_name_is_refused_and_hosts_n_bounds_the_cluster(
        workers: Workers) -> None:
    ctl = cb.Controller("tcp://127.0.0.1:*", hosts=1, key=_key(workers), **FAST)
    await ctl.start()
    _push_current(ctl)
    try:
        first = workers.start(ctl.address, "twin")
        await ctl.wait_for_hosts(1, timeout=120)
        dev = ctl.devices()[0]
        x = cb.device_put(np.arange(4.0), dev)
        np.testing.assert_array_equal(await cb.device_get(x), np.arange(4.0))

        # A second live worker under the same name is refused, and keeps retrying;
        # the first keeps its host, its session and its arrays.
        second = workers.start(ctl.address, "twin")
        await eventually(lambda: ctl.stats()["dropped"].get("name_in_use", 0) >= 2, 60,
                         "two refusals of the second 'twin'")
        assert "is alive under this name" in Workers.log(second)
        assert second.poll() is None
        [info] = ctl.hosts()
        assert (info.state, info.pid) == ("alive", first.pid)
        np.testing.assert_array_equal(await cb.device_get(await plus_one(x)), np.arange(4.0) + 1)

        # A new name beyond hosts=1 is refused with a message saying so; it exits non-zero.
        extra = workers.start(ctl.address, "extra")
        await eventually(lambda: extra.poll() is not None, 60, "the extra worker to exit")
        assert extra.returncode != 0
        assert "hosts=1" in Workers.log(extra) and "new name" in Workers.log(extra)
        assert [h.name for h in ctl.hosts()] == ["twin"]

        # Once the first is gone, the second is welcome under its name (same index).
        first.send_signal(signal.SIGKILL)
        await eventually(lambda: ctl.hosts()[0].pid == second.pid
                         and ctl.hosts()[0].state == "alive", 60, "the second twin to join")
        assert len(ctl.hosts()) == 1
        with pytest.raises(cb.HostLostError):
            await cb.device_get(x)
    finally:
        _pop_current(ctl)
        await ctl.aclose()
