"""``cb.slurm_cluster`` without Slurm: the batch script it submits (its restart loop
run for real by ``/bin/sh``), the parsing of ``squeue`` and ``srun --label`` output,
and the ``srun`` step command used inside an allocation.

The end-to-end tests against a real slurmctld/slurmd bed live with that bed.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from colobus._launch.slurm import (
    SlurmJobCluster,
    SrunLauncher,
    batch_script,
    parse_label_line,
    parse_squeue,
)
from colobus._wire.keys import write_key


def script(**kw: object) -> str:
    args: dict[str, object] = {
        "nodes": 3, "workers_per_node": 2, "python": "/opt/py/bin/python3",
        "connect": "tcp://10.0.0.1:5555", "devices": 4, "key_file": "/home/u/.colobus/k.key",
        "restart": 2, "output": "/home/u/.colobus/job-%j.out"}
    args.update(kw)
    return batch_script(**args)  # type: ignore[arg-type]


def inner_loop(text: str) -> str:
    """The shell loop that srun runs for each task, out of the script's exec line."""
    (line,) = [ln for ln in text.splitlines() if ln.startswith("exec srun")]
    words = shlex.split(line)
    return words[words.index("-c") + 1]


def test_batch_script_asks_for_the_nodes_and_names_the_key_file_not_the_key() -> None:
    text = script()
    lines = text.splitlines()
    assert lines[0] == "#!/bin/sh"
    assert "#SBATCH --nodes=3" in lines
    assert "#SBATCH --ntasks-per-node=2" in lines
    assert "#SBATCH --output=/home/u/.colobus/job-%j.out" in lines
    loop = inner_loop(text)
    assert "--connect tcp://10.0.0.1:5555" in loop
    assert "--devices 4" in loop
    assert '--name "slurm-$SLURM_PROCID"' in loop
    assert "--key-file /home/u/.colobus/k.key" in loop
    assert "srun --label" in text
    assert "--exit-on-stdin-eof" not in text  # a batch step's stdin is /dev/null


def test_srun_args_reach_the_step() -> None:
    text = script(srun_args=["--gpus-per-task=1", "--cpus-per-task=8"])
    (line,) = [ln for ln in text.splitlines() if ln.startswith("exec srun")]
    words = shlex.split(line)
    assert words[:2] == ["exec", "srun"]
    assert "--gpus-per-task=1" in words and "--cpus-per-task=8" in words
    assert words.index("--cpus-per-task=8") < words.index("/bin/sh")


@pytest.mark.parametrize(("restart", "fails", "runs", "status"),
                         [(2, 1, 2, 0), (2, 5, 3, 7), (0, 5, 1, 7), (1, 0, 1, 0)])
def test_the_restart_loop_restarts_a_failing_worker_at_most_restart_times(
        tmp_path: Path, restart: int, fails: int, runs: int, status: int) -> None:
    counter = tmp_path / "runs"
    fake = tmp_path / "fake_python.py"
    # Stands in for `python -m colobus worker ...`: fails `fails` times with status 7.
    fake.write_text(
        "import sys, pathlib\n"
        f"p = pathlib.Path({str(counter)!r})\n"
        "n = len(p.read_text()) if p.exists() else 0\n"
        "p.write_text('x' * (n + 1))\n"
        f"sys.exit(7 if n < {fails} else 0)\n")
    loop = inner_loop(script(python=f"{sys.executable} {fake}", restart=restart))
    out = subprocess.run(["/bin/sh", "-c", loop], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "SLURM_PROCID": "3"})
    assert out.returncode == status, out.stderr
    assert len(counter.read_text()) == runs
    assert out.stderr.count("restarting it") == runs - 1


def test_a_worker_that_gave_up_is_not_restarted(tmp_path: Path) -> None:
    """Status 3 (no controller for --give-up-after seconds) ends the task's loop."""
    counter = tmp_path / "runs"
    fake = tmp_path / "fake_python.py"
    fake.write_text("import pathlib, sys\n"
                    f"p = pathlib.Path({str(counter)!r})\n"
                    "p.write_text(p.read_text() + 'x' if p.exists() else 'x')\n"
                    "sys.exit(3)\n")
    text = script(python=f"{sys.executable} {fake}", restart=5, give_up_after=42.0)
    assert "--give-up-after 42" in inner_loop(text)
    out = subprocess.run(["/bin/sh", "-c", inner_loop(text)], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "SLURM_PROCID": "0"})
    assert out.returncode == 3 and counter.read_text() == "x", out.stderr


def test_a_worker_without_a_controller_gives_up(tmp_path: Path) -> None:
    """A real `colobus worker --give-up-after 2` whose controller is gone exits with 3."""
    key = tmp_path / "k.key"
    write_key(str(key))
    out = subprocess.run([sys.executable, "-m", "colobus", "worker", "--connect",
                          "tcp://127.0.0.1:9", "--key-file", str(key), "--give-up-after", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stderr[-2000:]
    assert "gives up" in out.stderr


def test_parse_squeue() -> None:
    assert parse_squeue("PENDING Resources\n") == ("PENDING", "Resources")
    assert parse_squeue("PENDING (ReqNodeNotAvail, UnavailableNodes:n[1-2])\n") == (
        "PENDING", "(ReqNodeNotAvail, UnavailableNodes:n[1-2])")
    assert parse_squeue("RUNNING None\n") == ("RUNNING", "None")
    assert parse_squeue("COMPLETED\n") == ("COMPLETED", "")
    assert parse_squeue("") is None
    assert parse_squeue("\n  \n") is None


def test_parse_label_line() -> None:
    assert parse_label_line("3: hello: world") == (3, "hello: world")
    assert parse_label_line(" 12: x") == (12, "x")
    assert parse_label_line("srun: error: n1: task 0: Exited") == (None,
                                                                  "srun: error: n1: task 0: Exited")


def test_srun_step_command_inside_an_allocation() -> None:
    launcher = SrunLauncher(["n1", "n2"], 2, 4, python="python3", srun_args=["--gpus=1"])
    assert launcher.names == ["slurm-n1-0", "slurm-n1-1", "slurm-n2-0", "slurm-n2-1"]
    cmd = launcher.command(2, "tcp://10.0.0.1:5555")
    assert cmd[:6] == ["srun", "--nodes=1", "--ntasks=1", "--nodelist=n2", "--overlap",
                       "--kill-on-bad-exit=1"]
    assert "--gpus=1" in cmd
    tail = cmd[cmd.index("python3"):]
    assert tail == ["python3", "-m", "colobus", "worker", "--connect", "tcp://10.0.0.1:5555",
                    "--devices", "4", "--name", "slurm-n2-0", "--key-file", "-",
                    "--exit-on-stdin-eof"]
    assert launcher.describe(3) == "slurm host 3 (node 'n2')"


def test_the_job_cluster_writes_no_key_into_its_script(tmp_path: Path) -> None:
    cluster = SlurmJobCluster(2, 1, workers_per_node=1, sbatch_args=[], srun_args=[],
                              python="python3", restart=0, bind="tcp://127.0.0.1:*",
                              key_dir=tmp_path)
    text = cluster.script("tcp://127.0.0.1:5000")
    assert cluster._key.hex() not in text
    assert str(cluster.key_file) in text and str(cluster.key_file).startswith(str(tmp_path))
    assert cluster.launcher.names == ["slurm-0", "slurm-1"]
