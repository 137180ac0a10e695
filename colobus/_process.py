"""A colobus process's own runtime settings, each where it pays for itself: the
startup objects frozen out of the collector's scans (below), the asyncio loop's clock
(``quick_loop``), huge pages for large receives and malloc heaps kept grown (their
comments further down).

A controller or worker imports JAX and numpy before its first call: about
100,000 objects that live as long as the process. CPython's collector scans
its oldest generation again whenever enough objects have survived into it, and
calls in flight keep a steady stream of futures, operations and messages
surviving long enough to get there, so each full collection walks all of
JAX's objects too. Measured with 1,000 calls in flight, that was about 6 us of
controller CPU per call (37 -> 31 us). ``gc.freeze()`` moves every object that
exists at that moment into a permanent generation the collector never scans;
objects are still freed by reference counting as usual, and everything made
later is collected as before. What freezing costs: an object alive at that
moment that later becomes part of unreachable reference cycles is never
reclaimed (so colobus freezes once per process, right after a full collection).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import platform
import sys
import threading
import time
from typing import TypeVar

__all__ = ["available", "freeze_once", "keep_heaps", "quick_loop", "reexec_with_huge_pages",
           "with_huge_pages"]

log = logging.getLogger("colobus.gc")
_L = TypeVar("_L", bound=asyncio.AbstractEventLoop)

_lock = threading.Lock()
_frozen = False


def quick_loop(loop: _L) -> _L:
    """Give an asyncio loop C callables for ``time`` and ``get_debug``, which it calls
    on every turn (``time`` twice while a timer is scheduled) and for every future it
    makes: ``time.monotonic`` is what ``BaseEventLoop.time`` returns, and ``getattr(loop,
    "_debug")`` what ``get_debug`` does, each without a Python frame (3-4 Python calls
    per colobus call on each side). Only a loop whose class keeps asyncio's own two
    methods is changed (a loop with a clock of its own, uvloop's, are left as they are).
    Returns ``loop``.
    """
    base = asyncio.BaseEventLoop
    cls = type(loop)
    if (getattr(cls, "time", None) is not base.time
            or getattr(cls, "get_debug", None) is not base.get_debug):
        return loop
    loop.time = time.monotonic  # type: ignore[method-assign]
    loop.get_debug = functools.partial(getattr, loop, "_debug")  # type: ignore[method-assign]
    return loop


def freeze_once() -> bool:
    """Collect, then freeze what is alive; only the first call in a process does it.

    Returns:
        Whether this call froze anything.
    """
    global _frozen
    with _lock:
        if _frozen:
            return False
        _frozen = True
        gc.collect()
        gc.freeze()
    log.debug("froze %d startup objects out of the garbage collector's scans",
              gc.get_freeze_count())
    return True


# Transparent huge pages for large buffers, through glibc's malloc tunable.
#
# Receiving a large message is bound by page faults on its fresh buffer (about
# 2 GB/s on a small VM): libzmq allocates the buffer with ``malloc`` and the
# kernel maps it 4 KiB at a time. With ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``
# glibc (2.35 and later) asks for transparent huge pages on its large mappings,
# 512 times fewer faults, and the same receive runs at 4-5 GB/s. glibc reads
# tunables only at process start, so colobus sets the variable in the
# environment of the processes it starts (``local_cluster`` workers) and re-runs
# ``colobus worker`` and ``colobus bench`` with it. ``COLOBUS_HUGE_PAGES=0``
# turns this off; a ``glibc.malloc.hugetlb`` setting of the user's own stands.
hplog = logging.getLogger("colobus.hugepages")

TUNABLE = "glibc.malloc.hugetlb=1"
OFF_ENV = "COLOBUS_HUGE_PAGES"  # "0": leave malloc alone
_DONE_ENV = "COLOBUS_HUGE_PAGES_EXEC"  # set across the re-exec: never loop


def available() -> bool:
    """Linux with glibc 2.35+ and transparent huge pages not switched off."""
    if not sys.platform.startswith("linux"):
        return False
    lib, version = platform.libc_ver()
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        return False
    if lib != "glibc" or (major, minor) < (2, 35):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def with_huge_pages(env: dict[str, str]) -> dict[str, str]:
    """A copy of ``env`` that asks glibc's malloc for huge pages (where it helps)."""
    env = dict(env)
    if env.get(OFF_ENV, "1") == "0" or not available():
        return env
    current = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in current:
        return env  # the user's own choice stands
    env["GLIBC_TUNABLES"] = f"{current}:{TUNABLE}" if current else TUNABLE
    return env


def reexec_with_huge_pages() -> None:
    """Re-run this command (same process id, arguments and descriptors) with huge
    pages on, unless they are on already, unavailable or turned off. Call it
    before reading stdin or starting threads."""
    if os.environ.get(_DONE_ENV):
        return
    env = with_huge_pages(dict(os.environ))
    if env.get("GLIBC_TUNABLES") == os.environ.get("GLIBC_TUNABLES"):
        return
    env[_DONE_ENV] = "1"
    argv = [sys.executable, *sys.orig_argv[1:]]
    hplog.debug("re-running with %s", env["GLIBC_TUNABLES"])
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, env)
    except OSError as exc:  # carry on without: only speed is lost
        hplog.warning("could not re-run with huge pages on: %s", exc)


