"""The Slurm test bed is a real cluster: jobs run on slurmd inside the nodes' namespaces.

These tests prove what ``cb.slurm_cluster``'s tests will rely on: ``sbatch``
outside an allocation, ``srun`` inside one (batch job or ``salloc``), a job that
stays PENDING with a known reason and goes away on ``scancel``, and a process
started by ``srun`` on a node reaching a TCP listener in the root namespace on
the bridge address (as a colobus worker reaches its controller).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time

import netbed
import pytest
from nsprocs import cmdline, wait_until
from slurmbed import (
    HOLD_PARTITION,
    HOLD_REASON,
    SlurmBed,
    SlurmBedError,
    unavailable_reason,
)

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason())),
]


def _read_lines(path: str) -> list[str]:
    with open(path) as f:
        return [line.strip() for line in f if line.strip()]


def test_sbatch_job_runs_on_a_node_inside_its_namespace(slurm: SlurmBed) -> None:
    out = os.path.join(slurm.dir, "sbatch-one.txt")
    job = slurm.sbatch(f"#!/bin/sh\necho \"$SLURMD_NODENAME $(hostname -I)\" > {out}\n"
                       "echo done in $(pwd)\n", "-N1")
    assert job.isdigit(), job
    assert slurm.wait_job(job, None, timeout=30) is None  # finished: squeue lists it no more
    assert slurm.job_state(job, finished=True) == ("COMPLETED", "None")
    assert _read_lines(slurm.job_output_path(job)) == [f"done in {os.getcwd()}"]
    [line] = _read_lines(out)
    node, *addrs = line.split()
    ips = {n.name: n.ip for n in slurm.nodes}
    assert node in ips, line
    assert addrs == [ips[node]], f"the job saw {addrs}, node {node} is {ips[node]}"
    assert slurm.controller_ip not in addrs


def test_the_environment_points_the_slurm_cli_at_the_bed(slurm: SlurmBed) -> None:
    assert os.environ["SLURM_CONF"] == slurm.conf
    # a plain subprocess (default environment) talks to the bed's slurmctld
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    assert f"ClusterName             = {slurm.cluster_name}" in out
    nodes = subprocess.run(["sinfo", "-h", "-N", "-p", slurm.partition, "-o", "%N %t"],
                           capture_output=True, text=True, timeout=30, check=True).stdout.split()
    assert nodes == ["n0", "idle", "n1", "idle"]


def test_srun_inside_a_batch_job_runs_on_two_nodes(slurm: SlurmBed) -> None:
    out = os.path.join(slurm.dir, "sbatch-two.txt")
    script = ("#!/bin/sh\n"
              f"echo \"job $SLURM_JOB_ID $SLURM_JOB_NUM_NODES\" > {out}\n"
              f"srun -N2 --ntasks-per-node=1 sh -c 'echo \"$SLURMD_NODENAME $(hostname -I)\"'"
              f" >> {out}\n")
    job = slurm.sbatch(script, "-N2", "-o", os.path.join(slurm.dir, "sbatch-two.log"))
    slurm.wait_job(job, None, timeout=30)
    lines = _read_lines(out)
    assert lines[0] == f"job {job} 2", lines
    seen = dict(line.split() for line in lines[1:])
    assert seen == {n.name: n.ip for n in slurm.nodes}, lines


def test_srun_inside_salloc_runs_on_two_nodes_and_several_tasks_per_node(slurm: SlurmBed) -> None:
    cmd = ["salloc", "-N2", "--ntasks-per-node=3", "sh", "-c",
           "echo alloc $SLURM_JOB_ID; srun -l sh -c 'echo $SLURMD_NODENAME $(hostname -I)'"]
    proc = slurm.slurm(*cmd, timeout=60)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("alloc ") and lines[0].split()[1].isdigit(), proc.stdout
    tasks = sorted(line.split(":", 1)[1].split() for line in lines[1:])
    ips = {n.name: n.ip for n in slurm.nodes}
    assert tasks == sorted([[name, ip] for name, ip in ips.items()] * 3), proc.stdout


def test_srun_gives_its_stdin_to_every_task(slurm: SlurmBed) -> None:
    # how a launcher can hand each worker its key without a file or the command line
    proc = slurm.slurm("srun", "-N2", "--ntasks-per-node=1", "-l", "sh", "-c",
                       "read line; echo \"$SLURMD_NODENAME got $line\"", input="k3y\n",
                       timeout=60)
    assert sorted(proc.stdout.splitlines()) == ["0: n0 got k3y", "1: n1 got k3y"], proc.stdout


def test_a_failing_batch_job_is_reported_failed(slurm: SlurmBed) -> None:
    job = slurm.sbatch("#!/bin/sh\necho about to fail\nexit 3\n")
    slurm.wait_job(job, None, timeout=30)
    assert slurm.job_state(job, finished=True) == ("FAILED", "NonZeroExitCode")
    assert "ExitCode=3:0" in slurm.slurm("scontrol", "show", "job", job).stdout
    assert _read_lines(slurm.job_output_path(job)) == ["about to fail"]


def test_inside_an_allocation_srun_runs_a_step_of_that_job(slurm: SlurmBed) -> None:
    assert "SLURM_JOB_ID" not in os.environ
    with slurm.allocation(2) as env:
        job = env["SLURM_JOB_ID"]
        assert os.environ["SLURM_JOB_ID"] == job
        assert env["SLURM_JOB_NUM_NODES"] == "2" and env["SLURM_JOB_NODELIST"] == "n[0-1]"
        assert slurm.job_state(job) == ("RUNNING", "None")
        # a plain srun (default environment) runs in the allocation, on its two nodes
        out = subprocess.run(["srun", "sh", "-c", "echo $SLURM_JOB_ID $(hostname -I)"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        assert sorted(out.splitlines()) == [f"{job} {n.ip}" for n in slurm.nodes]
    assert "SLURM_JOB_ID" not in os.environ
    assert slurm.job_state(job) is None  # cancelled with the block


def test_an_allocation_that_is_not_granted_in_time_fails_and_leaves_no_job(
        slurm: SlurmBed) -> None:
    t0 = time.monotonic()
    with pytest.raises(SlurmBedError, match="no allocation within 2"), \
            slurm.allocation(1, f"--partition={HOLD_PARTITION}", timeout=2):
        pass
    assert time.monotonic() - t0 < 15
    assert slurm.slurm("squeue", "-h", "-o", "%i %T").stdout == ""
    assert "SLURM_JOB_ID" not in os.environ


def scheduler_cycles(slurm: SlurmBed) -> int:
    """How many passes slurmctld's main scheduler has made (``sdiag``)."""
    found = re.search(r"Main schedule statistics.*?Total cycles: *(\d+)",
                      slurm.slurm("sdiag").stdout, re.S)
    assert found is not None
    return int(found.group(1))


