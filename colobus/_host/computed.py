"""Whether JAX finished computing a host's value, and a wait for it on the calling thread.

JAX dispatches asynchronously: a call's output may still be computing when the call
returns. :func:`is_computed` asks without waiting; :func:`wait_computed` waits on this
thread (the loop's own waits are :meth:`colobus._host.arrays.HostArrays.computed`'s).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

__all__ = ["SPIN_SECONDS", "is_computed", "spins", "wait_computed"]

SPIN_SECONDS = 0.002  # how long a wait asks JAX (is_ready) before it blocks a thread


_SPINS: dict[int, tuple[Any, bool]] = {}  # id(sharding) -> (sharding, whether to ask on the loop)


def spins(value: Any) -> bool:
    """Whether a wait for ``value`` asks JAX on the loop first: for a value on an
    accelerator, not one on CPU devices (worked out once per sharding)."""
    sharding = getattr(value, "sharding", None)
    if sharding is None:
        return False
    got = _SPINS.get(id(sharding))
    if got is None or got[0] is not sharding:
        if len(_SPINS) >= 256:
            _SPINS.clear()
        spin = all(d.platform != "cpu" for d in sharding.device_set)
        got = _SPINS[id(sharding)] = (sharding, spin)
    return got[1]


def wait_computed(values: Any) -> None:
    """Wait on this thread until JAX computed every value of ``values`` (asked for up to
    ``SPIN_SECONDS`` first where the values are an accelerator's, as ``computed``)."""
    for value in values:
        if is_computed(value):
            continue
        if spins(value):
            until = time.monotonic() + SPIN_SECONDS
            while time.monotonic() < until:
                if is_computed(value):
                    break
            else:
                value.block_until_ready()
        else:
            value.block_until_ready()


def is_computed(value: Any) -> bool:
    """Whether a stored value's data is there: a ``jax.Array`` JAX still computes is not
    (JAX dispatches asynchronously); numpy data always is."""
    if isinstance(value, np.ndarray):
        return True
    check = getattr(value, "is_ready", None)
    return True if check is None else bool(check())
