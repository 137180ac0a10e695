"""Controller side of colocated calls: the decorator, specs, dispatch, outputs.

One call runs its function once on each host of its device set (``_plan``).
The caller pickles the arguments once (``_serialization``), the loop thread
sends one CALL per host, and the per-host output descriptions are combined
into global ``cb.Array`` handles that stay on the hosts.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from .._controller.coalesced import HOST_BLIND
from .._controller.controller import Controller, default_controller
from .._controller.future import Future
from .._controller.hosts import Host
from .._controller.resultlane import SETTLERS
from .._model.devices import Device
from .._observe.observer import FunctionStats, Observer
from .._wire import protocol as P
from .._wire.describe import read_outputs
from .._wire.envelope import Envelope
from .._wire.peer import Peer
from .._wire.splice import CallSplicer
from .array import Array, check_owner
from .cacheinfo import CacheInfo, Signatures
from .firstcall import first_call
from .outputs import build_outputs as _build_outputs
from .outputs import lane_outputs, learn_outputs
from .plan import CallPlan, make_plan
from .serialization import Code, ColocatedObjectBase, PickledArgs, pickle_args
from .specs import (
    _check_specs,
    _is_handle,
    _positional_treedef,
    _spec_of_leaf,
    merge_specialization,
)

__all__ = [
    "CallPlan", "Code", "ColocatedFunction", "ColocatedObjectBase", "PickledArgs",
    "colocated_python", "invoke", "pickle_args",
]


# -- the call -------------------------------------------------------------------------------------


_stream_counter = itertools.count(1)
_task_streams: weakref.WeakKeyDictionary[asyncio.Task[Any], int] = weakref.WeakKeyDictionary()
_thread_streams = threading.local()


def task_stream(task: asyncio.Task[Any]) -> int:
    """A task's stream (see :func:`_stream_id`), the task known."""
    sid = _task_streams.get(task)
    if sid is None:
        sid = _task_streams[task] = next(_stream_counter)
    return sid


def _stream_id() -> int:
    """The calling task's (else thread's) stream: unique for this process's lifetime.

    Not ``id(task)`` or the thread ident: those are reused once a task or thread
    ends, which would queue a new caller's calls behind an old caller's calls
    still running on the hosts (ordering is per stream).
    """
    try:
        task = asyncio.current_task()
    except RuntimeError:
        task = None
    if task is not None:
        return task_stream(task)
    sid = getattr(_thread_streams, "sid", None)
    if sid is None:
        sid = _thread_streams.sid = next(_stream_counter)
    return int(sid)


class Target:
    """What a call runs: a function (by digest) or a method of a colocated object."""

    name: str = ""
    obj_id: int = 0
    method: str = ""
    signatures: Signatures | None = None  # counted where cache_info() reports them
    observed: tuple[Observer, FunctionStats] | None = None  # its counters, and whose
    code: Code | None = None  # a function's: all prepare() does is ship it
    built: dict[int, int] | None = None  # a method's object: host -> generation built in
    # the call's lane (colobus._api.lane): digest, obj_id and method packed; the last
    # one-argument call's (sharding, shape, dtype, signature set, plan, output specs); the
    # generations of its plan's hosts (registry, hosts, registry.changes, generations); a
    # method's checks passed (plan, registry.changes, controller, digest)
    lane_mid: tuple[bytes, bytes] | None = None
    lane_last: tuple[Any, Any, Any, Any, CallPlan, Any] | None = None
    lane_gens: tuple[Any, tuple[int, ...], int, dict[int, int]] | None = None
    lane_ok: tuple[CallPlan, int, Controller, bytes] | None = None
    known: bool = False  # its output specs are (out_specs_fn, a call succeeded): firstcall

    def learned(self, fut: Future[Any]) -> None:
        """A call of it ended (any thread): once one succeeded, its output specs are known."""
        if fut.done() and not fut.cancelled() and fut._exception is None:
            self.known = True

    def digest(self) -> bytes:
        return b""

    def stats_key(self, digest: bytes) -> tuple[bytes, str]:
        """What hosts call this target when they report its run times (its call's digest)."""
        return (digest, self.method)

    def check(self, ctl: Controller, plan: CallPlan) -> None:
        """Raise at the call if this target cannot run on ``plan`` (caller's thread)."""

    def prepare(self, ctl: Controller, host: Host) -> None:
        """Loop thread, before the CALL: make sure the host has what it needs."""


class FunctionTarget(Target):
    code: Code

    def __init__(self, code: Code, name: str) -> None:
        self.code = code
        self.name = name
        self.signatures = Signatures()

    def digest(self) -> bytes:
        return self.code.get()[0]

    def check(self, ctl: Controller, plan: CallPlan) -> None:
        if self.code.ready != ctl._shipper.serial:  # its first call with ctl
            self.code.prepare(ctl)

    def prepare(self, ctl: Controller, host: Host) -> None:
        self.code.ship(ctl, host)


