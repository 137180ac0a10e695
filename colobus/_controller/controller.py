"""The controller: binds one ROUTER socket and drives the workers that join it.

:class:`Controller` is the public facade over the parts that do the work (the
channel, the host registry, the operations, the frees, the sessions, the sync
face: see ``docs/architecture.md``). Everything that touches the socket or the
registry runs on the controller's event-loop thread; callers on other threads
hop there with ``call_soon_threadsafe``. Lifecycle: ``NEW -> RUNNING -> CLOSED``.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import secrets
import threading
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from .._errors import ControllerClosedError
from .._model.devices import Device
from .._observe.metrics import observing, stop_observing
from .._process import freeze_once, quick_loop
from .._wire import keys as _keys
from .._wire import protocol as P
from .._wire.channel import DEFAULT_MAX_WINDOW
from .._wire.envelope import Buffer
from .._wire.fanout import FanoutChannel
from .._wire.links import heartbeat_options
from .._wire.sockio import router_socket
from .._wire.tasks import supervise
from . import wakeups
from .codeship import DEFAULT_MAX_CODE_BYTES, CodeShipper, Secrets
from .current import Current, State, no_controller_error
from .environ import from_environment, from_environment_modules, launched_here
from .frees import Frees
from .future import Future
from .hangups import Hangups
from .hosts import Host, HostInfo, HostRegistry
from .inbox import Inbox
from .jobview import choose_view
from .joinwait import JoinProgress, JoinWaiters, key_words
from .ops import Operations
from .relays import Relays
from .sessions import Sessions
from .stats import collect_stats, refresh_stats, scrape_stats
from .syncface import LoopThread, SyncFace
from .uploads import DEFAULT_MAX_QUEUED_BYTES, Uploads

__all__ = ["Controller", "HostInfo", "State", "current_controller"]

log = logging.getLogger("colobus.controller")

DEFAULT_MAX_MESSAGE_BYTES = 1 << 31  # 2 GiB: raise with Controller(max_message_bytes=...)

_current: Current[Controller] = Current()


def current_controller() -> Controller | None:
    """The default controller: the one most recently entered and not yet closed."""
    return _current.top()


class Controller(SyncFace):
    """Binds a ROUTER socket and drives the workers that join it.

    Args:
        bind: ZeroMQ endpoint to bind, e.g. ``"tcp://0.0.0.0:5555"``, ``"ipc:///tmp/x.sock"``.
            None: ``$COLOBUS_ADDRESS`` (``colobus launch``), else ``"tcp://127.0.0.1:*"``.
        hosts: the cluster's size: entry waits for this many workers, and no more are
            alive at once (a new name beyond it is refused; 0: no bound). None:
            ``$COLOBUS_HOSTS``, else 1.
        key: shared secret of at least 32 bytes (``cb.load_key``). None: the file
            ``$COLOBUS_KEY_FILE`` names, else a fresh one, written on start to a private
            0600 file, :attr:`key_file`, for ``colobus worker --key-file``.
        heartbeat_interval: seconds between heartbeats, both directions.
        liveness_timeout: a host silent this long is declared lost.
        join_timeout: how long entry waits for ``hosts`` workers.
        max_inflight: calls in flight per host before new calls queue here.
        max_backlog: calls queued here (not yet sent) before callers wait: a plain thread
            blocks in the call; code on an event loop awaits :meth:`wait_capacity`.
            Default: ``max_inflight``.
        max_message_bytes: larger incoming messages (all frames together) are
            dropped and counted; workers refuse to send larger replies and fail
            the call instead. Default 2 GiB; raise it to fetch larger host blocks.
        send_window_bytes: the most bytes sent to one host and not yet
            acknowledged (the window adapts below it to the link); default 16 MiB.
        max_queued_bytes: a ``device_put`` to a host the controller holds this many bytes
            for (queued or unacknowledged) waits like a call at ``max_backlog``; 64 MiB.
        exit_workers_on_close: tell workers to exit (rather than wait for the
            next controller) when this controller closes. ``local_cluster`` sets it.
        curve_secret_key: turn on CurveZMQ encryption with this server key pair:
            the path of a secret key file from ``colobus keygen --curve PATH``
            (files only: a secret never travels as a value). Workers then need
            ``--server-key PATH.pub`` and a key pair of their own (docs/security.md).
        curve_public_key: the server's Z85 public key (default: derived from the secret key).
        curve_allow: the workers allowed (CurveZMQ): Z85 public keys, key files, or dirs of them.
        metrics: serve Prometheus metrics at ``http://HOST:PORT/metrics`` (``"127.0.0.1:9464"``;
            port 0 picks a free one, see :attr:`metrics_url`); needs ``prometheus_client``.
        metrics_public: allow a ``metrics`` address that is not loopback (the
            endpoint has no authentication). See ``docs/observability.md``.
        trace: record where each colocated call spends its time (``fut.timings()``): True,
            or a path to write a Chrome trace (Perfetto) JSON file to on close (and on
            :meth:`write_trace`); OpenTelemetry spans too where it is importable.
        freeze_gc: on the first start in this process, a full garbage collection and
            ``gc.freeze()`` of what is alive (JAX's ~100k objects), so collections during
            calls stop walking them (about 15 % of a pipelined call's controller CPU).
        broadcast_tree: a ``device_put`` block of 1 MiB or more that this many hosts or more
            hold the same goes down a tree of them (each serves it to two), leaving the
            controller twice; 0 turns trees off (``docs/moving_arrays.md``, "Broadcast trees").
        relays: relay processes carrying the hosts' sessions (one message per relay per
            call, not per host). None: ``$COLOBUS_RELAYS``, else by ``hosts=``: none below
            ``relay_threshold`` (0: never), one per 256 hosts above (docs/architecture.md).
        relay_key: a key (not ``key``) that relays on other machines (``colobus relay
            --connect``) prove to carry hosts; None: none is taken (docs/deployment.md).
        py_modules: modules or paths (package dirs, ``.py`` files) shipped to hosts too (None:
            ``$COLOBUS_PY_MODULES``); ``ship_code=False``: only those, not your modules calls
            need; ``max_code_bytes``: the most one session ships. docs/deployment.md.
        jax_distributed: the view host code runs (docs/jax_job.md): None (the default, or
            ``$COLOBUS_JAX_DISTRIBUTED``) a JAX job where ``hosts`` > 1 and it can form, else
            the block view, said in a log line; True: the job or an error; False: blocks.

    Raises:
        ValueError: ``curve_allow`` given without ``curve_secret_key``, ``metrics`` not
            loopback without ``metrics_public``, a ``py_modules`` entry is no module, or
            ``jax_distributed`` without a cluster size (``hosts=N``).
        SerializationError: the ``py_modules`` pass ``max_code_bytes``.
        ImportError: ``metrics`` given but ``prometheus_client`` is missing.
        AuthenticationError: ``key`` is shorter than 32 bytes, or a CurveZMQ key
            file is not valid.
    """

    def __init__(
        self,
        bind: str | None = None,
        *,
        hosts: int | None = None,
        key: bytes | None = None,
        heartbeat_interval: float = 1.0,
        liveness_timeout: float = 5.0,
        join_timeout: float = 120.0,
        max_inflight: int = 1024,
        max_backlog: int | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        send_window_bytes: int = DEFAULT_MAX_WINDOW,
        max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
        exit_workers_on_close: bool = False,
        curve_secret_key: str | os.PathLike[str] | None = None,
        curve_public_key: bytes | None = None,
        curve_allow: Iterable[bytes | str | os.PathLike[str]] | None = None,
        metrics: str | None = None,
        metrics_public: bool = False,
        trace: bool | str | os.PathLike[str] | None = None,
        freeze_gc: bool = True,
        broadcast_tree: int = 8,
        relays: int | None = None,
        relay_threshold: int = 128,
        relay_key: bytes | None = None,
        py_modules: Iterable[Any] | None = None,
        ship_code: bool = True,
        max_code_bytes: int = DEFAULT_MAX_CODE_BYTES,
        jax_distributed: bool | None = None,
    ) -> None:
        bind, hosts, key, names = from_environment(bind, hosts, key)  # colobus launch's
        if key is not None:
            key = _keys.check_key(key, "Controller(key=...)")
        if hosts < 0:
            raise ValueError(f"hosts must be >= 0, got {hosts}")
        self._bind = bind
        self._freeze_gc = freeze_gc
        self._expected_hosts = hosts
        self._key = key if key is not None else _keys.generate_key()
        self._write_key_file = key is None
        self.key_file: str | None = None  # where a generated key was written (on start)
        self.heartbeat_interval = heartbeat_interval
        self.liveness_timeout = liveness_timeout
        self.join_timeout = join_timeout
        self.max_message_bytes = max_message_bytes
        self.send_window_bytes = send_window_bytes
        self.broadcast_tree = broadcast_tree
        self._exit_workers = exit_workers_on_close
        # A message unacknowledged this long is sent again (a dropped connection).
        self._resend_after = max(2 * heartbeat_interval, liveness_timeout / 3)
        # A host whose connection closed must be heard from sooner (see _hangups).
        self._hangup_grace = min(liveness_timeout, max(liveness_timeout / 2,
                                                       2 * heartbeat_interval))
        self._hangups: Hangups | None = None
        # (public, secret) Z85 and the allowed workers' keys, when CurveZMQ is on
        self._curve, self._curve_allow = _keys.curve_server_config(
            curve_secret_key, curve_public_key, curve_allow)
        self._shipper = CodeShipper(from_environment_modules(py_modules), ship_code, max_code_bytes,
                                    Secrets.of_keys(self._key, curve_secret_key, self._curve))
        self._auth: Any = None  # zmq.auth.thread.ThreadAuthenticator while running
        self._relays = Relays.configure(self, relays, relay_threshold, hosts, relay_key)
        self.state, self._closed = State.NEW, False  # (_closed: a plain read per call)
        # Metrics and traces (None when both are off: one check per call site).
        self.observer, self._metrics, self._trace = observing(
            metrics, metrics_public, trace, functools.partial(scrape_stats, self))
        self._session = secrets.token_bytes(16)
        self._ctx: zmq.Context[Any] | None = None
        self._chan: FanoutChannel | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread_id: int | None = None
        self._inbox: Inbox | None = None
        self._own_thread: LoopThread | None = None
        self._address = ""
        self._hosts = HostRegistry()
        self._ops = Operations(self, max_inflight,
                               max_inflight if max_backlog is None else max_backlog)
        self._uploads = Uploads(self, max_queued_bytes)
        self._counters: collections.Counter[str] = collections.Counter()
        self._frees = Frees(self)
        self._join_waiters = JoinWaiters()
        self._joined = self._join_waiters.wake  # a host joined: wake those waiting
        self._tasks: list[asyncio.Task[None]] = []
        self._closing: asyncio.Task[None] | None = None  # a close begun on the loop thread
        self._close_reason: str | None = None  # why it closed, when not by the user
        self._sessions = Sessions(self)
        self._sessions.number_by_name = list(names) if names else None  # colobus launch
        # the view host code runs: the cluster's JAX job (the global view), or blocks
        self._job = choose_view(self, jax_distributed, hosts)
        self._job_off: dict[str, Any] | None = None  # a job that fell back, and why

    def __repr__(self) -> str:
        return f"<colobus.Controller {self._address or self._bind} {self.state.value}>"

    # -- public surface -------------------------------------------------------------

    @property
    def metrics_url(self) -> str | None:
        """Where the Prometheus metrics are served (after start), or None if off."""
        return (self._metrics.url or None) if self._metrics is not None else None

    def write_trace(self, path: str | os.PathLike[str] | None = None) -> str:
        """Write the calls settled so far as Chrome trace JSON; returns the path.

        Args:
            path: where to write; default the ``trace=`` path.

        Raises:
            ValueError: tracing is off, or no path was given either way.
        """
        if self._trace is None:
            raise ValueError("tracing is off: start the controller with trace=True or trace=PATH")
        return self._trace.write(path)

    @property
    def address(self) -> str:
        """The endpoint workers connect to (after start)."""
        return self._address

    max_inflight = property(lambda self: self._ops.max_inflight)
    max_backlog = property(lambda self: self._ops.max_backlog)

    def devices(self) -> list[Device]:
        """Devices of the live hosts, sorted by id."""
        return self._hosts.devices()

    def hosts(self) -> list[HostInfo]:
        """Every host that ever joined (or was numbered by name), by index, with its state."""
        return [h.info() for h in self._hosts.hosts]

    def stats(self) -> dict[str, Any]:
        """Counters: dropped messages by reason, code blobs and bytes sent (your packages too:
        ``packages_sent``, ``package_bytes``), array bytes put, relayed by hosts
        (``bytes_relayed``) and fetched, and per host its store and health:
        what each worker last reported (every heartbeat, or on :meth:`refresh_stats`):
        ``arrays``, ``bytes`` and ``objects`` it holds, and ``results``, the call results it
        keeps for futures still alive; from its heartbeats only, ``rtt`` (heartbeat round
        trip, s), ``rss`` (bytes), ``cpu`` (s), ``dropped``, ``threads`` and ``stuck`` (its call
        pool's threads, and those busy with calls of an ended session), ``code`` and
        ``code_bytes`` (the functions and classes it holds, and their size); ``relays``: each
        relay's ``pid``, ``hosts`` (indices), ``forwards`` and ``ups`` (its messages)."""
        return {**collect_stats(self._sessions, self._counters, self._chan, self._ops,
                                self._hosts, self._uploads),
                "relays": self._relays.describe() if self._relays is not None else [],
                "jax_job": self._job.describe() if self._job is not None else self._job_off}

    def refresh_stats(self) -> Future[dict[str, Any]]:
        """Ask every live host for its store counters now; resolves to :meth:`stats`.

        With metrics or tracing on, each host first sends the call times it counted since
        its last heartbeat: the histograms are exact once this resolves.
        """
        return refresh_stats(self._ops, self._hosts, self._send, self.stats)

    async def wait_capacity(self) -> None:
        """Wait until a new call would not queue beyond ``max_backlog``, and no live host
        has ``max_queued_bytes`` queued for it.

        The back-pressure point for async code: calls and ``device_put`` on an event loop
        never block, so a loop that fires them should ``await ctl.wait_capacity()`` first.

        Raises:
            ControllerClosedError: the controller closed.
        """
        await self._ops.wait_capacity()
        await self._uploads.wait_room()

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the socket and start serving on the running loop; returns once bound."""
        if self.state is not State.NEW:
            raise RuntimeError(f"Controller cannot start: it is {self.state.value}")
        self._loop = quick_loop(asyncio.get_running_loop())
        self._loop_thread_id = threading.get_ident()
        self._inbox = Inbox(self._loop)  # what other threads hand the loop, per burst
        if self._freeze_gc:
            freeze_once()
        if self._metrics is not None:
            self._metrics.start()
        self._ctx = zmq.Context()
        sock = router_socket(self._ctx, self.max_message_bytes)
        # Liveness in libzmq's I/O thread, not in this loop (colobus._wire.links).
        heartbeat_options(sock, self.heartbeat_interval, self.liveness_timeout)
        if self._curve is not None:
            from .._wire.keys import start_curve_server

            self._auth = start_curve_server(self._ctx, sock, *self._curve, self._curve_allow)
        try:
            sock.bind(self._bind)
        except zmq.ZMQError as exc:
            sock.close(0)
            self._stop_curve()
            self._ctx.term()
            self.state, self._closed = State.CLOSED, True
            stop_observing(self._metrics, self._trace)
            raise OSError(f"colobus controller cannot bind {self._bind!r}: {exc}") from exc
        self._address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._chan = FanoutChannel(sock, self._key, self._loop, self._sessions.reader,
                             before_flush=self._frees.move_to_outboxes,
                             on_release=self._uploads.on_release,
                             before_drain=wakeups.drain_starts,
                             after_reads=wakeups.drain_reads_done,
                             after_drain=wakeups.drain_ends)
        self._hangups = Hangups(sock, self._loop, self._hangup_grace, self._sessions.lose)
        self._tasks.append(supervise(self._loop.create_task(self._sessions.liveness()),
                                     "the liveness loop", self._die))
        self.state = State.RUNNING
        if self._job is not None:  # nothing reaches a host before the job formed
            self._job.started()
        log.info("controller listening on %s (%s)", self._address, key_words(self._key))
        if self._relays is not None:
            await self._relays.start()
        if self._write_key_file:
            self.key_file = _keys.announce_private_key(self._key, self._address)
        self._chan.drain()

    def _stop_curve(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    async def wait_for_hosts(self, n: int | None = None, timeout: float | None = None) -> None:
        """Wait until ``n`` hosts (default: ``hosts``) are alive; with
        ``jax_distributed``, also until the cluster's JAX job formed (again).

        Raises:
            TimeoutError: fewer joined within ``timeout`` (default ``join_timeout``), or
                the JAX job did not form within it.
            RuntimeError: the JAX job could not form (a host's error says why).
        """
        n = self._expected_hosts if n is None else n
        assert self._loop is not None
        timeout = self.join_timeout if timeout is None else timeout
        deadline = self._loop.time() + timeout
        await self._join_waiters.wait(self._loop, n, self._hosts.alive_count, JoinProgress(
            self._address, self._key, n, self._hosts.missing_names,
            launched_here(self._bind)), timeout, self._check_open)
        if self._job is not None and n >= self._expected_hosts:
            await self._job.wait_formed(max(0.0, deadline - self._loop.time()))
            self._check_open()

    async def aclose(self) -> None:
        """Close: every pending or queued call ends with ``ControllerClosedError``,
        workers are told, the socket is released. Idempotent."""
        if self.state is State.CLOSED:
            return
        if self.state is State.NEW:
            self.state, self._closed = State.CLOSED, True
            return
        chan = self._chan
        assert chan is not None and self._ctx is not None
        reason = "exit" if self._exit_workers else "controller closed"
        if self._hangups is not None:  # the hosts are told to go: their closes are no news
            self._hangups.close()
        for h in self._hosts.alive():
            self._send(h, P.Shutdown(reason))
        chan.flush()
        self.state, self._closed = State.CLOSED, True
        if self._job is not None:
            self._job.close()
        self._ops.close(self._close_reason)
        self._uploads.on_release()
        self._join_waiters.wake()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._relays is not None:  # they deliver what they were sent, then exit
            await self._relays.aclose()
        chan.close(linger_ms=200)  # a moment for the SHUTDOWN messages to leave
        self._stop_curve()
        self._ctx.term()
        if self.key_file is not None:
            _keys.remove_private_key(self.key_file)
        _pop_current(self)
        stop_observing(self._metrics, self._trace)
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

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- sync face (start_in_thread, run_sync, close: colobus._controller.syncface) ------

    def __enter__(self) -> Controller:
        self.start_in_thread()
        try:
            self.run_sync(self.wait_for_hosts())
        except BaseException:
            self.close()
            raise
        _push_current(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals the API layers use (package-private) -------------------------------------

    def _set_closed(self) -> None:
        self.state, self._closed = State.CLOSED, True

    def _check_open(self) -> None:
        if self.state is State.CLOSED:
            why = self._close_reason
            raise ControllerClosedError("the colobus controller is closed" + (
                f" ({why})" if why else ""))

    def _on_loop_thread(self) -> bool:
        return threading.get_ident() == self._loop_thread_id

    def _call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop thread: now if already there, else soon."""
        if threading.get_ident() == self._loop_thread_id:
            fn(*args)
            return
        if self._closed:
            self._check_open()  # (raises)
        assert self._inbox is not None
        try:
            self._inbox.post(fn, *args)
        except RuntimeError:  # the loop closed under us
            raise ControllerClosedError("the colobus controller is closed") from None

    def _send(self, host: Host, body: P.Body, payload: Buffer = b"",
              buffers: Any = (), pbufs: int = 0) -> None:
        """Queue a message to a live host (loop thread); see :meth:`Channel.send`."""
        chan = self._chan
        if chan is not None and host.alive:
            chan.send(host.peer, body, payload, buffers, pbufs)

    def _count(self, name: str, n: int = 1) -> None:
        self._counters[name] += n

    def _declare_lost(self, index: int, why: str = "declared lost by the controller") -> None:
        """Declare a host lost now (a local cluster whose worker process died; tests)."""
        self._call_soon(self._sessions.lose, self._hosts[index], why)

    def _die(self, why: str) -> None:
        """A background task died: close, every call failing with ``why``."""
        self._close_reason = why
        if self.state is State.RUNNING and self._loop is not None:
            self._closing = self._loop.create_task(self.aclose())


_push_current = _current.push
_pop_current = _current.pop


def default_controller() -> Controller:
    """The default controller, or ``NoControllerError`` saying how to start one."""
    ctl = current_controller()
    if ctl is None or ctl.state is not State.RUNNING:
        raise no_controller_error(ctl if ctl is not None else _current.left_last())
    return ctl
