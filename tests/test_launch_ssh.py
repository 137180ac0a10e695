"""``cb.ssh_cluster`` against real sshds, one inside each network namespace of a bed.

The workers really run in the namespaces (each reports the namespace's host
name and talks from its address); the controller's exit, a killed ssh client
and a failed start leave no worker process behind; an unreachable host and a
refused login fail within seconds naming the host and ssh's own message.
Skips (saying why) where namespaces or sshd cannot run.
"""

from __future__ import annotations

import glob
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from typing import Any

import numpy as np
import pytest
from nsprocs import alive, cmdline, processes_with, wait_until
from sshbed import SshBed

import colobus as cb

pytestmark = pytest.mark.netns

HERE = os.path.dirname(os.path.abspath(__file__))
FAST = {"heartbeat_interval": 0.2, "liveness_timeout": 3.0, "join_timeout": 90.0}


@cb.colocated_python
def source_octet(x: Any, controller_ip: str) -> Any:
    """The last octet of the address this host talks to the controller from."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((controller_ip, 9))
        ip = s.getsockname()[0]
    print(f"hello from {socket.gethostname()} at {ip}", flush=True)
    return x * 0 + int(ip.rsplit(".", 1)[1])


@cb.colocated_python
def nap(x: Any) -> Any:
    time.sleep(60)
    return x


def options(ssh_bed: SshBed, **more: Any) -> dict[str, Any]:
    """ssh_cluster arguments for the bed: its ssh files, this venv's Python, the tests dir."""
    return {"python": sys.executable, "ssh_args": ssh_bed.ssh_args(),
            "env": {"PYTHONPATH": HERE}, "cwd": os.getcwd(), **FAST, **more}


def fetch(out: Any) -> Any:
    return cb.device_get(out)  # (a call's arrays, or a Future)


def per_host(ctl: cb.Controller) -> cb.Array:
    mesh = cb.Mesh(np.array([h.devices[0] for h in ctl.hosts()]), ("h",))
    return cb.device_put(np.zeros(len(ctl.hosts()), np.int64),
                         cb.NamedSharding(mesh, cb.PartitionSpec("h")))


def test_workers_run_on_the_hosts_and_none_outlives_the_controller(
        ssh_bed: SshBed, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "colobus.launch")
    cluster = cb.ssh_cluster(ssh_bed.addresses, devices_per_host=2, **options(ssh_bed))
    with cluster as ctl:
        assert ctl.address.startswith(f"tcp://{ssh_bed.controller_ip}:")  # routed toward the hosts
        hosts = ctl.hosts()
        assert [(h.index, h.name, h.address) for h in hosts] == [
            (i, f"{ip}-{i}", f"sshbed-{i}") for i, ip in enumerate(ssh_bed.addresses)]
        assert [len(h.devices) for h in hosts] == [2, 2]
        got = fetch(source_octet(per_host(ctl), ssh_bed.controller_ip))
        assert got.tolist() == [int(ip.rsplit(".", 1)[1]) for ip in ssh_bed.addresses]
        pids = [h.pid for h in hosts]
        assert all(alive(p) for p in pids)
        # The key is on no command line, here or on the hosts.
        assert processes_with(ctl._key.hex()) == []
        ssh_procs = list(cluster.procs)
        wait_until(lambda: sum("hello from sshbed" in r.getMessage() for r in caplog.records) == 2,
                   10, "both hosts' prints to be relayed")
    relayed = [r.getMessage() for r in caplog.records if r.name == "colobus.launch.ssh"]
    for i, ip in enumerate(ssh_bed.addresses):
        assert f"[host {i}] hello from sshbed-{i} at {ip}" in relayed, relayed
    # Exit stopped every worker on the far side, and every local ssh.
    wait_until(lambda: not any(alive(p) for p in pids), 15, "the remote workers to exit")
    assert all(p.poll() is not None for p in ssh_procs)
    assert processes_with("colobus", "worker", ctl.address) == []


