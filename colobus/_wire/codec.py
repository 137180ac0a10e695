"""numpy arrays <-> (msgpack meta, one raw buffer), with no pickle.

Used on both sides of the wire. Every numpy dtype travels: plain and
structured dtypes as their raw bytes, numpy 2 ``StringDType`` as UTF-8 with
a length per element (exact: embedded and trailing NULs, any length, and the
NA of ``na_object=None`` / ``nan``), JAX typed PRNG key arrays as their key
data plus the name of their implementation.

``StringDType`` buffer layout: ``count`` little-endian int64 byte lengths (``-1``
marks NA), then the UTF-8 bytes of every element, in C order. The buffer comes
off the wire unauthenticated, so decoding checks every length against its size.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .envelope import decode_dtype, encode_dtype

__all__ = [
    "dtype_from_wire", "dtype_to_wire", "from_buffer", "key_impl_name",
    "to_buffer",
]


def key_impl_name(x: Any) -> str:
    import jax

    return str(jax.random.key_impl(x))


def to_buffer(arr: np.ndarray[Any, Any]) -> tuple[Any, memoryview]:
    """The wire dtype description and a C-contiguous byte view of ``arr``.

    Copies only when ``arr`` is not C-contiguous or has a ``StringDType``.
    """
    if isinstance(arr.dtype, np.dtypes.StringDType):
        return _strings_to_buffer(arr)
    if arr.dtype.hasobject:
        raise ValueError(
            f"arrays of dtype {arr.dtype} cannot travel to hosts: object dtypes are not"
            " supported; convert to a numeric, string or structured dtype first"
        )
    arr = np.ascontiguousarray(arr)
    return encode_dtype(arr.dtype), _bytes_view(arr)


def _bytes_view(arr: np.ndarray[Any, Any]) -> memoryview:
    if arr.size == 0 or arr.dtype.itemsize == 0:
        return memoryview(b"")
    return memoryview(arr.reshape(-1).view(np.uint8).data)


def from_buffer(descr: Any, shape: list[int] | tuple[int, ...], buf: Any) -> np.ndarray[Any, Any]:
    """Rebuild an array on ``buf``'s memory (no copy, except for ``StringDType``)."""
    shape = tuple(int(n) for n in shape)
    if isinstance(descr, list) and len(descr) == 2 and descr[0] == "T":
        return _strings_from_buffer(descr[1], shape, buf)
    return _view(buf, decode_dtype(descr), shape)


# StringDType ``na_object`` on the wire: 0 none, 1 ``None``, 2 ``nan``.
_NA_NONE, _NA_IS_NONE, _NA_IS_NAN = 0, 1, 2


def _na_code(dtype: Any) -> int:
    if not hasattr(dtype, "na_object"):
        return _NA_NONE
    na = dtype.na_object
    if na is None:
        return _NA_IS_NONE
    if isinstance(na, float) and na != na:
        return _NA_IS_NAN
    raise ValueError(
        f"arrays of {dtype} cannot travel to hosts: only StringDType(), "
        "StringDType(na_object=None) and StringDType(na_object=np.nan) are supported")


def _strings_to_buffer(arr: np.ndarray[Any, Any]) -> tuple[Any, memoryview]:
    na = _na_code(arr.dtype)
    flat = arr.ravel().tolist()
    lens = np.empty(len(flat), "<i8")
    parts: list[bytes] = []
    for k, s in enumerate(flat):
        if isinstance(s, str):
            b = s.encode("utf-8")
            lens[k] = len(b)
            parts.append(b)
        else:  # the dtype's NA
            lens[k] = -1
    data = b"".join(parts)
    out = np.empty(lens.nbytes + len(data), np.uint8)
    out[: lens.nbytes] = lens.view(np.uint8)
    out[lens.nbytes:] = np.frombuffer(data, np.uint8)
    return ["T", na], memoryview(out.data)


def _strings_from_buffer(na: Any, shape: tuple[int, ...], buf: Any) -> np.ndarray[Any, Any]:
    make: Any = np.dtypes.StringDType  # numpy's stubs reject na_object=
    if na == _NA_NONE:
        dtype = make()
        na_value: Any = None
    elif na == _NA_IS_NONE:
        dtype, na_value = make(na_object=None), None
    elif na == _NA_IS_NAN:
        dtype, na_value = make(na_object=np.nan), np.nan
    else:
        raise ValueError(f"bad string dtype NA code {na!r}")
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.frombuffer(buf, np.uint8) if memoryview(buf).nbytes else np.zeros(0, np.uint8)
    head = 8 * count
    if raw.nbytes < head:
        raise ValueError("string buffer shorter than its length table")
    lens = raw[:head].view("<i8")
    if count and (int(lens.min()) < (0 if na == _NA_NONE else -1)):
        raise ValueError("bad string length in buffer")
    if head + int(lens[lens > 0].sum()) != raw.nbytes:
        raise ValueError("string buffer size does not match its lengths")
    data = raw[head:].tobytes()
    out: list[Any] = []
    pos = 0
    for n in lens.tolist():
        if n < 0:
            out.append(na_value)
        else:
            out.append(data[pos: pos + n].decode("utf-8"))
            pos += n
    return np.array(out, dtype=dtype).reshape(shape)


def _view(buf: Any, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0 or dtype.itemsize == 0:
        return np.zeros(shape, dtype)
    if memoryview(buf).nbytes != count * dtype.itemsize:
        raise ValueError("buffer size does not match shape and dtype")
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)


def dtype_to_wire(dtype: Any) -> Any:
    """A msgpack description of any dtype an array travels with (no pickle):
    :func:`colobus._wire.envelope.encode_dtype`, or ``["T", na code]`` for ``StringDType``."""
    if isinstance(dtype, np.dtypes.StringDType):
        return ["T", _na_code(dtype)]
    return encode_dtype(np.dtype(dtype))


def dtype_from_wire(raw: Any) -> np.dtype[Any]:
    """Inverse of :func:`dtype_to_wire`; ``ValueError`` on garbage."""
    if isinstance(raw, list) and len(raw) == 2 and raw[0] == "T":
        if type(raw[1]) is not int or raw[1] not in (_NA_NONE, _NA_IS_NONE, _NA_IS_NAN):
            raise ValueError("bad NA code")
        make: Any = np.dtypes.StringDType  # numpy's stubs reject na_object=
        dt: np.dtype[Any] = (make() if raw[1] == _NA_NONE else make(na_object=None)
                             if raw[1] == _NA_IS_NONE else make(na_object=np.nan))
        return dt
    return decode_dtype(raw)
