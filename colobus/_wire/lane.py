"""The common message's lane: envelopes encoded, batched and decoded in few Python calls.

Every call is at least two messages, and most carry a free riding ahead of them (a
BATCH of two). :mod:`colobus._wire.envelope` writes and reads them with small helpers
(a length, a frame's bytes, a packed integer: one Python call each, a dozen per
message); the functions here do the same work in one function each, with the same
bytes on the wire and the same checks, in the same order, on what comes in
(``tests/test_wire.py`` and ``tests/test_lane.py`` compare them). Which ones the
channels use is chosen at import: ``COLOBUS_CALL_LANE=0`` keeps the helpers'
versions (to compare, or to rule the lane out).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq

from . import envelope as E
from .envelope import (
    _ARRAY9,
    _ARRAY10,
    _KEYED,
    _KEYED_MAX,
    _LEN,
    _NIL,
    BATCH_KIND,
    MAC_SIZE,
    PROTOCOL_VERSION,
    Buffer,
    Dropped,
    Envelope,
    Outgoing,
    mac_key,
    unpack_bounded,
)
from .limits import (
    BATCH_MAX_BUFFERS,
    BATCH_MAX_BYTES,
    BATCH_MAX_ITEMS,
    BATCH_MAX_PAYLOAD,
    BODY_INLINE_MAX,
    COUNT_ABOVE,
    MAX_FRAMES,
    MAX_HEADER_BYTES,
)
from .peer import HEARTBEAT_KIND
from .splice import pack_body

__all__ = ["ON", "batched", "decode", "encode", "envelope_bytes", "fast_one_envelope", "pack"]

ON = os.environ.get("COLOBUS_CALL_LANE", "1") != "0"

# what msgpack.packb does, without its call (the packer resets itself, on errors too)
_pack = pack = msgpack.Packer(use_bin_type=True).pack
_unpack = msgpack.unpackb
_Frame = zmq.Frame
_UINTS = [msgpack.packb(i) for i in range(128)]
_compare = hmac.compare_digest


def _keyed(key: bytes) -> Any:
    keyed = _KEYED.get(key)
    if keyed is None:
        if len(_KEYED) >= _KEYED_MAX:
            _KEYED.clear()
        import hashlib

        keyed = _KEYED[key] = hashlib.blake2b(key=mac_key(key), digest_size=MAC_SIZE)
    return keyed


def fast_encode(key: bytes, env: Envelope) -> list[Buffer]:
    """:func:`colobus._wire.envelope.encode`, the same frames."""
    bufs = env.buffers
    buflens = []
    for b in bufs:
        buflens.append(b.nbytes if type(b) is memoryview else len(b))
    packed = env.packed_body
    if packed is None:
        packed = pack_body(env.body)
    head = _pack([env.version, env.kind, env.sender, env.receiver, env.seq, env.ack, buflens,
                  env.pbufs])
    payload = env.payload
    if len(packed) <= BODY_INLINE_MAX:
        header = _ARRAY9 + head[1:] + packed
    else:
        header = _ARRAY10 + head[1:] + _NIL + _pack(len(packed))
        payload = packed + bytes(payload) if payload else packed
    keyed = _KEYED.get(key)
    h = (keyed if keyed is not None else _keyed(key)).copy()
    h.update(_LEN.pack(len(header)))
    h.update(header)
    h.update(_LEN.pack(payload.nbytes if type(payload) is memoryview else len(payload)))
    h.update(payload)
    if bufs:
        return [header, payload, h.digest(), *bufs]
    return [header, payload, h.digest()]


def fast_batched(items: Sequence[Outgoing], sender: bytes, receiver: bytes) -> list[Envelope]:
    """:func:`colobus._wire.envelope.batched`, the same envelopes."""
    if len(items) == 1:
        kind, body, payload, bufs, pbufs = items[0]
        return [Envelope(kind, sender, receiver, 0, None, payload, list(bufs), pbufs,
                         packed_body=body if type(body) is bytes else pack_body(body))]
    out: list[Envelope] = []
    run: list[Outgoing] = []
    run_bytes = run_bufs = 0
    for kind, body, payload, bufs, pbufs in items:
        if type(body) is not bytes:
            body = pack_body(body)
        plen = payload.nbytes if type(payload) is memoryview else len(payload)
        size = len(body) + plen
        for b in bufs:
            size += b.nbytes if type(b) is memoryview else len(b)
        item = (kind, body, payload, bufs, pbufs)
        if size >= BATCH_MAX_PAYLOAD:
            if run:
                _close(run, out, sender, receiver)
                run = []
            run_bytes = run_bufs = 0
            out.append(Envelope(kind, sender, receiver, 0, None, payload, list(bufs), pbufs,
                                packed_body=body))
            continue
        if run and (len(run) >= BATCH_MAX_ITEMS or run_bytes + size > BATCH_MAX_BYTES
                    or run_bufs + len(bufs) > BATCH_MAX_BUFFERS):
            _close(run, out, sender, receiver)
            run = []
            run_bytes = run_bufs = 0
        run.append(item)
        run_bytes += size + 16
        run_bufs += len(bufs)
    if run:
        _close(run, out, sender, receiver)
    return out


def _close(run: list[Outgoing], out: list[Envelope], sender: bytes, receiver: bytes) -> None:
    """One run of messages as one envelope: itself alone, else a BATCH."""
    if len(run) == 1:
        kind, body, payload, bufs, pbufs = run[0]
        out.append(Envelope(kind, sender, receiver, 0, None, payload, list(bufs), pbufs,
                            packed_body=body))
        return
    n = len(run)
    parts = [bytes((0x90 | n,)) if n < 16 else
             b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4, "big")]
    entries: list[Any] = []
    payloads: list[Buffer] = []
    buffers: list[Buffer] = []
    uints = _UINTS
    for kind, body, payload, bufs, pbufs in run:
        plen = payload.nbytes if type(payload) is memoryview else len(payload)
        nb = len(bufs)
        entries.append([kind, body, plen, nb, pbufs])
        parts += (b"\x95", uints[kind] if kind < 128 else _pack(kind), body,
                  uints[plen] if plen < 128 else _pack(plen),
                  uints[nb] if nb < 128 else _pack(nb),
                  uints[pbufs] if pbufs < 128 else _pack(pbufs))
        if plen:
            payloads.append(payload)
        if nb:
            buffers.extend(bufs)
    out.append(Envelope(BATCH_KIND, sender, receiver, 0, entries, b"".join(payloads), buffers,
                        packed_body=b"".join(parts)))


def fast_one_envelope(key: bytes, items: Sequence[Outgoing], sender: bytes, receiver: bytes,
                      seq: int, ack: int, whole: int,
                      ) -> tuple[list[Buffer], int, int, int, bool] | None:
    """What a channel sends of ``items`` when they leave as one envelope, whole: the
    frames of ``encode(key, env)`` for the one envelope :func:`fast_batched` makes of
    them, numbered ``seq`` with ``ack``; with the frames' size in bytes, the envelope's
    :func:`fast_envelope_bytes`, the payload frame's size, and whether it is a BATCH.
    None (nothing spent) when they would not: more than one envelope, a heartbeat among
    several (it leaves first, on its own), a body not packed yet, or a message over
    ``whole`` bytes (it travels in parts). ``tests/test_lane.py`` compares it with the
    general path."""
    n = len(items)
    bufsum = 0
    if n == 1:
        kind, body, payload, bufs, pbufs = items[0]
        if type(body) is not bytes:
            return None
        plen = payload.nbytes if type(payload) is memoryview else len(payload)
        buflens = []
        for b in bufs:
            m = b.nbytes if type(b) is memoryview else len(b)
            buflens.append(m)
            bufsum += m
    else:
        if n > BATCH_MAX_ITEMS:
            return None
        kind, pbufs = BATCH_KIND, 0
        parts = [bytes((0x90 | n,)) if n < 16 else b"\xdc" + n.to_bytes(2, "big")]
        payloads: list[Buffer] = []
        buffers: list[Buffer] = []
        buflens = []
        uints = _UINTS
        run_bytes = plen = 0
        for k, b, p, bs, pb in items:
            if type(b) is not bytes or k == HEARTBEAT_KIND:
                return None
            pl = p.nbytes if type(p) is memoryview else len(p)
            size = len(b) + pl
            nb = 0
            if bs:
                nb = len(bs)
                for x in bs:
                    m = x.nbytes if type(x) is memoryview else len(x)
                    buflens.append(m)
                    size += m
                    bufsum += m
            if size >= BATCH_MAX_PAYLOAD or (run_bytes and run_bytes + size > BATCH_MAX_BYTES):
                return None  # (fast_batched would start another envelope)
            run_bytes += size + 16
            parts += (b"\x95", uints[k] if k < 128 else _pack(k), b,
                      uints[pl] if pl < 128 else _pack(pl),
                      uints[nb] if nb < 128 else _pack(nb),
                      uints[pb] if pb < 128 else _pack(pb))
            if pl:
                payloads.append(p)
                plen += pl
                last = p
            if nb:
                buffers.extend(bs)
        if buffers and len(buffers) > BATCH_MAX_BUFFERS:
            return None
        body = b"".join(parts)
        # (one payload among them, the common case, is itself: no join; as bytes)
        payload = (b"" if not plen else b"".join(payloads) if len(payloads) > 1
                   or type(last) is not bytes else last)
        bufs = buffers
    data = plen + bufsum
    blen = len(body)
    if data and data + blen > whole:
        return None
    head = _pack([PROTOCOL_VERSION, kind, sender, receiver, seq, ack, buflens, pbufs])
    if blen <= BODY_INLINE_MAX:
        header = _ARRAY9 + head[1:] + body
    else:
        header = _ARRAY10 + head[1:] + _NIL + _pack(blen)
        payload = body + bytes(payload) if payload else body
        plen += blen
    hlen = len(header)
    keyed = _KEYED.get(key)
    h = (keyed if keyed is not None else _keyed(key)).copy()
    h.update(_LEN.pack(hlen) + header)  # (the same bytes hashed: mac() updates four times)
    if type(payload) is bytes and plen < 4096:
        h.update(_LEN.pack(plen) + payload)
    else:
        h.update(_LEN.pack(plen))
        h.update(payload)
    size = hlen + plen + MAC_SIZE + bufsum
    if bufs:
        return [header, payload, h.digest(), *bufs], size, data, plen, n > 1
    return [header, payload, h.digest()], size, data, plen, n > 1


def fast_envelope_bytes(env: Envelope) -> int:
    """:func:`colobus._wire.chunks.envelope_bytes`: payload and buffers."""
    p = env.payload
    n = p.nbytes if type(p) is memoryview else len(p)
    for b in env.buffers:
        n += b.nbytes if type(b) is memoryview else len(b)
    return n


def fast_decode(
    key: bytes, frames: Sequence[Any], *, max_payload: int = 1 << 40,
    max_total: int | None = None, max_frames: int = MAX_FRAMES,
    max_body: int = 1 << 40, max_objects: int | None = None,
) -> Envelope:
    """:func:`colobus._wire.envelope.decode`: the same checks, in the same order."""
    nframes = len(frames)
    if nframes < 3:
        raise Dropped("malformed", f"{nframes} frames")
    if nframes > max_frames:
        raise Dropped("oversized", f"{nframes} frames")
    f = frames[0]
    header = f.buffer if type(f) is _Frame else E._frame_bytes(f)
    f = frames[1]
    payload = f.buffer if type(f) is _Frame else E._frame_bytes(f)
    f = frames[2]
    tag = f.buffer if type(f) is _Frame else E._frame_bytes(f)
    hlen = header.nbytes if type(header) is memoryview else len(header)
    plen = payload.nbytes if type(payload) is memoryview else len(payload)
    if hlen > MAX_HEADER_BYTES or plen > max_payload:
        raise Dropped("oversized")
    if max_total is not None:
        total = hlen + plen
        for f in frames[2:]:
            b = f.buffer if type(f) is _Frame else E._frame_bytes(f)
            total += b.nbytes if type(b) is memoryview else len(b)
        if total > max_total:
            raise Dropped("oversized", f"{total} bytes")
    if (tag.nbytes if type(tag) is memoryview else len(tag)) != MAC_SIZE:
        raise Dropped("malformed", "bad mac frame")
    keyed = _KEYED.get(key)
    h = (keyed if keyed is not None else _keyed(key)).copy()
    # (the same bytes as four updates: the lengths and the header in one)
    h.update(_LEN.pack(hlen) + header + _LEN.pack(plen))
    if plen:
        h.update(payload)
    if not _compare(h.digest(), bytes(tag)):
        raise Dropped("unauthenticated")
    try:
        fields = (_unpack(header, raw=False, use_list=True)
                  if max_objects is None or hlen <= COUNT_ABOVE
                  else unpack_bounded(header, max_objects))
        nfields = len(fields) if type(fields) is list or isinstance(fields, list) else 0
        if nfields == 8:  # protocol 2: no ack (version check)
            fields.insert(5, 0)
            nfields = 9
        body_len = fields.pop() if nfields == 10 else None
        version, kind, sender, receiver, seq, ack, buflens, pbufs, body = fields
    except Exception as exc:  # msgpack raises several types on garbage
        raise Dropped("malformed", f"header: {exc}") from None
    if body_len is not None:  # the body heads the payload (inside the MAC)
        if not (type(body_len) is int and body is None and 0 < body_len <= plen):
            raise Dropped("malformed", "body length")
        if body_len > max_body:
            raise Dropped("oversized", f"a {body_len}-byte body")
        view = memoryview(payload)
        try:
            body = (_unpack(view[:body_len], raw=False, use_list=True)
                    if max_objects is None else unpack_bounded(view[:body_len], max_objects))
        except Exception as exc:
            raise Dropped("malformed", f"body: {exc}") from None
        payload = view[body_len:] if body_len < len(view) else b""
    if not ((type(version) is int or isinstance(version, int))
            and (type(kind) is int or isinstance(kind, int))
            and (type(sender) is bytes or isinstance(sender, bytes))
            and (type(receiver) is bytes or isinstance(receiver, bytes))
            and (type(seq) is int or isinstance(seq, int))
            and (type(ack) is int or isinstance(ack, int))
            and (type(buflens) is list or isinstance(buflens, list))
            and (type(pbufs) is int or isinstance(pbufs, int))):
        raise Dropped("malformed", "header field types")
    buffers: list[Buffer] = []
    if nframes == 3:  # (the checks below, for no buffers)
        if buflens or pbufs != 0:
            raise Dropped("malformed", "buffer count")
        return Envelope(kind, sender, receiver, seq, body, payload, buffers, pbufs, version,
                        ack)
    for f in frames[3:]:
        buffers.append(f.buffer if type(f) is _Frame else E._frame_bytes(f))
    if len(buffers) != len(buflens) or not 0 <= pbufs <= len(buffers):
        raise Dropped("malformed", "buffer count")
    for b, n in zip(buffers, buflens, strict=True):
        if (b.nbytes if type(b) is memoryview else len(b)) != n:
            raise Dropped("malformed", "buffer length")
    return Envelope(kind, sender, receiver, seq, body, payload, buffers, pbufs, version, ack)


if ON:
    encode, batched, decode, envelope_bytes = (fast_encode, fast_batched, fast_decode,
                                               fast_envelope_bytes)
else:
    from .chunks import envelope_bytes

    encode, batched, decode = E.encode, E.batched, E.decode
