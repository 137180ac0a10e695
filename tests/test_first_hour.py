"""A newcomer's first hour: the README's commands as written, messages that name the
mistake (each misused command run for real), the docs' claims about ports checked
against running workers, and the command line's quick commands without JAX."""

from __future__ import annotations

import asyncio
import http.server
import io
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from nsprocs import run_cli

import colobus as cb
from colobus._wire.keys import key_id

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(sys.executable).parent / "colobus"


def _colobus(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
             cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The installed console script, as a user runs it."""
    assert SCRIPT.exists(), f"no console script at {SCRIPT}: pip install -e . first"
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd, stdin=subprocess.DEVNULL)


def _one_line_error(proc: subprocess.CompletedProcess[str], status: int = 2) -> str:
    assert proc.returncode == status, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


# -- the command line: quick commands, misuse named --------------------------------------


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["keygen", "KEY"]],
                         ids=["version", "help", "keygen"])
def test_the_quick_commands_do_not_import_jax(args: list[str], tmp_path: Path) -> None:
    """What they import, read off Python's own import log (`-X importtime`)."""
    args = [str(tmp_path / "k") if a == "KEY" else a for a in args]
    env = dict(os.environ, PYTHONPROFILEIMPORTTIME="1")
    proc = _colobus(*args, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:")}
    assert "colobus._tools.cli" in imported  # the log is what this run imported
    heavy = sorted(m for m in imported if m.split(".")[0] in ("jax", "jaxlib", "numpy", "zmq"))
    assert not heavy, heavy


def test_import_colobus_imports_no_jax_and_partitionspec_is_jaxs() -> None:
    code = textwrap.dedent("""
        import sys
        import colobus as cb
        assert "jax" not in sys.modules and "numpy" not in sys.modules, sorted(sys.modules)
        names = dir(cb)
        assert "PartitionSpec" in names and "local_cluster" in names
        import jax
        assert cb.PartitionSpec is jax.sharding.PartitionSpec
        from colobus import PartitionSpec, colocated_python
        assert PartitionSpec is jax.sharding.PartitionSpec and callable(colocated_python)
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_every_public_name_resolves_where_the_package_says_it_lives() -> None:
    """The names come on first use: each one in ``__all__`` must have a home there."""
    assert set(cb._WHERE) == set(cb.__all__)
    for name in cb.__all__:
        value = getattr(cb, name)
        if name != "PartitionSpec":  # (JAX's own class, named P in recent JAX)
            assert getattr(value, "__name__", name) == name, (name, value)


def test_misused_options_are_named_with_the_close_one() -> None:
    # run for real: the console script, as a user types it
    line = _one_line_error(_colobus("worker", "--conect", "tcp://127.0.0.1:9"))
    assert "--conect" in line and "did you mean --connect?" in line, line
    assert "the following arguments are required" not in line, line
    line = _one_line_error(_colobus("worker", "--connect", "tcp://127.0.0.1:9", "--key",
                                    "ab" * 32))
    assert "--key ..." in line and "did you mean --key-file?" in line, line
    assert "ab" * 32 not in line  # a value is never echoed: it could be the key
    # the same parser through the entry point: a subcommand's own options are suggested
    out = run_cli(["launch", "local", "--hots", "3", "--", "python", "x.py"])
    assert out.returncode == 2 and "did you mean --hosts?" in out.stderr, out.stderr
    out = run_cli(["top", "--metric", "http://127.0.0.1:9"])
    assert out.returncode == 2 and "did you mean --metrics?" in out.stderr, out.stderr
    assert "colobus top --help" in out.stderr


def test_launch_without_the_double_dash_names_the_command_and_says_where_it_goes() -> None:
    line = _one_line_error(_colobus("launch", "local", "--hosts", "2", "python", "train.py"))
    assert "'python' is not an option of colobus launch local" in line, line
    assert "the driver command goes after `--`" in line, line
    assert "train.py" not in line  # only the program's name is echoed


def test_demo_metrics_on_a_port_in_use_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _colobus("demo", "--hosts", "1", "--devices", "1", "--steps", "2",
                        "--metrics", f"127.0.0.1:{port}", timeout=240)
    line = _one_line_error(proc, 1)
    assert line.startswith("colobus demo: error: colobus metrics cannot listen on "
                           f"127.0.0.1:{port}"), line
    assert "in use" in line and "give another HOST:PORT" in line, line


# -- the README as written, from a shell where the venv is not activated -------------------


def test_the_readme_launch_command_runs_as_written_without_the_venv_activated(
        tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    (line,) = re.findall(r"^(\.venv/bin/colobus launch .*)$", readme, re.MULTILINE)
    words = line.split()
    assert words[words.index("--") + 1] == "python", line  # a bare python, as users write
    # The shell: no venv on PATH, and a `python` there that is not the venv's (as a
    # system Python without colobus would be); `colobus launch` must not run it.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text("#!/bin/sh\necho 'the python on PATH ran' >&2\nexit 97\n")
    (fake / "python").chmod(0o755)
    venv_bin = str(Path(sys.executable).parent)
    path = [str(fake), *(p for p in os.environ.get("PATH", "").split(os.pathsep)
                         if p and os.path.abspath(p) != venv_bin)]
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "COLOBUS_KEY_FILE", "COLOBUS_ADDRESS")}
    env.update(PATH=os.pathsep.join(path), COLOBUS_LOG_LEVEL="INFO")
    proc = subprocess.run([str(SCRIPT), *words[1:]], capture_output=True, text=True,
                          timeout=400, env=env, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "the python on PATH ran" not in proc.stderr
    assert "running the driver's 'python' as" in proc.stderr, proc.stderr[-3000:]


# -- the docs' port claims, against running workers ---------------------------------------


def _listening_tcp_ports(pid: int) -> set[tuple[str, int]]:
    """The (address, port) pairs process ``pid`` listens on, read from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                addr_hex, port_hex = cols[1].split(":")
                raw = bytes.fromhex(addr_hex)
                # /proc writes each 32-bit word in host (little-endian) order
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
                addr = socket.inet_ntop(socket.AF_INET if width == 4 else socket.AF_INET6,
                                        words)
                found.add((addr, int(port_hex, 16)))
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_ports_the_docs_name_are_the_ones_workers_listen_on(tmp_path: Path) -> None:
    docs = (ROOT / "docs" / "network.md").read_text()
    assert "open no listening port" not in docs and "Only the driver listens" not in docs
    (row,) = [ln for ln in docs.splitlines() if ln.startswith("| **each worker: its data plane")]
    assert "**one TCP port**, ephemeral by default, on the worker's interface toward the " \
           "driver" in row, row
    assert "`COLOBUS_DATA_ADDRESS=:7000`" in docs and "`COLOBUS_DATA_ADDRESS=off`" in docs

    key = cb.load_key(_keygen(tmp_path / "key"))
    address, pinned = f"tcp://127.0.0.1:{_free_port()}", _free_port()
    logs = [tmp_path / "w0.log", tmp_path / "w1.log"]
    # the workers first: they keep trying until the driver binds, which then waits for them
    with _workers(address, tmp_path / "key", logs,
                  [{}, {"COLOBUS_DATA_ADDRESS": f":{pinned}"}]), \
            cb.Controller(address, hosts=2, key=key, join_timeout=240,
                          jax_distributed=False) as ctl:
        # (the block view's listeners: a JAX job adds its collectives' own, which the
        # network docs list with the job's)
        by_name = {h.name: h for h in ctl.hosts()}
        ctl_port = int(ctl.address.rsplit(":", 1)[1])
        default = _listening_tcp_ports(by_name["port-0"].pid)
        chosen = _listening_tcp_ports(by_name["port-1"].pid)
        # one TCP port each, on the interface toward the driver; none is the driver's
        assert len(default) == 1 and len(chosen) == 1, (default, chosen)
        (addr, port), = default
        assert addr == "127.0.0.1" and port != ctl_port, default
        assert chosen == {("127.0.0.1", pinned)}, chosen
        for log_file, (a, p) in zip(logs, [(addr, port), ("127.0.0.1", pinned)], strict=True):
            lines = _read_lines(log_file, "data plane at")
            # the worker's first line: where it connects, with which key id
            assert f"connecting to {ctl.address} with key id {key_id(key)}" in lines[0], lines
            (plane,) = [ln for ln in lines if "data plane at" in ln]
            assert f"data plane at tcp://{a}:{p} " in plane, lines


@pytest.mark.parametrize(("text", "parsed"), [
    ("", ("", "*")), ("10.0.0.5", ("10.0.0.5", "*")), ("10.0.0.5:7000", ("10.0.0.5", "7000")),
    (":7000", ("", "7000")), ("[::1]:7000", ("::1", "7000")), ("::1", ("::1", "*")),
    ("tcp://node7:7001", ("node7", "7001")),
])
def test_the_data_address_forms_the_docs_name(text: str, parsed: tuple[str, str]) -> None:
    from colobus._wire.endpoint import data_address

    assert data_address(text) == parsed
    with pytest.raises(ValueError, match="the port must be 1 to 65535"):
        data_address("10.0.0.5:0")


def _keygen(path: Path) -> Path:
    assert run_cli(["keygen", str(path)]).returncode == 0
    return path


class _workers:
    """Standalone workers at INFO, each with extra environment, logging to a file."""

    def __init__(self, address: str, key_file: Path, logs: list[Path],
                 envs: list[dict[str, str]]) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        for i, (log_file, extra) in enumerate(zip(logs, envs, strict=True)):
            env = {k: v for k, v in os.environ.items()
                   if k not in ("COLOBUS_KEY_FILE", "COLOBUS_DATA_ADDRESS")}
            env.update(COLOBUS_LOG_LEVEL="INFO", COLOBUS_PARENT_PID=str(os.getpid()), **extra)
            with open(log_file, "wb") as out:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "colobus", "worker", "--connect", address,
                     "--name", f"port-{i}", "--key-file", str(key_file)],
                    env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out))

    def __enter__(self) -> _workers:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(30)


