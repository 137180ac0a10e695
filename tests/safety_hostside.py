"""Host-side helpers of tests/test_jaxjob_safety.py (importable on the workers)."""

from __future__ import annotations

from typing import Any

import colobus as cb


@cb.colocated_python
def hold_the_gil_until(x: Any, started: str, fifo: str) -> Any:
    """A host busy the hardest way: it says it started, then blocks in C holding the GIL
    (libc's ``open`` and ``read`` of a FIFO through ``ctypes.PyDLL``, which never
    releases it) until the test writes a byte. Nothing else of the worker's Python runs
    meanwhile: it cannot even hear that its session ended."""
    import ctypes
    import os

    open(started, "w").close()
    libc = ctypes.PyDLL(None)
    libc.open.restype = ctypes.c_int
    fd = libc.open(fifo.encode(), os.O_RDONLY)
    byte = ctypes.create_string_buffer(1)
    libc.read(fd, byte, 1)
    libc.close(fd)
    return x
