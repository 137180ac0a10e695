"""Remote operations in flight: one object per operation, one way to end.

An :class:`Operation` spans one or more hosts (a call, a fetch, a stats
request). It is created by :meth:`Operations.submit` on any thread, waits in
the backlog while its hosts are at ``max_inflight`` (or behind earlier
operations: nothing overtakes what a caller asked for before), is sent, and
collects one RESULT per host. However it ends -- every host answered, a
combine error, cancelled, a host lost, the controller closed, its send failed
-- it ends through :meth:`Operation.end`, which frees whatever hosts stored
for it that nobody will own, and settles its future exactly once.

Back-pressure: operations submitted but not yet sent are counted; a caller on a
plain thread waits in :meth:`Operations.submit` while ``max_backlog`` are
queued; code on any event loop never blocks there and awaits
:meth:`Operations.wait_capacity` instead.

Work that would hold the loop thread for more than a few milliseconds keeps its
place in that order without holding the loop: a :class:`Gate` in the backlog
stops what comes after it until the work is done, on another thread
(:meth:`Operations.hold_for`: a tree put's digests) or in slices that the loop
runs between its other work (:meth:`Operations.post_steps`: the messages of a
put of many leaves).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .._errors import ControllerClosedError, HostLostError
from .._wire import protocol as P
from .._wire.describe import BadReply
from .._wire.envelope import Envelope
from .future import _PENDING, Future, in_event_loop
from .operation import Combiner, Decoder, Operation, Sender, rebuild_exception

if TYPE_CHECKING:
    from .._observe.observer import FunctionStats, Observer
    from .._observe.trace import CallRecord
    from .._wire.envelope import Buffer
    from .._wire.fanout import FanoutChannel
    from .hosts import Host, HostRegistry

__all__ = [
    "Combiner", "Decoder", "Gate", "Operation", "Operations", "OpsOwner", "Parts",
    "ProtocolJudge", "rebuild_exception",
]

log = logging.getLogger("colobus.controller")


class Gate:
    """A place in the backlog that nothing behind it passes until it opens."""

    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open = False

    def __call__(self) -> None:  # (passed once open: nothing to do)
        pass


class ProtocolJudge(Protocol):
    """What judges a host that broke the protocol (the controller's sessions)."""

    def violation(self, host: Host, reason: str, detail: str) -> None: ...


class Parts(Protocol):
    """The controller's parts every other part reads: its hosts and its channel."""

    @property
    def _hosts(self) -> HostRegistry: ...
    @property
    def _chan(self) -> FanoutChannel | None: ...
    @property
    def _closed(self) -> bool: ...
    @property
    def observer(self) -> Observer | None: ...


class OpsOwner(Parts, Protocol):
    """What :class:`Operations` uses of the controller that owns it."""

    @property
    def _sessions(self) -> ProtocolJudge: ...
    @property
    def _loop_thread_id(self) -> int | None: ...
    def _check_open(self) -> None: ...
    def _on_loop_thread(self) -> bool: ...
    def _call_soon(self, fn: Callable[..., Any], *args: Any) -> None: ...
    def _send(self, host: Host, body: P.Body, payload: Buffer = b"",
              buffers: Any = (), pbufs: int = 0) -> None: ...


_clock = time.perf_counter  # read per observed call: one global, not an attribute of one

class Operations:
    """The operation table, the backlog and back-pressure of one controller."""

    def __init__(self, ctl: OpsOwner, max_inflight: int, max_backlog: int) -> None:
        self.ctl = ctl
        self.max_inflight = max_inflight
        self.max_backlog = max_backlog
        self.pending: dict[int, Operation] = {}
        self.wide: dict[int, Operation] = {}  # the pending operations that are wide
        # call id -> the hosts of a wide operation that ended which still owe a reply
        self.late: dict[int, int] = {}
        # Operations (and posted functions) waiting to leave, in submission order.
        self.backlog: collections.deque[Operation | Callable[[], None]] = collections.deque()
        self._ids = itertools.count(1)  # next() is atomic under the GIL
        # Guards ``queued`` and the waiters; a raw lock (its ``with`` costs no Python call),
        # under a condition for the plain threads that wait for room (``_blocked`` of them).
        self._slots = threading.Lock()
        self._capacity = threading.Condition(self._slots)
        self._blocked = 0
        self.queued = 0  # submitted with back-pressure, not yet sent
        self._capacity_waiters: list[Future[None]] = []
        self._canceller = self._cancel_future  # one bound method, not one per call

    @property
    def hosts(self) -> HostRegistry:
        return self.ctl._hosts

    def next_id(self) -> int:
        return next(self._ids)

    def new_future(self, call_id: int = 0) -> Future[Any]:
        return Future(self.ctl._loop_thread_id, call_id, self.ctl)

    # -- submitting ---------------------------------------------------------------------

    def submit(self, hosts: Sequence[int], send: Sender, decode: Decoder, combine: Combiner, *,
               call_id: int | None = None, backpressure: bool = True,
               cancellable: bool = False, stats: FunctionStats | None = None,
               timing: CallRecord | None = None, urgent: bool = False,
               future: Future[Any] | None = None) -> Future[Any]:
        """Start one remote operation on ``hosts``; thread-safe.

        ``send(call_id)`` runs on the loop thread and sends the messages (it may
        raise, failing only this future); each host's RESULT goes through
        ``decode`` on receipt; once every host answered, ``combine`` builds the
        result from the per-host values. The first error by host index wins.
        ``urgent``: leaves at once, past the backlog (a step of an operation that
        already left, such as a reshard's moves: queued behind later calls that
        wait for it, it would never leave). ``future``: the operation's Future, made by
        the caller (with ``call_id``), else made here.
        """
        ctl = self.ctl
        if ctl._closed:
            ctl._check_open()  # (raises)
        if backpressure:
            self._take_slot()
        call_id = self.next_id() if call_id is None else call_id
        fut: Future[Any] = (Future(ctl._loop_thread_id, call_id, ctl) if future is None
                            else future)  # (new_future)
        if stats is not None:  # observed (before the loop can settle it)
            fut._stats, fut._submitted, fut._timing = stats, _clock(), timing
        if cancellable:
            fut._canceller = self._canceller
        op = Operation(call_id, fut, tuple(hosts), send, decode, combine, backpressure)
        ctl._call_soon(self._start, op, urgent)
        return fut

    def post(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop thread after every operation submitted before it
        left: at once when called there with nothing in the backlog (a free as a handle
        goes, on every call: no partial, no hop)."""
        if threading.get_ident() == self.ctl._loop_thread_id and not self.backlog:
            fn(*args)
            return
        self.ctl._call_soon(self._start_posted, functools.partial(fn, *args) if args else fn)

    def hold_for(self, work: Callable[[], None]) -> None:
        """Loop thread: run ``work`` on another thread; what is submitted or posted from
        now on waits in the backlog, in order, until it is done (or failed: logged)."""
        gate = Gate()
        self.backlog.append(gate)

        def done(fut: asyncio.Future[None]) -> None:
            if not fut.cancelled() and fut.exception() is not None:
                log.error("work held off the loop thread failed", exc_info=fut.exception())
            self._open(gate)

        asyncio.get_running_loop().run_in_executor(None, work).add_done_callback(done)

    def post_steps(self, step: Callable[[], bool]) -> None:
        """:meth:`post` of work done in slices: ``step()`` does a few milliseconds of it
        and says whether more is left. The loop runs its other work (reads, heartbeats)
        between slices; nothing submitted or posted after this passes it."""

        def first() -> None:
            if not step():
                return
            gate = Gate()
            self.backlog.appendleft(gate)  # (run at the front: it keeps its place)
            loop = asyncio.get_running_loop()

            def more() -> None:
                try:
                    left = step() and not self.ctl._closed
                except Exception:  # (a bug) what waits behind it must not wait forever
                    log.exception("a sliced send failed")
                    left = False
                if left:
                    loop.call_soon(more)
                else:
                    self._open(gate)

            loop.call_soon(more)

        self.post(first)

    def _open(self, gate: Gate) -> None:
        gate.open = True
        self.pump()

    def _start_posted(self, fn: Callable[[], None]) -> None:
        if self.backlog:
            self.backlog.append(fn)
        else:
            fn()

    def _start(self, op: Operation, urgent: bool = False) -> None:
        stats = op.future._stats
        if stats is not None:
            stats.started += 1  # only this thread writes it
        if op.future._state != _PENDING:  # cancelled before it reached the loop
            if op.backpressure:
                self._give_slot()
            return
        if self.ctl._closed:
            if op.backpressure:
                self._give_slot()
            op.future.set_exception(ControllerClosedError("the colobus controller is closed"))
            return
        # Nothing overtakes an earlier operation of any kind: the backlog is FIFO.
        # (_full's own first test inline: no call while fewer than max_inflight are pending)
        if not urgent and (self.backlog or (
                op.backpressure and len(self.pending) >= self.max_inflight
                and self._full(op.hosts))):
            self.backlog.append(op)
            return
        self._go(op)

    def _go(self, op: Operation) -> None:
        """Loop thread: send an operation now."""
        if op.backpressure:
            self._give_slot()
        fut = op.future
        if fut.done():
            return
        registry = self.ctl._hosts
        hosts = registry.hosts
        n = len(hosts)
        call_id = op.call_id
        wide = op.wide
        if wide and not op.remaining & ~registry.alive_mask:  # all alive: masks only
            self.wide[call_id] = op
        else:
            for j, i in enumerate(op.hosts):  # (one pass: undone if a host is not alive)
                h = hosts[i] if 0 <= i < n else None
                if h is None or not h.alive:
                    for k in () if wide else op.hosts[:j]:
                        hosts[k].inflight.discard(call_id)
                        hosts[k].awaiting.discard(call_id)
                    op.fail(h.lost_error("it is not alive") if h else HostLostError(
                        f"Host {i} does not exist", i))
                    return
                if not wide:
                    h.inflight.add(call_id)
                    h.awaiting.add(call_id)
            if wide:  # (every host alive after all)
                self.wide[call_id] = op
        self.pending[call_id] = op
        send, op.send = op.send, None
        assert send is not None
        rec = fut._timing
        go = time.perf_counter() if rec is not None else 0.0
        try:
            send(op.call_id)
        except BaseException as exc:
            op.end(self, exc)
            return
        if rec is not None:
            rec.go, rec.sent = go, time.perf_counter()
        if not op.hosts:
            op.end(self)

    def pump(self) -> None:
        """Send what waits in the backlog, in order, while its hosts have room."""
        backlog = self.backlog
        while backlog:
            head = backlog[0]
            if isinstance(head, Operation):
                if head.backpressure and not head.future.done() and self._full(head.hosts):
                    return
                backlog.popleft()
                self._go(head)
            else:
                if type(head) is Gate and not head.open:
                    return
                backlog.popleft()
                head()

    def _full(self, hosts: tuple[int, ...]) -> bool:
        limit = self.max_inflight
        if len(self.pending) < limit:  # a host's calls in flight are pending operations
            return False
        # Wide operations are in no host's set: each counts against every host here (at
        # worst a host waits for a slot that another host's fan-outs hold; nothing that
        # waits for a queued call can be ahead of it, so none waits forever).
        wide = len(self.wide)
        hs = self.ctl._hosts.hosts
        n = len(hs)
        for i in hosts:
            if 0 <= i < n and len(hs[i].inflight) + wide >= limit:
                return True
        return False

    def inflight_count(self, host: Host) -> int:
        """The operations ``host`` has yet to answer (its own set's, and wide ones')."""
        i = host.index
        return len(host.inflight) + sum(1 for op in self.wide.values() if op.remaining >> i & 1)

    def owed(self, host: Host, call_id: int) -> bool:
        """Whether ``host`` owes a reply to ``call_id`` (sent, not answered yet)."""
        op = self.pending.get(call_id)
        if op is not None and op.wide:
            return bool(op.remaining >> host.index & 1)
        late = self.late.get(call_id)
        if late is not None:
            return bool(late >> host.index & 1)
        return call_id in host.awaiting

    def settle_late(self, call_id: int, mask: int) -> None:
        """The hosts of ``mask`` answered ``call_id``, a wide operation that ended."""
        left = self.late.get(call_id, 0) & ~mask
        if left:
            self.late[call_id] = left
        else:
            self.late.pop(call_id, None)

    # -- replies and endings ---------------------------------------------------------------

    def on_result(self, host: Host, body: P.Result, env: Envelope) -> None:
        """A host's RESULT (loop thread)."""
        call_id = body.call_id
        ctl = self.ctl
        if not self.owed(host, call_id):  # never sent to this host, or answered already
            ctl._sessions.violation(host, "unsolicited", f"result for call {call_id}")
            return
        op = self.pending.get(call_id)
        if op is None and call_id in self.late:
            self.settle_late(call_id, 1 << host.index)
        host.awaiting.discard(call_id)
        if (body.status == P.Status.OK and type(body.meta) is int
                and not 0 <= body.meta < P.MAX_OUTPUTS):
            ctl._sessions.violation(host, "malformed", f"{body.meta} outputs")
            return
        host.inflight.discard(call_id)
        bad: BadReply | None = None
        if op is None or not op.waits_for(host.index):
            # Ended already (cancelled, failed, a host lost): nobody will own these.
            if body.status == P.Status.OK and type(body.meta) is int:
                self.free_outputs(host.index, call_id, body.meta)
        else:
            rec = op.future._timing  # traced: the host's times go in the call's record
            if rec is not None:  # (metrics count them on the host: colobus._wire.calltimes)
                rec.add_reply(host.index, time.perf_counter(), body.times)
            bad = op.answered(host, body, env)
            if not op.remaining:
                op.end(self)
        if bad is not None:  # the call failed with a ProtocolError; the host goes
            ctl._sessions.violation(host, "bad_reply", str(bad))
        if self.backlog:
            self.pump()

    def free_outputs(self, host: int, call_id: int, n: int) -> None:
        """Free the outputs a host stored for a call whose result nobody will own."""
        h = self.ctl._hosts[host]
        if h.alive and 0 < n <= P.MAX_OUTPUTS:
            self.ctl._send(h, P.Release([P.output_ref(call_id, i) for i in range(n)], [call_id]))

    def _cancel_future(self, fut: Future[Any]) -> None:
        """A cancellable operation's Future was cancelled (any thread)."""
        try:
            self.ctl._call_soon(self._cancel, fut.call_id)
        except ControllerClosedError:
            pass

    def _cancel(self, call_id: int) -> None:
        op = self.pending.get(call_id)
        if op is None:
            return  # still in the backlog (it is skipped there) or already ended
        hosts = self.ctl._hosts
        for i in op.waiting_for():
            h = hosts[i]
            if h.alive:
                self.ctl._send(h, P.Cancel(call_id))
        chan = self.ctl._chan
        if chan is not None:
            chan.flush()  # a CANCEL is urgent: it must reach the host before the call starts
        op.end(self, asyncio.CancelledError())

    def host_lost(self, host: Host, why: str) -> None:
        """Fail every operation waiting for ``host``; the others' outputs are freed."""
        i = host.index
        owed = set(host.inflight)
        owed.update(c for c, op in self.wide.items() if op.remaining >> i & 1)
        for call_id in sorted(owed):
            op = self.pending.get(call_id)
            if op is not None:
                op.end(self, host.lost_error(why))
        host.inflight.clear()
        bit = 1 << i
        for call_id, mask in list(self.late.items()):  # it will answer none of them
            if mask & bit:
                self.settle_late(call_id, bit)
        self.pump()  # queued operations for that host fail as they reach the front

    def close(self, why: str | None = None) -> None:
        """The controller closed: every operation, sent or queued, ends with an error."""
        err = ControllerClosedError("the colobus controller closed before this call finished"
                                    + (f" ({why})" if why else ""))
        for op in list(self.pending.values()):
            op.outputs = {}  # the hosts drop everything of this session themselves
            op.end(self, err)
        # (``late`` stays: hosts still answer while the controller closes, and a reply
        # owed by an operation that ended is no violation then either)
        backlog, self.backlog = self.backlog, collections.deque()
        for item in backlog:
            if isinstance(item, Operation):
                item.future.set_exception(err)
        self._wake_all_waiting()

    # -- back-pressure ---------------------------------------------------------------------

    def _take_slot(self) -> None:
        """Count one operation as queued; a plain thread first waits for room.

        A thread running an event loop never blocks here (the controller's own
        loop drains the queue; blocking any other would stall its tasks): async
        code awaits :meth:`wait_capacity` instead.
        """
        with self._slots:
            if (self.queued >= self.max_backlog and not self.ctl._on_loop_thread()
                    and not in_event_loop()):
                self._blocked += 1
                try:
                    while self.queued >= self.max_backlog and not self.ctl._closed:
                        self._capacity.wait()
                finally:
                    self._blocked -= 1
                self.ctl._check_open()
            self.queued += 1

    def _give_slot(self) -> None:
        """A queued operation left the queue (sent, cancelled or failed); loop thread."""
        with self._slots:
            self.queued = max(0, self.queued - 1)
            if self.queued >= self.max_backlog:
                return
            if self._blocked:
                self._capacity.notify()
            waiters = self._capacity_waiters
            if not waiters:
                return
            self._capacity_waiters = []
        for w in waiters:
            w.set_result(None)

    def _wake_all_waiting(self) -> None:
        with self._slots:
            self.queued = 0
            self._capacity.notify_all()
            waiters, self._capacity_waiters = self._capacity_waiters, []
        for w in waiters:
            w.set_result(None)

    async def wait_capacity(self) -> None:
        """Wait until a new operation would not queue beyond ``max_backlog``."""
        while True:
            self.ctl._check_open()
            with self._slots:
                if self.queued < self.max_backlog:
                    return
                waiter: Future[None] = Future()
                self._capacity_waiters.append(waiter)
            await waiter
