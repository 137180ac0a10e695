"""Checks a worker's ``--connect`` endpoint before ZeroMQ sees it.

ZeroMQ answers a malformed endpoint with a bare "Invalid argument" (and a worker
that went on would then hang in context termination); this says what is wrong
in words, and splits a good ``tcp://`` endpoint into host and port for the
worker's join diagnosis (:mod:`colobus._host.join`).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Endpoint", "parse_connect"]

_FORMS = "tcp://HOST:PORT or ipc://PATH"


class Endpoint(NamedTuple):
    """A checked endpoint: ``transport`` is ``"tcp"`` or ``"ipc"``; ``port`` 0 for ipc."""

    text: str
    transport: str
    host: str
    port: int


def parse_connect(text: str) -> Endpoint:
    """Check ``text`` as an endpoint a worker can connect to.

    Raises:
        ValueError: with one line that says what is wrong and the expected form.
    """
    if "://" not in text:
        raise ValueError(f"{text!r} has no transport: expected {_FORMS} "
                         f"(did you mean tcp://{text}?)")
    transport, rest = text.split("://", 1)
    if transport == "ipc":
        if not rest:
            raise ValueError(f"{text!r} has no path: expected ipc://PATH")
        return Endpoint(text, "ipc", rest, 0)
    if transport != "tcp":
        raise ValueError(f"{text!r}: transport {transport!r} is not supported; "
                         f"expected {_FORMS}")
    address = rest.rsplit(";", 1)[-1]  # ZeroMQ allows tcp://SOURCE;HOST:PORT
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text or (host.startswith("[") and not host.endswith("]")):
        raise ValueError(f"{text!r} has no port: expected tcp://HOST:PORT")
    if not host:
        raise ValueError(f"{text!r} has no host: expected tcp://HOST:PORT")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{text!r}: port {port_text!r} is not a number from 1 to 65535")
    return Endpoint(text, "tcp", host.strip("[]"), int(port_text))
