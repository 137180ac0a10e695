"""``colobus launch``: workers started for a driver whose ``cb.Controller()`` reads the
environment; the driver's exit status passes through; nothing outlives the run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from nsprocs import processes_with, run_cli
from sshbed import SshBed

HERE = os.path.dirname(os.path.abspath(__file__))

DRIVER = textwrap.dedent("""
    import os, socket, stat, sys
    import numpy as np
    import colobus as cb

    @cb.colocated_python
    def where(x):
        print("ran on", socket.gethostname(), flush=True)
        return x * 0 + os.getpid()

    key_file = os.environ["COLOBUS_KEY_FILE"]
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(key_file)).st_mode) == 0o700
    with cb.Controller() as ctl:
        hosts = ctl.hosts()
        assert len(hosts) == int(os.environ["COLOBUS_HOSTS"])
        mesh = cb.Mesh(np.array([h.devices[0] for h in hosts]), ("h",))
        x = cb.device_put(np.zeros(len(hosts), np.int64),
                          cb.NamedSharding(mesh, cb.PartitionSpec("h")))
        got = cb.device_get(where(x).result(timeout=60)).result(timeout=60)
        assert got.tolist() == [h.pid for h in hosts], (got, hosts)
        print("DRIVER", ctl.address, [h.name for h in hosts], [h.address for h in hosts],
              [h.pid for h in hosts], flush=True)
    sys.exit(int(sys.argv[1]))
""")


def launch(args: list[str], driver: Path, status: int, timeout: float = 240
           ) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLOBUS_LOG_LEVEL="INFO")
    env.pop("COLOBUS_KEY_FILE", None)
    env.pop("COLOBUS_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "colobus", "launch", *args, "--",
                           sys.executable, str(driver), str(status)],
                          capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=driver.parent)


def driver_line(out: str) -> list[str]:
    (line,) = [ln for ln in out.splitlines() if ln.startswith("DRIVER ")]
    return line.split(" ", 2)


def test_launch_local_runs_the_driver_on_all_hosts_and_passes_its_status(
        tmp_path: Path) -> None:
    driver = tmp_path / "drv.py"
    driver.write_text(DRIVER)
    out = launch(["local", "--hosts", "3", "--devices", "2"], driver, 7)
    assert out.returncode == 7, out.stderr[-3000:]
    _, address, rest = driver_line(out.stdout)
    assert address.startswith("ipc://")
    assert "['local-0', 'local-1', 'local-2']" in rest
    for i in range(3):
        assert f"[host {i}] ran on" in out.stderr, out.stderr[-3000:]
    # The key file and its directory are gone, and so are the workers.
    assert not os.path.exists(address[len("ipc://"):].rsplit("/", 1)[0])
    assert processes_with("colobus", "worker", address) == []


INIT_DRIVER = textwrap.dedent("""
    import os, sys
    import numpy as np
    import colobus as cb

    @cb.colocated_python
    def pid(x):
        return x * 0 + os.getpid()

    ctl = cb.init(hosts=5)  # under colobus launch: the launched workers, not 5 local ones
    (h,) = ctl.hosts()
    got = cb.device_get(pid(cb.device_put(np.zeros(1), h.devices[0])).result(60)).result(60)
    assert got.tolist() == [h.pid], (got, h)
    print("DRIVER", ctl.address, [h.name], [h.pid], flush=True)
    sys.exit(int(sys.argv[1]))
""")


def test_launch_local_init_joins_the_launched_workers(tmp_path: Path) -> None:
    driver = tmp_path / "drv.py"
    driver.write_text(INIT_DRIVER)
    out = launch(["local", "--hosts", "1"], driver, 0)
    assert out.returncode == 0, out.stderr[-3000:]
    _, address, rest = driver_line(out.stdout)
    assert address.startswith("ipc://") and rest.startswith("['local-0']")


PY_MODULE_DRIVER = textwrap.dedent("""
    import os, sys
    import numpy as np
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
    import colobus as cb
    from launchedpkg import twice

    ctl = cb.init(hosts=1, ship_code=False)  # only what --py-module names travels
    (h,) = ctl.hosts()
    got = cb.device_get(twice(cb.device_put(np.ones(1), h.devices[0])).result(60)).result(60)
    assert got.tolist() == [2.0] and ctl.stats()["packages_sent"] == 1, (got, ctl.stats())
    print("DRIVER", ctl.address, [h.name], flush=True)
