"""Controller side of colocated calls: the decorator, specs, dispatch, outputs.

One call runs its function once on each host of its device set (``_plan``).
The caller pickles the arguments once (``_serialization``), the loop thread
sends one CALL per host, and the per-host output descriptions are combined
into global ``cb.Array`` handles that stay on the hosts.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from .._controller.controller import Controller, default_controller
from .._controller.dependents import fail_with
from .._controller.future import Future
from .._model.devices import Device
from .array import Array, check_owner
from .cacheinfo import CacheInfo
from .callop import _CallOp, _decode_result
from .pending import (
    OutSpecs,
    Pending,
    Wait,
    cell_of,
    make_pending,
    outs_of_specs,
    signature,
    wait_outputs,
)
from .plan import CallPlan, make_plan
from .serialization import Code, ColocatedObjectBase, PickledArgs, pickle_args
from .specs import (
    _check_specs,
    _is_handle,
    _positional_treedef,
    _spec_of_leaf,
    merge_check,
    merge_specialization,
)
from .target import FunctionTarget, Target, _stream_id, _thread_streams

__all__ = [
    "CallPlan", "Code", "ColocatedFunction", "ColocatedObjectBase", "FunctionTarget",
    "PickledArgs", "Target", "_CallOp", "_decode_result", "_stream_id", "_thread_streams",
    "colocated_python", "invoke", "pickle_args", "returned",
]


# -- the call -------------------------------------------------------------------------------------


_get_ident = threading.get_ident


def invoke(target: Target, args: tuple[Any, ...], kwargs: dict[str, Any], *,
           in_specs: Any = None, out_specs_fn: Callable[..., Any] | None = None,
           devices: Sequence[Device] | None = None,
           check_replicas: bool = False) -> Future[Any]:
    """Run ``target`` on every host of the call's device set; a Future of its outputs
    (and, made off the controller's loop thread, in its ``_returns`` what the call
    returns there: ``colobus._api.pending``)."""
    import jax

    ctl = default_controller()
    tree = (args, kwargs)
    common = not kwargs  # f(x, y): the common call (loops here, not generators: fewer calls)
    for a in args if common else ():
        if type(a) is not Array:
            common = False
            break
    if common:
        leaves, treedef = list(args), _positional_treedef(len(args))
    else:
        leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_handle)
    for leaf in leaves:
        if isinstance(leaf, Array | Future):
            check_owner(leaf, ctl)
    plan = make_plan(leaves, devices)
    if target.signatures is not None:
        target.signatures.note(treedef, leaves, plan)
    if in_specs is not None:
        _check_specs(tree, in_specs, f"inputs of {target.name}", inputs=True)
    out_specs = None
    if out_specs_fn is not None:
        in_tree = jax.tree_util.tree_map(_spec_of_leaf, tree, is_leaf=_is_handle)
        out_specs = out_specs_fn(*in_tree[0], **in_tree[1])
    target.check(ctl, plan)
    for leaf in leaves:
        if isinstance(leaf, Array):
            leaf.check_usable()
    digest = target.digest()  # pickles the code now: SerializationError at the call
    pickled = pickle_args(tree, target.name, ctl)
    inputs = _check_buried(pickled.keep, leaves, plan, target.name)
    for state in pickled.objects:  # colocated objects passed as arguments
        state.bind(ctl)
    call_id = ctl._ops.next_id()
    fut: Future[Any] = Future(ctl._loop_thread_id, call_id, ctl)
    if _get_ident() != ctl._loop_thread_id:
        # off the controller's loop thread (a plain thread, or one running another event
        # loop): JAX's arrays at once where the output specs are known
        cell = cell_of(target, signature(treedef, leaves, plan))
        outs = cell[0] if cell is not None else None
        if outs is None and out_specs is not None and cell is not None:
            outs = cell[0] = outs_of_specs(out_specs, plan)
        fut._returns = Wait(cell) if outs is None else outs
    failed = _failed_input(inputs)
    if failed is not None:  # nothing to run it on: never sent, ends as its input did
        fut.info = plan
        fut._returns = None if fut._returns is None else Wait(None)
        if failed.cancelled():
            fut._set_cancelled()
        else:
            fut.set_exception(failed.exception())  # type: ignore[arg-type]
        return fut
    changes, gens = ctl._hosts.generations(plan.hosts)
    pending = None
    if type(fut._returns) is OutSpecs:
        pending = fut._returns = make_pending(ctl, call_id, fut._returns, fut, plan.hosts,
                                              gens, cell)
    op = _CallOp(ctl, target, plan, pickled, _stream_id(), digest, gens, call_id,
                 out_specs, changes, pending, check_replicas)
    # A JAX job's call on several hosts is never cancelled where it was sent: cancelled on
    # a host that had not started it and run on one that had, its collectives would pair
    # with the next call's. Cancelling its Future drops its result (freed as it comes).
    cancellable = len(plan.hosts) == 1 or ctl._job is None
    obs = ctl.observer  # None unless metrics or tracing is on
    if obs is None:
        fut = ctl._ops.submit(plan.hosts, op.send, _decode_result, op, call_id=op.call_id,
                              cancellable=cancellable, future=fut)
    else:
        seen = target.observed
        if seen is not None and seen[0] is obs:
            stats = seen[1]
        else:
            stats = obs.function(target.name, target.stats_key(digest))
            target.observed = (obs, stats)
        fut = ctl._ops.submit(plan.hosts, op.send, _decode_result, op, call_id=op.call_id,
                              cancellable=cancellable, stats=stats,
                              timing=obs.record(op.call_id, target.name, plan.hosts)
                              if obs.records else None, future=fut)
    fut.info = plan
    if inputs:
        _follow_inputs(fut, inputs)
    # When the Future goes, so does each host's result slot (kept for Futures as
    # arguments).
    ctl._frees.release_when_gone(fut, gens, call=op.call_id)
    return fut


def _check_buried(keep: list[Any], leaves: list[Any], plan: CallPlan,
                  name: str) -> list[Future[Any]]:
    """Check the handles the pickle found that are no pytree leaf; the input futures.

    A ``cb.Array`` (or call future) inside a plain object still reaches each
    host as its block there, so its devices must be the call's own: else a host
    would take its block for the whole. Returns every future among the inputs.
    """
    inputs: list[Future[Any]] = []
    for h in keep:  # a pending array's call: an input too (chained as a Future is)
        if type(h) is Array and h._call is not None:
            h._call._read()  # its error, if any, is the dependent call's (never logged)
            inputs.append(h._call)
    all_leaves = len(keep) == len(leaves)
    for a, b in zip(keep, leaves, strict=True) if all_leaves else ():
        if a is not b:
            all_leaves = False
            break
    leaf_ids = set() if all_leaves else {id(x) for x in leaves}
    for h in keep:
        if isinstance(h, Future):
            h._read()  # its error, if any, is the dependent call's: never logged as unread
            inputs.append(h)
        if all_leaves or id(h) in leaf_ids or not isinstance(h, Array | Future):
            continue
        devs = h.sharding.device_set if isinstance(h, Array) else set(h.info.devices)
        if set(devs) != set(plan.devices):
            kind = "cb.Array" if isinstance(h, Array) else "cb.Future"
            raise ValueError(
                f"an argument of {name} holds a {kind} inside an object that is not a pytree "
                f"node, on devices {sorted(d.id for d in devs)}, but the call runs on devices "
                f"{sorted(d.id for d in plan.devices)}: pass it as a pytree leaf (directly, "
                "or in a tuple, list, dict or registered pytree node) so that it takes part "
                "in the call's device set")
    return inputs


def _failed_input(inputs: list[Future[Any]]) -> Future[Any] | None:
    """The first of ``inputs`` that ended cancelled or failed, if any."""
    for f in inputs:
        if f.done() and (f.cancelled() or f._exception is not None):
            return f
    return None


def _follow_inputs(fut: Future[Any], inputs: list[Future[Any]]) -> None:
    """``fut`` (a call) ends as its first input to end badly does: cancelled as soon as
    one is cancelled, failed with its error as soon as one fails (an output check, a
    lost host, an error on a host: the input's own error, never what its hosts then
    make of the input's missing outputs)."""
    ref = weakref.ref(fut)

    def on_input(f: Future[Any]) -> None:
        dependent = ref()
        if dependent is None or dependent.done():
            return
        if f.cancelled():
            dependent.cancel()
        elif (exc := f._exception) is not None:
            owner = dependent._owner
            if isinstance(owner, Controller):
                fail_with(owner._ops, dependent, exc)

    for f in inputs:
        f.add_done_callback(on_input)


# -- the decorator ---------------------------------------------------------------------------------

# The common call's lane, set by colobus._api.lane as the package loads (None: off):
# ``lane(target, args, out_specs_fn)`` is the call's Future, or None (nothing done)
_LANE: list[Callable[[Target, tuple[Any, ...], Callable[..., Any] | None],
                     Future[Any] | None] | None] = [None]


class ColocatedFunction:
    """A function that runs on every host of its device set. A call returns what JAX's
    returns, its outputs as ``cb.Array`` handles at once, on any thread but the
    controller's event-loop thread; there (async code under ``async with``) an awaitable
    ``cb.Future`` of them (``colobus._api.pending``)."""

    def __init__(self, fn: Callable[..., Any], *, in_specs: Any = None,
                 out_specs_fn: Callable[..., Any] | None = None,
                 devices: Sequence[Device] | None = None, code: Code | None = None,
                 check_replicas: bool = False) -> None:
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._code = code if code is not None else Code(fn)
        self._target = FunctionTarget(self._code, getattr(fn, "__qualname__", repr(fn)))
        self._in_specs = in_specs
        self._out_specs_fn = out_specs_fn
        self._devices = tuple(devices) if devices is not None else None
        self._check_replicas = check_replicas
        # the common call's lane (colobus._api.lane): no input specs, no fixed devices
        self._lane = (_LANE[0] is not None and in_specs is None and devices is None
                      and not check_replicas)

    def __repr__(self) -> str:
        return f"<colocated_python {self._target.name}>"

    def specialize(self, in_specs: Any = None, out_specs_fn: Callable[..., Any] | None = None,
                   devices: Sequence[Device] | None = None,
                   check_replicas: bool | None = None) -> ColocatedFunction:
        """A new callable with fixed input specs, output specs function or devices, as
        JAX's; ``check_replicas=True`` (colobus's) compares the values of replicated
        outputs across hosts and devices, failing the call where they differ."""
        in_specs, out_specs_fn, devices = merge_specialization(
            (self._in_specs, self._out_specs_fn, self._devices), in_specs, out_specs_fn,
            devices)
        return ColocatedFunction(self._fn, in_specs=in_specs, out_specs_fn=out_specs_fn,
                                 devices=devices, code=self._code,
                                 check_replicas=merge_check(self._check_replicas,
                                                            check_replicas))

    def cache_info(self) -> CacheInfo:
        """Input signatures seen by this (specialized) function, and code shipped per host."""
        assert self._target.signatures is not None
        return self._target.signatures.info(self._code.shipped)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        target = self._target
        if self._lane and not kwargs:
            fut = _LANE[0](target, args, self._out_specs_fn)  # type: ignore[misc]
            if fut is not None:
                r = fut._returns  # (returned, inline)
                if r is None:  # the controller's loop thread: its Future
                    return fut
                return r.tree if type(r) is Pending else wait_outputs(fut, r)
        fut = invoke(target, args, kwargs, in_specs=self._in_specs,
                     out_specs_fn=self._out_specs_fn, devices=self._devices,
                     check_replicas=self._check_replicas)
        return returned(fut)


def returned(fut: Future[Any]) -> Any:
    """What a call returns: on the controller's event-loop thread its Future, at once;
    on any other thread its outputs, the pending arrays or, where their specs were not
    known, the outputs once its hosts ran it (``colobus._api.pending``)."""
    r = fut._returns
    if r is None:
        return fut
    return r.tree if type(r) is Pending else wait_outputs(fut, r)


def colocated_python(fn: Callable[..., Any]) -> ColocatedFunction:
    """Run ``fn`` once on each host of its device set, colocated with the data.

    The device set is the device list of the ``cb.Array`` arguments, or the one
    given with ``specialize(devices=...)``. Each array argument arrives on a host
    as a ``jax.Array`` holding that host's block; other arguments arrive as they
    are. A call returns its outputs as ``cb.Array`` handles at once, as JAX's does (its
    first call per input specs once its hosts ran it), on any thread but the
    controller's event-loop thread; there (async code under ``async with``) an awaitable
    ``cb.Future`` of them.
    """
    return ColocatedFunction(fn)
