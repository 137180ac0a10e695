"""One remote operation, from submission to its single ending (:mod:`.ops` holds the
table of them).

An operation's hosts yet to answer are a bit mask (:attr:`Operation.remaining`). One
on a few hosts is also listed in each host's ``inflight`` and ``awaiting`` sets; a
*wide* one (more than :data:`WIDE` host: a fan-out) is not, so that sending it and
settling its replies cost no step per host: its mask is what it waits for, and once it
ended, :attr:`Operations.late` keeps the mask of the hosts that still owe a reply.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .._errors import ControllerClosedError, ProtocolError
from .._wire import protocol as P
from .._wire.describe import BadReply
from .._wire.envelope import Envelope
from .._wire.failures import read_error, rebuild_error
from .future import fail_call
from .hosts import host_mask

if TYPE_CHECKING:
    from .future import Future
    from .hosts import Host, HostRegistry

__all__ = ["WIDE", "Combiner", "Decoder", "Operation", "Sender", "rebuild_exception"]

WIDE = 1  # an operation on more hosts than this keeps its hosts in masks only


class Table(Protocol):
    """What an operation's ending changes of the table it is in (:class:`.ops.Operations`)."""

    pending: dict[int, Operation]
    wide: dict[int, Operation]
    late: dict[int, int]

    @property
    def hosts(self) -> HostRegistry: ...
    def free_outputs(self, host: int, call_id: int, n: int) -> None: ...

# What a reply from one host turns into; runs on the loop thread on receipt.
Decoder = Callable[["Host", P.Result, Envelope], Any]
# Combines the per-host values (by host index) into the future's result.
Combiner = Callable[[dict[int, Any]], Any]
# How an operation's messages leave: called once, on the loop thread, with its id.
Sender = Callable[[int], None]


class Operation:
    """One remote operation, from submission to its single ending."""

    __slots__ = ("backpressure", "call_id", "combine", "decode", "errors", "future", "hosts",
                 "outputs", "remaining", "send", "values", "was_cancelled", "wide")

    def __init__(self, call_id: int, future: Future[Any], hosts: tuple[int, ...], send: Sender,
                 decode: Decoder, combine: Combiner, backpressure: bool) -> None:
        self.call_id = call_id
        self.future = future
        self.hosts = hosts
        self.send: Sender | None = send
        self.decode = decode
        self.combine = combine
        self.backpressure = backpressure
        # The hosts yet to answer, as a bit mask: an int is not tracked by the
        # garbage collector, a set would be (one more object per call in flight).
        self.remaining = host_mask(hosts)
        self.wide = len(hosts) > WIDE  # its hosts in masks only (see the module's doc)
        self.values: dict[int, Any] = {}
        self.errors: dict[int, BaseException] = {}
        self.outputs: dict[int, int] = {}  # host -> output leaves it stored for this call
        self.was_cancelled = False  # a host answered CANCELLED

    def waits_for(self, host: int) -> bool:
        return bool(self.remaining >> host & 1)

    def waiting_for(self) -> list[int]:
        """The hosts yet to answer, in index order."""
        mask, out, i = self.remaining, [], 0
        while mask:
            if mask & 1:
                out.append(i)
            mask >>= 1
            i += 1
        return out

    def answered(self, host: Host, body: P.Result, env: Envelope) -> BadReply | None:
        """Record one host's RESULT (loop thread); the reply's flaw if it broke the
        protocol (the operation then fails with a ``ProtocolError``)."""
        i = host.index
        self.remaining &= ~(1 << i)
        status = body.status
        try:
            if status == P.Status.OK:
                if type(body.meta) is int:
                    self.outputs[i] = body.meta
                self.values[i] = self.decode(host, body, env)
            elif status == P.Status.CANCELLED:
                self.was_cancelled = True
            else:
                self.errors[i] = rebuild_exception(host, env, body.meta)
        except BadReply as exc:
            err = ProtocolError(f"host {i} ({host.name!r}) sent a malformed reply: {exc}")
            err.__cause__ = exc
            self.errors[i] = err
            return exc
        except BaseException as exc:
            self.errors[i] = exc
        return None

    def end(self, ops: Table, exc: BaseException | None = None) -> None:
        """End the operation (loop thread): with ``exc``, else from what hosts answered.

        Frees what hosts stored for it unless its result now owns that; leaves
        the table; settles the future (a no-op if the caller cancelled it).
        """
        ops.pending.pop(self.call_id, None)
        if self.wide:
            ops.wide.pop(self.call_id, None)
            if self.remaining:  # their replies may still come: not unsolicited then
                ops.late[self.call_id] = self.remaining
        else:
            hosts = ops.hosts
            for i in self.waiting_for():
                if i < len(hosts):
                    hosts[i].inflight.discard(self.call_id)
        self.send = None
        fut = self.future
        if exc is None and self.remaining:
            return  # not every host answered: not the end yet
        if exc is None and fut.cancelled():
            exc = asyncio.CancelledError()
        result: Any = None
        if exc is None:
            exc = self._first_error()
        if exc is None and self.was_cancelled:
            self._free_outputs(ops)
            fut._set_cancelled()
            return
        if exc is None:
            try:
                result = self.combine(self.values)
            except BaseException as e:  # a combine error belongs to this operation only
                exc = e
        if exc is not None:
            self._free_outputs(ops)
            self.fail(exc)
        else:
            fut.set_result(result)

    def fail(self, exc: BaseException) -> None:
        """Settle the future with ``exc``: a colocated call's (its combiner names its
        target) is logged if its Future goes with the error never read (``fail_call``)."""
        target = getattr(self.combine, "target", None)
        if target is None:
            self.future.set_exception(exc)
            return
        host = min(self.errors) if self.errors else getattr(exc, "host", None)
        fail_call(self.future, exc, target.name, host, (ControllerClosedError,))

    def _first_error(self) -> BaseException | None:
        if not self.errors:
            return None
        first = min(self.errors)
        exc = self.errors[first]
        for other in sorted(self.errors):
            if other != first:
                err = self.errors[other]
                exc.add_note(f"host {other} also failed: {type(err).__name__}: {err}")
        return exc

    def _free_outputs(self, ops: Table) -> None:
        for host, n in self.outputs.items():
            ops.free_outputs(host, self.call_id, n)
        self.outputs = {}


# Exceptions raised on hosts, as the controller re-raises them.
def rebuild_exception(host: Host, env: Envelope, meta: Any) -> BaseException:
    """The exception a host's ERROR reply describes, rebuilt from data (never
    unpickled: see ``_describe``), with the host and traceback as notes.

    Raises:
        BadReply: the payload is not an error description.
    """
    failure = read_error(env.payload)
    exc = rebuild_error(failure, host.index)
    tb = failure.traceback
    exc.add_note(f"raised on colobus host {host.index} ({host.name!r})")
    if tb:
        exc.add_note(f"remote traceback (host {host.index}):\n{tb.rstrip()}")
    return exc
