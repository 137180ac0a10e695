"""msgpack written by hand where a message is put together from packed pieces.

A batch's entries and a fan-out's CALLs share most of their bytes: the shared
parts are packed once and spliced, and these give the bytes msgpack itself
would write around them (``tests/test_wire.py`` checks they are the same).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from .._errors import SerializationError

__all__ = ["array_header", "pack_body", "uint", "CallSplicer"]


def pack_body(body: Any) -> bytes:
    """A body's msgpack bytes; raises :class:`~colobus.SerializationError` if it has
    something msgpack cannot write (before any sequence number is spent on it)."""
    try:
        out: bytes = msgpack.packb(body, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise SerializationError(f"cannot encode the message for the host: {exc}") from None
    return out

_UINTS = [msgpack.packb(i) for i in range(128)]  # msgpack's positive fixints


def uint(n: int) -> bytes:
    """``msgpack.packb(n)`` for an int >= 0, without the call for small ones."""
    return _UINTS[n] if n < 128 else msgpack.packb(n)  # type: ignore[no-any-return]


def array_header(n: int) -> bytes:
    """The bytes msgpack writes before the ``n`` elements of a list."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


class CallSplicer:
    """The packed bodies of one call's CALLs to many hosts: ``fields`` (all but the
    host's mesh, the host count and ``spread``) packed once; per host, the mesh.

    ``CallSplicer(fields, spread)(mesh, hosts)`` equals ``pack_body([*fields, mesh,
    hosts])``, with ``True`` after them where ``spread`` (and raises
    :class:`~colobus.SerializationError` where that would).
    """

    __slots__ = ("_head", "head", "spread")

    def __init__(self, fields: Sequence[Any], spread: bool = False) -> None:
        packed = pack_body(list(fields))
        self._head = (array_header(len(fields) + 2 + spread)
                      + packed[len(array_header(len(fields))):])
        self.head = self._head  # every host's body begins so (a relay splices the rest)
        self.spread = spread

    def __call__(self, mesh: list[Any], hosts: int) -> bytes:
        return self._head + pack_body(mesh) + self.end(hosts)

    def end(self, hosts: int) -> bytes:
        """What follows each host's mesh part: the host count, and ``spread``."""
        return uint(hosts) + b"\xc3" if self.spread else uint(hosts)

    def packed(self, mesh: bytes, hosts: int) -> bytes:
        """``self(m, hosts)`` for ``mesh = pack_body(m)``."""
        return self._head + mesh + self.end(hosts)
