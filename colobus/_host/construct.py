"""CONSTRUCT on a host: build a colocated object once its inputs are resolved.

The instance is made on the worker's conversion pool (an ``__init__`` may take
its time) and then held by the object's future alone, so a DESTROY drops it at
once. Until it is built, and if ``__init__`` raised, the object's future says so
to every call that uses it (the store keeps it under the object's id). Once built, a
call's method is found without running the user's code where it is a plain one
(:func:`plain_method`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from types import FunctionType, MethodType
from typing import TYPE_CHECKING, Any

from .calls import _JOB, _global_views, _settable
from .pool import ArgsUnpickler

if TYPE_CHECKING:
    from .._wire import protocol as P
    from .._wire.envelope import Envelope
    from .calls import WorkerServices

__all__ = ["on_construct", "plain_method"]

_object_getattribute: Any = object.__getattribute__
_ABSENT: Any = object()


def plain_method(obj: asyncio.Future[Any], name: str) -> MethodType | None:
    """``getattr(instance, name)`` of a built object (``obj``, its store entry) where
    that is a plain function of its class bound to it, found without running any code
    of the user's (no ``__getattribute__`` of its own, no metaclass, not shadowed by the
    instance's ``__dict__``, not ``async``); else None (the scheduler's ``_target``
    then looks it up, once)."""
    if not obj.done() or obj.cancelled() or obj.exception() is not None:
        return None
    inst = obj.result()
    cls = type(inst)
    if type(cls) is not type or cls.__getattribute__ is not _object_getattribute:
        return None
    f: Any = None
    for klass in cls.__mro__:  # (the class's own entry: getattr would unwrap a staticmethod)
        f = klass.__dict__.get(name, _ABSENT)
        if f is not _ABSENT:
            break
    if (type(f) is not FunctionType or f.__code__.co_flags & inspect.CO_COROUTINE
            or f.__dict__):
        return None
    d = getattr(inst, "__dict__", None)
    if d is not None and name in d:
        return None
    return MethodType(f, inst)


def on_construct(w: WorkerServices, body: P.Construct, env: Envelope) -> None:
    """Loop thread: the object's future now, its instance once built."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()
    w.store.objects[body.obj] = fut
    w.store.classes[body.obj] = body.digest
    pins = [w.store.pin(r, w.host_index, env.seq) for r in body.refs]
    w._spawn(_construct(w, body, env, pins, fut))


async def _construct(w: WorkerServices, body: P.Construct, env: Envelope,
                     pins: list[asyncio.Future[Any]], fut: asyncio.Future[Any]) -> None:
    loop = asyncio.get_running_loop()
    try:
        values = [w.present(await p) for p in pins]
        job = _JOB[0]
        if job is not None:  # a JAX job: arrays arrive global, as in a call
            values = _global_views(job, body.refs, values)
        args, kwargs = ArgsUnpickler(env.payload, values, env.buffers[: env.pbufs]).load()
        cls = w.store.get_code(body.digest)
        built: list[Any] = []
        await loop.run_in_executor(w._pool, functools.partial(_build, built, cls, args, kwargs))
    except BaseException as exc:
        fut.set_exception(_settable(exc))  # an __init__ that raised StopIteration, too
        fut.exception()
        return
    fut.set_result(built.pop())  # from now on the object's future is the instance's only holder


def _build(built: list[Any], cls: Any, args: Any, kwargs: Any) -> None:
    """Work-pool thread: make the instance; it reaches the loop in ``built``, not as the
    executor future's result. That future (and the pool thread's work item) lives on a
    moment after the loop resumes: holding the instance, it would delay its ``__del__``
    past a DESTROY that ran meanwhile. A StopIteration from ``__init__`` is raised as its
    stand-in: asyncio cannot carry it from the executor's future to the loop's (the
    chaining callback fails, and the construction would never end)."""
    try:
        built.append(cls(*args, **kwargs))
    except (StopIteration, StopAsyncIteration) as exc:
        raise _settable(exc) from exc