def invoke(target: Target, args: tuple[Any, ...], kwargs: dict[str, Any], *,
           in_specs: Any = None, out_specs_fn: Callable[..., Any] | None = None,
           devices: Sequence[Device] | None = None) -> Future[Any]:
    """Run ``target`` on every host of the call's device set; a Future of its outputs."""
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
    if inputs and any(f.cancelled() for f in inputs):  # nothing to run it on: never sent
        fut = ctl._ops.new_future(ctl._ops.next_id())
        fut.info = plan
        fut._set_cancelled()
        return fut
    changes, gens = ctl._hosts.generations(plan.hosts)
    op = _CallOp(ctl, target, plan, pickled, _stream_id(), digest, gens, ctl._ops.next_id(),
                 out_specs, changes)
    # A JAX job's call on several hosts is never cancelled where it was sent: cancelled on
    # a host that had not started it and run on one that had, its collectives would pair
    # with the next call's. Cancelling its Future drops its result (freed as it comes).
    cancellable = len(plan.hosts) == 1 or ctl._job is None
    obs = ctl.observer  # None unless metrics or tracing is on
    if obs is None:
        fut = ctl._ops.submit(plan.hosts, op.send, _decode_result, op, call_id=op.call_id,
                              cancellable=cancellable)
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
                              if obs.records else None)
    fut.info = plan
    if inputs:
        _cancel_with(fut, inputs)
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
    all_leaves = len(keep) == len(leaves)
    for a, b in zip(keep, leaves, strict=True) if all_leaves else ():
        if a is not b:
            all_leaves = False
            break
    leaf_ids = set() if all_leaves else {id(x) for x in leaves}
    for h in keep:
        if isinstance(h, Future):
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


def _cancel_with(fut: Future[Any], inputs: list[Future[Any]]) -> None:
    """``fut`` ends cancelled as soon as one of its input futures is cancelled."""
    ref = weakref.ref(fut)

    def on_input(f: Future[Any]) -> None:
        if f.cancelled():
            dependent = ref()
            if dependent is not None:
                dependent.cancel()

    for f in inputs:
        f.add_done_callback(on_input)


class _CallOp:
    """One call's sending and output building (a class, not closures: fewer objects
    per call for the collector to track while calls are in flight)."""

    __slots__ = ("call_id", "changes", "ctl", "digest", "gens", "out_specs", "pickled", "plan",
                 "ref_shardings", "stream", "target")

    def __init__(self, ctl: Controller, target: Target, plan: CallPlan,
                 pickled: PickledArgs | None, stream: int, digest: bytes,
                 gens: dict[int, int], call_id: int, out_specs: Any, changes: int) -> None:
        self.changes = changes  # the host registry's, when ``gens`` were read
        self.ctl = ctl
        self.target = target
        self.plan = plan
        self.pickled: PickledArgs | None = pickled
        self.stream = stream
        self.digest = digest
        self.gens = gens
        self.call_id = call_id
        self.out_specs = out_specs
        self.ref_shardings: tuple[Any, ...] = ()

    def send(self, call_id: int) -> None:
        """Loop thread: one CALL per host; drops the pickled arguments once sent."""
        ctl, target, plan, pickled = self.ctl, self.target, self.plan, self.pickled
        assert pickled is not None
        self.pickled = None  # argument handles live until the call is sent, no longer
        if pickled.needs:  # the user's packages the arguments name go first
            for h in plan.hosts:
                ctl._shipper.ship(ctl, ctl._hosts[h], pickled.needs)
        if pickled.keep:  # an output laid out like an argument gets its global sharding
            shardings = []
            for k in pickled.keep:
                shardings.append(k.sharding if isinstance(k, Array) else None)
            self.ref_shardings = tuple(shardings)
        payload, bufs = pickled.payload, pickled.buffers
        hosts = max(ctl._expected_hosts, len(ctl._hosts))  # cb.host_count() on the hosts
        # P.Call's fields; all but the host's mesh and the host count packed once
        splice = CallSplicer([call_id, self.stream, self.digest, target.obj_id, target.method,
                              pickled.refs], len(plan.hosts) > 1)
        registry, objects, nbufs, chan = ctl._hosts, pickled.objects, len(bufs), ctl._chan
        # A fan-out made again with no host joined or lost since: its hosts are as checked
        # last time (generations, code shipped, alive, relays), their peers grouped.
        key = (id(plan), self.digest)
        again = registry.fanouts.get(key) if len(plan.hosts) > 1 and not objects else None
        if (again is not None and again[0] is plan and again[1] == registry.changes
                and self.changes == registry.changes and target.code is not None):
            if chan is not None:  # each body the head, then its host's mesh and count
                chan.send_fanned(again[2], P.Kind.CALL, splice.head, splice.end(hosts), payload,
                                 bufs, nbufs)
            ctl._count("calls")
            return
        meshes = plan.packed_meshes()
        known, gens = registry.hosts, self.gens
        prepare, code, digest = target.prepare, target.code, self.digest
        # the hosts by their mesh (one body each), sent together once all are prepared:
        # a fan-out's CALLs join their relay's next message as one entry
        to: dict[bytes, list[Peer]] = {}
        for h in plan.hosts:
            host = known[h]
            if host.generation != gens[h]:
                raise host.lost_error("it rejoined after this call was made")
            if code is None:
                prepare(ctl, host)
            elif digest not in host.code_sent:  # (what code.ship looks at, inline)
                code.ship(ctl, host)
            for state in objects:
                state.ensure_built(ctl, host)
            if host.alive:  # as ctl._send does
                mesh = meshes[h]
                peers = to.get(mesh)
                if peers is None:
                    to[mesh] = [host.peer]
                else:
                    peers.append(host.peer)
        if chan is not None:
            groups = []
            for mesh, peers in to.items():
                if len(peers) == 1:
                    chan.send_packed(peers[0], P.Kind.CALL, splice.packed(mesh, hosts), payload,
                                     bufs, nbufs)
                else:
                    fanned = chan.fanout(peers)
                    groups.append((mesh, fanned))
                    chan.send_packed_many(fanned, P.Kind.CALL, splice.packed(mesh, hosts), payload,
                                          bufs, nbufs)
            if len(plan.hosts) > 1 and not objects and code is not None and (
                    self.changes == registry.changes and len(groups) == len(to)):
                if len(registry.fanouts) >= 64:
                    registry.fanouts.clear()
                registry.fanouts[key] = (plan, registry.changes,
                                         chan.fanned(groups, splice.end(hosts)))
        ctl._count("calls")

    def __call__(self, per_host: dict[int, Any]) -> Any:
        """The combiner: the call's outputs from each host's reply (loop thread).

        The op itself, not its bound method: one object less per call in flight.
        """
        out = _build_outputs(self.ctl, self.call_id, self.plan, per_host, self.ref_shardings,
                             self.target.name)
        if self.out_specs is not None:
            _check_specs(out, self.out_specs, f"outputs of {self.target.name}")
        return out


