"""One session's state, the same on both sides of the wire: sequence numbers both
ways, the outbox, what waits for room in the send window, what the other side has
not acknowledged yet (and how the window grows and shrinks with it), and a chunked
message being received. :class:`colobus._wire.channel.Channel` moves it on a socket.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from typing import Protocol

from . import protocol as P
from .chunks import CHUNK_BYTES, CHUNKED_KIND, MAX_PART, PART_KIND, Assembly, Splitter
from .envelope import Buffer, Dropped, Envelope, Outgoing

__all__ = ["ACK_AFTER", "DEFAULT_MAX_WINDOW", "HEARTBEAT_KIND", "WINDOW_MIN", "Peer", "Via",
           "data_bytes"]

HEARTBEAT_KIND = int(P.Kind.HEARTBEAT)

# Flow control: what one peer may hold unacknowledged, in bytes. The window starts
# at one part and grows while acknowledgements come back fast; it shrinks when they
# are slow, so what waits ahead of a heartbeat on a slow link stays short.
WINDOW_MIN = CHUNK_BYTES
DEFAULT_MAX_WINDOW = 1 << 24  # 16 MiB: Controller(send_window_bytes=...)
# Acknowledgements that come this much later than the shortest round trip seen let
# the window grow no further; twice this shrinks it.
TARGET_DELAY_S = 0.25
ACK_AFTER = CHUNK_BYTES  # a receiver acknowledges at once after this many bytes


def data_bytes(payload: Buffer, buffers: Sequence[Buffer]) -> int:
    """What a message carries besides its body: its payload and buffers, in bytes."""
    n = len(payload) if type(payload) is bytes else memoryview(payload).nbytes
    for b in buffers:
        n += len(b) if type(b) is bytes else memoryview(b).nbytes
    return n


class Via(Protocol):
    """Where a relayed peer's messages go instead of its own socket route."""

    link: Peer  # the relay's own peer: what it holds for its hosts, together

    def collect(self, peer: Peer) -> None:
        """Take ``peer``'s outbox (it leaves in the relay's next message)."""

    def add(self, peer: Peer, kind: int, packed: bytes, payload: Buffer,
            buffers: Sequence[Buffer], pbufs: int) -> None:
        """Take one message for ``peer`` (after anything its outbox still holds)."""

    def carried(self, peers: list[Peer]) -> list[int]:
        """The host indices of those of ``peers`` it carries (what their outboxes still
        held goes first)."""

    def add_indices(self, hosts: list[int], kind: int, packed: bytes, payload: Buffer,
                    buffers: Sequence[Buffer], pbufs: int) -> None:
        """:meth:`add` of one message for each of the hosts ``carried`` named."""

    def add_spliced(self, hosts: list[int], kind: int, head: bytes, tails: list[bytes],
                    payload: Buffer, buffers: Sequence[Buffer], pbufs: int) -> None:
        """One message for each of the hosts ``carried`` named, host ``hosts[j]``'s body
        ``head`` and then ``tails[j]`` (the relay puts them together)."""

    def emit(self) -> Peer | None:
        """Queue what was collected on the relay's own peer; that peer, or None."""

    def held_for(self, index: int) -> int:
        """The payload and buffer bytes given for host ``index`` that it has not yet
        acknowledged (to the relay)."""


