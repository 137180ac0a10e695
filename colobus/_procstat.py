"""This process's resident memory and CPU time, as a worker reports them in heartbeats."""

from __future__ import annotations

import os
import resource
import sys
import time

__all__ = ["cpu_ns", "rss_bytes"]

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
