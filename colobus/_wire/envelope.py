"""Envelopes <-> ZeroMQ frames: layout, MAC, replay window, zero-copy buffers.

This module is pure: it never touches a socket. It trusts nothing it receives
until :func:`decode` has checked sizes and the MAC; only then is the header
unpacked. Only a worker unpickles payloads (:func:`loads`, on authenticated
envelopes from its controller); the controller never unpickles what a worker
sent: replies are msgpack (``_describe``) and raw buffers.

Frame layout of one envelope (fixed; no delimiter scanning)::

    0  header   msgpack array [version, kind, sender, receiver, seq, ack, buflens, pbufs, body]
    1  payload  cloudpickle bytes (controller to worker), msgpack (worker replies), or empty
    2  mac      32 bytes: keyed BLAKE2b over len(header)|header|len(payload)|payload
    3+ buffers  raw bytes (numpy data, pickle-5 out-of-band buffers), lengths in header

A BATCH envelope (kind 17) carries several messages to one peer in order: its
body is a list of ``[kind, body, payload_len, nbufs, pbufs]``, its payload the
messages' payloads back to back, its buffers theirs in order. One MAC and one
sequence number cover the batch; :func:`unpack_batch` splits it after
:func:`decode` authenticated it.

Buffer *contents* are not covered by the MAC (hashing gigabytes would halve the
transfer rate); their count and lengths are. They are never unpickled: they are
only ever viewed as numpy memory. Use CurveZMQ where the network is untrusted.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from .limits import (
    BATCH_MAX_BUFFERS,
    BATCH_MAX_BYTES,
    BATCH_MAX_ITEMS,
    BATCH_MAX_PAYLOAD,
    BODY_INLINE_MAX,
    COUNT_ABOVE,
    MAX_FRAMES,
    MAX_HEADER_BYTES,
    MAX_OBJECTS,
)
from .pickling import ByValue, StdPickler, dumps, loads, oob_callback
from .splice import array_header, pack_body, uint

__all__ = [
    "MAC_SIZE",
    "PROTOCOL_VERSION",
    "ByValue",
    "Dropped",
    "Envelope",
    "Outgoing",
    "StdPickler",
    "TooManyObjects",
    "batched",
    "decode",
    "decode_dtype",
    "dumps",
    "encode",
    "encode_dtype",
    "loads",
    "mac",
    "oob_callback",
    "pack_batch",
    "pack_body",
    "unpack_batch",
    "unpack_bounded",
]

PROTOCOL_VERSION = 13  # 2: BATCH envelopes; 3: acknowledgements (ack) in every header;
# 4: timings in RESULT, health in HEARTBEAT
# 5: challenged joins (JOIN, CHALLENGE), no pickles from workers
# 6: hosts count calls' queued and run times (asked in WELCOME, sent in HEARTBEAT)
# 7: bodies in the payload (header field 9), chunked messages (CHUNKED, PART), ACK,
#    REJECT with retry
# 8: resharding (RESHARD, PIECE, FETCH of a box); memory kinds in PUT; host counts
# 9: relays (a WELCOME may move the session to one; ADOPT, FORWARD, UP, GONE, READY)
# 10: FETCH modes (is_ready's probe; a wait for a call's outputs); FETCH waits until computed
# 11: HELLO must carry the worker's Python and colobus versions (refused without them);
#     the JAX job (FORM, WELCOME's jax_job); relays that connect (OFFER, SETUP)
# 12: a CALL on several hosts carries `spread` (a ninth field); a FORM of no processes;
#     a FETCH of one device's buffer (its device field); CALL's check field (a tenth:
#     check_replicas); a call's RESULT says whether its outputs were computed (times[2]);
#     COORD (the job's coordination over the link); IMPORT and MODULE
# 13: a call's RESULT answers the FETCH_CALL its host held for the call (times[3]: that
#     FETCH's id; not through a relay): an awaited step's wait needs no message of its own
BATCH_KIND = 17  # _protocol.Kind.BATCH (this module does not import the kinds)
MAC_SIZE = 32

_LEN = struct.Struct("<Q")

Buffer = bytes | memoryview


class Dropped(Exception):
    """An incoming message was dropped; ``reason`` names the counter to bump."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(slots=True)
