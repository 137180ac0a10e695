"""Pickles with out-of-band buffers: large arrays travel as frames, never copied in.

The controller pickles code and arguments here (:func:`dumps`, the stdlib
pickler first, cloudpickle where that fails or would pickle something by
reference that must travel by value); only a worker unpickles (:func:`loads`),
and only authenticated envelopes from its controller. Re-exported by
:mod:`colobus._wire.envelope`.
"""

from __future__ import annotations

import functools
import io
import pickle
import types
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
from cloudpickle.cloudpickle import _should_pickle_by_reference

__all__ = ["OOB_THRESHOLD", "ByValue", "StdPickler", "dumps", "handles_payload", "loads",
           "oob_callback"]

Buffer = bytes | memoryview
# Out-of-band pickle buffers below this size stay in the pickle (a copy is cheaper
# than a frame); the same threshold pyzmq uses to decide zero-copy sends.
OOB_THRESHOLD = 1 << 16



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


class _Slot:
    """Stands for the i-th array argument while :func:`handles_payload` pickles."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _SlotPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> int | None:
        return obj.index if type(obj) is _Slot else None


@functools.lru_cache(maxsize=64)
def handles_payload(n: int) -> bytes:
    """The arguments' payload of ``f(a_0, ..., a_{n-1})``, arrays alone, by position:
    ``(args, {})`` pickled with persistent ids 0..n-1, the same bytes every time. The
    controller sends it for every such call; a worker that meets it takes the values
    themselves as the arguments, with no unpickling (``_host/calls.py``)."""
    f = io.BytesIO()
    _SlotPickler(f, protocol=5).dump((tuple(_Slot(i) for i in range(n)), {}))
    return f.getvalue()
