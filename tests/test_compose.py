"""The docker-compose simulation, for real: a driver and three worker containers.

Builds the image (offline where needed: a base image from Debian's packages,
wheels from the host; see docker/), then trains with docker-compose.yml under
Compose v2 (``docker compose``) and under v1 (``docker-compose``, Debian's
1.29: no top-level ``name:``, ``deploy.replicas`` ignored), each where it is
installed (``.ci/docker-engine`` installs both), and breaks it under v2 (v1
where v2 is missing): a worker container killed mid-training, another cut off the
network and put back. Skipped, with the reason, where no Docker engine runs
(``.ci/run`` starts one where it can). All traffic stays between containers on
this machine.
"""

from __future__ import annotations

import collections.abc
import os
import subprocess
import time
from pathlib import Path

import early
import pytest
from composeimage import IMAGE, ROOT, _compose_commands, _engine_missing, _run

from colobus._wire.keys import write_key

HOST_LOST_STATUS = 3  # the example driver's status after a lost host (colobus._tools.demo)

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def image() -> str:
    """The image, built once per run: started with the session, beside the tests
    (tests/early.py; docker's layer cache makes a rebuild quick). Its base's tag."""
    reason = _engine_missing()
    if reason:
        pytest.skip(reason)
    built = early.result("compose-image", timeout=2400)
    if built.returncode != 0:
        raise AssertionError(f"building the image failed ({built.returncode}):\n"
                             f"{built.stdout[-3000:]}\n{built.stderr[-3000:]}")
    return built.stdout.split()[-1]


class Compose:
    """One compose project of the repository's file, torn down in finally."""

    def __init__(self, tmp: Path, base: str, compose: list[str]) -> None:
        self.project = f"colobusci{os.getpid()}"
        key = tmp / "colobus.key"
        write_key(key)
        # The key file: the repository's ./colobus.key is the user's, so the test's
        # own comes in through an override file (a secret all the same).
        override = tmp / "override.yml"
        override.write_text(
            "services:\n  driver:\n    secrets: [colobus_key]\n"
            f"secrets:\n  colobus_key:\n    file: {key}\n")
        self.argv = [*compose, "-p", self.project, "-f", str(ROOT / "docker-compose.yml"),
                     "-f", str(override)]
        self.env = dict(os.environ, COLOBUS_BASE_IMAGE=base)

    def __call__(self, *args: str, timeout: float = 300, check: bool = True,
                 steps: int = 20) -> subprocess.CompletedProcess[str]:
        env = dict(self.env, COLOBUS_STEPS=str(steps))
        return _run(*self.argv, *args, timeout=timeout, check=check, env=env)

    def containers(self, service: str) -> list[str]:
        out = _run("docker", "ps", "-aq", "--no-trunc",
                   "--filter", f"label=com.docker.compose.project={self.project}",
                   "--filter", f"label=com.docker.compose.service={service}").stdout
        return sorted(out.split())

    def network(self) -> str:
        return f"{self.project}_default"

    def down(self) -> None:
        self("down", "-t", "2", "--remove-orphans", check=False, timeout=120)


def _compose(image: str, tmp: Path, version: str | None) -> collections.abc.Iterator[Compose]:
    commands = _compose_commands()
    if version is not None and version not in commands:
        pytest.skip(f"Compose {version} is not installed (.ci/docker-engine installs it)")
    c = Compose(tmp, image, commands[version or next(iter(commands))])
    try:
        yield c
    finally:
        c.down()


@pytest.fixture
def compose(image: str, tmp_path: Path) -> collections.abc.Iterator[Compose]:
    """The compose project under the preferred Compose (v2, else v1)."""
    yield from _compose(image, tmp_path, None)


@pytest.fixture(params=["v2", "v1"])
def each_compose(request: pytest.FixtureRequest, image: str,
                 tmp_path: Path) -> collections.abc.Iterator[Compose]:
    """The compose project under each Compose version in turn."""
    yield from _compose(image, tmp_path, request.param)


def _logs(container: str) -> str:
    proc = _run("docker", "logs", container, check=False)
    return proc.stdout + proc.stderr


