"""Why a worker has not joined yet: it probes the endpoint and says so in one line.

A worker sends HELLO and waits for WELCOME. The controller answers a HELLO it
cannot authenticate with nothing at all (nothing it could be tricked by), so
silence alone cannot tell a wrong key from a wrong address. A few seconds into
the wait, :class:`JoinDiagnosis` looks closer: does the name resolve, does
anything listen at that port (a plain TCP connect) or socket path; if something
does, the likely causes left are a wrong key or a wrong address (unless the
controller answered with a CHALLENGE, which only the right key opens: then the
key and address are right and it says so instead). It logs that
at WARNING (the default level shows it), again every ``REPEAT_S`` while the
wait goes on; a worker that already joined once logs it at INFO (its driver
went away, and waiting for the next is normal).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from .._wire.endpoint import Endpoint
from .._wire.keys import key_id
from .._wire.links import heartbeat_options

__all__ = ["RECONNECT_MAX_S", "JoinDiagnosis", "probe", "session_socket"]

# ZeroMQ's TCP reconnects back off to at most this: a dropped connection is back well
# within the half liveness timeout a host whose connection closed has to be heard again.
RECONNECT_MAX_S = 0.5

log = logging.getLogger("colobus.worker")

FIRST_AFTER_S = 2.0
REPEAT_S = 30.0
PROBE_TIMEOUT_S = 2.0


async def probe(endpoint: Endpoint) -> str | None:
    """What keeps ``endpoint`` from answering, or None if something listens there."""
    if endpoint.transport == "ipc":
        path = endpoint.host
        if not os.path.exists(path):
            return f"nothing listening at {path} (no such socket): is the driver running?"
        return None
    host, port = endpoint.host, endpoint.port
    try:
        infos = await asyncio.wait_for(_resolve(host, port), PROBE_TIMEOUT_S)
    except socket.gaierror as exc:
        return f"cannot resolve {host!r} ({exc.strerror}): is the driver's host name right?"
    except TimeoutError:
        return f"cannot resolve {host!r} (no answer from DNS within {PROBE_TIMEOUT_S:.0f} s)"
    address = infos[0][4][0]
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(address, port),
                                           PROBE_TIMEOUT_S)
    except ConnectionRefusedError:
        return (f"nothing listening on {host}:{port} (connection refused): is the driver "
                "running and bound to that port?")
    except TimeoutError:
        return (f"no answer from {host}:{port} within {PROBE_TIMEOUT_S:.0f} s: a firewall, "
                "or a wrong address?")
    except OSError as exc:
        return f"cannot reach {host}:{port} ({exc.strerror or exc})"
    writer.close()
    return None


def _resolve(host: str, port: int) -> asyncio.Future[list[Any]]:
    """``getaddrinfo`` on a daemon thread of its own.

    Not the loop's default executor: a lookup that hangs (DNS gone) would hold
    up the end of ``asyncio.run``, which waits for that executor's threads.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[list[Any]] = loop.create_future()

    def settle(result: list[Any] | None, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result or [])

    def lookup() -> None:
        try:
            infos: list[Any] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            outcome: tuple[list[Any] | None, BaseException | None] = (None, exc)
        else:
            outcome = (infos, None)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=lookup, name="colobus-resolve", daemon=True).start()
    return fut


