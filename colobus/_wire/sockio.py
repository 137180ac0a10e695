"""Socket fast paths shared by the controller and the worker.

pyzmq's ``send_multipart`` type-checks every part, combines ``enum`` flags and
goes through the routing-id logic of ``Socket.send`` for each frame; on the
no-op call path that was about 10 us per message, several times the cost of
the sends themselves. These helpers do the same with plain ``int`` flags, and
copy small frames (cheaper than a zero-copy frame and its bookkeeping) while
sending large buffers without a copy. They call the socket's compiled
``send``/``recv`` directly (pyzmq's Python-level ``Socket.send`` only adds the
DRAFT ``routing_id``/``group`` arguments, unused here), and read a received
frame's ``more`` flag instead of asking the socket for ``RCVMORE`` (each
``getsockopt`` builds an enum): on a controller with a thousand hosts these
per-frame costs are most of what a heartbeat costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import zmq

from .limits import MAX_FRAME_BYTES

__all__ = [
    "router_socket",
    "COPY_BELOW", "EVENTS", "NOBLOCK", "POLLIN", "readable", "recv_frames", "send_envelope",
    "send_frames", "socket_fd",
]

SNDMORE = int(zmq.SNDMORE)
NOBLOCK = int(zmq.NOBLOCK)
EVENTS = int(zmq.EVENTS)
POLLIN = int(zmq.POLLIN)
RCVMORE = int(zmq.RCVMORE)
# Below this size a copy beats a zero-copy frame (pyzmq's own copy threshold).
COPY_BELOW = 1 << 16
_send = zmq.backend.Socket.send  # the compiled methods, below pyzmq's Python wrappers
_recv = zmq.backend.Socket.recv
_poll = zmq.backend.zmq_poll
_get: Any = zmq.backend.Socket.get  # (the compiled getsockopt: an int, but see readable)


def send_frames(sock: zmq.Socket[Any], frames: Sequence[Any], flags: int = 0) -> None:
    """Send one multipart message; ``bytes``/``memoryview`` parts, large ones zero-copy."""
    more = flags | SNDMORE
    last = len(frames) - 1
    for i, f in enumerate(frames):
        n = len(f) if type(f) is bytes else memoryview(f).nbytes
        _send(sock, f, more if i < last else flags, n < COPY_BELOW)


def send_envelope(sock: zmq.Socket[Any], route: Sequence[bytes], frames: Sequence[Any],
                  plen: int, flags: int = 0) -> None:
    """:func:`send_frames` of ``[*route, *frames]`` for an envelope's frames (header,
    payload of ``plen`` bytes, MAC, buffers) whose sizes the caller knows: the routing
    frames, the header and the MAC are small and copied, the payload and the buffers
    go as send_frames sends them."""
    more = flags | SNDMORE
    for r in route:
        _send(sock, r, more, True)
    if len(frames) == 3:
        header, payload, mac = frames
        _send(sock, header, more, True)
        _send(sock, payload, more, plen < COPY_BELOW)
        _send(sock, mac, flags, True)
        return
    _send(sock, frames[0], more, True)
    _send(sock, frames[1], more, plen < COPY_BELOW)
    last = len(frames) - 1
    for i in range(2, last + 1):
        f = frames[i]
        n = len(f) if type(f) is bytes else memoryview(f).nbytes
        _send(sock, f, more if i < last else flags, n < COPY_BELOW)


def readable(sock: zmq.Socket[Any]) -> bool:
    """Whether a message is waiting (the FD is edge-triggered: ask after every I/O).

    ``zmq_poll`` with no timeout: no Python call. ``ZMQ_EVENTS`` from the compiled
    ``getsockopt`` gives the same answer with one system call fewer (``zmq_poll`` polls
    the socket's descriptor before it asks for the events, which poll it again), but
    pyzmq builds the option's enum for it (two Python calls): the drains on both sides
    (``Channel.drain``, the worker's reader), which look once or twice per wake-up, take
    that trade inline; this helper serves the paths off the calls' way (resends, the
    link monitor).
    """
    return bool(_poll([(sock, POLLIN)], 0))


def socket_fd(sock: zmq.Socket[Any]) -> int:
    """The socket's file descriptor, for ``loop.add_reader``."""
    return cast(int, sock.getsockopt(zmq.FD))


def recv_frames(sock: zmq.Socket[Any], flags: int = NOBLOCK) -> list[Any]:
    """Receive one multipart message as ``zmq.Frame`` objects (no copies)."""
    frame = _recv(sock, flags, False)
    parts = [frame]
    while frame.more:
        frame = _recv(sock, flags, False)
        parts.append(frame)
    return parts




def router_socket(ctx: zmq.Context[Any], max_message_bytes: int) -> zmq.Socket[Any]:
    """The controller's ROUTER, set up for colobus's channel (not yet bound)."""
    sock: zmq.Socket[Any] = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    # A worker that reconnects after a dropped connection keeps its routing id:
    # its new connection takes over the route even if the old one lingers.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    # libzmq refuses (and disconnects) a single frame over the limit before it is
    # buffered: workers send nothing larger than MAX_FRAME_BYTES in one frame (large
    # data travels in parts), so neither can anyone else; larger totals are counted.
    sock.setsockopt(zmq.MAXMSGSIZE, min(max_message_bytes, MAX_FRAME_BYTES))
    return sock
