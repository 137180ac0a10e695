"""``cb.slurm_cluster`` against a real Slurm (tests/slurmbed.py: slurmctld, munged and a
slurmd per network namespace): a batch job's workers join from the nodes and the job
ends with the cluster; a job that stays pending fails with its id and Slurm's reason
and is cancelled; inside an allocation the workers are srun steps that end with it.

Skips (saying why) where the bed cannot run.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from nsprocs import wait_until
from slurmbed import HOLD_REASON, SlurmBed

import colobus as cb

pytestmark = pytest.mark.netns

HERE = os.path.dirname(os.path.abspath(__file__))
FAST = {"heartbeat_interval": 0.2, "liveness_timeout": 3.0}


@cb.colocated_python
def source_ip(x: Any, controller_ip: str) -> Any:
    """The last octet of the address this host reaches the controller from."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((controller_ip, 9))
        return x * 0 + int(s.getsockname()[0].rsplit(".", 1)[1])


def fetch_octets(ctl: cb.Controller, controller_ip: str) -> list[int]:
    hosts = ctl.hosts()
    mesh = cb.Mesh(np.array([h.devices[0] for h in hosts]), ("h",))
    x = cb.device_put(np.zeros(len(hosts), np.int64),
                      cb.NamedSharding(mesh, cb.PartitionSpec("h")))
    out = cb.block_until_ready(source_ip(x, controller_ip))
    return list(cb.device_get(out).tolist())


def node_octets(bed: SlurmBed) -> list[int]:
    return [int(h.ip.rsplit(".", 1)[1]) for h in bed.net.hosts]


@pytest.fixture
def importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs inherit the environment: the workers import this module as the test does."""
    monkeypatch.setenv("PYTHONPATH", HERE)


def test_a_batch_job_runs_the_workers_and_ends_with_the_cluster(
        slurm: SlurmBed, tmp_path: Path, importable: None,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", "colobus.launch")
    cluster = cb.slurm_cluster(nodes=2, python=sys.executable, key_dir=tmp_path,
                               join_timeout=90, **FAST)
    assert not os.environ.get("SLURM_JOB_ID")  # outside an allocation: sbatch
    with cluster as ctl:
        job = cluster.job_id  # type: ignore[attr-defined]
        assert job and slurm.job_state(job) is not None
        assert [h.name for h in ctl.hosts()] == ["slurm-0", "slurm-1"]
        assert sorted(fetch_octets(ctl, slurm.controller_ip)) == node_octets(slurm)
        key_file = cluster.key_file  # type: ignore[attr-defined]
        assert key_file.exists() and (key_file.stat().st_mode & 0o077) == 0
        output = cluster.output  # type: ignore[attr-defined]
        wait_until(output.exists, 10, "the job's output file")
        assert ctl._key.hex() not in output.read_text()
        script = cluster.script(cluster.connect_address())  # type: ignore[attr-defined]
        assert ctl._key.hex() not in script and str(key_file) in script
    said = [r.getMessage() for r in caplog.records]
    assert any(f"submitted slurm job {job}" in m for m in said), said
    assert any(f"slurm job {job}: RUNNING" in m for m in said), said
    wait_until(lambda: slurm.job_state(job) is None, 30, f"job {job} to leave squeue")
    assert not key_file.exists()


SHIPPED_MARK = 47  # what only this module's own code knows


@cb.colocated_python
def marked(x: Any) -> Any:
    return x * 0 + SHIPPED_MARK


def test_a_function_of_this_test_module_runs_in_a_job_that_lacks_it(
        slurm: SlurmBed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No PYTHONPATH to this directory and the job elsewhere: this module travels."""
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.chdir(tmp_path)  # the job's working directory: not this module's
    with cb.slurm_cluster(nodes=2, python=sys.executable, key_dir=tmp_path, join_timeout=90,
                          **FAST) as ctl:
        hosts = ctl.hosts()
        mesh = cb.Mesh(np.array([h.devices[0] for h in hosts]), ("h",))
        x = cb.device_put(np.zeros(2, np.int64), cb.NamedSharding(mesh, cb.PartitionSpec("h")))
        out = cb.device_get(marked(x))
        assert out.tolist() == [SHIPPED_MARK] * 2


def test_a_pending_job_times_out_naming_the_job_and_reason_and_is_cancelled(
        slurm: SlurmBed, tmp_path: Path, importable: None) -> None:
    cluster = cb.slurm_cluster(nodes=1, python=sys.executable, key_dir=tmp_path,
                               sbatch_args=[f"--partition={slurm.hold_partition}"],
                               join_timeout=6, **FAST)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        with cluster:
            pass
    assert time.monotonic() - t0 < 30
    job = cluster.job_id  # type: ignore[attr-defined]
    text = str(info.value)
    assert f"slurm job {job} is still pending" in text
    assert HOLD_REASON in text and "cancelled" in text
    wait_until(lambda: slurm.job_state(job) is None, 30, f"job {job} to be cancelled")
    state = slurm.job_state(job, finished=True)
    assert state is not None and state[0] == "CANCELLED", state
    assert not list(tmp_path.iterdir())  # the key file is gone


def test_inside_an_allocation_workers_are_srun_steps(slurm: SlurmBed, importable: None
                                                     ) -> None:
    with slurm.allocation(2) as env:
        job = env["SLURM_JOB_ID"]
        cluster = cb.slurm_cluster(nodes=2, python=sys.executable, join_timeout=90, **FAST)
        with cluster as ctl:
            names = [h.name for h in ctl.hosts()]
            assert names == ["slurm-n0-0", "slurm-n1-0"], names
            assert fetch_octets(ctl, slurm.controller_ip) == node_octets(slurm)
            steps = slurm.slurm("squeue", "-h", "-s", "-j", job, "-o", "%i").stdout.split()
            assert len([s for s in steps if not s.endswith((".extern", ".interactive"))]) >= 2
            procs = list(cluster.procs)
        assert all(p.poll() is not None for p in procs)  # every srun ended

        def no_steps() -> bool:
            out = slurm.slurm("squeue", "-h", "-s", "-j", job, "-o", "%i").stdout.split()
            return not [s for s in out if not s.endswith((".extern", ".interactive"))]

        wait_until(no_steps, 30, "the workers' steps to end")


@pytest.mark.parametrize("inside", [True, False], ids=["in-allocation", "via-salloc"])
def test_colobus_launch_slurm_runs_the_driver_on_the_nodes(
        slurm: SlurmBed, tmp_path: Path, inside: bool) -> None:
    from test_launch_cli import DRIVER, driver_line, launch

    driver = tmp_path / "drv.py"
    driver.write_text(DRIVER)
    if inside:
        with slurm.allocation(2):
            out = launch(["slurm", "--nodes", "2", "--python", sys.executable], driver, 5)
    else:
        out = launch(["slurm", "--nodes", "2", "--python", sys.executable], driver, 5)
        assert "salloc" in out.stderr  # it asked for an allocation, and said so
    assert out.returncode == 5, out.stderr[-3000:]
    _, address, rest = driver_line(out.stdout)
    assert address.startswith(f"tcp://{slurm.controller_ip}:")
    assert rest.startswith("['slurm-n0-0', 'slurm-n1-0']"), rest
    for i in range(2):
        assert f"[host {i}] ran on" in out.stderr, out.stderr[-3000:]
