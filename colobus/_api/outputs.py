"""A call's outputs, built on the controller from each host's output description.

Each host describes what its call returned (:mod:`colobus._wire.describe`); the
outputs are ``cb.Array`` handles whose sharding follows the call's mesh (or the
layout the hosts kept), checked for agreement across hosts in structure, shapes and
dtypes. Replicas' values are compared only where the call asked
(``specialize(check_replicas=True)``). A call that returned pending arrays
(``colobus._api.pending``) gets those back, once checked against what the hosts said.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._controller.resultlane import MISS
from .._model import outlayout as _outlayout
from .._model.blocks import global_shape_from_host, host_blocks, layout_from_host
from .._model.devices import Device, Mesh
from .._model.sharding import (
    NamedSharding,
    ShapeDtypeStruct,
    SingleDeviceSharding,
    with_memory_kind,
)
from .._wire import protocol as P
from .array import Array, _hosts_of

if TYPE_CHECKING:
    from .._controller.controller import Controller
    from .pending import Pending
    from .plan import CallPlan

__all__ = ["Unlike", "build_outputs"]


@functools.lru_cache(maxsize=16)
def _key_dtype(impl: str) -> Any:
    import jax

    return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype


def build_outputs(ctl: Controller, call_id: int, plan: CallPlan,
                   per_host: dict[int, Any], ref_shardings: Sequence[Any] = (),
                   name: str = "", pending: Pending | None = None,
                   check_replicas: bool = False) -> Any:
    """The call's outputs from each host's description (``name``: the function's, for
    errors); ``pending``: the arrays the call returned before it ran, which these must
    match (they are the outputs then); ``check_replicas``: compare replicas' values.

    Raises:
        ValueError: the hosts' outputs do not agree (structure, dtype, shape, layout,
            or, with ``check_replicas``, the values of a replicated output: naming the
            function, the output's path and the hosts); or they differ from
            ``pending``'s.
    """
    import jax

    hosts = sorted(per_host)
    # One value for every host (a relay's equal replies, decoded once): flattened once,
    # and nothing to compare between hosts.
    same = len(set(map(id, per_host.values()))) == 1
    flat: dict[int, tuple[list[Any], Any]] = {}
    if same:
        flat = dict.fromkeys(hosts, jax.tree_util.tree_flatten(per_host[hosts[0]]))
    seen: dict[int, tuple[list[Any], Any]] = {}  # hosts' replies decoded once share a value
    for h in () if same else hosts:
        value = per_host[h]
        f = seen.get(id(value))
        if f is None:
            f = seen[id(value)] = jax.tree_util.tree_flatten(value)
        flat[h] = f
    leaves0, tree0 = flat[hosts[0]]
    for h in () if same else hosts[1:]:
        if flat[h][1] is not tree0 and flat[h][1] != tree0:
            raise ValueError(
                f"hosts returned different output structures: host {hosts[0]} returned "
                f"{tree0}, host {h} returned {flat[h][1]}")
    unlike: str | None = None  # how the hosts' outputs differ from ``pending``'s
    came: list[Any] = []  # each leaf's (shape, dtype, sharding), while ``pending`` is given
    if pending is not None and (len(pending.leaves) != len(leaves0)
                                or tree0 != pending.treedef):
        unlike = f"output structure {pending.treedef}, came back as {tree0}"
    outs: list[Array] = []
    for i, leaf0 in enumerate(leaves0):
        metas: dict[int, P.OutLeaf] = (dict.fromkeys(hosts, leaf0) if same
                                       else {h: flat[h][0][i] for h in hosts})
        dtype = _key_dtype(leaf0.key_impl) if leaf0.key_impl else leaf0.dtype
        specs = {leaf0.spec} if same else {m.spec for m in metas.values()}
        kept = None  # the function's own layout, where the hosts kept one (_outlayout)
        has_layout = (leaf0.layout is not None if same else any(
            m.layout is not None for m in metas.values())) or (
            leaf0.ref >= 0 and _outlayout.names_other_layout(plan, leaf0, ref_shardings))
        if has_layout:
            kept = _outlayout.global_sharding(i, plan, metas, ref_shardings)
        if isinstance(kept, SingleDeviceSharding):
            sharding: Any = kept
            shape = tuple(leaf0.shape)
        elif kept is not None or (not has_layout and isinstance(plan.mesh, Mesh)
                                  and None not in specs and len(specs) == 1):
            if kept is None:
                sharding, shape, blocks, uniform = layout_from_host(
                    plan.mesh, leaf0.spec, hosts[0], tuple(leaf0.shape))  # type: ignore[arg-type]
            else:
                sharding = kept
                shape = global_shape_from_host(sharding, hosts[0], leaf0.shape)
                blocks, uniform = host_blocks(sharding, shape), False
            # One reply for all (a relay's equal replies) and every host's block of that
            # shape: nothing to compare host by host.
            for h, m in () if same and uniform and len(blocks) == len(hosts) else metas.items():
                if m.dtype != leaf0.dtype or m.key_impl != leaf0.key_impl:
                    other = _key_dtype(m.key_impl) if m.key_impl else m.dtype
                    raise ValueError(
                        f"output {i} is sharded, so all hosts must agree on its dtype, but "
                        f"host {hosts[0]} returned {dtype} and host {h} returned {other}")
                if tuple(blocks[h].shape) != tuple(m.shape):
                    raise ValueError(
                        f"output {i}: host {h} returned a block of shape {m.shape}, but the "
                        f"global shape {shape} needs {blocks[h].shape} there")
        else:
            for h, m in () if same else metas.items():
                if tuple(m.shape) != tuple(leaf0.shape) or m.dtype != leaf0.dtype or (
                        m.key_impl != leaf0.key_impl):
                    raise ValueError(
                        f"output {i} is replicated, so all hosts must agree on its shape and "
                        f"dtype, but host {hosts[0]} returned {leaf0.shape} {dtype} and host "
                        f"{h} returned {m.shape} {m.dtype}")
            shape = tuple(leaf0.shape)
            sharding = (SingleDeviceSharding(plan.mesh) if isinstance(plan.mesh, Device)
                        else NamedSharding(plan.mesh, jax.sharding.PartitionSpec()))
        if leaf0.memory_kind is not None:  # the host's own memory kind (JAX's sharding)
            sharding = with_memory_kind(sharding, leaf0.memory_kind)
        if check_replicas and leaf0.digest is not None and len(hosts) > 1:
            _outlayout.check_replicas(i, sharding, shape, metas, name,
                                      functools.partial(_output_path, tree0, i))
        if pending is not None:
            came.append(ShapeDtypeStruct(shape, dtype, sharding))
            if unlike is None:
                p = pending.leaves[i]
                if (p.shape != shape or p.dtype != dtype or p._key_impl != leaf0.key_impl
                        or not (p.sharding is sharding or (
                            p.sharding == sharding
                            and p.sharding.device_list == sharding.device_list))):
                    unlike = (f"{_output_path(tree0, i)} {p.shape} {p.dtype} on "
                              f"{p.sharding!r}, came back as {shape} {dtype} on {sharding!r}")
                outs.append(p)
            continue
        outs.append(Array(ctl, P.output_ref(call_id, i), shape, dtype, sharding,
                          key_impl=leaf0.key_impl))
    if unlike is not None:
        assert pending is not None
        if pending.cell is not None:
            pending.cell[0] = None  # (the next call learns its specs again)
        raise Unlike(
            f"{name or 'a colocated function'}: the call returned its outputs at once, as "
            f"JAX does, from the specs of its out_specs_fn or of its earlier call with the "
            f"same input specs, but they differ: {unlike}. Return outputs of the same specs "
            "for the same input specs, or give specialize(out_specs_fn=...) that says what "
            "it returns; its next call learns the specs again.", tree0.unflatten(came))
    return tree0.unflatten(outs)


class Unlike(ValueError):
    """A call's outputs differ from the pending arrays it returned; ``came`` is what the
    hosts returned, as a tree of ``cb.ShapeDtypeStruct`` (an ``out_specs_fn``'s own
    error, where it has one, says it first: ``_CallOp``)."""

    def __init__(self, text: str, came: Any) -> None:
        super().__init__(text)
        self.came = came


def _output_path(treedef: Any, i: int) -> str:
    """Where output leaf ``i`` lies in the returned tree, as JAX writes paths
    (``output[1]['w']``; ``the output`` for a lone array)."""
    import jax

    tree = treedef.unflatten(range(treedef.num_leaves))
    path = jax.tree_util.tree_flatten_with_path(tree)[0][i][0]
    return f"output{jax.tree_util.keystr(path)}" if path else "the output"


# -- the common reply's lane (colobus._controller.resultlane) ----------------------------------

# (description bytes, count, host, id(plan)) -> (plan, ref shardings, tree, leaves, output
# specs): what build_outputs made of that one host's description for that plan and those
# argument shardings (held: their ids stay theirs), and the output specs it passed (None:
# none given; the same specs object passes the same outputs again). ``tree``: None for one
# array, else the treedef; each leaf (shape, dtype, sharding, key_impl, the sharding's
# hosts).
_BUILT: dict[tuple[bytes, int, int, int],
             tuple[Any, tuple[Any, ...], Any, list[Any], Any]] = {}
_BUILT_MAX = 1024
_new = object.__new__


def lane_outputs(op: Any, host: int, raw: bytes, count: int, times: Any = None) -> Any:
    """``op(...)`` (a call's combiner: :func:`build_outputs`) for one host's reply whose
    description ``raw`` it built before for the same plan and argument shardings: the
    same handles, made without reading the description again (the call's pending arrays,
    where it returned some and they are alike: ``times``, the reply's, says whether they
    are computed); else ``MISS``."""
    plan = op.plan
    hit = _BUILT.get((raw, count, host, id(plan)))
    if hit is None or hit[0] is not plan or hit[4] is not op.out_specs:
        return MISS
    refs = op.ref_shardings
    if len(refs) != len(hit[1]):
        return MISS
    for a, b in zip(refs, hit[1], strict=True):
        if a is not b:
            return MISS
    pending = op.pending
    if pending is not None:  # the arrays returned when it was made, if alike
        leaves = pending.leaves
        entries = hit[3]
        if len(leaves) != len(entries) or (
                pending.tree is not leaves[0] if hit[2] is None
                else hit[2] != pending.treedef):
            return MISS  # (the general path says what differs)
        i = 0
        for shape, dtype, sharding, key_impl, _ in entries:
            p = leaves[i]
            if p.sharding is not sharding or p.shape != shape or p.dtype != dtype or (
                    p._key_impl != key_impl):
                return MISS
            i += 1
        computed = type(times) is list and len(times) > 2 and times[2] == 1
        for p in leaves:  # (settle_pending, inline)
            p._call = None
            if computed:
                p._ready = True
        return pending.tree
    ctl = op.ctl
    registry = ctl._hosts
    frees = ctl._frees
    base = op.call_id << 16  # P.output_ref(call_id, i)
    outs = []
    i = 0
    for shape, dtype, sharding, key_impl, hosts in hit[3]:
        # Array(ctl, ref, shape, dtype, sharding, key_impl=key_impl), its attributes set
        # here (tests/test_resultlane.py checks they are the constructor's)
        gens = (op.gens if hosts == plan.hosts and op.changes == registry.changes
                else registry.generations(hosts)[1])
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
        a._call = None
        a._prefetch = None
        a._checked = -1
        a._gens = gens
        a._finalizer = frees.release_when_gone(a, gens, ref=ref)
        outs.append(a)
        i += 1
    tree = hit[2]
    return outs[0] if tree is None else tree.unflatten(outs)


def learn_outputs(op: Any, host: int, raw: bytes, count: int, result: Any) -> None:
    """Remember what :func:`build_outputs` made of ``raw`` (a MISS of lane_outputs), and
    the output specs it passed."""
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(result)
    entry = []
    for i, a in enumerate(leaves):
        if type(a) is not Array or a.ref != P.output_ref(op.call_id, i):
            return
        entry.append((a.shape, a.dtype, a.sharding, a._key_impl, _hosts_of(a.sharding)))
    plan = op.plan
    if len(_BUILT) >= _BUILT_MAX:
        _BUILT.clear()
    _BUILT[(raw, count, host, id(plan))] = (
        plan, tuple(op.ref_shardings),
        None if len(leaves) == 1 and result is leaves[0] else treedef, entry, op.out_specs)
