"""What a worker says of an exception, and the exception the controller rebuilds from it.

Written on the host (:func:`describe_error`), read on the controller
(:func:`read_error`, bounded like every reader in :mod:`colobus._wire.describe`),
and turned into the exception a future raises (:func:`rebuild_error`): never a
pickle. Format (the RESULT payload of a call whose status is ERROR)::

    error (RESULT payload, status ERROR)
        {"v": 1, "module": str, "qualname": str, "args": [plain, ...] | None,
         "message": str, "notes": [str, ...], "traceback": str, "host": str}
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from typing import Any

from .._errors import RemoteError
from .describe import (
    MAX_ERROR_BYTES,
    MAX_ERROR_OBJECTS,
    MAX_NAME,
    MAX_NOTES,
    MAX_TEXT,
    VERSION,
    BadReply,
    is_plain,
    lookup_class,
    pack,
    unpack,
)

__all__ = ["RemoteFailure", "describe_error", "read_error", "rebuild_error", "rebuildable"]


def describe_error(exc: BaseException, hostname: str) -> bytes:
    """Worker side: the RESULT payload for an exception raised on this host."""
    cls = type(exc)
    given = _os_error_args(exc) if isinstance(exc, OSError) else list(exc.args)
    args = given if is_plain(given, 0) else None
    if args is not None and _containers(args, MAX_ERROR_OBJECTS // 2) < 0:
        args = None  # more lists and dicts than a reader takes: the message says enough
    notes = [str(n)[:MAX_TEXT] for n in getattr(exc, "__notes__", [])[:MAX_NOTES]]
    tb = "".join(traceback.format_exception(exc))
    if len(tb) > MAX_TEXT:
        tb = "...\n" + tb[-MAX_TEXT:]
    desc = {"v": VERSION, "module": cls.__module__, "qualname": cls.__qualname__,
            "args": args, "message": _text(exc), "notes": notes, "traceback": tb,
            "host": hostname}
    try:
        out = pack(desc)
    except Exception:  # an int arg out of msgpack's range, say: send it without args
        desc["args"] = None
        out = pack(desc)
    if len(out) > MAX_ERROR_BYTES:  # long notes or args: keep what a reader takes
        desc["args"] = None
        desc["notes"] = [n[:MAX_TEXT // 4] for n in notes[:4]]
        out = pack(desc)
    return out


def _os_error_args(exc: OSError) -> list[Any]:
    """An ``OSError``'s arguments with its file names, which ``args`` leaves out (so the
    rebuilt error's headline names the file, as the original's does)."""
    args = list(exc.args)
    names = [os.fspath(n) if isinstance(n, os.PathLike) else n
             for n in (exc.filename, exc.filename2)]
    if len(args) == 2 and names[0] is not None:
        args.append(names[0])
        if names[1] is not None:
            args += [None, names[1]]  # OSError(errno, strerror, filename, winerror, filename2)
    return args


def _containers(x: Any, left: int) -> int:
    """``left`` less the lists, tuples and dicts in ``x``; negative once past zero."""
    if type(x) in (list, tuple, dict):
        left -= 1
        for v in (x.values() if type(x) is dict else x):
            if left < 0:
                return left
            left = _containers(v, left)
    return left


def _text(exc: BaseException) -> str:
    try:
        return str(exc)[:MAX_TEXT]
    except Exception:
        return f"<{type(exc).__name__}: str() failed>"


@dataclass(frozen=True, slots=True)
class RemoteFailure:
    """An error description as read off the wire (strings bounded)."""

    module: str
    qualname: str
    args: list[Any] | None
    message: str
    notes: list[str]
    traceback: str
    hostname: str

    @property
    def type_name(self) -> str:
        return f"{self.module}.{self.qualname}"


def _str(raw: Any, limit: int = MAX_TEXT) -> str:
    if not isinstance(raw, str):
        raise BadReply("bad error description field")
    return raw[:limit]


def read_error(payload: Any) -> RemoteFailure:
    """Controller side: the error description in a RESULT payload.

    Raises:
        BadReply: not an error description.
    """
    desc = unpack(payload, MAX_ERROR_OBJECTS, MAX_ERROR_BYTES)
    if not isinstance(desc, dict) or desc.get("v") != VERSION:
        raise BadReply("bad error description")
    args = desc.get("args")
    if args is not None and not (isinstance(args, list) and is_plain(args, 0)):
        raise BadReply("bad error arguments")
    notes = desc.get("notes", [])
    if not isinstance(notes, list):
        raise BadReply("bad error notes")
    return RemoteFailure(
        _str(desc.get("module"), MAX_NAME), _str(desc.get("qualname"), MAX_NAME), args,
        _str(desc.get("message")), [_str(n) for n in notes[:MAX_NOTES]],
        _str(desc.get("traceback", "")), _str(desc.get("host", ""), MAX_NAME))


# Exceptions that mean something to the caller's control flow or to colobus itself:
# a worker must not be able to raise them in the caller (a StopIteration ends the
# caller's loop, a HostLostError says a host is gone when it is not).
_NEVER_REBUILT = (StopIteration, StopAsyncIteration)


def rebuildable(cls: type[BaseException]) -> bool:
    """Whether a worker may have ``cls`` rebuilt in the caller: an ``Exception``
    subclass, neither colobus's own (``colobus.*``) nor StopIteration-like."""
    module = getattr(cls, "__module__", "") or ""
    return (issubclass(cls, Exception) and not issubclass(cls, _NEVER_REBUILT)
            and module != "colobus" and not module.startswith("colobus."))


def rebuild_error(failure: RemoteFailure, host: int | None) -> BaseException:
    """The exception a future raises for ``failure``.

    Its original type when the type's module is already imported here and the
    class is an ``Exception`` subclass that accepts the plain arguments that
    travelled, and is :func:`rebuildable` (never colobus's own errors, never
    ``StopIteration``/``StopAsyncIteration``); otherwise
    :class:`~colobus.RemoteError`. The remote notes follow.
    """
    exc: BaseException | None = None
    cls = lookup_class(failure.module, failure.qualname)
    if (isinstance(cls, type) and issubclass(cls, Exception) and rebuildable(cls)
            and failure.args is not None):
        try:
            exc = cls(*failure.args)
        except Exception:
            exc = None
    if exc is None:
        exc = RemoteError(failure.type_name, failure.message, failure.traceback, host)
    for note in failure.notes:
        exc.add_note(note)
    return exc
