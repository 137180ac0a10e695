"""The examples, ``colobus demo`` and the docker-compose deployment.

The examples and the demo run as real subprocesses with short settings. Docker
cannot run here, so the compose file is checked by parsing its commands with
the very argument parsers they end up in, and the same driver and worker
commands run on the network-namespace bed (``tests/netbed.py``): the driver in
the root namespace, each worker in a namespace of its own with its own address.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from colobus._tools.cli import build_parser as cli_parser

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SECRET_PATH = "/run/secrets/colobus_key"
TIMEOUT = 180


def _compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parse(parser: Any, argv: list[str]) -> Any:
    """argparse exits on a bad option; turn that into a test failure naming the command."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{parser.prog} rejects {argv}: exit {exc.code}")


def _run(args: list[str], timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (
        f"{args} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}")
    return proc


_HOST_LINE = re.compile(r"^host (\d+): '([^']*)', pid (\d+) on (\S+), (\d+) cpu devices$", re.M)


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie has no command line left
        return Path(f"/proc/{pid}/cmdline").read_bytes() == b""
    except OSError:
        return True


def _set_options(argv: list[str], values: dict[str, str]) -> list[str]:
    """``argv`` with the value after each option in ``values`` replaced (all must occur)."""
    out = list(argv)
    for option, value in values.items():
        out[out.index(option) + 1] = value
    return out


# -- the compose file -----------------------------------------------------------------------


def _driver_argv(command: list[str]) -> list[str]:
    assert command[:2] == ["python", "examples/async_training_loop.py"], command
    assert (ROOT / command[1]).is_file()
    # "${VAR:-default}" as Compose (v1 and v2) expands it with VAR unset.
    return [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", c) for c in command[2:]]


def _replicas(worker: dict[str, Any]) -> int:
    """The workers' replicas, with ``${VAR:-default}`` expanded as Compose does (VAR unset)."""
    return int(re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(worker["deploy"]["replicas"])))


def test_compose_worker_command_uses_real_cli_options() -> None:
    worker = _compose()["services"]["worker"]
    command = [str(c) for c in worker["command"]]
    assert command[0] == "colobus"
    args = _parse(cli_parser(), command[1:])
    assert args.command == "worker"
    assert args.connect == "tcp://driver:5555"
    assert args.devices == 4
    assert args.key_file == SECRET_PATH
    assert _replicas(worker) >= 2


def test_compose_driver_runs_the_training_example() -> None:
    compose = _compose()
    driver = compose["services"]["driver"]
    example = _load_example("async_training_loop")
    args = _parse(example.build_parser(), _driver_argv([str(c) for c in driver["command"]]))
    assert args.bind == "tcp://0.0.0.0:5555"
    assert args.key_file == SECRET_PATH
    # The driver waits for exactly the workers compose starts: one variable sets both.
    assert args.hosts == _replicas(compose["services"]["worker"])
    hosts = [str(c) for c in driver["command"]]
    hosts_arg = hosts[hosts.index("--hosts") + 1]
    assert hosts_arg == str(compose["services"]["worker"]["deploy"]["replicas"]), hosts_arg
    assert hosts_arg.startswith("${COLOBUS_HOSTS:-"), hosts_arg
    # Workers reach the driver by its service name on the bound port.
    port = args.bind.rsplit(":", 1)[1]
    worker_connect = compose["services"]["worker"]["command"]
    assert f"tcp://driver:{port}" in worker_connect


def test_compose_key_is_a_secret_file_not_inline() -> None:
    compose = _compose()
    secret = compose["secrets"]["colobus_key"]
    assert set(secret) == {"file"}, "the key must come from a file made by `colobus keygen`"
    assert not Path(secret["file"]).is_absolute()
    ignored = (ROOT / ".gitignore").read_text().split()
    assert Path(secret["file"]).name in ignored
    assert Path(secret["file"]).name in (ROOT / ".dockerignore").read_text().split()
    for name, service in compose["services"].items():
        assert service["secrets"] == ["colobus_key"], name
        env = service.get("environment") or {}
        assert not any("KEY" in str(k).upper() for k in env), name
    text = (ROOT / "docker-compose.yml").read_text()
    assert not re.search(r"\b[0-9a-fA-F]{32,}\b", text), "something key-like is written inline"


def test_dockerfile_installs_the_project() -> None:
    text = (ROOT / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines()]
    # The base users pull by default; CI passes another (docker/build-base).
    assert "ARG BASE=python:3.11-slim" in lines
    assert lines.count("FROM ${BASE}") == 1 and "FROM ${BASE} AS deps" in lines
    install = next(i for i, ln in enumerate(lines) if ln.startswith("RUN pip install"))
    assert lines[install].split("&&")[0].strip().endswith(" .")
    # Dependencies come in a layer before the package's code.
    assert lines.index("COPY --from=deps /opt/colobus /opt/colobus") < lines.index(
        "COPY colobus ./colobus") < install
    assert "COPY examples ./examples" in lines  # the driver runs an example
    for service in _compose()["services"].values():
        assert service["build"]["args"]["BASE"] == "${COLOBUS_BASE_IMAGE:-python:3.11-slim}"
    assert "name" not in _compose(), "Compose v1 (1.29) rejects a top-level name"


def test_example_parser_matches_the_demo_cli() -> None:
    """``colobus demo`` options are a subset of the example's, with the same defaults."""
    example = _load_example("async_training_loop").build_parser().parse_args([])
    demo = _parse(cli_parser(), ["demo"])
    # The example leaves --hosts and --devices unset (None) so that under `colobus launch`
    # the launch's size wins; outside one, main() makes them 2 and 4 (colobus/_tools/demo.py).
    assert (example.hosts, example.devices) == (None, None)
    example.hosts, example.devices = 2, 4
    for name in ("hosts", "devices", "steps"):
        assert getattr(demo, name) == getattr(example, name), name


# -- the examples and the demo, for real ------------------------------------------------------


def test_sync_script_runs() -> None:
    proc = _run([str(EXAMPLES / "sync_script.py"), "--steps", "10"])
    assert "step 10: loss per host [" in proc.stdout
    error = float(re.search(r"done: max \|w - w_true\| = ([0-9.]+)", proc.stdout).group(1))
    assert error < 0.1


def test_jax_job_dataloader_runs() -> None:
    proc = _run([str(EXAMPLES / "jax_job_dataloader.py"), "--steps", "10", "--devices", "2"])
    lines = proc.stdout.splitlines()
    assert "2 hosts in one JAX job: formed" in lines
    assert "step 10: global batch (32, 4), loss " in proc.stdout  # every host's rows
    assert "checkpoint: process_0-of-2.json, process_1-of-2.json" in lines
    done = re.search(r"done: max \|w - w_true\| = ([0-9.]+); restored batch equal: (\w+)",
                     proc.stdout)
    assert done is not None and float(done.group(1)) < 0.1 and done.group(2) == "True"


def test_objects_reference_runs() -> None:
    proc = _run([str(EXAMPLES / "objects_reference.py")])
    lines = proc.stdout.splitlines()
    assert "before: 'The cat sat on the mat' -> [0, 1, 2, -1, 0, -1]" in lines
    assert "vocabulary size on every host: 5" in lines
    assert "after:  'The cat sat on the mat' -> [0, 1, 2, 3, 0, 4]" in lines


def test_async_training_loop_runs(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    proc = _run([str(EXAMPLES / "async_training_loop.py"), "--steps", "5", "--hosts", "2",
                 "--devices", "2", "--checkpoint-dir", str(ckpt)])
    out = proc.stdout
    assert len(_HOST_LINE.findall(out)) == 2
    assert "trained 5 steps on 2 hosts x 2 devices" in out
    m = re.search(r"loss ([0-9.]+) -> ([0-9.]+)", out)
    assert m and float(m.group(2)) < float(m.group(1))
    m = re.search(r"checkpoints: (\d+) saves on every host, [0-9.]+ ms of saving, "
                  r"[0-9.]+ ms hidden behind training \((\d+)%\)", out)
    assert m, out
    assert int(m.group(1)) == 5  # default: a save every steps // 4 = 1 steps
    assert "step 5/5 | loss" in proc.stderr  # the progress line
    # Both hosts share this machine's directory: the newest two saves, no temp files.
    assert sorted(os.listdir(ckpt)) == ["step_000004.npy", "step_000005.npy"]


def test_accelerator_training_runs_on_cpu_and_says_so(tmp_path: Path) -> None:
    proc = _run([str(EXAMPLES / "accelerator_training.py"), "--steps", "6", "--hosts", "1",
                 "--checkpoint-every", "3", "--checkpoint-dir", str(tmp_path)])
    assert "no accelerator here: CPU devices stand in" in proc.stdout
    assert "waited with block_until_ready" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["host0-step3.npy", "host0-step6.npy"]


def test_every_example_is_run_here() -> None:
    text = Path(__file__).read_text()
    for example in EXAMPLES.glob("*.py"):
        assert f'"{example.name}"' in text, f"{example.name} has no test in {__file__}"


def test_demo_exits_cleanly_and_reaps_its_workers() -> None:
    proc = _run(["-m", "colobus", "demo", "--steps", "5", "--devices", "2"])
    hosts = _HOST_LINE.findall(proc.stdout)
    assert [h[0] for h in hosts] == ["0", "1"]  # 2 hosts unless told
    assert "trained 5 steps on 2 hosts x 2 devices" in proc.stdout
    pids = [int(h[2]) for h in hosts]
    assert os.getpid() not in pids
    # local_cluster reaps its workers before the demo returns: none may outlive it.
    alive = [p for p in pids if not _pid_gone(p)]
    assert not alive, f"demo left worker processes behind: {alive}"


# -- the same commands on separate hosts: the network-namespace bed ---------------------------


@pytest.mark.netns
def test_compose_commands_on_netns_hosts() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        import netbed
    finally:
        sys.path.pop(0)
    reason = netbed.unavailable_reason()
    if reason:
        pytest.skip(reason)
    compose = _compose()
    worker_cmd = [str(c) for c in compose["services"]["worker"]["command"]]
    worker_args = _parse(cli_parser(), worker_cmd[1:])
    driver_argv = _driver_argv([str(c) for c in compose["services"]["driver"]["command"]])

    with netbed.NetBed(hosts=2) as bed:
        port = bed.free_port()

        # Only what compose's network and secret store provide differs here (and the
        # bed has 2 hosts; fewer steps keep the test short).
        argv = _set_options(driver_argv, {"--bind": f"tcp://0.0.0.0:{port}", "--hosts": "2",
                                          "--steps": "6", "--key-file": bed.key_file})
        driver = subprocess.Popen([sys.executable, str(EXAMPLES / "async_training_loop.py"),
                                   *argv], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
        try:
            connect = worker_args.connect.replace("driver", bed.controller_ip).replace(
                ":5555", f":{port}")
            workers = [bed.start_worker(i, connect, devices=worker_args.devices,
                                        key_file=bed.key_file) for i in range(2)]
            out, err = driver.communicate(timeout=TIMEOUT)
        finally:
            if driver.poll() is None:
                driver.kill()
                driver.wait()
        assert driver.returncode == 0, f"driver exited {driver.returncode}\n{out}\n{err[-4000:]}"
        hosts = _HOST_LINE.findall(out)
        # The driver ran on exactly the two namespace workers, 4 devices each.
        assert sorted(int(h[2]) for h in hosts) == sorted(w.pid for w in workers)
        assert all(h[4] == "4" for h in hosts)
        assert "trained 6 steps on 2 hosts x 4 devices" in out
        # Workers outlive their driver (they wait for the next one); the bed stops them.
        time.sleep(0.2)
        assert all(w.poll() is None for w in workers)
