"""Frees of host data (arrays, call results): batched, and never ahead of what they free.

A handle's finalizer may run on any thread, during interpreter shutdown too.
A free goes through the operation backlog, so it never overtakes the PUT or
call that makes what it frees (which may still be queued); on the loop thread
it waits for the next message to its host (one RELEASE per host rides along,
ahead of it) or leaves on its own after ``RELEASE_DELAY_S``, or with the flush
that ends the drain it was asked for in (the channel is corked: that flush comes).

The common case, a call's Future and output dropped on the loop thread while
nothing waits in the backlog (a task awaiting calls one after another), costs one
Python call per free (:func:`release_now`, the weak reference's callback) and one per
call to queue both as a RELEASE ahead of the next message (:meth:`Frees.move_to_outboxes`,
called by the channel only while frees wait).
"""

from __future__ import annotations

import collections
import functools
import threading
import weakref
from typing import TYPE_CHECKING, Any, Protocol

from .._errors import ColobusError
from .._wire import protocol as P
from .._wire.envelope import pack_body
from .._wire.lane import pack
from .ops import Parts

if TYPE_CHECKING:
    import asyncio

    from .._wire.fanout import Fanout
    from .inbox import Inbox
    from .ops import Operations

__all__ = ["WATCHED", "Frees", "FreesOwner", "release_now"]

RELEASE_DELAY_S = 0.002  # frees wait this long for a message to ride along with
_get_ident = threading.get_ident
_RELEASE = int(P.Kind.RELEASE)


# What each watched handle frees when it goes: its weak reference -> (the queue, host ->
# generation, array ref, call id). A weak reference with a callback, held here, costs a
# third of a ``weakref.finalize``.
WATCHED: dict[weakref.ref[Any], tuple[Frees, dict[int, int], int, int]] = {}


def release_now(handle: weakref.ref[Any]) -> None:
    """Free what ``handle`` (from :meth:`Frees.release_when_gone`) watches, once: when its
    object goes, or earlier (an array's ``delete``); any thread."""
    entry = WATCHED.pop(handle, None)
    if entry is None:
        return
    frees, generations, ref, call = entry
    ctl = frees._ctl
    if ctl._closed:
        return
    if _get_ident() != ctl._loop_thread_id:
        # ops.post's hop, straight to the loop's inbox (posted after, and so run after,
        # whatever this thread submitted before): Frees._posted queues it there
        inbox = ctl._inbox
        if inbox is not None:
            try:
                inbox.post(frees._posted, (generations, ref, call))
            except RuntimeError:  # the loop closed under us: nothing to free any more
                pass
        return
    if ctl._ops.backlog:
        frees.release_on(generations, ref=ref, call=call)
        return
    # ops.post's own case, inline (run at once: on the loop thread, nothing queued ahead)
    frees._queue.append((generations, ref, call))
    chan = ctl._chan
    if chan is None:
        return
    chan.before_flush_due = True
    # Corked (inside a drain or a burst), the channel flushes before it lets go: the
    # free leaves then, or with the next message queued meanwhile; no timer needed.
    if frees._timer is None and not chan._corked:
        loop = ctl._loop
        if loop is not None:
            frees._timer = loop.call_later(RELEASE_DELAY_S, frees._on_timer)


class FreesOwner(Parts, Protocol):
    """What :class:`Frees` uses of the controller that owns it."""

    @property
    def _ops(self) -> Operations: ...
    @property
    def _loop(self) -> asyncio.AbstractEventLoop | None: ...
    @property
    def _loop_thread_id(self) -> int | None: ...
    @property
    def _inbox(self) -> Inbox | None: ...


