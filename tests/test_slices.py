"""Pipelined calls in slices (issue 64): where one stream's calls are the only ones on a
host and each is brief, the loop's leader runs them back to back (no call-pool thread, no
hand-off of the GIL per call), a slice at a time; between slices the loop runs once.

What must hold, on real workers: the calls keep their stream's order; a call of the slice
that waits for something the controller does only after an earlier call's answer still
completes (the watchdog hands the loop over, and what finished leaves); other streams
are not held up longer than a slice; a call the controller cancels while it waits behind
a slice never runs.
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
from pipeline_hostside import call as _call
from pipeline_hostside import like_on_host0 as _like
from pipeline_hostside import touch, wait_for_path
from pipeline_hostside import value as _value

import colobus as cb

HB, LIVE = 0.2, 2.0
INLINE, POOL = 1, 2


@pytest.fixture(autouse=True)
def _inline_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLOBUS_INLINE_CALLS", "1")


@cb.colocated_python
def numbered(i: int) -> Any:
    """``[i, where it ran]``: 1 a loop leader, 2 a call-pool thread."""
    name = threading.current_thread().name
    return np.array([i, INLINE if name.startswith("colobus-loop-")
                     else POOL if name.startswith("colobus-call") else 0], np.int64)


@cb.colocated_python_class
class Log:
    """What a stream's calls saw, in the order they ran."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def add(self, like: Any, i: int) -> Any:
        self.seen.append(i)
        return np.int64(len(self.seen))

    def wait_for(self, like: Any, path: str, seconds: float) -> Any:
        return wait_for_path(path, seconds)

    def seen_all(self, like: Any) -> Any:
        return np.array(self.seen, np.int64)


def _on(fn: Any, ctl: cb.Controller) -> Any:
    return fn.specialize(devices=[d for d in ctl.devices() if d.host == 0][:1])


async def test_a_streams_pipelined_brief_calls_run_on_the_loops_leader_in_order() -> None:
    async with cb.local_cluster(hosts=1, heartbeat_interval=HB, liveness_timeout=LIVE) as ctl:
        fn = _on(numbered, ctl)
        for _attempt in range(10):  # (under load a slice may go to the pool: tries)
            futs = [fn(i) for i in range(300)]
            got = [await _value(f) for f in futs]
            assert [int(g[0]) for g in got] == list(range(300))
            where = [int(g[1]) for g in got]
            if where[1:].count(INLINE) >= 150:  # most of them, after the first
                break
        else:
            pytest.fail(f"pipelined calls did not run on the loop's leader: {where}")


async def test_an_objects_pipelined_calls_keep_their_order_across_slices() -> None:
    async with cb.local_cluster(hosts=1, heartbeat_interval=HB, liveness_timeout=LIVE) as ctl:
        log: Any = Log()
        x = _like(ctl)
        futs = [log.add(x, i) for i in range(1000)]
        counts = [int(await _value(f)) for f in futs]
        assert counts == list(range(1, 1001))
        assert [int(v) for v in await _value(log.seen_all(x))] == list(range(1000))
        await cb.aclose(log)


async def test_a_call_of_a_slice_that_waits_for_the_controller_completes(
        tmp_path: Path) -> None:
    """Call 2 of a pipelined pair waits for a file the controller has made (by another
    stream's call) only once it got call 1's answer: held until the slice ended, that
    answer would never come. The watchdog hands the loop over and what finished leaves."""
    async with cb.local_cluster(hosts=1, heartbeat_interval=HB, liveness_timeout=LIVE) as ctl:
        log: Any = Log()
        x = _like(ctl)
        await _value(log.add(x, -1))  # built
        for i in range(5):
            path = str(tmp_path / f"made{i}")
            first = log.add(x, i)
            second = log.wait_for(x, path, 20.0)
            assert int(await asyncio.wait_for(_value(first), 10)) >= 1
            # (called inside the new task: its own stream)
            assert int(await asyncio.create_task(_call(_on(touch, ctl), path))) == 1
            assert int(await asyncio.wait_for(_value(second), 30)) == 1
        await cb.aclose(log)


@cb.colocated_python
def numbered_slowly(i: int) -> Any:
    time.sleep(0.0006)  # brief (a slice's call), but 1,500 of them take a second or more
    return np.array([i, 0], np.int64)


async def test_another_stream_is_answered_while_a_long_pipeline_runs() -> None:
    async with cb.local_cluster(hosts=1, heartbeat_interval=HB, liveness_timeout=LIVE) as ctl:
        fn = _on(numbered_slowly, ctl)
        futs = [fn(i) for i in range(1500)]
        await asyncio.sleep(0)  # (the pipeline's calls leave first)
        assert int((await asyncio.create_task(_call(fn, -1)))[0]) == -1
        done_before = sum(f.done() for f in futs)
        # answered before the long pipeline ended (it waits at most a slice behind it)
        assert done_before < len(futs), "the pipeline ended first: no overlap to measure"
        got = [int((await _value(f))[0]) for f in futs]
        assert got == list(range(1500))


