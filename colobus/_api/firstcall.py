"""The first call of a function or method whose output specs are not known yet.

JAX runs that call synchronously, to learn the output specs, and code written for JAX
relies on it: a call made for its side effect (writing a file, saving state) has
happened when it returns. colobus keeps that where blocking is safe, on a thread where
no event loop runs; in async code every call returns at once. A target's specs are
known once it has an ``out_specs_fn`` or a call of it succeeded (``Target.learned``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .._controller.future import Future

__all__ = ["Learner", "first_call"]

_running_loop = asyncio._get_running_loop


class Learner(Protocol):
    """What a call's target (``func.Target``) does once one of its calls ended."""

    def learned(self, fut: Future[Any]) -> None: ...


def first_call(target: Learner, fut: Future[Any]) -> Future[Any]:
    """``fut`` of a call of ``target`` made while its output specs were unknown: on a
    thread with no event loop, once its hosts have run it (done); in async code (a
    thread running an event loop, the controller's or another) at once. Two first calls
    from two threads wait side by side, each for its own."""
    if _running_loop() is None:
        fut._wait(None)
        target.learned(fut)
    else:
        fut.add_done_callback(target.learned)
    return fut
