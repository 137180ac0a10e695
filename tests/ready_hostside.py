"""Host-side helpers for the readiness tests (``test_accelerators.py``).

Importable on the workers (they inherit ``sys.path``), so these travel by
reference and their module state (the gate) persists on each host between calls.

JAX computes asynchronously, but a computation that waits on Python (a host
callback) is dispatched synchronously on CPU, so no real CPU computation can be
held open by an event. ``hold`` therefore stands in for "still computing" at
JAX's own surface: until the gate opens, ``is_ready()`` of the held array says
False and its ``block_until_ready()`` blocks, exactly as for a computation the
device has not finished. colobus's code is left as it is.
"""

from __future__ import annotations

import threading
from typing import Any

import colobus as cb

_gate = threading.Event()
_held: set[int] = set()
_patched: dict[str, Any] = {}


def _patch() -> None:
    from jax._src.array import ArrayImpl

    if _patched:
        return
    _patched.update(is_ready=ArrayImpl.is_ready, block=ArrayImpl.block_until_ready)

    def is_ready(self: Any) -> bool:
        if id(self) in _held and not _gate.is_set():
            return False
        return bool(_patched["is_ready"](self))

    def block_until_ready(self: Any) -> Any:
        if id(self) in _held:
            _gate.wait(60)
        return _patched["block"](self)

    ArrayImpl.is_ready = is_ready  # type: ignore[method-assign]
    ArrayImpl.block_until_ready = block_until_ready  # type: ignore[method-assign]


@cb.colocated_python
def hold(x: Any) -> Any:
    """``x * 2``, reported as still computing until :func:`release` opens the gate."""
    import jax

    _patch()
    _gate.clear()
    y = jax.jit(lambda a: a * 2)(x)
    _held.add(id(y))
    return y


@cb.colocated_python
def release(x: Any) -> Any:
    """Open the gate: the held arrays are computed now."""
    _gate.set()
    return x


@cb.colocated_python
def unpatch(x: Any) -> Any:
    """Put JAX's own methods back (after the test)."""
    from jax._src.array import ArrayImpl

    if _patched:
        ArrayImpl.is_ready = _patched.pop("is_ready")  # type: ignore[method-assign]
        ArrayImpl.block_until_ready = _patched.pop("block")  # type: ignore[method-assign]
    _held.clear()
    return x


@cb.colocated_python
def fail(x: Any) -> Any:
    raise LookupError("no such thing")


@cb.colocated_python
def long_computation(x: Any) -> Any:
    """A real CPU computation of a second or more, returned as JAX dispatched it."""
    import jax
    import jax.numpy as jnp

    a = jnp.full((768, 768), 1e-3, jnp.float32)
    step = jax.jit(lambda v: jax.lax.fori_loop(0, 40, lambda i, b: jnp.tanh(b @ a), a * v.sum()))
    return step(x)


@cb.colocated_python
def computed_here(x: Any) -> Any:
    """Whether JAX on this host says ``x`` is computed (without waiting for it)."""
    import numpy as np

    return np.asarray([x.is_ready()])