class Envelope:
    """One authenticated message."""

    kind: int
    sender: bytes
    receiver: bytes
    seq: int
    body: Any
    payload: Buffer = b""
    buffers: list[Buffer] = field(default_factory=list)
    pbufs: int = 0  # the first ``pbufs`` buffers belong to the payload's pickle
    version: int = PROTOCOL_VERSION
    ack: int = 0  # the highest sequence number the sender has received from the receiver
    # ``body`` already msgpacked (a BATCH, packed once to check its size): ``encode``
    # splices these bytes into the header instead of packing the body again.
    packed_body: bytes | None = None


_ARRAY9 = b"\x99"  # msgpack: a fixarray of 9 elements (the header's fields)
_ARRAY10 = b"\x9a"  # ... of 10: the body travels at the head of the payload
_NIL = b"\xc0"
_KEYED: dict[bytes, Any] = {}  # key -> BLAKE2b state after the key block (a few keys)
_KEYED_MAX = 16


def mac_key(key: bytes) -> bytes:
    """The BLAKE2b key for ``key``: itself up to 64 bytes (BLAKE2b's limit), else a
    digest of all of it, so every byte of a longer key counts (never cut to 64)."""
    if len(key) <= 64:
        return key
    return hashlib.blake2b(key, digest_size=64, person=b"colobus-mac-key").digest()


def mac(key: bytes, header: Buffer, payload: Buffer) -> bytes:
    """Keyed BLAKE2b over the header and the payload, each with its length.

    The state after absorbing the key is made once per key and copied per
    message (a keyed BLAKE2b compresses a whole block for the key first).
    """
    keyed = _KEYED.get(key)
    if keyed is None:
        if len(_KEYED) >= _KEYED_MAX:
            _KEYED.clear()
        keyed = _KEYED[key] = hashlib.blake2b(key=mac_key(key), digest_size=MAC_SIZE)
    h = keyed.copy()
    h.update(_LEN.pack(len(header)))
    h.update(header)
    h.update(_LEN.pack(len(payload)))
    h.update(payload)
    return h.digest()


def _nbytes(b: Buffer) -> int:
    return b.nbytes if isinstance(b, memoryview) else len(b)


def encode(key: bytes, env: Envelope) -> list[Buffer]:
    """Frames for ``env`` (the caller prepends a routing identity where needed).

    A body packed larger than :data:`BODY_INLINE_MAX` (a RELEASE of many arrays, a
    CALL with many handles, a long batch) travels at the head of the payload, inside
    the MAC, and the header's tenth field gives its length: headers stay small
    whatever a message lists.
    """
    buflens = [_nbytes(b) for b in env.buffers]
    packed = env.packed_body
    if packed is None:
        packed = pack_body(env.body)
    head = msgpack.packb(
        [env.version, env.kind, env.sender, env.receiver, env.seq, env.ack, buflens,
         env.pbufs],
        use_bin_type=True,
    )
    payload = env.payload
    if len(packed) <= BODY_INLINE_MAX:
        # the same bytes as packing the 9 fields: an 8-array's fields and the ninth
        header = _ARRAY9 + head[1:] + packed
    else:
        header = _ARRAY10 + head[1:] + _NIL + msgpack.packb(len(packed))
        payload = packed + bytes(payload) if payload else packed
    return [header, payload, mac(key, header, payload), *env.buffers]


class TooManyObjects(ValueError):
    """A msgpack document holds more containers than its reader allows."""




