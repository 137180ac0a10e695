"""Exceptions raised on hosts, as the controller re-raises them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._errors import RemoteError
from ._wire import Envelope, loads

if TYPE_CHECKING:
    from ._hosts import Host

__all__ = ["rebuild_exception"]


def rebuild_exception(host: Host, env: Envelope, meta: Any) -> BaseException:
    """The exception a host's ERROR reply describes, with the host and traceback as notes."""
    type_name, message, tb = "Exception", "", ""
    if isinstance(meta, list) and len(meta) == 3:
        type_name, message, tb = (str(x) for x in meta)
    exc: BaseException
    try:
        exc = loads(env.payload, env.buffers[: env.pbufs])
        if not isinstance(exc, BaseException):
            raise TypeError("not an exception")
    except Exception:
        exc = RemoteError(type_name, message, tb, host.index)
    exc.add_note(f"raised on colobus host {host.index} ({host.name!r})")
    if tb:
        exc.add_note(f"remote traceback (host {host.index}):\n{tb.rstrip()}")
    return exc
