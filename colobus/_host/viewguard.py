"""Host code that seems written for the other view is told so (SPEC 13).

A call on several hosts runs in the global view (the hosts form one JAX job: each array
argument is the global ``jax.Array``) or in the block view (each argument is this host's
block). Code written for one view and run in the other fails inside JAX with a long
message of shapes, or, worse, runs and misplaces data. Two guards, neither on a call's
common path:

- :func:`note_view`: an error raised inside JAX by a spread call's host code gets one
  note naming the view it ran in and ``jax_distributed`` (only when it failed).
- :func:`guard_builders`: in the block view, host code that builds an array
  (``jax.make_array_from_callback``, ``jax.make_array_from_single_device_arrays``,
  ``jax.device_put``) with the sharding of a ``cb.ShapeDtypeStruct`` but with that
  struct's *global* shape instead of this host's block of it is warned once per
  process (each host would hold the whole array: a result of hosts times its size).
  What cannot be told apart is not guessed at: a shard's ``index`` or
  ``jax.process_index()`` mean the block's place in the block view, and the global
  place in the global view, and host code reads them the same way in both.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import TracebackType
from typing import Any

from .._model import jaxside

__all__ = ["guard_builders", "note_view"]

log = logging.getLogger("colobus.worker")

JOB_NOTE = ("colobus: this call ran in the global view (the hosts form one JAX job): each array "
            "argument is the global jax.Array, only its addressable shards this host's. Host "
            "code written for the block view (each host its own block) runs with "
            "jax_distributed=False")
BLOCK_NOTE = ("colobus: this call ran in the block view: each array argument is this host's "
              "block of the global array, and arrays host code builds are blocks. Host code "
              "written for global arrays (multi-controller JAX, Pathways) needs the global "
              "view: jax_distributed=True (the default where the hosts can form a JAX job)")


def _in_jax(tb: TracebackType | None) -> bool:
    """Whether the innermost frame of ``tb`` is JAX's (or jaxlib's)."""
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    if last is None:
        return False
    name = last.tb_frame.f_globals.get("__name__", "")
    return type(name) is str and name.split(".", 1)[0] in ("jax", "jaxlib")


def note_view(exc: BaseException, in_job: bool) -> None:
    """Add the view's note to ``exc`` (a spread call's failure) where JAX raised it, or
    raised what it was raised from."""
    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 4:
        if type(e).__module__.split(".", 1)[0] in ("jax", "jaxlib") or _in_jax(e.__traceback__):
            exc.add_note(JOB_NOTE if in_job else BLOCK_NOTE)
            return
        e = e.__cause__ or e.__context__
        seen += 1


_warned = False


def _check(shape: Any, sharding: Any, what: str) -> None:
    """Warn once where ``shape`` is a struct's global shape over its block's sharding."""
    global _warned
    hit = jaxside.block_structs.get(id(sharding))
    if hit is None or hit[0] is not sharding or jaxside.in_job() or _warned:
        return
    try:
        same = tuple(shape) == hit[2]
    except TypeError:
        return
    if same:
        _warned = True
        log.warning(
            "colobus: host %s builds an array of shape %s with %s over the sharding of a "
            "ShapeDtypeStruct whose block on this host is %s: in the block view each host "
            "builds its own block, so this host would hold the whole array (the result is "
            "hosts times its size). Build the block (the struct's shape here), or run the "
            "global view: jax_distributed=True (the default where the hosts can form a JAX "
            "job). Said once.", jaxside._host, tuple(shape), what, hit[1])


def _guarded(original: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def build(shape: Any, sharding: Any, *args: Any, **kwargs: Any) -> Any:
        if jaxside.block_structs:
            _check(shape, sharding, name)
        return original(shape, sharding, *args, **kwargs)

    return build


def _guarded_put(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def device_put(x: Any, device: Any = None, *args: Any, **kwargs: Any) -> Any:
        if jaxside.block_structs and device is not None:
            shape = getattr(x, "shape", None)
            if shape is not None:
                _check(shape, device, "jax.device_put")
        return original(x, device, *args, **kwargs)

    return device_put


_done = False


def guard_builders(jax: Any) -> None:
    """Wrap JAX's array builders with the block view's check (once, in a worker, before
    any user code runs; JAX's own callers are unaffected but for one dict read)."""
    global _done
    if _done:
        return
    _done = True
    for name in ("make_array_from_callback", "make_array_from_single_device_arrays"):
        original = getattr(jax, name, None)
        if original is not None:
            setattr(jax, name, _guarded(original, f"jax.{name}"))
    put = getattr(jax, "device_put", None)
    if put is not None:
        jax.device_put = _guarded_put(put)
