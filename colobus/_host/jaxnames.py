"""In host code, ``jax.process_index()`` and ``jax.process_count()`` answer colobus's.

A worker is a JAX process of its own (the block model) or one process of the
cluster's JAX job (``jax_distributed``). In a job JAX's own answers already are the
host's index and the cluster's host count; in the block model JAX's are 0 and 1 on
every host, which silently sends every host to the same data shard or file. So the
worker makes JAX's public functions answer the colobus host index and host count
once it joined a controller (:mod:`colobus._model.jaxside` holds them), in every
form user code reaches them: ``jax.process_index()``, ``from jax import
process_index`` (the same function object), and a function pickled by value that
names it (cloudpickle names JAX's function by its module,
``jax._src.xla_bridge.process_index``, which is replaced too).

JAX itself calls the same ``xla_bridge`` functions to decide which devices are this
process's (its dispatch, meshes, arrays). Those callers, and JAX's own libraries
(``jax.experimental.multihost_utils`` and the like, which compute across JAX
processes), still get JAX's answer: the replacement looks at its caller's module,
and answers colobus's values only to code outside ``jax`` and ``jaxlib``. Only the
worker process is changed, never the controller's.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from .._model import jaxside

__all__ = ["answer_colobus_process_index"]

_done = False


def _jax_caller() -> bool:
    """Whether the function that called our replacement's caller is JAX's own."""
    name = sys._getframe(2).f_globals.get("__name__", "")
    return (type(name) is str and name.startswith(("jax.", "jaxlib."))) or name in ("jax", "jaxlib")


def _index(original: Callable[..., int]) -> Callable[..., int]:
    @functools.wraps(original)
    def process_index(backend: Any = None) -> int:
        host = jaxside._host  # (read inline: this runs inside JAX's own dispatch too)
        if host is None or _jax_caller():
            return original(backend)
        return host

    return process_index


def _count(original: Callable[..., int]) -> Callable[..., int]:
    @functools.wraps(original)
    def process_count(backend: Any = None) -> int:
        if jaxside._host is None or _jax_caller():
            return original(backend)
        return jaxside.host_count()

    process_count.cache_clear = getattr(original, "cache_clear", lambda: None)  # type: ignore[attr-defined]
    return process_count


def _indices(original: Callable[..., list[int]]) -> Callable[..., list[int]]:
    @functools.wraps(original)
    def process_indices(backend: Any = None) -> list[int]:
        if jaxside._host is None or _jax_caller():
            return original(backend)
        return list(range(jaxside.host_count()))

    return process_indices


def answer_colobus_process_index(jax: Any) -> None:
    """Make ``jax.process_index`` / ``process_count`` / ``process_indices`` (and their
    old names ``host_id`` / ``host_count``) answer colobus's values in host code.

    Called once by the worker, right after it imports JAX and before any user code runs.
    """
    global _done
    if _done:
        return
    _done = True
    from jax._src import xla_bridge

    for name, wrap in (("process_index", _index), ("process_count", _count),
                       ("process_indices", _indices), ("host_id", _index),
                       ("host_count", _count)):
        original = getattr(xla_bridge, name, None)
        if original is None:
            continue
        replaced = wrap(original)
        setattr(xla_bridge, name, replaced)
        if getattr(jax, name, None) is original:
            setattr(jax, name, replaced)
