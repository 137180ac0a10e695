"""Probe: 256 MiB from one process to another through shared memory.

A fresh segment per transfer against one reused segment whose pages stay
mapped on both sides. Run: ``python benchmarks/shm_probe.py``. Findings and
what they mean for colobus: docs/performance.md ("Shared memory for hosts on
the controller's machine").
"""

from __future__ import annotations

import os
import time
from multiprocessing import Pipe, Process, resource_tracker, shared_memory
from multiprocessing.connection import Connection

import numpy as np

N = 256 << 20
REPS = 6


def receiver(conn: Connection) -> None:
    """Attach to the named segment (again if fresh) and touch every page of it."""
    seg: shared_memory.SharedMemory | None = None
    while (msg := conn.recv()) is not None:
        name, fresh = msg
        if seg is None or fresh:
            if seg is not None:
                seg.close()
            seg = shared_memory.SharedMemory(name=name)
            # Python 3.11 tracks attached segments too; the creator unlinks them.
            resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
        view = np.ndarray((N,), np.uint8, buffer=seg.buf)
        conn.send(int(view[::4096].sum()))
        del view
    if seg is not None:
        seg.close()


def main() -> None:
    data = np.ones(N, np.uint8)
    here, there = Pipe()
    proc = Process(target=receiver, args=(there,))
    proc.start()
    for mode in ("fresh", "reused"):
        rates = []
        seg: shared_memory.SharedMemory | None = None
        for _ in range(REPS):
            t = time.perf_counter()
            new = seg is None or mode == "fresh"
            if new:
                if seg is not None:
                    seg.close()
                    seg.unlink()
                seg = shared_memory.SharedMemory(create=True, size=N)
            assert seg is not None
            np.copyto(np.ndarray((N,), np.uint8, buffer=seg.buf), data)
            here.send((seg.name, new))
            here.recv()
            rates.append(N / (time.perf_counter() - t) / 1e9)
        print(f"{mode:<7} GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}:",
              " ".join(f"{r:.2f}" for r in rates), "GB/s")
        if seg is not None:
            seg.close()
            seg.unlink()
    here.send(None)
    proc.join()


if __name__ == "__main__":
    main()
