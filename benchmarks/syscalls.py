"""System calls per call, counted on both sides: the controller's process and the worker's.

A driver process (``--child``) starts ``local_cluster(hosts=1)`` and, per mode, warms up,
says so, waits for a go on its stdin, runs ``--calls`` calls and says it is done. Around
that window this script counts every system call of both processes, all their threads
(ZeroMQ's I/O thread included), and prints them per call, with the syscalls that make
them up:

* ``perf`` (the default where it can read tracepoints): ``perf stat`` on
  ``raw_syscalls:sys_enter`` and a few ``syscalls:sys_enter_*``, enabled and disabled
  through its control FIFO around the window; it does not slow the processes;
* ``strace`` (``--tool strace``, or where perf cannot count): ``strace -f -c``, attached
  before the window and detached after it; it slows every system call, which changes
  how many calls wait per wake-up: its counts differ from perf's (on the 2-core VM,
  4-5x fewer calls a second and up to a quarter more system calls a call). perf needs the
  tracing filesystem (``mount -t tracefs nodev /sys/kernel/tracing``, as root).

Modes: ``window`` (``return x``, one task keeping ``--inflight`` futures in flight, as a
training loop pipelines its steps), ``tasks`` (``--inflight`` tasks, each awaiting its
own ``return x`` calls one after another), ``awaited`` (one call in flight at a time).

    python benchmarks/syscalls.py                          # 2,000 calls per mode, perf
    python benchmarks/syscalls.py --calls 500 --mode window --tool strace

``--spin-us N`` makes each call a step of the host's time instead of ``return x``: the
call spins N us on the worker and returns its argument (a small step's shape: calls of
under 1 ms run back to back on the worker's loop thread, in slices, and each loop turn
between slices is shared by a few calls only).

    python benchmarks/syscalls.py --mode window --spin-us 300 --calls 1000

Counts follow what the processes do, not the clock, except for how many calls wait per
wake-up (more on a slow machine) and the heartbeats (one each way per second).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

MODES = ("window", "tasks", "awaited")
# the system calls listed apart (perf: one tracepoint each, where the kernel has it)
NAMED = ("poll", "ppoll", "epoll_wait", "epoll_pwait", "read", "write", "recvfrom", "sendto",
         "recvmsg", "sendmsg", "getpid", "futex", "timerfd_settime", "sched_yield")
TRACEFS = "/sys/kernel/tracing/events/syscalls"


# -- the driver (its own process: counted whole) ----------------------------------------------


SPIN_ENV = "SYSCALLS_SPIN_US"
SPIN_S = float(os.environ.get(SPIN_ENV, "0")) / 1e6  # (the driver's: set by main)


def _spin(x: Any) -> Any:
    """A small step's shape: ``SPIN_S`` of the host's time, the argument returned."""
    end = time.perf_counter() + SPIN_S
    while time.perf_counter() < end:
        pass
    return x


def _worker_pid() -> Any:
    import numpy as np

    return np.int64(os.getpid())


async def _window(fn: Callable[[Any], Any], x: Any, n: int, inflight: int) -> None:
    futs: collections.deque[Any] = collections.deque()
    for _ in range(n):
        futs.append(fn(x))
        if len(futs) >= inflight:
            await futs.popleft()
    for f in futs:
        await f


async def _tasks(fn: Callable[[Any], Any], x: Any, n: int, inflight: int) -> None:
    async def one(k: int) -> None:
        for _ in range(k):
            await fn(x)

    each, extra = divmod(n, inflight)
    await asyncio.gather(*(one(each + (i < extra)) for i in range(inflight)))


async def _awaited(fn: Callable[[Any], Any], x: Any, n: int, inflight: int) -> None:
    for _ in range(n):
        await fn(x)


RUNS: dict[str, Callable[[Callable[[Any], Any], Any, int, int], Awaitable[None]]] = {
    "window": _window, "tasks": _tasks, "awaited": _awaited}


async def _drive(modes: list[str], n: int, inflight: int) -> None:
    import numpy as np

    import colobus as cb
    from colobus._tools.bench_base import _one_device_array
    from colobus._tools.bench_calls import bench_ident

    pid_of = cb.colocated_python(_worker_pid)
    fn = cb.colocated_python(_spin) if SPIN_S else bench_ident
    async with cb.local_cluster(hosts=1, devices_per_host=1) as ctl:
        x = _one_device_array(ctl)
        await cb.block_until_ready(x)
        wpid = int(np.asarray(await cb.device_get(await pid_of.specialize(
            devices=list(x.sharding.device_set))())))
        print(f"PIDS {os.getpid()} {wpid}", flush=True)
        for mode in modes:
            await RUNS[mode](fn, x, max(n // 4, 50), inflight)  # warm: threads made
            print(f"READY {mode}", flush=True)
            sys.stdin.readline()  # (blocking: the loop has nothing else to do)
            await RUNS[mode](fn, x, n, inflight)
            print(f"DONE {mode}", flush=True)
            sys.stdin.readline()


# -- the counters --------------------------------------------------------------------------


def perf_usable() -> bool:
    """Whether ``perf stat`` can count syscall tracepoints here."""
    if shutil.which("perf") is None or not os.path.isdir(TRACEFS):
        return False
    got = subprocess.run(["perf", "stat", "-x,", "-e", "raw_syscalls:sys_enter", "true"],
                         capture_output=True, text=True)
    return got.returncode == 0 and "raw_syscalls:sys_enter" in got.stderr


class Perf:
    """``perf stat`` attached to one process, counting only between start and stop."""

    def __init__(self, pid: int, directory: str, tag: str) -> None:
        self._ctl, self._ack = (os.path.join(directory, f"{tag}.{k}") for k in ("ctl", "ack"))
        self._out = os.path.join(directory, f"{tag}.out")
        for path in (self._ctl, self._ack):
            os.mkfifo(path)
        events = ["raw_syscalls:sys_enter"] + [
            f"syscalls:sys_enter_{s}" for s in NAMED
            if os.path.isdir(os.path.join(TRACEFS, f"sys_enter_{s}"))]
        self._proc = subprocess.Popen(
            ["perf", "stat", "-x,", "-o", self._out, "-D", "-1",
             "--control", f"fifo:{self._ctl},{self._ack}",
             *(a for e in events for a in ("-e", e)), "-p", str(pid)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._c = open(self._ctl, "w")  # (opens once perf has opened its end)
        self._a = open(self._ack)

    def _say(self, what: str) -> None:
        self._c.write(what + "\n")
        self._c.flush()
        if not self._a.read(5).startswith("ack"):
            raise RuntimeError(f"perf did not acknowledge {what!r}")

    def start(self) -> None:
        self._say("enable")

    def stop(self) -> dict[str, int]:
        self._say("disable")
        self._proc.send_signal(signal.SIGINT)
        self._proc.wait(60)
        self._c.close()
        self._a.close()
        got: dict[str, int] = {}
        with open(self._out) as f:
            for line in f:
                fields = line.strip().split(",")
                if len(fields) < 3 or not fields[2].startswith(("raw_syscalls", "syscalls")):
                    continue
                value = int(fields[0]) if fields[0].isdigit() else 0
                name = fields[2].split(":")[1]
                got["total" if name == "sys_enter" else name.removeprefix("sys_enter_")] = value
        return got


class Strace:
    """``strace -f -c`` attached to one process (all its threads) between start and stop."""

    def __init__(self, pid: int, directory: str, tag: str) -> None:
        self._pid = pid
        self._out = os.path.join(directory, f"{tag}.strace")
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(["strace", "-f", "-c", "-o", self._out, "-p",
                                       str(self._pid)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not self._attached():  # every thread traced: the window may open
            if time.monotonic() > deadline or self._proc.poll() is not None:
                raise RuntimeError(f"strace did not attach to {self._pid}")
            time.sleep(0.01)

    def _attached(self) -> bool:
        tasks = f"/proc/{self._pid}/task"
        for tid in os.listdir(tasks):
            try:
                with open(f"{tasks}/{tid}/status") as f:
                    tracer = next(line for line in f if line.startswith("TracerPid:"))
            except (OSError, StopIteration):
                continue
            if tracer.split()[1] == "0":
                return False
        return True

    def stop(self) -> dict[str, int]:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGINT)
        self._proc.wait(60)
        got: dict[str, int] = {}
        with open(self._out) as f:
            for line in f:
                fields = line.split()
                if len(fields) < 5 or not fields[3].isdigit():
                    continue
                name = fields[-1]
                got["total" if name == "total" else name] = int(fields[3])
        return got


def count(modes: list[str], n: int, inflight: int, tool: str) -> dict[str, dict[str, Any]]:
    """Per mode, the system calls of each side over ``n`` calls."""
    counter = Perf if tool == "perf" else Strace
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", "--calls",
                              str(n), "--inflight", str(inflight), "--mode", *modes],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None

    def expect(word: str) -> list[str]:
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith(word + " "):
                return line.split()[1:]
        raise RuntimeError(f"the driver ended before {word} (exit {child.wait()})")

    out: dict[str, dict[str, Any]] = {}
    try:
        ctl_pid, worker_pid = (int(v) for v in expect("PIDS"))
        with tempfile.TemporaryDirectory() as d:
            for mode in modes:
                expect("READY")
                sides = {"controller": counter(ctl_pid, d, f"{mode}.c"),
                         "worker": counter(worker_pid, d, f"{mode}.w")}
                for c in sides.values():
                    c.start()
                t0 = time.perf_counter()
                child.stdin.write("go\n")
                child.stdin.flush()
                expect("DONE")
                seconds = time.perf_counter() - t0
                out[mode] = {side: c.stop() for side, c in sides.items()}
                out[mode]["seconds"] = seconds
                child.stdin.write("next\n")
                child.stdin.flush()
    finally:
        child.stdin.close()
        if child.wait(120) != 0:
            raise RuntimeError(f"the driver failed (exit {child.returncode})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--inflight", type=int, default=100)
    ap.add_argument("--mode", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--tool", choices=("perf", "strace"), default=None,
                    help="perf where it can count tracepoints, else strace")
    ap.add_argument("--spin-us", type=float, default=0.0,
                    help="each call spins this long on the worker (default: return x)")
    ap.add_argument("--child", action="store_true", help="(internal) the driver")
    args = ap.parse_args()
    if args.spin_us:
        os.environ[SPIN_ENV] = str(args.spin_us)  # (the driver's child reads it)
    if args.child:
        asyncio.run(_drive(args.mode, args.calls, args.inflight))
        return
    tool = args.tool or ("perf" if perf_usable() else "strace")
    if tool == "strace" and shutil.which("perf") and not os.path.isdir(TRACEFS):
        print(f"(perf cannot count here: no {TRACEFS}; as root, `mount -t tracefs nodev "
              "/sys/kernel/tracing` lets it, and strace moves the counts)", file=sys.stderr)
    got = count(args.mode, args.calls, args.inflight, tool)
    load = os.getloadavg()[0]
    what = f"{args.spin_us:g} us step" if args.spin_us else "`return x`"
    print(f"system calls per call ({tool}), {args.calls} {what} calls per mode, "
          f"load {load:.1f}")
    print(f"  {'mode':28s} {'controller':>10s} {'worker':>8s} {'calls/s':>8s}")
    for mode in args.mode:
        r = got[mode]
        label = {"window": f"window of {args.inflight}", "tasks": f"{args.inflight} tasks",
                 "awaited": "awaited, one at a time"}[mode]
        print(f"  {label:28s} {r['controller'].get('total', 0) / args.calls:10.2f} "
              f"{r['worker'].get('total', 0) / args.calls:8.2f} "
              f"{args.calls / r['seconds']:8.0f}")
        for side in ("controller", "worker"):
            parts = sorted(((v, k) for k, v in r[side].items() if k != "total" and v),
                           reverse=True)
            print(f"    {side}: " + ", ".join(f"{k} {v / args.calls:.2f}" for v, k in parts[:8]))


if __name__ == "__main__":
    main()