def test_a_job_in_the_hold_partition_stays_pending_until_scancel(slurm: SlurmBed) -> None:
    before = scheduler_cycles(slurm)
    job = slurm.sbatch("#!/bin/sh\nsleep 300\n", f"--partition={HOLD_PARTITION}",
                       "-o", "/dev/null")
    assert slurm.wait_job(job, ["PENDING"], timeout=10) is not None
    # A scheduling pass after the submission has seen the job: it is still not started.
    wait_until(lambda: scheduler_cycles(slurm) != before, 30, "a scheduling pass")
    line = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], capture_output=True,
                          text=True, timeout=30, check=True).stdout.strip()
    assert line == f"PENDING {HOLD_REASON}"
    slurm.slurm("scancel", job)
    assert slurm.wait_job(job, None, timeout=15) is None
    listed = slurm.slurm("squeue", "-h", "-o", "%i").stdout.split()
    assert job not in listed


def test_scancel_stops_a_running_job_and_its_processes(slurm: SlurmBed) -> None:
    job = slurm.sbatch("#!/bin/sh\nexec sleep 300\n", "-N1", "-o", "/dev/null")
    slurm.wait_job(job, ["RUNNING"], timeout=30)
    node = slurm.slurm("squeue", "-h", "-j", job, "-o", "%N").stdout.strip()
    [ns] = [n.ns for n in slurm.nodes if n.name == node]

    def sleeps() -> list[int]:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                              timeout=30).stdout.split()
        return [int(p) for p in pids if cmdline(int(p)) == "sleep 300 "]

    deadline = time.monotonic() + 15
    while not sleeps():
        assert time.monotonic() < deadline, f"no `sleep 300` in {ns}\n{slurm.log_tail()}"
        time.sleep(0.1)
    slurm.slurm("scancel", job)
    slurm.wait_job(job, None, timeout=15)
    deadline = time.monotonic() + 15
    while sleeps():
        assert time.monotonic() < deadline, f"the job's sleep survived scancel in {ns}"
        time.sleep(0.1)


