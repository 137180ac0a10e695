"""The core runtime from the outside: exports, keys, CLI, controllers, futures, clusters."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import colobus as cb
from colobus._tools.cli import build_parser
from colobus._wire.keys import write_key


@cb.colocated_python
def ident(x):
    return x


def test_exports_are_complete_and_sorted() -> None:
    public = {n for n in dir(cb) if not n.startswith("_")} - {"annotations"}
    assert set(cb.__all__) == public
    assert cb.__all__ == sorted(cb.__all__)
    assert cb.PartitionSpec is __import__("jax").sharding.PartitionSpec
    # colobus's own lifecycle calls of a colocated object: never a method name of its own
    assert {"close", "aclose"} <= set(cb.__all__)


def test_error_tree() -> None:
    for name in ["NoControllerError", "ControllerClosedError", "HostLostError", "RemoteError",
                 "SerializationError", "ProtocolError", "AuthenticationError"]:
        assert issubclass(getattr(cb, name), cb.ColobusError)


def test_keygen_writes_0600_and_load_key_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "k"
    out = subprocess.run([sys.executable, "-m", "colobus", "keygen", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = cb.load_key(path)
    assert len(key) == 32
    assert key.hex() not in out.stdout
    (tmp_path / "bad").write_text("not hex")
    with pytest.raises(cb.AuthenticationError, match="keygen"):
        cb.load_key(tmp_path / "bad")


def test_worker_cli_options() -> None:
    args = build_parser().parse_args(
        ["worker", "--connect", "tcp://h:5555", "--devices", "4", "--name", "a",
         "--key-file", "/k"])
    assert (args.connect, args.devices, args.name, args.key_file) == (
        "tcp://h:5555", 4, "a", "/k")


def test_keys_are_at_least_32_bytes_everywhere(tmp_path: Path) -> None:
    for bad in (b"", b"k" * 31):
        with pytest.raises(cb.AuthenticationError, match=rf"is {len(bad)} bytes.*at least 32"):
            cb.Controller("tcp://0.0.0.0:5555", hosts=1, key=bad)
    cb.Controller("tcp://0.0.0.0:5555", hosts=1, key=b"k" * 32)
    short = tmp_path / "short.key"
    short.write_text((b"s" * 16).hex())
    short.chmod(0o600)
    with pytest.raises(cb.AuthenticationError, match="is 16 bytes"):
        cb.load_key(short)
    # A worker reading a short key from stdin (--key-file -) exits with the same error.
    out = subprocess.run([sys.executable, "-m", "colobus", "worker", "--connect",
                          "tcp://127.0.0.1:9", "--key-file", "-"], input="00" * 8,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "is 8 bytes" in out.stderr
    # ... and one without any key does not start either (no unauthenticated mode).
    env = {k: v for k, v in os.environ.items() if k != "COLOBUS_KEY_FILE"}
    out = subprocess.run([sys.executable, "-m", "colobus", "worker", "--connect",
                          "tcp://127.0.0.1:9"], capture_output=True, text=True, timeout=120,
                         env=env, stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and "--key-file" in out.stderr


def test_key_files_are_private_and_never_written_through(tmp_path: Path) -> None:
    path = tmp_path / "k"
    key = write_key(path)
    path.chmod(0o640)
    with pytest.raises(cb.AuthenticationError, match=f"chmod 600 {path}"):
        cb.load_key(path)
    path.chmod(0o600)
    assert cb.load_key(path) == key
    # keygen never overwrites a file, nor writes through a symlink.
    out = subprocess.run([sys.executable, "-m", "colobus", "keygen", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "exists" in out.stderr
    assert cb.load_key(path) == key
    target = tmp_path / "target"
    target.write_text("precious")
    link = tmp_path / "link"
    link.symlink_to(target)
    out = subprocess.run([sys.executable, "-m", "colobus", "keygen", str(link)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and target.read_text() == "precious"


async def test_controller_without_key_makes_one_in_a_private_file() -> None:
    async with cb.Controller("tcp://127.0.0.1:*", hosts=0) as c:
        assert c.key_file is not None
        path = Path(c.key_file)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert len(cb.load_key(path)) >= 32
    assert not path.exists()


def test_no_controller_error_says_how_to_start_one() -> None:
    from colobus._controller.controller import _current

    saved = list(_current._stack)
    _current._stack.clear()
    try:
        with pytest.raises(cb.NoControllerError, match="local_cluster"):
            cb.devices()
        with pytest.raises(cb.NoControllerError):
            ident(1)
    finally:
        _current._stack[:] = saved


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
async def test_async_with_round_trip(transport: str) -> None:
    async with cb.local_cluster(hosts=2, transport=transport) as ctl:
        assert len(ctl.hosts()) == 2 and len(cb.devices()) == 2
        assert ctl.address.startswith(transport)
        x = cb.device_put(np.arange(3), cb.devices()[1])
        y = await ident(x)
        np.testing.assert_array_equal(await cb.device_get(y), np.arange(3))
        assert [h.state for h in ctl.hosts()] == ["alive", "alive"]


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_sync_with_round_trip(transport: str) -> None:
    with cb.local_cluster(hosts=1, devices_per_host=2, transport=transport) as ctl:
        pids = [h.pid for h in ctl.hosts()]
        x = cb.device_put(np.arange(3), cb.devices()[1])
        np.testing.assert_array_equal(np.asarray(ident(x)), np.arange(3))
        info = ctl.hosts()[0]
        assert info.index == 0 and info.name == "local-0" and len(info.devices) == 2
    _assert_gone(pids)


def _assert_gone(pids: list[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    for pid in pids:
        while _alive(pid):
            assert time.monotonic() < deadline, f"worker {pid} still running"
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of ours is as good as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_exit_on_error_reaps_workers() -> None:
    pids: list[int] = []
    with pytest.raises(ZeroDivisionError):
        with cb.local_cluster(hosts=2) as ctl:
            pids = [h.pid for h in ctl.hosts()]
            1 / 0  # noqa: B018
    _assert_gone(pids)


def test_workers_exit_when_the_controller_process_dies(tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent("""
        import os, sys, colobus as cb
        ctl = cb.init(hosts=2)
        print(" ".join(str(h.pid) for h in ctl.hosts()), flush=True)
        os.kill(os.getpid(), 9)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == -signal.SIGKILL
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2
    _assert_gone(pids, timeout=15)


