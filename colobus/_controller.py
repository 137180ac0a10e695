"""The controller: one ROUTER socket, the host registry, and a future per call.

Everything that touches the socket or the registry runs on the controller's
event-loop thread. Public entry points that callers use from other threads
(submitting calls, releasing arrays, cancelling) hop onto the loop with
``call_soon_threadsafe``; callers already on the loop act directly.

Lifecycle: ``NEW -> RUNNING -> CLOSED`` (:class:`State`). ``async with`` runs the
controller on the caller's loop; plain ``with`` runs it on a loop thread of its
own.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import functools
import ipaddress
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import zmq

from . import _protocol as P
from ._errors import (
    ColobusError,
    ControllerClosedError,
    HostLostError,
    NoControllerError,
    RemoteError,
)
from ._future import Future
from ._loops import new_event_loop
from ._protocol import Kind
from ._sharding import Device
from ._sockio import readable, recv_frames, send_frames, socket_fd
from ._wire import (
    PROTOCOL_VERSION,
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

__all__ = ["Controller", "HostInfo", "State", "current_controller"]

log = logging.getLogger("colobus.controller")

HELLO_MAX_AGE_S = 300.0
RESET_SEQ = 1 << 62  # sequence number of a RESET: above any a session reaches
RELEASE_DELAY_S = 0.002  # frees wait this long for a message to ride along with


class State(enum.Enum):
    """Controller lifecycle."""

    NEW = "new"
    RUNNING = "running"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class HostInfo:
    """What the controller knows of one host.

    Attributes:
        index: host index (== ``Device.host`` == process index), in join order.
        name: the worker's ``--name`` (stable across rejoins).
        address: the worker's host name as it reported it.
        pid: the worker process id.
        devices: the host's devices, sorted by id.
        state: ``"alive"`` or ``"lost"``.
    """

    index: int
    name: str
    address: str
    pid: int
    devices: tuple[Device, ...]
    state: str


@dataclass(slots=True, eq=False)
class _Host:
    index: int
    name: str
    identity: bytes
    session: bytes
    pid: int
    address: str
    devices: tuple[Device, ...]
    alive: bool = True
    send_seq: int = 0
    recv_seq: int = 0
    last_seen: float = 0.0
    inflight: set[int] = field(default_factory=set)
    outbox: list[Outgoing] = field(default_factory=list)  # not sent yet (see _send)
    code_sent: set[bytes] = field(default_factory=set)
    objects_built: set[int] = field(default_factory=set)
    store: tuple[int, int, int] = (0, 0, 0)  # arrays, bytes, objects, as last reported
    generation: int = 0  # bumps on every (re)join; handles remember the one they saw

    def info(self) -> HostInfo:
        return HostInfo(
            self.index, self.name, self.address, self.pid, self.devices,
            "alive" if self.alive else "lost",
        )

    def lost_error(self, why: str) -> HostLostError:
        return HostLostError(f"Host {self.index} ({self.name!r}) was lost: {why}", self.index)


# What a reply from one host turns into; runs on the loop thread on receipt.
Decoder = Callable[["_Host", P.Result, Envelope], Any]
# Combines the per-host values (by host index) into the future's result.
Combiner = Callable[[dict[int, Any]], Any]


class _Pending:
    """One remote operation spanning one or more hosts."""

    __slots__ = ("combine", "decode", "errors", "future", "outputs", "remaining", "values")

    def __init__(
        self, future: Future[Any], hosts: Iterable[int], decode: Decoder, combine: Combiner
    ) -> None:
        self.future = future
        # The hosts yet to answer, as a bit mask: an int is not tracked by the
        # garbage collector, a set would be (one more object per call in flight).
        remaining = 0
        for i in hosts:
            remaining |= 1 << i
        self.remaining = remaining
        self.values: dict[int, Any] = {}
        self.errors: dict[int, BaseException] = {}
        self.decode = decode
        self.combine = combine
        self.outputs: dict[int, int] = {}  # host -> output leaves it stored (call results)

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

    def settle(self, ctl: Controller) -> None:
        if self.remaining:
            return
        if self.errors:
            for host, n in self.outputs.items():
                ctl.free_outputs(host, self.future.call_id, n)
            first = min(self.errors)
            exc = self.errors[first]
            for other in sorted(self.errors):
                if other != first:
                    err = self.errors[other]
                    exc.add_note(f"host {other} also failed: {type(err).__name__}: {err}")
            self.future.set_exception(exc)
            return
        try:
            result = self.combine(self.values)
        except BaseException as exc:  # a combine error belongs to this call only
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)


def _is_loopback(bind: str) -> bool:
    parts = urlsplit(bind)
    if parts.scheme in ("ipc", "inproc"):
        return True
    host = (parts.hostname or "").strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _rebuild_exception(host: _Host, env: Envelope, meta: Any) -> BaseException:
    type_name, message, tb = "Exception", "", ""
    if isinstance(meta, list) and len(meta) == 3:
        type_name, message, tb = (str(x) for x in meta)
    exc: BaseException
    try:
        exc = loads(env.payload, env.buffers[: env.pbufs])
        if not isinstance(exc, BaseException):
            raise TypeError("not an exception")
    except Exception:
        exc = RemoteError(type_name, message, tb, host.index)
    exc.add_note(f"raised on colobus host {host.index} ({host.name!r})")
    if tb:
        exc.add_note(f"remote traceback (host {host.index}):\n{tb.rstrip()}")
    return exc


_current: list[Controller] = []
_current_lock = threading.Lock()


def current_controller() -> Controller | None:
    """The default controller: the one most recently entered and not yet closed."""
    with _current_lock:
        return _current[-1] if _current else None


class Controller:
    """Binds a ROUTER socket and drives the workers that join it.

    Args:
        bind: ZeroMQ endpoint to bind, e.g. ``"tcp://0.0.0.0:5555"``,
            ``"tcp://127.0.0.1:*"`` (random port) or ``"ipc:///tmp/x.sock"``.
        hosts: how many workers to wait for on entry.
        key: shared secret (``cb.load_key``). Required unless bound to loopback/ipc.
        heartbeat_interval: seconds between heartbeats, both directions.
        liveness_timeout: a host silent this long is declared lost.
        join_timeout: how long entry waits for ``hosts`` workers.
        max_inflight: calls in flight per host before new calls queue here.
        max_backlog: calls queued here (not yet sent) before callers wait: a
            caller on any other thread blocks in the call until the queue is
            shorter; async code on the controller's loop awaits
            :meth:`wait_capacity`. Default: ``max_inflight``.
        max_message_bytes: larger incoming messages are dropped and counted.
        exit_workers_on_close: tell workers to exit (rather than wait for the
            next controller) when this controller closes. ``local_cluster`` sets it.
        curve_secret_key: turn on CurveZMQ encryption with this server key pair:
            the path of a secret key file from ``colobus keygen --curve PATH``,
            or a Z85 secret key. Workers then need ``--server-key PATH.pub``
            and a key pair of their own. The MAC ``key`` is still required
            where it is without encryption. See ``docs/security.md``.
        curve_public_key: the server's Z85 public key; by default derived from
            the secret key.
        curve_allow: the workers allowed to connect (CurveZMQ only): Z85 public
            keys, public key files, or directories of ``*.pub`` files. None
            lets any worker that knows the server's public key finish the
            handshake (its messages must still carry the MAC).

    Raises:
        ValueError: bound to a non-loopback address without a key, or
            ``curve_allow`` given without ``curve_secret_key``.
        AuthenticationError: a CurveZMQ key or key file is not valid.
    """

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:*",
        *,
        hosts: int = 1,
        key: bytes | None = None,
        heartbeat_interval: float = 1.0,
        liveness_timeout: float = 5.0,
        join_timeout: float = 120.0,
        max_inflight: int = 1024,
        max_backlog: int | None = None,
        max_message_bytes: int = 1 << 40,
        exit_workers_on_close: bool = False,
        curve_secret_key: bytes | str | os.PathLike[str] | None = None,
        curve_public_key: bytes | None = None,
        curve_allow: Iterable[bytes | str | os.PathLike[str]] | None = None,
    ) -> None:
        if key is None and not _is_loopback(bind):
            raise ValueError(
                f"Controller bound to {bind!r} (not loopback) refuses to start without a key: "
                "make one with `colobus keygen PATH` and pass key=cb.load_key(PATH); give "
                "workers the same file with --key-file PATH or COLOBUS_KEY_FILE."
            )
        if hosts < 0:
            raise ValueError(f"hosts must be >= 0, got {hosts}")
        self._bind = bind
        self._expected_hosts = hosts
        self._key = key if key is not None else b""
        self.heartbeat_interval = heartbeat_interval
        self.liveness_timeout = liveness_timeout
        self.join_timeout = join_timeout
        self.max_inflight = max_inflight
        self.max_backlog = max_inflight if max_backlog is None else max_backlog
        self.max_message_bytes = max_message_bytes
        self._exit_workers = exit_workers_on_close
        self._curve: tuple[bytes, bytes] | None = None  # (public, secret), Z85
        self._curve_allow: set[bytes] | None = None
        self._auth: Any = None  # zmq.auth.thread.ThreadAuthenticator while running
        if curve_secret_key is not None:
            from ._keys import load_curve_allow, load_curve_keypair

            public, secret = load_curve_keypair(curve_secret_key)
            self._curve = (curve_public_key or public, secret)
            if curve_allow is not None:
                self._curve_allow = load_curve_allow(curve_allow)
        elif curve_allow is not None:
            raise ValueError("curve_allow needs curve_secret_key (the server's key pair)")
        self.state = State.NEW
        self._session = secrets.token_bytes(16)
        self._ctx: zmq.Context[Any] | None = None
        self._sock: zmq.Socket[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread_id: int | None = None
        self._own_thread: threading.Thread | None = None
        self._address = ""
        self._hosts: list[_Host] = []
        self._by_identity: dict[bytes, _Host] = {}
        self._by_name: dict[str, _Host] = {}
        self._dead_sessions: dict[bytes, bytes] = {}  # worker session -> identity
        self._seen_hello: set[bytes] = set()
        self._next_device_id = 0
        self._pending: dict[int, _Pending] = {}
        self._ids = _Counter()
        self._dropped: collections.Counter[str] = collections.Counter()
        self._warned_peers: set[bytes] = set()
        self._counters: collections.Counter[str] = collections.Counter()
        self._backlog: collections.deque[tuple[tuple[int, ...], Callable[[], None]]] = (
            collections.deque()
        )
        self._releases: collections.deque[tuple[int, int, int, int]] = collections.deque()
        self._release_scheduled = False
        self._outbox_hosts: list[_Host] = []  # hosts with messages waiting in their outbox
        self._flush_scheduled = False
        self._corked = False  # inside _drain: its sends leave when it ends
        # Back-pressure: calls submitted but not yet sent (in transit to the loop
        # or in the backlog), guarded by a condition that callers block on.
        self._capacity = threading.Condition()
        self._queued = 0
        self._capacity_waiters: list[Future[None]] = []
        self._join_waiters: list[asyncio.Future[None]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._on_lost: list[Callable[[int], None]] = []
        self._canceller = self._cancel_future  # one bound method, not one per call
        # Keyed by Kind, found by the plain int off the wire (IntEnum hashes as int).
        self._handlers: dict[int, Callable[[_Host, Any, Envelope], None]] = {
            Kind.HEARTBEAT: self._on_heartbeat,
            Kind.RESULT: self._on_result,
        }

    # -- public surface -------------------------------------------------------------

    @property
    def address(self) -> str:
        """The endpoint workers connect to (after start)."""
        return self._address

    def devices(self) -> list[Device]:
        """Devices of the live hosts, sorted by id."""
        return sorted(d for h in self._hosts if h.alive for d in h.devices)

    def hosts(self) -> list[HostInfo]:
        """Every host that ever joined, by index, with its state."""
        return [h.info() for h in self._hosts]

    def stats(self) -> dict[str, Any]:
        """Counters: dropped messages by reason, code blobs sent, per-host store sizes.

        Per-host figures are the ones each worker last reported (every heartbeat,
        or on :meth:`refresh_stats`).
        """
        return {
            "dropped": dict(self._dropped),
            "dropped_total": sum(self._dropped.values()),
            "code_sent": self._counters["code_sent"],
            "calls": self._counters["calls"],
            "batches": self._counters["batches"],
            "batches_received": self._counters["batches_received"],
            "backlog": len(self._backlog),
            "queued": self._queued,
            "pending": len(self._pending),
            "hosts": {
                h.index: {
                    "name": h.name,
                    "state": "alive" if h.alive else "lost",
                    "arrays": h.store[0],
                    "bytes": h.store[1],
                    "objects": h.store[2],
                    "inflight": len(h.inflight),
                }
                for h in self._hosts
            },
        }

    def refresh_stats(self) -> Future[dict[str, Any]]:
        """Ask every live host for its store counters now; resolves to :meth:`stats`."""
        hosts = tuple(h.index for h in self._hosts if h.alive)

        def decode(host: _Host, body: P.Result, env: Envelope) -> None:
            meta = body.meta
            if isinstance(meta, list) and len(meta) == 3:
                host.store = (int(meta[0]), int(meta[1]), int(meta[2]))

        def send(call_id: int) -> None:
            for i in hosts:
                self._send(self._hosts[i], P.Stats(call_id))

        return self.submit(hosts, send, decode, lambda _: self.stats(), backpressure=False)

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the socket and start serving on the running loop; returns once bound."""
        if self.state is not State.NEW:
            raise RuntimeError(f"Controller cannot start: it is {self.state.value}")
        self._loop = asyncio.get_running_loop()
        self._loop_thread_id = threading.get_ident()
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if self.max_message_bytes < (1 << 62):
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        if self._curve is not None:
            self._start_curve(sock)
        try:
            sock.bind(self._bind)
        except zmq.ZMQError as exc:
            sock.close(0)
            self._stop_curve()
            self._ctx.term()
            raise OSError(f"colobus controller cannot bind {self._bind!r}: {exc}") from exc
        self._address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        self._loop.add_reader(socket_fd(sock), self._drain)
        self._tasks.append(self._loop.create_task(self._heartbeat_loop()))
        self.state = State.RUNNING
        log.info("controller listening on %s", self._address)
        self._drain()

    def _start_curve(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CurveZMQ server; a ZAP thread checks the allow-list."""
        from zmq.auth.thread import ThreadAuthenticator

        assert self._curve is not None and self._ctx is not None
        public, secret = self._curve
        allowed = self._curve_allow
        self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger("colobus.auth"))
        self._auth.start()
        if allowed is None:
            self._auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
        else:
            self._auth.configure_curve_callback(domain="*",
                                                credentials_provider=_CurveAllowList(allowed))
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        log.info("CurveZMQ on: server key %s, %s", public.decode(),
                 "any client key" if allowed is None else f"{len(allowed)} allowed client keys")

    def _stop_curve(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    async def wait_for_hosts(self, n: int | None = None, timeout: float | None = None) -> None:
        """Wait until ``n`` hosts (default: ``hosts``) are alive.

        Raises:
            TimeoutError: fewer joined within ``timeout`` (default ``join_timeout``).
        """
        n = self._expected_hosts if n is None else n
        timeout = self.join_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while self._alive_count() < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"only {self._alive_count()} of {n} colobus hosts joined {self._address} "
                    f"within {timeout:.0f} s; start workers with "
                    f"`colobus worker --connect {self._address}`"
                )
            assert self._loop is not None
            waiter = self._loop.create_future()
            self._join_waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, left)
            except TimeoutError:
                pass
            self._check_open()

    def _alive_count(self) -> int:
        return sum(1 for h in self._hosts if h.alive)

    def _check_open(self) -> None:
        if self.state is State.CLOSED:
            raise ControllerClosedError("the colobus controller is closed")

    async def aclose(self) -> None:
        """Close the controller: fail pending calls, tell workers, release the socket."""
        if self.state is State.CLOSED:
            return
        if self.state is State.NEW:
            self.state = State.CLOSED
            return
        self._queue_releases()
        reason = "exit" if self._exit_workers else "controller closed"
        for h in self._hosts:
            if h.alive:
                self._send(h, P.Shutdown(reason))
        self._flush_out()
        self.state = State.CLOSED
        err = ControllerClosedError("the colobus controller closed before this call finished")
        for p in list(self._pending.values()):
            p.future.set_exception(err)
        self._pending.clear()
        self._backlog.clear()
        self._wake_all_waiting()
        for w in self._join_waiters:
            if not w.done():
                w.set_result(None)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        assert self._loop is not None and self._sock is not None and self._ctx is not None
        self._loop.remove_reader(socket_fd(self._sock))
        # Give the SHUTDOWN messages a moment to leave before closing with linger.
        self._sock.setsockopt(zmq.LINGER, 200)
        self._sock.close()
        self._stop_curve()
        self._ctx.term()
        _pop_current(self)
        log.info("controller on %s closed", self._address)

    async def __aenter__(self) -> Controller:
        await self.start()
        try:
            await self.wait_for_hosts()
        except BaseException:
            await self.aclose()
            raise
        _push_current(self)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # -- sync face: the same core on a loop thread of its own ---------------------------

    def start_in_thread(self, timeout: float = 30.0) -> None:
        """Start the controller on a private event-loop thread (the sync face)."""
        loop = new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        self._own_thread = threading.Thread(target=run, name="colobus-controller", daemon=True)
        self._own_thread.start()
        if not ready.wait(timeout):
            raise TimeoutError("colobus controller thread did not start")
        asyncio.run_coroutine_threadsafe(self.start(), loop).result(timeout)

    def run_sync(self, coro: Any, timeout: float | None = None) -> Any:
        """Run a coroutine on the controller's own loop thread and wait for it."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def close(self) -> None:
        """Close a controller started with ``with`` (or from another thread)."""
        loop = self._loop
        if loop is None or (self.state is State.CLOSED and self._own_thread is None):
            self.state = State.CLOSED
            return
        if self._own_thread is None:
            if threading.get_ident() == self._loop_thread_id:
                raise RuntimeError("use `await ctl.aclose()` on the controller's loop")
            asyncio.run_coroutine_threadsafe(self.aclose(), loop).result(30)
            return
        if self.state is not State.CLOSED:
            asyncio.run_coroutine_threadsafe(self.aclose(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        self._own_thread.join(30)
        self._own_thread = None

    def __enter__(self) -> Controller:
        self.start_in_thread()
        try:
            self.run_sync(self.wait_for_hosts())
        except BaseException:
            self.close()
            raise
        _push_current(self)
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- thread hopping --------------------------------------------------------------

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        self._check_open()
        assert self._loop is not None
        return self._loop

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self._loop_thread_id

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop thread: now if already there, else soon."""
        if threading.get_ident() == self._loop_thread_id:
            fn(*args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    # -- the call primitive ------------------------------------------------------------

    def new_future(self, call_id: int = 0) -> Future[Any]:
        return Future(self._loop_thread_id, call_id)

    def next_id(self) -> int:
        return self._ids.next()

    def submit(
        self,
        hosts: Sequence[int],
        send: Callable[[int], None],
        decode: Decoder,
        combine: Combiner,
        *,
        call_id: int | None = None,
        backpressure: bool = True,
        cancellable: bool = False,
    ) -> Future[Any]:
        """Start one remote operation on ``hosts``; thread-safe.

        ``send(call_id)`` runs on the loop thread and sends the messages (it may
        raise, failing only this future); each host's RESULT goes through
        ``decode`` on receipt; once every host answered, ``combine`` builds the
        result from the per-host values. The first error by host index wins.
        """
        self._check_open()
        if backpressure:
            self._take_slot()
        call_id = self.next_id() if call_id is None else call_id
        fut = self.new_future(call_id)
        hosts = tuple(hosts)
        if cancellable:
            fut._set_canceller(self._canceller)
        self.call_soon(self._start_op, call_id, hosts, send, decode, combine, fut, backpressure)
        return fut

    def _start_op(
        self,
        call_id: int,
        hosts: tuple[int, ...],
        send: Callable[[int], None],
        decode: Decoder,
        combine: Combiner,
        fut: Future[Any],
        backpressure: bool,
    ) -> None:
        if fut.done():  # cancelled before it left the caller's thread
            if backpressure:
                self._give_slot()
            return
        if self.state is State.CLOSED:
            fut.set_exception(ControllerClosedError("the colobus controller is closed"))
            return
        if backpressure and (self._backlog or self._full(hosts)):
            go = functools.partial(self._go, call_id, hosts, send, decode, combine, fut,
                                   backpressure)
            self._backlog.append((hosts, go))
            return
        self._go(call_id, hosts, send, decode, combine, fut, backpressure)

    def _go(
        self,
        call_id: int,
        hosts: tuple[int, ...],
        send: Callable[[int], None],
        decode: Decoder,
        combine: Combiner,
        fut: Future[Any],
        backpressure: bool,
    ) -> None:
        """Loop thread: send an operation now (a method, not a closure: fewer objects)."""
        if backpressure:
            self._give_slot()
        if fut.done():
            return
        for i in hosts:
            h = self._hosts[i] if 0 <= i < len(self._hosts) else None
            if h is None or not h.alive:
                who = h.lost_error("it is not alive") if h else HostLostError(
                    f"Host {i} does not exist", i)
                fut.set_exception(who)
                return
        self._pending[call_id] = _Pending(fut, hosts, decode, combine)
        for i in hosts:
            self._hosts[i].inflight.add(call_id)
        try:
            send(call_id)
        except BaseException as exc:
            self._pending.pop(call_id, None)
            for i in hosts:
                self._hosts[i].inflight.discard(call_id)
            fut.set_exception(exc)
            return
        if not hosts:
            self._pending.pop(call_id).settle(self)

    # -- back-pressure --------------------------------------------------------------------

    def _take_slot(self) -> None:
        """Count one call as queued; off the loop thread, first wait for room.

        The controller's own loop thread never blocks here (it is the thread that
        drains the queue); code running there awaits :meth:`wait_capacity`.
        """
        with self._capacity:
            if not self.on_loop_thread():
                while self._queued >= self.max_backlog and self.state is State.RUNNING:
                    self._capacity.wait()
                self._check_open()
            self._queued += 1

    def _give_slot(self) -> None:
        """A queued call left the queue (sent, cancelled or failed); loop thread."""
        with self._capacity:
            self._queued = max(0, self._queued - 1)
            if self._queued >= self.max_backlog:
                return
            self._capacity.notify()
            waiters, self._capacity_waiters = self._capacity_waiters, []
        for w in waiters:
            w.set_result(None)

    def _wake_all_waiting(self) -> None:
        with self._capacity:
            self._queued = 0
            self._capacity.notify_all()
            waiters, self._capacity_waiters = self._capacity_waiters, []
        for w in waiters:
            w.set_result(None)

    async def wait_capacity(self) -> None:
        """Wait until a new call would not queue beyond ``max_backlog``.

        The back-pressure point for async code: calls made on the controller's
        own loop never block, so a loop that fires calls there should ``await
        ctl.wait_capacity()`` before each. Works from any event loop.

        Raises:
            ControllerClosedError: the controller closed.
        """
        while True:
            self._check_open()
            with self._capacity:
                if self._queued < self.max_backlog:
                    return
                waiter: Future[None] = Future()
                self._capacity_waiters.append(waiter)
            await waiter

    def _full(self, hosts: tuple[int, ...]) -> bool:
        limit = self.max_inflight
        hs = self._hosts
        n = len(hs)
        for i in hosts:
            if 0 <= i < n and len(hs[i].inflight) >= limit:
                return True
        return False

    def post(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop thread after every call queued before it was sent."""
        def run() -> None:
            if self._backlog:
                self._backlog.append(((), fn))
            else:
                fn()

        self.call_soon(run)

    def free_outputs(self, host: int, call_id: int, n: int) -> None:
        """Free the outputs a host stored for a call whose result nobody will read."""
        h = self._hosts[host]
        if h.alive:
            self._send(h, P.Release([P.output_ref(call_id, i) for i in range(n)], [call_id]))

    def _pump_backlog(self) -> None:
        while self._backlog:
            hosts, go = self._backlog[0]
            if self._full(hosts):
                return
            self._backlog.popleft()
            go()

    def _cancel_future(self, fut: Future[Any]) -> None:
        """A cancellable operation's Future was cancelled (any thread)."""
        self.call_soon(self._cancel, fut.call_id)

    def _cancel(self, call_id: int) -> None:
        p = self._pending.pop(call_id, None)
        if p is None:
            return
        for i in p.waiting_for():
            h = self._hosts[i]
            if h.alive:
                self._send(h, P.Cancel(call_id))

    def fail_pending(self, call_id: int, exc: BaseException) -> None:
        p = self._pending.pop(call_id, None)
        if p is not None:
            p.future.set_exception(exc)

    # -- host bookkeeping used by the API layers ------------------------------------------

    def host(self, index: int) -> _Host:
        return self._hosts[index]

    def host_generation(self, index: int) -> int:
        return self._hosts[index].generation

    def check_hosts(self, hosts: Iterable[int], generations: dict[int, int] | None = None,
                    what: str = "data") -> None:
        """Raise ``HostLostError`` if a host is lost (or rejoined since ``generations``)."""
        for i in hosts:
            h = self._hosts[i]
            if not h.alive:
                raise h.lost_error(f"its {what} is gone")
            if generations is not None and generations.get(i, h.generation) != h.generation:
                raise h.lost_error(f"it rejoined since, and its {what} is gone")

    def on_host_lost(self, fn: Callable[[int], None]) -> None:
        self._on_lost.append(fn)

    def send_code(self, host: _Host, digest: bytes, code: bytes) -> None:
        """Send a pickled function or class to ``host`` once; later calls name it."""
        if digest in host.code_sent:
            return
        host.code_sent.add(digest)
        self._counters["code_sent"] += 1
        self._send(host, P.Code(digest), code)

    def count(self, name: str, n: int = 1) -> None:
        self._counters[name] += n

    def release(self, host: int, generation: int, ref: int = 0, call: int = 0) -> None:
        """Free an array ref or a call's result tree on a host; thread-safe, batched.

        Safe to call from finalizers on any thread, during interpreter shutdown too.
        """
        if self.state is State.CLOSED:
            return
        try:
            # Through post(): a free must never overtake the PUT (or call) that
            # makes what it frees, which may still be on its way to the loop or
            # queued in the backlog; else the host stores it after the free and
            # keeps it forever (a `device_put(...).delete()` leak).
            self.post(functools.partial(self._queue_release, (host, generation, ref, call)))
        except (RuntimeError, ColobusError):
            pass

    def _queue_release(self, entry: tuple[int, int, int, int]) -> None:
        self._releases.append(entry)
        if not self._release_scheduled and self._loop is not None:
            self._release_scheduled = True
            # Frees are not urgent: they ride along with the next messages sent
            # (see _flush_out), or leave on their own after RELEASE_DELAY_S.
            self._loop.call_later(RELEASE_DELAY_S, self._release_timer)

    def _release_timer(self) -> None:
        self._release_scheduled = False
        if self._releases:
            self._flush_out()
            self._drain()  # the send may have taken the FD's edge: read what waits

    def _queue_releases(self) -> None:
        """Move the queued frees into the hosts' outboxes, one RELEASE per host."""
        per_host: dict[int, tuple[list[int], list[int]]] = {}
        while self._releases:
            host, gen, ref, call = self._releases.popleft()
            h = self._hosts[host]
            if not h.alive or h.generation != gen:
                continue
            refs, calls = per_host.setdefault(host, ([], []))
            if ref:
                refs.append(ref)
            if call:
                calls.append(call)
        for host, (refs, calls) in per_host.items():
            self._enqueue(self._hosts[host], P.Release(refs, calls))

    # -- socket I/O --------------------------------------------------------------------

    def send(self, host: _Host, body: P.Body, payload: Buffer = b"",
             buffers: Sequence[Buffer] = (), pbufs: int = 0) -> None:
        self._send(host, body, payload, buffers, pbufs)

    def _send(self, host: _Host, body: P.Body, payload: Buffer = b"",
              buffers: Sequence[Buffer] = (), pbufs: int = 0) -> None:
        """Queue a message to ``host`` (loop thread); it leaves at the end of this step.

        Messages to one host leave in the order queued. Those queued in one step
        of the loop (a burst of calls from one task, the replies a drain of the
        socket triggers) leave as one BATCH envelope: one MAC, one sequence
        number, one multipart send for all of them.
        """
        if not self._enqueue(host, body, payload, buffers, pbufs):
            return
        if self._corked or self._loop is None or self._flush_scheduled:
            return
        # The first message of a step leaves at once (a lone call waits for nothing);
        # the ones queued after it in the same step leave together when it ends.
        self._flush_scheduled = True
        self._loop.call_soon(self._end_step)
        self._flush_out()

    def _enqueue(self, host: _Host, body: P.Body, payload: Buffer = b"",
                 buffers: Sequence[Buffer] = (), pbufs: int = 0) -> bool:
        """Append a message to ``host``'s outbox; False if the socket is gone.

        Frees queued before it go first: a message never overtakes a free the
        program asked for earlier (a ``refresh_stats()`` after a ``delete()``
        sees the array gone).
        """
        sock = self._sock
        if sock is None or sock.closed:
            return False
        if self._releases:
            self._queue_releases()
        host.outbox.append((body.kind, body.to_wire(), payload, buffers, pbufs))
        if len(host.outbox) == 1:
            self._outbox_hosts.append(host)
        return True

    def _end_step(self) -> None:
        self._flush_scheduled = False
        self._flush_out()
        # The ZeroMQ FD is edge-triggered: a send can consume the edge that
        # announced incoming messages, so read what waits after sending.
        self._drain()

    def _flush_out(self) -> None:
        """Send every host's queued messages (and queued frees): a BATCH where several."""
        if self._releases:
            self._queue_releases()
        hosts, self._outbox_hosts = self._outbox_hosts, []
        sock = self._sock
        for host in hosts:
            items, host.outbox = host.outbox, []
            if sock is None or sock.closed:
                continue
            for env in batched(items, self._session, host.session):
                host.send_seq += 1
                env.seq = host.send_seq
                try:
                    send_frames(sock, [host.identity, *encode(self._key, env)])
                except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer's connection is gone
                    log.debug("send to host %d failed: %s", host.index, exc)
                    break
                if env.kind == Kind.BATCH:
                    self._counters["batches"] += 1

    def _send_raw(self, identity: bytes, receiver: bytes, body: P.Body, seq: int = 1) -> None:
        assert self._sock is not None
        env = Envelope(body.kind, self._session, receiver, seq, body.to_wire())
        try:
            self._sock.send_multipart([identity, *encode(self._key, env)])
        except zmq.ZMQError:
            pass

    def _drain(self) -> None:
        sock = self._sock
        if sock is None or sock.closed:
            return
        corked, self._corked = self._corked, True  # replies' sends leave in batches
        try:
            while True:
                while readable(sock):
                    frames = recv_frames(sock)
                    self._on_frames(frames)
                    if sock.closed:
                        return
                if not self._outbox_hosts:
                    break
                self._flush_out()  # then read again: the sends may have taken the edge
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EAGAIN, zmq.ENOTSOCK):
                log.warning("controller socket error: %s", exc)
        finally:
            self._corked = corked

    def _drop(self, reason: str, identity: bytes, detail: str = "") -> None:
        self._dropped[reason] += 1
        if reason in ("unauthenticated", "version") and identity not in self._warned_peers:
            self._warned_peers.add(identity)
            log.warning(
                "dropping %s messages from peer %s%s (logged once per peer)",
                reason, identity.hex(), f": {detail}" if detail else "",
            )
        else:
            log.debug("dropped message (%s) %s", reason, detail)

    def _on_frames(self, frames: list[Any]) -> None:
        if len(frames) < 2:
            self._dropped["malformed"] += 1
            return
        identity = frames[0].bytes
        try:
            env = decode(self._key, frames[1:], max_payload=self.max_message_bytes)
        except Dropped as d:
            self._drop(d.reason, identity, d.detail)
            return
        try:
            if env.kind == Kind.HELLO:
                self._on_hello(identity, env)
                return
            host = self._by_identity.get(identity)
            if host is None or env.sender != host.session:
                if env.sender in self._dead_sessions:
                    self._drop("stale", identity)
                    # The last word of that session: a sequence number above any the
                    # worker has seen from us, or it would drop the RESET as a replay.
                    self._send_raw(identity, env.sender, P.Reset("declared lost; join again"),
                                   seq=RESET_SEQ)
                else:
                    self._drop("unknown_peer", identity)
                return
            if env.receiver != self._session:
                self._drop("stale", identity)
                return
            if env.seq <= host.recv_seq:
                self._drop("replay", identity)
                return
            if env.version != PROTOCOL_VERSION:
                self._drop("version", identity)
                return
            host.recv_seq = env.seq
            host.last_seen = time.monotonic()
            if env.kind != Kind.BATCH:
                self._dispatch(host, identity, env)
                return
            subs = unpack_batch(env)
            self._counters["batches_received"] += 1
        except Dropped as d:
            self._drop(d.reason, identity, d.detail)
            return
        except ValueError as exc:
            self._drop("malformed", identity, str(exc))
            return
        except Exception:  # a bug in a handler must not kill the reader
            self._dropped["handler_error"] += 1
            log.exception("error handling a message from %s", identity.hex())
            return
        for sub in subs:
            self._dispatch(host, identity, sub)

    def _dispatch(self, host: _Host, identity: bytes, env: Envelope) -> None:
        """Handle one authenticated message of a joined host."""
        try:
            body = P.parse(env.kind, env.body)
            handler = self._handlers.get(env.kind)
            if handler is None:
                self._drop("unexpected_kind", identity, Kind(env.kind).name)
                return
            handler(host, body, env)
        except ValueError as exc:
            self._drop("malformed", identity, str(exc))
        except Exception:  # a bug in a handler must not kill the reader
            self._dropped["handler_error"] += 1
            log.exception("error handling a message from %s", identity.hex())

    # -- handlers ------------------------------------------------------------------------

    def _on_hello(self, identity: bytes, env: Envelope) -> None:
        if env.version != PROTOCOL_VERSION:
            self._drop("version", identity, f"peer speaks protocol {env.version}")
            self._send_raw(identity, env.sender, P.Reject(
                f"protocol version mismatch: worker speaks {env.version}, controller speaks "
                f"{PROTOCOL_VERSION}; install the same colobus version on both sides"))
            return
        hello = P.parse(env.kind, env.body)
        assert isinstance(hello, P.Hello)
        current = self._by_identity.get(identity)
        if current is not None and current.session == env.sender:
            return  # a HELLO the worker resent while ours was on its way: already joined
        if env.sender in self._seen_hello or abs(time.time() - hello.time) > HELLO_MAX_AGE_S:
            self._drop("replay", identity, "old hello")
            return
        if self.state is not State.RUNNING:
            return
        self._seen_hello.add(env.sender)
        devices_raw = hello.devices
        if not all(isinstance(d, list) and len(d) == 3 for d in devices_raw):
            raise ValueError("bad device list")
        old = self._by_name.get(hello.name)
        if old is not None:
            if old.alive:
                self._lose(old, "it re-registered (the worker restarted)")
            index = old.index
            ids = [d.id for d in old.devices]
            if len(ids) != len(devices_raw):
                ids = self._new_device_ids(len(devices_raw))
            generation = old.generation + 1
        else:
            index = len(self._hosts)
            ids = self._new_device_ids(len(devices_raw))
            generation = 0
        devices = tuple(
            Device(id=gid, host=index, platform=str(p), device_kind=str(k), local_id=int(lid))
            for gid, (p, k, lid) in zip(ids, devices_raw, strict=True)
        )
        host = _Host(
            index=index, name=hello.name, identity=identity, session=env.sender,
            pid=hello.pid, address=hello.hostname, devices=tuple(sorted(devices)),
            recv_seq=env.seq, last_seen=time.monotonic(), generation=generation,
        )
        if old is not None:
            self._hosts[index] = host
        else:
            self._hosts.append(host)
        self._by_name[hello.name] = host
        self._by_identity[identity] = host
        self._send(host, P.Welcome(index, [d.id for d in devices], self.heartbeat_interval,
                                   self.liveness_timeout, self._exit_workers))
        kinds = collections.Counter(d.platform for d in devices)
        log.info(
            "host %d %s: %r (pid %d on %s) with %s [%d/%d alive]",
            index, "rejoined" if old else "joined", hello.name, hello.pid, hello.hostname,
            ", ".join(f"{n} {p}" for p, n in sorted(kinds.items())) or "no devices",
            self._alive_count(), self._expected_hosts,
        )
        for w in self._join_waiters:
            if not w.done():
                w.set_result(None)
        self._join_waiters.clear()

    def _new_device_ids(self, n: int) -> list[int]:
        ids = list(range(self._next_device_id, self._next_device_id + n))
        self._next_device_id += n
        return ids

    def _on_heartbeat(self, host: _Host, body: P.Heartbeat, env: Envelope) -> None:
        host.store = (body.arrays, body.nbytes, body.objects)

    def _on_result(self, host: _Host, body: P.Result, env: Envelope) -> None:
        call_id = body.call_id
        host.inflight.discard(call_id)
        p = self._pending.get(call_id)
        ok_outputs = body.status == P.Status.OK and type(body.meta) is int
        if p is None or not p.waits_for(host.index):
            if ok_outputs:  # cancelled, failed or lost: nobody will hold these
                self.free_outputs(host.index, call_id, body.meta)
        else:
            p.remaining &= ~(1 << host.index)
            if ok_outputs:
                p.outputs[host.index] = body.meta
            try:
                if body.status == P.Status.OK:
                    p.values[host.index] = p.decode(host, body, env)
                elif body.status == P.Status.CANCELLED:
                    p.errors[host.index] = asyncio.CancelledError()
                else:
                    p.errors[host.index] = _rebuild_exception(host, env, body.meta)
            except BaseException as exc:
                p.errors[host.index] = exc
            if not p.remaining:
                del self._pending[call_id]
                p.settle(self)
        if self._backlog:
            self._pump_backlog()

    # -- liveness ------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            # Read what already arrived before judging silence: a loop that was busy
            # (a large pickle, a GC pause) must not declare live hosts lost.
            self._drain()
            now = time.monotonic()
            for h in self._hosts:
                if not h.alive:
                    continue
                silent = now - h.last_seen
                if silent > self.liveness_timeout:
                    self._lose(h, f"no message for {silent:.1f} s")
                else:
                    self._send(h, P.Heartbeat(0, 0, 0))

    def _lose(self, host: _Host, why: str) -> None:
        if not host.alive:
            return
        host.alive = False
        self._dead_sessions[host.session] = host.identity
        self._by_identity.pop(host.identity, None)
        log.warning("host %d (%r) lost: %s", host.index, host.name, why)
        exc_text = why
        for call_id in sorted(host.inflight):
            p = self._pending.pop(call_id, None)
            if p is not None:
                # The other hosts still answer; their result slots are freed then.
                p.future.set_exception(host.lost_error(exc_text))
        host.inflight.clear()
        # Queued calls for that host fail when they are started (go() checks).
        for fn in self._on_lost:
            try:
                fn(host.index)
            except Exception:
                log.exception("host-lost callback failed")
        self._pump_backlog()

    def lose_host_for_test(self, index: int) -> None:
        """Declare a host lost now (tests and operators)."""
        self.call_soon(self._lose, self._hosts[index], "declared lost by the controller")


class _CurveAllowList:
    """ZAP credentials provider: a CurveZMQ client key must be on the list."""

    def __init__(self, allowed: set[bytes]) -> None:
        self.allowed = allowed
        self.refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.allowed
        if not ok and key not in self.refused:  # it retries: log each key once
            self.refused.add(key)
            log.warning("refused a CurveZMQ client with key %s (not in curve_allow)",
                        key.decode(errors="replace"))
        return ok


class _Counter:
    """A thread-safe increasing id source (itertools.count is atomic under the GIL)."""

    def __init__(self) -> None:
        import itertools

        self._it = itertools.count(1)

    def next(self) -> int:
        return next(self._it)


def _push_current(ctl: Controller) -> None:
    with _current_lock:
        _current.append(ctl)


def _pop_current(ctl: Controller) -> None:
    with _current_lock:
        if ctl in _current:
            _current.remove(ctl)


def default_controller() -> Controller:
    """The default controller, or ``NoControllerError`` saying how to start one."""
    ctl = current_controller()
    if ctl is None or ctl.state is not State.RUNNING:
        raise NoControllerError()
    return ctl
