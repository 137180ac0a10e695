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
            print("ready", flush=True)
            sys.stdin.readline()  # the test freezes the group, resumes it, then says go
            await asyncio.sleep(0.5)  # a few liveness ticks after the freeze
            y = await ident(x)
            print("states", [h.state for h in ctl.hosts()], "value",
                  (await cb.device_get(y)).tolist(), flush=True)

    asyncio.run(main())
""")


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
            assert proc.stdout.readline().strip() == "ready"
            group = os.getpgid(proc.pid)
            os.killpg(group, signal.SIGSTOP)  # the driver and its workers, all at once
            try:
                subprocess.run(["sleep", "3"], check=True)  # three liveness timeouts
            finally:
                os.killpg(group, signal.SIGCONT)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            out = proc.stdout.readline()
            assert proc.wait(60) == 0, out
        finally:
            if proc.poll() is None:
                proc.kill()
    assert out.startswith("states ['alive', 'alive'] value [1.0, 2.0]"), out