class Frees:
    """The controller's queue of frees (see the module docstring)."""

    def __init__(self, ctl: FreesOwner) -> None:
        self._ctl = ctl
        # (host -> generation, array ref, call id) of each free, oldest first
        self._queue: collections.deque[tuple[dict[int, int], int, int]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None  # the frees leave on their own then
        # the destinations of frees on the same hosts, by their generations' dict
        self._fans: dict[int, tuple[dict[int, int], int, Fanout]] = {}

    def release_on(self, generations: dict[int, int], ref: int = 0, call: int = 0) -> None:
        """Free array ``ref`` or the result of ``call`` on each of its hosts (host ->
        generation, not changed after): one hop to the loop thread for all of them, not
        one per host; thread-safe."""
        ctl = self._ctl
        if ctl._closed:
            return
        try:
            ctl._ops.post(self._queue_many, [(generations, ref, call)])
        except (RuntimeError, ColobusError):
            pass

    def release_when_gone(self, obj: Any, generations: dict[int, int], ref: int = 0,
                          call: int = 0) -> weakref.ref[Any]:
        """:meth:`release_on` once ``obj`` (a handle) is collected; the weak reference
        returned frees at once with :func:`release_now`."""
        handle = weakref.ref(obj, release_now)
        WATCHED[handle] = (self, generations, ref, call)
        return handle

    def _posted(self, entry: tuple[dict[int, int], int, int]) -> None:
        """A free asked for on another thread, on the loop thread now: as ``ops.post``
        runs what it was given (behind the backlog, if operations wait there)."""
        backlog = self._ctl._ops.backlog
        if backlog:
            backlog.append(functools.partial(self._queue_many, [entry]))
        else:
            self._queue_many([entry])

    def _queue_many(self, entries: list[tuple[dict[int, int], int, int]]) -> None:
        self._queue.extend(entries)
        ctl = self._ctl
        chan = ctl._chan
        if chan is not None:
            chan.before_flush_due = True
            if chan._corked:  # (as in release_now)
                return
        loop = ctl._loop
        if self._timer is None and loop is not None:
            self._timer = loop.call_later(RELEASE_DELAY_S, self._on_timer)

    def _on_timer(self) -> None:
        # The timer is not cancelled when the frees ride along (arming and cancelling one
        # per call costs more than its firing once per RELEASE_DELAY_S while calls flow):
        # it may find nothing to send, or frees queued since, which leave sooner.
        self._timer = None
        chan = self._ctl._chan
        if self._queue and chan is not None and chan.open:
            chan.flush()
            chan.drain()  # the send may have taken the FD's edge: read what waits

    def move_to_outboxes(self) -> None:
        """Queue the waiting frees as one RELEASE per host (called before any flush)."""
        if not self._queue:
            return
        items, self._queue = self._queue, collections.deque()
        hosts = self._ctl._hosts.hosts
        chan = self._ctl._chan
        assert chan is not None
        first = items[0][0]
        last = items[-1][0]
        if len(first) == 1 and len(items) <= 2 and (last is first or last == first):
            # One host's (a call's result slot and its output): its RELEASE, packed here
            ((host, gen),) = first.items()
            h = hosts[host]
            if h.alive and h.generation == gen:  # (else nothing of these is there now)
                refs, calls = [], []
                for _, r, c in items:
                    if r:
                        refs.append(r)
                    if c:
                        calls.append(c)
                # (pack_body(P.Release(refs, calls).to_wire()), written out: the same
                # bytes; lists of ints always pack)
                chan.enqueue_packed(h.peer, _RELEASE, pack([refs, calls, []]))
            return
        alike = True  # (a loop, not a generator: fewer calls on every call's free)
        for g, _, _ in items:
            if g is not first and g != first:
                alike = False
                break
        if alike:  # frees of fan-outs alike:
            # one RELEASE for all their hosts, packed once, one relay entry; where the
            # hosts are as when these generations were last looked at, as worked out then
            changes = self._ctl._hosts.changes
            hit = self._fans.get(id(first))
            if hit is not None and hit[0] is first and hit[1] == changes:
                to = hit[2]
            else:
                peers = []
                for host, gen in first.items():
                    h = hosts[host]
                    if h.alive and h.generation == gen:
                        peers.append(h.peer)
                to = chan.fanout(peers)
                if len(first) > 1:  # (the entry holds ``first``: its id stays its own)
                    if len(self._fans) >= 64:
                        self._fans.clear()
                    self._fans[id(first)] = (first, changes, to)
            if to.direct or to.relayed:
                refs, calls = [], []
                for _, r, c in items:
                    if r:
                        refs.append(r)
                    if c:
                        calls.append(c)
                one = pack_body(P.Release(refs, calls).to_wire())
                chan.enqueue_packed_many(to, P.Kind.RELEASE, one)
            return
        per_host: dict[int, tuple[list[int], list[int]]] = {}
        for gens, ref, call in items:
            for host, gen in gens.items():
                h = hosts[host]
                if not h.alive or h.generation != gen:
                    continue
                refs, calls = per_host.setdefault(host, ([], []))
                if ref:
                    refs.append(ref)
                if call:
                    calls.append(call)
        packed: dict[tuple[tuple[int, ...], tuple[int, ...]], bytes] = {}
        for host, (refs, calls) in per_host.items():  # a fan-out's free: packed once
            lists = (tuple(refs), tuple(calls))
            body = packed.get(lists)
            if body is None:
                body = packed[lists] = pack_body(P.Release(refs, calls).to_wire())
            chan.enqueue_packed(hosts[host].peer, P.Kind.RELEASE, body)