def _decode_result(host: Host, body: P.Result, env: Envelope) -> Any:
    """A host's output description (msgpack; never a pickle: see ``_describe``)."""
    return read_outputs(env.payload, body.meta)


HOST_BLIND.add(_decode_result)  # equal replies of a relay's hosts: decoded once
SETTLERS[_decode_result] = (lane_outputs, learn_outputs, read_outputs)  # the reply's lane


# -- the decorator ---------------------------------------------------------------------------------

# The common call's lane, set by colobus._api.lane as the package loads (None: off):
# ``lane(target, args, out_specs_fn)`` is the call's Future, or None (nothing done)
_LANE: list[Callable[[Target, tuple[Any, ...], Callable[..., Any] | None],
                     Future[Any] | None] | None] = [None]


class ColocatedFunction:
    """A function that runs on every host of its device set; calls return ``cb.Future``."""

    def __init__(self, fn: Callable[..., Any], *, in_specs: Any = None,
                 out_specs_fn: Callable[..., Any] | None = None,
                 devices: Sequence[Device] | None = None, code: Code | None = None) -> None:
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._code = code if code is not None else Code(fn)
        self._target = FunctionTarget(self._code, getattr(fn, "__qualname__", repr(fn)))
        self._target.known = out_specs_fn is not None
        self._in_specs = in_specs
        self._out_specs_fn = out_specs_fn
        self._devices = tuple(devices) if devices is not None else None
        # the common call's lane (colobus._api.lane): no input specs, no fixed devices
        self._lane = _LANE[0] is not None and in_specs is None and devices is None

    def __repr__(self) -> str:
        return f"<colocated_python {self._target.name}>"

    def specialize(self, in_specs: Any = None, out_specs_fn: Callable[..., Any] | None = None,
                   devices: Sequence[Device] | None = None) -> ColocatedFunction:
        """A new callable with fixed input specs, output specs function or devices."""
        in_specs, out_specs_fn, devices = merge_specialization(
            (self._in_specs, self._out_specs_fn, self._devices), in_specs, out_specs_fn,
            devices)
        return ColocatedFunction(self._fn, in_specs=in_specs, out_specs_fn=out_specs_fn,
                                 devices=devices, code=self._code)

    def cache_info(self) -> CacheInfo:
        """Input signatures seen by this (specialized) function, and code shipped per host."""
        assert self._target.signatures is not None
        return self._target.signatures.info(self._code.shipped)

    def __call__(self, *args: Any, **kwargs: Any) -> Future[Any]:
        target = self._target
        if self._lane and not kwargs:
            fut = _LANE[0](target, args, self._out_specs_fn)  # type: ignore[misc]
            if fut is not None:
                return fut if target.known else first_call(target, fut)
        fut = invoke(target, args, kwargs, in_specs=self._in_specs,
                     out_specs_fn=self._out_specs_fn, devices=self._devices)
        return fut if target.known else first_call(target, fut)


def colocated_python(fn: Callable[..., Any]) -> ColocatedFunction:
    """Run ``fn`` once on each host of its device set, colocated with the data.

    The device set is the device list of the ``cb.Array`` arguments, or the one
    given with ``specialize(devices=...)``. Each array argument arrives on a host
    as a ``jax.Array`` holding that host's block; other arguments arrive as they
    are. Calls return a ``cb.Future`` of the outputs as ``cb.Array`` handles.
    """
    return ColocatedFunction(fn)
