"""Host-side helpers for the issue-23 tests (``test_edges.py``).

Importable on the workers (they inherit ``sys.path``), so these travel by
reference and their module state persists on each host between calls.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

import colobus as cb


def _wait_for_file(path: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.005)


@cb.colocated_python
def block(gate: str) -> Any:
    """Block a worker thread until ``gate`` exists (the test creates it)."""
    _wait_for_file(gate)
    return np.int32(1)


@cb.colocated_python
def token(n: int) -> Any:
    return np.int32(n)


@cb.colocated_python
def ident(x: Any) -> Any:
    return x
