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


# -- 2. send-path failures are the caller's ------------------------------------------------


class _Title:
    """An arbitrary object as a structured dtype's field title: msgpack cannot write it."""


@pytest.fixture(scope="module")
def big_cluster() -> collections.abc.Iterator[cb.Controller]:
    """One host, 64 MiB max_message_bytes (the issue's fetch case)."""
    with cb.local_cluster(hosts=1, devices_per_host=1, max_message_bytes=64 << 20) as ctl:
        yield ctl


@pytest.fixture
def bctl(big_cluster: cb.Controller) -> collections.abc.Iterator[cb.Controller]:
    _push_current(big_cluster)
    try:
        yield big_cluster
    finally:
        _pop_current(big_cluster)
    assert [h.state for h in big_cluster.hosts()] == ["alive"]
    assert big_cluster.stats()["hosts_dropped"] == 0


def _host_drops(ctl: cb.Controller) -> dict[str, int]:
    """What the worker dropped, from a heartbeat that is current."""
    ctl.refresh_stats().result(30)
    return dict(ctl.stats()["hosts"][0].get("dropped") or {})


def test_an_unencodable_put_fails_at_the_call_and_spends_nothing(bctl: cb.Controller) -> None:
    dev = bctl.devices()[0]
    bad = np.zeros(3, np.dtype([((_Title(), "a"), "<f4"), ("b", "<i4")]))

    def one_step() -> tuple[cb.Array, cb.Array, BaseException | None]:
        """On the controller's loop: the three puts are queued in one step (one batch)."""
        first = cb.device_put(np.arange(3.0), dev)
        err: BaseException | None = None
        try:
            cb.device_put(bad, dev)
        except BaseException as exc:
            err = exc
        second = cb.device_put(np.arange(3.0) + 10, dev)
        return first, second, err

    async def on_loop() -> tuple[cb.Array, cb.Array, BaseException | None]:
        return one_step()

    first, second, err = bctl.run_sync(on_loop())
    assert isinstance(err, cb.SerializationError), repr(err)
    np.testing.assert_array_equal(np.asarray(plus_one(first).result(30)), np.arange(3.0) + 1)
    np.testing.assert_array_equal(cb.device_get(second).result(30), np.arange(3.0) + 10)
    assert not {"gap", "oversized", "malformed"} & set(_host_drops(bctl))


# -- 3. no legal operation makes a message its receiver refuses -------------------------


def test_six_large_fetch_replies_are_never_one_oversized_batch(bctl: cb.Controller) -> None:
    dev = bctl.devices()[0]
    n = (24 << 20) // 8
    arrays = [cb.device_put(np.full(n, float(i)), dev) for i in range(6)]
    got = cb.device_get(arrays).result(120)  # the host answers all six in one loop step
    assert [float(a[0]) for a in got] == [float(i) for i in range(6)]
    assert all(a.shape == (n,) for a in got)
    assert bctl.stats()["dropped"].get("oversized", 0) == 0


@cb.colocated_python
def first_plus_one(xs: Any) -> Any:
    return xs[0] + 1


def test_calls_with_many_handles_and_frees_of_many_arrays_fit(bctl: cb.Controller) -> None:
    dev = bctl.devices()[0]
    x = cb.device_put(np.arange(2.0), dev)
    # A CALL listing 150k handles (1.5 MB of refs): its body travels in the payload.
    y = first_plus_one([x] * 150_000).result(120)
    np.testing.assert_array_equal(np.asarray(y), np.arange(2.0) + 1)
    # 262k frees at once: one RELEASE listing them all, never refused by the worker.
    gen = bctl._hosts[0].generation
    ref0 = bctl._ops.next_id() << 16

    def free_all() -> None:
        bctl._frees._queue_many([(0, gen, ref0 + i, 0) for i in range(262_144)])

    bctl._call_soon(free_all)
    z = plus_one(x).result(60)  # queued behind the RELEASE: it arrives, in sequence
    np.testing.assert_array_equal(np.asarray(z), np.arange(2.0) + 1)
    assert not {"gap", "oversized", "malformed"} & set(_host_drops(bctl))