def unpack_bounded(data: Buffer, max_objects: int = MAX_OBJECTS, **limits: Any) -> Any:
    """``msgpack.unpackb`` that stops once ``max_objects`` lists and maps were made.

    msgpack bounds each container's length, not how many there are: a 16 MiB
    document of nested empty lists is 16 million lists. Counting them (a hook per
    container) caps what a hostile document costs to a small multiple of the budget.

    Raises:
        TooManyObjects: more containers than ``max_objects``.
        ValueError, TypeError, msgpack's exceptions: not msgpack.
    """
    left = max_objects

    def count(obj: Any) -> Any:
        nonlocal left
        left -= 1
        if left < 0:
            raise TooManyObjects(f"more than {max_objects} lists and maps")
        return obj

    return msgpack.unpackb(data, raw=False, use_list=True, list_hook=count, object_hook=count,
                           **limits)


def _frame_bytes(frame: Any) -> Buffer:
    # zmq.Frame exposes .buffer (a memoryview on the message); plain bytes pass.
    buf = getattr(frame, "buffer", None)
    return buf if buf is not None else frame  # type: ignore[no-any-return]


def decode(
    key: bytes, frames: Sequence[Any], *, max_payload: int = 1 << 40,
    max_total: int | None = None, max_frames: int = MAX_FRAMES,
    max_body: int = 1 << 40, max_objects: int | None = None,
) -> Envelope:
    """Authenticate and unpack ``frames``; raise :class:`Dropped` on anything wrong.

    Nothing is unpickled here. Sizes are checked from the frame lengths first
    (``max_total``: all frames together), then the MAC, and only then is the
    header parsed. ``max_body`` bounds a body carried in the payload, ``max_objects``
    the lists and maps a header or body over 4 KiB may make (None: no bound, for
    what a controller sends its workers).
    """
    if len(frames) < 3:
        raise Dropped("malformed", f"{len(frames)} frames")
    if len(frames) > max_frames:
        raise Dropped("oversized", f"{len(frames)} frames")
    header = _frame_bytes(frames[0])
    payload = _frame_bytes(frames[1])
    tag = _frame_bytes(frames[2])
    if _nbytes(header) > MAX_HEADER_BYTES or _nbytes(payload) > max_payload:
        raise Dropped("oversized")
    if max_total is not None:
        total = sum(_nbytes(_frame_bytes(f)) for f in frames)
        if total > max_total:
            raise Dropped("oversized", f"{total} bytes")
    if _nbytes(tag) != MAC_SIZE:
        raise Dropped("malformed", "bad mac frame")
    if not hmac.compare_digest(mac(key, header, payload), bytes(tag)):
        raise Dropped("unauthenticated")
    try:
        fields = (msgpack.unpackb(header, raw=False, use_list=True)
                  if max_objects is None or _nbytes(header) <= COUNT_ABOVE
                  else unpack_bounded(header, max_objects))
        if isinstance(fields, list) and len(fields) == 8:  # protocol 2: no ack (version check)
            fields.insert(5, 0)
        body_len = fields.pop() if isinstance(fields, list) and len(fields) == 10 else None
        version, kind, sender, receiver, seq, ack, buflens, pbufs, body = fields
    except Exception as exc:  # msgpack raises several types on garbage
        raise Dropped("malformed", f"header: {exc}") from None
    if body_len is not None:  # the body heads the payload (inside the MAC)
        if not (type(body_len) is int and body is None and 0 < body_len <= _nbytes(payload)):
            raise Dropped("malformed", "body length")
        if body_len > max_body:
            raise Dropped("oversized", f"a {body_len}-byte body")
        view = memoryview(payload)
        try:
            body = (msgpack.unpackb(view[:body_len], raw=False, use_list=True)
                    if max_objects is None else unpack_bounded(view[:body_len], max_objects))
        except Exception as exc:
            raise Dropped("malformed", f"body: {exc}") from None
        payload = view[body_len:] if body_len < len(view) else b""
    if not (
        isinstance(version, int)
        and isinstance(kind, int)
        and isinstance(sender, bytes)
        and isinstance(receiver, bytes)
        and isinstance(seq, int)
        and isinstance(ack, int)
        and isinstance(buflens, list)
        and isinstance(pbufs, int)
    ):
        raise Dropped("malformed", "header field types")
    buffers = [_frame_bytes(f) for f in frames[3:]]
    if len(buffers) != len(buflens) or not 0 <= pbufs <= len(buffers):
        raise Dropped("malformed", "buffer count")
    for b, n in zip(buffers, buflens, strict=True):
        if _nbytes(b) != n:
            raise Dropped("malformed", "buffer length")
    return Envelope(kind, sender, receiver, seq, body, payload, buffers, pbufs, version, ack)


