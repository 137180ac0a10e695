"""Modules hosts ask for: host code imported a module its host lacks (an IMPORT).

A host's finder (:mod:`colobus._host.fetched`) asks when host code imports a module
nothing on the host provides: inside a function (``import helpers``), or by a name
given to ``importlib``. The controller answers with that module's top-level package
when it is the user's own code, found on the controller's ``sys.path`` outside its
installed environment (:func:`colobus._controller.codeship.locate`), read and sent as
every package of the user's is (:mod:`.packfiles`: keys, owner-only files and links out
never travel); else with why not, which the host's ``ModuleNotFoundError`` says.

Trust runs one way: a host's IMPORT is a name, checked and looked up as a path; the
controller never imports or runs what a host names. A host asks at most
:data:`MAX_ASKS` names a session; past that it is answered without a look.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from typing import TYPE_CHECKING, Any, Protocol

from .._wire import protocol as P

if TYPE_CHECKING:
    from .._wire.envelope import Buffer, Envelope
    from .codeship import CodeShipper, Package
    from .hosts import Host

__all__ = ["MAX_ASKS", "ImportAnswers"]

log = logging.getLogger("colobus.controller")

MAX_ASKS = 256  # names one host may ask for in a session
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")  # a top-level module's name


class ImportsOwner(Protocol):
    """What :class:`ImportAnswers` uses of the controller."""

    @property
    def _shipper(self) -> CodeShipper: ...
    @property
    def _loop(self) -> asyncio.AbstractEventLoop | None: ...
    def _send(self, host: Host, body: P.Body, payload: Buffer = b"",
              buffers: Any = (), pbufs: int = 0) -> None: ...
    def _count(self, name: str, n: int = 1) -> None: ...


class ImportAnswers:
    """The controller's answers to its hosts' IMPORTs (the handler of that kind)."""

    def __init__(self, ctl: ImportsOwner) -> None:
        self._ctl = ctl

    def on_import(self, host: Host, body: P.Import, env: Envelope) -> None:
        """Loop thread: look the module up on a thread (a package is read there), then
        answer: its package (a CODE) and a MODULE, or a MODULE that says why not."""
        name = body.name
        host.imports_asked += 1
        if host.imports_asked > MAX_ASKS:
            self._answer(host, host.session, name, None, f"this host asked for more than "
                         f"{MAX_ASKS} modules this session; no more are looked up")
            return
        if not _NAME.fullmatch(name):
            self._answer(host, host.session, name[:128], None, "not a top-level module name")
            return
        loop = self._ctl._loop
        assert loop is not None
        job = loop.run_in_executor(None, self._ctl._shipper.provide, name)
        job.add_done_callback(functools.partial(self._looked_up, host, host.session, name))

    def _looked_up(self, host: Host, session: bytes, name: str,
                   job: asyncio.Future[tuple[Package | None, str]]) -> None:
        try:
            pkg, why = job.result()
        except Exception as exc:  # (a bug, or a file that changed as it was read)
            log.warning("looking up module %r for host %d failed: %r", name, host.index, exc)
            pkg, why = None, f"the controller could not read it: {exc!r}"
        self._answer(host, session, name, pkg, why)

    def _answer(self, host: Host, session: bytes, name: str, pkg: Package | None,
                why: str) -> None:
        if not host.alive or host.session != session:  # lost meanwhile: its asker too
            return
        if pkg is not None:
            self._ctl._shipper.send(self._ctl, host, pkg)  # (first: the MODULE waits for it)
        self._ctl._send(host, P.Module(name, pkg.name if pkg is not None else "", why))
