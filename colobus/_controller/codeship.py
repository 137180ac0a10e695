"""The user's own code, sent to hosts: which modules travel, their files, the size limit.

A module the driver imported from outside its installed environment (not the
standard library, not site-packages or dist-packages, not a folder where pip
installed it, not colobus) is the user's: its top-level package (or the lone
module) travels to a host with the first code that names it, as a zip of its
source and data files, named by the digest of its contents. :class:`CodeShipper`
keeps one snapshot per package and controller (read once, when first needed), so a
session ships what the files held when it first needed them; the next controller
reads them again.

Some files never travel, whatever the package directory holds (:class:`Secrets`,
:func:`snapshot`): the controller's key and CurveZMQ secret-key files (by path, by
inode, and any file whose bytes hold the key), any CurveZMQ secret-key file, any file
only its owner may read (no group or other read bit), and links to files outside the
package. A package that holds one ships without it and the controller says so once.
Bytes are counted as they are read, so a file that grows after it was measured (or a
``/proc`` file, which says it holds 0 bytes) cannot pass ``max_code_bytes``.
Trust runs one way: packages go to hosts; nothing here reads what a host sent.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import io
import itertools
import logging
import os
import re
import site
import stat
import sys
import sysconfig
import threading
import types
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .._errors import SerializationError
from .._wire import protocol as P

if TYPE_CHECKING:
    from .._wire.envelope import Buffer
    from .hosts import Host

__all__ = ["DEFAULT_MAX_CODE_BYTES", "CodeShipper", "Package", "Secrets", "imports_of",
           "snapshot", "user_package"]

log = logging.getLogger("colobus.controller")

DEFAULT_MAX_CODE_BYTES = 64 << 20
# Never travel: caches, version control, virtual environments, build leftovers.
SKIP_DIRS = frozenset({"__pycache__", "node_modules"})
SKIP_SUFFIXES = (".pyc", ".pyo", ".so", ".pyd", ".dylib", ".dll", ".o", ".a")
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # fixed, so equal files make equal archives


@dataclass(frozen=True, slots=True)
class Package:
    """One package's files, as read once: its import name, digest, zip and size."""

    name: str
    root: str  # the package directory, or the lone module's file
    digest: bytes
    archive: bytes
    nbytes: int  # of the files themselves, as read
    left_out: tuple[tuple[str, str], ...] = ()  # (path in the package, why): never travels


# A CurveZMQ secret-key file (ZeroMQ's certificate format, as `colobus keygen --curve`
# writes it): its secret-key line, with a Z85 key (40 characters).
_CURVE_SECRET = re.compile(rb'(?m)^[ \t]*secret-key[ \t]*=[ \t]*'
                           rb'"[0-9A-Za-z.:+=^!/*?&<>()\[\]{}@%$#-]{40}"')


@dataclass(frozen=True, slots=True)
class Secrets:
    """What never travels, whatever a package directory holds: the controller's key and
    CurveZMQ secret-key files (by device and inode: a hard link or another path to them
    is the same file), and any file whose bytes hold one of ``contents`` (the key, raw and
    as hex; the CurveZMQ secret key, Z85)."""

    files: frozenset[tuple[int, int]] = frozenset()
    contents: tuple[bytes, ...] = ()

    @classmethod
    def of(cls, paths: Iterable[str | os.PathLike[str] | None],
           contents: Iterable[bytes | None]) -> Secrets:
        """The secrets of a controller: its key (and curve) files and values."""
        files = set()
        for path in paths:
            if path is None:
                continue
            try:
                st = os.stat(path)
            except OSError:
                continue
            files.add((st.st_dev, st.st_ino))
        values = tuple(v for v in contents if v and len(v) >= 16)  # (a short one: no key)
        return cls(frozenset(files), values)

    def why(self, st: os.stat_result, data: bytes | None) -> str | None:
        """Why a file (its ``fstat``, and its bytes once read) must not travel, or None."""
        if (st.st_dev, st.st_ino) in self.files:
            return "it is the controller's key file"
        if data is not None:
            if any(v in data for v in self.contents):
                return "it holds the controller's key"
            if _CURVE_SECRET.search(data):
                return "it is a CurveZMQ secret-key file"
        return None