# Threads' malloc heaps that stay grown.
#
# glibc gives each thread that allocates an arena of its own. A non-main arena's heap
# grows with ``mprotect`` and, whenever a free leaves more than ``M_TRIM_THRESHOLD``
# (128 KiB, or what glibc's dynamic threshold has raised it to) free at its top, shrinks
# with ``madvise(MADV_DONTNEED)``: the next growth faults the same pages in again. A
# host keeps each call's outputs until the controller frees them, so the heap of the
# thread that runs the calls grows with every call and shrinks with every batch of
# frees. Where system calls and page faults are slow (the lent TPU VM's sandbox: 6 us a
# system call), JAX's dispatch of a small step on such a thread took 470-600 us instead
# of 330 (benchmarks/NOTES.md, "Issue 64, third pass"). A 16 MiB pad on each growth,
# a 64 MiB trim threshold and the mmap threshold fixed at glibc's own dynamic ceiling
# (32 MiB: smaller blocks come from the heaps, as once that threshold has risen) keep
# the heaps grown. What it costs: up to 64 MiB of freed memory an arena keeps instead of
# returning it to the system. ``COLOBUS_MALLOC_HEAPS=0`` leaves malloc alone, and so does
# a ``GLIBC_TUNABLES`` that sets any of these itself.
heaplog = logging.getLogger("colobus.malloc")
HEAPS_ENV = "COLOBUS_MALLOC_HEAPS"
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_HEAPS = ((_M_TOP_PAD, 16 << 20), (_M_TRIM_THRESHOLD, 64 << 20), (_M_MMAP_THRESHOLD, 32 << 20))
_OWN = ("glibc.malloc.top_pad", "glibc.malloc.trim_threshold", "glibc.malloc.mmap_threshold")
heaps_kept = False  # whether this process made the settings (read by the tests)


def keep_heaps() -> bool:
    """Keep this process's malloc heaps grown (glibc only; see above). The settings are
    the allocator's, for every thread's arena, whenever it is called; a worker calls it
    at its start.

    Returns:
        Whether the settings were made.
    """
    if os.environ.get(HEAPS_ENV, "1") == "0":
        return False
    if any(name in os.environ.get("GLIBC_TUNABLES", "") for name in _OWN):
        return False  # the user's own choice stands
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    made = all(mallopt(param, value) == 1 for param, value in _HEAPS)
    heaplog.debug("malloc heaps kept grown: %s", made)
    global heaps_kept
    heaps_kept = made
    return made
