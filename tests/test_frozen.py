"""A machine frozen whole (controller and workers stopped together, then resumed) loses
no host: the time nobody ran is nobody's silence (``colobus._wire.stalls``).

A sandbox that stops every process while one of them opens an accelerator, a paused
VM or container, a suspended laptop: all look like this from inside.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from colobus._wire.stalls import StallClock

DRIVER = textwrap.dedent("""
    import asyncio, sys
    import numpy as np
    import colobus as cb

    @cb.colocated_python
    def ident(x):
        return x

    async def main():
        async with cb.local_cluster(hosts=2, heartbeat_interval=0.1,
                                    liveness_timeout=1.0) as ctl:
            x = cb.device_put(np.array([1.0, 2.0]), ctl.devices()[1])
            await ident(x)
            print("ready", *[h.pid for h in ctl.hosts()], flush=True)
            sys.stdin.readline()  # the test freezes the group, resumes it, then says go
            await asyncio.sleep(0.5)  # a few liveness ticks after the freeze
            y = await ident(x)
            print("states", [h.state for h in ctl.hosts()], "value",
                  (await cb.device_get(y)).tolist(), flush=True)

    asyncio.run(main())
""")


def _signal_all(group: int, pids: list[int], sig: int) -> None:
    """``sig`` to a process group and to processes of their own sessions (the workers),
    back to back: a machine's processes stopped or resumed together."""
    os.killpg(group, sig)
    for pid in pids:
        os.kill(pid, sig)


def test_a_late_tick_says_how_long_the_process_was_frozen() -> None:
    clock = StallClock(1.0)
    start = clock._last
    assert clock.frozen(start + 1.5) == 0.0  # late, but within a second interval
    assert clock.frozen(start + 1.5 + 7.0) == pytest.approx(5.0)  # 7 s: 5 beyond two
    assert clock.frozen(start + 9.5) == 0.0


def test_a_machine_frozen_whole_past_the_liveness_timeout_loses_no_host() -> None:
    with subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, start_new_session=True) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            word, *pids = proc.stdout.readline().split()
            assert word == "ready" and len(pids) == 2, (word, pids)
            # the driver and its workers (each in a session of its own), all at once
            group = os.getpgid(proc.pid)
            _signal_all(group, [int(p) for p in pids], signal.SIGSTOP)
            try:
                subprocess.run(["sleep", "3"], check=True)  # three liveness timeouts
            finally:
                _signal_all(group, [int(p) for p in pids], signal.SIGCONT)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            out = proc.stdout.readline()
            assert proc.wait(60) == 0, out
        finally:
            if proc.poll() is None:
                proc.kill()
    assert out.startswith("states ['alive', 'alive'] value [1.0, 2.0]"), out


RELAYED_DRIVER = textwrap.dedent("""
    import asyncio, json, sys
    import numpy as np
    import colobus as cb

    @cb.colocated_python
    def ident(x):
        return x

    async def main():
        async with cb.local_cluster(hosts=2, heartbeat_interval=0.2, liveness_timeout=2.0,
                                    relays=1, relay_threshold=1) as ctl:
            xs = [cb.device_put(np.array([1.0, 2.0]), d) for d in ctl.devices()]
            await cb.gather(*[ident(x) for x in xs])
            rounds = 0

            async def busy():  # calls in flight on both hosts, all along
                nonlocal rounds
                while True:
                    await cb.gather(*[ident(x) for x in xs])
                    rounds += 1

            task = asyncio.create_task(busy())
            while rounds < 3:
                await asyncio.sleep(0.05)
            pids = {"workers": [h.pid for h in ctl.hosts()],
                    "relays": [r["pid"] for r in ctl.stats()["relays"]]}
            print("ready", json.dumps(pids), flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            await asyncio.sleep(1.0)  # calls go on after the freeze
            task.cancel()
            ys = await cb.gather(*[ident(x) for x in xs])
            values = [(await cb.device_get(y)).tolist() for y in ys]
            print("states", [h.state for h in ctl.hosts()], "values", values, flush=True)

    asyncio.run(main())
""")


def test_a_machine_frozen_whole_with_calls_in_flight_through_a_relay_loses_no_host() -> None:
    """The same freeze with the hosts behind a relay and calls in flight. The hosts stop
    a moment before the relay and resume a moment after it, as processes of a frozen
    machine may: the relay's first ticks after the freeze find the calls it forwarded
    unacknowledged since before the freeze. It used to take that wait for the hosts'
    ("it acknowledged nothing for 6.3 s") and lose them; the frozen time is nobody's
    wait, and a host that said nothing (stopped) could acknowledge nothing either."""
    import json

    with subprocess.Popen([sys.executable, "-c", RELAYED_DRIVER], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, start_new_session=True) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            line = proc.stdout.readline()
            assert line.startswith("ready "), line
            pids = json.loads(line.split(" ", 1)[1])
            (relay,) = pids["relays"]
            group = os.getpgid(proc.pid)
            for pid in pids["workers"]:
                os.kill(pid, signal.SIGSTOP)
            subprocess.run(["sleep", "0.3"], check=True)  # calls forwarded, unacknowledged
            _signal_all(group, [relay], signal.SIGSTOP)  # the driver and its relay too
            try:
                subprocess.run(["sleep", "6"], check=True)  # three liveness timeouts
            finally:
                os.kill(proc.pid, signal.SIGCONT)
                os.kill(relay, signal.SIGCONT)
                subprocess.run(["sleep", "0.5"], check=True)  # the relay ticks first
                _signal_all(group, pids["workers"], signal.SIGCONT)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            out = proc.stdout.readline()
            assert proc.wait(60) == 0, out
        finally:
            if proc.poll() is None:
                proc.kill()
    assert out.startswith("states ['alive', 'alive'] values [[1.0, 2.0], [1.0, 2.0]]"), out