_NO_SECRETS = Secrets()


@functools.cache
def _installed_roots() -> tuple[str, ...]:
    """Directories whose modules are installed, not the user's: the standard library,
    site-packages (the environment's, the base interpreter's, the user's) and colobus."""
    roots: set[str] = set()
    for base in ({}, {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}):
        paths = sysconfig.get_paths(vars=base)
        roots.update(paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")
                     if k in paths)
    try:
        roots.update(site.getsitepackages())
    except AttributeError:  # some virtualenvs' site lacks it
        pass
    if site.ENABLE_USER_SITE and site.USER_SITE:
        roots.add(site.USER_SITE)
    roots.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # colobus itself
    return tuple(os.path.join(os.path.realpath(r), "") for r in roots if r)


def _module_root(module: types.ModuleType) -> str | None:
    """Where a top-level module's source lives: its package directory or its file."""
    file: str | None = getattr(module, "__file__", None)
    if file:
        path = os.path.realpath(file)
        if os.path.basename(path).startswith("__init__."):
            return os.path.dirname(path)
        return path if path.endswith(".py") else None  # an extension module stays home
    paths = list(getattr(module, "__path__", None) or [])
    return os.path.realpath(paths[0]) if len(paths) == 1 else None  # a namespace package


@functools.cache
def _distributed(directory: str) -> frozenset[str]:
    """Top-level names the distributions installed in ``directory`` provide: what the
    ``RECORD`` of each ``*.dist-info`` there lists (a ``pip install --target`` folder on
    ``PYTHONPATH`` is installed code, wherever it is)."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return frozenset()
    names: set[str] = set()
    for entry in entries:
        if not entry.endswith(".dist-info"):
            continue
        try:
            with open(os.path.join(directory, entry, "RECORD"), encoding="utf-8") as f:
                for line in f:
                    top = line.partition(",")[0].partition("/")[0]
                    names.add(top[:-3] if top.endswith(".py") else top)
        except OSError:
            continue
    return frozenset(names)


# Never the user's to ship: the script, colobus, and what each Python process imports
# at start from its own path (a host has its own, or none).
_NEVER = frozenset({"__main__", "colobus", "sitecustomize", "usercustomize"})
_serials = itertools.count(1)
_user_roots: dict[str, str | None] = {}  # top-level name -> its root if the user's (cache)


def user_package(module_name: str) -> str | None:
    """The top-level name of ``module_name`` if that module is the user's own code
    (imported here from outside the installed environment), else None."""
    top = module_name.partition(".")[0]
    if top in _user_roots:
        return top if _user_roots[top] is not None else None
    if top in sys.stdlib_module_names or top in _NEVER or not top:
        return None
    module = sys.modules.get(top)
    if module is None:
        return None  # not imported (yet): ask again later
    root = _module_root(module)
    if root is not None:
        parts = root.split(os.sep)
        if "site-packages" in parts or "dist-packages" in parts or (
                root.startswith(_installed_roots())) or (
                top in _distributed(os.path.dirname(root))):
            root = None
    _user_roots[top] = root
    return top if root is not None else None


def imports_of(top: str) -> tuple[str, ...]:
    """The user's other packages that the imported modules of package ``top`` hold in
    their globals: modules, classes and functions (``import b``, ``from b import f``)."""
    found: dict[str, None] = {}
    for mod_name, module in list(sys.modules.items()):
        if module is None or not (mod_name == top or mod_name.startswith(top + ".")):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, types.ModuleType):
                ref = value.__name__
            elif isinstance(value, type | types.FunctionType):
                ref = getattr(value, "__module__", None) or ""
            else:
                continue
            other = user_package(ref) if isinstance(ref, str) else None
            if other is not None and other != top:
                found[other] = None
    return tuple(found)


def _files(root: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(relative path in the archive, path)`` of every file that may travel, sorted,
    and ``(relative path, why)`` of the links to directories outside the package (never
    followed, said with the files left out)."""
    if not os.path.isdir(root):
        return [(os.path.basename(root), root)], []
    name = os.path.basename(root)
    inside = os.path.join(os.path.realpath(root), "")
    out, out_links = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for d in dirnames:  # (os.walk never descends a link to a directory)
            path = os.path.join(dirpath, d)
            if os.path.islink(path) and not os.path.realpath(path).startswith(inside):
                out_links.append((_archive_path(name, rel, d), "a link to a directory outside "
                                                               "the package"))
        dirnames[:] = sorted(
            d for d in dirnames if not (d.startswith(".") or d in SKIP_DIRS
                                        or d.endswith(".egg-info") or _environment(dirpath, d)))
        for f in sorted(filenames):
            if f.startswith(".") or f.endswith(SKIP_SUFFIXES):
                continue
            out.append((_archive_path(name, rel, f), os.path.join(dirpath, f)))
    return out, out_links