def test_init_and_shutdown() -> None:
    from colobus._controller.controller import _current

    saved = list(_current._stack)
    _current._stack.clear()
    try:
        ctl = cb.init(hosts=1)
        assert cb.devices() == ctl.devices()
        np.testing.assert_array_equal(
            np.asarray(ident(cb.device_put(np.ones(2), cb.devices()[0]))), 1)
        cb.shutdown()
        cb.shutdown()  # idempotent
        with pytest.raises(cb.NoControllerError):
            cb.devices()
    finally:
        _current._stack[:] = saved


def test_future_result_timeout_and_loop_thread_guard(ctl: cb.Controller) -> None:
    fut = ctl._ops.new_future()
    with pytest.raises(TimeoutError):
        fut.result(timeout=0.05)
    errors: list[BaseException] = []

    async def on_loop() -> None:
        try:
            fut.result()
        except RuntimeError as exc:
            errors.append(exc)

    ctl.run_sync(on_loop(), timeout=10)
    assert errors and "await" in str(errors[0])
    fut.set_result(5)
    assert fut.result() == 5 and fut.done() and fut.exception() is None


async def test_future_awaitable_from_other_loops_and_callbacks(ctl: cb.Controller) -> None:
    fut = ctl._ops.new_future()
    seen: list[object] = []
    fut.add_done_callback(lambda f: seen.append(f.result()))

    def other_thread() -> object:
        async def wait() -> object:
            return await fut
        return asyncio.run(wait())

    result: list[object] = []
    t = threading.Thread(target=lambda: result.append(other_thread()))
    t.start()
    await asyncio.sleep(0.05)
    ctl._call_soon(fut.set_result, "done")
    assert await fut == "done"
    t.join(10)
    assert result == ["done"] and seen == ["done"]
    assert fut.cancel() is False


def test_stats_counts_hosts(ctl: cb.Controller) -> None:
    stats = ctl.refresh_stats().result(30)
    assert set(stats["hosts"]) == {0, 1}
    assert {"dropped", "code_sent"} <= set(stats)


def test_a_worker_with_another_key_never_joins(tmp_path: Path) -> None:
    key_file = tmp_path / "wrong.key"
    subprocess.run([sys.executable, "-m", "colobus", "keygen", str(key_file)], check=True,
                   capture_output=True, timeout=60)

    async def run() -> dict[str, int]:
        ctl = cb.Controller("tcp://127.0.0.1:*", hosts=0, key=b"r" * 32)
        await ctl.start()
        proc = subprocess.Popen([sys.executable, "-m", "colobus", "worker", "--connect",
                                 ctl.address, "--key-file", str(key_file)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while not ctl.stats()["dropped"].get("unauthenticated"):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            assert ctl.hosts() == []
            return dict(ctl.stats()["dropped"])
        finally:
            proc.kill()
            proc.wait()
            await ctl.aclose()

    dropped = asyncio.run(run())
    assert dropped["unauthenticated"] >= 1


def test_local_cluster_key_is_fresh_and_never_on_a_command_line(ctl: cb.Controller) -> None:
    from colobus._launch.local import LocalCluster

    assert LocalCluster(hosts=1)._key != LocalCluster(hosts=1)._key  # one per cluster
    secret = ctl._key.hex().encode()
    assert len(ctl._key) >= 32
    for host in ctl.hosts():
        assert secret not in Path(f"/proc/{host.pid}/cmdline").read_bytes()
        assert secret not in Path(f"/proc/{host.pid}/environ").read_bytes()
