"""Shared helpers of the issue-12 tests: bounded waits, store checks, standalone workers.

Every wait here has a bound, so a hang fails the test instead of stalling the run.
Store figures come only from the public ``await ctl.refresh_stats()``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import colobus as cb

T = TypeVar("T")

SETTLE_S = 20.0  # a future that should settle does so within this (generous on 2 loaded cores)
STORE_KEYS = ("arrays", "results", "objects")
# The liveness timeout of clusters shared by many tests, none of which loses a host on
# purpose: a machine loaded by another run does not starve their hosts into loss.
SHARED_LIVENESS_S = 30.0


def all_joined(cluster: cb.Controller) -> None:
    """Wait until every host of a shared (sync-face) cluster is alive: one lost for
    silence rejoins, and a test that started meanwhile would find its devices missing
    (``Number of devices 0 must be >= the product of mesh_shape``)."""
    cluster.run_sync(cluster.wait_for_hosts(timeout=120))


async def bounded(aw: Awaitable[T], seconds: float = SETTLE_S, what: str = "operation") -> T:
    """``await aw`` within ``seconds``; a hang is an ``AssertionError`` naming ``what``."""

    async def run() -> T:
        return await aw

    try:
        return await asyncio.wait_for(run(), seconds)
    except TimeoutError:
        raise AssertionError(f"{what} did not settle within {seconds} s (hang)") from None


def _loop_of(ctl: cb.Controller | None) -> cb.Controller:
    from colobus._controller.controller import default_controller

    return ctl if ctl is not None else default_controller()


def in_async(make: Callable[[], T], ctl: cb.Controller | None = None) -> T:
    """``make()`` run as async code under ``async with`` runs it: on the controller's own
    event-loop thread (``ctl``, default: the default controller, a ``with`` one), in a
    task of its own (one stream). Calls made there return their ``cb.Future``; on every
    other thread (plain code, or another event loop) they return their arrays. For tests
    of the Futures themselves; ``make`` must not block (it runs on that loop)."""

    async def run() -> T:
        return make()

    return _loop_of(ctl).run_sync(run(), timeout=SETTLE_S)


class OnLoop:
    """``on_loop(make)``: ``make()`` run as :func:`in_async` runs it, every one in the same
    task on the controller's loop (one stream: the calls made there run on each host in
    the order made, as one thread's or task's do); its result or error, here."""

    def __init__(self, ctl: cb.Controller) -> None:
        self.ctl = ctl
        self.jobs: asyncio.Queue[Any] | None = None
        self.task: concurrent.futures.Future[None] | None = None

    def start(self) -> None:
        async def make_queue() -> asyncio.Queue[Any]:
            return asyncio.Queue()

        self.jobs = jobs = self.ctl.run_sync(make_queue(), timeout=SETTLE_S)

        async def serve() -> None:
            while (job := await jobs.get()) is not None:
                make, done = job
                try:
                    done.set_result(make())
                except BaseException as exc:
                    done.set_exception(exc)
                del job, make, done  # (holds nothing made: a Future kept frees nothing)

        assert self.ctl._loop is not None
        self.task = asyncio.run_coroutine_threadsafe(serve(), self.ctl._loop)

    def __call__(self, make: Callable[[], T]) -> T:
        assert self.jobs is not None and self.ctl._loop is not None
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self.ctl._loop.call_soon_threadsafe(self.jobs.put_nowait, (make, done))
        return done.result(SETTLE_S)

    def stop(self) -> None:
        if self.jobs is not None and self.task is not None and self.ctl._loop is not None:
            self.ctl._loop.call_soon_threadsafe(self.jobs.put_nowait, None)
            self.task.result(SETTLE_S)


@contextmanager
def calls_return_futures(ctl: cb.Controller | None = None) -> Iterator[OnLoop]:
    """Within, ``on_loop(make)`` runs ``make()`` on the controller's loop thread, in one
    task (:class:`OnLoop`), where calls return their ``cb.Future`` as async code's under
    ``async with`` do: for tests of the Futures themselves, written as plain code."""
    on_loop = OnLoop(_loop_of(ctl))
    on_loop.start()
    try:
        yield on_loop
    finally:
        on_loop.stop()


async def outcome(fut: cb.Future[Any], seconds: float = SETTLE_S,
                  what: str = "future") -> BaseException | None:
    """Wait (bounded) until ``fut`` is done, without cancelling it; its exception or None."""
    deadline = time.monotonic() + seconds
    while not fut.done():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not settle within {seconds} s (hang)")
        await asyncio.sleep(0.01)
    if fut.cancelled():
        return asyncio.CancelledError()
    return fut.exception()


async def eventually(pred: Callable[[], object], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds} s waiting for {what}")
        await asyncio.sleep(0.05)


def held(host: dict[str, Any]) -> dict[str, Any]:
    """What a host's stats say it holds (``results`` only where reported)."""
    return {k: host[k] for k in STORE_KEYS if k in host}


