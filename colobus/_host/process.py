"""The worker process itself: its memory and CPU figures, and the end of its ZeroMQ context."""

from __future__ import annotations

import logging
import os
import resource
import sys
import threading
import time
from typing import Any

import zmq

__all__ = ["cpu_ns", "end_context", "rss_bytes"]

log = logging.getLogger("colobus.worker")


def end_context(ctx: zmq.Context[Any], timeout: float = 0.5) -> None:
    """Close ``ctx``'s sockets and terminate it, waiting at most ``timeout``.

    ZeroMQ resolves a ``tcp://NAME:PORT`` endpoint on its I/O thread, and
    termination waits for that thread: with the driver's name gone (its
    container stopped) and DNS timing out, that can take many seconds. The
    worker is exiting, so it does not wait for more than ``timeout``.
    """
    ender = threading.Thread(target=ctx.destroy, kwargs={"linger": 0},
                             name="colobus-zmq-term", daemon=True)
    ender.start()
    ender.join(timeout)
    if ender.is_alive():
        log.debug("ZeroMQ context still terminating after %.1f s (a name lookup?); "
                  "exiting without it", timeout)


# This process's resident memory and CPU time, as a worker reports them in heartbeats.
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Resident set size now (Linux ``/proc``); elsewhere the peak, from ``getrusage``."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # macOS: bytes; else KiB


def cpu_ns() -> int:
    """CPU time of this process so far (user + system, all threads), in ns."""
    return time.process_time_ns()
