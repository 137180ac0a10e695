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
        got = cb.device_get(where(x))
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

    def parent(pid):
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])

    for misuse in (lambda: cb.init(hosts=5), lambda: cb.local_cluster(devices_per_host=4),
                   lambda: cb.local_cluster(hosts=1, devices_per_host=2)):
        try:
            misuse()
        except ValueError as exc:
            print("REFUSED", exc, flush=True)
    # What the launch says is no contradiction; a local cluster's own workers would be
    # this process's children, behind an address of their own.
    with cb.local_cluster(hosts=2, devices_per_host=2, transport="tcp") as ctl:
        assert ctl.address == os.environ["COLOBUS_ADDRESS"], ctl.address
        hosts = ctl.hosts()
        assert [len(h.devices) for h in hosts] == [2, 2], hosts
        assert all(parent(h.pid) != os.getpid() for h in hosts), hosts
        mesh = cb.Mesh(np.array([h.devices[0] for h in hosts]), ("h",))
        x = cb.device_put(np.zeros(2), cb.NamedSharding(mesh, cb.PartitionSpec("h")))
        assert cb.device_get(pid(x)).tolist() == [h.pid for h in hosts]
    ctl = cb.init()
    print("DRIVER", ctl.address, [h.name for h in ctl.hosts()], flush=True)
    sys.exit(int(sys.argv[1]))
""")


def test_launch_local_serves_local_cluster_and_init_with_the_launched_workers(
        tmp_path: Path) -> None:
    """Under ``colobus launch``, a script's ``local_cluster``/``init`` start no workers of
    their own, and arguments that contradict the launch stop with a ValueError."""
    driver = tmp_path / "drv.py"
    driver.write_text(INIT_DRIVER)
    out = launch(["local", "--hosts", "2", "--devices", "2"], driver, 0)
    assert out.returncode == 0, out.stderr[-3000:]
    _, address, rest = driver_line(out.stdout)
    assert address.startswith("ipc://") and rest.startswith("['local-0', 'local-1']")
    refused = [ln for ln in out.stdout.splitlines() if ln.startswith("REFUSED ")]
    assert len(refused) == 3, out.stdout
    assert refused[0].startswith("REFUSED cb.init(hosts=5) contradicts `colobus launch`")
    assert "cb.local_cluster(devices_per_host=4) contradicts" in refused[1]
    assert "cb.local_cluster(hosts=1) contradicts" in refused[2]
    assert all("2 worker(s) with 2 device(s) each" in line for line in refused)
    assert "joined: 'local-0'" not in out.stderr  # not a terminal: the join lines stay INFO


SELF_BINDING_DRIVER = textwrap.dedent("""
    import sys
    import colobus as cb

    # The README's remote form: an address of its own, where no launched worker connects.
    with cb.Controller(bind="tcp://127.0.0.1:5999", hosts=1, join_timeout=600,
                       key=b"k" * 32) as ctl:
        print("DRIVER joined", flush=True)
    sys.exit(int(sys.argv[1]))
""")


def test_launch_of_a_driver_that_binds_its_own_address_fails_naming_both(
        tmp_path: Path) -> None:
    """A driver under ``colobus launch`` that binds an address of its own fails at once,
    naming ``colobus launch`` and both addresses, instead of both sides waiting for the
    join timeout (10 minutes here) without a word."""
    driver = tmp_path / "drv.py"
    driver.write_text(SELF_BINDING_DRIVER)
    out = launch(["local", "--hosts", "1"], driver, 0, timeout=100)
    assert out.returncode != 0 and "DRIVER joined" not in out.stdout, out.stderr[-3000:]
    assert ("ValueError: cb.Controller(bind='tcp://127.0.0.1:5999') runs under `colobus "
            "launch`") in out.stderr, out.stderr[-3000:]
    (line,) = [ln for ln in out.stderr.splitlines() if ln.startswith("ValueError: ")]
    assert "'ipc://" in line and "controller.sock' ($COLOBUS_ADDRESS)" in line, line
    # This launch's own address: other tests running beside this one launch workers too.
    address = line.split("'ipc://", 1)[1].split("'", 1)[0]
    assert processes_with("colobus", "worker", address) == []


def test_launch_on_a_terminal_shows_a_line_per_host_as_it_joins(tmp_path: Path) -> None:
    """The driver sets up no logging; on a terminal its joins show anyway."""
    import pty

    driver = ("import colobus as cb\n"
              "with cb.Controller() as ctl: print('DRIVER', len(ctl.hosts()))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLOBUS_")}
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "colobus", "launch", "local", "--hosts",
                                 "2", "--", sys.executable, "-c", driver],
                                stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env,
                                cwd=tmp_path)
    finally:
        os.close(slave)
    seen = b""
    try:
        while chunk := os.read(master, 4096):
            seen += chunk
    except OSError:  # EIO: every writer closed the terminal
        pass
    finally:
        os.close(master)
    assert proc.wait(timeout=120) == 0, seen.decode(errors="replace")
    text = seen.decode(errors="replace")
    for i in range(2):
        assert f"host {i} joined: 'local-{i}'" in text, text
    assert "DRIVER 2" in text


PY_MODULE_DRIVER = textwrap.dedent("""
    import os, sys
    import numpy as np
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
    import colobus as cb
    from launchedpkg import twice

    ctl = cb.init(hosts=1, ship_code=False)  # only what --py-module names travels
    (h,) = ctl.hosts()
    got = cb.device_get(twice(cb.device_put(np.ones(1), h.devices[0])))
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


def test_launch_jax_distributed_tells_the_drivers_controller(tmp_path: Path) -> None:
    """``--jax-distributed`` sets ``$COLOBUS_JAX_DISTRIBUTED=1``: the driver's
    ``cb.Controller()`` forms a JAX job of the hosts (docs/jax_job.md)."""
    driver = tmp_path / "drv.py"
    driver.write_text(textwrap.dedent("""
        import os, sys
        import colobus as cb
        ctl = cb.Controller()  # (not started: what it was told is enough)
        print("DRIVER", os.environ.get("COLOBUS_JAX_DISTRIBUTED"), ctl._job is not None,
              flush=True)
    """))
    out = launch(["local", "--hosts", "1", "--jax-distributed"], driver, 0)
    assert out.returncode == 0, out.stderr[-3000:]
    assert driver_line(out.stdout)[1:] == ["1", "True"], out.stdout


def test_launch_parses_the_view() -> None:
    """``--jax-distributed`` insists on a job, ``--no-jax-distributed`` keeps the block
    view, neither leaves the default (``$COLOBUS_JAX_DISTRIBUTED`` 1, 0 or unset)."""
    import argparse

    from colobus._launch.cli import add_launch_parsers

    parser = argparse.ArgumentParser()
    add_launch_parsers(parser.add_subparsers(dest="command"), int)
    for flags, want in ((["--jax-distributed"], True), (["--no-jax-distributed"], False),
                        ([], None)):
        args = parser.parse_args(["launch", "local", "--hosts", "2", *flags])
        assert args.jax_distributed is want, flags


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
