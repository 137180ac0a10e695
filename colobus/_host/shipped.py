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

Each session's directory holds a lock (``flock`` on :data:`LOCK` inside it) for as
long as its worker lives: a worker's sweep removes another's leftovers only where it
can take that lock, never by judging a PID (workers in containers that share
``/dev/shm`` see each other's PIDs as dead). A package is checked before a byte is
written (paths inside it, entry count, unpacked size against the bounds and the room
left); one that does not unpack is refused for the rest of the session: code that
needs it fails with the reason, and never imports a same-named module from the
worker's own ``sys.path`` instead.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import fcntl
import functools
import importlib
import io
import logging
import os
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

from .._wire.envelope import Envelope

log = logging.getLogger("colobus.worker")

__all__ = ["MAX_ENTRIES", "MAX_UNPACKED_BYTES", "ShippedCode"]

MAX_ENTRIES = 100_000  # files in one session's packages
MAX_UNPACKED_BYTES = 4 << 30  # their bytes unpacked (the controller sends at most
# max_code_bytes, 64 MiB unless raised); the room left where they go bounds them too
ROOM_MARGIN = 64 << 20  # left free where the packages are unpacked


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
        self._lock: int | None = None  # the session directory's lock (its descriptor)
        self.entries = 0  # files unpacked this session
        self.refused: dict[str, str] = {}  # package -> why it did not unpack (this session)

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
            base = _in_memory() or tempfile.gettempdir()
            _sweep(base)
            try:
                self.dir, self._lock = _make_dir(base)
            except OSError as exc:
                self._refuse(name, f"no directory for it in {base}: {exc}")
                return
        self.busy = True
        self._saved = dict(self._handlers)
        for kind in self._handlers:
            self._handlers[kind] = self._hold
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(None, _unpack, name, archive, self.dir, self.entries,
                                   self.nbytes)
        job.add_done_callback(functools.partial(self._unpacked, name=name, digest=digest,
                                                session=self._session, where=self.dir))

    def _hold(self, body: Any, env: Envelope) -> None:
        self._held.append(env)

    def _unpacked(self, job: asyncio.Future[tuple[int, int]], name: str, digest: bytes,
                  session: int, where: str) -> None:
        if session != self._session:  # the session ended meanwhile: its files go too
            shutil.rmtree(where, ignore_errors=True)
            return
        self._release()
        try:
            entries, nbytes = job.result()
        except Exception as exc:  # the code that needs it fails, saying why
            _remove_package(where, name)  # what was written of it, if anything
            self._refuse(name, str(exc) if isinstance(exc, ValueError) else repr(exc))
        else:
            self.entries += entries
            self.nbytes += nbytes
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

    def _refuse(self, name: str, why: str) -> None:
        """Package ``name`` did not unpack: code that needs it fails, saying ``why``."""
        self.refused[name] = why
        log.warning("package %r did not unpack on this host, so the calls that need it "
                    "fail: %s", name, why)
        if _REFUSED not in sys.meta_path:
            sys.meta_path.insert(0, _REFUSED)
        _REFUSED.refused = self.refused

    def why_refused(self, module: str) -> str | None:
        """Why module ``module`` cannot be imported here this session (its package was
        shipped and did not unpack), or None."""
        if not self.refused:
            return None
        return _REFUSED.why(module)

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
        if self.refused:
            self.refused = {}
            _REFUSED.refused = self.refused
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(_REFUSED)
        self.entries = 0
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
        if self._lock is not None:  # only now: a sweep may take it once the files are gone
            os.close(self._lock)
            self._lock = None


PREFIX = "colobus-code-"
STAGING = ".colobus-new-"  # a directory being made: locked before it takes its name
LOCK = ".colobus-lock"  # in each session's directory, locked while its worker lives
SHM = "/dev/shm"
_swept: set[str] = set()


def _make_dir(base: str) -> tuple[str, int]:
    """A new session directory in ``base``, and the descriptor that holds its lock.

    Made under a staging name, locked, then renamed: a sweep never sees it unlocked.
    """
    staging = tempfile.mkdtemp(prefix=STAGING, dir=base)
    try:
        fd = os.open(os.path.join(staging, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (new: nobody else has it)
    where = os.path.join(base, PREFIX + f"{os.getpid()}-" + os.path.basename(staging)[
        len(STAGING):])
    try:
        os.rename(staging, where)
    except OSError:
        os.close(fd)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return where, fd


def _sweep(base: str) -> None:
    """Once per process and place: remove what workers that died without ending their
    session (SIGKILL) left there: each ``colobus-code-*`` directory of this user whose
    lock can be taken (its worker is gone; the kernel dropped the lock with it)."""
    if base in _swept:
        return
    _swept.add(base)
    try:
        names = os.listdir(base)
    except OSError:
        return
    for entry in names:
        if entry.startswith(PREFIX):
            _remove_if_free(os.path.join(base, entry))


def _remove_if_free(path: str) -> bool:
    """Remove session directory ``path`` if its lock can be taken now (else it is alive,
    or not one of ours: kept). A directory without a lock file (an older colobus's, or
    not ours) is kept."""
    try:
        if os.lstat(path).st_uid != os.getuid():
            return False
        fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False  # its worker lives
            raise
        shutil.rmtree(path, ignore_errors=True)  # (held until the files are gone)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


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


def _unpack(name: str, archive: bytes, where: str, entries: int = 0,
            nbytes: int = 0) -> tuple[int, int]:
    """A thread: ``archive``'s files into ``where``; how many, and their bytes.

    Everything is checked before a byte is written: each path lies inside the package,
    and with ``entries`` files of ``nbytes`` bytes unpacked before this session, the
    total stays within :data:`MAX_ENTRIES`, :data:`MAX_UNPACKED_BYTES` and the room
    left in ``where`` (less :data:`ROOM_MARGIN`). A file's size is what the archive
    says: extracting stops there (``zipfile``), and a wrong checksum fails it.

    Raises:
        ValueError: a path outside the package, or a bound passed (the message says
            which, with the figures).
        zipfile.BadZipFile, OSError: it cannot be unpacked here.
    """
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        infos = z.infolist()
        for info in infos:
            parts = info.filename.split("/")
            if info.filename.startswith("/") or ".." in parts or parts[0] not in (
                    name, name + ".py"):
                raise ValueError(f"package {name!r}: a path outside it, {info.filename!r}")
        count, size = len(infos), sum(i.file_size for i in infos)
        if entries + count > MAX_ENTRIES:
            raise ValueError(
                f"package {name!r} holds {count} files; with the {entries} this session "
                f"unpacked before that passes the bound of {MAX_ENTRIES} files per session")
        if nbytes + size > MAX_UNPACKED_BYTES:
            raise ValueError(
                f"package {name!r} unpacks to {size} bytes; with the {nbytes} this session "
                f"unpacked before that passes the bound of {MAX_UNPACKED_BYTES} bytes per "
                "session")
        st = os.statvfs(where)
        room = st.f_bavail * st.f_frsize - ROOM_MARGIN
        if size > room:
            raise ValueError(
                f"package {name!r} unpacks to {size} bytes, and {where} has room for "
                f"{max(room, 0)} (keeping {ROOM_MARGIN} bytes free)")
        z.extractall(where)
    return count, size


def _remove_package(where: str, name: str) -> None:
    """Remove what an unpacking that failed wrote of package ``name``."""
    shutil.rmtree(os.path.join(where, name), ignore_errors=True)
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(where, name + ".py"))


class _Refusals:
    """On ``sys.meta_path`` while a package of this session did not unpack: importing it
    (or a module in it) raises, saying why, where the worker's own ``sys.path`` would
    otherwise give a same-named module."""

    def __init__(self) -> None:
        self.refused: dict[str, str] = {}

    def why(self, module: str) -> str | None:
        top = module.partition(".")[0]
        why = self.refused.get(top)
        if why is None:
            return None
        return (f"package {top!r}, which the controller shipped, did not unpack on this "
                f"host: {why}")

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        why = self.why(fullname)
        if why is not None:
            raise ImportError(why, name=fullname)
        return None


_REFUSED = _Refusals()


def _where(module: object) -> str:
    file = getattr(module, "__file__", None)
    if file:
        return str(file)
    paths = list(getattr(module, "__path__", None) or [])
    return str(paths[0]) if paths else ""


def _from(module: object, directory: str) -> bool:
    """Whether ``module`` was imported from ``directory``."""
    return _where(module).startswith(os.path.join(directory, ""))
