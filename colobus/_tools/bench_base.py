"""What every ``colobus bench`` group shares: the rows, the sizes, the raw pyzmq echo
baseline, peak-memory probes and the functions the benchmarks call on hosts.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import zmq

import colobus as cb

from . import raw_echo

__all__ = [
    "FULL", "QUICK", "BenchObject", "BenchRun", "PeakMemory", "RawEcho", "Row", "Sizes",
    "bench_inc", "bench_noop", "quotient", "rss_mib", "unmeasured_lines",
]

MiB = 1 << 20


# -- code that runs on the hosts (importable, so it travels by reference) -------------


@cb.colocated_python
def bench_noop(x: Any) -> None:
    """The no-op call: returns nothing, so no output is stored."""
    return None


@cb.colocated_python
def bench_inc(x: Any) -> Any:
    """One link of the dependent-call chain."""
    return x + 1


@cb.colocated_python_class
class BenchObject:
    """A trivial colocated object: construct plus first call."""

    def __init__(self, n: int) -> None:
        self.n = n

    def ping(self, x: Any) -> None:
        return None

    def ident(self, x: Any) -> Any:
        """``return x`` as a method."""
        return x


# -- results -------------------------------------------------------------------------------


@dataclass
class Row:
    """One benchmark figure: colobus, the raw baseline, and their ratio."""

    name: str
    unit: str
    colobus: float
    baseline: float
    better: str  # "lower" or "higher"
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    peers: dict[str, dict[str, Any]] = field(default_factory=dict)  # see bench_peers

    @property
    def ratio(self) -> float:
        return quotient(self.colobus, self.baseline)

    def unmeasured(self) -> list[str]:
        """The figures of this row that could not be computed (NaN: a divisor read 0)."""
        figures = {"colobus": self.colobus, "baseline": self.baseline, "ratio": self.ratio,
                   **self.extra}
        return [name for name, value in figures.items()
                if isinstance(value, float) and math.isnan(value)]

    def as_dict(self) -> dict[str, Any]:
        doc = {"unit": self.unit, "colobus": self.colobus, "baseline": self.baseline,
               "ratio": self.ratio, "better": self.better, "note": self.note, **self.extra,
               "peers": self.peers}
        # JSON has no NaN: a figure that could not be computed is null
        return {k: None if isinstance(v, float) and math.isnan(v) else v
                for k, v in doc.items()}


def quotient(num: float, den: float) -> float:
    """``num / den``, or NaN where ``den`` is 0 or not finite.

    A clock of coarse resolution (the process CPU clock under gVisor, say) can read 0
    over a short run; the figure divided by it is then unknown, never a crash. The
    table prints it as ``n/a`` and the run's last lines name it (:func:`unmeasured_lines`).
    """
    if not den or not math.isfinite(den):
        return float("nan")
    return num / den


def unmeasured_lines(rows: list[Row]) -> list[str]:
    """One line naming every figure the run could not compute (none: no line)."""
    missing = [f"{row.name} {name}" for row in rows for name in row.unmeasured()]
    if not missing:
        return []
    return [f"not measured ({len(missing)}): {', '.join(missing)}: a clock read 0 over its "
            "run (too coarse a clock here for so short a run; a longer run, without "
            "--quick, may measure them)"]


@dataclass(frozen=True)
class Sizes:
    latency_calls: int
    pipelined_calls: int
    window: int
    object_reps: int
    transfer: tuple[tuple[str, int, int], ...]  # (label, bytes, reps)
    chain_reps: int
    chain_len: int = 100


FULL = Sizes(latency_calls=2000, pipelined_calls=20000, window=1000, object_reps=40,
             transfer=(("small", 1 * MiB, 20), ("medium", 64 * MiB, 7), ("large", 256 * MiB, 5)),
             chain_reps=5)
QUICK = Sizes(latency_calls=200, pipelined_calls=3000, window=1000, object_reps=8,
              transfer=(("small", 1 * MiB, 5), ("medium", 8 * MiB, 3), ("large", 32 * MiB, 2)),
              chain_reps=2)


# -- /proc memory --------------------------------------------------------------------------


def _status_kib(pid: int, field_name: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise KeyError(field_name)


def rss_mib(pid: int | str = "self") -> float:
    """Resident set size of ``pid`` (default: this process) in MiB, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class PeakMemory:
    """Peak RSS growth of some processes over a block (``VmHWM`` after a reset).

    Writing ``5`` to ``/proc/PID/clear_refs`` resets ``VmHWM`` to the current
    RSS, so the peak covers only the measured block. Where the kernel refuses,
    the lifetime peak is used (then the figure may overstate).
    """

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.before: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.exact = True

    def __enter__(self) -> PeakMemory:
        for name, pid in self.pids.items():
            try:
                with open(f"/proc/{pid}/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                self.exact = False
            self.before[name] = _status_kib(pid, "VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        for name, pid in self.pids.items():
            self.peak[name] = max(0, _status_kib(pid, "VmHWM") - self.before[name]) * 1024


# -- the raw pyzmq baseline ---------------------------------------------------------------


class RawEcho:
    """A ROUTER here and ``n`` DEALER echo servers in subprocesses, over ipc."""

    def __init__(self, n: int = 1) -> None:
        self.n = n
        self.path = os.path.join(tempfile.gettempdir(), f"colobus-bench-{os.getpid()}.sock")
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.bind(f"ipc://{self.path}")
        self.ids = [f"s{i}".encode() for i in range(n)]
        # Run by path: the echo server imports pyzmq alone, not colobus (and JAX), so it
        # is up in a fraction of a second even on a loaded machine.
        self.procs = [subprocess.Popen([sys.executable, raw_echo.__file__, f"ipc://{self.path}",
                                        i.decode()]) for i in self.ids]
        self.sock.setsockopt(zmq.RCVTIMEO, 60_000)
        for _ in range(n):
            self.sock.recv_multipart()  # hello
        self.sock.setsockopt(zmq.RCVTIMEO, -1)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        for i in self.ids:
            self.sock.send_multipart([i, b"q"])
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.sock.close(0)
        self.ctx.term()
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def __enter__(self) -> RawEcho:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def round_trips(self, n: int, hosts: int = 1) -> list[float]:
        """``n`` blocking round trips (to ``hosts`` servers at once); seconds each."""
        sock, ids, payload = self.sock, self.ids[:hosts], b"x" * 200
        out = []
        for _ in range(n + n // 10):
            t = time.perf_counter()
            for i in ids:
                sock.send_multipart([i, b"e", payload])
            for _ in ids:
                sock.recv_multipart()
            out.append(time.perf_counter() - t)
        return out[n // 10:]

    def pipelined(self, total: int, window: int, hosts: int = 1) -> float:
        """Round trips per second with ``window`` in flight per server."""
        sock, ids, payload = self.sock, self.ids[:hosts], b"x" * 200
        t = time.perf_counter()
        sent = recv = 0
        for _ in range(min(window, total)):
            for i in ids:
                sock.send_multipart([i, b"e", payload])
            sent += 1
        while recv < total * len(ids):
            sock.recv_multipart()
            recv += 1
            if sent < total and recv % len(ids) == 0:
                for i in ids:
                    sock.send_multipart([i, b"e", payload])
                sent += 1
        return quotient(total, time.perf_counter() - t)

    def put(self, buf: np.ndarray[Any, Any]) -> float:
        """Send ``buf`` zero-copy to server 0 and wait for its ack; seconds."""
        t = time.perf_counter()
        self.sock.send_multipart([self.ids[0], b"p", buf.data], copy=False)
        self.sock.recv_multipart()
        return time.perf_counter() - t

    def get(self) -> tuple[float, Any]:
        """Fetch the kept buffer from server 0 (zero-copy); seconds and the data."""
        t = time.perf_counter()
        self.sock.send_multipart([self.ids[0], b"g"])
        frames = self.sock.recv_multipart(copy=False)
        data = np.frombuffer(frames[2].buffer, np.uint8)
        return time.perf_counter() - t, data


def _median_us(xs: list[float]) -> float:
    return statistics.median(xs) * 1e6


def _one_device_array(ctl: cb.Controller, host: int = 0) -> Any:
    dev = next(d for d in ctl.devices() if d.host == host)
    return cb.device_put(np.zeros(4, np.float32), dev)


def _fanout_array(ctl: cb.Controller, hosts: int) -> Any:
    devs = [next(d for d in ctl.devices() if d.host == h) for h in range(hosts)]
    mesh = cb.Mesh(np.array(devs, dtype=object), ("hosts",))
    return cb.device_put(np.zeros(hosts, np.float32),
                         cb.NamedSharding(mesh, cb.PartitionSpec("hosts")))


def _format_row(row: Row) -> str:
    fmt = "{:>12,.1f}" if row.unit != "GB/s" else "{:>12.2f}"

    def figure(value: float) -> str:
        return fmt.format(value) if math.isfinite(value) else f"{'n/a':>12}"

    ratio = row.ratio
    worse = ratio if row.better == "lower" else quotient(1.0, ratio)
    if math.isnan(worse):
        return (f"{row.name:<26} {figure(row.colobus)} {figure(row.baseline)} "
                f"{row.unit:<8} ratio    n/a  (not measured: see the last lines)")
    return (f"{row.name:<26} {figure(row.colobus)} {figure(row.baseline)} "
            f"{row.unit:<8} ratio {ratio:6.2f}  ({worse:.2f}x raw's cost)")


class BenchRun(Protocol):
    """What a group of benchmarks uses of the run it belongs to."""

    sizes: Sizes

    def add(self, row: Row) -> None: ...