def _wait_for_log(container: str, text: str, timeout: float, count: int = 1) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = _logs(container)
        if logs.count(text) >= count:
            return logs
        time.sleep(0.5)
    raise AssertionError(f"{text!r} x{count} not in the logs of {container[:12]} within "
                         f"{timeout} s:\n{_logs(container)[-3000:]}")


def _wait_exit(container: str, timeout: float) -> int:
    return int(_run("docker", "wait", container, timeout=timeout).stdout.strip())


def test_compose_trains_on_three_worker_containers(each_compose: Compose) -> None:
    compose = each_compose
    t0 = time.monotonic()
    proc = compose("up", "--no-build", "--scale", "worker=3", "--abort-on-container-exit",
                   "--exit-code-from", "driver", steps=20, timeout=600, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "trained 20 steps on 3 hosts x 4 devices" in out, out[-4000:]
    # Workers take SIGTERM as PID 1: --abort-on-container-exit ends in seconds,
    # not after docker's 10 s grace and a SIGKILL.
    assert "exited with code 137" not in out
    assert time.monotonic() - t0 < 300


def test_killed_worker_container_stops_the_driver_cleanly(compose: Compose) -> None:
    compose("up", "-d", "--no-build", "--scale", "worker=3", steps=10**6)
    [driver] = compose.containers("driver")
    workers = compose.containers("worker")
    assert len(workers) == 3
    _wait_for_log(driver, "host 2: ", 180)  # all three joined; training runs
    time.sleep(2)
    _run("docker", "kill", workers[0])
    status = _wait_exit(driver, 90)
    logs = _logs(driver)
    assert status == HOST_LOST_STATUS, logs[-3000:]
    assert f"'{workers[0][:12]}-1') was lost" in logs, logs[-3000:]
    assert "stopping:" in logs and "Traceback" not in logs
    # The other workers leave on SIGTERM (PID 1 in their containers), with status 0,
    # long before docker's grace period would end in a SIGKILL (status 137).
    t0 = time.monotonic()
    compose("stop", "-t", "30", timeout=120)
    assert time.monotonic() - t0 < 20.0, "a worker waited for SIGKILL"
    for w in workers[1:]:
        assert _run("docker", "inspect", "-f", "{{.State.ExitCode}}", w).stdout.strip() == "0"
        assert "SIGTERM; worker exits" in _logs(w)


def test_network_cut_worker_is_lost_then_rejoins_the_next_driver(compose: Compose) -> None:
    compose("up", "-d", "--no-build", "--scale", "worker=3", steps=10**6)
    [driver] = compose.containers("driver")
    cut = compose.containers("worker")[1]
    _wait_for_log(driver, "host 2: ", 180)
    time.sleep(2)
    _run("docker", "network", "disconnect", compose.network(), cut)
    try:
        status = _wait_exit(driver, 90)
        logs = _logs(driver)
        assert status == HOST_LOST_STATUS, logs[-3000:]
        # Lost by its silence, or sooner by its connection closing (ZeroMQ's heartbeats
        # close a cut link within the link timeout): either way, for the cut.
        assert (f"'{cut[:12]}-1') was lost: no message for" in logs
                or f"'{cut[:12]}-1') was lost: its connection closed" in logs), logs[-3000:]
    finally:
        _run("docker", "network", "connect", compose.network(), cut)
    # Back on the network, the worker joins the next driver with the others.
    _run("docker", "start", driver)
    logs = _wait_for_log(driver, "host 2: ", 180, count=2)
    second = logs[logs.rindex("colobus: training"):]
    assert f"'{cut[:12]}-1'" in second, second[-3000:]


def test_image_without_the_key_secret_says_keygen(image: str) -> None:
    secret = "/run/secrets/colobus_key"
    for command in (["colobus", "worker", "--connect", "tcp://driver:5555", "--key-file", secret],
                    ["python", "examples/async_training_loop.py", "--bind", "tcp://0.0.0.0:5555",
                     "--hosts", "1", "--key-file", secret]):
        proc = _run("docker", "run", "--rm", "--network", "none", IMAGE, *command,
                    check=False, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert "colobus keygen colobus.key" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
