"""One connection of the JAX job's coordination, carried over the colobus link.

JAX's coordination service (a gRPC server of jaxlib's) authenticates nobody, so in a
colobus job it listens on no port: a host's JAX client connects to a Unix socket of its
own worker, and the bytes of that connection travel as COORD messages over the host's
authenticated link to the controller, which writes them to the service's Unix socket
(both sockets in private directories). :class:`Pipe` is either end of one such
connection: the bytes it reads go to ``on_data``, its close to ``on_end``; the bytes
that came over the link are written to it, queued until it is connected.

Both ends run on their process's event loop; nothing here unpickles or parses the bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from typing import Any

__all__ = ["LINK", "Pipe", "private_dir", "remove_dir", "socket_path"]

LINK = "link"  # a FORM's coordinator: the service is reached through the host's link
MAX_PATH = 107  # bytes of a Unix socket's path (Linux: 108 with the NUL)


class Pipe(asyncio.Protocol):
    """A stream whose reads leave through ``on_data`` (and its end through ``on_end``).

    Args:
        on_data: called with each chunk read.
        on_end: called once when the stream closed (by the peer; not when aborted here).
        sock: its socket, where it is made before the transport (:meth:`abort` shuts it
            at once even then).
    """

    def __init__(self, on_data: Callable[[bytes], None], on_end: Callable[[], None],
                 sock: socket.socket | None = None) -> None:
        self._on_data = on_data
        self._on_end = on_end
        self._sock = sock
        self.transport: asyncio.Transport | None = None
        self._pending: list[bytes] = []  # written before the stream was connected
        self._closing = False
        self.ended = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        if self._pending:
            transport.write(b"".join(self._pending))
            self._pending.clear()
        if self._closing:
            transport.close()

    def data_received(self, data: bytes) -> None:
        if not self.ended:
            self._on_data(data)

    def eof_received(self) -> bool:
        return False  # (the transport closes)

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.ended:
            self.ended = True
            self._on_end()

    def write(self, data: bytes) -> None:
        """Write ``data`` (queued until connected; dropped once closed)."""
        if self._closing or self.ended:
            return
        if self.transport is None:
            self._pending.append(bytes(data))
        else:
            self.transport.write(data)

    def buffered(self) -> int:
        """Bytes written and not yet taken by the other end."""
        if self.transport is None:
            return sum(map(len, self._pending))
        return int(self.transport.get_write_buffer_size())

    def close(self) -> None:
        """Close once what was written left."""
        self._closing = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Close now, dropping what was not written; ``on_end`` is not called. The peer
        sees the end at once (the socket is shut here, not at the loop's next turn)."""
        self.ended = self._closing = True
        self._pending.clear()
        sock = (self.transport.get_extra_info("socket") if self.transport is not None
                else self._sock)
        if sock is not None:
            with contextlib.suppress(OSError, ValueError):  # (uvloop's sockets shut nothing:
                with socket.socket(fileno=os.dup(sock.fileno())) as dup:  # a copy does)
                    dup.shutdown(socket.SHUT_RDWR)
        if self.transport is not None:
            self.transport.abort()
        elif self._sock is not None:
            self._sock.close()


def private_dir(prefix: str) -> str:
    """A new directory only this user can enter (mode 0700), for Unix sockets."""
    path = tempfile.mkdtemp(prefix=prefix)
    os.chmod(path, 0o700)  # (mkdtemp's mode already; said again against a umask surprise)
    return path


def socket_path(directory: str, name: str) -> str:
    """``directory/name``, checked to fit a Unix socket.

    Raises:
        OSError: it is too long (a long ``$TMPDIR``), saying so.
    """
    path = os.path.join(directory, name)
    if len(os.fsencode(path)) > MAX_PATH:
        remove_dir(directory)
        raise OSError(f"the Unix socket path {path} is over {MAX_PATH} bytes: set TMPDIR to "
                      "a shorter directory")
    return path


def remove_dir(path: str | None) -> None:
    """Remove a directory :func:`private_dir` made (quietly: it may be gone)."""
    if path:
        shutil.rmtree(path, ignore_errors=True)