class Peer:
    """The other end of one session: sequence numbers both ways, the outbox, what waits
    for room in the window, what it has not acknowledged yet, and a chunked message
    being received."""

    __slots__ = ("ack_due", "ack_wait", "acked_sent", "assembly", "backoff", "base_delay",
                 "held", "inflight", "last_cut", "max_part", "max_window", "nack_due", "nacked",
                 "outbox", "pending", "recv_owed", "recv_seq", "route", "send_seq", "session",
                 "their_session", "unacked", "undelivered", "via", "went_back", "window")

    def __init__(self, route: list[bytes], session: bytes, their_session: bytes,
                 recv_seq: int = 0, max_window: int = DEFAULT_MAX_WINDOW) -> None:
        self.route = route  # frames sent before each envelope: [identity] on a ROUTER
        self.session = session
        self.their_session = their_session
        self.send_seq = 0
        self.recv_seq = recv_seq
        self.outbox: list[Outgoing] = []
        # envelopes made from the outbox that wait for room in the window (unnumbered),
        # and messages leaving in parts, cut as the window makes room
        self.pending: collections.deque[Envelope | Splitter] = collections.deque()
        # the largest part (or message sent whole) the peer takes in one frame
        self.max_part = MAX_PART
        # (seq, time sent, frames, bytes, data bytes): kept until the peer's ack covers seq
        self.unacked: collections.deque[tuple[int, float, list[Buffer], int, int]] = (
            collections.deque())
        self.inflight = 0  # bytes in ``unacked``
        # payload and buffer bytes this side holds for the peer: queued in the outbox,
        # waiting for the window, or sent and not yet acknowledged (uploads wait on it)
        self.held = 0
        self.max_window = max(WINDOW_MIN, max_window)
        self.window = WINDOW_MIN
        self.last_cut = 0.0
        self.base_delay = float("inf")  # the shortest round trip seen: the link's own
        self.ack_wait = 0.0  # since when ``unacked`` waits for the peer's next ack
        self.backoff = 1.0
        self.acked_sent = recv_seq  # the highest recv_seq we told the peer
        self.recv_owed = 0  # bytes received since then
        # An ACK is due even if ``acked_sent`` says it was sent: the peer resent what we
        # have (it missed it), or we resent (the copies carry their first ``ack``).
        self.ack_due = False
        # A gap: the next ACK asks the peer to resend from it at once (go-back-N),
        # once per place in the stream (``nacked``: the recv_seq last asked from).
        self.nack_due = False
        self.nacked = -1
        # The highest ``ack`` of a NACK we went back for: a peer's NACKs make us resend
        # once per place, only forward (a keyed peer cannot make us resend at will).
        self.went_back = -1
        self.assembly: Assembly | None = None
        # A host a relay carries (colobus._controller.relays): its messages leave through
        # the relay, and this side numbers and acknowledges nothing for it.
        self.via: Via | None = None
        self.undelivered = False  # a send found no connection (it waits for a resend)

    def accept(self, env: Envelope) -> str | None:
        """Take an authenticated envelope of this session, or say why not.

        Envelopes must come in sequence: ``"replay"`` for one already taken (a
        copy resent after a blip, or a replay), ``"gap"`` for one after a lost
        one (its sender resends from the gap on, since it is not acknowledged).
        """
        seq = env.seq
        # Its acknowledgement counts even when the envelope is refused: after a blip
        # both sides resend, and a side that heeded acks only in sequence would keep
        # resending what the other side already has.
        if self.unacked and self.unacked[0][0] <= env.ack:
            self.acked(env.ack)
        if seq != self.recv_seq + 1:
            if seq <= self.recv_seq:
                return "replay"
            if self.nacked != self.recv_seq:
                self.nacked = self.recv_seq
                self.nack_due = True
            return "gap"
        self.recv_seq = seq
        return None

    def acked(self, ack: int) -> None:
        """The peer has everything up to ``ack``: free it, and size the window."""
        unacked = self.unacked
        freed = data = 0
        sent = 0.0
        while unacked and unacked[0][0] <= ack:
            _, sent, _, n, d = unacked.popleft()
            freed += n
            data += d
        if not freed:
            return
        now = time.monotonic()
        self.inflight -= freed
        self.held -= data
        self.ack_wait = now
        self.backoff = 1.0
        delay = now - sent
        if delay < self.base_delay:
            self.base_delay = delay
        queued = delay - self.base_delay  # what the window adds to the round trip
        if queued < TARGET_DELAY_S:
            window = self.window + freed
            self.window = window if window < self.max_window else self.max_window
        elif queued > 2 * TARGET_DELAY_S and now - self.last_cut > delay:
            self.window = max(WINDOW_MIN, self.window * 7 // 10)
            self.last_cut = now

    def deliver(self, env: Envelope, max_total: int) -> Envelope | None:
        """The message an accepted envelope completes: itself, or a chunked message
        once its last part is in (None until then).

        Raises:
            Dropped: a part without a head, a head inside a chunked message, any other
                message between the parts (a heartbeat may come between them).
        """
        kind = env.kind
        assembly = self.assembly
        if kind == PART_KIND:
            if assembly is None:
                raise Dropped("malformed", "a part without its head")
            whole = assembly.feed(env)
            if whole is not None:
                self.assembly = None
            return whole
        if assembly is not None and kind != HEARTBEAT_KIND:
            raise Dropped("malformed", "a message between the parts of another")
        if kind == CHUNKED_KIND:
            self.assembly = Assembly(env, max_total)
            return None
        return env

    def forget(self) -> None:
        """The session is over: drop what waits to be sent or acknowledged."""
        self.outbox = []
        self.pending.clear()
        self.unacked.clear()
        self.inflight = self.held = 0
        self.assembly = None


