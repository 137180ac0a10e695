"""The user's packages a controller shipped to this host, for one session.

Each arrives as a CODE message with ``package`` set (a zip of its files,
``_controller.codeship``) and is unpacked into one directory of the session,
first on ``sys.path``, so the session's code imports from it and not from an
older copy. Unpacking writes files (hundreds, for a large package), so it runs
on a thread, and the session's later messages wait for it in order: while it
runs, every message handler is :meth:`ShippedCode._hold`, and the loop thread
stays free for heartbeats. When the session ends the directory goes, and so
does every module imported from it (``sys.modules``): the next session imports
what its own controller ships.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import importlib
import io
import logging
import os
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Callable
from typing import Any

from .._wire.envelope import Envelope

log = logging.getLogger("colobus.worker")

__all__ = ["ShippedCode"]


class ShippedCode:
    """This session's directory of shipped packages (loop thread)."""

    def __init__(self) -> None:
        self.dir: str | None = None
        self.packages: dict[str, bytes] = {}  # import name -> digest
        self.nbytes = 0
        self.busy = False  # a package is being unpacked: messages wait (in ``_held``)
        self._held: collections.deque[Envelope] = collections.deque()
        self._handlers: dict[int, Any] = {}  # the worker's, while busy: its own
        self._saved: dict[int, Any] = {}
        self._dispatch: Callable[[Envelope], None] | None = None
        self._session = 0  # bumps on clear(): an unpacking of an ended session is dropped

    def attach(self, handlers: dict[int, Any], dispatch: Callable[[Envelope], None]) -> None:
        """The worker's message handlers (held while busy) and its dispatch (to replay)."""
        self._handlers = handlers
        self._dispatch = dispatch

    def install(self, name: str, digest: bytes, archive: bytes) -> None:
        """Start unpacking package ``name`` into the session's directory; later messages
        are handled once it is there (or failed: the code that needs it says so)."""
        if self.packages.get(name) == digest:
            return
        if self.dir is None:
            base = _in_memory()
            _sweep(base or tempfile.gettempdir())
            self.dir = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base)
        self.busy = True
        self._saved = dict(self._handlers)
        for kind in self._handlers:
            self._handlers[kind] = self._hold
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(None, _unpack, name, archive, self.dir)
        job.add_done_callback(functools.partial(self._unpacked, name=name, digest=digest,
                                                session=self._session, where=self.dir))

    def _hold(self, body: Any, env: Envelope) -> None:
        self._held.append(env)

    def _unpacked(self, job: asyncio.Future[int], name: str, digest: bytes, session: int,
                  where: str) -> None:
        if session != self._session:  # the session ended meanwhile: its files go too
            shutil.rmtree(where, ignore_errors=True)
            return
        self._release()
        try:
            self.nbytes += job.result()
        except Exception as exc:  # the code that needs it fails, saying what is missing
            log.warning("package %s cannot be unpacked here: %r", name, exc)
        else:
            assert self.dir is not None
            if self.dir not in sys.path:
                sys.path.insert(0, self.dir)
            importlib.invalidate_caches()
            self.packages[name] = digest
            module = sys.modules.get(name)
            if module is not None and not _from(module, self.dir):
                log.warning("package %s was shipped, but this worker already imported it from "
                            "%s; that copy stays in use", name, _where(module))
        while self._held and not self.busy and self._dispatch is not None:
            self._dispatch(self._held.popleft())  # in order; another package holds the rest

    def _release(self) -> None:
        if self.busy:
            self._handlers.update(self._saved)
            self._saved = {}
            self.busy = False

    def clear(self) -> None:
        """The session ended: drop what waited, forget its modules, remove its directory."""
        self._session += 1
        self._release()
        self._held.clear()
        where = self.dir
        if where is None:
            return
        self.dir = None
        self.packages.clear()
        self.nbytes = 0
        for mod_name, module in list(sys.modules.items()):
            if module is not None and _from(module, where):
                del sys.modules[mod_name]
        while where in sys.path:
            sys.path.remove(where)
        sys.path_importer_cache.pop(where, None)
        importlib.invalidate_caches()
        shutil.rmtree(where, ignore_errors=True)  # (an unpacking still running: _unpacked)


PREFIX = "colobus-code-"
SHM = "/dev/shm"
_swept: set[str] = set()


def _sweep(base: str) -> None:
    """Once per process and place: remove what workers that died without ending their
    session (SIGKILL) left there: ``colobus-code-PID-*`` of a PID that is gone."""
    if base in _swept:
        return
    _swept.add(base)
    try:
        names = os.listdir(base)
    except OSError:
        return
    for entry in names:
        pid = entry[len(PREFIX):].partition("-")[0]
        if not (entry.startswith(PREFIX) and pid.isdigit()) or _alive(int(pid)):
            continue
        path = os.path.join(base, entry)
        try:
            if os.stat(path).st_uid == os.getuid():
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: alive
        return True
    return True
SHM_ROOM = 1 << 30  # what /dev/shm must have free to take a session's code


def _in_memory() -> str | None:
    """Where to unpack: ``/dev/shm`` (memory: a package's hundreds of files are written
    in a tenth of the time of a virtual machine's disk) where it has room, else None
    (the temporary directory)."""
    try:
        st = os.statvfs(SHM)
    except OSError:
        return None
    room = st.f_bavail * st.f_frsize
    return SHM if room >= SHM_ROOM and os.access(SHM, os.W_OK | os.X_OK) else None


def _unpack(name: str, archive: bytes, where: str) -> int:
    """A thread: ``archive``'s files into ``where``; their bytes.

    Raises:
        ValueError: the archive holds a path outside the package.
        zipfile.BadZipFile, OSError: it cannot be unpacked here.
    """
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        infos = z.infolist()
        for info in infos:
            parts = info.filename.split("/")
            if info.filename.startswith("/") or ".." in parts or parts[0] not in (
                    name, name + ".py"):
                raise ValueError(f"package {name!r}: a path outside it, {info.filename!r}")
        z.extractall(where)
    return sum(i.file_size for i in infos)


def _where(module: object) -> str:
    file = getattr(module, "__file__", None)
    if file:
        return str(file)
    paths = list(getattr(module, "__path__", None) or [])
    return str(paths[0]) if paths else ""


def _from(module: object, directory: str) -> bool:
    """Whether ``module`` was imported from ``directory``."""
    return _where(module).startswith(os.path.join(directory, ""))
