"""A host's calls in flight: one CALL from arrival to reply, the streams they queue in.

The scheduler (:mod:`colobus._host.sched`) moves each :class:`_Call` through its
states (queued, running, cancelled, done) under its state lock.
"""

from __future__ import annotations

import asyncio
import collections
import io
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .._wire import protocol as P
from .._wire.envelope import Buffer, Envelope
from .._wire.pickling import handles_payload
from .pool import ArgsLoader
from .store import CallResult
from .values import NumpyBlock, PiecedBlock

if TYPE_CHECKING:
    import concurrent.futures

    from .._wire.calltimes import HostCallTimes
    from .._wire.channel import Channel, Peer
    from .dataplane import DataPlane
    from .jaxjob import HostJob
    from .store import Store
    from .values import HostValues

__all__ = ["_CANCELLED", "_DONE", "_QUEUED", "_RUNNING", "WorkerServices", "_Call", "_Destroy",
           "_Stream", "_settable", "call_args", "set_job"]

_QUEUED, _RUNNING, _CANCELLED, _DONE = range(4)


class _Stream:
    """The calls of one controller-side stream, which run in arrival order."""

    __slots__ = ("busy", "queue", "sid", "waiting")

    def __init__(self, sid: int) -> None:
        self.sid = sid
        self.queue: collections.deque[_Call | _Destroy] = collections.deque()
        self.busy = False  # a batch, an async call or a destroy of it is running
        self.waiting: asyncio.Future[Any] | None = None  # the head's unresolved input


class _Destroy:
    """A DESTROY waiting for its turn in a stream."""

    __slots__ = ("calls", "obj")

    def __init__(self, obj: int, calls: set[asyncio.Future[Any]]) -> None:
        self.obj = obj
        self.calls = calls


class _Call:
    """One CALL on this host, from arrival to reply."""

    __slots__ = ("after", "argvals", "arrived", "body", "env", "epoch", "fn", "last", "mesh", "obj",
                 "ok", "outcome", "pins", "ran", "results", "started", "state", "stream")

    def __init__(self, body: P.Call, env: Envelope, pins: list[asyncio.Future[Any]],
                 obj: asyncio.Future[Any] | None, results: asyncio.Future[Any],
                 stream: _Stream | None, epoch: int) -> None:
        self.body = body
        self.env: Envelope | None = env
        self.pins = pins
        self.obj = obj
        self.results = results
        self.stream = stream
        self.epoch = epoch
        self.state = _QUEUED
        self.fn: Any = None
        self.mesh: Any = None
        self.last = False  # the last of its batch: the stream is free once it is done
        self.ok = False
        self.outcome: Any = None
        # the pins' values as user code got them, where each is the stored value itself
        self.argvals: list[Any] | None = None
        # perf_counter_ns on arrival and at start, and ns it ran: the reply's times.
        self.arrived = self.started = self.ran = 0
        # In a JAX job, a spread call's turn: the results of the spread call that arrived
        # before it from another stream (colobus._host.sched); None: no turn to wait for
        self.after: asyncio.Future[Any] | None = None

    def times(self) -> list[int]:
        """``[queued, ran]`` in ns, as the RESULT reports them (empty: it never started)."""
        return [self.started - self.arrived, self.ran] if self.started else []

    def unready_input(self) -> asyncio.Future[Any] | None:
        """An input (argument or object) not resolved yet, or the job's turn not come
        yet (``after``), if any."""
        for p in self.pins:
            if not p.done():
                return p
        if self.obj is not None and not self.obj.done():
            return self.obj
        after = self.after
        if after is not None:
            if not after.done():
                return after
            self.after = None
        return None


