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
import io
import pickle
import struct
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import msgpack
import numpy as np
from cloudpickle.cloudpickle import _should_pickle_by_reference

__all__ = [
    "MAC_SIZE",
    "PROTOCOL_VERSION",
    "ByValue",
    "Dropped",
    "Envelope",
    "Outgoing",
    "StdPickler",
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
    "unpack_batch",
]

PROTOCOL_VERSION = 7  # 2: BATCH envelopes; 3: acknowledgements (ack) in every header;
# 4: timings in RESULT, health in HEARTBEAT
# 5: challenged joins (JOIN, CHALLENGE), no pickles from workers
# 6: hosts count calls' queued and run times (asked in WELCOME, sent in HEARTBEAT)
# 7: resharding (RESHARD, PIECE, FETCH of a box); memory kinds in PUT; host counts
BATCH_KIND = 17  # _protocol.Kind.BATCH (this module does not import the kinds)
MAC_SIZE = 32
MAX_HEADER_BYTES = 1 << 20
MAX_FRAMES = 1 << 16  # frames in one envelope (a batch's buffers included)
# Out-of-band pickle buffers below this size stay in the pickle (a copy is cheaper
# than a frame); the same threshold pyzmq uses to decide zero-copy sends.
OOB_THRESHOLD = 1 << 16

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
_KEYED: dict[bytes, Any] = {}  # key -> BLAKE2b state after the key block (a few keys)
_KEYED_MAX = 16


def mac(key: bytes, header: Buffer, payload: Buffer) -> bytes:
    """Keyed BLAKE2b over the header and the payload, each with its length.

    The state after absorbing the key is made once per key and copied per
    message (a keyed BLAKE2b compresses a whole block for the key first).
    """
    keyed = _KEYED.get(key)
    if keyed is None:
        if len(_KEYED) >= _KEYED_MAX:
            _KEYED.clear()
        keyed = _KEYED[key] = hashlib.blake2b(key=key[:64], digest_size=MAC_SIZE)
    h = keyed.copy()
    h.update(_LEN.pack(len(header)))
    h.update(header)
    h.update(_LEN.pack(len(payload)))
    h.update(payload)
    return h.digest()


def _nbytes(b: Buffer) -> int:
    return b.nbytes if isinstance(b, memoryview) else len(b)


def encode(key: bytes, env: Envelope) -> list[Buffer]:
    """Frames for ``env`` (the caller prepends a routing identity where needed)."""
    buflens = [_nbytes(b) for b in env.buffers]
    if env.packed_body is None:
        header = msgpack.packb(
            [env.version, env.kind, env.sender, env.receiver, env.seq, env.ack, buflens,
             env.pbufs, env.body],
            use_bin_type=True,
        )
    else:  # the same bytes: a 9-array is an 8-array's fields followed by the ninth
        head = msgpack.packb(
            [env.version, env.kind, env.sender, env.receiver, env.seq, env.ack, buflens,
             env.pbufs],
            use_bin_type=True,
        )
        header = _ARRAY9 + head[1:] + env.packed_body
    return [header, env.payload, mac(key, header, env.payload), *env.buffers]


def _frame_bytes(frame: Any) -> Buffer:
    # zmq.Frame exposes .buffer (a memoryview on the message); plain bytes pass.
    buf = getattr(frame, "buffer", None)
    return buf if buf is not None else frame  # type: ignore[no-any-return]


