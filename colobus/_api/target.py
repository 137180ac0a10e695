"""What a colocated call runs (a function, or a method of a colocated object) and what
the call's lanes keep of it, and each caller's stream (calls of one stream run in order
on each host)."""

from __future__ import annotations

import asyncio
import itertools
import threading
import weakref
from typing import Any

from .._controller.controller import Controller
from .._controller.hosts import Host
from .._observe.observer import FunctionStats, Observer
from .cacheinfo import Signatures
from .pending import OutSpecs
from .plan import CallPlan
from .serialization import Code

__all__ = ["FunctionTarget", "Target", "_stream_id", "_thread_streams", "task_stream"]

_stream_counter = itertools.count(1)
_task_streams: weakref.WeakKeyDictionary[asyncio.Task[Any], int] = weakref.WeakKeyDictionary()
_thread_streams = threading.local()


def task_stream(task: asyncio.Task[Any]) -> int:
    """A task's stream (see :func:`_stream_id`), the task known."""
    sid = _task_streams.get(task)
    if sid is None:
        sid = _task_streams[task] = next(_stream_counter)
    return sid


def _stream_id() -> int:
    """The calling task's (else thread's) stream: unique for this process's lifetime.

    Not ``id(task)`` or the thread ident: those are reused once a task or thread
    ends, which would queue a new caller's calls behind an old caller's calls
    still running on the hosts (ordering is per stream).
    """
    try:
        task = asyncio.current_task()
    except RuntimeError:
        task = None
    if task is not None:
        return task_stream(task)
    sid = getattr(_thread_streams, "sid", None)
    if sid is None:
        sid = _thread_streams.sid = next(_stream_counter)
    return int(sid)


class Target:
    """What a call runs: a function (by digest) or a method of a colocated object."""

    name: str = ""
    obj_id: int = 0
    method: str = ""
    signatures: Signatures | None = None  # counted where cache_info() reports them
    observed: tuple[Observer, FunctionStats] | None = None  # its counters, and whose
    code: Code | None = None  # a function's: all prepare() does is ship it
    built: dict[int, int] | None = None  # a method's object: host -> generation built in
    # the call's lane (colobus._api.lane): digest, obj_id and method packed; the last
    # one-argument call's (sharding, shape, dtype, signature set, plan, output specs, its
    # cell of learned output specs: colobus._api.pending); the
    # generations of its plan's hosts (registry, hosts, registry.changes, generations); a
    # method's checks passed (plan, registry.changes, controller, digest)
    lane_mid: tuple[bytes, bytes] | None = None
    lane_last: tuple[Any, Any, Any, Any, CallPlan, Any, Any] | None = None
    lane_gens: tuple[Any, tuple[int, ...], int, dict[int, int]] | None = None
    lane_ok: tuple[CallPlan, int, Controller, bytes] | None = None
    # per input signature, the output specs its calls learned (colobus._api.pending)
    cells: dict[Any, list[OutSpecs | None]] | None = None

    def digest(self) -> bytes:
        return b""

    def stats_key(self, digest: bytes) -> tuple[bytes, str]:
        """What hosts call this target when they report its run times (its call's digest)."""
        return (digest, self.method)

    def check(self, ctl: Controller, plan: CallPlan) -> None:
        """Raise at the call if this target cannot run on ``plan`` (caller's thread)."""

    def prepare(self, ctl: Controller, host: Host) -> None:
        """Loop thread, before the CALL: make sure the host has what it needs."""


class FunctionTarget(Target):
    code: Code

    def __init__(self, code: Code, name: str) -> None:
        self.code = code
        self.name = name
        self.signatures = Signatures()

    def digest(self) -> bytes:
        return self.code.get()[0]

    def check(self, ctl: Controller, plan: CallPlan) -> None:
        if self.code.ready != ctl._shipper.serial:  # its first call with ctl
            self.code.prepare(ctl)

    def prepare(self, ctl: Controller, host: Host) -> None:
        self.code.ship(ctl, host)
