"""The common call's lane, controller side: ``f(x, ...)`` to its CALL in few Python calls.

A call of a plain colocated function whose arguments are all ``cb.Array`` handles,
with no specs, no fixed devices, metrics and tracing off, made on the controller's
loop thread (``async with``) while no operation waits in the backlog and its hosts
have room, needs none of what :func:`colobus._api.func.invoke` prepares for the
other calls: no pytree flattening, no plan worked out again (the plan of the same
argument shardings is kept per function), no hop through the backlog and its
back-pressure slot (the call leaves at once, as the backlog would send it). It makes
the same checks in the same order, raises the same errors, numbers, sends, cancels
and frees the call exactly as that path does: only the Python calls in between are
fewer. Anything else returns None before doing anything, and takes the usual path.

``COLOBUS_CALL_LANE=0`` (read at import) turns the lane off. ``colobus._api`` imports
this module as it loads, which sets the hook that ``ColocatedFunction`` calls.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from .._controller.controller import default_controller
from .._controller.future import Future
from .._controller.operation import Operation
from .._wire import protocol as P
from .._wire.lane import ON, pack
from .array import Array, check_owner
from .func import (
    _LANE,
    FunctionTarget,
    _CallOp,
    _check_buried,
    _decode_result,
    _positional_treedef,
    _stream_id,
)
from .plan import CallPlan, make_plan
from .serialization import pickle_args

if TYPE_CHECKING:
    from .._controller.controller import Controller

__all__ = ["ON", "call", "call_body"]

_get_ident = threading.get_ident
_MAX_PLANS = 64  # argument shardings remembered per function


def _plan(target: FunctionTarget, args: tuple[Any, ...]) -> CallPlan:
    """``make_plan`` of ``args``, kept per function by their shardings (held: their ids
    stay theirs)."""
    plans: dict[Any, tuple[tuple[Any, ...], CallPlan]] | None = target.__dict__.get("lane_plans")
    if plans is None:
        plans = target.lane_plans = {}  # type: ignore[attr-defined]
    if len(args) == 1:
        sh = args[0].sharding
        hit = plans.get(id(sh))
        if hit is not None and hit[0][0] is sh:
            return hit[1]
        key: Any = id(sh)
        shardings: tuple[Any, ...] = (sh,)
    else:
        shardings = tuple([a.sharding for a in args])
        key = tuple([id(s) for s in shardings])
        hit = plans.get(key)
        if hit is not None:
            same = True
            for a, b in zip(hit[0], shardings, strict=True):
                if a is not b:
                    same = False
                    break
            if same:
                return hit[1]
    plan = make_plan(list(args), None)
    if len(plans) >= _MAX_PLANS:
        plans.clear()
    plans[key] = (shardings, plan)
    return plan


def call(target: FunctionTarget, args: tuple[Any, ...]) -> Future[Any] | None:
    """``invoke(target, args, {})`` for the common call; None (nothing done) if it is not."""
    if not args:
        return None
    for a in args:
        if type(a) is not Array:
            return None
    ctl = default_controller()
    if ctl.observer is not None:
        return None
    for a in args:
        if a._ctl is not ctl:
            check_owner(a, ctl)
    plan = _plan(target, args)
    leaves = list(args)
    assert target.signatures is not None
    target.signatures.note(_positional_treedef(len(args)), leaves, plan)
    target.check(ctl, plan)
    registry = ctl._hosts
    changes = registry.changes
    for a in args:
        if a._deleted or a._failed is not None or a._checked != changes:
            a.check_usable()
    digest = target.digest()  # pickles the code now: SerializationError at the call
    pickled = pickle_args((args, {}), target.name, ctl)
    keep = pickled.keep
    buried = len(keep) != len(leaves)
    for k, leaf in zip(keep, leaves, strict=False) if not buried else ():
        if k is not leaf:
            buried = True
            break
    if buried or pickled.objects:  # (not from Arrays alone; as invoke does, if so)
        inputs = _check_buried(keep, leaves, plan, target.name)
        for state in pickled.objects:
            state.bind(ctl)
        if inputs:
            return _submit_usual(ctl, target, plan, pickled, digest, inputs)
    changes, gens = registry.generations(plan.hosts)
    ops = ctl._ops
    hosts = plan.hosts
    op = (_LaneOp if len(hosts) == 1 and not pickled.objects else _CallOp)(
        ctl, target, plan, pickled, _stream_id(), digest, gens, ops.next_id(), None, changes)
    if (_get_ident() != ctl._loop_thread_id or ops.backlog or ctl._closed
            or (len(ops.pending) >= ops.max_inflight and ops._full(hosts))):
        fut = ops.submit(hosts, op.send, _decode_result, op, call_id=op.call_id,
                         cancellable=True)
    else:
        # ops.submit -> _start -> _go, for an operation that leaves now: it never queues,
        # so it takes no back-pressure slot (and gives none back).
        fut = Future(ctl._loop_thread_id, op.call_id, ctl)
        fut._canceller = ops._canceller
        ops._go(Operation(op.call_id, fut, hosts, op.send, _decode_result, op, False))
    fut.info = plan
    ctl._frees.release_when_gone(fut, gens, call=op.call_id)
    return fut


def _submit_usual(ctl: Controller, target: FunctionTarget, plan: CallPlan, pickled: Any,
                  digest: bytes, inputs: list[Future[Any]]) -> Future[Any]:
    """A call with futures among its inputs: as :func:`colobus._api.func.invoke` ends."""
    from .func import _cancel_with

    if any(f.cancelled() for f in inputs):  # nothing to run it on: never sent
        fut = ctl._ops.new_future(ctl._ops.next_id())
        fut.info = plan
        fut._set_cancelled()
        return fut
    changes, gens = ctl._hosts.generations(plan.hosts)
    op = _CallOp(ctl, target, plan, pickled, _stream_id(), digest, gens, ctl._ops.next_id(),
                 None, changes)
    fut = ctl._ops.submit(plan.hosts, op.send, _decode_result, op, call_id=op.call_id,
                          cancellable=True)
    fut.info = plan
    _cancel_with(fut, inputs)
    ctl._frees.release_when_gone(fut, gens, call=op.call_id)
    return fut


def call_body(call_id: int, stream: int, mid: bytes, refs: list[Any], mesh: bytes,
              hosts: int) -> bytes:
    """A CALL's body: ``pack_body(P.Call(call_id, stream, digest, obj_id, method, refs,
    mesh, hosts).to_wire())`` for ``mid``, the three middle fields packed, and ``mesh``
    packed (tests/test_lane.py compares them)."""
    body: bytes = b"\x98" + pack(call_id) + pack(stream) + mid + pack(refs) + mesh + pack(hosts)
    return body


class _LaneOp(_CallOp):
    """A one-host call's sending: :meth:`_CallOp.send` with the CALL's body spliced from
    bytes packed once per function (digest, object, method) and per plan (the mesh)."""

    __slots__ = ()

    def send(self, call_id: int) -> None:
        ctl, target, plan, pickled = self.ctl, self.target, self.plan, self.pickled
        assert pickled is not None
        self.pickled = None  # argument handles live until the call is sent, no longer
        if pickled.keep:  # an output laid out like an argument gets its global sharding
            shardings = []
            for k in pickled.keep:
                shardings.append(k.sharding if isinstance(k, Array) else None)
            self.ref_shardings = tuple(shardings)
        hosts = max(ctl._expected_hosts, len(ctl._hosts))  # cb.host_count() on the hosts
        digest = self.digest
        mid = target.__dict__.get("lane_mid")
        if mid is None or mid[0] != digest:
            mid = target.lane_mid = (  # type: ignore[attr-defined]
                digest, pack(digest) + pack(target.obj_id) + pack(target.method))
        meshes = plan.packed_mesh or plan.packed_meshes()
        for h in plan.hosts:
            body = call_body(call_id, self.stream, mid[1], pickled.refs, meshes[h], hosts)
            host = ctl._hosts.hosts[h]
            if host.generation != self.gens[h]:
                raise host.lost_error("it rejoined after this call was made")
            code = target.code
            if code is None:
                target.prepare(ctl, host)
            elif digest not in host.code_sent:  # (what code.ship looks at, inline)
                code.ship(ctl, host)
            chan = ctl._chan
            if host.alive and chan is not None:  # as ctl._send does
                chan.send_packed(host.peer, P.Kind.CALL, body, pickled.payload,
                                 pickled.buffers, len(pickled.buffers))
        ctl._count("calls")


if ON:
    _LANE[0] = call
