"""The worker: one DEALER socket, the host's store, and the user code it runs.

A worker joins a controller (HELLO -> WELCOME), then serves until the
controller closes, goes silent, or declares the worker lost; then it drops the
session's arrays and objects and joins again, with back-off. Plain functions
run on a thread pool and ``async def`` ones on the worker's loop, so a busy
call never stops heartbeats. Calls from one controller-side stream run in
order; calls from different streams run at the same time.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import gc
import inspect
import io
import logging
import os
import pickle
import queue
import random
import secrets
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zmq

from . import _protocol as P
from ._codec import from_buffer, is_key_array, key_impl_name, to_buffer
from ._protocol import Kind, Status
from ._sockio import NOBLOCK, readable, recv_frames, send_frames, socket_fd
from ._wire import (
    Buffer,
    Dropped,
    Envelope,
    Outgoing,
    batched,
    decode,
    encode,
    loads,
    unpack_batch,
)

__all__ = ["Worker", "setup_jax"]

log = logging.getLogger("colobus.worker")

BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0


class _Exit(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


def setup_jax(cpu_devices: int | None) -> Any:
    """Import JAX with ``cpu_devices`` host-platform devices; return the module."""
    if cpu_devices:
        flags = os.environ.get("XLA_FLAGS", "")
        flags = " ".join(f for f in flags.split() if "host_platform_device_count" not in f)
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={cpu_devices}".strip()
        )
    import jax

    if cpu_devices:
        try:
            jax.config.update("jax_num_cpu_devices", cpu_devices)
        except Exception:  # older JAX: XLA_FLAGS above does it
            pass
    # JAX's own default (x64 off) unless the controller side asks otherwise;
    # local_cluster passes its process's setting (docs/arrays.md, "Dtypes").
    jax.config.update("jax_enable_x64", os.environ.get("COLOBUS_JAX_X64", "0") == "1")
    return jax


def _jax_exact(jax: Any, dtype: Any) -> bool:
    """Whether JAX holds ``dtype`` without changing it (x64 off narrows int64...)."""
    import numpy as np

    if isinstance(dtype, np.dtypes.StringDType):
        # JAX's string arrays fail on empty and replicated layouts: keep numpy.
        return False
    if dtype.fields is not None or dtype.hasobject:
        return False
    # ml_dtypes (bfloat16, float8_*, int4...) are kind "V" to numpy, yet JAX's own.
    ml = dtype.type.__module__.split(".")[0] == "ml_dtypes"
    if dtype.kind in "VSUMm" and not ml:
        return False
    try:
        return bool(jax.dtypes.canonicalize_dtype(dtype) == dtype)
    except Exception:
        return False


class NumpyBlock(np.ndarray):
    """A host block kept as numpy (its exact bytes), with the layout JAX would give it.

    Stored when JAX cannot hold the dtype as is (64-bit types while x64 is off,
    structured dtypes, some string layouts), so fetching returns exactly what was
    put. A numeric block is presented to user code as a ``jax.Array``, converted
    the way ``jax.device_put`` would (int64 -> int32 while x64 is off).

    Large PUT blocks are stored this way too, even where JAX holds the dtype: a
    numpy view on the received frame, made a ``jax.Array`` only when a call first
    needs it (``lazy``). That conversion is cached, and the store entry then holds
    the ``jax.Array`` alone, so the frame is freed once no queued call holds it.
    """

    jax_sharding: Any = None
    lazy = False  # JAX holds the dtype exactly: cache the jax.Array once made
    jax_value: Any = None  # that cached jax.Array
    put_ref = 0  # the store entry a lazy block was PUT as


def _numpy_block(arr: Any, sharding: Any) -> NumpyBlock:
    block = np.asarray(arr).view(NumpyBlock)
    block.jax_sharding = sharding
    return block


def _present(jax: Any, value: Any) -> Any:
    """What user code receives for a stored value (any thread)."""
    if not isinstance(value, NumpyBlock):
        return value
    cached = value.jax_value
    if cached is not None:
        return cached
    plain = value.view(np.ndarray)
    if value.lazy:
        out = jax.device_put(plain, value.jax_sharding)
        out.block_until_ready()  # the copy is done: the frame can go once unpinned
        value.jax_value = out
        return out
    if plain.dtype.kind in "biufc" and value.jax_sharding is not None:
        canonical = jax.dtypes.canonicalize_dtype(plain.dtype)
        return jax.device_put(plain.astype(canonical, copy=False), value.jax_sharding)
    return plain


def _is_string(dtype: Any) -> bool:
    import numpy as np

    return isinstance(dtype, np.dtypes.StringDType)


LAZY_PUT_BYTES = 1 << 20  # PUT blocks this large become jax.Arrays on first use
MAX_BATCH = 256  # calls of one stream run in one thread-pool job, at most
BRIEF_WAIT_S = 0.0005  # after starting quick calls, the loop waits this long for them

_QUEUED, _RUNNING, _CANCELLED, _DONE = range(4)


class _CallPool:
    """The threads plain functions run on: one job per ready run of a stream's calls.

    ``ThreadPoolExecutor`` makes a ``concurrent.futures.Future`` (a condition
    variable and its lock) and a work item per job and takes a semaphore on each
    submit; the runs of calls need none of that. Threads start on demand, up to
    ``max_threads``; a job waits in the queue while all are busy.
    """

    def __init__(self, max_threads: int, name: str) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads: list[threading.Thread] = []
        self._max = max_threads
        self._name = name

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1  # that thread takes this job
            elif len(self._threads) < self._max:
                t = threading.Thread(target=self._serve, daemon=True,
                                     name=f"{self._name}_{len(self._threads)}")
                self._threads.append(t)
                t.start()
        self._queue.put(job)

    def _serve(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                job()
            except BaseException:  # a job reports its own errors; this is a bug
                log.exception("a call-pool job failed")
            del job
            with self._lock:
                self._idle += 1

    def shutdown(self) -> None:
        """Let the threads go once their jobs end (daemons: they never hold up exit)."""
        for _ in self._threads:
            self._queue.put(None)


class _Stream:
    """The calls of one controller-side stream, which run in arrival order."""

    __slots__ = ("busy", "queue", "sid", "waiting")

    def __init__(self, sid: int) -> None:
        self.sid = sid
        self.queue: collections.deque[_Call] = collections.deque()
        self.busy = False  # a batch or an async call of it is running
        self.waiting: asyncio.Future[Any] | None = None  # the head's unresolved input


class _Call:
    """One CALL on this host, from arrival to reply."""

    __slots__ = ("body", "env", "epoch", "fn", "last", "mesh", "obj", "ok", "outcome", "pins",
                 "results", "state", "stream")

    def __init__(self, body: P.Call, env: Envelope, pins: list[asyncio.Future[Any]],
                 obj: asyncio.Future[Any] | None, results: asyncio.Future[Any],
                 stream: _Stream, epoch: int) -> None:
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

    def unready_input(self) -> asyncio.Future[Any] | None:
        """An input (argument or object) not resolved yet, if any."""
        for p in self.pins:
            if not p.done():
                return p
        if self.obj is not None and not self.obj.done():
            return self.obj
        return None


class _ArgsUnpickler(pickle.Unpickler):
    """Unpickles call arguments; persistent ids name values resolved on this host."""

    def __init__(self, data: Buffer, values: Sequence[Any], buffers: Sequence[Buffer]) -> None:
        super().__init__(io.BytesIO(data), buffers=buffers)
        self._values = values

    def persistent_load(self, pid: Any) -> Any:
        try:
            return self._values[pid]
        except (IndexError, TypeError):
            raise pickle.UnpicklingError(f"bad persistent id {pid!r}") from None


class Worker:
    """One host: joins ``connect`` and runs what the controller sends.

    Args:
        connect: the controller's endpoint, e.g. ``tcp://10.0.0.1:5555``.
        name: stable name; a worker rejoining under it gets its host index back.
        key: the shared key (empty: none, for loopback-only controllers).
        cpu_devices: XLA host-platform device count.
        parent_pid: exit when this process is no longer our parent (local clusters).
        curve_keypair: ``(public, secret)`` Z85 CurveZMQ key pair of this worker;
            with ``curve_server_key`` it turns on encryption.
        curve_server_key: the controller's Z85 CurveZMQ public key.
    """

    def __init__(
        self,
        connect: str,
        *,
        name: str | None = None,
        key: bytes = b"",
        cpu_devices: int | None = None,
        parent_pid: int | None = None,
        max_threads: int = 64,
        curve_keypair: tuple[bytes, bytes] | None = None,
        curve_server_key: bytes | None = None,
    ) -> None:
        if (curve_keypair is None) != (curve_server_key is None):
            raise ValueError("CurveZMQ needs both this worker's key pair and the server's "
                             "public key (--curve-key-file and --server-key)")
        self._curve: tuple[tuple[bytes, bytes], bytes] | None = None
        if curve_keypair is not None and curve_server_key is not None:
            self._curve = (curve_keypair, curve_server_key)
        self.connect = connect
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self._key = key
        self._cpu_devices = cpu_devices
        self._parent_pid = parent_pid
        self._calls_pool = _CallPool(max_threads, "colobus-call")
        # PUT conversions and object construction: run_in_executor needs an Executor.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_threads, "colobus-work")
        self._jax: Any = None
        self._jax_devices: list[Any] = []
        self._by_local: dict[tuple[str, int], Any] = {}
        self._mesh_cache: dict[Any, Any] = {}
        # session state
        self._ctx: zmq.Context[Any] | None = None
        self._sock: zmq.Socket[Any] | None = None
        self._session = b""
        self._ctl_session: bytes | None = None
        self._seq = 0
        self._ctl_seq = 0
        self._last_heard = 0.0
        self._heartbeat = 1.0
        self._liveness = 5.0
        self._exit_with_controller = False
        self.host_index = -1
        self._welcome: asyncio.Future[None] | None = None
        self._ended: asyncio.Future[str] | None = None
        self._drain_scheduled = False
        self._corked = False  # sends queue in _outbox and leave together (see _send)
        self._outbox: list[Outgoing] = []
        self.dropped: dict[str, int] = {}
        # the store
        self._code: dict[bytes, Any] = {}
        self._arrays: dict[int, asyncio.Future[Any]] = {}
        self._results: dict[int, asyncio.Future[Any]] = {}
        self._objects: dict[int, asyncio.Future[Any]] = {}
        self._obj_calls: dict[int, set[asyncio.Future[Any]]] = {}  # obj -> calls' results
        self._streams: dict[int, _Stream] = {}
        self._calls: dict[int, _Call] = {}
        self._async_calls: set[asyncio.Task[None]] = set()
        self._epoch = 0  # bumps when a session's store is dropped
        self._state_lock = threading.Lock()  # a call's QUEUED -> RUNNING | CANCELLED
        self._done_lock = threading.Lock()
        self._done: list[_Call] = []  # finished on pool threads, not yet seen by the loop
        self._flush_scheduled = False
        # The brief wait (see _wait_briefly): the loop thread waits on this event
        # while ``_sync_wait``; a pool thread that finishes a call sets it instead of
        # waking the loop through its self-pipe.
        self._sync_wait = False
        self._done_event = threading.Event()
        self._started = False  # the current drain started a batch on the pool
        self._quick = True  # the last batch took less than BRIEF_WAIT_S
        self._loop: asyncio.AbstractEventLoop | None = None  # set in serve()
        self._bg: set[asyncio.Task[None]] = set()
        self._handlers = {
            Kind.HEARTBEAT: self._on_heartbeat,
            Kind.CODE: self._on_code,
            Kind.CALL: self._on_call,
            Kind.CANCEL: self._on_cancel,
            Kind.PUT: self._on_put,
            Kind.FETCH: self._on_fetch,
            Kind.RELEASE: self._on_release,
            Kind.CONSTRUCT: self._on_construct,
            Kind.DESTROY: self._on_destroy,
            Kind.STATS: self._on_stats,
            Kind.SHUTDOWN: self._on_shutdown,
            Kind.RESET: self._on_reset,
            Kind.WELCOME: self._on_welcome,
            Kind.REJECT: self._on_reject,
        }

    def _spawn(self, coro: Any) -> None:
        """A background task, kept referenced until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    # -- top level -----------------------------------------------------------------------

    def run(self) -> int:
        """Serve until told to exit; returns the process exit code."""
        return asyncio.run(self.serve())

    async def serve(self) -> int:
        self._loop = asyncio.get_running_loop()
        self._jax = setup_jax(self._cpu_devices)
        self._discover_devices()
        # Everything imported so far (JAX: ~100k objects) lives as long as the process:
        # keep it out of the collector's scans, which otherwise cost every call.
        gc.freeze()
        # User code that spins in pure Python holds the GIL for a whole switch
        # interval each time the loop thread lets go of it (the convoy effect): a
        # short interval keeps heartbeats and fetches flowing past such code.
        sys.setswitchinterval(0.0005)
        self._ctx = zmq.Context()
        watchdog = asyncio.get_running_loop().create_task(self._watch_parent())
        backoff = BACKOFF_MIN_S
        try:
            while True:
                joined, outcome = await self._one_session(backoff)
                self._clear_store()
                if outcome == "exit":
                    return 0
                if outcome == "reject":
                    return 2
                if self._exit_with_controller and outcome in ("closed", "lost"):
                    log.info("controller gone; this local worker exits")
                    return 0
                backoff = BACKOFF_MIN_S if joined else min(backoff * 2, BACKOFF_MAX_S)
                log.info("host %s: controller session ended (%s); joining again", self.name,
                         outcome)
        except _Exit as e:
            return e.code
        finally:
            watchdog.cancel()
            self._calls_pool.shutdown()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._ctx.term()

    async def _watch_parent(self) -> None:
        if self._parent_pid is None:
            return
        while True:
            await asyncio.sleep(0.5)
            if os.getppid() != self._parent_pid:
                log.warning("parent process %d is gone; worker exits", self._parent_pid)
                os._exit(0)

    def _discover_devices(self) -> None:
        jax = self._jax
        devices: list[Any] = []
        try:
            if jax.default_backend() != "cpu":
                devices.extend(jax.devices())
        except RuntimeError:
            pass
        devices.extend(jax.devices("cpu"))
        self._jax_devices = devices
        self._by_local = {(d.platform, d.id): d for d in devices}

    def _device_report(self) -> list[list[Any]]:
        return [[d.platform, d.device_kind, d.id] for d in self._jax_devices]

    # -- one session: join, serve, end ---------------------------------------------------

    async def _one_session(self, backoff: float) -> tuple[bool, str]:
        loop = asyncio.get_running_loop()
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        # Not IMMEDIATE: with it, a DEALER drops unread incoming messages (such as
        # the controller's SHUTDOWN) when the connection goes. HELLOs queued while
        # the controller is away are resent copies; the controller ignores them.
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(BACKOFF_MAX_S * 1000))
        if self._curve is not None:
            (public, secret), server = self._curve
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            sock.setsockopt(zmq.CURVE_SERVERKEY, server)
        sock.connect(self.connect)
        self._sock = sock
        self._outbox = []  # nothing of an earlier session leaves on this one
        self._session = secrets.token_bytes(16)
        self._ctl_session = None
        self._seq = 0
        self._ctl_seq = 0
        self._welcome = loop.create_future()
        self._ended = loop.create_future()
        fd = socket_fd(sock)
        loop.add_reader(fd, self._drain)
        joined = False
        try:
            while not self._welcome.done():
                self._send(P.Hello(self.name, os.getpid(), socket.gethostname(),
                                   self._device_report(), time.time()))
                wait = backoff * (0.75 + random.random() / 2)
                waits: list[asyncio.Future[Any]] = [self._welcome, self._ended]
                await asyncio.wait(waits, timeout=wait)
                if self._ended.done():
                    return False, self._ended.result()
                backoff = min(backoff * 2, BACKOFF_MAX_S)
            joined = True
            log.info("host %s joined %s as host %d", self.name, self.connect, self.host_index)
            hb = loop.create_task(self._heartbeats())
            try:
                outcome = await self._ended
            finally:
                hb.cancel()
            return joined, outcome
        finally:
            loop.remove_reader(fd)
            sock.close(0)
            self._sock = None

    async def _heartbeats(self) -> None:
        assert self._ended is not None
        while not self._ended.done():
            await asyncio.sleep(self._heartbeat)
            self._drain()  # judge silence only after reading what already arrived
            if self._ended.done():
                return
            if time.monotonic() - self._last_heard > self._liveness:
                log.warning("controller silent for %.1f s", time.monotonic() - self._last_heard)
                self._end("lost")
                return
            self._send(P.Heartbeat(*self._store_counts()))

    def _end(self, outcome: str) -> None:
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(outcome)

    def _clear_store(self) -> None:
        self._epoch += 1
        for t in list(self._async_calls):
            t.cancel()
        self._calls.clear()
        self._streams.clear()
        self._arrays.clear()
        self._results.clear()
        self._objects.clear()
        self._obj_calls.clear()
        self._code.clear()
        self._mesh_cache.clear()

    def _store_counts(self) -> tuple[int, int, int]:
        nbytes = 0
        for f in self._arrays.values():
            if f.done() and not f.cancelled() and f.exception() is None:
                nbytes += int(getattr(f.result(), "nbytes", 0))
        return len(self._arrays), nbytes, len(self._objects)

    # -- socket I/O ----------------------------------------------------------------------

    def _send(self, body: P.Body, payload: Buffer = b"", buffers: Sequence[Buffer] = (),
              pbufs: int = 0) -> None:
        """Send a message; while corked (a drain, a burst of finished calls) it waits
        in the outbox and leaves with the others, in order, as one BATCH envelope."""
        if self._sock is None:
            return
        self._outbox.append((body.kind, body.to_wire(), payload, buffers, pbufs))
        if not self._corked:
            self._flush_out()

    def _flush_out(self) -> bool:
        """Send what waits in the outbox; True if anything was sent."""
        items, self._outbox = self._outbox, []
        sock = self._sock
        if sock is None or not items:
            return False
        for env in batched(items, self._session, self._ctl_session or b""):
            self._seq += 1
            env.seq = self._seq
            try:
                send_frames(sock, encode(self._key, env), NOBLOCK)
            except zmq.Again:
                log.debug("no connection yet; %s not sent", Kind(env.kind).name)
        if not self._corked and not self._drain_scheduled:
            # The ZeroMQ FD is edge-triggered: a send can take the edge that announced
            # incoming messages; read them soon. (A drain re-reads by itself.)
            self._drain_scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)
        return True

    def _drain(self) -> None:
        self._drain_scheduled = False
        sock = self._sock
        if sock is None:
            return
        self._started = False  # only calls this drain starts are worth waiting for
        corked, self._corked = self._corked, True
        try:
            while True:
                while readable(sock):
                    frames = recv_frames(sock)
                    self._on_frames(frames)
                    if self._sock is not sock:
                        return
                sent = self._flush_out()  # the replies so far leave before any wait
                if self._started and self._quick and self._wait_briefly():
                    continue
                if not sent:
                    break  # else read again: the sends may have taken the FD's edge
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EAGAIN:
                log.warning("worker socket error: %s", exc)
        finally:
            self._corked = corked
            if not corked:
                self._flush_out()

    def _wait_briefly(self) -> bool:
        """Loop thread: wait a moment for the calls this drain started; True if any ended.

        A quick call then costs no wake-up of the loop through its self-pipe, and
        the GIL passes to the pool thread at once instead of when the loop next
        blocks. The wait is bounded (``BRIEF_WAIT_S``) and skipped while calls run
        long, so heartbeats and new messages wait at most that long.
        """
        self._started = False
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

    def _drop(self, reason: str, detail: str = "") -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        log.debug("dropped message (%s) %s", reason, detail)

    def _on_frames(self, frames: list[Any]) -> None:
        try:
            env = decode(self._key, frames)
        except Dropped as d:
            if d.reason == "unauthenticated" and self._ctl_session is None:
                log.warning("a message from %s failed authentication: is the key the same "
                            "on both sides?", self.connect)
            self._drop(d.reason, d.detail)
            return
        if env.receiver != self._session:
            self._drop("stale")
            return
        if self._ctl_session is None:
            if env.kind not in (Kind.WELCOME, Kind.REJECT):
                self._drop("unexpected_kind")
                return
        elif env.sender != self._ctl_session:
            self._drop("stale")
            return
        elif env.seq <= self._ctl_seq:
            self._drop("replay")
            return
        self._ctl_seq = env.seq
        self._last_heard = time.monotonic()
        if env.kind != Kind.BATCH:
            self._dispatch(env)
            return
        try:
            subs = unpack_batch(env)
        except Dropped as d:
            self._drop(d.reason, d.detail)
            return
        for sub in subs:
            self._dispatch(sub)

    def _dispatch(self, env: Envelope) -> None:
        """Handle one authenticated message of this session's controller."""
        try:
            body = P.parse(env.kind, env.body)
            self._handlers[Kind(env.kind)](body, env)  # type: ignore[operator]
        except (ValueError, KeyError) as exc:
            self._drop("malformed", str(exc))
        except _Exit:
            raise
        except Exception:
            log.exception("error handling %s", env.kind)

    # -- session handlers ---------------------------------------------------------------

    def _on_welcome(self, body: P.Welcome, env: Envelope) -> None:
        if self._ctl_session is not None:
            self._drop("unexpected_kind")
            return
        if len(body.device_ids) != len(self._jax_devices):
            raise ValueError("welcome device count mismatch")
        self._ctl_session = env.sender
        self.host_index = body.host
        self._heartbeat = float(body.heartbeat)
        self._liveness = float(body.liveness)
        self._exit_with_controller = bool(body.exit_with_controller)
        if self._welcome is not None and not self._welcome.done():
            self._welcome.set_result(None)

    def _on_reject(self, body: P.Reject, env: Envelope) -> None:
        log.error("controller %s refused this worker: %s", self.connect, body.reason)
        self._end("reject")

    def _on_heartbeat(self, body: P.Heartbeat, env: Envelope) -> None:
        pass

    def _on_shutdown(self, body: P.Shutdown, env: Envelope) -> None:
        self._end("exit" if body.reason == "exit" else "closed")

    def _on_reset(self, body: P.Reset, env: Envelope) -> None:
        self._end("reset")

    def _on_stats(self, body: P.Stats, env: Envelope) -> None:
        self._send(P.Result(body.call_id, Status.OK, list(self._store_counts())))

    # -- code, arrays --------------------------------------------------------------------

    def _on_code(self, body: P.Code, env: Envelope) -> None:
        try:
            self._code[body.digest] = ("ok", loads(env.payload, env.buffers[: env.pbufs]))
        except Exception as exc:
            log.warning("code %s does not unpickle here: %r", body.digest.hex()[:12], exc)
            self._code[body.digest] = ("error", exc)

    def _get_code(self, digest: bytes) -> Any:
        state, value = self._code.get(digest, ("error", None))
        if state == "error":
            if value is None:
                raise RuntimeError(f"code {digest.hex()[:12]} was never sent to this host")
            raise value
        return value

    def local_mesh(self, raw: list[Any]) -> Any:
        """A jax ``Mesh`` (or one ``jax.Device``) from ``[[platform, id]...], shape, names]``."""
        key = repr(raw)
        mesh = self._mesh_cache.get(key)
        if mesh is None:
            import numpy as np

            ids, shape, names = raw
            devs = [self._by_local[(str(p), int(i))] for p, i in ids]
            if not shape:
                mesh = devs[0]
            else:
                mesh = self._jax.sharding.Mesh(
                    np.array(devs, dtype=object).reshape(shape), tuple(names))
            self._mesh_cache[key] = mesh
        return mesh

    def _sharding(self, mesh: Any, spec: Any) -> Any:
        jax = self._jax
        if isinstance(mesh, jax.sharding.Mesh):
            return jax.sharding.NamedSharding(mesh, spec)
        return jax.sharding.SingleDeviceSharding(mesh)

    def _to_host_value(self, arr: Any, mesh: Any, spec: Any, key_impl: str | None) -> Any:
        jax = self._jax
        if key_impl:
            keys = jax.random.wrap_key_data(arr, impl=key_impl)
            return jax.device_put(keys, self._sharding(mesh, spec))
        if _jax_exact(jax, arr.dtype):
            return jax.device_put(arr, self._sharding(mesh, spec))
        if _is_string(arr.dtype) and arr.size:
            # A jax.Array where JAX can hold it (one distinct shard per device, as
            # in JAX's own string examples); numpy where it cannot (replicas).
            sharding = self._sharding(mesh, spec)
            if sharding.is_fully_replicated and len(sharding.device_set) > 1:
                return arr  # JAX puts it, but cannot read it back (jax 0.10)
            try:
                return jax.device_put(arr, sharding)
            except Exception:
                return arr
        return _numpy_block(arr, self._sharding(mesh, spec))

    def _on_put(self, body: P.Put, env: Envelope) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._arrays[body.ref] = fut
        try:
            if len(env.buffers) != 1:
                raise ValueError("PUT needs one buffer")
            arr = from_buffer(body.dtype, body.shape, env.buffers[0])
            mesh = self.local_mesh(body.mesh)
            spec = P.decode_spec(body.spec)
            impl = body.key_impl if isinstance(body.key_impl, str) else None
        except Exception as exc:
            fut.set_exception(exc)
            fut.exception()
            raise ValueError(f"bad PUT: {exc}") from exc
        if arr.nbytes < LAZY_PUT_BYTES:
            try:
                fut.set_result(self._to_host_value(arr, mesh, spec, impl))
            except Exception as exc:
                fut.set_exception(exc)
                fut.exception()
            return
        if impl is None and _jax_exact(self._jax, arr.dtype):
            # Stored as the numpy view on the received frame: no copy now (the
            # put is done when the frame is here); a call makes the jax.Array.
            try:
                block = _numpy_block(arr, self._sharding(mesh, spec))
            except Exception as exc:
                fut.set_exception(exc)
                fut.exception()
                return
            block.lazy = True
            block.put_ref = body.ref
            fut.set_result(block)
            return
        work = loop.run_in_executor(self._pool, self._to_host_value_ready, arr, mesh, spec,
                                    impl)
        work.add_done_callback(functools.partial(_chain, fut))

    def _present(self, value: Any) -> Any:
        """What user code receives for a stored value (any thread)."""
        lazy = isinstance(value, NumpyBlock) and value.lazy and value.jax_value is None
        out = _present(self._jax, value)
        if lazy and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._swap_block, value)
            except RuntimeError:  # the loop closed: the worker is exiting
                pass
        return out

    def _swap_block(self, block: NumpyBlock) -> None:
        """Loop thread: a lazy PUT block got its jax.Array; store that alone.

        The numpy view (and the received frame under it) lives on only while
        calls that pinned the old entry still hold it. If JAX aliased the frame
        (aligned host memory), the jax.Array keeps it: no copy was made.
        """
        ref = block.put_ref
        fut = self._arrays.get(ref)
        if fut is None or not fut.done() or fut.cancelled() or fut.exception() is not None:
            return
        if fut.result() is not block or block.jax_value is None:
            return
        swapped = asyncio.get_running_loop().create_future()
        swapped.set_result(block.jax_value)
        self._arrays[ref] = swapped
        # jaxlib drops its reference to the copied numpy source from a callback of
        # the collector (references released off the GIL wait in a queue): run a
        # young-generation pass now, or the frame waits for the next automatic one.
        gc.collect(0)

    def _to_host_value_ready(self, arr: Any, mesh: Any, spec: Any, key_impl: str | None) -> Any:
        # jax.device_put returns before its copy is done: wait here (a pool thread),
        # so a PUT counts as stored (block_until_ready) only once the data is in place
        # and the received frame can be freed.
        value = self._to_host_value(arr, mesh, spec, key_impl)
        ready = getattr(value, "block_until_ready", None)
        return ready() if ready is not None else value

    def _on_fetch(self, body: P.Fetch, env: Envelope) -> None:
        fut = self._arrays.get(body.ref)
        self._spawn(self._fetch(body.call_id, body.ref, fut, body.data))

    async def _fetch(self, call_id: int, ref: int, fut: asyncio.Future[Any] | None,
                     data: bool) -> None:
        import numpy as np

        try:
            if fut is None:
                raise KeyError(f"array {ref} is not on host {self.host_index} (deleted?)")
            value = await fut
            if not data:
                self._send(P.Result(call_id, Status.OK, None))
                return
            impl = None
            if is_key_array(value):
                impl = key_impl_name(value)
                value = self._jax.random.key_data(value)
            arr = np.asarray(value)
            descr, buf = to_buffer(arr)
        except BaseException as exc:
            self._reply_error(call_id, exc)
            return
        self._send(P.Result(call_id, Status.OK, [list(arr.shape), descr, impl]), b"", [buf])

    def _on_release(self, body: P.Release, env: Envelope) -> None:
        for ref in body.refs:
            self._arrays.pop(ref, None)
        for call_id in body.calls:
            self._results.pop(call_id, None)

    # -- calls ----------------------------------------------------------------------------

    def _pin(self, ref: Any) -> asyncio.Future[Any]:
        """The store entry a call argument names, taken now (a later RELEASE can't race)."""
        tag, ident = ref
        table = (self._arrays, self._results, self._objects)[tag]
        fut = table.get(ident)
        if fut is None:
            what = ("array", "call result", "object")[tag]
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            fut.set_exception(KeyError(f"{what} {ident} is not on host {self.host_index}"))
            fut.exception()
        return fut

    def _on_call(self, body: P.Call, env: Envelope) -> None:
        loop = asyncio.get_running_loop()
        pins = [self._pin(r) for r in body.refs]
        obj = self._pin((2, body.obj)) if body.obj else None
        results: asyncio.Future[Any] = loop.create_future()
        self._results[body.call_id] = results
        stream = self._streams.get(body.stream)
        if stream is None:
            stream = self._streams[body.stream] = _Stream(body.stream)
        call = _Call(body, env, pins, obj, results, stream, self._epoch)
        self._calls[body.call_id] = call
        if body.obj:
            self._obj_calls.setdefault(body.obj, set()).add(results)
        stream.queue.append(call)
        self._pump(stream)

    def _on_cancel(self, body: P.Cancel, env: Envelope) -> None:
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
        if not call.results.done():
            call.results.set_exception(asyncio.CancelledError())
            call.results.exception()  # retrieved: no "never retrieved" log when dropped
        self._send(P.Result(body.call_id, Status.CANCELLED, None))
        stream = call.stream
        if stream.waiting is not None and stream.queue and stream.queue[0] is call:
            stream.waiting = None  # it waited for this call's inputs: not any more
            self._pump(stream)

    # A stream's calls run one after another. When the head of its queue is a
    # plain function with its inputs ready, it and the ready plain calls queued
    # behind it run back to back in one thread-pool job (one hop, not one per
    # call); each call's reply goes out as it finishes. `async def` functions run
    # on the loop, alone.

    def _pump(self, stream: _Stream) -> None:
        """Start the stream's next calls, unless some are running or it waits for inputs."""
        if stream.busy or stream.waiting is not None:
            return
        if self._streams.get(stream.sid) is not stream:
            return  # a stream of a finished session
        queue = stream.queue
        batch: list[_Call] = []
        while queue and len(batch) < MAX_BATCH:
            call = queue[0]
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
                return
            try:
                fn = self._target(call)
            except Exception as exc:
                if batch:
                    break
                queue.popleft()
                self._fail(call, exc)
                continue
            if inspect.iscoroutinefunction(fn):
                if batch:
                    break
                queue.popleft()
                call.state = _RUNNING  # no lock: CANCEL also runs on this thread
                stream.busy = True
                task = asyncio.get_running_loop().create_task(self._run_async(call, fn))
                self._async_calls.add(task)
                task.add_done_callback(self._async_calls.discard)
                return
            call.fn = fn
            queue.popleft()
            batch.append(call)
        if batch:
            batch[-1].last = True
            stream.busy = True
            self._started = True
            self._calls_pool.submit(functools.partial(self._run_batch, batch))
        elif not queue:
            del self._streams[stream.sid]  # idle: a later call starts a new one

    def _resume(self, stream: _Stream, fut: asyncio.Future[Any]) -> None:
        if stream.waiting is fut:
            stream.waiting = None
            self._pump(stream)

    def _target(self, call: _Call) -> Any:
        """The callable a call runs, and its mesh (loop thread; raises for the call)."""
        body = call.body
        if call.obj is not None:
            fn = getattr(call.obj.result(), body.method)
        else:
            fn = self._get_code(body.digest)
        call.mesh = self.local_mesh(body.mesh)
        return fn

    def _forget(self, call: _Call) -> None:
        """Drop a call from the bookkeeping, and its references to inputs and code."""
        body = call.body
        self._calls.pop(body.call_id, None)
        if body.obj:
            pending = self._obj_calls.get(body.obj)
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
            call.results.set_exception(exc)
            call.results.exception()
        self._reply_error(call.body.call_id, exc)

    def _run_batch(self, batch: list[_Call]) -> None:
        """Pool thread: run ready plain calls of one stream back to back."""
        t0 = time.perf_counter()
        for call in batch:
            with self._state_lock:
                runs = call.state == _QUEUED
                if runs:
                    call.state = _RUNNING
            if runs:
                self._run_plain(call)
            self._quick = time.perf_counter() - t0 < BRIEF_WAIT_S
            self._post_done(call)

    def _run_plain(self, call: _Call) -> None:
        """Pool thread: one call, start to reply bytes; sets ``ok`` and ``outcome``."""
        try:
            fn, call.fn = call.fn, None
            args, kwargs = self._call_args(call)
            out = fn(*args, **kwargs)
            call.outcome = (out, *self._outputs(out, call.mesh))
            call.ok = True
        except BaseException as exc:
            call.outcome = exc

    def _call_args(self, call: _Call) -> tuple[Any, Any]:
        values = [self._present(p.result()) for p in call.pins]
        env = call.env
        assert env is not None
        args, kwargs = _ArgsUnpickler(env.payload, values, env.buffers[: env.pbufs]).load()
        return args, kwargs

    def _post_done(self, call: _Call) -> None:
        """Pool thread: hand a finished call to the loop; one wake-up per burst."""
        with self._done_lock:
            self._done.append(call)
            if self._flush_scheduled:
                return
            self._flush_scheduled = True
            if self._sync_wait:
                self._done_event.set()  # the loop thread is waiting for it
                return
        loop = self._loop
        assert loop is not None
        try:
            loop.call_soon_threadsafe(self._flush_done)
        except RuntimeError:  # the loop closed: the worker is exiting
            pass

    def _flush_done(self) -> None:
        with self._done_lock:
            done, self._done = self._done, []
            self._flush_scheduled = False
        corked, self._corked = self._corked, True  # the replies leave as one batch
        try:
            for call in done:
                self._finish(call)
        finally:
            self._corked = corked
            if not corked:
                self._flush_out()

    def _finish(self, call: _Call) -> None:
        """Loop thread: store a finished call's outputs, reply, start what is next."""
        if call.epoch != self._epoch:
            return  # the session it belonged to is over
        body = call.body
        if call.state == _RUNNING:
            call.state = _DONE
            self._forget(call)
            outcome, call.outcome = call.outcome, None
            if call.ok:
                out, stored, payload, bufs = outcome
                loop = asyncio.get_running_loop()
                for i, value in enumerate(stored):
                    fut = loop.create_future()
                    fut.set_result(value)
                    self._arrays[P.output_ref(body.call_id, i)] = fut
                if not call.results.done():
                    call.results.set_result(out)
                self._send(P.Result(body.call_id, Status.OK, len(stored)), payload, bufs,
                           len(bufs))
            else:
                if not call.results.done():
                    call.results.set_exception(outcome)
                    call.results.exception()
                self._reply_error(body.call_id, outcome)
        else:
            self._forget(call)
        if call.last:
            call.stream.busy = False
            self._pump(call.stream)

    async def _run_async(self, call: _Call, fn: Any) -> None:
        """An ``async def`` call, on the loop."""
        try:
            args, kwargs = self._call_args(call)
            out = await fn(*args, **kwargs)
            call.outcome = (out, *self._outputs(out, call.mesh))
            call.ok = True
        except asyncio.CancelledError as exc:
            if call.epoch != self._epoch:
                raise  # the session ended
            call.outcome = exc
        except BaseException as exc:
            call.outcome = exc
        del fn
        call.last = True
        if call.ok or not isinstance(call.outcome, asyncio.CancelledError):
            self._finish(call)
            return
        # The function itself was cancelled (it awaited something cancelled).
        call.state = _DONE
        self._forget(call)
        call.outcome = None
        if not call.results.done():
            call.results.set_exception(asyncio.CancelledError())
            call.results.exception()
        self._send(P.Result(call.body.call_id, Status.CANCELLED, None))
        call.stream.busy = False
        self._pump(call.stream)

    def _outputs(self, out: Any, mesh: Any) -> tuple[list[Any], bytes, list[Buffer]]:
        """The values a call's outputs are stored as, and its reply's pickled metadata.

        Thread-safe: runs on a pool thread for plain functions.
        """
        import numpy as np

        jax = self._jax
        leaves, treedef = jax.tree_util.tree_flatten(out)
        if len(leaves) >= P.MAX_OUTPUTS:
            raise ValueError(f"a call may return at most {P.MAX_OUTPUTS - 1} arrays")
        metas: list[P.OutLeaf] = []
        values: list[Any] = []
        is_mesh = isinstance(mesh, jax.sharding.Mesh)
        for i, leaf in enumerate(leaves):
            spec = None
            if isinstance(leaf, jax.Array):
                sh = leaf.sharding
                if (is_mesh and isinstance(sh, jax.sharding.NamedSharding)
                        and sh.mesh.axis_names == mesh.axis_names
                        and sh.mesh.devices.shape == mesh.devices.shape
                        and all(a == b for a, b in zip(sh.mesh.devices.flat, mesh.devices.flat,
                                                       strict=True))):
                    spec = sh.spec
                    value = leaf
                elif _is_string(leaf.dtype):  # JAX cannot replicate string arrays
                    value = np.asarray(leaf)
                else:
                    value = jax.device_put(leaf, self._sharding(mesh, jax.sharding.PartitionSpec()))
            elif isinstance(leaf, np.ndarray | np.generic | bool | int | float | complex):
                arr = np.asarray(leaf)
                if arr.dtype.hasobject and not isinstance(arr.dtype, np.dtypes.StringDType):
                    raise ValueError(
                        "colocated_python only supports jax.Array as input and output, "
                        f"but got {type(leaf)}.")
                replicated = self._sharding(mesh, jax.sharding.PartitionSpec())
                value = (jax.device_put(arr, replicated) if _jax_exact(jax, arr.dtype)
                         else _numpy_block(arr, replicated))
            else:
                raise ValueError(
                    "colocated_python only supports jax.Array as input and output, "
                    f"but got {type(leaf)}.")
            impl = key_impl_name(value) if is_key_array(value) else None
            metas.append(P.OutLeaf(i, tuple(value.shape), value.dtype if impl is None else None,
                                   spec, impl))
            values.append(value)
        payload, bufs = _dumps_meta(treedef.unflatten(metas))
        return values, payload, bufs

    def _reply_error(self, call_id: int, exc: BaseException) -> None:
        tb = "".join(traceback.format_exception(exc))
        meta = [f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), tb]
        try:
            payload, bufs = _dumps_meta(exc)
        except Exception:
            payload, bufs = b"", []
        self._send(P.Result(call_id, Status.ERROR, meta), payload, bufs, len(bufs))

    # -- objects ------------------------------------------------------------------------

    def _on_construct(self, body: P.Construct, env: Envelope) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._objects[body.obj] = fut
        pins = [self._pin(r) for r in body.refs]
        self._spawn(self._construct(body, env, pins, fut))

    async def _construct(self, body: P.Construct, env: Envelope,
                         pins: list[asyncio.Future[Any]], fut: asyncio.Future[Any]) -> None:
        loop = asyncio.get_running_loop()
        try:
            values = [self._present(await p) for p in pins]
            args, kwargs = _ArgsUnpickler(env.payload, values, env.buffers[: env.pbufs]).load()
            cls = self._get_code(body.digest)
            inst = await loop.run_in_executor(self._pool, functools.partial(cls, *args, **kwargs))
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()
            return
        fut.set_result(inst)

    def _on_destroy(self, body: P.Destroy, env: Envelope) -> None:
        calls = self._obj_calls.pop(body.obj, set())
        fut = self._objects.get(body.obj)
        if fut is None:
            return
        self._spawn(self._destroy(body.obj, fut, calls))

    async def _destroy(self, obj: int, fut: asyncio.Future[Any],
                       calls: set[asyncio.Future[Any]]) -> None:
        if calls:  # each call's result slot: settled once the call finished
            await asyncio.wait(calls)
        if not fut.done():
            await asyncio.wait({fut})
        if self._objects.get(obj) is fut:
            del self._objects[obj]
        del fut  # the last reference: the instance's __del__ runs here


def _chain(dst: asyncio.Future[Any], src: asyncio.Future[Any]) -> None:
    if dst.done():
        return
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
        dst.exception()
    else:
        dst.set_result(src.result())


def _dumps_meta(obj: Any) -> tuple[bytes, list[Buffer]]:
    from ._wire import dumps

    return dumps(obj)


def main_worker(connect: str, name: str | None, key: bytes, cpu_devices: int | None,
                parent_pid: int | None, curve_keypair: tuple[bytes, bytes] | None = None,
                curve_server_key: bytes | None = None) -> int:
    """Entry point used by ``colobus worker``."""
    worker = Worker(connect, name=name, key=key, cpu_devices=cpu_devices, parent_pid=parent_pid,
                    curve_keypair=curve_keypair, curve_server_key=curve_server_key)
    try:
        return worker.run()
    except KeyboardInterrupt:
        return 130
