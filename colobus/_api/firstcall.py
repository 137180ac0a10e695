"""The first call of a function or method whose output specs are not known yet.

JAX runs that call synchronously, to learn the output specs, and code written for JAX
relies on it: a call made for its side effect (writing a file, saving state) has
happened when it returns. colobus keeps that wherever blocking cannot stall the
controller: on every thread but the controller's own event-loop thread (plain scripts,
``cb.init()``, worker threads, a thread running another event loop such as a Jupyter
kernel's beside a ``with`` cluster). On the controller's loop thread (async code under
``async with``) every call returns at once. A target's specs are known once it has an
``out_specs_fn`` or a call of it succeeded (``Target.learned``).

This is the rule of calls that return their Future (async code, on any loop). Plain
code's calls return their arrays, and learn output specs per input signature, as JAX
specializes: ``colobus._api.pending``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .._controller.future import Future

__all__ = ["Learner", "first_call"]

_get_ident = threading.get_ident


class Learner(Protocol):
    """What a call's target (``func.Target``) does once one of its calls ended."""

    def learned(self, fut: Future[Any]) -> None: ...


def first_call(target: Learner, fut: Future[Any]) -> Future[Any]:
    """``fut`` of a call of ``target`` made while its output specs were unknown: off the
    controller's event-loop thread (``fut._loop_thread``), once its hosts have run it
    (done), whatever loop the calling thread runs; on that thread at once. Two first
    calls from two threads wait side by side, each for its own."""
    loop_thread = fut._loop_thread
    if loop_thread is None or _get_ident() != loop_thread:
        fut._wait(None)
        target.learned(fut)
    else:
        fut.add_done_callback(target.learned)
    return fut