async def test_a_killed_ssh_client_leaves_no_worker_on_the_far_side(ssh_bed: SshBed) -> None:
    # (the block view: host 0 goes on serving calls alone; in a JAX job it would leave too)
    cluster = cb.ssh_cluster(ssh_bed.addresses, jax_distributed=False, **options(ssh_bed))
    async with cluster as ctl:
        hosts = ctl.hosts()
        x = per_host(ctl)
        await source_octet(x, ssh_bed.controller_ip)  # the hosts run calls
        on1 = cb.device_put(np.zeros(1, np.int64), hosts[1].devices[0])
        pending = nap(on1)  # a call held by host 1 (host 0 stays free for the calls below)
        ssh1 = cluster.procs[1]
        os.kill(ssh1.pid, signal.SIGKILL)  # the ssh client of host 1, mid-run
        with pytest.raises(cb.HostLostError, match=r"Host 1 .*lost its ssh session: "
                                                    r"the ssh client was killed by SIGKILL"):
            await pending
        deadline = time.monotonic() + 15
        while alive(hosts[1].pid):
            assert time.monotonic() < deadline, "the worker of a dead ssh session lives on"
            await __import__("asyncio").sleep(0.05)
        assert alive(hosts[0].pid)
        assert [h.state for h in ctl.hosts()] == ["alive", "lost"]
        d0 = ctl.hosts()[0].devices[0]
        one = cb.device_put(np.zeros(1, np.int64), d0)
        got = await cb.device_get(await source_octet(one, ssh_bed.controller_ip))
        assert got.tolist() == [int(ssh_bed.addresses[0].rsplit(".", 1)[1])]
    assert processes_with("colobus", "worker", ctl.address) == []


SHIPPED_MARK = 47  # what only this module's own code knows


@cb.colocated_python
def marked(x: Any) -> Any:
    return x * 0 + SHIPPED_MARK


def test_a_function_of_this_test_module_runs_on_hosts_that_lack_it(ssh_bed: SshBed) -> None:
    """No PYTHONPATH and another directory on the hosts: this module (and the helpers it
    imports) travels with the call."""
    opts = {**options(ssh_bed), "env": {}, "cwd": "/"}
    with cb.ssh_cluster(ssh_bed.addresses, **opts) as ctl:
        assert fetch(marked(per_host(ctl))).tolist() == [SHIPPED_MARK] * 2
        assert ctl.stats()["packages_sent"] >= 2  # this module (and nsprocs, sshbed) per host


def test_curve_over_ssh_with_keys_made_for_the_cluster_and_sent_on_stdin(
        ssh_bed: SshBed) -> None:
    cluster = cb.ssh_cluster(ssh_bed.addresses, curve=True, **options(ssh_bed))
    with cluster as ctl:
        assert ctl._curve is not None  # the controller's socket is a CurveZMQ server:
        # the workers joined and run calls, so each had its key pair and the server's key
        got = fetch(source_octet(per_host(ctl), ssh_bed.controller_ip))
        assert got.tolist() == [int(ip.rsplit(".", 1)[1]) for ip in ssh_bed.addresses]
        assert ctl._curve_allow is not None and len(ctl._curve_allow) == 2  # theirs only
        assert cluster.launcher.curve is not None  # type: ignore[attr-defined]
        secrets, _ = cluster.launcher.curve  # type: ignore[attr-defined]
        # No secret on a command line, here or on the hosts, and no secret file left.
        for secret in [*secrets, ctl._curve[1], ctl._key.hex().encode()]:
            assert processes_with(secret.decode()) == []
        assert not glob.glob(os.path.join(tempfile.gettempdir(), "colobus-curve-*"))
        workers = processes_with("colobus", "worker", ctl.address)
        assert len(workers) == 4  # two ssh clients and their workers: keys from stdin
        assert all("--curve-key-file - --server-key -" in cmdline(p) for p in workers)
    assert processes_with("colobus", "worker", ctl.address) == []


def test_restart_over_ssh_brings_a_killed_worker_back(ssh_bed: SshBed,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "colobus.launch")
    with cb.ssh_cluster(ssh_bed.addresses, restart=1, **options(ssh_bed)) as ctl:
        before = ctl.hosts()
        os.kill(before[0].pid, signal.SIGKILL)  # the worker itself, on the far side
        wait_until(lambda: ctl.hosts()[0].state == "alive" and ctl.hosts()[0].pid != before[0].pid,
                   60, "host 0 to be restarted over ssh")
        after = ctl.hosts()
        assert (after[0].name, after[0].address) == (before[0].name, "sshbed-0")
        assert [d.id for d in after[0].devices] == [d.id for d in before[0].devices]
        got = fetch(source_octet(per_host(ctl), ssh_bed.controller_ip))
        assert got.tolist() == [int(ip.rsplit(".", 1)[1]) for ip in ssh_bed.addresses]
    said = [r.getMessage() for r in caplog.records]
    assert any(f"restarting ssh host 0 ({ssh_bed.addresses[0]!r}) (restart 1 of 1)" in m
               for m in said), said