# -- batches ----------------------------------------------------------------------------

# One message waiting to be sent: (kind, body, payload, buffers, pbufs); the body as
# packed by :func:`pack_body` (a channel packs it when the message is queued, so what
# cannot be encoded fails there), or as its wire list.
Outgoing = tuple[int, Any, Buffer, Sequence[Buffer], int]


def pack_batch(items: Sequence[Outgoing]) -> tuple[list[Any], bytes, list[Buffer]]:
    """The body, payload and buffers of one BATCH envelope carrying ``items`` in order."""
    entries: list[Any] = []
    payloads: list[Buffer] = []
    buffers: list[Buffer] = []
    for kind, body, payload, bufs, pbufs in items:
        entries.append([kind, body, _nbytes(payload), len(bufs), pbufs])
        if payload:
            payloads.append(payload)
        buffers.extend(bufs)
    return entries, b"".join(payloads), buffers


# A message of BATCH_MAX_PAYLOAD or more (body, payload and buffers together) travels
# alone, not copied into a batch; and a batch stops short of BATCH_MAX_BYTES and
# BATCH_MAX_BUFFERS frames, so it never nears a receiver's limits (.limits).


def _packed(item: Outgoing) -> Outgoing:
    kind, body, payload, bufs, pbufs = item
    return item if type(body) is bytes else (kind, pack_body(body), payload, bufs, pbufs)


def _size(item: Outgoing) -> int:
    return len(item[1]) + _nbytes(item[2]) + sum(_nbytes(b) for b in item[3])


def batched(items: Sequence[Outgoing], sender: bytes, receiver: bytes) -> list[Envelope]:
    """Envelopes (sequence numbers not set) carrying ``items`` in order, batched where
    several fit together: a lone message, or a large one, travels as itself."""
    if len(items) == 1:  # the common case: one message, as itself
        return [_single(_packed(items[0]), sender, receiver)]
    out: list[Envelope] = []
    run: list[Outgoing] = []
    run_bytes = run_bufs = 0

    def close_run() -> None:
        if len(run) == 1:
            out.append(_single(run[0], sender, receiver))
        elif run:
            entries, payload, buffers = pack_batch(run)
            parts = [array_header(len(run))]
            for kind, body, p, bufs, pbufs in run:  # the entries, spliced from packed bodies
                parts += (b"\x95", uint(kind), body, uint(_nbytes(p)), uint(len(bufs)),
                          uint(pbufs))
            out.append(Envelope(BATCH_KIND, sender, receiver, 0, entries, payload, buffers,
                                packed_body=b"".join(parts)))
        run.clear()

    for item in map(_packed, items):
        size = _size(item)
        if size >= BATCH_MAX_PAYLOAD:
            close_run()
            run_bytes = run_bufs = 0
            out.append(_single(item, sender, receiver))
            continue
        if run and (len(run) >= BATCH_MAX_ITEMS or run_bytes + size > BATCH_MAX_BYTES
                    or run_bufs + len(item[3]) > BATCH_MAX_BUFFERS):
            close_run()
            run_bytes = run_bufs = 0
        run.append(item)
        run_bytes += size + 16
        run_bufs += len(item[3])
    close_run()
    return out


def _single(item: Outgoing, sender: bytes, receiver: bytes) -> Envelope:
    kind, body, payload, bufs, pbufs = item
    return Envelope(kind, sender, receiver, 0, None, payload, list(bufs), pbufs,
                    packed_body=body)


