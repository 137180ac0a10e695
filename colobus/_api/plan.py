"""Device sets: which hosts a call runs on, and each host's part of the call's mesh.

The device set comes from the call's ``cb.Array`` arguments (and futures of
earlier calls), or from ``specialize(devices=...)``, with JAX's error texts
when they disagree or are missing. Plans are cached by device list and mesh.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._controller.future import Future
from .._model.blocks import host_blocks
from .._model.devices import Device, Mesh
from .._model.sharding import NamedSharding, SingleDeviceSharding
from .._wire.splice import pack_body
from .array import Array, mesh_message

__all__ = ["CallPlan", "make_plan"]


@dataclass(frozen=True, slots=True)
class CallPlan:
    """Where a call runs: its device list, its mesh, and each host's part of it."""

    devices: tuple[Device, ...]
    mesh: Mesh | Device
    hosts: tuple[int, ...]
    host_mesh: dict[int, list[Any]]
    # each host's mesh as msgpack, made once (plans are cached): equal ones are one object
    packed_mesh: dict[int, bytes] = field(default_factory=dict, compare=False)
    # this plan among all made (a key that costs nothing to hash: a fan-out's device
    # tuple hashes a thousand devices in Python)
    serial: int = field(default_factory=itertools.count().__next__, compare=False)

    def packed_meshes(self) -> dict[int, bytes]:
        """Host -> its part of the mesh, packed (a fan-out's CALLs splice these)."""
        packed = self.packed_mesh
        if not packed:
            same: dict[bytes, bytes] = {}
            for h, m in self.host_mesh.items():
                b = pack_body(m)
                packed[h] = same.setdefault(b, b)
        return packed


_plans: dict[Any, CallPlan] = {}
# The same plans by the identity of the device tuple and mesh asked for (a sharding's,
# a specialization's): no per-device work on a fan-out's every call. Each entry holds
# what it is keyed on, so no other object can take those ids while it is here.
_by_ids: dict[tuple[int, int], tuple[Any, Any, CallPlan]] = {}


def _plan_for(devices: tuple[Device, ...], mesh: Mesh | Device | None) -> CallPlan:
    """The plan of ``devices`` laid out as ``mesh`` (None: as one axis of them)."""
    ids = (id(devices), id(mesh))
    hit = _by_ids.get(ids)
    if hit is not None:
        return hit[2]
    if len(_by_ids) > 1024:
        _by_ids.clear()
    plan = _plan_by_value(devices, _mesh_of_devices(devices) if mesh is None else mesh)
    _by_ids[ids] = (devices, mesh, plan)
    return plan


def _plan_by_value(devices: tuple[Device, ...], mesh: Mesh | Device) -> CallPlan:
    # Devices compare by id only, and ids repeat across controllers: key on everything.
    full = tuple((d.id, d.host, d.platform, d.local_id) for d in devices)
    key = (full, None if isinstance(mesh, Device) else (mesh.axis_names, mesh.devices.shape,
                                                           mesh.axis_type_names))
    plan = _plans.get(key)
    if plan is None:
        plan = _make_plan(devices, mesh)
        if len(_plans) > 1024:
            _plans.clear()
        _plans[key] = plan
    return plan


def _make_plan(devices: tuple[Device, ...], mesh: Mesh | Device) -> CallPlan:
    hosts = tuple(sorted({d.host for d in devices}))
    if isinstance(mesh, Device):
        host_mesh = {mesh.host: [[[mesh.platform, mesh.local_id]], [], []]}
    else:
        from jax.sharding import PartitionSpec

        blocks = host_blocks(NamedSharding(mesh, PartitionSpec()), ())
        host_mesh = {h: mesh_message(b) for h, b in blocks.items()}
    return CallPlan(devices, mesh, hosts, host_mesh)


def _device_list_of(x: Any) -> tuple[tuple[Device, ...], Mesh | Device]:
    if isinstance(x, Array):
        sh = x.sharding
        if isinstance(sh, NamedSharding):
            return sh.device_list, sh.mesh
        if isinstance(sh, SingleDeviceSharding):
            return sh.device_list, sh.device
        return sh.device_list, Mesh(np.array(sh.device_list, dtype=object), ("devices",))
    plan: CallPlan = x.info
    return plan.devices, plan.mesh


def _mesh_of_devices(devices: Sequence[Device]) -> Mesh | Device:
    if len(devices) == 1:
        return devices[0]
    return Mesh(np.array(list(devices), dtype=object), ("devices",))


def make_plan(leaves: list[Any], devices: Sequence[Device] | None) -> CallPlan:
    # (device list, its mesh) in order of first use; a list, not a dict: hashing a device
    # list runs a Python ``__hash__`` per device, on every call
    lists: list[tuple[tuple[Device, ...], Mesh | Device]] = []
    for leaf in leaves:
        if isinstance(leaf, Array) or (isinstance(leaf, Future) and isinstance(leaf.info,
                                                                               CallPlan)):
            dl, mesh = _device_list_of(leaf)
            if not any(seen is dl or seen == dl for seen, _ in lists):
                lists.append((dl, mesh))
    if devices is not None:
        devs = tuple(devices)
        for dl, _ in lists:
            if set(dl) != set(devs):
                raise ValueError(
                    "All arguments must use the same device list, but got multiple device "
                    f"lists: {[list(devs), list(dl)]}.")
        if lists:
            return _plan_for(*lists[0])
        return _plan_for(devs, None)
    if not lists:
        jax_text = ("No devices found. colocated_python function without input arguments "
                    "must be first specialized with devices.")
        if not leaves:
            raise ValueError(jax_text)
        cls = type(leaves[0])
        first = ("a jax.Array of this process" if cls.__module__.startswith(("jax", "jaxlib"))
                 else f"a {cls.__module__.split('.')[0]}.{cls.__qualname__}")
        # JAX's text first, then what to do: in the message itself too, since a bare
        # `except Exception as e: print(e)` shows no notes.
        exc = ValueError(f"{jax_text} colobus: the arguments hold no cb.Array ({first} "
                         "first): cb.device_put them onto the hosts first.")
        exc.add_note(
            f"colobus: the call has arguments ({first} first), but no cb.Array among "
            "them: put them on the hosts first with cb.device_put(x, device_or_sharding), "
            "or fix the devices with fn.specialize(devices=...).")
        raise exc
    if len(lists) > 1:
        raise ValueError(
            "All arguments must use the same device list, but got multiple device lists: "
            f"{[list(dl) for dl, _ in lists]}.")
    return _plan_for(*lists[0])