def _archive_path(name: str, rel: str, f: str) -> str:
    return os.path.normpath(os.path.join(name, rel, f)).replace(os.sep, "/")


def _environment(dirpath: str, d: str) -> bool:
    """Whether ``dirpath/d`` is a virtual or conda environment."""
    return any(os.path.exists(os.path.join(dirpath, d, mark)) for mark in ("pyvenv.cfg",
                                                                           "conda-meta"))


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def too_large(what: str, sizes: list[tuple[int, str]], total: int, limit: int) -> str:
    """The error text of a session that would ship more than ``limit`` bytes of code."""
    largest = ", ".join(f"{path} ({_size(size)})" for size, path in
                        sorted(sizes, reverse=True)[:3])
    return (f"shipping {what} would make this session's code {total / 1e6:.1f} MB, over "
            f"max_code_bytes={limit}; its largest files: {largest}. Keep data out of the "
            "package (or install it on the hosts and pass ship_code=False), or raise "
            "max_code_bytes")


def _stays(st: os.stat_result, secrets: Secrets, data: bytes | None = None) -> str | None:
    """Why the file of ``st`` (with its bytes, once read) never travels, or None."""
    why = secrets.why(st, data)
    if why is None and not st.st_mode & (stat.S_IRGRP | stat.S_IROTH):
        why = (f"only its owner may read it (mode {st.st_mode & 0o777:o}; chmod go+r if it "
               "is meant to travel)")
    return why


def _largest(sizes: dict[str, int]) -> list[tuple[int, str]]:
    return [(n, rel) for rel, n in sizes.items()]


def _target(path: str, inside: str) -> tuple[str | None, str | None]:
    """``(the file to open, None)`` for ``path``, or ``(None, why it stays)``: a link is
    followed only to a file inside the package (``inside``: its real path, with a
    trailing separator)."""
    if not os.path.islink(path):
        return path, None
    real = os.path.realpath(path)
    if inside and real.startswith(inside):
        return real, None
    return None, f"a link to a file outside the package ({real})"


