"""Inline calls (issue 27, on unless ``COLOBUS_INLINE_CALLS=0``): a lone quick plain call runs on
the worker thread that received it (:mod:`colobus._host.leader`), and what the call pool
guaranteed still holds: a slow call never blocks heartbeats, calls that wait for each
other complete.

Real workers, real sockets; which thread ran a call is read from the call itself.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from lifecycle import eventually

import colobus as cb

HB, LIVE = 0.2, 2.0
INLINE, POOL, OTHER = 1, 2, 0  # where a call ran, as the call says (outputs are arrays)


@pytest.fixture(autouse=True)
def _inline_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inline calls are on by default; these workers say so (a CI may turn them off)."""
    monkeypatch.setenv("COLOBUS_INLINE_CALLS", "1")


def _where() -> Any:
    name = threading.current_thread().name
    return np.int32(INLINE if name.startswith("colobus-loop-")
                    else POOL if name.startswith("colobus-call") else OTHER)


@cb.colocated_python
def thread_name() -> Any:
    return _where()


@cb.colocated_python
def nothing() -> None:
    """Returns nothing: its run on the host's pool is as short as a call's can be."""


@cb.colocated_python
def sleep_then_name(seconds: float) -> Any:
    time.sleep(seconds)
    return _where()


@cb.colocated_python
def wait_for(path: str, seconds: float) -> Any:
    """Waits (up to ``seconds``) for ``path``, which a later call of another stream makes."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.001)
    return (np.int32(os.path.exists(path)), _where())


@cb.colocated_python
def touch(path: str) -> Any:
    with open(path, "w"):
        pass
    return np.int32(1)


@cb.colocated_python
def watch_figures() -> Any:
    """The worker's baton: inline calls, late ones (stall_s or longer), the watchdog's
    wake-ups and takeovers, the last takeover's call's time (us) and the stall (us)."""
    from colobus._host.leader import Baton

    watch = next(t for t in threading.enumerate() if t.name == "colobus-loop-watch")
    baton = watch._target.__self__  # type: ignore[attr-defined]
    assert isinstance(baton, Baton)
    return np.array([baton.inlined, baton.late, baton.watch_wakes, baton.takeovers,
                     round(baton.takeover_after_s * 1e6), round(baton.stall_s * 1e6)],
                    np.int64)


def _on(fn: Any, ctl: cb.Controller, host: int = 0) -> Any:
    return fn.specialize(devices=[d for d in ctl.devices() if d.host == host][:1])


async def _call(fn: Any, *args: Any) -> Any:
    return await fn(*args)


async def _get(x: Any) -> int:
    return int(np.asarray(await cb.device_get(x)))


async def _names(ctl: cb.Controller, n: int) -> list[int]:
    name = _on(thread_name, ctl)
    return [await _get(await name()) for _ in range(n)]


async def test_a_lone_quick_call_runs_on_the_thread_that_received_it() -> None:
    async with cb.local_cluster(hosts=1, heartbeat_interval=HB, liveness_timeout=LIVE) as ctl:
        names = await _names(ctl, 20)
        assert INLINE in names, names


async def test_inline_calls_off_runs_every_plain_call_on_the_pool(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLOBUS_INLINE_CALLS", "0")
    async with cb.local_cluster(hosts=1, heartbeat_interval=HB, liveness_timeout=LIVE) as ctl:
        names = await _names(ctl, 20)
        assert set(names) == {POOL}, names


async def test_a_slow_inline_call_never_blocks_heartbeats_nor_other_calls() -> None:
    """A call that runs well past the liveness timeout, started inline, loses the loop to
    another thread: the host stays alive, and a call of another stream runs meanwhile."""
    async with cb.local_cluster(hosts=1, heartbeat_interval=HB, liveness_timeout=LIVE) as ctl:
        for _ in range(25):  # until the slow call is one that started inline (under load: tries)
            await _names(ctl, 3)
            # The host's last call a quick one (its run under 0.5 ms), which a lone call
            # needs to start inline: a thread_name call's array output alone takes about
            # that long on a pool thread, so its calls may leave the host on the pool.
            await _on(nothing, ctl)()
            slow = _on(sleep_then_name, ctl)(LIVE * 1.5)
            await asyncio.sleep(0.1)  # alone on the host, not in one batch with the next
            # another task, another stream: answered while the slow call runs
            quick = await asyncio.create_task(_call(_on(thread_name, ctl)))
            assert await _get(quick) in (INLINE, POOL) and not slow.done()
            name = await _get(await slow)
            assert ctl.hosts()[0].state == "alive"
            if name == INLINE:
                break
        else:
            pytest.fail("no slow call started inline in 25 tries")
        await eventually(lambda: ctl.hosts()[0].state == "alive", 5, "the host alive")


async def test_calls_that_wait_for_each_other_complete_when_the_first_ran_inline(
        tmp_path: Path) -> None:
    """A (inline) waits for what B does; B arrives after A started: the loop moves to
    another thread, which receives and runs B, so A completes."""
    async with cb.local_cluster(hosts=1, heartbeat_interval=HB, liveness_timeout=LIVE) as ctl:
        for i in range(25):
            await _names(ctl, 3)
            path = str(tmp_path / f"made{i}")
            a = _on(wait_for, ctl)(path, 30.0)
            await asyncio.sleep(0.05)  # A is running on the host (inline, or on the pool)
            assert await _get(await asyncio.create_task(_call(_on(touch, ctl), path))) == 1
            found, name = await asyncio.wait_for(a, 30)
            assert await _get(found) == 1, "A gave up waiting: B did not run while A waited"
            if await _get(name) == INLINE:
                break
        else:
            pytest.fail("A never ran inline in 25 tries")


async def test_the_watchdog_wakes_only_for_a_call_past_the_stall_and_hands_it_over(
        tmp_path: Path) -> None:
    """The watchdog costs nothing per unit of time: over 40 quick inline calls it wakes at
    most once for each that ran past the stall threshold (on a quiet machine: none),
    never on a clock. A stuck inline call still loses the loop: a later call of another
    stream runs while it waits for that call (real worker), and the takeover came after
    the threshold, never before, and well inside the liveness timeout."""
    async with cb.local_cluster(hosts=1, heartbeat_interval=HB, liveness_timeout=LIVE) as ctl:
        figures = _on(watch_figures, ctl)
        await _names(ctl, 3)
        for _ in range(10):  # (a loaded machine can make every call of a round slow)
            before = await _get_all(await figures())
            names = await _names(ctl, 40)
            after = await _get_all(await figures())
            if INLINE in names:
                break
        else:
            pytest.fail(f"no call ran inline in 10 rounds of 40: {names} {before} {after}")
        inlined, late, wakes = (after[i] - before[i] for i in range(3))
        assert inlined >= names.count(INLINE), (names, before, after)
        # (+1: the second figures call's own wake-up, if it ran late, before its own count)
        assert wakes <= late + 1, (before, after)
        for i in range(25):  # a call that waits for a later one, started inline
            path = str(tmp_path / f"made{i}")
            a = _on(wait_for, ctl)(path, 30.0)
            await asyncio.sleep(0.05)  # A is running on the host (inline, or on the pool)
            assert await _get(await asyncio.create_task(_call(_on(touch, ctl), path))) == 1
            found, name = await asyncio.wait_for(a, 30)
            assert await _get(found) == 1, "A gave up waiting: B did not run while A waited"
            if await _get(name) == INLINE:
                break
            await _names(ctl, 3)
        else:
            pytest.fail("A never ran inline in 25 tries")
        got = await _get_all(await figures())
        takeovers, took_after_us, stall_us = got[3] - after[3], got[4], got[5]
        assert takeovers >= 1 and got[2] - after[2] >= takeovers, (after, got)
        assert stall_us <= took_after_us < LIVE * 1e6, got


async def _get_all(x: Any) -> list[int]:
    return [int(v) for v in np.asarray(await cb.device_get(x))]


def test_ctrl_c_ends_a_worker_with_inline_calls_as_asyncio_run_would(tmp_path: Path) -> None:
    """SIGINT: the worker's coroutine is cancelled, the process exits 130 (no traceback),
    with inline calls on (the loop on a leader thread) as with them off."""
    import signal
    import subprocess
    import sys

    from colobus._wire.keys import write_key

    key_file = str(tmp_path / "key")
    write_key(key_file)
    for inline in ("1", "0"):
        proc = subprocess.Popen(
            # SIGINT's default restored before the worker starts (a test runner's child may
            # inherit it ignored); no preexec_fn: a fork beside JAX's threads warns.
            [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, "
             "signal.SIG_DFL); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])",
             "-m", "colobus", "worker", "--connect", f"ipc://{tmp_path}/nobody.sock",
             "--key-file", key_file],
            env={**os.environ, "COLOBUS_INLINE_CALLS": inline}, stderr=subprocess.PIPE,
            text=True)
        try:
            assert proc.stderr is not None
            for line in proc.stderr:  # serving: its data plane is up
                if "data plane" in line:
                    break
            proc.send_signal(signal.SIGINT)
            assert proc.wait(30) == 130, inline
            assert "Traceback" not in proc.stderr.read(), inline
        finally:
            proc.kill()
            proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()


@pytest.mark.parametrize("kind", ["timerfd", "condition"])
def test_the_alarm_rings_after_an_arm_not_after_a_disarm(kind: str) -> None:
    """colobus._host.alarm: the sleeper wakes once an armed alarm's time is up, not for
    an alarm disarmed in time, and at once for ring() (the watchdog's close); the
    timerfd where Linux has one and the condition variable that stands in elsewhere."""
    import sys

    from colobus._host.alarm import Alarm, make_alarm

    if kind == "timerfd" and sys.platform != "linux":
        pytest.skip("timerfd is Linux's")
    alarm = make_alarm(0.002) if kind == "timerfd" else Alarm(0.002)
    assert (type(alarm) is not Alarm) == (kind == "timerfd")
    woke: list[float] = []

    def sleeper() -> None:
        alarm.wait()
        woke.append(time.monotonic())

    try:
        t = threading.Thread(target=sleeper, daemon=True)
        t.start()
        armed = time.monotonic()
        alarm.arm()
        t.join(30)
        assert woke and woke[0] - armed >= 0.002 - 1e-4, woke
        t = threading.Thread(target=sleeper, daemon=True)
        t.start()
        alarm.arm()
        alarm.disarm()
        time.sleep(0.05)  # past the armed time: a disarmed alarm stays silent
        assert t.is_alive() and len(woke) == 1
        alarm.ring()
        t.join(30)
        assert len(woke) == 2
    finally:
        alarm.close()
