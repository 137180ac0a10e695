"""Checks a worker's ``--connect`` endpoint (and its ``$COLOBUS_DATA_ADDRESS``) before
ZeroMQ sees it.

ZeroMQ answers a malformed endpoint with a bare "Invalid argument" (and a worker
that went on would then hang in context termination); this says what is wrong
in words, and splits a good ``tcp://`` endpoint into host and port for the
worker's join diagnosis (:mod:`colobus._host.join`).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Endpoint", "data_address", "parse_connect"]

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


def data_address(text: str) -> tuple[str, str]:
    """``(address, port)`` of a ``$COLOBUS_DATA_ADDRESS`` (``""``: the default address;
    ``"*"``: an ephemeral port).

    Raises:
        ValueError: a port that is not a number from 1 to 65535.
    """
    text = text.strip()
    if text.startswith("tcp://"):
        text = text[len("tcp://"):]
    if text.startswith("["):  # [IPV6] or [IPV6]:PORT
        address, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:  # ADDRESS:PORT or :PORT
        address, _, port = text.partition(":")
    else:  # ADDRESS (an IPv6 address without brackets has no port)
        address, port = text, ""
    if port in ("", "*"):
        return address, "*"
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"COLOBUS_DATA_ADDRESS={text!r}: the port must be 1 to 65535")
    return address, port