def _wait(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _read_lines(path: Path, until: str, timeout: float = 120) -> list[str]:
    """The colobus log lines of ``path``, once one holds ``until``."""
    lines: list[str] = []

    def seen() -> bool:
        lines[:] = [ln for ln in path.read_text(errors="replace").splitlines()
                    if " colobus." in ln]
        return any(until in ln for ln in lines)

    _wait(seen, timeout, f"{until!r} in {path.name}")
    return lines


# -- errors that point the right way -----------------------------------------------------


@cb.colocated_python
def _echo(x: Any) -> Any:
    return x


@cb.colocated_python_class
class _Keeper:
    def get(self, x: Any) -> Any:
        return x


def test_a_call_after_its_cluster_closed_says_the_cluster_was_closed() -> None:
    from colobus._controller.controller import _current

    saved = list(_current._stack)
    _current._stack.clear()
    try:
        with cb.Controller("tcp://127.0.0.1:*", hosts=0, key=b"k" * 32) as ctl:
            keeper = _Keeper()
        for call in (lambda: _echo(np.arange(3)), lambda: keeper.get(np.arange(3))):
            with pytest.raises(cb.ControllerClosedError) as info:
                call()
            # a call without a default controller is a NoControllerError as well (SPEC 2)
            assert isinstance(info.value, cb.NoControllerError)
            text = str(info.value)
            assert text.startswith(f"The colobus cluster in use here, {ctl!r}, was closed")
            assert "No colobus controller is running" not in text
            assert "local_cluster" in text  # and how to start another
    finally:
        _current._stack[:] = saved


# -- smaller points ----------------------------------------------------------------------


def test_the_license_is_the_apache_2_0_text_pyproject_names() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_the_index_lists_every_example() -> None:
    index = (ROOT / "docs" / "index.md").read_text()
    listed = set(re.findall(r"^\| `examples/(\w+\.py)` \|", index, re.MULTILINE))
    present = {p.name for p in (ROOT / "examples").glob("*.py")}
    assert listed == present, (listed, present)
    section = index.split("## The examples", 1)[1].split("\n## ", 1)[0]
    assert not re.search(r"\b(two|three|four|five|six) runnable", section), section


def test_a_jax_without_its_private_pytree_registry_is_a_clear_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import jax._src.tree_util

    from colobus._wire.describe import BadReply, _registered_unflatten

    class Node:
        pass

    assert _registered_unflatten(Node) is None  # not registered: the caller says so
    monkeypatch.delattr(jax._src.tree_util, "_registry")
    with pytest.raises(BadReply, match=r"JAX's pytree registry.*return a dict or tuple"):
        _registered_unflatten(Node)


def test_top_keeps_the_last_figures_marked_stale_when_the_endpoint_goes() -> None:
    from rich.console import Console

    from colobus._observe.top import Watch

    text = (b'colobus_host_up{host="0",name="node-a"} 1\n'
            b'colobus_calls_started_total{function="train_step"} 1234\n')

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    watch = Watch(f"http://127.0.0.1:{server.server_port}/metrics")

    def shown() -> str:
        console = Console(file=io.StringIO(), width=200)
        console.print(watch.view())
        out = console.file.getvalue()
        assert isinstance(out, str)
        return out

    live = shown()
    assert "1234" in live and "node-a" in live and "STALE" not in live
    server.shutdown()
    server.server_close()
    stale = shown()
    assert "STALE: last read at" in stale and "cannot read" in stale, stale
    assert "1234" in stale and "node-a" in stale, stale  # the last figures, not zeros


def test_a_controllers_own_key_file_goes_on_sigterm_and_its_timeout_says_so(
        tmp_path: Path) -> None:
    driver = textwrap.dedent("""
        import threading, time
        import colobus as cb

        try:
            with cb.Controller("tcp://127.0.0.1:*", hosts=1, join_timeout=0.5):
                pass
        except TimeoutError as exc:
            print("TIMEOUT", exc, flush=True)
        ctl = cb.Controller("tcp://127.0.0.1:*", hosts=1, join_timeout=600)

        def say():
            while ctl.key_file is None:
                time.sleep(0.02)
            print("KEYFILE", ctl.key_file, flush=True)

        threading.Thread(target=say, daemon=True).start()
        with ctl:  # waits for a host that never comes
            pass
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("COLOBUS_KEY_FILE",
                                                              "COLOBUS_ADDRESS")}
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        assert proc.stdout is not None
        timeout_line = proc.stdout.readline()
        key_line = proc.stdout.readline()
        assert timeout_line.startswith("TIMEOUT only 0 of 1"), (timeout_line, proc.stderr)
        assert "is removed as it closes now" in timeout_line, timeout_line
        assert "colobus keygen colobus.key" in timeout_line, timeout_line
        assert key_line.startswith("KEYFILE "), key_line
        key_file = Path(key_line.split(" ", 1)[1].strip())
        assert key_file.exists()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == -signal.SIGTERM  # it still ends as SIGTERM ends it
        assert not key_file.exists() and not key_file.parent.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def test_the_exit_message_for_calls_still_running_is_plain(
        caplog: pytest.LogCaptureFixture) -> None:
    from colobus._host.pool import CallPool

    pool = CallPool(2, "test-pool", hard_max=8)
    pool.hold(threading.get_ident())  # a call of this session, still running
    with caplog.at_level(logging.WARNING, logger="colobus"):
        pool.new_session()
    pool.unhold(threading.get_ident())
    assert ("1 call of the controller that has gone still runs on this host (Python cannot "
            "stop a running function; its result will be dropped)") in caplog.text
    assert "grows past" not in caplog.text and "call pool" not in caplog.text


def test_a_hosts_axis_on_one_host_is_logged_once(ctl: cb.Controller,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    from colobus._api import entry

    entry._said_one_host[0] = False
    with caplog.at_level(logging.INFO, logger="colobus.mesh"):
        spread = cb.make_mesh((2, 4), ("hosts", "devices"))  # over both hosts: nothing said
        assert not caplog.records
        mesh = cb.make_mesh((2,), ("hosts",))
        assert {d.host for d in mesh.devices.flat} == {0}  # JAX's rule: devices in order
        cb.make_mesh((2,), ("hosts",))
    (record,) = caplog.records  # once
    assert "axis 'hosts' (size 2) lies on one host, host 0" in record.getMessage()
    assert "devices=[h.devices[0] for h in ctl.hosts()]" in record.getMessage()
    assert spread.shape == {"hosts": 2, "devices": 4}


# -- colobus launch: an example at the launch's size, and what a slow join says ------------


def test_an_example_takes_the_launchs_size_and_a_slow_join_names_the_launched_workers(
        ) -> None:
    # The first progress line due at once (the workers cannot have joined yet): what the
    # driver says while the workers `colobus launch` started are still starting.
    driver = ("import runpy, sys\n"
              "import colobus._controller.joinwait as joinwait\n"
              "joinwait.FIRST_AFTER_S = 0.0\n"
              "sys.argv = ['examples/sync_script.py', '--steps', '10']\n"
              "runpy.run_path('examples/sync_script.py', run_name='__main__')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLOBUS_")}
    proc = _colobus("launch", "local", "--hosts", "3", "--", "python", "-c", driver, env=env,
                    cwd=ROOT, timeout=400)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "ValueError" not in proc.stderr
    assert re.search(r"step 10: loss per host \[[-0-9.]+, [-0-9.]+, [-0-9.]+\]", proc.stdout), \
        proc.stdout  # three replicas: the launch's three hosts
    (line,) = [ln for ln in proc.stderr.splitlines() if "waiting for hosts:" in ln][:1]
    assert "of 3 joined" in line, line
    assert "the workers `colobus launch` started are still starting" in line, line
    assert "[host N] lines" in line and "COLOBUS_LOG_LEVEL=INFO" in line, line
    assert "on each host run" not in proc.stderr and "colobus worker --connect" not in line


def test_a_worker_with_another_key_is_named_on_the_driver_with_both_key_ids(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ours, theirs = _keygen(tmp_path / "ours.key"), _keygen(tmp_path / "theirs.key")
    key = cb.load_key(ours)
    with caplog.at_level(logging.WARNING, logger="colobus.controller"):
        ctl = cb.Controller("tcp://127.0.0.1:*", hosts=1, key=key, join_timeout=600)
        ctl.start_in_thread()
        try:
            with _workers(ctl.address, theirs, [tmp_path / "w.log"], [{}]):
                _wait(lambda: any("another key" in r.getMessage() for r in caplog.records),
                      120, "the driver to name the key")
                ctl.run_sync(asyncio.sleep(1.0))  # its JOINs again: still one line
        finally:
            ctl.close()
    said = [r.getMessage() for r in caplog.records if "another key" in r.getMessage()]
    assert len(said) == 1, said
    line = said[0]
    assert f"its key id is {key_id(cb.load_key(theirs))}" in line, line
    assert f"this controller's is {key_id(key)} (key from {ours}" in line, line
    assert f"colobus worker --key-file {ours} ...)" in line, line
    assert "dropping unauthenticated messages" not in caplog.text
    assert ctl.stats()["dropped"]["unauthenticated"] >= 2
