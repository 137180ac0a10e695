"""The JAX job's coordination service, reached only through the colobus link.

JAX's coordination service has no authentication: whoever reaches it reads and writes
the job's key-value store (the topology, each host's gloo address) and can break every
collective. So the controller's service listens on no port, only on a Unix socket in a
directory of the controller's own (mode 0700). A host's JAX client connects to a Unix
socket of its own worker (:mod:`colobus._host.coordfwd`), which carries each
connection's bytes here as COORD messages over the host's authenticated link; here each
such connection is one connection to the service (:class:`~colobus._wire.coordpipe.Pipe`).

jaxlib's client ends its process (``LOG(QFATAL)``) on any error it polls from the service,
a broken connection included, and its callback for that cannot be replaced from Python
(jaxlib 0.10 casts the status it would pass and aborts instead). So JAX must never see
the job end: workers never close a connection their client may still use, and before a
service stops (a loss broke the job, it forms again, the controller closes) this side
cuts every connection to it (:meth:`CoordLink.cut`), so the service has no client left
to tell about its end and its shutdown waits for nobody.

A host sends COORD only for the job's current generation, while it is a member; what a
key holder sends beyond that is bounded: at most :data:`MAX_CONNECTIONS` connections per
host and :data:`MAX_BUFFERED` bytes the service has not read per connection (then the
host is dropped for breaking the protocol). Everything here runs on the controller's
loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import TYPE_CHECKING, Any, Protocol

from .._wire import protocol as P
from .._wire.coordpipe import Pipe, private_dir, remove_dir, socket_path

if TYPE_CHECKING:
    from .._wire.envelope import Envelope
    from .hosts import Host

__all__ = ["MAX_BUFFERED", "MAX_CONNECTIONS", "CoordLink"]

log = logging.getLogger("colobus.controller")

MAX_CONNECTIONS = 8  # a host's open connections to the service (JAX's client makes one)
MAX_BUFFERED = 16 << 20  # bytes of one connection the service has not read yet


class LinkOwner(Protocol):
    """What :class:`CoordLink` uses of the controller."""

    def _send(self, host: Host, body: P.Body, payload: Any = b"", buffers: Any = (),
              pbufs: int = 0) -> None: ...


class _Violation(Protocol):
    def __call__(self, host: Host, reason: str, detail: str = ...) -> None: ...


class CoordLink:
    """The hosts' connections to the coordination service of the job's generation.

    Args:
        ctl: sends COORD to hosts.
        violation: drops a host that broke the protocol (``Sessions.violation``).
        dropped: where ignored messages are counted by reason.
    """

    def __init__(self, ctl: LinkOwner, violation: _Violation, dropped: Any) -> None:
        self._ctl = ctl
        self._violation = violation
        self._dropped = dropped
        self._dir: str | None = None  # the private directory of the service's sockets
        self.generation = 0  # the generation whose connections are carried
        self._path = ""  # its service's socket
        self._members: dict[int, int] = {}  # host index -> its generation in the job
        self._pipes: dict[tuple[int, int], Pipe] = {}  # (host index, conn) -> to the service
        self.carried = 0  # connections carried, over the controller's life

    def open(self, generation: int, members: dict[int, int]) -> str:
        """A service for ``generation`` is about to start: the Unix socket it listens on
        (``unix:PATH``); the COORDs of ``members`` are carried to it from now on.

        Raises:
            OSError: no private directory for it, or its path is too long for a socket.
        """
        self.cut()
        if self._dir is None or not os.path.isdir(self._dir):
            self._dir = None
            self._dir = private_dir("colobus-jax-")
        self._path = socket_path(self._dir, f"coord-{generation}")
        self.generation = generation
        self._members = dict(members)
        return f"unix:{self._path}"

    def cut(self, index: int | None = None) -> None:
        """Cut the connections of host ``index`` (None: every host's) to the service, at
        once: the service sees its clients go, and none of them hears of its end."""
        for key in [k for k in self._pipes if index is None or k[0] == index]:
            self._pipes.pop(key).abort()
        if index is None:
            self._members = {}
        else:
            self._members.pop(index, None)

    def close(self) -> None:
        """The controller closes: every connection cut, the sockets' directory removed."""
        self.cut()
        self.generation = -1
        remove_dir(self._dir)
        self._dir = None

    def describe(self) -> str:
        """Where the service listens (for ``stats()``)."""
        return f"unix:{self._path}" if self._path else ""

    # -- COORD from a host ------------------------------------------------------------------

    def on_coord(self, host: Host, body: P.Coord, env: Envelope) -> None:
        """Bytes of one of ``host``'s connections to the service (or its end)."""
        if (body.generation != self.generation
                or self._members.get(host.index) != host.generation):
            self._dropped["stale"] += 1  # a job that ended, or a host not in this one
            return
        key = (host.index, body.conn)
        pipe = self._pipes.get(key)
        if pipe is None:
            if body.end:
                return
            if sum(k[0] == host.index for k in self._pipes) >= MAX_CONNECTIONS:
                self._violation(host, "malformed", f"over {MAX_CONNECTIONS} connections to "
                                "the JAX coordination service")
                return
            pipe = self._connect(host, body.conn)
            if pipe is None:
                return
        if body.end:
            self._pipes.pop(key, None)
            pipe.close()
            return
        pipe.write(bytes(env.payload))
        if pipe.buffered() > MAX_BUFFERED:
            self._violation(host, "malformed", f"over {MAX_BUFFERED} bytes the JAX "
                            "coordination service did not read")

    def _connect(self, host: Host, conn: int) -> Pipe | None:
        """A new connection to the service for ``host``'s connection ``conn``."""
        loop = asyncio.get_running_loop()
        generation, index = self.generation, host.index
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.connect(self._path)  # (a local socket: at once, or not at all)
        except OSError as exc:
            sock.close()
            log.warning("host %d's JAX client cannot reach the coordination service: %s",
                        index, exc)
            self._ctl._send(host, P.Coord(generation, conn, True))
            return None

        def back(data: bytes) -> None:  # the service's bytes, to the host
            if self.generation == generation and (index, conn) in self._pipes:
                self._ctl._send(host, P.Coord(generation, conn, False), data)

        def ended() -> None:  # the service closed it (the host's side stays as it is)
            if self._pipes.get((index, conn)) is pipe:
                del self._pipes[(index, conn)]
                self._ctl._send(host, P.Coord(generation, conn, True))

        pipe = Pipe(back, ended, sock)
        self._pipes[(index, conn)] = pipe
        self.carried += 1
        def connected(task: asyncio.Task[Any]) -> None:
            if not task.cancelled() and task.exception() is not None:
                ended()

        loop.create_task(loop.create_unix_connection(lambda: pipe, sock=sock)
                         ).add_done_callback(connected)
        return pipe
