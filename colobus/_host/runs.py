"""A host's plain calls run and reply: a batch of one stream's calls on a pool thread, or
the lone call inline on the loop's leader (:mod:`colobus._host.leader`); each outcome
handed to the loop, its outputs stored and its RESULT sent there.

:class:`Runs` is the part of :class:`colobus._host.sched.Scheduler` that does this; the
scheduler decides what runs when.
"""

from __future__ import annotations

import threading
import time
from time import monotonic as _monotonic
from typing import TYPE_CHECKING

import msgpack

from .._wire.protocol import Kind, Result, Status
from .alarm import LoopTimer, make_loop_timer
from .calls import (
    _DONE,
    _JOB,
    _QUEUED,
    _RUNNING,
    WorkerServices,
    _Call,
    _settable,
    _Stream,
    call_args,
)
from .computed import wait_computed
from .viewguard import note_view

if TYPE_CHECKING:
    from .leader import Baton

__all__ = ["BRIEF_WAIT_NS", "BRIEF_WAIT_S", "Runs"]

_WAITING, _TAKEN, _EXPIRED = range(3)  # a pool job's claim: taken by a thread, or expired
BRIEF_WAIT_S = 0.0005  # after starting quick calls, the loop waits this long for them
BRIEF_WAIT_NS = int(BRIEF_WAIT_S * 1e9)
# A stream's pipelined calls run on the loop's leader in slices, the loop running once
# between two (the replies leave in one burst, new messages are read). A slice ends
# once it ran SLICE_MIN_CALLS calls and SLICE_MIN_NS, and either SLICE_MAX_CALLS calls
# or at least as many as still wait in its stream (the caller's window: replies keep
# flowing to a caller that keeps calls in flight); or at SLICE_MAX_NS, whichever comes
# first. A deep queue of brief steps so shares each loop turn (its system calls: 6 us
# each on a sandboxed accelerator host) among up to 32 calls, not four. Each call must
# take less than SLICE_CALL_NS (a slower one ends its slice, and the stream's next
# calls go to the pool): a step that long (JAX on CPU computes on the dispatching
# thread, its GIL released) is better run beside the loop, which reads the next calls
# and sends the replies meanwhile, than with the loop stopped; its replies are held
# as a slice's (HOLD_NS).
SLICE_MIN_NS = 500_000
SLICE_MIN_CALLS = 4
SLICE_MAX_CALLS = 32
SLICE_MAX_NS = 8_000_000
SLICE_CALL_NS = 500_000
# The host's only call in flight runs inline while the last call took less than this
# (slow twice running, the next goes to the pool): one such call costs no hand-off
# between threads either way, and a call past the stall threshold loses the loop.
LONE_CALL_NS = 1_500_000
WAIT_SKIP = 16  # after an awaited lone call's wait went past LONE_CALL_NS (see _run_lone)
# The alarm is moved on between a slice's calls once this much passed since it was set
# (half the stall threshold: one arm per few brief calls, and no wake-up in the slice).
REARM_NS = 1_000_000
# The calls a slice is handed: twice what the last slice ran, at least SLICE_MIN_BATCH.
# Each call handed is made ready first (its inputs, target and mesh looked up), and
# those a slice does not reach go back to the queue: handing a slice of four 300 us
# steps the stream's next 256 calls made each loop turn between slices cost ~1 ms.
SLICE_MIN_BATCH = 8
# A pool batch's replies are held as a slice's are: the pool thread wakes the loop once
# the calls held since the last burst pass the slice's cut (above), or its batch ends,
# or a call took HOLD_CALL_NS or more; and HOLD_NS after the first held at the latest,
# a timer the loop reads rings (a call that blocks, perhaps on what a held reply would
# have let the caller do, holds nothing longer; set past the cut's own SLICE_MAX_NS,
# which the pool thread keeps while its calls are brief). Where the system has no
# timerfd, nothing is held.
HOLD_CALL_NS = 2_000_000
HOLD_NS = SLICE_MAX_NS + HOLD_CALL_NS
HOLD_S = HOLD_NS / 1e9
_OK = int(Status.OK)
_RESULT = int(Kind.RESULT)
_pack = msgpack.Packer(use_bin_type=True).pack  # a RESULT's body (loop thread only)