def decode(
    key: bytes, frames: Sequence[Any], *, max_payload: int = 1 << 40,
    max_total: int | None = None, max_frames: int = MAX_FRAMES,
) -> Envelope:
    """Authenticate and unpack ``frames``; raise :class:`Dropped` on anything wrong.

    Nothing is unpickled here. Sizes are checked from the frame lengths first
    (``max_total``: all frames together), then the MAC, and only then is the
    header parsed.
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
        fields = msgpack.unpackb(header, raw=False, use_list=True)
        if isinstance(fields, list) and len(fields) == 8:  # protocol 2: no ack (version check)
            fields.insert(5, 0)
        version, kind, sender, receiver, seq, ack, buflens, pbufs, body = fields
    except Exception as exc:  # msgpack raises several types on garbage
        raise Dropped("malformed", f"header: {exc}") from None
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

# One message waiting to be sent: (kind, body as wire list, payload, buffers, pbufs).
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


BATCH_MAX_ITEMS = 256  # messages in one BATCH, at most
BATCH_MAX_PAYLOAD = 1 << 18  # a payload this large travels alone, not copied into a batch
BATCH_MAX_HEADER = MAX_HEADER_BYTES // 2  # a larger batch header is sent as its messages


def batched(items: Sequence[Outgoing], sender: bytes, receiver: bytes) -> list[Envelope]:
    """Envelopes (sequence numbers not set) carrying ``items`` in order, batched where
    several fit together: a lone message, or one with a large payload, travels as itself."""
    if len(items) == 1:  # the common case: one message, as itself
        return [_single(items[0], sender, receiver)]
    out: list[Envelope] = []
    run: list[Outgoing] = []

    def close_run() -> None:
        if len(run) == 1:
            out.append(_single(run[0], sender, receiver))
        elif run:
            body, payload, buffers = pack_batch(run)
            # Bodies are small but for error replies (tracebacks): a batch whose
            # header would near the receiver's limit goes as its messages instead.
            packed = msgpack.packb(body, use_bin_type=True)
            if len(packed) > BATCH_MAX_HEADER:
                out.extend(_single(item, sender, receiver) for item in run)
            else:
                out.append(Envelope(BATCH_KIND, sender, receiver, 0, body, payload, buffers,
                                    packed_body=packed))
        run.clear()

    for item in items:
        if _nbytes(item[2]) >= BATCH_MAX_PAYLOAD:
            close_run()
            out.append(_single(item, sender, receiver))
            continue
        run.append(item)
        if len(run) >= BATCH_MAX_ITEMS:
            close_run()
    close_run()
    return out


def _single(item: Outgoing, sender: bytes, receiver: bytes) -> Envelope:
    kind, body, payload, bufs, pbufs = item
    return Envelope(kind, sender, receiver, 0, body, payload, list(bufs), pbufs)


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
    out: list[Envelope] = []
    at = nb = 0
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 5):
            raise Dropped("malformed", "batch entry")
        kind, body, plen, nbufs, pbufs = entry
        if not (type(kind) is int and type(plen) is int and type(nbufs) is int
                and type(pbufs) is int and kind != BATCH_KIND and plen >= 0
                and 0 <= pbufs <= nbufs):
            raise Dropped("malformed", "batch entry fields")
        if at + plen > len(view) or nb + nbufs > len(env.buffers):
            raise Dropped("malformed", "batch lengths")
        payload: Buffer = view[at:at + plen] if plen else b""
        out.append(Envelope(kind, env.sender, env.receiver, env.seq, body, payload,
                            env.buffers[nb:nb + nbufs], pbufs, env.version, env.ack))
        at += plen
        nb += nbufs
    if at != len(view) or nb != len(env.buffers):
        raise Dropped("malformed", "batch lengths")
    return out


# -- pickling with out-of-band buffers -------------------------------------------------


class ByValue(Exception):
    """The stdlib pickler met a class or function that must travel by value."""


_by_reference: dict[Any, bool] = {}  # importable classes and functions seen so far


class StdPickler(pickle.Pickler):
    """The stdlib (C) pickler, refusing what cloudpickle would pickle by value.

    Several times cheaper than cloudpickle's pickler for plain data. It raises
    :class:`ByValue` on a class or function that cloudpickle pickles by value
    (defined in ``__main__``, locally, or in a module registered by value): by
    reference, those would not load on the other side. Callers then fall back to
    cloudpickle.
    """

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type | types.FunctionType):
            ok = _by_reference.get(obj)
            if ok is None:
                try:
                    ok = bool(_should_pickle_by_reference(obj))
                except Exception:
                    ok = False
                if ok:
                    if len(_by_reference) > 4096:
                        _by_reference.clear()
                    _by_reference[obj] = True
            if not ok:
                raise ByValue(repr(obj))
        return NotImplemented


def oob_callback(buffers: list[Buffer]) -> Callable[[pickle.PickleBuffer], bool]:
    """A pickle-5 ``buffer_callback``: large contiguous buffers go out of band into
    ``buffers`` (zero-copy frames); small or non-contiguous ones stay in the pickle."""

    def callback(pb: pickle.PickleBuffer) -> bool:
        try:
            raw = pb.raw()
        except BufferError:  # not contiguous: keep it in band
            return True
        if raw.nbytes < OOB_THRESHOLD:
            return True
        buffers.append(raw)
        return False

    return callback


def dumps(obj: Any) -> tuple[bytes, list[Buffer]]:
    """Pickle ``obj``; large contiguous buffers go out of band (zero-copy frames).

    The stdlib pickler first; cloudpickle where that fails or would pickle a class
    or function by reference that cloudpickle sends by value.
    """
    bufs: list[Buffer] = []
    callback = oob_callback(bufs)
    f = io.BytesIO()
    try:
        StdPickler(f, protocol=5, buffer_callback=callback).dump(obj)
        return f.getvalue(), bufs
    except Exception:
        bufs.clear()
    data = cloudpickle.dumps(obj, protocol=5, buffer_callback=callback)
    return data, bufs


def loads(payload: Buffer, buffers: Sequence[Buffer] = ()) -> Any:
    """Unpickle a payload made by :func:`dumps` (workers only, on authenticated envelopes
    from their controller; the controller never unpickles what a worker sent)."""
    return pickle.loads(payload, buffers=buffers)


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