""")


def test_launch_py_module_ships_a_package_the_hosts_lack(tmp_path: Path) -> None:
    out = run_cli(["launch", "local", "--py-module", str(tmp_path / "nowhere"), "--", "true"])
    assert out.returncode == 2 and "--py-module" in out.stderr and "nowhere" in out.stderr
    pkg = tmp_path / "lib" / "launchedpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "import colobus as cb\n\n\n@cb.colocated_python\ndef twice(x):\n    return x * 2\n")
    driver = tmp_path / "drv.py"
    driver.write_text(PY_MODULE_DRIVER)
    out = launch(["local", "--hosts", "1", "--py-module", str(pkg)], driver, 0)
    assert out.returncode == 0, out.stderr[-3000:]
    assert driver_line(out.stdout)[2].startswith("['local-0']")


def test_launch_without_a_driver_command_is_a_usage_error() -> None:
    out = run_cli(["launch", "local"])  # the command's entry point, in this process
    assert out.returncode == 2 and "no driver command" in out.stderr


def ssh_options(ssh_bed: SshBed) -> list[str]:
    return [*(f"--ssh-arg={a}" for a in ssh_bed.ssh_args()), "--python", sys.executable,
            "--env", f"PYTHONPATH={HERE}"]


@pytest.mark.netns
def test_launch_ssh_runs_the_driver_on_the_hosts(ssh_bed: SshBed, tmp_path: Path) -> None:
    driver = tmp_path / "drv.py"
    driver.write_text(DRIVER)
    out = launch(["ssh", *ssh_bed.addresses, "--devices", "2", *ssh_options(ssh_bed)], driver, 3)
    assert out.returncode == 3, out.stderr[-3000:]
    _, address, rest = driver_line(out.stdout)
    assert address.startswith(f"tcp://{ssh_bed.controller_ip}:")
    assert "'sshbed-0', 'sshbed-1'" in rest  # the hosts' names: they ran in the namespaces
    for i in range(2):
        assert f"[host {i}] ran on sshbed-{i}" in out.stderr, out.stderr[-3000:]
    # Their ssh sessions ended with the run: the far sides' workers follow within seconds.
    deadline = time.monotonic() + 15
    while processes_with("colobus", "worker", address):
        assert time.monotonic() < deadline, "a worker outlived colobus launch"
        time.sleep(0.05)


@pytest.mark.netns
def test_launch_ssh_refused_login_ends_the_run_naming_the_host(ssh_bed: SshBed,
                                                              tmp_path: Path) -> None:
    driver = tmp_path / "drv.py"
    driver.write_text(DRIVER)
    args = [f"--ssh-arg={a}" for a in ssh_bed.ssh_args(identity=ssh_bed.other_identity())]
    t0 = time.monotonic()
    out = launch(["ssh", *ssh_bed.addresses, *args, "--python", sys.executable], driver, 0)
    assert time.monotonic() - t0 < 60
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Permission denied (publickey)" in out.stderr
    assert "the driver was stopped" in out.stderr
    assert any(f"{ip!r} (ssh host {i})" in out.stderr for i, ip in enumerate(ssh_bed.addresses))


SLEEPER = textwrap.dedent("""
    import time
    import colobus as cb
    with cb.Controller() as ctl:
        print("READY", ctl.address, flush=True)
        time.sleep(300)
""")


def test_sigterm_to_colobus_launch_reaches_the_driver_and_stops_the_workers(
        tmp_path: Path) -> None:
    import signal

    driver = tmp_path / "sleeper.py"
    driver.write_text(SLEEPER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLOBUS_")}
    with subprocess.Popen([sys.executable, "-m", "colobus", "launch", "local", "--hosts", "2",
                           "--", sys.executable, str(driver)],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                          env=env) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()  # the driver's controller is up, workers joined
            assert line.startswith("READY "), line
            address = line.split()[1]
            assert len(processes_with("colobus", "worker", address)) == 2
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 128 + signal.SIGTERM  # the driver's end, passed on
            assert processes_with("colobus", "worker", address) == []
            assert processes_with(str(driver)) == []
        finally:
            if proc.poll() is None:
                proc.kill()
