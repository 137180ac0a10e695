"""The raw pyzmq echo server of ``colobus bench``'s baselines: pyzmq only, run by path.

``python raw_echo.py ENDPOINT IDENTITY`` connects a DEALER to the bench's ROUTER.
It imports nothing of colobus (nor JAX), so it starts at once.
"""

from __future__ import annotations

import sys
from typing import Any

import zmq

__all__ = ["echo_main"]


def echo_main(address: str, identity: str) -> None:
    """A raw DEALER echo server (runs in a subprocess; blocking socket).

    Ops (first frame): ``e`` echo the frames back; ``p`` keep the second frame
    (zero-copy) and ack; ``g`` send the kept frame back (zero-copy); ``q`` quit.
    """
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    sock.send(b"hello")
    kept: Any = None
    while True:
        frames = sock.recv_multipart(copy=False)
        op = frames[0].bytes
        if op == b"e":
            sock.send_multipart(frames, copy=False)
        elif op == b"p":
            kept = frames[1]
            sock.send(b"k")
        elif op == b"g":
            sock.send_multipart([b"d", kept], copy=False)
        elif op == b"q":
            break
    sock.close(0)
    ctx.term()


if __name__ == "__main__":
    echo_main(sys.argv[1], sys.argv[2])
