"""Output layouts: a host keeps the sharding its function produced; the controller rebuilds it.

Host side (:func:`kept_layout`, :func:`digest`): a ``jax.Array`` output whose
sharding covers exactly the host's devices of the call, but is not the call's
own mesh (another device order, another mesh shape or axis names, a
``SingleDeviceSharding``), is stored as it is, and the host describes its
layout in plain fields (``OutLeaf.layout``)::

    [kind, device ids, mesh shape, axis names, fully replicated]

``kind`` is ``"named"`` or ``"single"``; device ids are global. ``OutLeaf.ref``
is the position (among the call's host-resident arguments) of an argument
whose sharding *object* the output carries (as after ``jax.device_put(v,
y.sharding)`` or ``make_array_from_single_device_arrays(..., y.sharding,
...)``), else -1: where one host's part of two global layouts looks the same
(one device per host), it names the global one. It is looked for on kept
layouts, and on outputs on the call's own mesh when the call has several
host-resident arguments. Where the call asks (``specialize(check_replicas=True)``),
every output of a call on a mesh, whatever its size, also carries a digest of its bytes
(:func:`digest`: one hash up to :data:`DIGEST_CHUNK_BYTES`, above that chunks hashed on
threads), so the controller can tell replicas that disagree; otherwise replicas are kept
as JAX keeps them, each device's as returned, never compared.

Controller side (:func:`global_sharding`, :func:`check_replicas`): the global
sharding is the first candidate that gives every host exactly the layout it
reported: the argument's sharding named by ``ref``, the call's mesh, the
meshes of the other array arguments, and, on one host, the host's own mesh.
Where none fits and every host's output is replicated over its devices of the
call, the output is replicated over the call's mesh (as before); else the
call fails with a ``ValueError`` that shows each host's layout.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from . import jaxside as _hostside
from .blocks import host_blocks, host_sub_mesh
from .devices import Device, Mesh
from .jaxside import is_key_array
from .sharding import NamedSharding, Sharding, SingleDeviceSharding

__all__ = ["DIGEST_CHUNK_BYTES", "check_replicas", "digest", "global_sharding", "kept_layout"]

DIGEST_CHUNK_BYTES = 8 << 20
"""Outputs up to this size are hashed at once (blake2b, 16 bytes); larger ones in chunks of
this size (SHA-256, which runs on the CPU's own instructions where it has them), on up
to :data:`DIGEST_THREADS` threads at once, then the chunks' digests hashed together."""
DIGEST_THREADS = min(8, os.cpu_count() or 1)


# -- host side -------------------------------------------------------------------------------


def kept_layout(jax: Any, leaf: Any, mesh: Any) -> list[Any] | None:
    """The layout fields of a ``jax.Array`` output to keep as it is, or None.

    Args:
        jax: The ``jax`` module.
        leaf: The output.
        mesh: The host's part of the call's mesh (a ``jax`` Mesh or one device).
    """
    sh = leaf.sharding
    if isinstance(sh, jax.sharding.NamedSharding):
        kind = "named"
        devices = list(sh.mesh.devices.flat)
        shape = list(sh.mesh.devices.shape)
        names = list(sh.mesh.axis_names)
    elif isinstance(sh, jax.sharding.SingleDeviceSharding):
        kind = "single"
        devices = list(sh.device_set)
        shape, names = [], []
    else:
        return None
    call_devices = set(mesh.devices.flat) if isinstance(mesh, jax.sharding.Mesh) else {mesh}
    if set(devices) != call_devices:
        return None
    ids = [_hostside.global_id(d) for d in devices]
    if None in ids:
        return None
    return [kind, ids, shape, names, bool(sh.is_fully_replicated)]


def arg_ref(sharding: Any, args: Sequence[Any]) -> int:
    """The position of the first argument whose sharding is ``sharding`` itself, else -1."""
    for k, value in enumerate(args):
        if getattr(value, "sharding", None) is sharding:
            return k
    return -1


def digest(value: Any, index: int | None = None) -> bytes:
    """A digest of an output's bytes, whatever its size (replicas compare by it).

    Shape and dtype are not in it: the controller compares those separately. A
    ``jax.Array`` replicated over the host's devices is read from its first device
    (on an accelerator: one copy to host memory, not kept on the array). With ``index``
    (the output's, for the error), the devices of this host that hold the same block
    are compared first.

    Raises:
        ValueError: two devices of this host hold different values of one block.
    """
    if index is not None:
        _check_devices(value, index)
    if is_key_array(value):
        import jax

        value = jax.random.key_data(value)
    if getattr(getattr(value, "sharding", None), "is_fully_replicated", False) and (
            len(value.sharding.device_set) > 1):
        value = value.addressable_data(0)
    return _hash(np.asarray(value))


def _raw(value: Any) -> np.ndarray[Any, Any]:
    if is_key_array(value):
        import jax

        value = jax.random.key_data(value)
    return np.asarray(value)


def _check_devices(value: Any, index: int) -> None:
    """Raise if two of this host's devices hold different values of one block of
    ``value`` (JAX keeps each device's copy as it was given: ``check_replicas``)."""
    shards = getattr(value, "addressable_shards", None)
    if not shards or len(shards) < 2:
        return
    groups: dict[str, list[Any]] = {}
    for s in shards:
        groups.setdefault(repr(s.index), []).append(s)
    for group in groups.values():
        if len(group) < 2:
            continue
        first = _hash(_raw(group[0].data))
        for other in group[1:]:
            if _hash(_raw(other.data)) != first:
                raise ValueError(
                    f"output {index} is replicated over this host's devices "
                    f"{[getattr(g.device, 'id', g.device) for g in group]}, but device "
                    f"{getattr(group[0].device, 'id', group[0].device)} and device "
                    f"{getattr(other.device, 'id', other.device)} hold different values "
                    "(check_replicas=True compares every replica). Either shard the output "
                    "over those devices, or give each the same value.")


def _hash(arr: np.ndarray[Any, Any]) -> bytes:
    """blake2b of an array's bytes (chunks hashed side by side above the chunk size)."""
    if isinstance(arr.dtype, np.dtypes.StringDType):
        h = hashlib.blake2b(digest_size=16)
        for s in arr.reshape(-1).tolist():
            h.update(s.encode("utf-8", "surrogatepass"))
            h.update(b"\0")
        return h.digest()
    if not arr.size or not arr.dtype.itemsize:
        return b""
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    data = arr.reshape(-1).view(np.uint8).data
    n = data.nbytes
    if n <= DIGEST_CHUNK_BYTES:
        return hashlib.blake2b(data, digest_size=16).digest()
    # hashlib lets go of the GIL over large buffers: the chunks hash side by side
    chunks = [data[i:i + DIGEST_CHUNK_BYTES] for i in range(0, n, DIGEST_CHUNK_BYTES)]
    h = hashlib.blake2b(b"%d\0" % n, digest_size=16)
    for part in _digest_pool().map(_sha256, chunks):
        h.update(part)
    return h.digest()


def _sha256(chunk: memoryview) -> bytes:
    return hashlib.sha256(chunk).digest()


_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _digest_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(DIGEST_THREADS,
                                                          thread_name_prefix="colobus-digest")
        return _pool


# -- controller side ---------------------------------------------------------------------------


# (ref, the host's layout, replicated); None: replicated on the host's part of the call mesh
_Report = tuple[int, Sharding, bool] | None


def _reports(plan: Any, metas: Mapping[int, Any]) -> dict[int, _Report]:
    by_id = {d.id: d for d in plan.devices}
    out: dict[int, _Report] = {}
    for h, m in metas.items():
        ref = m.ref
        if m.layout is not None:
            kind, ids, shape, names, replicated = m.layout
            if not ids or not all(isinstance(i, int) and i in by_id for i in ids):
                raise ValueError(f"host {h} described an output on devices {ids} outside the call")
            devs = [by_id[i] for i in ids]
            if kind == "single":
                local: Sharding = SingleDeviceSharding(devs[0])
            else:
                arr = np.empty(len(devs), dtype=object)
                arr[:] = devs
                local = NamedSharding(Mesh(arr.reshape(shape), tuple(names)), m.spec)
            out[h] = (int(ref), local, bool(replicated))
        elif m.spec is not None and isinstance(plan.mesh, Mesh):
            from jax.sharding import PartitionSpec

            _, sub = host_sub_mesh(NamedSharding(plan.mesh, PartitionSpec()), h)
            local = NamedSharding(sub, m.spec)
            out[h] = (int(ref), local, local.is_fully_replicated)
        else:
            out[h] = None
    return out


def _host_view(sharding: Sharding, host: int) -> Sharding | None:
    if isinstance(sharding, SingleDeviceSharding):
        return sharding if sharding.device.host == host else None
    if not isinstance(sharding, NamedSharding):
        return None
    try:
        _, sub = host_sub_mesh(sharding, host)
    except ValueError:
        return None
    return NamedSharding(sub, sharding.spec)


def _fits(candidate: Sharding, reports: Mapping[int, _Report]) -> bool:
    if {d.host for d in candidate.device_list} != set(reports):
        return False
    for h, r in reports.items():
        view = _host_view(candidate, h)
        if r is None or view is None:
            return False
        local = r[1]
        if view != local or view.device_list != local.device_list:
            return False
        if isinstance(view, NamedSharding) and isinstance(local, NamedSharding) and (
                view.mesh.axis_names != local.mesh.axis_names):
            return False
    return True


def names_other_layout(plan: Any, leaf: Any, ref_shardings: Sequence[Any]) -> bool:
    """Whether an output on the call's mesh names an argument laid out on another mesh."""
    ref = leaf.ref
    if not 0 <= ref < len(ref_shardings):
        return False
    sharding = ref_shardings[ref]
    return isinstance(sharding, NamedSharding) and sharding.mesh != plan.mesh


def global_sharding(index: int, plan: Any, metas: Mapping[int, Any],
                    ref_shardings: Sequence[Sharding | None]) -> Sharding | None:
    """The global sharding of output ``index`` from the hosts' layouts.

    Returns None when the output is to be replicated over the call's mesh.

    Raises:
        ValueError: the hosts' layouts do not form one global sharding.
    """
    single = _on_the_one_device(plan, metas, ref_shardings)
    if single is not None:
        return single
    reports = _reports(plan, metas)
    candidates: list[Sharding] = []
    refs = {r[0] for r in reports.values() if r is not None}
    if None not in reports.values() and len(refs) == 1:
        ref = refs.pop()
        if 0 <= ref < len(ref_shardings) and ref_shardings[ref] is not None:
            candidates.append(ref_shardings[ref])  # type: ignore[arg-type]
    locals_ = [r[1] for r in reports.values() if r is not None]
    if len(locals_) == len(reports) and all(isinstance(s, NamedSharding) for s in locals_):
        spec = locals_[0].spec  # type: ignore[attr-defined]
        meshes = [plan.mesh] + [s.mesh for s in ref_shardings if isinstance(s, NamedSharding)]
        meshes += _joined_meshes(reports)  # the hosts' own meshes, side by side
        for m in meshes:
            named = _named(m, spec)
            if named is not None:
                candidates.append(named)
    if len(reports) == 1 and locals_:
        candidates.append(locals_[0])
    for c in candidates:
        try:
            if _fits(c, reports):
                return c
        except ValueError:  # the spec does not apply to this mesh
            continue
    if all(r is None or r[2] for r in reports.values()):
        return None
    shown = "; ".join(f"host {h}: {r[1]!r}" if r else f"host {h}: the call mesh"
                      for h, r in reports.items())
    call_mesh = (f"axes {plan.mesh.axis_names} of shape {plan.mesh.devices.shape}"
                 if isinstance(plan.mesh, Mesh) else "one device")
    raise ValueError(
        f"output {index}: the hosts returned layouts that do not form one global sharding "
        f"({shown}). Return it laid out like an argument (e.g. jax.device_put(v, x.sharding)), "
        f"or on the call's mesh ({call_mesh}; a call without array arguments gets a 1-D mesh "
        "with axis 'devices'), or on the host's part of one mesh whose hosts' parts lie side "
        "by side along one axis, or replicated over the host's devices of the call.")


def _named(mesh: Any, spec: Any) -> NamedSharding | None:
    """``NamedSharding(mesh, spec)``, or None where the spec names an axis the mesh lacks."""
    if not isinstance(mesh, Mesh):
        return None
    try:
        return NamedSharding(mesh, spec)
    except ValueError:
        return None


def _joined_meshes(reports: Mapping[int, _Report]) -> list[Mesh]:
    """The hosts' own meshes (same axis names) laid side by side along one axis, in
    host order: the global mesh a host-local layout was cut from, when the call's
    mesh is not it (a call without array arguments, a mesh captured by the function)."""
    local = [reports[h] for h in sorted(reports)]
    shardings = [r[1] for r in local if r is not None]
    if len(shardings) < 2 or len(shardings) != len(local) or not all(
            isinstance(s, NamedSharding) for s in shardings):
        return []
    names = shardings[0].mesh.axis_names  # type: ignore[attr-defined]
    if any(s.mesh.axis_names != names for s in shardings):  # type: ignore[attr-defined]
        return []
    out = []
    for axis in range(len(names)):
        try:
            devs = np.concatenate([s.mesh.devices for s in shardings],  # type: ignore[attr-defined]
                                  axis=axis)
        except ValueError:  # the parts do not line up along this axis
            continue
        if len({d.id for d in devs.flat}) == devs.size:
            out.append(Mesh(devs, names))
    return out


def _on_the_one_device(plan: Any, metas: Mapping[int, Any],
                       ref_shardings: Sequence[Sharding | None]) -> Sharding | None:
    """The common case, decided without the general search: a call on one device
    whose host kept the output there; the argument's own sharding where the
    output names one. None: not this case (the general search decides)."""
    if len(metas) != 1 or not isinstance(plan.mesh, Device):
        return None
    (m,) = metas.values()
    layout = m.layout
    if layout is None or layout[0] != "single" or list(layout[1]) != [plan.mesh.id]:
        return None
    if m.ref == -1:
        return SingleDeviceSharding(plan.mesh)
    if 0 <= m.ref < len(ref_shardings):
        named = ref_shardings[m.ref]
        if isinstance(named, SingleDeviceSharding) and named.device == plan.mesh:
            return named
    return None


@functools.lru_cache(maxsize=256)
def _block_groups(sharding: Sharding, shape: tuple[int, ...],
                  hosts: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Hosts that hold the same block of a global array, for each block held twice or more.

    ``hosts`` (each device's host) is part of the cache key: devices compare by id
    only, and another controller numbers the same ids onto other hosts.
    """
    groups: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for h, b in host_blocks(sharding, shape).items():
        groups.setdefault(tuple((s.start, s.stop) for s in b.index), []).append(h)
    return tuple(tuple(g) for g in groups.values() if len(g) > 1)


def check_replicas(index: int, sharding: Sharding, shape: tuple[int, ...],
                   metas: Mapping[int, Any], function: str = "",
                   where: Callable[[], str] | None = None) -> None:
    """Raise if hosts holding the same block of output ``index`` returned different bytes.

    Every output of a call on a mesh carries its digest, whatever its size; one a host
    did not hash (an older worker's: none) is not compared.

    Args:
        function: The function's name, for the error.
        where: The output's path in the returned tree, for the error (asked only then).

    Raises:
        ValueError: naming the function, the output's path and the hosts of each value.
    """
    digests = {h: m.digest for h, m in metas.items() if m.digest is not None}
    if len(digests) < 2 or len(set(digests.values())) == 1:
        return
    for group in _block_groups(sharding, shape, tuple(d.host for d in sharding.device_list)):
        values: dict[bytes, list[int]] = {}
        for h in group:
            if h in digests:
                values.setdefault(digests[h], []).append(h)
        if len(values) < 2:
            continue
        path = where() if where is not None else f"output {index}"
        (first, *_), (other, *_) = list(values.values())[:2]
        alike = ""
        if sum(map(len, values.values())) > 2:  # which hosts hold which value
            alike = " (hosts by value: " + "; ".join(
                ", ".join(map(str, hs[:8])) + (" ..." if len(hs) > 8 else "")
                for hs in list(values.values())[:6]) + ("; ..." if len(values) > 6 else "") + ")"
        raise ValueError(
            f"{function or 'a colocated function'}: {path} is replicated over hosts "
            f"{list(group)} (each holds the same block of it, under {sharding!r}), but host "
            f"{first} and host {other} returned different values{alike}. Either shard the "
            "output over the hosts (return it with a NamedSharding whose spec names the "
            "mesh axis that spans the hosts), or return the same value on every host.")
