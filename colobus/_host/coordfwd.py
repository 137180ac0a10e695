"""The worker's end of the way to the JAX job's coordination service.

The controller's coordination service listens on no port (see
:mod:`colobus._controller.coordlink`): each job generation, the worker listens on a
Unix socket in a directory of its own (mode 0700: no other user reaches it), and its
JAX client connects there. :class:`Forwarder` carries the bytes of each such
connection to the controller as COORD messages over this session's authenticated link,
and writes what comes back.

jaxlib's client ends its process on a broken connection, so a connection is never
closed here while the client may use it: when the session ends (or the controller
goes away), the forwarder goes dark (it reads and drops what the client writes, and
holds every connection open), and only :meth:`Forwarder.close`, called once the client
was shut down, closes them. A client that never finishes connecting keeps its
forwarder until the process exits. Everything here runs on the worker's event loop,
except :meth:`Forwarder.close_soon` (any thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any

from .._wire import protocol as P
from .._wire.coordpipe import Pipe, private_dir, remove_dir, socket_path

__all__ = ["Forwarder"]

log = logging.getLogger("colobus.worker")

MAX_CONNECTIONS = 8  # the controller takes at most this many of a host's (coordlink)


class Forwarder:
    """One job generation's Unix socket for JAX's client, carried over the link.

    Args:
        loop: the worker's event loop (the one this is made on).
        send: sends a COORD (and its payload) over this session's link.
        generation: the job's generation (every COORD carries it).

    Raises:
        OSError: no private directory or socket for it (a full or too long ``$TMPDIR``).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 send: Callable[[P.Coord, bytes], None], generation: int) -> None:
        self._loop = loop
        self._send = send
        self.generation = generation
        self.dark = False  # the session is over: nothing leaves, nothing is closed
        self.closed = False
        self._dir = private_dir("colobus-jax-")
        self.path = socket_path(self._dir, "coord")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(self.path)  # (in a 0700 directory: this user only)
            self._listener.listen(MAX_CONNECTIONS)
        except OSError:
            self._listener.close()
            remove_dir(self._dir)
            raise
        self._listener.setblocking(False)
        self._pipes: dict[int, Pipe] = {}
        self._next = 0
        self._server: asyncio.AbstractServer | None = None
        self._starting = loop.create_task(self._serve())

    @property
    def address(self) -> str:
        """What JAX's client connects to (``unix:PATH``)."""
        return f"unix:{self.path}"

    async def _serve(self) -> None:
        # (the socket listens already: a connect made before this runs waits in its backlog)
        self._server = await self._loop.create_unix_server(self._accepted, sock=self._listener)

    def _accepted(self) -> Pipe:
        conn = self._next
        self._next += 1

        def out(data: bytes) -> None:
            if not self.dark:
                self._send(P.Coord(self.generation, conn, False), data)

        def ended() -> None:  # JAX's client closed it: the controller's end closes too
            self._pipes.pop(conn, None)
            if not self.dark:
                self._send(P.Coord(self.generation, conn, True), b"")

        pipe = self._pipes[conn] = Pipe(out, ended)
        return pipe

    def on_coord(self, body: P.Coord, payload: Any) -> None:
        """The service's bytes on connection ``body.conn`` (its end: held, not closed)."""
        pipe = self._pipes.get(body.conn)
        if pipe is None or self.dark:
            return
        if body.end:
            log.debug("the JAX coordination service closed connection %d (held open)",
                      body.conn)
            return
        pipe.write(bytes(payload))

    def go_dark(self) -> None:
        """The session is over: send nothing more, hold every connection as it is."""
        self.dark = True

    def close(self) -> None:
        """JAX's client is shut down: close its connections, the socket, the directory."""
        if self.closed:
            return
        self.closed = self.dark = True
        for pipe in self._pipes.values():
            pipe.abort()
        self._pipes.clear()
        if self._server is not None:
            self._server.close()
        else:
            self._starting.cancel()
        with contextlib.suppress(OSError):
            self._listener.close()
        remove_dir(self._dir)

    def close_soon(self) -> None:
        """:meth:`close` on the loop (any thread; nothing if the loop is gone)."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self.close)