def test_a_python_process_started_by_srun_reaches_the_root_namespace(slurm: SlurmBed) -> None:
    accepted: list[tuple[str, bytes]] = []
    with socket.socket() as srv:
        srv.bind((slurm.controller_ip, 0))
        srv.listen(8)
        srv.settimeout(30)
        port = srv.getsockname()[1]

        def serve() -> None:
            for _ in range(2):
                try:
                    conn, (peer, _) = srv.accept()
                except OSError:
                    return
                with conn:
                    conn.settimeout(10)
                    accepted.append((peer, conn.recv(200)))
                    conn.sendall(b"ok")

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        client = ("import os,socket,sys; s=socket.create_connection((sys.argv[1], int(sys.argv[2]))"
                  ", timeout=10); s.sendall(os.environ['SLURMD_NODENAME'].encode());"
                  " assert s.recv(2) == b'ok'; print('connected', s.getsockname()[0])")
        proc = slurm.slurm("srun", "-N2", "--ntasks-per-node=1", sys.executable, "-c", client,
                           slurm.controller_ip, str(port), timeout=60)
        t.join(30)
    ips = {n.name: n.ip for n in slurm.nodes}
    assert sorted((peer, name.decode()) for peer, name in accepted) == sorted(
        (ip, name) for name, ip in ips.items()), (accepted, proc.stdout)
    assert sorted(proc.stdout.split()) == sorted(["connected"] * 2 + list(ips.values()))


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _leftovers(bed: SlurmBed, pids: list[int]) -> list[str]:
    left = [f"pid {p} ({cmdline(p)})" for p in pids if _running(p)]
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                           timeout=30).stdout
    left += [n.ns for n in bed.nodes if n.ns in names]
    if os.path.exists(bed.dir):
        left.append(bed.dir)
    if os.path.exists(f"/sys/class/net/{bed.net.bridge}"):
        left.append(bed.net.bridge)
    return left


def test_close_removes_every_daemon_job_namespace_and_file(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "424242")  # as in a test run inside a real job
    before = os.environ.get("SLURM_CONF")
    bed = SlurmBed(nodes=1, cpus_per_node=2)
    with bed:
        assert os.environ["SLURM_CONF"] == bed.conf
        assert "SLURM_JOB_ID" not in os.environ
        assert bed.start_seconds < 30, bed.start_seconds
        job = bed.sbatch("#!/bin/sh\nexec sleep 300\n", "-o", "/dev/null")
        bed.wait_job(job, ["RUNNING"], timeout=30)
        pids = [p.pid for _, p, _ in bed._procs]
        pids += [int(p) for p in subprocess.run(["ip", "netns", "pids", bed.nodes[0].ns],
                                                capture_output=True, text=True,
                                                timeout=30).stdout.split()]
        assert len(pids) >= 4  # munged, slurmctld, slurmd, slurmstepd (+ the job)
    assert os.environ.get("SLURM_CONF") == before
    assert os.environ["SLURM_JOB_ID"] == "424242"
    assert _leftovers(bed, pids) == []
    bed.close()  # idempotent


def test_a_start_that_times_out_names_the_wait_and_leaves_nothing() -> None:
    bed = SlurmBed(nodes=1, start_timeout=0.0)  # no wait can succeed in time
    # the first check of a wait comes before its deadline: munged may still answer it
    with pytest.raises(SlurmBedError, match=r"timed out waiting for (munged|slurmctld|every node to be idle)") as err:
        bed.create()
    assert "--- munged.log" in str(err.value)
    assert _leftovers(bed, [p.pid for _, p, _ in bed._procs]) == []


def test_a_daemon_that_dies_fails_the_start_with_its_log_and_leaves_nothing() -> None:
    bed = SlurmBed(nodes=1, extra_conf=["SelectType=select/no-such-plugin"])
    t0 = time.monotonic()
    with pytest.raises(SlurmBedError, match=r"slurmctld exited \(\d+\) while waiting") as err:
        bed.create()
    assert time.monotonic() - t0 < 20  # it does not wait out the start timeout
    assert "select/no-such-plugin" in str(err.value)  # slurmctld's own words, from its log
    assert _leftovers(bed, [p.pid for _, p, _ in bed._procs]) == []
    assert not any(name.startswith(f"{netbed.NS_PREFIX}{os.getpid()}-{bed.net.tag}")
                   for name in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                              text=True, timeout=30).stdout.split())
