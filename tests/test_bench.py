"""`colobus bench --quick --json` runs every benchmark, colobus and raw pyzmq side by side."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from colobus._tools.bench import BENCHMARKS

EXPECTED = {
    "latency_async", "latency_sync", "pipelined", "fanout4_latency", "fanout4_pipelined",
    "object_first_call", "put_small", "get_small", "put_medium", "get_medium", "put_large",
    "get_large", "peak_rss_put_controller", "peak_rss_put_worker", "peak_rss_get_controller",
    "peak_rss_get_worker", "chain100",
    # bench_calls: calls, scaling, bigout
    "mem_inflight_controller", "mem_inflight_worker", "mem_held_controller", "mem_held_worker",
    "noop_async_alt", "ident_async", "spec_async", "plus1_async", "ident_pipelined_tasks",
    "ident_pipelined_gather", "ident_pipelined_cbgather", "ident_sync",
    "scaling1_noop", "scaling1_ident", "scaling2_noop", "scaling2_ident", "scaling4_noop",
    "scaling4_ident", "scaling_cpu_per_host_noop", "scaling_cpu_per_host_ident",
    "bigout_first_peak_rss_worker", "bigout_second_peak_rss_worker",
    # bench_reshard: reshard
    "reshard_16mib_4hosts",
}


def test_quick_bench_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "colobus", "bench", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["quick"] is True
    assert doc["machine"]["cpus"] >= 1
    rows = doc["benchmarks"]
    assert set(rows) == EXPECTED
    for name, row in rows.items():
        assert row["better"] in ("lower", "higher"), name
        assert row["unit"], name
        assert row["baseline"] > 0, name
        assert row["colobus"] >= 0, name
        assert math.isfinite(row["ratio"]) and row["ratio"] >= 0, name
        if not name.startswith(("peak_rss", "mem_", "scaling_cpu")):
            assert row["colobus"] > 0 and row["ratio"] > 0, name
    # every table row also printed, with both figures
    for name in EXPECTED:
        assert name in proc.stdout
    assert rows["chain100"]["colobus_awaited_each"] > 0
    assert rows["fanout4_latency"]["colobus_1host"] > 0
    assert rows["ident_async"]["vs_noop"] > 0 and rows["ident_async"]["cpu_us"] > 0
    assert rows["scaling4_noop"]["cpu_us_per_host"] > 0
    assert rows["bigout_second_peak_rss_worker"]["bytes"] == 32 << 20
    # --quick skips Ray and IPython Parallel (CI does not install the bench extra)
    assert {run["status"] for run in doc["peers"].values()} == {"skipped"}
    assert all(row["peers"] == {} for row in rows.values())
    assert "skipped: --quick" in proc.stdout


def test_unknown_benchmark_name() -> None:
    proc = subprocess.run([sys.executable, "-m", "colobus", "bench", "nope"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    for name in BENCHMARKS:
        assert name in proc.stderr


@pytest.mark.parametrize("name", ["object"])
def test_one_group_to_stdout(name: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "colobus", "bench", name, "--quick", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert set(doc["benchmarks"]) == {"object_first_call"}


def test_ab_pairs_alternate_and_report_the_ratio() -> None:
    """benchmarks/ab.py: A/B pairs of one row, each side with its own options."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "ab.py"
    proc = subprocess.run([sys.executable, str(script), "object", "--row", "object_first_call",
                           "--pairs", "2", "--quick", "--b=--metrics"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pairs = [line for line in proc.stdout.splitlines() if line.startswith("pair ")]
    assert len(pairs) == 2 and all(" B/A " in line for line in pairs)
    assert "B/A per pair: median" in proc.stdout and "(2 pairs)" in proc.stdout
    bad = subprocess.run([sys.executable, str(script), "object", "--pairs", "1", "--quick",
                          "--b-env", "nonsense"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "NAME=VALUE" in bad.stderr


def test_call_cpu_reports_every_pattern() -> None:
    """benchmarks/call_cpu.py: CPU and loop turns per call, per pattern, against raw."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "call_cpu.py"
    proc = subprocess.run([sys.executable, str(script), "--calls", "200", "--window", "50"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("raw pyzmq: round trip")
    for name in ("awaited", "ident", "tasks", "gather", "cbgather"):
        row = next(line for line in lines if line.startswith(name + " "))
        turns = float(row.split(" turns/call")[0].rsplit(" ", 1)[1])
        assert 0 < turns < 10, row  # the loop ran, and not absurdly often per call
        assert "us/call" in row and "threads)" in row


def test_critical_path_times_every_link_of_colobus_and_the_minimal_call() -> None:
    """benchmarks/critical_path.py: its shim finds the library's send, receive and wake-up
    (a renamed function would leave no chain to time: the script then fails), on both
    sides of both designs."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "critical_path.py"
    proc = subprocess.run([sys.executable, str(script), "--calls", "300", "--warm", "100",
                           "--what", "ident"],
                          capture_output=True, text=True, timeout=300, cwd=tempfile.gettempdir())
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    # Chains seen whole: none if the shim missed a send, receive or wake-up (how many of
    # the 300 depends on how the two processes interleave, so only that some were)
    chains = int(out.split(" traced chains")[0].rsplit(" ", 1)[1])
    assert chains > 0, out
    for link in ("controller: sent -> worker woke", "worker: read -> sent the RESULT",
                 "controller: read -> sent the next CALL", "round trip"):
        row = next(line for line in out.splitlines() if line.strip().startswith(link))
        ours, minimal = (float(v) for v in row.split()[-2:])
        assert ours > 0 and minimal > 0, row
    assert "raw pyzmq round trip" in out and "minimal" in out


def test_relay_cpu_measures_the_raw_pyzmq_floors_of_one_message_per_host() -> None:
    """benchmarks/relay_cpu.py's baselines: a raw ROUTER sending each host its copy, and
    ZeroMQ's own fan-out (one PUB send), each host's echo back on the ROUTER; both print
    the process's CPU per host per call and its threads'."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "relay_cpu.py"
    proc = subprocess.run([sys.executable, str(script), "--mode", "raw", "raw-pub", "--hosts",
                           "3", "--calls", "20", "--warm", "5"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for mode in ("raw", "raw-pub"):
        i = next(i for i, line in enumerate(lines) if line.split()[0] == mode)
        row = lines[i]
        assert row.split()[1] == "3", row
        us = float(row.split(" us CPU per host")[0].rsplit("=", 1)[1])
        assert us > 0, row
        assert "python" in lines[i + 1] and "ZMQbg/IO/0" in lines[i + 1], lines[i + 1]


def test_call_counts_prints_both_sides_for_every_pattern() -> None:
    """benchmarks/call_counts.py: the profiler counts Python and C calls in the controller
    and in its workers (a shim that missed the workers would leave no marks: the script
    then fails), one row per pattern, each count a plausible number per call."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "call_counts.py"
    proc = subprocess.run([sys.executable, str(script), "--calls", "30", "--warm", "10"],
                          capture_output=True, text=True, timeout=300, cwd=tempfile.gettempdir())
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for label in ("no-op, awaited", "`return x`, awaited, 1 host", "no frees",
                  "block_until_ready()", "specialized", "object method (no-op)",
                  "object method `return x`", "4 hosts"):
        row = next(line for line in lines if label in line)
        *counts, watch = (float(v) for v in row.split()[-5:])
        # A call runs some Python on each side, and not tens of thousands of functions
        assert all(5 < c < 5000 for c in counts), row
        # the watchdog, counted apart (none per call in time; a difference of two windows,
        # so a wake in the baseline's window reads a little below 0)
        assert -1 < watch < 5000, row


def test_accelerator_check_runs_its_whole_path_with_cpu_devices_standing_in() -> None:
    """benchmarks/accelerator_check.py (run on a machine with an accelerator): here, in
    its smoke mode, CPU devices stand in, and it says so rather than faking one."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "accelerator_check.py"
    proc = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = "\n" + proc.stdout
    report = json.loads(out[out.index("\n{") + 1:])
    assert report["accelerator"] is None and "no accelerator" in report["note"]
    assert report["compute"]["ok"] and report["moves"]["ok"]
    assert report["moves"]["platforms"] == ["cpu", "cpu", "cpu"]
    for kind in ("matmul", "mlp"):
        step = report["steps"][kind]
        assert step["plain"]["steps_per_s"] > 0 and step["colobus"]["steps_per_s"] > 0
        # the raw pyzmq server ran the same step: the machine's part of the awaited extra
        assert step["raw"]["awaited_us"] > 0 and step["raw"]["round_trip_us"] > 0
        assert step["own_extra_us"] == round(
            step["colobus"]["awaited_us"] - step["raw"]["awaited_us"], 1)
    assert [len(h) for h in report["two_workers"]["hosts"]] == [1, 1]


def test_a_cpu_clock_that_reads_zero_is_named_not_a_crash() -> None:
    """Where the CPU clock is too coarse for a short run (it read 0 under gVisor),
    ``colobus bench calls`` prints every figure it can, and names those it could not."""
    code = ("import sys, time\n"
            "time.thread_time = lambda: 1.0  # a clock that never moves over the run\n"
            "from colobus._tools import bench_calls\n"
            "async def skipped(*args):  # rows of the group not under test: kept short\n"
            "    pass\n"
            "bench_calls._inflight_memory = bench_calls._pipelined_rows = skipped\n"
            "from colobus._tools.cli import main\n"
            "sys.exit(main(['bench', 'calls', '--quick', '--json', '-']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ZeroDivisionError" not in proc.stderr
    rows = json.loads(proc.stdout)["benchmarks"]
    ident = rows["ident_async"]
    assert ident["cpu_us"] == 0 and ident["cpu_vs_noop"] is None  # null in JSON, not NaN
    assert ident["colobus"] > 0 and ident["vs_noop"] > 0  # the wall-clock figures stand
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("not measured")]
    for name in ("ident_async cpu_vs_noop", "spec_async cpu_vs_noop", "plus1_async cpu_vs_noop"):
        assert name in line, line
    assert "a clock read 0" in line, line


def test_syscalls_counts_both_sides_per_call_around_the_window() -> None:
    """benchmarks/syscalls.py: every system call of the controller's process and the
    worker's (all threads) over the measured calls only, per call, with the syscalls that
    make them up; pipelined calls cost far fewer per call than awaited ones (they are read
    and answered in batches). Counts, not times: the load moves none of this much."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    try:
        import syscalls
    finally:
        sys.path.pop(0)
    if not syscalls.perf_usable() and shutil.which("strace") is None:
        pytest.skip("neither perf (with tracepoints) nor strace here")
    script = Path(syscalls.__file__)
    proc = subprocess.run([sys.executable, str(script), "--calls", "300", "--mode", "window",
                           "awaited"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    rows = {}
    for mode, label in (("window", "window of 100"), ("awaited", "awaited, one at a time")):
        i = next(i for i, line in enumerate(lines) if line.strip().startswith(label))
        ctl, wrk = (float(v) for v in lines[i][len(label) + 2:].split()[:2])
        assert 0 < ctl < 1000 and 0 < wrk < 1000, lines[i]
        assert lines[i + 1].strip().startswith("controller:"), lines[i + 1]
        assert lines[i + 2].strip().startswith("worker:"), lines[i + 2]
        rows[mode] = (ctl, wrk)
    assert rows["window"][0] < rows["awaited"][0] and rows["window"][1] < rows["awaited"][1]


def test_small_step_measures_the_mlp_step_plain_and_through_colobus() -> None:
    """benchmarks/small_step.py: the MLP step on CPU in a plain process and on a worker,
    in pairs, with the ratios and the goals printed (a smoke run: one short pair)."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "small_step.py"
    proc = subprocess.run([sys.executable, str(script), "--rounds", "1", "--steps", "20",
                           "--awaited", "5"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = next(line for line in proc.stdout.splitlines() if line.split()[:1] == ["1"])
    plain, via, ratio = (float(v) for v in row.split()[1:4])
    assert plain > 0 and via > 0 and abs(ratio - via / plain) < 0.01, row
    assert "median of the pairs: pipelined" in proc.stdout and "round trips" in proc.stdout


def test_step_anatomy_times_the_step_on_the_host_per_call_and_in_one_call() -> None:
    """benchmarks/step_anatomy.py: the host's own clock around the MLP step, per colobus
    call and in one call, beside the plain process (a smoke run of a few steps, on CPU)."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "step_anatomy.py"
    proc = subprocess.run([sys.executable, str(script), "--steps", "10"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    via = doc["colobus"]
    for side in (doc["plain"], via["in_one_call"]):
        assert side["steps_per_s"] > 0 and side["dispatch_us"] > 0, doc
    assert via["steps_per_s"] > 0 and via["host"]["dispatch_us"] > 0, doc
    kept = via["in_one_call_kept"]
    assert kept["steps_per_s"] > 0 and kept["dispatch_us"] > 0, doc
    # (per thread, those past 5 ms of CPU: a smoke run's ten steps may leave none there)
    assert all(v > 0.005 for v in via["thread_cpu_s"].values()), doc
    assert abs(doc["ratio"] - doc["colobus"]["steps_per_s"] / doc["plain"]["steps_per_s"]) < 0.01
    # the worker's functions timed per step: each step's arguments read, its outputs
    # described and its RESULT made once (the profile's own calls: the rest), each timed
    rows = via["loop_profile"]["per_step"]
    for name in ("Runs._finish", "call_args", "HostValues.outputs"):
        assert 1 <= rows[name]["per_step"] <= 1.3 and rows[name]["own_us"] > 0, rows