def _open(path: str) -> tuple[int, os.stat_result] | None:
    """An open descriptor of the regular file at ``path`` and its ``fstat``, or None
    (not there, not a regular file: a FIFO, a socket, a device). Never through a link
    (one swapped in after :func:`_target` looked), never blocking on a FIFO.

    Raises:
        OSError: the file cannot be read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link now: the next snapshot judges it
            return None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None
    return fd, st


def _read(fd: int, most: int) -> bytes:
    """Up to ``most`` bytes from ``fd``, read until its end: what it holds now, whatever
    its size said (a file that grew, a ``/proc`` file)."""
    chunks, got = [], 0
    while got < most:
        chunk = os.read(fd, min(most - got, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def snapshot(name: str, root: str, used: int = 0, limit: int | None = None,
             secrets: Secrets = _NO_SECRETS) -> Package:
    """Read a package's files once: a zip of them and the digest of their contents.

    Files that never travel (``secrets``, owner-only files, links out) are left out and
    listed in :attr:`Package.left_out`. Bytes count as they are read: a file larger than
    its size said when measured still counts in full.

    Raises:
        SerializationError: with ``used`` bytes shipped before, the files would pass
            ``limit`` (the message names the largest), or they cannot be read.
    """
    files, left_out = _files(root)
    inside = os.path.join(os.path.realpath(root), "") if os.path.isdir(root) else ""
    # Measured first (as they stand now), so a package far over the limit is refused
    # before anything is read: what stays home is not counted.
    chosen: list[tuple[str, str]] = []
    sizes: dict[str, int] = {}
    for rel, path in files:
        target, why = _target(path, inside)
        if target is None:
            left_out.append((rel, str(why)))
            continue
        try:
            st = os.stat(target)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise SerializationError(f"cannot read the files of {name!r} to ship: {exc}") from exc
        if not stat.S_ISREG(st.st_mode):
            continue
        why = _stays(st, secrets)
        if why is not None:
            left_out.append((rel, why))
            continue
        chosen.append((rel, target))
        sizes[rel] = st.st_size
    room = None if limit is None else limit - used
    if limit is not None and used + sum(sizes.values()) > limit:
        raise SerializationError(too_large(f"{name!r} ({root})", _largest(sizes),
                                           used + sum(sizes.values()), limit))
    digest = hashlib.blake2b(b"colobus package\0" + name.encode(), digest_size=16)
    out = io.BytesIO()
    nbytes = 0
    with zipfile.ZipFile(out, "w") as archive:
        for rel, path in chosen:
            try:
                opened = _open(path)
                if opened is None:
                    continue
                fd, st = opened
                try:
                    why = _stays(st, secrets)  # as it stands now: it may have changed
                    # (one byte past the room left: enough to know it is over)
                    data = b"" if why else _read(
                        fd, (1 << 62) if room is None else room - nbytes + 1)
                finally:
                    os.close(fd)
            except OSError as exc:
                raise SerializationError(f"cannot read {path} to ship: {exc}") from exc
            why = why or _stays(st, secrets, data)
            if why is not None:
                left_out.append((rel, why))
                sizes.pop(rel, None)
                continue
            sizes[rel] = len(data)
            nbytes += len(data)
            if limit is not None and used + nbytes > limit:
                raise SerializationError(too_large(f"{name!r} ({root})", _largest(sizes),
                                                   used + max(nbytes, sum(sizes.values())),
                                                   limit))
            digest.update(b"%d\0%s\0" % (len(data), rel.encode()))
            digest.update(data)
            archive.writestr(zipfile.ZipInfo(rel, _ZIP_TIME), data,
                             compress_type=zipfile.ZIP_DEFLATED, compresslevel=1)
    return Package(name, root, digest.digest(), out.getvalue(), nbytes,
                   tuple(sorted(left_out)))


def say_left_out(pkg: Package) -> None:
    """Say which files of ``pkg`` stay home, and why (once per controller: it reads each
    package once)."""
    shown = "; ".join(f"{rel}: {why}" for rel, why in pkg.left_out[:20])
    more = len(pkg.left_out) - 20
    log.warning("shipping %s (%s) without %d file(s) that never travel: %s%s", pkg.name,
                pkg.root, len(pkg.left_out), shown, f"; and {more} more" if more > 0 else "")


def _resolve(spec: Any) -> tuple[str, str]:
    """``(import name, root)`` of a ``py_modules`` entry: a module, or a path."""
    if isinstance(spec, types.ModuleType):
        top = spec.__name__.partition(".")[0]
        root = _module_root(sys.modules.get(top, spec))
        if root is None:
            raise ValueError(f"py_modules: {spec.__name__!r} has no Python source to ship")
        return top, root
    path = os.path.realpath(os.fspath(spec))
    if os.path.isdir(path):
        return os.path.basename(path), path
    if os.path.isfile(path) and path.endswith(".py"):
        return os.path.basename(path)[:-3], path
    raise ValueError(f"py_modules: {os.fspath(spec)!r} is neither a package directory nor "
                     "a .py file")


class _Controller(Protocol):
    def _send(self, host: Host, body: P.Body, payload: Buffer = b"") -> None: ...

    def _count(self, name: str, n: int = 1) -> None: ...


class CodeShipper:
    """One controller's code that travels: the ``py_modules``, and the user's packages
    as calls need them, each read once and sent once per host.

    Args:
        py_modules: modules or paths shipped to every host with its first code.
        ship_code: also ship the user's own packages that code names (automatic).
        max_code_bytes: the most bytes of files one session ships.
        secrets: what never travels besides owner-only files and links out (the
            controller's key and CurveZMQ secret-key files and values).

    Raises:
        ValueError: a ``py_modules`` entry is no module, package directory or .py file.
        SerializationError: the ``py_modules`` alone pass ``max_code_bytes``.
    """

    def __init__(self, py_modules: Iterable[Any] = (), ship_code: bool = True,
                 max_code_bytes: int = DEFAULT_MAX_CODE_BYTES,
                 secrets: Secrets = _NO_SECRETS) -> None:
        self.auto = ship_code
        self.secrets = secrets
        self.serial = next(_serials)  # what code remembers it by (not the object: no cycle)
        self.limit = max_code_bytes
        self._lock = threading.Lock()
        self._packages: dict[str, Package | None] = {}  # by name; None: not shipped
        self._deps: dict[str, tuple[str, ...]] = {}  # the user's packages each imports
        self._resolved: dict[tuple[str, ...], list[Package]] = {}  # by the names code needs
        self.total = 0
        self.always: list[Package] = []
        for spec in py_modules:
            name, root = _resolve(spec)
            if name not in self._packages:
                self.always.append(self._admit(name, root))

    def _admit(self, name: str, root: str) -> Package:
        pkg = snapshot(name, root, self.total, self.limit, self.secrets)
        self._packages[name] = pkg
        self.total += pkg.nbytes
        if pkg.left_out:
            say_left_out(pkg)
        return pkg

    def packages(self, names: tuple[str, ...]) -> list[Package]:
        """The packages to send with code that names ``names``: those, the user's packages
        they import, and the ``py_modules`` (each read on first need).

        Raises:
            SerializationError: one would pass ``max_code_bytes`` (that one is not sent).
        """
        if not self.auto:
            return self.always
        done = self._resolved.get(names)
        if done is not None:
            return done
        out = list(self.always)
        todo, seen = list(names), set()
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            if name not in self._packages:
                with self._lock:
                    if name not in self._packages:
                        self._first_need(name)
            pkg = self._packages[name]
            if pkg is not None:
                if pkg not in out:
                    out.append(pkg)
                todo.extend(self._deps.get(name, ()))
        self._resolved[names] = out
        return out

    def _first_need(self, name: str) -> None:
        root = _user_roots.get(name)
        if root is None:
            self._packages[name] = None
            return
        pkg = self._admit(name, root)
        self._deps[name] = imports_of(name)
        log.info("shipping %s (%s, %.1f MB) to the hosts with the first code that needs it",
                 name, root, pkg.nbytes / 1e6)

    def ship(self, ctl: _Controller, host: Host, names: tuple[str, ...]) -> None:
        """Loop thread: send ``host`` the packages code naming ``names`` needs, unless sent."""
        sent = host.packages_sent
        for pkg in self.packages(names):
            if pkg.digest not in sent:
                sent.add(pkg.digest)
                ctl._count("packages_sent")
                ctl._count("package_bytes", len(pkg.archive))
                ctl._send(host, P.Code(pkg.digest, pkg.name, True), pkg.archive)
