"""Small public entry points that read the default controller."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, overload

from .._controller.controller import default_controller
from .._model.devices import Device, Mesh, colocated_cpu_devices_from, make_mesh_from

__all__ = ["colocated_cpu_devices", "devices", "make_mesh"]

log = logging.getLogger("colobus.mesh")
_HOST_WORDS = ("host", "process", "node", "machine", "worker")
_said_one_host: list[bool] = [False]  # the note below is logged once per process


def devices() -> list[Device]:
    """The default controller's devices (live hosts), sorted by id."""
    return default_controller().devices()


@overload
def colocated_cpu_devices(devices_or_mesh: Mesh) -> Mesh: ...
@overload
def colocated_cpu_devices(devices_or_mesh: Sequence[Device]) -> list[Device]: ...


def colocated_cpu_devices(devices_or_mesh: Any) -> Any:
    """The CPU device on the same host for each given device (order kept).

    A CPU device maps to itself; a mesh maps to a mesh of the same shape.

    Raises:
        ValueError: ``Process {h} does not have enough local CPU devices``.
    """
    ctl = default_controller()
    all_devices = [d for h in ctl.hosts() for d in h.devices]
    return colocated_cpu_devices_from(devices_or_mesh, all_devices)


def make_mesh(axis_shapes: Sequence[int], axis_names: Sequence[str], axis_types: Any = None,
              *, devices: Sequence[Device] | None = None) -> Mesh:
    """A mesh of ``axis_shapes`` named ``axis_names``, as ``jax.make_mesh``.

    Args:
        axis_shapes: The mesh's shape, e.g. ``(2, 4)``.
        axis_names: One name per axis, e.g. ``("hosts", "devices")``.
        axis_types: One ``jax.sharding.AxisType`` per axis (see :class:`Mesh`); None:
            ``Auto`` on every axis, as ``cb.Mesh`` (recent JAX's ``make_mesh`` makes
            them ``Explicit`` instead; pass them to get that).
        devices: The devices to use, in order; default ``cb.devices()`` (sorted
            by id, so host by host). The first ``prod(axis_shapes)`` are taken.

    Raises:
        ValueError: JAX's texts: ``axis_shapes`` not ints, too few devices for
            the shape, a number of names (or axis types) other than the number of axes.
        TypeError: An axis type that is not a ``jax.sharding.AxisType``.
    """
    mesh = make_mesh_from(axis_shapes, axis_names,
                          default_controller().devices() if devices is None else devices,
                          axis_types)
    _note_one_host(mesh)
    return mesh


def _note_one_host(mesh: Mesh) -> None:
    """Log once (INFO) when an axis named like hosts spans one host only.

    ``cb.make_mesh((2,), ("hosts",))`` on hosts of 2 devices or more takes the first 2
    devices by id, both host 0's: JAX's rule (devices in order), and a surprise for an
    axis called ``hosts``.
    """
    if _said_one_host[0]:
        return
    named = [n for n in mesh.axis_names if any(w in str(n).lower() for w in _HOST_WORDS)
             and mesh.shape[n] > 1]
    hosts = mesh.host_tuple
    if not named or len(hosts) != 1:
        return
    _said_one_host[0] = True
    axis = named[0]
    log.info("cb.make_mesh: axis %r (size %d) lies on one host, host %d: like jax.make_mesh, "
             "it takes the first %d devices by id, and that host has them all. For one "
             "device per host pass devices=[h.devices[0] for h in ctl.hosts()], or shape "
             "the mesh (hosts, devices per host), e.g. cb.make_mesh((H, D), (%r, 'devices'))",
             axis, mesh.shape[axis], hosts[0], mesh.size, axis)
