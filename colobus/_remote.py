"""Exceptions raised on hosts, as the controller re-raises them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._describe import read_error, rebuild_error
from ._wire import Envelope

if TYPE_CHECKING:
    from ._hosts import Host

__all__ = ["rebuild_exception"]


def rebuild_exception(host: Host, env: Envelope, meta: Any) -> BaseException:
    """The exception a host's ERROR reply describes, rebuilt from data (never
    unpickled: see ``_describe``), with the host and traceback as notes.

    Raises:
        BadReply: the payload is not an error description.
    """
    failure = read_error(env.payload)
    exc = rebuild_error(failure, host.index)
    tb = failure.traceback
    exc.add_note(f"raised on colobus host {host.index} ({host.name!r})")
    if tb:
        exc.add_note(f"remote traceback (host {host.index}):\n{tb.rstrip()}")
    return exc
