"""CurveZMQ on the controller's socket: the server key pair and the client allow-list."""

from __future__ import annotations

import logging
from typing import Any

import zmq

__all__ = ["start_curve_server"]

log = logging.getLogger("colobus.controller")


class _CurveAllowList:
    """ZAP credentials provider: a CurveZMQ client key must be on the list."""

    def __init__(self, allowed: set[bytes]) -> None:
        self.allowed = allowed
        self.refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.allowed
        if not ok and key not in self.refused and len(self.refused) < 1024:
            self.refused.add(key)  # it retries: log each key once
            log.warning("refused a CurveZMQ client with key %s (not in curve_allow)",
                        key.decode(errors="replace"))
        return ok


def start_curve_server(ctx: zmq.Context[Any], sock: zmq.Socket[Any], public: bytes,
                       secret: bytes, allowed: set[bytes] | None) -> Any:
    """Make ``sock`` a CurveZMQ server; a ZAP thread checks the allow-list.

    Returns the authenticator, to ``stop()`` when the socket closes.
    """
    from zmq.auth import CURVE_ALLOW_ANY
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx, log=logging.getLogger("colobus.auth"))
    auth.start()
    if allowed is None:
        auth.configure_curve(domain="*", location=CURVE_ALLOW_ANY)
    else:
        auth.configure_curve_callback(domain="*", credentials_provider=_CurveAllowList(allowed))
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    log.info("CurveZMQ on: server key %s, %s", public.decode(),
             "any client key" if allowed is None else f"{len(allowed)} allowed client keys")
    return auth