async def store(ctl: cb.Controller) -> dict[int, dict[str, Any]]:
    """Every live host's store counters, asked for now."""
    stats = await bounded(ctl.refresh_stats(), what="refresh_stats()")
    return {i: h for i, h in stats["hosts"].items() if h["state"] == "alive"}


async def quiesced(ctl: cb.Controller, seconds: float = 10.0,
                   base: dict[int, dict[str, Any]] | None = None) -> dict[int, dict[str, Any]]:
    """Collect garbage and poll the live hosts' stores until each holds no more than ``base``
    (default: nothing), or ``seconds`` pass; returns the last figures."""
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        now = await store(ctl)
        if all(_within(h, (base or {}).get(i)) for i, h in now.items()):
            return now
        if time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.1)


def _within(host: dict[str, Any], base: dict[str, Any] | None) -> bool:
    return all(host[k] <= (base or {}).get(k, 0) for k in STORE_KEYS if k in host)


def assert_store_empty(hosts: dict[int, dict[str, Any]],
                       base: dict[int, dict[str, Any]] | None = None) -> None:
    """Every host holds no arrays or objects beyond ``base``, then no call results.

    Arrays and objects first: those are what today's code leaks; the
    ``results`` counter is the stats contract of the redesign (a ``KeyError``
    until it exists).
    """
    base = base or {}
    extra = {i: {k: h[k] - base.get(i, {}).get(k, 0) for k in ("arrays", "objects")}
             for i, h in hosts.items()}
    assert all(v == 0 for e in extra.values() for v in e.values()), (
        f"hosts still hold (beyond the baseline) {extra}; stats {hosts}")
    results = {i: h["results"] - base.get(i, {}).get("results", 0) for i, h in hosts.items()}
    assert all(v == 0 for v in results.values()), f"hosts still hold call results {results}"


def pid_of(ctl: cb.Controller, host: int) -> int:
    return ctl.hosts()[host].pid


class Workers:
    """Standalone ``colobus worker`` subprocesses; killed and reaped in ``close``."""

    def __init__(self, key_file: str) -> None:
        self.key_file = key_file
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, connect: str, name: str, devices: int = 1,
              parent: bool = True) -> subprocess.Popen[bytes]:
        """Start a worker joining ``connect`` as ``name``; its output goes to ours."""
        env = dict(os.environ)
        paths = [p if p else os.getcwd() for p in sys.path]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        if parent:
            env["COLOBUS_PARENT_PID"] = str(os.getpid())
        env.pop("COLOBUS_KEY_FILE", None)
        env.setdefault("COLOBUS_LOG_LEVEL", "WARNING")
        proc = subprocess.Popen(
            [sys.executable, "-m", "colobus", "worker", "--connect", connect,
             "--devices", str(devices), "--name", name, "--key-file", self.key_file],
            env=env, stdin=subprocess.DEVNULL, cwd=os.getcwd())
        self.procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)

    def alive(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in self.procs if p.poll() is None]

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(10)


@contextmanager
def workers(key_file: str) -> Iterator[Workers]:
    w = Workers(key_file)
    try:
        yield w
    finally:
        w.close()
