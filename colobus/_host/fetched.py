"""Modules host code imports that this host lacks, fetched from the controller.

The user's modules travel with the code that names them (``_controller.codeship``).
One that host code only imports as it runs (``import helpers`` inside a function, or
``importlib.import_module("helpers")``) is named by no pickle. :data:`FETCHER`, last on
``sys.meta_path`` (after every finder of this host's own, so the host's modules always
win), asks the controller for a top-level module nothing here provides (an IMPORT),
when the user's code imports it (an installed library that probes for an optional
module is never asked about: :func:`_users_import`);
the controller answers with the module's package (a CODE, unpacked into the session's
directory by :mod:`.shipped` before the answer is read) or with why it has none (a
MODULE), and the import goes on from there. Each name is asked once per session.

The asking thread waits for the answer: a call's thread (the pool's, or a leader that
ran a lone call inline, which hands the loop on while it waits). On the worker's event
loop itself (``async def`` host code) nothing can wait for the loop: the import fails
as it would without colobus, and the error says why. A module the controller could
not provide fails as Python's own ``ModuleNotFoundError`` (a finder that raised would
break every ``importlib.util.find_spec`` probe of an optional dependency); the call's
error then carries a note saying why (:meth:`Fetcher.explain`).
"""

from __future__ import annotations

import _imp
import asyncio
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import sysconfig
import threading
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import FrameType, ModuleType

from .._wire import protocol as P

__all__ = ["ASK_TIMEOUT_S", "FETCHER", "Fetcher"]

ASK_TIMEOUT_S = 120.0  # the longest an import waits for the controller's answer
ON_LOOP = ("it was imported on the worker's event loop (async def host code), where "
           "colobus cannot wait for the controller: import it in a plain function, or at "
           "the top of a module of yours that travels, or name it in py_modules=")


class Fetcher(importlib.abc.MetaPathFinder):
    """Asks the controller of this worker's session for top-level modules it lacks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ask: Callable[[str], None] | None = None  # (loop thread) send an IMPORT
        self._answers: dict[str, str] = {}  # name -> "" (its package came) or why not
        self._waits: dict[str, threading.Event] = {}
        self._on_loop: set[str] = set()  # imported on the loop, so never asked (explain)

    def open(self, loop: asyncio.AbstractEventLoop, ask: Callable[[str], None]) -> None:
        """A session joined: imports may ask its controller (``ask`` sends an IMPORT)."""
        with self._lock:
            self._loop, self._ask = loop, ask
            self._answers.clear()
            self._on_loop.clear()
        if self not in sys.meta_path:
            sys.meta_path.append(self)

    def close(self) -> None:
        """The session ended: no more asking; an import still waiting goes on without."""
        with self._lock:
            self._loop = self._ask = None
            self._answers.clear()
            self._on_loop.clear()
            waits, self._waits = self._waits, {}
        for event in waits.values():
            event.set()

    def answered(self, body: P.Module) -> None:
        """Loop thread: the controller's MODULE (its package, if any, is unpacked now)."""
        with self._lock:
            event = self._waits.pop(body.name, None)
            if event is None:
                return  # not asked (or the asker gave up): nothing waits
            self._answers[body.name] = "" if body.package else (body.why or "no answer")
        event.set()

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if path is not None or fullname in sys.stdlib_module_names or not _users_import():
            return None  # a submodule (its package's own path finds it), or a library's
        with self._lock:
            loop = self._loop
            if loop is None or fullname in self._answers:
                return None  # no session, or asked already (and the package is no help)
            if _running(loop):  # the loop that would read the answer is this thread's
                self._on_loop.add(fullname)
                return None
            event = self._waits.get(fullname)
            first = event is None
            if event is None:
                event = self._waits[fullname] = threading.Event()
        if first:
            try:
                loop.call_soon_threadsafe(self._send, fullname)
            except RuntimeError:  # the loop closed: the worker is exiting
                return None
        if not _wait_unlocked(event, ASK_TIMEOUT_S):
            with self._lock:
                self._answers.setdefault(fullname, f"the controller did not answer within "
                                                   f"{ASK_TIMEOUT_S:.0f} s")
                self._waits.pop(fullname, None)
            return None
        with self._lock:
            if self._answers.get(fullname) != "":
                return None
        importlib.invalidate_caches()  # the session's directory has new files
        return importlib.machinery.PathFinder.find_spec(fullname)

    def _send(self, name: str) -> None:
        """Loop thread: the IMPORT, if the session it was asked in is still on."""
        with self._lock:
            ask = self._ask if name in self._waits else None
        if ask is not None:
            ask(name)

    def explain(self, exc: BaseException) -> None:
        """A note on ``exc`` (a call's error) when it is a module this finder asked the
        controller for and did not get: that the host lacks it, and why the controller
        could not provide it."""
        if not isinstance(exc, ModuleNotFoundError) or not exc.name:
            return
        top = exc.name.partition(".")[0]
        with self._lock:
            on_loop, why = top in self._on_loop, self._answers.get(top)
        if on_loop:
            exc.add_note(f"colobus: this host lacks the module {top!r}; {ON_LOOP}")
        elif why:
            exc.add_note(f"colobus: this host lacks the module {top!r}, and the controller "
                         f"could not provide it: {why}")


def _library_dirs() -> tuple[str, ...]:
    """Where installed code lives (the standard library, site-packages, colobus): an
    import from there is a library's (a probe for an optional dependency, most often)."""
    dirs = {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}  # colobus
    for base in ({}, {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}):
        paths = sysconfig.get_paths(vars=base)
        dirs.update(paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")
                    if k in paths)
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs if d)


_LIBRARY = _library_dirs()
_IMPORTLIB = os.path.join(os.path.dirname(os.path.realpath(importlib.__file__)), "")


def _users_import() -> bool:
    """Whether the import being found comes from the user's code (a function pickled by
    value, a shipped package, a script), not from a library: only those are asked of the
    controller. A library that probes for an optional module it lacks (``try: import
    scipy``) costs no round trip, and never waits while it may hold a lock of its own."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith("<frozen") or name.startswith(_IMPORTLIB):
            frame = frame.f_back  # the import machinery, importlib.import_module
            continue
        return not (name.startswith(_LIBRARY) or "site-packages" in name
                    or "dist-packages" in name)
    return False


def _wait_unlocked(event: threading.Event, timeout: float) -> bool:
    """``event.wait(timeout)`` without Python's global import lock, which the import
    system holds around every finder's ``find_spec``: while this thread waits for the
    controller, other threads import (the unpacking of the answer's package does), and
    would wait for this one. The lock is taken again before the import goes on."""
    held = _imp.lock_held()
    if held:
        _imp.release_lock()
    try:
        return event.wait(timeout)
    finally:
        if held:
            _imp.acquire_lock()


def _running(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` runs on this thread now (its callbacks, a coroutine of it)."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


FETCHER = Fetcher()
