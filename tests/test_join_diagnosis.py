"""Workers and drivers that say what is wrong: real worker processes, real sockets.

A worker that cannot join says why at the default log level within seconds;
a driver waiting for hosts shows progress with no logging set up and names
the key in its timeout; SIGTERM ends a worker at once and cleanly.
"""

from __future__ import annotations

import asyncio
import collections.abc
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import IO

import pytest

import colobus as cb
from colobus._wire.keys import key_id, write_key

SCRIPT = Path(sys.executable).parent / "colobus"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Procs:
    """Subprocesses with their stderr piped; killed and reaped in finally."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, *argv: str) -> subprocess.Popen[str]:
        env = dict(os.environ)
        env.pop("COLOBUS_KEY_FILE", None)
        env.pop("COLOBUS_LOG_LEVEL", None)
        proc = subprocess.Popen(list(argv), env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=10)


@pytest.fixture
def procs() -> collections.abc.Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        p.close()


def _wait_listening(port: int, timeout: float) -> None:
    """Return once something accepts TCP connections on ``port`` (fails after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _read_until(stream: IO[str], pattern: str, timeout: float) -> list[str]:
    """Lines of ``stream`` up to one matching ``pattern`` (fails after ``timeout``)."""
    import selectors

    lines: list[str] = []
    deadline = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    try:
        while time.monotonic() < deadline:
            if not sel.select(max(0.0, deadline - time.monotonic())):
                continue
            line = stream.readline()
            if not line:
                break
            lines.append(line)
            if re.search(pattern, line):
                return lines
    finally:
        sel.close()
    raise AssertionError(f"no line matching {pattern!r} within {timeout} s: {lines}")


def test_nothing_listening_is_said_in_seconds_and_sigterm_exits_cleanly(
        procs: Procs, tmp_path: Path) -> None:
    key_file = tmp_path / "k"
    write_key(key_file)
    port = _free_port()
    worker = procs.start(str(SCRIPT), "worker", "--connect", f"tcp://127.0.0.1:{port}",
                         "--key-file", str(key_file))
    assert worker.stderr is not None
    t0 = time.monotonic()
    lines = _read_until(worker.stderr, "cannot join", 60)
    assert "WARNING" in lines[-1] and "nothing listening on 127.0.0.1" in lines[-1], lines
    # JAX's start-up counts too; under load it can take a while.
    assert time.monotonic() - t0 < 30
    t1 = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(10) == 0
    assert time.monotonic() - t1 < 3.0, "SIGTERM must end a worker at once"
    assert "Traceback" not in worker.stderr.read()


def test_wrong_key_both_sides_say_so_without_logging_setup(
        procs: Procs, tmp_path: Path) -> None:
    good, bad = tmp_path / "good.key", tmp_path / "bad.key"
    key = write_key(good)
    write_key(bad)
    port = _free_port()
    driver_code = textwrap.dedent(f"""
        import asyncio, colobus as cb
        async def main():
            ctl = cb.Controller("tcp://127.0.0.1:{port}", hosts=1,
                                key=cb.load_key({str(good)!r}), join_timeout=15)
            try:
                async with ctl:
                    pass
            except TimeoutError as exc:
                print("TIMEOUT:", exc, flush=True)
        asyncio.run(main())
    """)
    driver = procs.start(sys.executable, "-c", driver_code)  # no logging configured
    _wait_listening(port, 60)  # a worker probing before the bind would see nothing there
    worker = procs.start(str(SCRIPT), "worker", "--connect", f"tcp://127.0.0.1:{port}",
                         "--key-file", str(bad), "--name", "intruder")
    assert worker.stderr is not None
    lines = _read_until(worker.stderr, "cannot join", 60)
    assert "wrong key or wrong address?" in lines[-1], lines
    assert f"key id is {key_id(cb.load_key(bad))}" in lines[-1]
    out, err = driver.communicate(timeout=60)
    assert "waiting for hosts: 0 of 1 joined" in err, err
    assert f"--key-file {good}" in err
    assert "TIMEOUT: only 0 of 1 colobus hosts joined" in out, out
    assert f"from {good}, id {key_id(key)}" in out
    assert "Traceback" not in err


async def test_version_mismatch_is_refused_and_the_worker_exits_2(
        procs: Procs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import colobus._controller.sessions as sessions_module

    key_file = tmp_path / "k"
    key = write_key(key_file)
    # This controller speaks another protocol version than the worker.
    monkeypatch.setattr(sessions_module, "PROTOCOL_VERSION", 99)
    async with cb.Controller("tcp://127.0.0.1:*", hosts=0, key=key) as ctl:
        worker = procs.start(str(SCRIPT), "worker", "--connect", ctl.address,
                             "--key-file", str(key_file))
        assert worker.stderr is not None
        # Read in a thread: the controller serves on this loop meanwhile.
        lines = await asyncio.to_thread(_read_until, worker.stderr, "refused this worker", 60)
        assert "protocol version mismatch" in lines[-1]
        assert await asyncio.to_thread(worker.wait, 10) == 2
        assert ctl.hosts() == []


async def test_a_worker_answered_but_not_yet_welcomed_is_not_told_its_key_is_wrong(
        procs: Procs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from colobus._controller.sessions import Sessions

    key_file = tmp_path / "k"
    key = write_key(key_file)
    # This controller challenges the worker (so its key is right) and then holds its
    # HELLO for good, as a controller with a reason to wait would.
    monkeypatch.setattr(Sessions, "_admit", lambda self, identity, env, hello: None)
    async with cb.Controller("tcp://127.0.0.1:*", hosts=0, key=key) as ctl:
        worker = procs.start(str(SCRIPT), "worker", "--connect", ctl.address,
                             "--key-file", str(key_file))
        assert worker.stderr is not None
        lines = await asyncio.to_thread(_read_until, worker.stderr, "cannot join", 60)
        assert "wrong key" not in lines[-1], lines
        assert f"the controller answers (key id {key_id(key)} is right)" in lines[-1], lines


def test_names_are_numbered_before_they_join_and_keep_their_device_ids_in_order() -> None:
    from colobus._controller.hosts import HostRegistry
    from colobus._wire import protocol as P

    hosts = HostRegistry()
    hosts.reserve(["local-0", "local-1", "local-2"])

    def join(name: str, devices: int) -> tuple[int, list[int]]:
        hello = P.Hello(name, 1, "here", [["cpu", "cpu", i] for i in range(devices)], b"n")
        host = hosts.join(name.encode(), hello, b"s", b"c", 0)
        return host.index, [d.id for d in host.devices]

    assert [h.state for h in (h.info() for h in hosts.hosts)] == ["joining"] * 3
    assert join("local-2", 2) == (2, [4, 5])  # first to come: no wait for the others
    assert hosts.missing_names() == ["local-0", "local-1"]
    assert join("stranger", 2) == (3, [6, 7])  # a name not numbered comes after them
    assert join("local-0", 2) == (0, [0, 1])
    assert join("local-1", 2) == (1, [2, 3])
    assert hosts.missing_names() == [] and hosts.alive_count() == 4
    assert [d.id for d in hosts.devices()] == list(range(8))
    assert [d.host for d in hosts.devices()] == [0, 0, 1, 1, 2, 2, 3, 3]  # ids in host order


def test_worker_refuses_a_malformed_endpoint_before_zeromq() -> None:
    from colobus._host.worker import Worker

    KEY = b"k" * 32
    for bad in ("localhost:5555", "tcp://localhost", "tcp://:5555", "ipc://"):
        with pytest.raises(ValueError, match="expected"):
            Worker(bad, key=KEY)
    Worker("tcp://[::1]:5555", key=KEY)
    Worker("ipc:///tmp/x.sock", key=KEY)
