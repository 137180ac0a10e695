"""Liveness is the processes' and the links', not the Python code's (SPEC 7).

A driver whose own code holds its event loop (here ``time.sleep`` inside ``async with``,
as a long computation, ``input()`` or a debugger would) loses no host, array or object,
and the controller says how long the loop was held; a host function whose native call
holds the GIL keeps its host; a worker that is really gone (SIGSTOP: its process answers
nothing, not even ZeroMQ's heartbeats) is still lost within the liveness timeout.

A short liveness timeout (1 s) lets holds of a few seconds prove it. The same tests run
through a relay in ``tests/test_relayed_held.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
from lifecycle import bounded, eventually

import colobus as cb
from colobus._controller.controller import _pop_current, _push_current

HB, LIVE = 0.2, 1.0
HOLD_S = 4 * LIVE  # four liveness timeouts: long past what used to lose every host
LOST_WITHIN = LIVE + 10 * HB + 5.0  # generous bound for "declared lost within the timeout"


@cb.colocated_python
def holds_the_gil(x: Any) -> Any:
    """A native call that keeps the GIL for HOLD_S (ctypes' PyDLL never releases it)."""
    import ctypes

    ctypes.PyDLL(None).usleep(int(HOLD_S * 1e6))
    return x + 1


@cb.colocated_python
def ident(x: Any) -> Any:
    return x


@cb.colocated_python_class
class Tally:
    def __init__(self) -> None:
        self.n = 0

    def add(self, x: Any) -> Any:
        self.n += 1
        return x * 0 + self.n


async def _value(fut: Any) -> list[Any]:
    return np.asarray(await bounded(cb.device_get(await bounded(fut)))).tolist()


async def test_a_held_loop_or_gil_loses_nothing_and_a_stopped_worker_is_lost(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="colobus.controller")
    # (the block view: a stopped worker is lost alone; in a JAX job, every host with it)
    async with cb.local_cluster(hosts=2, heartbeat_interval=HB, liveness_timeout=LIVE,
                                jax_distributed=False) as ctl:
        d0, d1 = ctl.devices()
        x0 = cb.device_put(np.arange(3.0), d0)
        x1 = cb.device_put(np.arange(3.0), d1)
        tally = Tally()
        assert await _value(tally.add(x1)) == [1.0, 1.0, 1.0]  # (it lives on host 1)

        # The driver's own code holds the loop (the controller runs on it): no heartbeat
        # leaves, no message is read, for four liveness timeouts.
        time.sleep(HOLD_S)
        assert [h.state for h in ctl.hosts()] == ["alive", "alive"]
        assert await _value(ident(x1)) == [0.0, 1.0, 2.0]  # the old arrays and objects
        # Host 0's function holds its GIL as long, right after the driver's hold: its
        # heartbeats stop, its link answers (and the hold is nobody's silence: host 0's
        # last word, read when the loop ran again, is not taken to be later than that).
        gil = holds_the_gil(x0)
        assert await _value(tally.add(x1)) == [2.0, 2.0, 2.0]
        held = [r.getMessage() for r in caplog.records
                if "event loop did not run for" in r.getMessage()]
        assert held and held[0].startswith("the controller's event loop did not run for")
        assert float(held[0].split(" for ")[1].split(" s ")[0]) >= HOLD_S - 1  # its length
        assert [r for r in caplog.records if r.levelno >= logging.WARNING
                and "event loop did not run" in r.getMessage()], "a hold this long warns"

        assert await _value(gil) == [1.0, 2.0, 3.0]
        assert [h.state for h in ctl.hosts()] == ["alive", "alive"]
        assert np.asarray(await bounded(cb.device_get(x0))).tolist() == [0.0, 1.0, 2.0]
        assert await _value(tally.add(x1)) == [3.0, 3.0, 3.0]

        # A worker that is really gone: stopped, it answers nothing, not even ZeroMQ's
        # heartbeats, so its link closes and its silence is judged. It is lost.
        pid = ctl.hosts()[1].pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            await eventually(lambda: ctl.hosts()[1].state == "lost", LOST_WITHIN,
                             "the stopped worker to be lost")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGCONT)
        with pytest.raises(cb.HostLostError):
            await bounded(tally.add(x1))
        assert await _value(ident(x0)) == [0.0, 1.0, 2.0]  # the other host goes on
        assert ctl.hosts()[0].state == "alive"


SILENT = """
import sys, zmq
from fakeworker import FakeWorker

address, key = sys.argv[1], bytes.fromhex(sys.argv[2])
fake = FakeWorker(zmq.Context(), address, key, "early", channel=True)
print("ready", flush=True)
fake.join()  # its JOIN waits in its socket until the controller binds: it joins at once
while True:  # and says nothing more (its ZeroMQ I/O thread answers until it is stopped)
    fake.poll_in(1.0)
"""


async def test_the_stall_clock_starts_with_the_controller_not_its_construction(
        caplog: pytest.LogCaptureFixture) -> None:
    """A controller built long before it starts was not held meanwhile. A worker that
    joins at once and then goes silent (here: stopped) is lost within the liveness
    timeout: construction's head start used to count as a frozen process at the first
    tick and was added to the silence of every host joined by then, so that worker was
    lost that much later (and a returning worker refused as alive as long). No held loop
    is reported either."""
    caplog.set_level(logging.INFO, logger="colobus.controller")
    hb, live = 0.5, 1.5
    key = os.urandom(32)
    address = f"tcp://127.0.0.1:{_free_port()}"  # known before it binds: the worker waits
    ctl = cb.Controller(address, hosts=1, key=key, heartbeat_interval=hb,
                        liveness_timeout=live)
    built = time.monotonic()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), *sys.path]))
    proc = subprocess.Popen([sys.executable, "-c", SILENT, address, key.hex()],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert (await asyncio.to_thread(proc.stdout.readline)).strip() == b"ready"
        await asyncio.sleep(max(2 * hb, built + 7.0 - time.monotonic()))
        head_start = time.monotonic() - built  # 7 s or more
        await ctl.start()
        _push_current(ctl)
        started = time.monotonic()
        await ctl.wait_for_hosts(1, timeout=60)
        os.kill(proc.pid, signal.SIGSTOP)  # silent since it joined; now really gone
        stopped = time.monotonic()
        await eventually(lambda: ctl.hosts()[0].state == "lost", head_start + 4 * live,
                         "the stopped worker to be lost")
        took = time.monotonic() - stopped
        assert took < head_start - live, f"lost {took:.1f} s after it stopped"  # not 7 s late
        assert stopped - started < head_start  # (it joined at once)
    finally:
        proc.kill()
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()
        _pop_current(ctl)
        await ctl.aclose()
    holds = [float(r.getMessage().split(" for ")[1].split(" s ")[0]) for r in caplog.records
             if "event loop did not run for" in r.getMessage()]
    assert all(h < head_start - live for h in holds), holds  # (a loaded machine lags a bit)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
