"""The worker: one DEALER socket, one controller session at a time.

It joins a controller (HELLO -> WELCOME) and serves until the controller closes,
goes silent or declares it lost; then it drops the session's
:class:`~colobus._host.store.Store` and joins again, with back-off. Calls run
through :class:`~colobus._host.sched.Scheduler`; what arrives and leaves goes
through its base, :class:`~colobus._host.messages.MessagePath`. Its DEALER keeps
one routing id per session, so a TCP connection ZeroMQ re-establishes in time
continues it (:mod:`colobus._wire.channel`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random
import secrets
import signal
import socket
import sys
import threading
import time
from typing import Any

import zmq

from .._model import jaxside as _hostside
from .._process import freeze_once, keep_heaps, quick_loop
from .._wire import protocol as P
from .._wire import versions as _versions
from .._wire.calltimes import HEARTBEAT_BUDGET, HostCallTimes
from .._wire.channel import Channel, Peer
from .._wire.chunks import CHUNK_BYTES, MAX_PART
from .._wire.endpoint import parse_connect
from .._wire.envelope import Envelope
from .._wire.keys import check_key, key_id
from .._wire.lane import ON as LANE
from .._wire.links import heartbeat_options
from .._wire.protocol import Kind, Status
from .._wire.sockio import NOBLOCK, socket_fd
from .._wire.stalls import StallClock
from .._wire.tasks import supervise
from .arrays import HostArrays
from .calls import set_job
from .construct import on_construct
from .dataplane import DataPlane, start_dataplane
from .fetched import FETCHER
from .forming import on_coord, on_form, run
from .jaxjob import HostJob
from .jaxnames import answer_colobus_process_index
from .join import JoinDiagnosis, relay_socket, session_socket
from .leader import serve_worker
from .link import ControllerLink
from .messages import Exit, MessagePath
from .process import cpu_ns, end_context, rss_bytes
from .sched import Scheduler
from .store import Store
from .values import HostValues, local_devices, setup_jax
from .viewguard import guard_builders

__all__ = ["Worker", "setup_jax"]

log = logging.getLogger("colobus.worker")

BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0
MAX_HEARTBEAT_RESTARTS = 3  # per session; then the worker leaves it and joins afresh


class Worker(MessagePath):
    """One host: joins ``connect`` and runs what the controller sends.

    Args:
        connect: the controller's endpoint, e.g. ``tcp://10.0.0.1:5555``.
        name: stable name; a worker rejoining under it gets its host index back.
        key: the shared key, at least 32 bytes (there is no unauthenticated mode).
        cpu_devices: XLA host-platform device count.
        parent_pid: exit when this process is no longer our parent (local clusters).
        launched: a launcher or ``local_cluster`` started this worker for one controller:
            refused because that cluster is full, it exits (status 2) rather than wait for
            a place or the next controller. Default: ``parent_pid`` was given.
        curve_keypair, curve_server_key: this worker's ``(public, secret)`` Z85 CurveZMQ
            key pair and the controller's public key (encryption).
    """

    def __init__(
        self,
        connect: str,
        *,
        name: str | None = None,
        key: bytes,
        cpu_devices: int | None = None,
        parent_pid: int | None = None,
        launched: bool | None = None,
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
        self._endpoint = parse_connect(connect)  # ValueError: says what is wrong with it
        self.connect = connect
        self._hostname = socket.gethostname()
        self.name = name or f"{self._hostname}-{os.getpid()}"
        self._key = check_key(key, "the worker's key")
        self._cpu_devices = cpu_devices
        self._parent_pid = parent_pid
        self._launched = parent_pid is not None if launched is None else launched
        self._refused = ""  # the last refusal logged (each reason once: a spare worker retries)
        self.sched = Scheduler(self, max_threads)
        # PUT conversions and object construction: run_in_executor needs an Executor.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_threads, "colobus-work")
        self._jax: Any = None
        self._jax_devices: list[Any] = []
        # What HELLO reports: [platform, device_kind, id] per device, as first found (a job
        # renumbers the devices JAX shows; the controller keeps the host's ids across it)
        self._reported: list[list[Any]] = []
        self._devices_stale = False  # a job dropped the backend the devices came from
        self._welcome_ids: list[int] = []  # this host's device ids, as its WELCOME said
        self.job: HostJob | None = None  # this process's part in the cluster's JAX job
        self._jax_session = False  # this session's hosts form one JAX job (WELCOME)
        self.values: HostValues = HostValues(None, {})
        self.dropped: dict[str, int] = {}
        self.store = Store(self.dropped)
        self.arrays = HostArrays(self)
        self.dataplane: DataPlane | None = None  # blocks host to host (set in serve())
        self.epoch = 0  # bumps when a session's store is dropped
        self.host_index = -1
        self.loop: asyncio.AbstractEventLoop | None = None  # set in serve()
        # Calls' queued and run times per function, when the controller asked (WELCOME).
        self.call_times: HostCallTimes | None = None
        self._ping = self._ping_at = 0  # the last heartbeat ping (to echo), when (monotonic ns)
        # session state
        self._ctx: zmq.Context[Any] | None = None
        self._chan: Channel | None = None
        self._peer: Peer | None = None
        self._joined = False
        self._last_heard = 0.0
        self._link = ControllerLink(lambda: self._last_heard)  # its silence, by its link
        self._heartbeat = 1.0
        self._liveness = 5.0
        self._exit_with_controller = False
        self._max_message = 1 << 62  # the controller's limit, from its WELCOME
        self._answered = False  # a HELLO answered the CHALLENGE to the last JOIN
        self._stopping = False  # SIGTERM: no next session
        self._welcome: asyncio.Future[None] | None = None
        self._ended: asyncio.Future[str] | None = None
        self._hb: asyncio.Task[None] | None = None  # this session's heartbeats
        self._hb_restarts = 0  # times they died this session (and were started again)
        self._bg: set[asyncio.Task[None]] = set()
        self._handlers: dict[int, Any] = {  # Kind keys, found by the plain int off the wire
            Kind.HEARTBEAT: self._on_heartbeat,
            Kind.CODE: self.store.add_code,
            Kind.CALL: self.sched.on_call,
            Kind.CANCEL: lambda body, env: self.sched.on_cancel(body),
            **self.arrays.handlers(),  # PUT, FETCH, RESHARD, PIECE, TREEPUT, RELEASE
            Kind.CONSTRUCT: lambda body, env: on_construct(self, body, env),
            Kind.DESTROY: lambda body, env: self.sched.on_destroy(body),
            Kind.STATS: self._on_stats,
            Kind.SHUTDOWN: self._on_shutdown,
            Kind.RESET: lambda body, env: self._on_reset(env),
            Kind.WELCOME: self._on_welcome,
            Kind.REJECT: self._on_reject,
            Kind.CHALLENGE: self._on_challenge,
            Kind.FORM: lambda body, env: on_form(self, body, env),
            Kind.COORD: lambda body, env: on_coord(self, body, env),
            Kind.MODULE: lambda body, env: FETCHER.answered(body),  # (fetched.py)
        }
        self.store.shipped.attach(self._handlers, self._dispatch)  # (held while it unpacks)
        self._lane_call = self._handlers[Kind.CALL]  # what the lane stands for, in place
        self._lane_release = self._handlers[Kind.RELEASE]

    def _spawn(self, coro: Any) -> None:
        """A background task of this session, kept referenced until it ends."""
        task = supervise(asyncio.get_running_loop().create_task(coro), "a session task")
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    # -- top level -----------------------------------------------------------------------
    def run(self) -> int:  # serve until told to exit; the process exit code
        # (once in a JAX job, the process exits in there: see forming.run)
        return run(lambda: serve_worker(self.serve, self.sched, self._on_sigterm),
                   lambda: self.job)

    async def serve(self) -> int:
        self.loop = quick_loop(asyncio.get_running_loop())
        # The first line says where this worker goes and with which key (its id, never
        # the key): what to compare with the driver's log when the join does not come.
        log.info("host %s: connecting to %s with key id %s%s", self.name, self.connect,
                 key_id(self._key), " (CurveZMQ)" if self._curve is not None else "")
        # As PID 1 in a container, SIGTERM without a handler is ignored (docker stop
        # would wait and SIGKILL); with one, the worker leaves its session and exits.
        on_main = threading.current_thread() is threading.main_thread()
        if on_main:
            self.loop.add_signal_handler(signal.SIGTERM, self._on_sigterm)
        # The calls' outputs live until the controller frees them: the heaps of the
        # threads that run calls would grow and shrink with each batch (colobus._process).
        keep_heaps()
        self._jax = setup_jax(self._cpu_devices)
        answer_colobus_process_index(self._jax)  # (before any user code runs here)
        guard_builders(self._jax)  # (the block view's check: colobus._host.viewguard)
        self.job = HostJob(self._jax)
        self._discover_devices()
        self._reported = [[d.platform, d.device_kind, d.id] for d in self._jax_devices]
        # Everything imported so far (JAX: ~100k objects) lives as long as the process:
        # keep it out of the collector's scans, which otherwise cost every call.
        freeze_once()
        # User code that spins in pure Python holds the GIL for a whole switch
        # interval each time the loop thread lets go of it (the convoy effect): a
        # short interval keeps heartbeats and fetches flowing past such code.
        sys.setswitchinterval(0.0005)
        self._ctx = zmq.Context()
        start_dataplane(self.loop, self._ctx, self._endpoint, self._curve is not None,
                        self._plane_up)
        watchdog = supervise(asyncio.get_running_loop().create_task(self._watch_parent()),
                             "the parent watchdog")
        backoff = BACKOFF_MIN_S
        try:
            while True:
                joined, outcome = await self._one_session(backoff)
                self._clear_session()
                if outcome == "exit":
                    return 0
                if outcome == "reject":
                    return 2
                if self._exit_with_controller and outcome in ("closed", "lost"):
                    log.info("controller gone; this local worker exits")
                    return 0
                backoff = BACKOFF_MIN_S if joined else min(backoff * 2, BACKOFF_MAX_S)
                log.info("host %s: controller session ended (%s); rejoining", self.name, outcome)
        except Exit as e:
            return e.code
        finally:
            if on_main:
                self.loop.remove_signal_handler(signal.SIGTERM)
            watchdog.cancel()
            self.sched.shutdown()
            self._pool.shutdown(wait=False, cancel_futures=True)
            if self.dataplane is not None:
                self.dataplane.close()
            end_context(self._ctx)

    def _plane_up(self, plane: DataPlane | None) -> None:
        self.dataplane = plane  # the next HELLO announces it

    def _on_sigterm(self) -> None:
        log.info("host %s: SIGTERM; worker exits", self.name)
        self._stopping = True
        self._end("exit")

    async def _watch_parent(self) -> None:
        if self._parent_pid is None:
            return
        while True:
            await asyncio.sleep(0.5)
            if os.getppid() != self._parent_pid:
                log.warning("parent process %d is gone; worker exits", self._parent_pid)
                os._exit(0)

    def _discover_devices(self) -> None:
        self._jax_devices = devices = local_devices(self._jax)
        self.values = HostValues(self._jax, {(d.platform, d.id): d for d in devices})
        self._devices_stale = False

    # -- one session: join, serve, end ---------------------------------------------------

    async def _one_session(self, backoff: float) -> tuple[bool, str]:
        loop = asyncio.get_running_loop()
        assert self._ctx is not None
        sock = session_socket(self._ctx, self.connect, self._curve, watch=self._watch_link,
                              link=(self._heartbeat, self._liveness))
        session = secrets.token_bytes(16)
        self._peer = Peer([], session, b"")
        self._joined = False
        self._welcome = loop.create_future()
        self._ended = loop.create_future()
        if self._stopping:
            self._ended.set_result("exit")
        diagnosis = JoinDiagnosis(self._endpoint, self._key, curve=self._curve is not None,
                                  quiet=self.host_index >= 0)
        sched = self.sched
        chan = self._chan = Channel(sock, self._key, loop, self._on_frames, send_flags=NOBLOCK,
                                    after_flush=sched.wait_briefly, before_drain=sched.drain_starts,
                                    after_drain=sched.drain_ends)
        if LANE:  # the socket read by the lane's reader (MessagePath._read)
            loop.add_reader(socket_fd(sock), self._read)
        joined = False
        try:
            while not self._welcome.done():
                # One HELLO per JOIN round: it answers the CHALLENGE (_on_challenge).
                self._answered = False
                self._send_join_raw(P.Join(), key_id(self._key).encode())
                wait = backoff * (0.75 + random.random() / 2)
                waits: list[asyncio.Future[Any]] = [self._welcome, self._ended]
                await asyncio.wait(waits, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                if self._ended.done():
                    return False, self._ended.result()
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                diagnosis.after_hello(self._answered)
            joined = True
            self._refused = ""
            diagnosis.close()
            log.info("host %s joined %s as host %d", self.name, self.connect, self.host_index)
            self._hb_restarts = 0
            self._hb = self._start_heartbeats()
            try:
                outcome = await self._ended
            finally:
                self._hb.cancel()
            return joined, outcome
        finally:
            diagnosis.close()
            self._watch_link(None)
            chan.close()
            self._chan = None
            self._peer = None

    def _watch_link(self, sock: zmq.Socket[Any] | None) -> None:
        """Watch ``sock``'s link (None: stop watching, before it closes)."""
        self._link.watch(sock, self.loop)

    def _start_heartbeats(self) -> asyncio.Task[None]:
        return supervise(asyncio.get_running_loop().create_task(self._heartbeats()),
                         "the worker's heartbeats", self._heartbeats_died)

    def _heartbeats_died(self, why: str) -> None:
        """Restart them, a few times a session; then leave it (and join afresh)."""
        self._hb_restarts += 1
        if self._hb_restarts > MAX_HEARTBEAT_RESTARTS:
            self._end("error")
        elif self._ended is not None and not self._ended.done():
            self._hb = self._start_heartbeats()

    async def _heartbeats(self) -> None:
        assert self._ended is not None and self._chan is not None and self._peer is not None
        resend_after = max(2 * self._heartbeat, self._liveness / 3)
        stalls = StallClock(self._heartbeat)
        beat = 0.0  # when the last heartbeat left
        while not self._ended.done():
            await asyncio.sleep(self._heartbeat)
            self._chan.drain()  # judge silence only after reading what already arrived
            if self._ended.done():
                return
            now = time.monotonic()
            frozen = stalls.frozen(now)  # not the controller's silence
            if frozen:  # (never past now: what the drain just read was heard now)
                self._link.settle()
                self._last_heard = min(self._last_heard + frozen, now)
                self._link.shift(frozen, now)
            if self._link.gone(self._liveness, time.monotonic()):
                self._end("relay" if self._chan.moved else "lost")  # a relay lost: rejoin
                return
            now = time.monotonic()
            # A controller silent past the liveness timeout on a live link reads nothing
            # (its loop is held): one heartbeat per timeout, not one per interval, waits
            # for it in its socket, however long the hold.
            if now - self._last_heard <= self._liveness or now - beat >= self._liveness:
                beat = now
                self.send(self._health())
            self._chan.resend_stale([self._peer], resend_after)

    def _health(self) -> P.Heartbeat:
        """Our heartbeat: store counters, the ping echo, process memory, CPU, drops."""
        ping, self._ping = self._ping, 0
        held = time.monotonic_ns() - self._ping_at if ping else 0
        calls = ([] if self.call_times is None else
                 self.call_times.take(min(HEARTBEAT_BUDGET, self._max_message // 16)))
        plane = self.dataplane
        dropped = dict(self.dropped) if plane is None else {**self.dropped, **plane.dropped()}
        return P.Heartbeat(*self.store.counts(), ping, held, rss_bytes(), cpu_ns(), dropped,
                           calls, *self.sched.pool.figures(), *self.store.code_figures())

    def _end(self, outcome: str) -> None:
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(outcome)

    def _clear_session(self) -> None:
        """Drop everything of the session that ended; its late work sends nothing."""
        self.epoch += 1
        FETCHER.close()
        for t in list(self._bg):
            t.cancel()
        self.sched.clear()
        self.store.clear()
        if self.dataplane is not None:
            self.dataplane.clear()
        self.values.clear()
        self.call_times = None
        if self.job is not None and self.job.index >= 0:  # the job ends with the session
            self.job.leave()
            set_job(None)
            self._devices_stale = True
        self._jax_session = False

    # -- session handlers ---------------------------------------------------------------

    def _on_welcome(self, body: P.Welcome, env: Envelope) -> None:
        if self._joined:
            self._drop("unexpected_kind")
            return
        if len(body.device_ids) != len(self._reported):
            raise ValueError("welcome device count mismatch")
        assert self._peer is not None
        self._peer.their_session = env.sender
        self._joined = True
        self.host_index = body.host
        self._welcome_ids = list(body.device_ids)
        self._jax_session = bool(body.jax_job)
        if self._jax_session:  # its devices once the job forms (FORM): no backend till then
            _hostside.install(body.host, {}, body.host_count)
        else:
            if self._devices_stale:  # a job dropped the backend: this process's own now
                self._discover_devices()
            _hostside.install(body.host, dict(zip(body.device_ids, self._jax_devices,
                                                  strict=True)), body.host_count)
        self._heartbeat = float(body.heartbeat)
        self._liveness = float(body.liveness)
        if self._chan is not None:  # (its connections after this one: a reconnect's)
            heartbeat_options(self._chan.sock, self._heartbeat, self._liveness)
        self._exit_with_controller = bool(body.exit_with_controller)
        self._max_message = body.max_message_bytes
        # parts (and messages sent whole) well within the controller's frame limit
        self._peer.max_part = min(MAX_PART, max(CHUNK_BYTES, self._max_message // 2))
        self.call_times = HostCallTimes() if body.host_stats else None
        if body.relay:  # the session moves to a relay, once this drain is over
            asyncio.get_running_loop().call_soon(self._to_relay, body.relay, self._peer)
        FETCHER.open(asyncio.get_running_loop(), lambda name: self.send(P.Import(name)))
        if self._welcome is not None and not self._welcome.done():
            self._welcome.set_result(None)

    def _to_relay(self, relay: str, peer: Peer | None) -> None:
        if (chan := self._chan) and self._ctx and chan.open and peer and self._peer is peer:
            self._watch_link(None)  # (the old socket closes in the move)
            sock = relay_socket(self._ctx, self.connect, relay, self._curve, chan.sock,
                                self._watch_link, (self._heartbeat, self._liveness))
            chan.move(sock, peer)
            if LANE:
                chan._loop.add_reader(socket_fd(chan.sock), self._read)

    def _on_challenge(self, body: P.Challenge, env: Envelope) -> None:
        """The controller's nonce for this session: join with a HELLO that carries it."""
        if self._joined or self._answered:
            self._drop("stale")
            return
        self._answered = True
        data = self.dataplane.endpoint if self.dataplane is not None else ""
        self._send_join_raw(P.Hello(self.name, os.getpid(), self._hostname, self._reported,
                                    body.nonce, data, _versions.local_versions()))

    def _on_reject(self, body: P.Reject, env: Envelope) -> None:
        # retry: the name is in use, or the cluster full, for now: the next JOIN round.
        # full (a new name): a long-running worker waits for a place or the next
        # controller the same way, with back-off; a launched one exits.
        waits = body.retry or (body.full and not self._launched)
        if body.reason != self._refused:  # said once: the next rounds are refused alike
            self._refused = body.reason
            log.log(logging.WARNING if waits else logging.ERROR,
                    "controller %s refused this worker%s: %s%s", self.connect,
                    " for now" * waits, body.reason,
                    "; it waits for a place or for the next controller (retrying)"
                    if waits and not body.retry else "")
        else:
            log.debug("controller %s refused this worker again: %s", self.connect, body.reason)
        if not waits:
            self._end("reject")

    def _on_reset(self, env: Envelope) -> None:
        """The controller declared this session lost: rejoin, or exit if it said so."""
        try:
            body = P.parse(env.kind, env.body)
        except ValueError:
            body = None
        if isinstance(body, P.Reset) and body.reason == P.RESET_EXIT:
            log.warning("controller %s saw this worker's process end (its launcher's "
                        "session is gone): exiting", self.connect)
            self._end("exit")
        else:
            self._end("reset")

    def _on_heartbeat(self, body: P.Heartbeat, env: Envelope) -> None:
        self._ping, self._ping_at = body.ping, time.monotonic_ns()

    def _on_shutdown(self, body: P.Shutdown, env: Envelope) -> None:
        self._end("exit" if body.reason == "exit" else "closed")

    def _on_stats(self, body: P.Stats, env: Envelope) -> None:
        if self.call_times is not None:  # what it counted so far arrives first
            self.send(self._health())
        self.send(P.Result(body.call_id, Status.OK, list(self.store.counts())))

    def present(self, value: Any) -> Any:
        """What user code receives for a stored value (any thread)."""
        return self.arrays.present(value)

