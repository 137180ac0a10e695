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
fewer. Anything else returns None before doing anything, and takes the usual path
(an argument that is a pending array, a call's output while the call runs, too). Made
off the controller's loop thread (plain code, or a thread running another event loop),
the call's Future carries what the call returns there: its pending arrays, made here
from the output specs learned for its input signature, or what to learn into
(``colobus._api.pending``).

``COLOBUS_CALL_LANE=0`` (read at import) turns the lane off. ``colobus._api`` imports
this module as it loads, which sets the hook that ``ColocatedFunction`` calls.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._controller.controller import _current, default_controller
from .._controller.current import State
from .._controller.frees import WATCHED, release_now
from .._controller.future import _PENDING, Future
from .._controller.operation import Operation
from .._controller.wakeups import current_task_of
from .._errors import ControllerClosedError
from .._wire import protocol as P
from .._wire.lane import ON, pack
from .._wire.pickling import handles_payload as _handles_payload
from .array import Array, check_owner
from .func import (
    _LANE,
    Target,
    _CallOp,
    _decode_result,
    _stream_id,
    _thread_streams,
)
from .joblayout import _LAYOUTS, job_layout
from .pending import OutSpecs, Pending, Wait, cell_of, make_pending, outs_of_specs, signature
from .plan import CallPlan, make_plan
from .serialization import PickledArgs
from .specs import _positional_treedef, _spec_of_leaf
from .target import task_stream

if TYPE_CHECKING:
    from .._controller.controller import Controller

__all__ = ["ON", "call", "call_body"]

_get_ident = threading.get_ident
_current_task = current_task_of  # (asyncio.current_task(loop), without a Python call)
_get_running_loop = asyncio._get_running_loop
_controllers = _current._stack  # the entered controllers, most recent last
_RUNNING = State.RUNNING
# the loop thread's last caller: (its task, by a weak reference; its stream)
_last_stream: list[tuple[weakref.ref[asyncio.Task[Any]], int] | None] = [None]
_ref = weakref.ref
_CALL = int(P.Kind.CALL)
_MAX_PLANS = 64  # argument shardings remembered per function


def _out_specs(out_specs_fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """``out_specs_fn`` of the arguments' specs, as :func:`invoke` works them out (its
    ``tree_map`` of ``_spec_of_leaf`` over ``(args, {})``, for arrays alone)."""
    specs = []
    for a in args:
        specs.append(_spec_of_leaf(a))
    return out_specs_fn(*specs)


def _plan(target: Target, args: tuple[Any, ...]) -> CallPlan:
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


def call(target: Target, args: tuple[Any, ...],
         out_specs_fn: Callable[..., Any] | None = None) -> Future[Any] | None:
    """``invoke(target, args, {}, out_specs_fn=out_specs_fn)`` for the common call of a
    function (specialized or not) or an object's method; None (nothing done) if it is
    not."""
    if not args:
        return None
    for a in args:
        if type(a) is not Array or a._call is not None:  # (a pending one: chained there)
            return None
    try:  # default_controller(), read inline (any thread: a list's last item)
        ctl = _controllers[-1]
    except IndexError:
        ctl = None
    if ctl is None or ctl.state is not _RUNNING:
        ctl = default_controller()  # (raises what it raises)
    if ctl.observer is not None:
        return None
    for a in args:
        if a._ctl is not ctl:
            check_owner(a, ctl)
    sigs = target.signatures  # (a method's: None, cache_info() is a function's)
    seen = sigs.seen if sigs is not None else None
    a = args[0]
    n = len(args)
    # The input signature counted for cache_info(): a call like the last one of one
    # argument (the same sharding object, shape and dtype, and its key still in the set
    # of those seen) is a hit, counted without making its key (hashing a sharding). Its
    # output specs are those worked out then (as JAX, out_specs_fn runs once per input
    # signature, not once per call).
    last = target.lane_last
    cell: list[OutSpecs | None] | None
    if (last is not None and last[0] is a.sharding and last[1] == a.shape
            and last[2] == a.dtype and last[3] is seen and n == 1):
        plan: CallPlan = last[4]
        out_specs = last[5]
        cell = last[6]  # the output specs learned for this signature (off the loop thread)
        if sigs is not None:
            with sigs.lock:
                sigs.hits += 1
    else:
        plan = _plan(target, args)
        if sigs is not None:  # (seen read before note: a set that note replaces lacks the key)
            sigs.note(_positional_treedef(n), list(args), plan)
        out_specs = None if out_specs_fn is None else _out_specs(out_specs_fn, args)
        cell = None  # (several arguments: worked out below, off the loop thread)
        if n == 1:
            cell = cell_of(target, signature(_positional_treedef(1), [a], plan))
            target.lane_last = (a.sharding, a.shape, a.dtype, seen, plan, out_specs, cell)
    registry = ctl._hosts
    changes = registry.changes
    code = target.code
    if code is not None:  # a function
        if code.ready != ctl._shipper.serial:  # (target.check, inline)
            target.check(ctl, plan)
    else:
        # A method: its object's checks (bound to this controller, built where still
        # alive, its class's code prepared) hold while the plan and the hosts do.
        ok = target.lane_ok
        if ok is None or ok[0] is not plan or ok[1] != changes or ok[2] is not ctl:
            target.check(ctl, plan)
            ok = target.lane_ok = (plan, changes, ctl, target.digest())
    changes = registry.changes  # (read again: as after target.check on the general path)
    refs = []
    job = ctl._job
    for a in args:
        if a._deleted or a._failed is not None or a._checked != changes:
            a.check_usable()
        if job is None:
            refs.append([0, a.ref])
        else:  # a JAX job: its global layout beside it (job_refs, inline)
            hit = _LAYOUTS.get((id(a.sharding), a.shape))
            layout = hit[1] if hit is not None and hit[0] is a.sharding else job_layout(a)
            refs.append([0, a.ref] if layout is None else [0, a.ref, layout])
    if code is not None:
        blob = code._blob  # (target.digest(), inline once the code is pickled)
        digest = blob[0] if blob is not None else target.digest()  # SerializationError now
    else:
        assert ok is not None
        digest = ok[3]
    hosts = plan.hosts
    # registry.generations, kept per target while this registry's hosts stay as they
    # are (the registry's own: ``changes`` of another controller's may be equal)
    g = target.lane_gens
    if g is not None and g[0] is registry and g[1] is hosts and g[2] == changes:
        gens = g[3]
    else:
        changes, gens = registry.generations(hosts)
        target.lane_gens = (registry, hosts, changes, gens)
    ops = ctl._ops
    call_id = next(ops._ids)  # (ops.next_id, inline)
    if _get_ident() != ctl._loop_thread_id:
        fut: Future[Any] = Future(ctl._loop_thread_id, call_id, ctl)
        pending = None
        # Off the controller's loop thread (a plain thread, or one running another event
        # loop): JAX's arrays at once where the output specs are known.
        # _stream_id() on a plain thread: the thread's, read inline (a task's on a loop)
        stream = ((_get_running_loop() is None and getattr(_thread_streams, "sid", None))
                  or _stream_id())
        if cell is None:
            cell = cell_of(target, signature(_positional_treedef(n), list(args), plan))
        outs = cell[0] if cell is not None else None
        if outs is None and out_specs is not None and cell is not None:
            outs = cell[0] = outs_of_specs(out_specs, plan)
        if outs is None:
            fut._returns = Wait(cell)
        else:
            pending = fut._returns = make_pending(ctl, call_id, outs, fut, hosts, gens, cell)
        if len(hosts) == 1:
            _submit_one(ctl, target, plan, args, n, refs, stream, digest, gens, call_id,
                        out_specs, changes, fut)
        else:
            op = _CallOp(ctl, target, plan, _pickled(args, refs), stream, digest, gens, call_id,
                         out_specs, changes, pending)
            # (a JAX job's call on several hosts: never cancelled on them, as invoke)
            ops.submit(hosts, op.send, _decode_result, op, call_id=call_id,
                       cancellable=job is None, future=fut)
    else:
        # _stream_id() on the loop thread: the last task's, kept (by a weak reference)
        task = _current_task(ctl._loop)  # (the running loop: this is its thread)
        last_stream = _last_stream[0]
        if task is not None and last_stream is not None and last_stream[0]() is task:
            stream = last_stream[1]
        elif task is not None:  # (_stream_id() without asking for the task again)
            stream = task_stream(task)
            _last_stream[0] = (weakref.ref(task), stream)
        else:
            stream = _stream_id()
            _last_stream[0] = None
        if (ops.backlog or ctl._closed
                or (len(ops.pending) >= ops.max_inflight and ops._full(hosts))):
            op = (_LaneOp if len(hosts) == 1 else _CallOp)(
                ctl, target, plan, _pickled(args, refs), stream, digest, gens, call_id,
                out_specs, changes)
            fut = ops.submit(hosts, op.send, _decode_result, op, call_id=call_id,
                             cancellable=job is None or len(hosts) == 1)
        else:
            # ops.submit -> _start -> _go, for an operation that leaves now: it never
            # queues, so it takes no back-pressure slot (and gives none back).
            fut = Future(ctl._loop_thread_id, call_id, ctl)
            fut._canceller = ops._canceller
            if len(hosts) == 1:
                _go_one(ctl, target, plan, args, n, refs, stream, digest, gens, call_id,
                        out_specs, changes, fut)
            else:
                if job is not None:  # (never cancelled on its hosts, as invoke)
                    fut._canceller = None
                op = _CallOp(ctl, target, plan, _pickled(args, refs), stream, digest, gens,
                             call_id, out_specs, changes)
                ops._go(Operation(call_id, fut, hosts, op.send, _decode_result, op, False))
    fut.info = plan
    WATCHED[_ref(fut, release_now)] = (ctl._frees, gens, 0, call_id)  # (release_when_gone)
    return fut


def _submit_one(ctl: Controller, target: Target, plan: CallPlan, args: tuple[Any, ...],
                nargs: int, refs: list[list[int]], stream: int, digest: bytes,
                gens: dict[int, int], call_id: int, out_specs: Any, changes: int,
                fut: Future[Any]) -> None:
    """``ops.submit`` of a one-host call from another thread than the loop's: its
    back-pressure slot taken as ``_take_slot`` takes it (a plain thread waits there while
    ``max_backlog`` are queued), and :func:`_start_one` posted to the loop's inbox
    (``ctl._call_soon``) in the order of everything else submitted, with its Future."""
    if ctl._closed:
        ctl._check_open()  # (raises)
    ops = ctl._ops
    with ops._slots:  # (ops._take_slot, its case with room inline)
        room = ops.queued < ops.max_backlog
        if room:
            ops.queued += 1
    if not room:
        ops._take_slot()
    fut._canceller = ops._canceller
    inbox = ctl._inbox
    assert inbox is not None
    try:
        inbox.post(_start_one, ctl, target, plan, args, nargs, refs, stream, digest, gens,
                   call_id, out_specs, changes, fut)
    except RuntimeError:  # the loop closed under us
        raise ControllerClosedError("the colobus controller is closed") from None


def _start_one(ctl: Controller, target: Target, plan: CallPlan, args: tuple[Any, ...],
               nargs: int, refs: list[list[int]], stream: int, digest: bytes,
               gens: dict[int, int], call_id: int, out_specs: Any, changes: int,
               fut: Future[Any]) -> None:
    """Loop thread: ``ops._start`` of what :func:`_submit_one` posted (its slot given
    back as it leaves or ends; to the backlog behind what waits there, or while its
    host is full), then :func:`_go_one`."""
    ops = ctl._ops
    if fut._state != _PENDING:  # cancelled before it reached the loop
        ops._give_slot()
        return
    if ctl._closed:
        ops._give_slot()
        fut.set_exception(ControllerClosedError("the colobus controller is closed"))
        return
    hosts = plan.hosts
    if ops.backlog or (len(ops.pending) >= ops.max_inflight and ops._full(hosts)):
        r = fut._returns
        op = _LaneOp(ctl, target, plan, _pickled(args, refs), stream, digest, gens, call_id,
                     out_specs, changes, r if type(r) is Pending else None)
        ops.backlog.append(Operation(call_id, fut, hosts, op.send, _decode_result, op, True))
        return
    ops._give_slot()  # (as _go gives it)
    _go_one(ctl, target, plan, args, nargs, refs, stream, digest, gens, call_id, out_specs,
            changes, fut)


def _pickled(args: tuple[Any, ...], refs: list[list[int]]) -> PickledArgs:
    """``pickle_args((args, {}), ...)`` of handles alone (their checks made by the caller)."""
    return PickledArgs(_handles_payload(len(args)), [], refs, list(args), [])


def _go_one(ctl: Controller, target: Target, plan: CallPlan, args: tuple[Any, ...],
            nargs: int, refs: list[list[int]], stream: int, digest: bytes, gens: dict[int, int],
            call_id: int, out_specs: Any, changes: int, fut: Future[Any]) -> None:
    """``ops._go`` of a one-host call that leaves now (loop thread; ``fut`` is new): when
    its host is alive, as when the call was made, and has its code (a method's: has
    built its object), the CALL is queued here as :meth:`_LaneOp.send` would; otherwise
    ``_go`` does what it does."""
    ops = ctl._ops
    (h,) = plan.hosts
    host = ctl._hosts.hosts[h]
    chan = ctl._chan
    built = target.built
    r = fut._returns  # (the pending arrays the call returned, if any)
    pending = r if type(r) is Pending else None
    if not (host.alive and host.generation == gens[h] and chan is not None
            and (digest in host.code_sent if built is None
                 else built.get(h) == host.generation)):
        op = _LaneOp(ctl, target, plan, _pickled(args, refs), stream, digest, gens, call_id,
                     out_specs, changes, pending)
        ops._go(Operation(call_id, fut, plan.hosts, op.send, _decode_result, op, False))
        return
    op = _LaneOp(ctl, target, plan, None, stream, digest, gens, call_id, out_specs, changes,
                 pending)
    operation = Operation(call_id, fut, plan.hosts, op.send, _decode_result, op, False)
    operation.send = None  # (sent here)
    host.inflight.add(call_id)
    host.awaiting.add(call_id)
    ops.pending[call_id] = operation
    try:
        if nargs == 1:  # an output laid out like an argument gets its global sharding
            op.ref_shardings = (args[0].sharding,)
        else:
            shardings = []
            for a in args:
                shardings.append(a.sharding)
            op.ref_shardings = tuple(shardings)
        n = len(ctl._hosts.hosts)  # cb.host_count() on the hosts
        if n < ctl._expected_hosts:
            n = ctl._expected_hosts
        mid = target.lane_mid
        if mid is None or mid[0] != digest:
            mid = target.lane_mid = (
                digest, pack(digest) + pack(target.obj_id) + pack(target.method))
        meshes = plan.packed_mesh or plan.packed_meshes()
        # (call_body, inline)
        body = (b"\x98" + pack(call_id) + pack(stream) + mid[1] + pack(refs) + meshes[h]
                + pack(n))
        chan.send_packed(host.peer, _CALL, body, _handles_payload(nargs))
        ctl._counters["calls"] += 1  # (ctl._count, inline)
    except BaseException as exc:  # as _go
        operation.end(ops, exc)


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
        shardings = []  # an output laid out like an argument gets its global sharding
        for k in pickled.keep:  # (handles only)
            shardings.append(k.sharding)
        self.ref_shardings = tuple(shardings)
        hosts = len(ctl._hosts.hosts)  # cb.host_count() on the hosts
        if hosts < ctl._expected_hosts:
            hosts = ctl._expected_hosts
        digest = self.digest
        mid = target.lane_mid
        if mid is None or mid[0] != digest:
            mid = target.lane_mid = (
                digest, pack(digest) + pack(target.obj_id) + pack(target.method))
        meshes = plan.packed_mesh or plan.packed_meshes()
        head = b"\x98" + pack(call_id) + pack(self.stream) + mid[1] + pack(pickled.refs)
        for h in plan.hosts:
            body = head + meshes[h] + pack(hosts)  # (call_body, inline)
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
        ctl._counters["calls"] += 1  # (ctl._count, inline)


if ON:
    _LANE[0] = call
