"""Large messages in chunks, so that nothing waits behind one message on a slow link.

A message whose payload and buffers together pass :data:`CHUNK_BYTES` leaves as a
``CHUNKED`` head and ``PART`` envelopes (:func:`split`). The head carries the
message's kind, body, buffer lengths and payload length, and a BLAKE2b digest
of the payload (the head is MAC-checked like any header, so the payload, which
travels in the parts' unauthenticated frames, is checked against the digest
before anything reads it). Each ``PART`` carries the next ``CHUNK_BYTES`` of
the payload then the buffers, back to back, as zero-copy slices of the
sender's memory. Each is an envelope of its own: numbered, acknowledged and,
if lost, sent again on its own; heartbeats and acknowledgements travel between
them, so how long the whole message takes never decides liveness.

The receiver (:class:`Assembly`) writes the parts into buffers allocated once
from the head's lengths (bounded by the receiver's limit) -- one copy of the
data, at memory speed -- and hands on the whole message once the last part is
in. Until then, nothing but heartbeats may come between the parts: the sender
keeps other messages behind the chunked one, in order.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import mmap
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from .envelope import MAX_FRAMES, Buffer, Dropped, Envelope, pack_body

__all__ = ["ACK_KIND", "CHUNKED_KIND", "CHUNK_BYTES", "PART_KIND", "Assembly", "envelope_bytes",
           "split"]

CHUNKED_KIND = 20  # protocol.Kind.CHUNKED: the head of a message sent in parts
PART_KIND = 21  # protocol.Kind.PART: the next bytes of that message
ACK_KIND = 22  # protocol.Kind.ACK: acknowledgement only, outside the numbering
# Size of one part. Small enough that a heartbeat waits behind at most a few of
# them on a slow link (256 KiB is 26 ms at 80 Mbit/s), large enough that the
# per-envelope cost (a few microseconds) is noise at memory speed.
CHUNK_BYTES = 1 << 18
DIGEST_SIZE = 32

_ARRAY6 = b"\x96"


def _nbytes(b: Buffer) -> int:
    return b.nbytes if isinstance(b, memoryview) else len(b)


def envelope_bytes(env: Envelope) -> int:
    """What ``env`` carries besides its header: payload and buffers."""
    return _nbytes(env.payload) + sum(_nbytes(b) for b in env.buffers)


def split(env: Envelope, chunk: int = CHUNK_BYTES) -> list[Envelope]:
    """``env`` as a CHUNKED head and its PARTs (sequence numbers not set)."""
    payload = env.payload
    plen = _nbytes(payload)
    buflens = [_nbytes(b) for b in env.buffers]
    digest = hashlib.blake2b(payload, digest_size=DIGEST_SIZE).digest() if plen else b""
    body = env.packed_body if env.packed_body is not None else pack_body(env.body)
    head_body = b"".join((_ARRAY6, msgpack.packb(env.kind), body, msgpack.packb(env.pbufs),
                          msgpack.packb(buflens), msgpack.packb(plen),
                          msgpack.packb(digest, use_bin_type=True)))
    out = [Envelope(CHUNKED_KIND, env.sender, env.receiver, 0, None, packed_body=head_body)]
    frames: list[Buffer] = []
    filled = 0
    for src in ([payload] if plen else []) + list(env.buffers):
        view = memoryview(src).cast("B")
        at = 0
        while at < len(view):
            take = min(chunk - filled, len(view) - at)
            frames.append(view[at:at + take])
            filled += take
            at += take
            if filled == chunk:
                out.append(_part(env, frames))
                frames, filled = [], 0
    if frames:
        out.append(_part(env, frames))
    return out


_EMPTY_BODY = msgpack.packb([])


def _part(env: Envelope, frames: list[Buffer]) -> Envelope:
    return Envelope(PART_KIND, env.sender, env.receiver, 0, None, b"", frames,
                    packed_body=_EMPTY_BODY)


HUGE_FROM = 1 << 21  # buffers this large are mapped for transparent huge pages


def _alloc(n: int) -> memoryview:
    """Writable memory for ``n`` received bytes. Large buffers are anonymous mappings
    that ask for transparent huge pages: writing 256 MiB then faults 128 pages in,
    not 65536 (on the loop thread, where the parts are copied, that is most of the
    copy's cost)."""
    if n < HUGE_FROM:
        return np.empty(n, np.uint8).data
    mm = mmap.mmap(-1, n)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            mm.madvise(mmap.MADV_HUGEPAGE)
    return memoryview(mm)


class Assembly:
    """One chunked message being received: its buffers, filled part by part.

    Args:
        head: the authenticated CHUNKED envelope.
        max_total: the most payload and buffer bytes the receiver takes in one message.

    Raises:
        Dropped: ``malformed`` (a head that does not parse) or ``oversized``.
    """

    __slots__ = ("_at", "_digest", "_head", "_inner", "_views", "left")

    def __init__(self, head: Envelope, max_total: int) -> None:
        raw = head.body
        if not (isinstance(raw, list) and len(raw) == 6):
            raise Dropped("malformed", "chunked head")
        kind, body, pbufs, buflens, plen, digest = raw
        if not (type(kind) is int and kind not in (CHUNKED_KIND, PART_KIND, ACK_KIND)
                and type(pbufs) is int and isinstance(buflens, list)
                and len(buflens) < MAX_FRAMES and all(type(n) is int and n >= 0 for n in buflens)
                and type(plen) is int and plen >= 0 and 0 <= pbufs <= len(buflens)
                and isinstance(digest, bytes) and len(digest) == (DIGEST_SIZE if plen else 0)
                and not head.payload and not head.buffers):
            raise Dropped("malformed", "chunked head fields")
        total = plen + sum(buflens)
        if total > max_total:
            raise Dropped("oversized", f"a {total}-byte chunked message")
        self._head = head
        self._inner: tuple[int, Any, int] = (kind, body, pbufs)
        self._digest = digest
        lens = [plen, *buflens] if plen else [0, *buflens]
        self._views = [_alloc(n) for n in lens]
        self._at = [0, 0]  # target index, offset in it
        self.left = total
        self._skip_full()

    def _skip_full(self) -> None:
        at = self._at
        while at[0] < len(self._views) and at[1] == len(self._views[at[0]]):
            at[0] += 1
            at[1] = 0

    def feed(self, part: Envelope) -> Envelope | None:
        """Take one PART; the whole message once it is complete, else None.

        Raises:
            Dropped: ``malformed``: more bytes than the head announced, or a payload
                that does not match its digest.
        """
        frames: Sequence[Buffer] = part.buffers
        at = self._at
        for frame in frames:
            src = memoryview(frame).cast("B")
            pos = 0
            while pos < len(src):
                if at[0] >= len(self._views):
                    raise Dropped("malformed", "parts beyond their message")
                dst = self._views[at[0]]
                take = min(len(dst) - at[1], len(src) - pos)
                dst[at[1]:at[1] + take] = src[pos:pos + take]
                at[1] += take
                pos += take
                self._skip_full()
            self.left -= len(src)
        if self.left > 0:
            return None
        kind, body, pbufs = self._inner
        payload: Buffer = self._views[0] if len(self._views[0]) else b""
        if payload and not hmac.compare_digest(
                hashlib.blake2b(payload, digest_size=DIGEST_SIZE).digest(), self._digest):
            raise Dropped("malformed", "chunked payload does not match its digest")
        head = self._head
        return Envelope(kind, head.sender, head.receiver, head.seq, body, payload,
                        list(self._views[1:]), pbufs, head.version, part.ack)