class JoinDiagnosis:
    """Says, while a worker waits for WELCOME, what is most likely wrong.

    Args:
        endpoint: where the worker connects.
        key: the worker's key (only its :func:`~colobus._wire.keys.key_id` is shown).
        curve: CurveZMQ is on (a wrong server key is then one more cause).
        quiet: log at INFO, not WARNING (the worker joined a driver before).
    """

    def __init__(self, endpoint: Endpoint, key: bytes, *, curve: bool, quiet: bool) -> None:
        self._endpoint = endpoint
        self._key_id = key_id(key)
        self._curve = curve
        self._level = logging.INFO if quiet else logging.WARNING
        self._start = time.monotonic()
        self._next = self._start + FIRST_AFTER_S
        self.tries = 0
        self.answered = False  # the controller challenged us: our key is its key
        self.last: str | None = None
        self._probe: asyncio.Task[None] | None = None

    def after_hello(self, answered: bool = False) -> None:
        """Count one join round (``answered``: the controller's authenticated CHALLENGE
        came, so key and address are right); when due, probe (in the background) and
        log what is wrong."""
        self.tries += 1
        self.answered = self.answered or answered
        now = time.monotonic()
        if now < self._next or (self._probe is not None and not self._probe.done()):
            return
        self._next = now + REPEAT_S
        self._probe = asyncio.get_running_loop().create_task(self._report(now))

    def close(self) -> None:
        """The wait is over (joined, or the worker exits): stop a probe in flight."""
        if self._probe is not None:
            self._probe.cancel()

    async def _report(self, now: float) -> None:
        why = None if self.answered else await probe(self._endpoint)
        if self.answered:  # (a controller that refuses us says why in a REJECT)
            why = (f"the controller answers (key id {self._key_id} is right) but has not "
                   f"welcomed this worker after {self.tries} tries in {now - self._start:.0f} "
                   "s; its driver's log says why")
        elif why is None:
            why = (f"no WELCOME after {self.tries} tries in {now - self._start:.0f} s: wrong "
                   f"key or wrong address? (something listens at {self._endpoint.text}; this "
                   f"worker's key id is {self._key_id}, the driver logs its own"
                   + ("; with CurveZMQ, also check --server-key" if self._curve else "") + ")")
        self.last = why
        log.log(self._level, "cannot join %s yet: %s", self._endpoint.text, why)


def session_socket(ctx: zmq.Context[Any], connect: str,
                   curve: tuple[tuple[bytes, bytes], bytes] | None,
                   routing_id: bytes | None = None,
                   watch: Callable[[zmq.Socket[Any]], None] | None = None,
                   link: tuple[float, float] = (1.0, 5.0)) -> zmq.Socket[Any]:
    """A session's DEALER, connecting to ``connect`` (CurveZMQ when ``curve`` is
    ``((public, secret), server public)``); ``routing_id``: the one it had (a
    session moving to a relay keeps it), else a new one; ``watch``: called with the
    socket before it connects (its monitor sees the connection from the start);
    ``link``: the heartbeat interval and liveness timeout its connection is kept by
    (ZeroMQ's PINGs from this side too: a peer's TTL alone arms only after a PING,
    and a connection cut right after data would never close).

    Raises:
        ValueError: ZeroMQ cannot connect to that endpoint.
    """
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    # One routing id for the whole session, random and unrelated to the session
    # id (which every header shows): after a dropped connection the controller
    # finds this host by it again.
    sock.setsockopt(zmq.ROUTING_ID, routing_id or b"w" + secrets.token_bytes(16))
    # Not IMMEDIATE: with it, a DEALER drops unread incoming messages (such as
    # the controller's SHUTDOWN) when the connection goes. JOINs queued while
    # the controller is away get one CHALLENGE each; only the first is answered.
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    heartbeat_options(sock, *link)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(RECONNECT_MAX_S * 1000))
    if curve is not None:
        (public, secret), server = curve
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        sock.setsockopt(zmq.CURVE_SERVERKEY, server)
    if watch is not None:
        watch(sock)
    try:
        sock.connect(connect)
    except zmq.ZMQError as exc:  # an endpoint parse_connect let through
        sock.close(0)
        raise ValueError(f"cannot connect to {connect!r}: {exc}") from None
    return sock


def relay_socket(ctx: zmq.Context[Any], connect: str, relay: str,
                 curve: tuple[tuple[bytes, bytes], bytes] | None,
                 old: zmq.Socket[Any],
                 watch: Callable[[zmq.Socket[Any]], None] | None = None,
                 link: tuple[float, float] = (1.0, 5.0)) -> zmq.Socket[Any]:
    """The socket a session moves to when its WELCOME names a relay: ``tcp://*:PORT``
    is that port at the address ``connect`` reached the controller at."""
    if relay.startswith("tcp://*:"):
        relay = connect.rsplit(":", 1)[0] + ":" + relay.rsplit(":", 1)[1]
    identity = old.getsockopt(zmq.ROUTING_ID)
    assert isinstance(identity, bytes)
    return session_socket(ctx, relay, curve, identity, watch, link)
