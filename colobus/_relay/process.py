"""A relay process the controller started: its settings on standard input, then run.

The controller writes the settings (the key among them: never on a command line or in
the environment) as a length and msgpack on the relay's standard input, and keeps that
pipe open: the relay ends when it closes, so it never outlives the controller.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import sys
from typing import Any

import msgpack

from .relay import Relay

__all__ = ["main", "read_settings"]


def read_settings(fd: int = 0) -> dict[str, Any]:
    """The settings the controller writes on the relay's standard input (length, msgpack)."""
    head = b""
    while len(head) < 4:
        more = os.read(fd, 4 - len(head))
        if not more:
            raise SystemExit("colobus relay: no settings on standard input")
        head += more
    (n,) = struct.unpack("!I", head)
    data = b""
    while len(data) < n:
        more = os.read(fd, n - len(data))
        if not more:
            raise SystemExit("colobus relay: settings cut short")
        data += more
    cfg: dict[str, Any] = msgpack.unpackb(data)
    return cfg


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="[relay] %(levelname)s %(message)s",
                        stream=sys.stderr)
    relay = Relay(read_settings())
    try:
        asyncio.run(relay.run())
    except KeyboardInterrupt:
        return 0
    return 0
