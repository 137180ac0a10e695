"""The host's scheduler: calls in per-stream order, on a thread pool or the loop.

A stream is one controller-side caller (a thread or an asyncio task). Its calls
run in arrival order; different streams run at the same time, except in a JAX job:
there a *spread* call (one on several hosts, whose host code may run collectives with
the others') starts only once the spread call that arrived before it has ended,
whatever its stream, so every host runs them in the one order the controller sent
them in and their collectives pair up (multi-controller JAX's rule). Calls on this
host alone keep their concurrency. When the head of
a stream's queue is a plain function with its inputs ready, it and the ready
plain calls queued behind it form one run, and the runs of all streams wait in one
queue that as few pool jobs as keep it moving take (:mod:`colobus._host.runners`:
one hop per burst, not one per call or per stream); each call's reply goes out as
it finishes (:mod:`colobus._host.runs`). The host's only call in flight, when quick,
runs inline on the loop's thread instead (:mod:`colobus._host.leader`); arrived on an
idle stream, it takes no stream of its own unless another call arrives before it ends;
its stream's calls read in the same drain join it (one slice, one reply for a burst).
``async def`` functions run on the loop, alone (:mod:`colobus._host.onloop`). A DESTROY
runs in its stream like a call: after that caller's earlier calls, before its later
ones, once every call of the object received (any stream) has finished.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import time
from types import FunctionType, MethodType
from typing import Any

from .._model.jaxside import set_host_count
from .._wire import lane
from .._wire import protocol as P
from .._wire.envelope import Envelope
from .._wire.protocol import Status
from .calls import (
    _CANCELLED,
    _DONE,
    _JOB,
    _QUEUED,
    _RUNNING,
    WorkerServices,
    _Call,
    _Destroy,
    _settable,
    _Stream,
)
from .construct import plain_method
from .onloop import destroy, run_async
from .pool import CallPool
from .runners import Runners
from .runs import _EXPIRED, _WAITING, BRIEF_WAIT_S, Runs

__all__ = ["Scheduler", "WorkerServices"]

log = logging.getLogger("colobus.worker")

MAX_BATCH = 256  # calls of one stream run in one thread-pool job, at most
# A plain call that no pool thread takes this long after it was ready fails
# (TimeoutError) instead of waiting forever; COLOBUS_CALL_START_TIMEOUT overrides.
CALL_START_TIMEOUT_S = 60.0
_Future = asyncio.Future  # made directly: create_future is one Python call more


class Scheduler(Runs):
    """Runs the CALLs and DESTROYs of one worker, stream by stream."""

    def __init__(self, worker: WorkerServices, max_threads: int) -> None:
        super().__init__(worker)
        max_threads = int(os.environ.get("COLOBUS_CALL_THREADS", max_threads))
        self.start_timeout = float(os.environ.get("COLOBUS_CALL_START_TIMEOUT",
                                                  CALL_START_TIMEOUT_S))
        self.pool = CallPool(max_threads, "colobus-call")
        self.runners = Runners(self.pool)
        self._streams: dict[int, _Stream] = {}
        self._calls: dict[int, _Call] = {}
        self._async_calls: set[asyncio.Task[None]] = set()
        self.started = False  # the current drain started a batch on the pool
        self._deferred: tuple[list[_Call], list[int]] | None = None  # to run inline
        self._draining = False  # inside a drain of the socket
        self._hosts = 0  # the host count the last CALL said
        self.lone_calls = 0  # calls that ran so (tests read it)
        # In a JAX job, the last spread call that arrived: (its stream, its results)
        self._spread: tuple[int, asyncio.Future[Any]] | None = None

    def clear(self) -> None:
        """The session ended: forget its calls (running ones finish into nothing)."""
        self.pool.new_session()
        self.runners.clear()
        self._deferred = None
        self._lone = None
        self._hosts = 0
        self._spread = None
        for t in list(self._async_calls):
            t.cancel()
        self._calls.clear()
        self._streams.clear()

    def shutdown(self) -> None:
        """The worker ends (loop thread): the pool's threads go, the held timer closes."""
        self.pool.shutdown()
        self.close_timer()

    # -- arrivals ------------------------------------------------------------------------

    def on_call(self, body: P.Call, env: Envelope) -> None:
        if body.hosts != self._hosts:
            self._hosts = body.hosts
            set_host_count(body.hosts)
        if self._lone is not None:
            self._adopt()  # not alone any more: it keeps its place in its stream
        elif (not self._calls and self._lone_ok and not self.started and self.baton is not None
              and lane.ON and body.stream not in self._streams):
            # The host's only call, on an idle stream: deferred to run inline as ``pump``
            # would defer it, with no stream, when it is a plain function (or a plain
            # method of an object built here) whose inputs and mesh are all here and a
            # thread could take the loop over from it.
            w = self._w
            store = w.store
            obj = None
            if body.obj:
                obj = store.objects.get(body.obj)
                fn = plain_method(obj, body.method) if obj is not None else None
                plain = fn is not None
            else:
                code = store.code.get(body.digest)
                fn = code[1] if code is not None and code[0] == "ok" else None
                plain = (type(fn) is FunctionType
                         and not fn.__code__.co_flags & inspect.CO_COROUTINE
                         and not fn.__dict__)  # (else pump tells async apart)
            mesh = w.values.meshes.get(repr(body.mesh))
            pool = self.pool
            if plain and mesh is not None and (pool.idle or pool.has_room()):
                pins = []
                arrays = store.arrays
                for ref in body.refs:
                    fut = (arrays.get(ref[1]) if ref[0] == 0
                           else store.pin(ref, w.host_index, env.seq))
                    if fut is None or not fut.done():
                        break
                    pins.append(fut)
                else:
                    loop = w.loop
                    assert loop is not None
                    results: asyncio.Future[Any] = _Future(loop=loop)
                    store.results[body.call_id] = results
                    if obj is not None:  # (as _queue: a DESTROY waits for it)
                        store.obj_calls.setdefault(body.obj, set()).add(results)
                    call = _Call(body, env, pins, obj, results, None, w.epoch)
                    call.arrived = time.perf_counter_ns()
                    if body.spread and _JOB[0] is not None:  # (nothing else in flight)
                        self._spread = (body.stream, results)
                    call.fn = fn
                    call.mesh = mesh
                    call.last = True
                    self._calls[body.call_id] = call
                    self._lone = call
                    self.lone_calls += 1
                    self._deferred = ([call], [_WAITING])
                    if not self._draining:  # a drain hands it over as it ends
                        loop.call_soon(self._hand_inline)
                    return
        self._queue(body, env)

    def _queue(self, body: P.Call, env: Envelope) -> None:
        """A CALL into its stream's queue, started as its turn comes."""
        w = self._w
        store = w.store
        loop = w.loop  # (not asyncio.get_running_loop(): a getpid system call on 3.11)
        assert loop is not None
        pins = [store.pin(r, w.host_index, env.seq) for r in body.refs]
        obj = store.pin((2, body.obj), w.host_index) if body.obj else None
        results: asyncio.Future[Any] = loop.create_future()
        store.results[body.call_id] = results
        stream = self._stream(body.stream)
        call = _Call(body, env, pins, obj, results, stream, w.epoch)
        call.arrived = time.perf_counter_ns()
        if body.spread and _JOB[0] is not None:
            # A job's calls on several hosts start in the order they arrived, whatever
            # their stream (within one stream its order already says so).
            last = self._spread
            if last is not None and last[0] != body.stream and not last[1].done():
                call.after = last[1]
            self._spread = (body.stream, results)
        code = None if body.obj else store.code.get(body.digest)
        if code is not None and code[0] == "ok":
            call.fn = code[1]  # held from now on: a RELEASE of the code cannot strand it
        self._calls[body.call_id] = call
        if body.obj:
            store.obj_calls.setdefault(body.obj, set()).add(results)
        stream.queue.append(call)
        self.pump(stream)

    def _adopt(self) -> None:
        """The lone call gets its stream, busy with it until it ends (another call or a
        DESTROY arrived: one of its stream's must wait for it)."""
        call, self._lone = self._lone, None
        assert call is not None
        stream = call.stream = self._stream(call.body.stream)
        stream.busy = True

    def on_destroy(self, body: P.Destroy) -> None:
        if self._lone is not None:
            self._adopt()
        store = self._w.store
        calls = store.obj_calls.pop(body.obj, set())
        if body.obj not in store.objects:
            return
        stream = self._stream(body.stream)
        stream.queue.append(_Destroy(body.obj, calls))
        self.pump(stream)

    def _stream(self, sid: int) -> _Stream:
        stream = self._streams.get(sid)
        if stream is None:
            stream = self._streams[sid] = _Stream(sid)
        return stream

    def on_cancel(self, body: P.Cancel) -> None:
        # A call not started yet never runs: it stays in its stream's queue (or its
        # batch) and is skipped there, so later calls keep their order. The
        # controller hears CANCELLED at once.
        call = self._calls.get(body.call_id)
        if call is None:
            return
        with self._state_lock:
            if call.state != _QUEUED:
                return
            call.state = _CANCELLED
        self._w.store.gone_early.pop(body.call_id, None)
        if not call.results.done():
            call.results.set_exception(asyncio.CancelledError())
            call.results.exception()  # retrieved: no "never retrieved" log when dropped
        self._w.send(P.Result(body.call_id, Status.CANCELLED, None))
        stream = call.stream
        if (stream is not None and stream.waiting is not None and stream.queue
                and stream.queue[0] is call):
            stream.waiting = None  # it waited for this call's inputs: not any more
            self.pump(stream)

    # -- running -------------------------------------------------------------------------

    def pump(self, stream: _Stream) -> None:
        """Start the stream's next calls, unless some are running or it waits for inputs."""
        if stream.busy or stream.waiting is not None:
            return
        if self._streams.get(stream.sid) is not stream:
            return  # a stream of a finished session
        batch: list[_Call] = []
        # A stream that may run inline, in slices (below), is handed a slice's worth.
        limit = (self.slice_batch if self._brief and self.baton is not None
                 and len(self._calls) <= len(stream.queue) else MAX_BATCH)
        if not self._fill(stream, batch, limit):
            return
        queue = stream.queue
        if batch:
            batch[-1].last = True
            stream.busy = True
            claim = [_WAITING]
            deferred = self._deferred
            if deferred is not None:  # not alone: the deferred call goes to the pool too
                self._deferred = None
                if self._lone is not None:
                    self._adopt()
                self._submit(*deferred)
            elif ((self._lone_ok if len(self._calls) == 1 else
                   self._brief and len(self._calls) <= len(batch) + len(queue))
                  and not self.started and self.baton is not None and not self.baton.busy
                  and not self.runners.waiting() and self.pool.has_room()):
                # The host's only call, and a quick one, or only this stream's calls, each
                # brief: they run inline (colobus._host.leader; the calls in slices,
                # _run_slice), unless another call arrives before this drain ends.
                self._deferred = (batch, claim)
                if not self._draining:  # a drain hands it over as it ends (wait_briefly)
                    loop = self._w.loop
                    assert loop is not None
                    loop.call_soon(self._hand_inline)
                return
            self._submit(batch, claim)
        elif not queue:
            del self._streams[stream.sid]  # idle: a later call starts a new one

    def _fill(self, stream: _Stream, batch: list[_Call], limit: int) -> bool:
        """Move the calls at the head of ``stream``'s queue that are ready to run into
        ``batch``, up to ``limit`` of them; False where the stream's head needs more than
        a batch (a DESTROY, an ``async`` call: started; inputs not here: waited for;
        ``batch`` empty) and ``pump`` is done."""
        queue = stream.queue
        while queue and len(batch) < limit:
            call = queue[0]
            if isinstance(call, _Destroy):
                if batch:
                    break
                queue.popleft()
                stream.busy = True
                task = asyncio.get_running_loop().create_task(destroy(self, call, stream))
                self._async_calls.add(task)
                task.add_done_callback(self._async_calls.discard)
                return False
            if call.state == _CANCELLED:
                queue.popleft()
                self._forget(call)
                continue
            wait = call.unready_input()
            if wait is not None:
                if batch:
                    break
                stream.waiting = wait
                wait.add_done_callback(functools.partial(self._resume, stream))
                return False
            try:
                fn = self._target(call)
            except Exception as exc:
                if batch:
                    break
                queue.popleft()
                self._fail(call, exc)
                continue
            f = fn.__func__ if type(fn) is MethodType else fn  # (a bound method's function)
            if ((type(f) is not FunctionType or f.__code__.co_flags & inspect.CO_COROUTINE
                 or f.__dict__) and inspect.iscoroutinefunction(fn)):  # (plain: no calls)
                if batch:
                    break
                queue.popleft()
                call.state = _RUNNING  # no lock: CANCEL also runs on this thread
                stream.busy = True
                task = asyncio.get_running_loop().create_task(run_async(self, call, fn))
                self._async_calls.add(task)
                task.add_done_callback(self._async_calls.discard)
                return False
            call.fn = fn
            queue.popleft()
            batch.append(call)
        return True

    def _gather(self, batch: list[_Call]) -> None:
        """A batch about to run inline takes the calls its stream received since it was
        made (in the same drain: a caller's burst whose first call found the stream
        idle), while they are all the host's calls and brief: one slice and one reply
        for the burst, not one for its first call and one for the rest."""
        stream = batch[-1].stream
        if stream is None or not stream.queue or not self._brief:
            return
        if len(self._calls) > len(batch) + len(stream.queue):
            return
        last = batch[-1]
        if self._fill(stream, batch, self.slice_batch) and batch[-1] is not last:
            last.last = False
            batch[-1].last = True

    def _submit(self, batch: list[_Call], claim: list[int]) -> None:
        """Loop thread: a batch to the call pool's runners."""
        self.started = True
        loop = self._w.loop
        assert loop is not None
        if not self._timer_tried:
            self.hold_replies()
        if not self.runners.add(functools.partial(self._run_batch, batch, claim), loop):
            loop.call_later(  # every thread is busy
                self.start_timeout, self._expire, batch, claim, self._w.epoch)

    def _hand_inline(self) -> None:
        """Loop thread: the deferred lone call runs on this thread once the iteration ends."""
        if self._deferred is not None:
            self.wait_briefly()  # (which hands it over first)

    def _resume(self, stream: _Stream, fut: asyncio.Future[Any]) -> None:
        if stream.waiting is fut:
            stream.waiting = None
            self.pump(stream)

    def _target(self, call: _Call) -> Any:
        """The callable a call runs, and its mesh (loop thread; raises for the call)."""
        body = call.body
        if call.obj is not None:
            fn = getattr(call.obj.result(), body.method)
        else:
            fn = call.fn if call.fn is not None else self._w.store.get_code(body.digest)
        call.mesh = self._w.values.local_mesh(body.mesh)
        return fn

    def _forget(self, call: _Call) -> None:
        """Drop a call from the bookkeeping, and its references to inputs and code."""
        body = call.body
        self._calls.pop(body.call_id, None)
        if body.obj:
            pending = self._w.store.obj_calls.get(body.obj)
            if pending is not None:
                pending.discard(call.results)
        call.pins = []
        call.obj = None
        call.fn = None
        call.env = None

    def _fail(self, call: _Call, exc: BaseException) -> None:
        """A call that cannot start: fail it (loop thread)."""
        call.state = _DONE
        self._forget(call)
        if not call.results.done():
            call.results.set_exception(_settable(exc))
            call.results.exception()
        self._w.reply_error(call.body.call_id, exc)

    def _expire(self, batch: list[_Call], claim: list[int], epoch: int) -> None:
        """Loop thread: a batch no pool thread took in time fails, and its stream moves on."""
        with self._state_lock:
            if claim[0] != _WAITING or epoch != self._w.epoch:
                return
            claim[0] = _EXPIRED
        threads, stuck = self.pool.figures()
        err = TimeoutError(
            f"this call could not start within {self.start_timeout:g} s: all {threads} call "
            f"threads of host {self._w.host_index} are busy ({stuck} of them stuck in calls "
            "of an ended controller session)")
        for call in batch:
            with self._state_lock:
                queued = call.state == _QUEUED
                call.state = _DONE
            if queued:
                self._fail(call, err)
            else:
                self._forget(call)
        stream = batch[-1].stream
        assert stream is not None  # (a lone call goes to the pool only with its stream)
        stream.busy = False
        self.pump(stream)

    def drain_starts(self) -> None:
        """A drain of the socket starts: only the calls it starts are worth a brief wait."""
        self.started = False
        self._draining = True

    def drain_ends(self) -> None:
        """A drain ended; a lone call it deferred and did not hand over goes now."""
        self._draining = False
        if self._deferred is not None and self._w.loop is not None:
            self._w.loop.call_soon(self._hand_inline)

    def wait_briefly(self) -> bool:
        """Loop thread: wait a moment for the calls this drain started; True if any ended.

        A quick call then costs no wake-up of the loop through its self-pipe, and
        the GIL passes to the pool thread at once instead of when the loop next
        blocks. The wait is bounded (``BRIEF_WAIT_S``) and skipped while calls run
        long, so heartbeats and new messages wait at most that long.
        """
        deferred = self._deferred
        if deferred is not None:  # a lone call: it runs on this thread once the iteration ends
            self._deferred = None
            baton = self.baton
            assert baton is not None  # (deferred only where there is one)
            with self._done_lock:
                self._sync_wait = 2  # what finishes meanwhile is collected after it
            batch, claim = deferred
            lone = self._lone
            if lone is not batch[0]:
                self._gather(batch)
            baton.inline(functools.partial(self._run_lone, lone) if lone is batch[0]
                         else functools.partial(self._run_slice, batch, claim))
            return False
        if not (self.started and self._quick):
            return False
        self.started = False
        with self._done_lock:
            waiting = self._sync_wait = not self._done
            if waiting:
                self._done_event.clear()
        if waiting:
            self._done_event.wait(BRIEF_WAIT_S)
            with self._done_lock:
                self._sync_wait = False
        if not self._done:
            return False
        self._flush_done()
        return True
