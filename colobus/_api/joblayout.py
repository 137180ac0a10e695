"""In a JAX job, the global layout of each array argument, which host code sees.

A host stores its block of every array. In the cluster's JAX job
(``jax_distributed``) host code sees the global ``jax.Array`` instead, so a call
names, beside each array's ref, its global layout: shape, the mesh's global device
ids, shape and axis names, the spec and the memory kind, packed once per sharding and
shape (``[0, ref, layout]`` in the CALL's refs, ``colobus._wire.protocol.Call``). The
host turns its block into that global array once, and keeps it
(``colobus._host.jaxjob``). An array on one host's devices only needs none: its block
is the whole array.
"""

from __future__ import annotations

from typing import Any

import msgpack

from .._model.sharding import NamedSharding, SingleDeviceSharding
from .._wire import protocol as P
from .array import Array

__all__ = ["job_layout", "job_refs"]

_LAYOUTS: dict[tuple[int, tuple[int, ...]], tuple[Any, bytes | None]] = {}


def job_layout(arr: Array) -> bytes | None:
    """``arr``'s global layout, packed (None: one host holds all of it)."""
    sh = arr.sharding
    key = (id(sh), arr.shape)
    hit = _LAYOUTS.get(key)
    if hit is not None and hit[0] is sh:
        return hit[1]
    layout: bytes | None = None
    if isinstance(sh, NamedSharding) and len(sh.mesh.host_tuple) > 1:
        mesh = sh.mesh
        layout = msgpack.packb([list(arr.shape), "named", [d.id for d in mesh.devices.flat],
                                list(mesh.devices.shape), list(mesh.axis_names),
                                P.encode_spec(sh.spec), sh.memory_kind], use_bin_type=True)
    elif not isinstance(sh, NamedSharding | SingleDeviceSharding):  # pragma: no cover
        raise TypeError(f"no global layout for a {type(sh).__name__}")
    if len(_LAYOUTS) >= 1024:
        _LAYOUTS.clear()
    _LAYOUTS[key] = (sh, layout)  # (holds the sharding: its id stays its own)
    return layout


def job_refs(refs: list[list[int]], keep: list[Any]) -> list[Any]:
    """``refs`` with each array's global layout beside its ref (``keep``: the handles
    the refs name, in the same order)."""
    out: list[Any] = []
    for ref, handle in zip(refs, keep, strict=True):
        if ref[0] == 0 and isinstance(handle, Array):
            layout = job_layout(handle)
            if layout is not None:
                out.append([0, ref[1], layout])
                continue
        out.append(ref)
    return out
