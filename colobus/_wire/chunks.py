"""Large messages in chunks, so that nothing waits behind one message on a slow link.

A message whose payload and buffers together pass the peer's part size
(:func:`part_size`: a quarter of its send window, from :data:`CHUNK_BYTES` to
:data:`MAX_PART`) leaves as a ``CHUNKED`` head and ``PART`` envelopes, cut by a
:class:`Splitter` as the window makes room (so parts grow with the window). The
head carries the message's kind, body, buffer lengths and payload length, and a
BLAKE2b digest of the payload (the head is MAC-checked like any header, so the
payload, which travels in the parts' unauthenticated frames, is checked against
the digest before anything reads it). Each ``PART`` carries the next bytes of
the payload then the buffers, back to back, as zero-copy slices of the sender's
memory; a buffer that fits in a part is not cut across two. Each is an envelope
of its own: numbered, acknowledged and, if lost, sent again on its own;
heartbeats and acknowledgements travel between them, so how long the whole
message takes never decides liveness.

The receiver (:class:`Assembly`) keeps a buffer that arrives whole in one part as
that part's frame (no copy), and writes the others into buffers allocated from
the head's lengths (bounded by the receiver's limit) -- one copy, at memory
speed -- and hands on the whole message once the last part is in. Until then,
nothing but heartbeats may come between the parts: the sender keeps other
messages behind the chunked one, in order.
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

from .envelope import Buffer, Dropped, Envelope, pack_body
from .limits import CHUNK_BYTES, MAX_BUFFERS, MAX_PART

__all__ = ["ACK_KIND", "CHUNKED_KIND", "CHUNK_BYTES", "MAX_PART", "PART_KIND", "Assembly",
           "Splitter", "envelope_bytes", "part_size", "split"]

CHUNKED_KIND = 20  # protocol.Kind.CHUNKED: the head of a message sent in parts
PART_KIND = 21  # protocol.Kind.PART: the next bytes of that message
ACK_KIND = 22  # protocol.Kind.ACK: acknowledgement only, outside the numbering
# CHUNK_BYTES (.limits), the smallest part: a heartbeat waits behind at most a few of
# them on a slow link (256 KiB is 26 ms at 80 Mbit/s). MAX_PART, the largest: under the
# controller's 4 MiB frame limit (ZMQ_MAXMSGSIZE), with room for the header;
# per-envelope costs (both loops, the acknowledgement) are noise at that size.
DIGEST_SIZE = 32

_ARRAY6 = b"\x96"


def _nbytes(b: Buffer) -> int:
    return b.nbytes if isinstance(b, memoryview) else len(b)


def envelope_bytes(env: Envelope) -> int:
    """What ``env`` carries besides its header: payload and buffers."""
    return _nbytes(env.payload) + sum(_nbytes(b) for b in env.buffers)


def part_size(window: int, cap: int = MAX_PART) -> int:
    """Bytes per part for a peer whose send window is ``window`` (and the most a
    message to it travels whole): a quarter of the window, from CHUNK_BYTES to ``cap``.

    The window already bounds what waits ahead of a heartbeat; a quarter of it per
    part keeps several parts in flight.
    """
    return max(CHUNK_BYTES, min(cap, window >> 2))


class Splitter:
    """One message leaving in parts: its CHUNKED head first, then PARTs of the size
    asked for each time (sequence numbers not set)."""

    __slots__ = ("_at", "_env", "_head", "_i", "_srcs")

    def __init__(self, env: Envelope) -> None:
        payload = env.payload
        plen = _nbytes(payload)
        buflens = [_nbytes(b) for b in env.buffers]
        digest = hashlib.blake2b(payload, digest_size=DIGEST_SIZE).digest() if plen else b""
        body = env.packed_body if env.packed_body is not None else pack_body(env.body)
        head_body = b"".join((_ARRAY6, msgpack.packb(env.kind), body, msgpack.packb(env.pbufs),
                              msgpack.packb(buflens), msgpack.packb(plen),
                              msgpack.packb(digest, use_bin_type=True)))
        self._env = env
        self._head: Envelope | None = Envelope(CHUNKED_KIND, env.sender, env.receiver, 0, None,
                                               packed_body=head_body)
        srcs = ([payload] if plen else []) + list(env.buffers)
        self._srcs = [memoryview(b).cast("B") for b in srcs if _nbytes(b)]
        self._i = self._at = 0  # the source the next part starts in, and where in it

    @property
    def done(self) -> bool:
        return self._head is None and self._i >= len(self._srcs)

    def next(self, size: int) -> Envelope:
        """The head, or the next part of about ``size`` bytes (never more)."""
        head = self._head
        if head is not None:
            self._head = None
            return head
        frames: list[Buffer] = []
        room = size
        srcs = self._srcs
        while room > 0 and self._i < len(srcs):
            view = srcs[self._i]
            left = len(view) - self._at
            if left > room and frames and len(view) <= size and self._at == 0:
                break  # it fits whole in the next part: not cut across two
            take = min(room, left)
            frames.append(view[self._at:self._at + take] if take < len(view) else view)
            room -= take
            self._at += take
            if self._at == len(view):
                self._i += 1
                self._at = 0
        return _part(self._env, frames)


def split(env: Envelope, chunk: int = CHUNK_BYTES) -> list[Envelope]:
    """``env`` as a CHUNKED head and its PARTs of ``chunk`` bytes (sequence numbers not set)."""
    splitter = Splitter(env)
    out = []
    while not splitter.done:
        out.append(splitter.next(chunk))
    return out


_EMPTY_BODY = msgpack.packb([])


def _part(env: Envelope, frames: list[Buffer]) -> Envelope:
    return Envelope(PART_KIND, env.sender, env.receiver, 0, None, b"", frames,
                    packed_body=_EMPTY_BODY)


_EMPTY = memoryview(b"")
HUGE_FROM = 1 << 21  # buffers this large are mapped for transparent huge pages


def _alloc(n: int) -> memoryview:
    """Writable memory for ``n`` received bytes. Large buffers are private anonymous
    mappings that ask for transparent huge pages: writing 256 MiB then faults 128
    pages in, not 65536 (on the loop thread, where the parts are copied, that is most
    of the copy's cost). Private, not ``mmap.mmap(-1, n)``'s default shared mapping:
    shared anonymous memory is shmem, which takes no huge pages under the usual
    ``madvise`` setting (64 MiB filled at 1.1 GB/s shared, 7 GB/s private, here)."""
    if n < HUGE_FROM:
        return np.empty(n, np.uint8).data
    private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    mm = mmap.mmap(-1, n, flags=private) if private else mmap.mmap(-1, n)
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

    __slots__ = ("_at", "_digest", "_head", "_inner", "_lens", "_views", "left")

    def __init__(self, head: Envelope, max_total: int) -> None:
        raw = head.body
        if not (isinstance(raw, list) and len(raw) == 6):
            raise Dropped("malformed", "chunked head")
        kind, body, pbufs, buflens, plen, digest = raw
        if not (type(kind) is int and kind not in (CHUNKED_KIND, PART_KIND, ACK_KIND)
                and type(pbufs) is int and isinstance(buflens, list)
                and len(buflens) <= MAX_BUFFERS and all(type(n) is int and n >= 0 for n in buflens)
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
        self._lens = [plen, *buflens] if plen else [0, *buflens]
        # each target: a view of the frame it arrived whole in, or memory the parts fill
        self._views: list[memoryview | None] = [None if n else _EMPTY for n in self._lens]
        self._at = [0, 0]  # target index, offset in it
        self.left = total
        self._skip_full()

    def _skip_full(self) -> None:
        at = self._at
        lens = self._lens
        while at[0] < len(lens) and at[1] == lens[at[0]]:
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
        lens, views = self._lens, self._views
        for frame in frames:
            src = memoryview(frame).cast("B")
            pos = 0
            while pos < len(src):
                i = at[0]
                if i >= len(lens):
                    raise Dropped("malformed", "parts beyond their message")
                take = min(lens[i] - at[1], len(src) - pos)
                if at[1] == 0 and take == lens[i]:  # it came whole: keep the frame's bytes
                    views[i] = src[pos:pos + take] if take < len(src) else src
                else:
                    dst = views[i]
                    if dst is None:
                        dst = views[i] = _alloc(lens[i])
                    dst[at[1]:at[1] + take] = src[pos:pos + take]
                at[1] += take
                pos += take
                self._skip_full()
            self.left -= len(src)
        if self.left > 0:
            return None
        kind, body, pbufs = self._inner
        whole: list[Buffer] = [v if v is not None else _EMPTY for v in views]
        payload: Buffer = whole[0] if len(whole[0]) else b""
        if payload and not hmac.compare_digest(
                hashlib.blake2b(payload, digest_size=DIGEST_SIZE).digest(), self._digest):
            raise Dropped("malformed", "chunked payload does not match its digest")
        head = self._head
        return Envelope(kind, head.sender, head.receiver, head.seq, body, payload,
                        whole[1:], pbufs, head.version, part.ack)