async def test_a_call_cancelled_behind_a_slice_never_runs(tmp_path: Path) -> None:
    """1,000 brief calls queue behind a call of their stream that waits until the
    controller has cancelled the last 300 (a cancelled call that had started would
    finish, its result dropped: SPEC 4); then they run in slices, and none of the
    cancelled ones does. What ran kept its order."""
    async with cb.local_cluster(hosts=1, heartbeat_interval=HB, liveness_timeout=LIVE) as ctl:
        log: Any = Log()
        x = _like(ctl)
        await _value(log.add(x, -1))
        gate = str(tmp_path / "open")
        held = log.wait_for(x, gate, 30.0)
        futs = [log.add(x, i) for i in range(1000)]
        cancelled = futs[-300:]
        for f in cancelled:
            f.cancel()
        # (another stream's call, sent after the CANCELs: the host has read them)
        assert int(await asyncio.create_task(_call(_on(touch, ctl), gate))) == 1
        assert int(await _value(held)) == 1
        for f in futs[:-300]:
            await _value(f)
        seen = [int(v) for v in await _value(log.seen_all(x))]
        assert all(f.cancelled() for f in cancelled)
        assert seen[1:] == list(range(700)), seen[-5:]  # none cancelled ran; in order
        await cb.aclose(log)


@cb.colocated_python_class
class Looked:
    """Counts how often the host looks its method ``add`` up: once each time a call of it
    is made ready to run (its target, inputs and mesh)."""

    def __init__(self) -> None:
        self.lookups = 0
        self.ran = 0

    def __getattribute__(self, name: str) -> Any:
        if name == "add":
            object.__getattribute__(self, "__dict__")["lookups"] += 1
        return object.__getattribute__(self, name)

    def add(self, like: Any) -> Any:
        self.ran += 1
        return np.int64(self.ran)

    def counts(self, like: Any) -> Any:
        return np.array([self.ran, self.lookups], np.int64)


async def test_a_slice_is_handed_a_slices_worth_of_calls_not_the_whole_queue() -> None:
    """400 pipelined calls queue behind the first: each slice is made ready only about
    as many as it runs (those it does not reach go back to the queue, to be made ready
    again). Handed the stream's next 256 each time, each call was made ready tens of
    times: on a small step that was most of the loop's turn between two slices."""
    async with cb.local_cluster(hosts=1, heartbeat_interval=HB, liveness_timeout=LIVE) as ctl:
        obj: Any = Looked()
        x = _like(ctl)
        await _value(obj.add(x))
        futs = [obj.add(x) for _ in range(400)]
        assert [int(await _value(f)) for f in futs] == list(range(2, 402))
        ran, lookups = (int(v) for v in await _value(obj.counts(x)))
        assert ran == 401
        assert lookups <= 10 * ran, f"{lookups} lookups for {ran} calls"
        await cb.aclose(obj)


@cb.colocated_python_class
class Twin:
    """Calls that fail at every seventh, noting where each ran (loop leader or pool); the
    call numbered ``hold`` waits (up to a minute) for the file ``gate``."""

    def __init__(self, hold: int, gate: str) -> None:
        self.seen: list[int] = []
        self.where: set[int] = set()
        self.hold, self.gate = hold, gate

    def step(self, like: Any, i: int) -> Any:
        name = threading.current_thread().name
        self.where.add(INLINE if name.startswith("colobus-loop-")
                       else POOL if name.startswith("colobus-call") else 0)
        if i == self.hold:
            deadline = time.monotonic() + 60.0
            while not os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.001)
        self.seen.append(i)
        if i % 7 == 3:
            raise ValueError(f"call {i} fails")
        return np.int64(i)

    def report(self, like: Any) -> Any:
        return np.array([*sorted(self.where), -1, *self.seen], np.int64)


