"""numpy arrays <-> (msgpack meta, one raw buffer), with no pickle.

Used on both sides of the wire. Every numpy dtype travels: plain and
structured dtypes as their raw bytes, numpy 2 ``StringDType`` as fixed-width
UTF-32 (``np.str_``), JAX typed PRNG key arrays as their key data plus the
name of their implementation.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._wire import decode_dtype, encode_dtype

__all__ = ["from_buffer", "is_key_array", "key_impl_name", "to_buffer"]


def is_key_array(x: Any) -> bool:
    """True for a JAX typed PRNG key array (``jax.random.key``)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or isinstance(dtype, np.dtype):
        return False
    import jax

    return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


def key_impl_name(x: Any) -> str:
    import jax

    return str(jax.random.key_impl(x))


def to_buffer(arr: np.ndarray[Any, Any]) -> tuple[Any, memoryview]:
    """The wire dtype description and a C-contiguous byte view of ``arr``.

    Copies only when ``arr`` is not C-contiguous or has a ``StringDType``.
    """
    if isinstance(arr.dtype, np.dtypes.StringDType):
        width = int(np.strings.str_len(arr).max()) if arr.size else 0
        arr = np.ascontiguousarray(arr.astype(f"U{max(width, 1)}"))
        return ["T", arr.dtype.str], _bytes_view(arr)
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
    return memoryview(arr.reshape(-1).view(np.uint8))


def from_buffer(descr: Any, shape: list[int] | tuple[int, ...], buf: Any) -> np.ndarray[Any, Any]:
    """Rebuild an array on ``buf``'s memory (no copy, except for ``StringDType``)."""
    shape = tuple(int(n) for n in shape)
    if isinstance(descr, list) and len(descr) == 2 and descr[0] == "T":
        fixed = np.dtype(str(descr[1]))
        if fixed.kind != "U":
            raise ValueError(f"bad string dtype {descr!r}")
        raw = _view(buf, fixed, shape)
        return raw.astype(np.dtypes.StringDType())
    return _view(buf, decode_dtype(descr), shape)


def _view(buf: Any, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0 or dtype.itemsize == 0:
        return np.zeros(shape, dtype)
    if memoryview(buf).nbytes != count * dtype.itemsize:
        raise ValueError("buffer size does not match shape and dtype")
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)