@pytest.mark.parametrize("how", ["nothing at the address", "link down"])
def test_an_unreachable_host_fails_fast_naming_it_and_stops_the_others(
        ssh_bed: SshBed, how: str) -> None:
    if how == "link down":
        bad = ssh_bed.addresses[1]
        ssh_bed.net.cut(1)
    else:
        bad = ssh_bed.controller_ip.rsplit(".", 1)[0] + ".200"  # on the bridge, nobody there
    cluster = cb.ssh_cluster([ssh_bed.addresses[0], bad], **options(ssh_bed))
    t0 = time.monotonic()
    with pytest.raises(ConnectionError) as info:
        with cluster:
            pass
    took = time.monotonic() - t0
    text = str(info.value)
    assert f"{bad!r} (ssh host 1)" in text
    assert f"ssh: connect to host {bad} port 22" in text  # ssh's own message
    assert took < 20, took
    # The reachable host's worker was stopped too (it may have started by then).
    assert cluster.procs and all(p.poll() is not None for p in cluster.procs)
    wait_until(lambda: not processes_with("colobus", "worker", cluster.controller.address),
               15, "no worker left")


def test_a_refused_login_fails_fast_naming_the_host(ssh_bed: SshBed) -> None:
    opts = options(ssh_bed)
    opts["ssh_args"] = ssh_bed.ssh_args(identity=ssh_bed.other_identity())
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=r"Permission denied \(publickey\)") as info:
        with cb.ssh_cluster(ssh_bed.addresses, **opts):
            pass
    assert time.monotonic() - t0 < 20
    assert any(f"{ip!r} (ssh host {i})" in str(info.value)
               for i, ip in enumerate(ssh_bed.addresses)), info.value


def test_ssh_cluster_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="list of ssh destinations"):
        cb.ssh_cluster("node1")
    with pytest.raises(ValueError, match="at least one host"):
        cb.ssh_cluster([], bind="tcp://127.0.0.1:*")
    with pytest.raises(ValueError, match="not an environment variable name"):
        cb.ssh_cluster(["node1"], bind="tcp://127.0.0.1:*", env={"A B": "1"})
    with pytest.raises(ValueError, match="give curve=True"):
        cb.ssh_cluster(["node1"], bind="tcp://127.0.0.1:*", curve_secret_key="server.key")


HOLDER = """
import json, signal, sys, time
# Ctrl-C in a terminal raises KeyboardInterrupt in the foreground job. A process started
# in the background of a non-interactive shell (as CI runners start the suite) inherits
# SIGINT *ignored*, and Python then keeps it ignored: the controller's process is made
# the foreground job a user presses Ctrl-C in.
signal.signal(signal.SIGINT, signal.default_int_handler)
import colobus as cb
args = json.loads(sys.argv[1])
with cb.ssh_cluster(args["hosts"], python=sys.executable, ssh_args=args["ssh_args"]) as ctl:
    print("READY", json.dumps([h.pid for h in ctl.hosts()], separators=(",", ":")),
          ctl.address, flush=True)
    time.sleep(300)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "sigkill"])
def test_the_controller_process_interrupted_or_killed_leaves_no_worker(
        ssh_bed: SshBed, tmp_path: Any, sig: int) -> None:
    import json
    import subprocess

    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    args = json.dumps({"hosts": ssh_bed.addresses, "ssh_args": ssh_bed.ssh_args()})
    proc = subprocess.Popen([sys.executable, str(script), args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the cluster is up (or the script died)
        assert line.startswith("READY "), line
        _, pids_text, address = line.split()
        pids = json.loads(pids_text)
        assert len(pids) == 2 and all(alive(p) for p in pids)
        assert len(processes_with("BatchMode=yes", address)) == 2  # the local ssh clients
        proc.send_signal(sig)
        # Ctrl-C: KeyboardInterrupt left the `with` (which stopped the workers) and ended
        # the process, which Python then reports as killed by SIGINT.
        assert proc.wait(30) == -sig
        if sig == signal.SIGINT:  # the `with` reaped the local ssh clients before the end
            assert processes_with("BatchMode=yes", address) == []
        wait_until(lambda: not any(alive(p) for p in pids), 20, "the remote workers to exit")
        wait_until(lambda: not processes_with("BatchMode=yes", address), 20,
                   "the ssh clients to exit")
        assert processes_with("colobus", "worker", address) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
