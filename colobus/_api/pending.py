"""What a call returns off the controller's event-loop thread: JAX's arrays, at once.

JAX's colocated call returns its output arrays while the computation runs, from specs it
knows: an ``out_specs_fn``'s, or those its first call with the same input specs
returned (that first call runs synchronously, to learn them). colobus does the same on
every thread but the controller's own event-loop thread (scripts, ``cb.init()``, worker
threads, and a thread running another event loop: a Jupyter kernel's, an
``asyncio.run`` or pytest-asyncio's beside a ``with`` cluster; the controller's loop
runs on a thread of its own there, so a wait stalls only the caller): each target
keeps, per input signature, a *cell* with the output specs it learned
(:class:`OutSpecs`); a call whose cell is full returns *pending* arrays at once
(:class:`Pending`), handles under the refs the hosts will store the outputs under, each
holding the call's Future until the call ends. A call whose cell is empty waits for its
hosts (:func:`wait_outputs`), learns, and returns the outputs. Async code on another
loop awaits an array (``cb.Array.__await__``) without stalling its loop.

On the controller's loop thread (async code under ``async with``) the call returns its
awaitable ``cb.Future`` at once (``Future._returns`` is None): nothing may wait there.

When the call ends, its combiner checks the outputs the hosts described against the
pending arrays (:func:`colobus._api.outputs.build_outputs`): a difference fails the call
with a ``ValueError`` saying what differs (and the cell is emptied, so the next call
learns again); the arrays then raise that error wherever they are used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .._controller.future import Future
from .._model.devices import Device
from .._model.sharding import NamedSharding, ShapeDtypeStruct, SingleDeviceSharding
from .array import Array, _hosts_of
from .specs import _as_seen_on_hosts

if TYPE_CHECKING:
    from .._controller.controller import Controller
    from .plan import CallPlan

__all__ = ["OutSpecs", "Pending", "Wait", "cell_of", "make_pending", "outs_of_specs",
           "settle_pending", "signature", "wait_outputs"]

_new = object.__new__
_Entry = tuple[tuple[int, ...], Any, Any, "str | None", tuple[int, ...]]


class OutSpecs:
    """A call's outputs as specs: their tree (None: one array) and each leaf's
    ``(shape, dtype, sharding, key_impl, hosts)`` (the sharding's hosts, sorted)."""

    __slots__ = ("leaves", "tree", "treedef")

    def __init__(self, tree: Any, treedef: Any, leaves: list[_Entry]) -> None:
        self.tree = tree
        self.treedef = treedef
        self.leaves = leaves


class Pending:
    """A call's outputs while it runs: the tree returned (``tree``), its arrays in order
    (``leaves``), their tree's structure, and the cell their specs came from."""

    __slots__ = ("cell", "leaves", "tree", "treedef")

    def __init__(self, tree: Any, leaves: list[Array], treedef: Any,
                 cell: list[OutSpecs | None] | None) -> None:
        self.tree = tree
        self.leaves = leaves
        self.treedef = treedef
        self.cell = cell


class Wait:
    """A call made off the controller's loop thread whose output specs are not known: it
    waits for its hosts, then its outputs' specs fill ``cell`` (None: nothing to learn
    into)."""

    __slots__ = ("cell",)

    def __init__(self, cell: list[OutSpecs | None] | None) -> None:
        self.cell = cell


def outs_of_result(result: Any) -> OutSpecs | None:
    """The specs of a call's outputs (its arrays; None where a leaf is something else)."""
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(result)
    entries: list[_Entry] = []
    for a in leaves:
        if type(a) is not Array:
            return None
        entries.append((a.shape, a.dtype, a.sharding, a._key_impl, _hosts_of(a.sharding)))
    single = len(leaves) == 1 and result is leaves[0]
    return OutSpecs(None if single else treedef, treedef, entries)


def outs_of_specs(out_specs: Any, plan: CallPlan) -> OutSpecs | None:
    """The specs an ``out_specs_fn`` gave, where each leaf is a ``cb.ShapeDtypeStruct``
    with a plain dtype (else None: its first call tells); one without a sharding is
    replicated over the call's devices, as a host's plain value is."""
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(out_specs)
    entries: list[_Entry] = []
    replicated: Any = None
    for s in leaves:
        if not isinstance(s, ShapeDtypeStruct):
            return None
        sharding = s.sharding
        if sharding is None:
            if replicated is None:
                replicated = (SingleDeviceSharding(plan.mesh) if isinstance(plan.mesh, Device)
                              else NamedSharding(plan.mesh, jax.sharding.PartitionSpec()))
            sharding = replicated
        elif not isinstance(sharding, NamedSharding | SingleDeviceSharding):
            return None
        dtype = _as_seen_on_hosts(s.dtype)
        if not isinstance(dtype, np.dtype) or dtype.hasobject:
            return None  # (a key array's, or no dtype numpy knows: its first call tells)
        entries.append((tuple(s.shape), dtype, sharding, None, _hosts_of(sharding)))
    single = len(leaves) == 1 and out_specs is leaves[0]
    return OutSpecs(None if single else treedef, treedef, entries)


def signature(treedef: Any, leaves: list[Any], plan: Any) -> Any:
    """A call's input signature, as JAX specializes on it (and ``cache_info`` counts it):
    the tree, the device set, each array's shape, dtype and sharding, each other leaf's
    type. None where a leaf is a ``cb.Future`` (its specs are not known yet)."""
    sig: list[Any] = []
    for x in leaves:
        if type(x) is Array:
            sig.append((x.shape, x.dtype, x.sharding))
        elif isinstance(x, Future):
            return None
        else:
            sig.append(type(x))
    return (treedef, plan.serial, tuple(sig))


_MAX_CELLS = 1024  # input signatures remembered per target; beyond, they start over


def cell_of(target: Any, key: Any) -> list[OutSpecs | None] | None:
    """``target``'s cell for input signature ``key`` (made empty the first time)."""
    if key is None:
        return None
    cells: dict[Any, list[OutSpecs | None]] | None = target.cells
    if cells is None:
        cells = target.cells = {}
    cell = cells.get(key)
    if cell is None:
        if len(cells) >= _MAX_CELLS:
            cells.clear()
        cell = cells[key] = [None]
    return cell


def make_pending(ctl: Controller, call_id: int, outs: OutSpecs, fut: Future[Any],
                 plan_hosts: tuple[int, ...], gens: dict[int, int],
                 cell: list[OutSpecs | None] | None) -> Pending:
    """The arrays of call ``call_id`` (whose Future is ``fut``) before it ran: under the
    refs its hosts will store its outputs under, freed on the hosts when they go, as the
    handles the call's reply would have made (``lane_outputs``)."""
    registry = ctl._hosts
    frees = ctl._frees
    base = call_id << 16  # P.output_ref(call_id, i)
    leaves = []
    i = 0
    for shape, dtype, sharding, key_impl, hosts in outs.leaves:
        g = gens if hosts == plan_hosts else registry.generations(hosts)[1]
        # Array(ctl, ref, shape, dtype, sharding, key_impl=key_impl), with its call
        a = _new(Array)
        a._ctl = ctl
        a.ref = ref = base | i
        a.shape = shape
        a.dtype = dtype
        a.sharding = sharding
        a._key_impl = key_impl
        a._ready = False
        a._deleted = False
        a._failed = None
        a._call = fut
        a._prefetch = None
        a._checked = -1
        a._gens = g
        a._finalizer = frees.release_when_gone(a, g, ref=ref)
        leaves.append(a)
        i += 1
    tree = outs.tree
    return Pending(leaves[0] if tree is None else tree.unflatten(leaves), leaves,
                   outs.treedef, cell)


def settle_pending(pending: Pending, computed: bool) -> None:
    """The call ended well (loop thread): its arrays are its outputs, stored on their
    hosts (and ready, where every host said its outputs were computed)."""
    for a in pending.leaves:
        a._call = None
        if computed:
            a._ready = True


def wait_outputs(fut: Future[Any], wait: Wait) -> Any:
    """The outputs of a call made off the controller's loop thread whose specs were not
    known: its Future waited for (its error raised here, as JAX's first call raises it),
    its outputs' specs learned into its cell."""
    out = fut.result()
    cell = wait.cell
    if cell is not None and cell[0] is None:
        cell[0] = outs_of_result(out)
    return out
