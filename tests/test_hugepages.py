"""Huge pages for large receives (issue 7): local workers and the CLI run with
glibc's ``malloc.hugetlb`` tunable, unless turned off or set by the user. And a
worker's malloc heaps kept grown (issue 64): made in each worker, unless turned off
or set by the user."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import colobus as cb
from colobus import _process as H

glibc = sys.platform.startswith("linux") and __import__("platform").libc_ver()[0] == "glibc"
needs_glibc = pytest.mark.skipif(not glibc, reason="needs Linux with glibc")
needs_thp = pytest.mark.skipif(not H.available(),
                               reason="needs Linux, glibc 2.35+ and transparent huge pages")


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv]
    return {k.decode(): v.decode() for k, v in items}


@needs_thp
def test_with_huge_pages_adds_the_tunable_keeps_the_users_and_obeys_the_switch() -> None:
    assert H.with_huge_pages({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert H.with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})[
        "GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    mine = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert H.with_huge_pages(mine) == mine
    assert "GLIBC_TUNABLES" not in H.with_huge_pages({"COLOBUS_HUGE_PAGES": "0"})
    env: dict[str, str] = {}
    H.with_huge_pages(env)
    assert env == {}  # a copy: the caller's mapping is not changed


@needs_thp
@pytest.mark.parametrize("switch", [None, "0"])
async def test_local_workers_start_with_huge_pages_unless_turned_off(
        switch: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    if switch is not None:
        monkeypatch.setenv("COLOBUS_HUGE_PAGES", switch)
    async with cb.local_cluster(hosts=1, devices_per_host=1) as ctl:
        env = _environ(ctl.hosts()[0].pid)
    if switch is None:
        assert env.get("GLIBC_TUNABLES") == "glibc.malloc.hugetlb=1"
    else:
        assert "GLIBC_TUNABLES" not in env


@needs_thp
def test_colobus_worker_reruns_itself_with_huge_pages() -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLIBC_TUNABLES", "COLOBUS_HUGE_PAGES", "COLOBUS_HUGE_PAGES_EXEC")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "colobus", "worker", "--connect", "tcp://127.0.0.1:9",
         "--name", "hp"], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        seen: dict[str, str] = {}
        while time.monotonic() < deadline:
            seen = _environ(proc.pid)  # the same process id after the re-exec
            if "COLOBUS_HUGE_PAGES_EXEC" in seen:
                break
            time.sleep(0.1)
        assert seen.get("GLIBC_TUNABLES") == "glibc.malloc.hugetlb=1", seen.get("GLIBC_TUNABLES")
        assert proc.poll() is None  # still running: it is trying to join
    finally:
        proc.kill()
        proc.wait()


def _keeps(env: dict[str, str]) -> str:
    """What ``keep_heaps`` answers in a fresh interpreter with ``env`` added."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("GLIBC_TUNABLES", "COLOBUS_MALLOC_HEAPS")}
    return subprocess.run(
        [sys.executable, "-c", "from colobus import _process as H; print(H.keep_heaps())"],
        env={**base, **env}, capture_output=True, text=True, check=True).stdout.strip()


@needs_glibc
def test_keep_heaps_is_made_unless_turned_off_or_set_by_the_user() -> None:
    assert _keeps({}) == "True"
    assert _keeps({"COLOBUS_MALLOC_HEAPS": "0"}) == "False"
    assert _keeps({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1048576"}) == "False"
    assert _keeps({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}) == "True"  # not one of ours


@cb.colocated_python
def _heaps_kept(x: object) -> object:
    import jax.numpy as jnp

    from colobus import _process

    return jnp.asarray([int(_process.heaps_kept)], jnp.int32)


@needs_glibc
@pytest.mark.parametrize("switch", [None, "0"])
async def test_each_worker_keeps_its_heaps_unless_turned_off(
        switch: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    if switch is None:
        monkeypatch.delenv("COLOBUS_MALLOC_HEAPS", raising=False)
    else:
        monkeypatch.setenv("COLOBUS_MALLOC_HEAPS", switch)
    async with cb.local_cluster(hosts=1, devices_per_host=1):
        x = cb.device_put(np.zeros(1, np.int32), cb.SingleDeviceSharding(cb.devices()[0]))
        got = await cb.device_get(_heaps_kept(x))
    assert list(np.asarray(got)) == ([1] if switch is None else [0])
