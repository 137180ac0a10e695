"""Transparent huge pages for large buffers, through glibc's malloc tunable.

Receiving a large message is bound by page faults on its fresh buffer (about
2 GB/s on a small VM): libzmq allocates the buffer with ``malloc`` and the
kernel maps it 4 KiB at a time. With ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``
glibc (2.35 and later) asks for transparent huge pages on its large mappings,
512 times fewer faults, and the same receive runs at 4-5 GB/s. glibc reads
tunables only at process start, so colobus sets the variable in the
environment of the processes it starts (``local_cluster`` workers) and re-runs
``colobus worker`` and ``colobus bench`` with it. ``COLOBUS_HUGE_PAGES=0``
turns this off; a ``glibc.malloc.hugetlb`` setting of the user's own stands.
"""

from __future__ import annotations

import logging
import os
import platform
import sys

__all__ = ["available", "reexec_with_huge_pages", "with_huge_pages"]

log = logging.getLogger("colobus.hugepages")

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
    log.debug("re-running with %s", env["GLIBC_TUNABLES"])
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, env)
    except OSError as exc:  # carry on without: only speed is lost
        log.warning("could not re-run with huge pages on: %s", exc)
