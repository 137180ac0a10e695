"""An authenticated worker that says whatever a test tells it to: raw pyzmq plus
colobus's own wire module, holding the key.

It joins like a real worker (JOIN, CHALLENGE, HELLO with the nonce, WELCOME) and
then sends what a test asks, envelope by envelope. By default every envelope is
sent as given, whatever its size (hostile frames stay hostile) and acknowledging
nothing; with ``channel=True`` it sends as a real worker's channel does: large
messages as a head and parts (the controller takes no frame over 4 MiB), each
acknowledging what arrived. Used by ``tests/test_malicious_worker.py`` and
``tests/test_transport.py``.
"""

from __future__ import annotations

import os
import secrets
import time
from typing import Any

import zmq

from colobus._wire import protocol as P
from colobus._wire.chunks import CHUNK_BYTES, envelope_bytes, split
from colobus._wire.envelope import BATCH_KIND, Envelope, decode, encode, unpack_batch
from colobus._wire.protocol import Kind
from colobus._wire.versions import local_versions

__all__ = ["FakeWorker"]


class FakeWorker:
    """One raw session with a controller at ``address``.

    Args:
        zctx: the ZeroMQ context its DEALER belongs to.
        address: the controller's endpoint.
        key: the MAC key (a stranger's for an unauthenticated peer).
        name: the name it joins under.
        channel: send like a real worker's channel (parts, acknowledgements).
    """

    def __init__(self, zctx: zmq.Context[Any], address: str, key: bytes, name: str, *,
                 channel: bool = False) -> None:
        self.key, self.name, self.channel = key, name, channel
        self.zctx, self.address = zctx, address
        self.identity = b"f" + secrets.token_bytes(16)  # kept if it moves to a relay
        self.sock = self._socket(address)
        self.session = secrets.token_bytes(16)
        self.ctl_session = b""
        self.seq = 0
        self.ack = 0  # the highest sequence number received from the controller
        self.index = -1
        self.sent_hello: list[bytes] = []  # the HELLO's frames (to replay them)
        self._inbox: list[Envelope] = []

    def _socket(self, address: str) -> zmq.Socket[Any]:
        sock = self.zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, self.identity)
        sock.connect(address)
        return sock

    def send(self, kind: int, body: Any, payload: bytes = b"",
             buffers: list[bytes] | None = None, *, session: bytes | None = None,
             receiver: bytes | None = None, ack: bool = True) -> list[bytes]:
        """Send one message; returns the frames of its (last) envelope.

        ``session``/``receiver`` override the envelope's sender and receiver
        sessions; ``ack=False`` acknowledges nothing even with ``channel``.
        """
        env = Envelope(int(kind), session or self.session,
                       self.ctl_session if receiver is None else receiver, 0, body,
                       payload, list(buffers or []), 0,
                       ack=self.ack if ack and self.channel else 0)
        large = self.channel and envelope_bytes(env) > CHUNK_BYTES
        frames: list[bytes] = []
        for e in split(env) if large else [env]:
            self.seq += 1
            e.seq, e.ack = self.seq, env.ack
            frames = [bytes(f) for f in encode(self.key, e)]
            self.sock.send_multipart(frames)
        return frames

    def poll_in(self, timeout: float) -> bool:
        """Take in one envelope from the controller if one comes within ``timeout`` s."""
        if not self.sock.poll(int(timeout * 1000)):
            return False
        env = decode(self.key, self.sock.recv_multipart())
        if self.index >= 0 and 0 < env.seq <= self.ack:
            return True  # a copy resent (a relay resends what a host did not acknowledge)
        if env.seq < 1 << 62:
            self.ack = max(self.ack, env.seq)
        self._inbox.extend(unpack_batch(env) if env.kind == BATCH_KIND else [env])
        return True

    def expect(self, kind: Kind, timeout: float = 30.0) -> Envelope:
        """The first message of ``kind`` received (others stay in the inbox)."""
        deadline = time.monotonic() + timeout
        while True:
            for i, env in enumerate(self._inbox):
                if env.kind == kind:
                    return self._inbox.pop(i)
            left = deadline - time.monotonic()
            assert left > 0 and self.poll_in(left), f"no {kind.name} arrived"

    def join(self, devices: int = 1) -> int:
        """Join with ``devices`` CPU devices; returns the host index it was given."""
        self.send(Kind.JOIN, [], receiver=b"")
        nonce = self.expect(Kind.CHALLENGE).body[0]
        hello = P.Hello(self.name, os.getpid(), "fake",
                        [["cpu", "cpu", i] for i in range(devices)], nonce, "",
                        local_versions())
        self.sent_hello = self.send(Kind.HELLO, hello.to_wire(), receiver=b"")
        welcome = self.expect(Kind.WELCOME)
        self.ctl_session = welcome.sender
        self.index = welcome.body[0]
        relay = welcome.body[8] if len(welcome.body) > 8 else ""
        if relay:  # the session moves to a relay, as a real worker's does
            if relay.startswith("tcp://*:"):
                relay = self.address.rsplit(":", 1)[0] + ":" + relay.rsplit(":", 1)[1]
            self.sock.close(0)
            self.sock = self._socket(relay)
            # greet it, as a real worker does: it resends what found no connection
            hi = Envelope(22, self.session, self.ctl_session, 0, [], ack=self.ack)  # ACK
            self.sock.send_multipart([bytes(f) for f in encode(self.key, hi)])
        return self.index

    def close(self) -> None:
        self.sock.close(0)