def unpack_batch(env: Envelope) -> list[Envelope]:
    """The messages of an authenticated BATCH envelope, in order.

    Raises:
        Dropped: ``malformed`` if the entries do not describe exactly the
            envelope's payload and buffers, or nest another batch.
    """
    entries = env.body
    if not isinstance(entries, list) or not entries:
        raise Dropped("malformed", "batch body")
    view = memoryview(env.payload)
    total, buffers = len(view), env.buffers
    nbuf = len(buffers)
    out: list[Envelope] = []
    at = nb = 0
    for entry in entries:
        if not ((type(entry) is list or isinstance(entry, list)) and len(entry) == 5):
            raise Dropped("malformed", "batch entry")
        kind, body, plen, nbufs, pbufs = entry
        if not (type(kind) is int and type(plen) is int and type(nbufs) is int
                and type(pbufs) is int and kind != BATCH_KIND and plen >= 0
                and 0 <= pbufs <= nbufs):
            raise Dropped("malformed", "batch entry fields")
        if at + plen > total or nb + nbufs > nbuf:
            raise Dropped("malformed", "batch lengths")
        payload: Buffer = view[at:at + plen] if plen else b""
        out.append(Envelope(kind, env.sender, env.receiver, env.seq, body, payload,
                            buffers[nb:nb + nbufs], pbufs, env.version, env.ack))
        at += plen
        nb += nbufs
    if at != total or nb != nbuf:
        raise Dropped("malformed", "batch lengths")
    return out


# -- dtypes on the wire (no pickle) -----------------------------------------------------


def encode_dtype(dtype: np.dtype[Any]) -> Any:
    """A msgpack-able description of ``dtype``.

    ``ml_dtypes`` types (``bfloat16``, ``float8_*``, ``int4``...) travel by name:
    numpy's own description of them is an anonymous ``V2`` that would lose the type.
    """
    if isinstance(dtype, np.dtypes.StringDType):
        return "T"
    if dtype.fields is None and _is_ml(dtype):
        return ["ml_dtypes", dtype.name]
    if _has_ml_field(dtype):
        raise ValueError(
            f"structured dtype {dtype} has an ml_dtypes field, which would arrive as raw "
            "bytes; send that field as an array of its own")
    return np.lib.format.dtype_to_descr(dtype)


def _is_ml(dtype: np.dtype[Any]) -> bool:
    return dtype.type.__module__.split(".")[0] == "ml_dtypes"


def _has_ml_field(dtype: np.dtype[Any]) -> bool:
    if dtype.subdtype is not None:
        return _has_ml_field(dtype.subdtype[0])
    if dtype.fields is None:
        return _is_ml(dtype)
    return any(_has_ml_field(f[0]) for f in dtype.fields.values())


def _ml_dtype(name: Any) -> np.dtype[Any]:
    """An ``ml_dtypes`` type by name, checked (the name comes off the wire)."""
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        raise ValueError(f"bad ml_dtypes name {name!r}")
    import ml_dtypes

    try:
        dt: np.dtype[Any] = np.dtype(getattr(ml_dtypes, name))
    except (AttributeError, TypeError) as exc:
        raise ValueError(f"unknown ml_dtypes type {name!r}") from exc
    if not _is_ml(dt):
        raise ValueError(f"{name!r} is not an ml_dtypes type")
    return dt


def decode_dtype(descr: Any) -> np.dtype[Any]:
    """Inverse of :func:`encode_dtype`; raises ``ValueError`` on garbage."""
    if descr == "T":
        return np.dtype(np.dtypes.StringDType())
    if isinstance(descr, list) and len(descr) == 2 and descr[0] == "ml_dtypes":
        return _ml_dtype(descr[1])
    try:
        dt = np.lib.format.descr_to_dtype(descr)
    except Exception as exc:
        raise ValueError(f"bad dtype description {descr!r}") from exc
    if dt.hasobject:
        raise ValueError("object dtypes do not travel")
    return dt
