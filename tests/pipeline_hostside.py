"""Host-side helpers of the pipelined-call tests (``test_slices.py``, ``test_bursts.py``).

Importable on the workers (they inherit ``sys.path``), so these travel by reference.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

import colobus as cb


@cb.colocated_python
def touch(path: str) -> Any:
    """Make the file ``path`` (a call of another stream lets a waiting call go on)."""
    with open(path, "w"):
        pass
    return np.int32(1)


def wait_for_path(path: str, seconds: float) -> Any:
    """On the host, inside a method: wait until the file ``path`` exists (at most
    ``seconds``); whether it does, as an int32 (the method's output)."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.001)
    return np.int32(os.path.exists(path))


def like_on_host0(ctl: cb.Controller) -> Any:
    """An array on host 0's first device: an object's methods take it (it places them)."""
    dev = next(d for d in ctl.devices() if d.host == 0)
    return cb.device_put(np.zeros(1, np.float32), cb.SingleDeviceSharding(dev))


async def value(x: Any) -> Any:
    """A call's (or an array's) value, as numpy."""
    return np.asarray(await cb.device_get(await x if isinstance(x, cb.Future) else x))


async def call(fn: Any, *args: Any) -> Any:
    """``fn(*args)``'s value: made inside the awaiting task (its own stream)."""
    return await value(fn(*args))