@pytest.mark.parametrize("inline", ["1", "0"])
async def test_slices_and_pool_batches_end_calls_alike(
        inline: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``Runs._run_slice`` writes out ``_run_batch``'s loop (the hot path's twin): the same
    pipeline, in slices on the loop's leader or in batches on a pool thread
    (``COLOBUS_INLINE_CALLS=0``), ends every call alike: values, errors, order, and the
    calls cancelled before they started never run. (A cancel that reaches the host after
    its call started lets it finish: call 240 holds the stream until the host has read the
    cancels, which came before a call of another stream that it answered.)"""
    monkeypatch.setenv("COLOBUS_INLINE_CALLS", inline)
    gate = tmp_path / "gate"
    async with cb.local_cluster(hosts=1, heartbeat_interval=HB, liveness_timeout=LIVE) as ctl:
        obj: Any = Twin(240, str(gate))
        x = _like(ctl)
        await _value(obj.step(x, 0))
        futs = [obj.step(x, i) for i in range(1, 301)]
        for f in futs[-60:]:
            f.cancel()  # (its CANCEL leaves at once: this is the controller's loop)
        assert int((await asyncio.create_task(_call(_on(numbered, ctl), -1)))[0]) == -1
        gate.touch()
        got: list[Any] = []
        for i, f in zip(range(1, 301), futs, strict=True):
            try:
                got.append(int(await _value(f)))
            except ValueError as exc:
                got.append(str(exc))
            except asyncio.CancelledError:
                assert i > 240, i
                got.append(None)
        report = [int(v) for v in await _value(obj.report(x))]
        where, seen = report[:report.index(-1)], report[report.index(-1) + 1:]
        await cb.aclose(obj)
    expected = [f"call {i} fails" if i % 7 == 3 else i for i in range(1, 241)]
    assert got[:240] == expected
    assert seen[:241] == list(range(241))
    for i, outcome in zip(range(241, 301), got[240:], strict=True):
        if outcome is None:  # answered CANCELLED: its cancel came before it started
            assert i not in seen, i
        else:
            assert outcome == (f"call {i} fails" if i % 7 == 3 else i)
    assert seen == sorted(seen)
    assert (INLINE in where) if inline == "1" else (where == [POOL]), where


def _baton() -> Any:
    """The worker's :class:`~colobus._host.leader.Baton` (its watchdog thread's)."""
    from colobus._host.leader import Baton

    watch = next(t for t in threading.enumerate() if t.name == "colobus-loop-watch")
    baton = watch._target.__self__  # type: ignore[attr-defined]
    assert isinstance(baton, Baton)
    return baton


@cb.colocated_python_class
class Spinner:
    """A small step's shape: each call holds the host's thread (and the GIL) ``us``, and
    says which inline job ran it (a slice is one; -1: not inline)."""

    def __init__(self) -> None:
        self.baton = _baton()
        self.last = (-1, 0.0)  # the last call's inline job and end
        self.stretched = 0

    def step(self, like: Any, us: float) -> Any:
        from colobus._host.runs import REARM_NS

        start = time.perf_counter()
        end = start + us / 1e6
        while time.perf_counter() < end:
            pass
        now = time.perf_counter()
        inline = threading.current_thread().name.startswith("colobus-loop-")
        job = self.baton.inlined if inline else -1
        # The leader moves the alarm on at a call's end once REARM_NS passed since it last
        # did: the alarm can ring in a slice only after REARM_NS or more from one call's
        # end to the next's (a preempted step, on a loaded machine). Counted here.
        since = self.last[1] if inline and self.last[0] == job else start
        if now - since >= REARM_NS / 1e9:
            self.stretched += 1
        self.last = (job, now)
        return np.int64(job)

    def figures(self, like: Any) -> Any:
        """The watchdog's wake-ups, its takeovers, the jobs whose last call ran past the
        stall threshold, and the steps stretched past the alarm's move (above)."""
        b = self.baton
        return np.array([b.watch_wakes, b.takeovers, b.late, self.stretched], np.int64)


async def _slices(obj: Any, x: Any, calls: int, burst: int, us: float) -> tuple[float, int]:
    """``calls`` steps sent in bursts of ``burst`` (each burst awaited whole): the mean
    length of the runs of calls one inline job ran, and the watchdog's wake-ups
    meanwhile less its takeovers, late jobs and the steps stretched past the alarm's
    move (each may ring it once)."""
    before = [int(v) for v in await _value(obj.figures(x))]
    jobs: list[int] = []
    for _ in range(calls // burst):
        futs = [obj.step(x, us) for _ in range(burst)]
        jobs += [int(await _value(f)) for f in futs]
    after = [int(v) for v in await _value(obj.figures(x))]
    wakes, takeovers, late, stretched = (a - b for a, b in zip(after, before, strict=True))
    inline = [j for j in jobs if j >= 0]
    runs = sum(1 for i, j in enumerate(inline) if i == 0 or inline[i - 1] != j)
    return len(inline) / max(runs, 1), wakes - takeovers - late - stretched


async def test_a_deep_pipeline_runs_in_long_slices_and_a_shallow_one_in_short() -> None:
    """Brief steps queued deep run many to a slice (the loop's turn between two, its
    system calls, shared by up to 32), and the watchdog sleeps through a slice however
    long: the leader moves the alarm on between its calls. Where few are queued (bursts
    of 12), a slice runs at most half of them: the replies leave while the rest run."""
    async with cb.local_cluster(hosts=1, heartbeat_interval=HB, liveness_timeout=LIVE) as ctl:
        obj: Any = Spinner()
        x = _like(ctl)
        await _value(obj.step(x, 1))
        for _ in range(6):  # (a loaded machine may stretch a step past 1 ms: its slice cut)
            deep, deep_wakes = await _slices(obj, x, 600, 600, 100)
            shallow, _ = await _slices(obj, x, 120, 12, 300)
            if deep >= 10 and 2 <= shallow <= 6 and deep_wakes <= 1:
                break
        else:
            pytest.fail(f"calls per slice: {deep:.1f} queued deep (want 10 or more), "
                        f"{shallow:.1f} in bursts of 12 (want 2 to 6); the watchdog woke "
                        f"{deep_wakes} times more than its takeovers, late calls and "
                        "stretched steps while the deep pipeline ran (want at most 1)")
        await cb.aclose(obj)
