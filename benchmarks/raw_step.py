"""The floor under an awaited step: the same step behind a raw pyzmq echo server.

An awaited step through colobus pays, besides colobus's own Python on both sides, what
any design that sends each step over ZeroMQ pays on the machine: the two processes'
wake-ups (each slept while the other worked, the caller for the whole step), ZeroMQ's
I/O threads, and a step that starts on threads that slept. This measures that part
alone: a server process holds ``accelerator_check.Trainer(kind)`` and answers a
blocking DEALER's requests with nothing else (no colobus, no asyncio, no MAC, no
pickling): ``s`` runs one step and waits for it, ``n`` answers at once, ``q`` quits.
The driver, a blocking ROUTER on ``ipc://`` (the lent machines open no TCP socket),
times them one at a time:

* ``awaited_us``: the median of awaited steps (request, step, ``block_until_ready``,
  reply);
* ``round_trip_us``: the median of no-op requests, right after.

``(awaited_us - plain awaited) / round_trip_us`` is the extra an awaited step costs in
that design's own round trips; ``awaited_us - plain awaited``, in microseconds, is the
part of colobus's extra that is the machine's. Used by ``small_step.py`` (a third side
of each pair) and ``accelerator_check.py`` (after the plain side, alone on the chip).

    python benchmarks/raw_step.py mlp          # one measurement, printed as JSON
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import zmq

START_TIMEOUT_MS = 600_000  # the server's first step compiles (an accelerator's: minutes)


def serve(address: str, kind: str) -> None:
    """The server process: the step, on request (blocking DEALER)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from accelerator_check import Trainer

    trainer = Trainer(kind)
    for _ in range(20):  # compiled and warm, as the plain side's
        trainer.step().block_until_ready()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send(b"ready")
    while True:
        op = sock.recv()
        if op == b"s":
            trainer.step().block_until_ready()
        elif op != b"n":
            break
        sock.send(b"d")
    sock.close(0)
    ctx.term()


class RawStep:
    """A raw server holding the step, kept until :meth:`close`."""

    def __init__(self, kind: str) -> None:
        self._dir = tempfile.mkdtemp(prefix="colobus-raw-step-")
        address = f"ipc://{self._dir}/s"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__),
                                       "--serve", address, kind])
        if not self._sock.poll(START_TIMEOUT_MS):
            self.close()
            raise RuntimeError("the raw step server did not start")
        self._peer = self._sock.recv_multipart()[0]

    def _times(self, op: bytes, n: int) -> float:
        sock, peer, out = self._sock, self._peer, []
        for _ in range(n):
            t0 = time.perf_counter()
            sock.send_multipart([peer, op])
            sock.recv_multipart()
            out.append(time.perf_counter() - t0)
        return statistics.median(out) * 1e6

    def awaited(self, steps: int) -> float:
        """The median awaited step (us)."""
        return self._times(b"s", steps)

    def round_trip(self, trips: int) -> float:
        """The median no-op round trip (us)."""
        return self._times(b"n", trips)

    def close(self) -> None:
        if self._proc.poll() is None and hasattr(self, "_peer"):
            self._sock.send_multipart([self._peer, b"q"])
        try:
            self._proc.wait(60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._sock.close(0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def raw_timings(kind: str, steps: int, trips: int) -> dict[str, Any]:
    """One server for ``kind``: its median awaited step and no-op round trip (us)."""
    raw = RawStep(kind)
    try:
        raw.awaited(max(5, steps // 10))  # warm
        return {"awaited_us": raw.awaited(steps), "round_trip_us": raw.round_trip(trips)}
    finally:
        raw.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2], sys.argv[3])
    else:
        print(json.dumps(raw_timings(sys.argv[1] if len(sys.argv) > 1 else "mlp", 100, 100)))