class Runs:
    """Calls from their start to their RESULT (see the module docstring)."""

    def __init__(self, worker: WorkerServices) -> None:
        self._w = worker
        self._state_lock = threading.Lock()  # a call's QUEUED -> RUNNING | CANCELLED
        self._done_lock = threading.Lock()
        self._done: list[_Call] = []  # finished on pool threads, not yet seen by the loop
        self._flush_scheduled = False
        # The brief wait (see Scheduler.wait_briefly): the loop thread waits on this
        # event while ``_sync_wait``; a pool thread that finishes a call sets it instead
        # of waking the loop through its self-pipe.
        self._sync_wait: bool | int = False  # (2: the loop thread runs the call inline)
        self._done_event = threading.Event()
        self._quick = True  # the last batch took less than BRIEF_WAIT_S
        self._slow_once = False  # the last lone call took longer (see _run_lone)
        # The last call run took less than SLICE_CALL_NS, or in a slice the one before it
        # did (a slice's call slow once, perhaps preempted, ends its slice but leaves its
        # stream in slices; slow twice running, its next calls go to the pool).
        self._brief = True
        self._last_brief = True  # the last call run took less than SLICE_CALL_NS
        self._lone_ok = True  # the last call run took less than LONE_CALL_NS (see _run_lone)
        self.held_timer: LoopTimer | None = None  # (made by hold_replies)
        self._timer_tried = False
        self.bursts = 0  # finished calls' bursts the loop took from pool threads
        self.held_rings = 0  # of them, sent as the held timer rang
        self.waited_inline = 0  # lone calls whose outputs were waited for before the reply
        self._wait_skip = 0  # awaited lone calls whose wait is left to the loop, still
        self.slice_batch = SLICE_MIN_BATCH  # the calls the next slice is handed, at most
        self.baton: Baton | None = None  # inline calls (colobus._host.leader), if on
        # The host's only call, arrived on an idle stream: no stream of its own unless
        # another call or DESTROY arrives before it ends (Scheduler._adopt, on_call).
        self._lone: _Call | None = None

    def pump(self, stream: _Stream) -> None:
        """Start the stream's next calls (the scheduler's)."""
        raise NotImplementedError

    def _forget(self, call: _Call) -> None:
        """Drop a call from the bookkeeping (the scheduler's)."""
        raise NotImplementedError

    def _run_batch(self, batch: list[_Call], claim: list[int]) -> None:
        """Pool thread: run ready plain calls of one stream back to back."""
        with self._state_lock:
            if claim[0] == _EXPIRED:
                return  # failed meanwhile: waited too long for a thread
            claim[0] = _TAKEN
        t0 = start = time.perf_counter_ns()
        timer = self.held_timer
        last = batch[-1]
        stream = last.stream
        since = held = 0
        armed = False
        for i, call in enumerate(batch):
            with self._state_lock:
                runs = call.state == _QUEUED
                if runs:
                    call.state = _RUNNING
            if runs:
                self._run_plain(call)
            end = time.perf_counter_ns()
            call.started, call.ran = start, end - start
            self._quick = end - t0 < BRIEF_WAIT_NS
            self._brief = self._last_brief = end - start < SLICE_CALL_NS
            self._lone_ok = end - start < LONE_CALL_NS
            if timer is not None and end - start < HOLD_CALL_NS and call is not last:
                # Its reply held (see HOLD_NS): the loop is not woken per brief call.
                with self._done_lock:
                    hold = not self._flush_scheduled  # (else it leaves with that flush)
                    if hold:
                        if not self._done:  # a new window (the last one left, however:
                            since, held = end, 0  # perhaps as the timer rang)
                            armed = False
                        held += 1
                        spent = end - since
                        left = len(batch) - i - 1 + (len(stream.queue) if stream else 0)
                        hold = spent < SLICE_MAX_NS and (
                            spent < SLICE_MIN_NS or held < SLICE_MIN_CALLS
                            or (held < SLICE_MAX_CALLS and held < left))
                        if hold:
                            self._done.append(call)
                if hold:
                    start = end
                    if not armed:
                        armed = True
                        timer.arm_in(HOLD_S)
                    continue
            start = end
            self._post_done(call)
            if armed and timer is not None:
                armed = False
                timer.disarm()

    def _run_slice(self, batch: list[_Call], claim: list[int]) -> None:
        """The loop's leader, the loop stopped: ``_run_batch`` of one stream's ready calls,
        for one slice. Each call is watched on its own (the watchdog times it from its
        start); at the slice's end the calls not started go back to the head of their
        stream's queue (:meth:`Baton.between`) and the loop runs once (the replies leave in
        one burst, new messages are read); the stream's next slice starts from ``pump``.
        A thread that lost the loop to the watchdog runs the rest as a pool thread would.
        Twin of ``_run_batch``'s loop, written out (the hot path); tests/test_slices.py
        (``test_slices_and_pool_batches_end_calls_alike``) holds the two equal."""
        baton = self.baton
        assert baton is not None
        claim[0] = _TAKEN  # (no pool thread can claim it, and it never expires)
        watch = baton.watching()  # None: the loop was taken from this job already
        t0 = start = armed = time.perf_counter_ns()
        last = batch[-1]
        stream = last.stream
        queued = len(batch) + (len(stream.queue) if stream is not None else 0)
        for i, call in enumerate(batch):
            with self._state_lock:
                runs = call.state == _QUEUED
                if runs:
                    call.state = _RUNNING
            if runs:
                if watch is not None:
                    watch.started = _monotonic()
                self._run_plain(call)
            end = time.perf_counter_ns()
            call.started, call.ran = start, end - start
            brief = end - start < SLICE_CALL_NS
            self._brief = brief or self._last_brief
            self._last_brief = brief
            self._quick = end - start < BRIEF_WAIT_NS
            self._lone_ok = end - start < LONE_CALL_NS
            start = end
            spent = end - t0
            ran = i + 1
            cut = (call is not last and watch is not None
                   and (not brief or spent >= SLICE_MAX_NS
                        or (spent >= SLICE_MIN_NS and ran >= SLICE_MIN_CALLS
                            and (ran >= SLICE_MAX_CALLS or 2 * ran >= queued)))
                   and not watch.lost and baton.between(watch, self._requeue, batch, ran))
            self._post_done(call)  # (after the cut: this call then ends its batch)
            if cut:
                self.slice_batch = max(SLICE_MIN_BATCH, 2 * ran)
                return
            if end - armed >= REARM_NS and watch is not None:
                armed = end
                baton.rearm(watch)
        self.slice_batch = max(SLICE_MIN_BATCH, 2 * len(batch))

    def _requeue(self, batch: list[_Call], rest: int) -> None:
        """As the loop's owner: the calls of ``batch`` from ``rest`` on go back to the head
        of their stream's queue, not started; the one before them ends the batch."""
        batch[rest - 1].last = True
        batch[-1].last = False
        stream = batch[0].stream
        assert stream is not None
        stream.queue.extendleft(reversed(batch[rest:]))

    def _run_lone(self, call: _Call) -> None:
        """The loop's leader, the loop stopped: the lone call (``_run_batch`` of a batch of
        one, and ``_run_plain``, written out: no pool thread can claim it). Its start is
        taken under the state lock as there: past 2 ms another thread leads the loop
        (:mod:`colobus._host.leader`) and may be handling a CANCEL for it meanwhile, and
        a call answered CANCELLED must never run (nor send a RESULT after that)."""
        with self._state_lock:
            runs = call.state == _QUEUED
            if runs:
                call.state = _RUNNING
        if runs:
            start = time.perf_counter_ns()
            try:
                fn, call.fn = call.fn, None
                args, kwargs = call_args(call, self._w.present)
                out = fn(*args, **kwargs)
                call.outcome = outcome = self._w.values.outputs(out, call.mesh, call.pins, fn,
                                                                call.argvals, call.body.check)
                call.ok = True
            except BaseException as exc:
                call.outcome = exc
            end = time.perf_counter_ns()
            awaited = self._w.store.awaited
            if awaited and call.ok and call.body.call_id in awaited:
                # A FETCH_CALL waits for this call's outputs (block_until_ready on its
                # Future): wait for them here, the loop stopped, and the answer leaves with
                # the RESULT (Runs._finish), where a thread of the loop's would wait and wake
                # the loop. The watchdog guards the loop as during the call. A wait that
                # took the call past LONE_CALL_NS leaves the next WAIT_SKIP waits to the
                # loop (colobus._host.arrays: a long step would lose the loop each time).
                if self._wait_skip:
                    self._wait_skip -= 1
                else:
                    self.waited_inline += 1
                    wait_computed(outcome[0])
                    if time.perf_counter_ns() - start >= LONE_CALL_NS:
                        self._wait_skip = WAIT_SKIP
            call.started, call.ran = start, end - start
            # Slow twice running, the next lone call goes to the pool; slow once, it
            # may have been a preemption (many workers on few cores, all woken by one
            # fan-out): the next still runs inline (the watchdog guards the loop).
            self._quick = end - start < BRIEF_WAIT_NS
            self._brief = self._last_brief = end - start < SLICE_CALL_NS
            if end - start < LONE_CALL_NS:
                self._lone_ok = True
                self._slow_once = False
            else:
                self._lone_ok = not self._slow_once
                self._slow_once = True
        with self._done_lock:
            if self._sync_wait == 2:  # (_post_done's case, written out) an inline call's end
                self._done.append(call)  # collects it: this one's, or if this thread lost
                return  # the loop, the takeover's or the next inline call's
        self._post_done(call)

    def _run_plain(self, call: _Call) -> None:
        """Pool thread: one call, start to reply bytes; sets ``ok`` and ``outcome``."""
        try:
            fn, call.fn = call.fn, None
            args, kwargs = call_args(call, self._w.present)
            out = fn(*args, **kwargs)
            call.outcome = self._w.values.outputs(out, call.mesh, call.pins, fn, call.argvals,
                                                  call.body.check)
            call.ok = True
        except BaseException as exc:
            call.outcome = exc

    def _post_done(self, call: _Call) -> None:
        """Pool thread: hand a finished call to the loop; one wake-up per burst."""
        with self._done_lock:
            self._done.append(call)
            if self._flush_scheduled:
                return
            self._flush_scheduled = True
            if self._sync_wait:  # the loop thread waits for it, or is running it inline
                if self._sync_wait is True:
                    self._done_event.set()
                return
        loop = self._w.loop
        assert loop is not None
        try:
            loop.call_soon_threadsafe(self._flush_done)
        except RuntimeError:  # the loop closed: the worker is exiting
            pass

    def inline_ended(self) -> None:
        """The loop's leader after an inline call (or a new one that took the loop over):
        send what finished while the loop was stopped; from now on a pool thread (or
        the thread left in its call) wakes the loop as usual."""
        with self._done_lock:
            self._sync_wait = False
            done = self._done
            if not done:
                return
            self._done = []
            self._flush_scheduled = False
        self._finish_all(done)

    def hold_replies(self) -> None:
        """Loop thread: make the timer that bounds how long pool batches hold replies
        (once: where none can be made, nothing is held)."""
        if self._timer_tried or self._w.loop is None:
            return
        self._timer_tried = True
        timer = make_loop_timer()
        if timer is not None:
            self._w.loop.add_reader(timer.fd, self._held_rang, timer)
            self.held_timer = timer

    def close_timer(self) -> None:
        """Loop thread, as the worker ends: release the timer."""
        timer, self.held_timer = self.held_timer, None
        if timer is not None:
            if self._w.loop is not None:
                self._w.loop.remove_reader(timer.fd)
            timer.close()

    def _held_rang(self, timer: LoopTimer) -> None:
        timer.clear()
        self.held_rings += 1
        self._flush_done()

    def _flush_done(self) -> None:
        with self._done_lock:
            done, self._done = self._done, []
            self._flush_scheduled = False
        if done:
            self.bursts += 1
            self._finish_all(done)

    def _finish_all(self, done: list[_Call]) -> None:
        """Loop thread: :meth:`_finish` each; the replies leave as one batch at uncork."""
        corked = self._w.cork()
        try:
            for call in done:
                self._finish(call)
        finally:
            self._w.uncork(corked)

    def _finish(self, call: _Call) -> None:
        """Loop thread: store a finished call's outputs, reply, start what is next."""
        w = self._w
        if call.epoch != w.epoch:
            return  # the session it belonged to is over
        body = call.body
        if call.state == _RUNNING:
            call.state = _DONE
            self._forget(call)
            call_times = w.call_times
            if call_times is not None:  # metrics on: this host counts its calls' times
                call_times.add((w.store.classes.get(body.obj, b"") if body.obj else body.digest,
                                body.method), call.started - call.arrived, call.ran)
            outcome, call.outcome = call.outcome, None
            if call.ok:
                values, treedef, payload, bufs = outcome
                result = w.store.store_outputs(body.call_id, values, treedef, w.loop)
                if not call.results.done():
                    call.results.set_result(result)
                times = [call.started - call.arrived, call.ran] if call.started else []
                fetch = 0
                if times:  # third: whether every output is computed already (JAX's is_ready)
                    computed = 1
                    for v in values:
                        ready = getattr(v, "is_ready", None)
                        if ready is not None and not ready():
                            computed = 0
                            break
                    times.append(computed)
                    awaited = w.store.awaited
                    if computed and awaited:
                        fetch = awaited.get(body.call_id, 0)
                        if fetch > 0:  # a FETCH_CALL waits for it (arrays.py): answered now
                            awaited[body.call_id] = -fetch
                            chan = w._chan
                            if chan is not None and not chan.moved:
                                times.append(fetch)  # by this RESULT (fourth: its id)
                                fetch = 0
                w.send_packed(_RESULT, _pack([body.call_id, _OK, len(values), times]),
                              payload, bufs, len(bufs))  # P.Result(...).to_wire(), packed
                if fetch > 0:  # through a relay (which passes calls' times up only when
                    # tracing): the FETCH_CALL's own RESULT, behind the call's
                    w.send(Result(fetch, Status.OK, True))
            else:
                if body.spread:  # code written for the other view fails inside JAX: say so
                    note_view(outcome, _JOB[0] is not None)
                if not call.results.done():
                    call.results.set_exception(_settable(outcome))
                    call.results.exception()
                w.store.gone_early.pop(body.call_id, None)
                w.reply_error(body.call_id, outcome, call.times())
        else:
            self._forget(call)
        if call.last:
            stream = call.stream
            if stream is None:  # the lone call, alone to its end
                self._lone = None
            else:
                stream.busy = False
                self.pump(stream)