def _settable(exc: BaseException) -> BaseException:
    """``exc``, or what stands for it where asyncio futures refuse it (StopIteration)."""
    if isinstance(exc, StopIteration | StopAsyncIteration):
        err = RuntimeError(f"a colocated call raised {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        return err
    return exc


class WorkerServices(Protocol):
    """What the scheduler and the host's arrays use of the worker that owns them."""

    epoch: int
    host_index: int
    loop: asyncio.AbstractEventLoop | None
    store: Store
    values: HostValues
    call_times: HostCallTimes | None
    dataplane: DataPlane | None
    _jax: Any
    _chan: Channel | None  # (the scheduler sends a RESULT's body packed by itself)
    _peer: Peer | None
    _max_message: int
    _pool: concurrent.futures.ThreadPoolExecutor

    def _spawn(self, coro: Any) -> None: ...
    def send(self, body: P.Body, payload: Buffer = b"", buffers: Sequence[Buffer] = (),
             pbufs: int = 0) -> None: ...
    def send_packed(self, kind: int, packed: bytes, payload: Buffer = b"",
                    buffers: Sequence[Buffer] = (), pbufs: int = 0) -> None: ...
    def cork(self) -> bool: ...
    def uncork(self, corked: bool) -> None: ...
    def reply_error(self, call_id: int, exc: BaseException, times: list[int] | None = None
                    ) -> None: ...
    def present(self, value: Any) -> Any: ...


# What user code receives otherwise than as stored (``present`` returns any other value).
_PRESENTED = (CallResult, PiecedBlock, NumpyBlock)

# This worker's part in the cluster's JAX job while it is in one (host code then sees
# global arrays): one list read per call, nothing more, in the block model.
_JOB: list[HostJob | None] = [None]


def set_job(job: HostJob | None) -> None:
    """The worker joined the cluster's JAX job (``job``), or left it (None)."""
    _JOB[0] = job


# The payload of ``f(a_0, ..., a_{n-1})`` of arrays alone, by its length (each n's is
# longer): the arguments are the values themselves (see ``call_args``).
_HANDLES = {len(p): (p, n) for n in range(9) for p in (handles_payload(n),)}


def call_args(call: _Call, present: Callable[[Any], Any]) -> tuple[Any, Any]:
    """A call's arguments: its pickled ones, with the host's values for what it names
    (``present``: the worker's, the identity on all but ``_PRESENTED``); in a JAX job,
    each array as the global ``jax.Array`` of its layout (``HostJob.view``)."""
    values = []
    plain = True
    shown: dict[int, Any] | None = None  # a value named again is the same object again
    for p in call.pins:
        v = p.result()
        if isinstance(v, _PRESENTED):
            if shown is None:
                plain, shown = False, {}
            got = shown.get(id(v))
            if got is None:
                got = shown[id(v)] = (v.tree(present) if isinstance(v, CallResult)
                                      else present(v))
            v = got
        values.append(v)
    if plain:
        call.argvals = values
    job = _JOB[0]
    if job is not None:  # (only where an array is global: a layout, or a global output)
        views = job._views
        for k, ref in enumerate(call.body.refs):
            if len(ref) > 2 or (views and id(values[k]) in views):
                values = _global_views(job, call.body.refs, values)
                break
    env = call.env
    assert env is not None
    payload = env.payload
    hit = _HANDLES.get(len(payload))
    if hit is not None and hit[1] == len(values) and not env.pbufs and payload == hit[0]:
        return tuple(values), {}  # (what unpickling it gives: arrays by position)
    unpickler = ArgsLoader(io.BytesIO(payload), buffers=env.buffers[: env.pbufs])
    unpickler._values = values
    args, kwargs = unpickler.load()
    return args, kwargs


def _global_views(job: HostJob, refs: list[Any], values: list[Any]) -> list[Any]:
    """The arguments' values as host code sees them in a JAX job: an array whose entry
    carries its global layout as that global array; a call's outputs as the global
    arrays they were made as (where host code made them so)."""
    out = list(values)
    for k, ref in enumerate(refs):
        if len(ref) > 2 and type(ref[2]) is bytes:
            out[k] = job.view(out[k], ref[2])
        elif ref[0] != 2:
            out[k] = job.known(out[k])
    return out
