"""A relay that runs anywhere: ``colobus relay --connect tcp://CONTROLLER:PORT``.

A relay the controller starts on its own machine (``relays=``) reads its settings on
its standard input. One that runs on another machine (by hand, or one per N hosts
on the hosts' own machines by a launcher: ``relays_on_hosts=``) connects to the
controller and offers itself: JOIN, the controller's CHALLENGE, then an OFFER that
carries the challenge's nonce and a proof made with the *relay key*
(:func:`colobus._wire.relaywire.relay_proof`), which workers do not hold; the
controller answers with SETUP (the same settings). From then on it is a relay like
any other: the controller hands it hosts, and a lost one costs exactly its hosts.

When a session ends (the controller closed, went silent, or dropped this relay) it
offers itself to the next controller at the same address, as workers rejoin, unless
told to run once. A REJECT (no relays taken there, the wrong relay key, another
version) ends it with status 2.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from typing import Any

import zmq

from .._wire import protocol as P
from .._wire.envelope import Dropped, Envelope, decode, encode
from .._wire.links import heartbeat_options
from .._wire.relaywire import Offer, Setup, relay_proof
from .._wire.versions import local_versions
from .relay import Relay

__all__ = ["RelayRefused", "offer", "serve"]

log = logging.getLogger("colobus.relay")

ANSWER_S = 3.0  # an unanswered JOIN or OFFER is sent again after this long
RETRY_MAX_S = 10.0  # back-off between offers to a controller that is not there


class RelayRefused(Exception):
    """The controller refused this relay (its REJECT's reason): no point in retrying."""


def default_advertise(connect: str) -> str:
    """The address hosts reach this machine at: the one it reaches the controller from
    (the interface the route to the controller's address leaves by)."""
    if not connect.startswith("tcp://"):
        return "127.0.0.1"
    host = connect[6:].rsplit(":", 1)[0].strip("[]")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # (no packet leaves: a datagram socket only routes)
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


def offer(ctx: zmq.Context[Any], connect: str, key: bytes, relay_key: bytes, name: str,
          timeout: float) -> tuple[zmq.Socket[Any], Envelope, bytes, bytes] | None:
    """Offer this relay to the controller at ``connect``: JOIN, CHALLENGE, OFFER, SETUP.

    Returns:
        The DEALER joined to the controller, the SETUP envelope (taken: its number is
        the first the relay received), the relay's routing id and its session; None
        if no answer came within ``timeout`` seconds.

    Raises:
        RelayRefused: the controller refused the offer (a REJECT).
    """
    identity, session = b"r" + secrets.token_bytes(16), secrets.token_bytes(16)
    sock = ctx.socket(zmq.DEALER)
    for opt, value in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0),
                       (zmq.ROUTING_ID, identity)):
        sock.setsockopt(opt, value)
    heartbeat_options(sock, 1.0, 5.0)  # (the defaults: SETUP says the controller's later)
    sock.connect(connect)
    seq = 0

    def send(body: P.Body) -> None:
        nonlocal seq
        seq += 1
        sock.send_multipart(encode(key, Envelope(body.kind, session, b"", seq,
                                                 body.to_wire())))

    versions = {k: v for k, v in local_versions().items() if k in ("python", "colobus")}
    deadline = time.monotonic() + timeout
    nonce: bytes | None = None
    asked = 0.0
    try:
        while time.monotonic() < deadline:
            now = time.monotonic()
            if now - asked > ANSWER_S:  # (again: the JOIN or OFFER, or its answer, was lost)
                nonce = None
                send(P.Join())
                asked = now
            if not sock.poll(200):
                continue
            try:
                env = decode(key, sock.recv_multipart())
            except Dropped:
                continue
            if env.receiver != session:
                continue
            try:
                body = (Setup.from_wire(env.body) if env.kind == P.Kind.SETUP
                        else P.parse(env.kind, env.body))
            except ValueError:
                continue
            if isinstance(body, P.Reject):
                raise RelayRefused(body.reason)
            if isinstance(body, P.Challenge) and nonce is None:
                nonce = body.nonce
                send(Offer(name, os.getpid(), socket.gethostname(), nonce,
                           relay_proof(relay_key, nonce, session), versions))
                asked = now
            elif isinstance(body, Setup) and nonce is not None:
                return sock, env, identity, session
    except BaseException:
        sock.close(0)
        raise
    sock.close(0)
    return None


def serve(connect: str, key: bytes, relay_key: bytes, *, bind: str = "tcp://*:*",
          advertise: str | None = None, name: str | None = None, once: bool = False) -> int:
    """Run a relay for the controller at ``connect`` (``colobus relay``); returns the
    exit status: 0 once a session ended (``once``) or on Ctrl-C, 2 if refused."""
    name = name or f"relay@{socket.gethostname()}"
    advertise = advertise or default_advertise(connect)
    ctx: zmq.Context[Any] = zmq.Context()
    wait = 0.5
    try:
        while True:
            try:
                got = offer(ctx, connect, key, relay_key, name, timeout=RETRY_MAX_S)
            except RelayRefused as exc:
                log.error("relay %s refused by the controller at %s: %s", name, connect, exc)
                return 2
            if got is None:
                log.info("relay %s: no controller answers at %s; trying again", name, connect)
                time.sleep(wait)
                wait = min(2 * wait, RETRY_MAX_S)
                continue
            wait = 0.5
            sock, setup_env, identity, session = got
            setup = Setup.from_wire(setup_env.body)
            assert isinstance(setup, Setup)
            relay = Relay({
                "key": key, "session": session, "ctl_session": setup_env.sender,
                "identity": identity, "controller": connect, "bind": bind,
                "advertise": advertise, "heartbeat": setup.heartbeat,
                "liveness": setup.liveness, "resend_after": setup.resend_after,
                "max_message_bytes": setup.max_message_bytes, "times": setup.times})
            relay.ctl.send_seq = 2  # (its JOIN and OFFER)
            relay.ctl.recv_seq = setup_env.seq
            log.info("relay %s carries hosts for the controller at %s (relay %d)", name,
                     connect, setup.index)
            why = asyncio.run(relay.run(ctx, sock))
            log.info("relay %s: the session ended (%s)", name, why)
            if once:
                return 0
    except KeyboardInterrupt:
        return 0
    finally:
        ctx.term()
