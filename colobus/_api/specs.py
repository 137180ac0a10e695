"""The specs of a colocated call: what a leaf's spec is as the hosts see it, the
checks of a call's inputs and outputs against the specs it was given, and a
``specialize`` merged into what was given before (each once)."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .._controller.future import Future
from .._model.devices import Device
from .._model.sharding import ShapeDtypeStruct
from .array import Array
from .serialization import ColocatedObjectBase, arg_path

__all__ = ["merge_check", "merge_specialization"]


def _as_seen_on_hosts(dtype: Any) -> Any:
    """The dtype user code on a host sees: JAX's canonical one (int64 -> int32 unless x64)."""
    if isinstance(dtype, np.dtype) and dtype.kind in "biufc":
        import jax

        return np.dtype(jax.dtypes.canonicalize_dtype(dtype))
    return dtype


def _spec_of_leaf(x: Any) -> Any:
    if isinstance(x, Array):
        return ShapeDtypeStruct(x.shape, _as_seen_on_hosts(x.dtype), x.sharding)
    if isinstance(x, np.ndarray | np.generic):
        return ShapeDtypeStruct(x.shape, x.dtype)
    return x


def _is_handle(x: Any) -> bool:
    return isinstance(x, Array | Future | ColocatedObjectBase)


@functools.lru_cache(maxsize=64)
def _positional_treedef(n: int) -> Any:
    """The tree of ``(args, kwargs)`` for ``n`` positional handles and no keywords."""
    import jax

    return jax.tree_util.tree_structure((tuple(range(n)), {}))


def _check_specs(actual: Any, expected: Any, what: str, *, inputs: bool = False) -> None:
    import jax

    a_leaves, a_tree = jax.tree_util.tree_flatten_with_path(actual, is_leaf=_is_handle)
    e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
    a_struct: Any = jax.tree_util.tree_structure(actual, is_leaf=_is_handle)
    if a_struct != e_tree:
        raise ValueError(
            f"{what} do not match the specs: expected structure {e_tree}, got {a_tree}")
    for (path, a), e in zip(a_leaves, e_leaves, strict=True):
        if not isinstance(e, ShapeDtypeStruct) or isinstance(a, Future):
            continue
        shape = getattr(a, "shape", None)
        dtype = getattr(a, "dtype", None)
        where = arg_path(path) if inputs else "output" + jax.tree_util.keystr(tuple(path))
        if shape is None or tuple(shape) != tuple(e.shape):
            raise ValueError(f"{what}: {where}: expected shape {tuple(e.shape)}, got "
                             f"{None if shape is None else tuple(shape)}")
        if _as_seen_on_hosts(dtype) != _as_seen_on_hosts(e.dtype):
            raise ValueError(f"{what}: {where}: expected dtype {e.dtype}, got {dtype}")


def merge_specialization(current: tuple[Any, Any, Any], in_specs: Any,
                         out_specs_fn: Any, devices: Any) -> tuple[Any, Any, Any]:
    cur_in, cur_out, cur_dev = current
    if in_specs is not None and cur_in is not None:
        raise ValueError("in_specs already specified")
    if out_specs_fn is not None and cur_out is not None:
        raise ValueError("out_specs_fn already specified")
    if devices is not None and cur_dev is not None:
        raise ValueError("devices already specified")
    if devices is not None:
        devices = tuple(np.asarray(devices, dtype=object).flat) if isinstance(
            devices, np.ndarray) else tuple(devices)
        if not devices or not all(isinstance(d, Device) for d in devices):
            raise ValueError("devices must be a non-empty sequence of colobus Devices")
    return (in_specs if in_specs is not None else cur_in,
            out_specs_fn if out_specs_fn is not None else cur_out,
            devices if devices is not None else cur_dev)


def merge_check(current: bool, given: bool | None) -> bool:
    """``specialize(check_replicas=...)`` over what was given before (each once)."""
    if given is None:
        return current
    if current:
        raise ValueError("check_replicas already specified")
    return bool(given)
