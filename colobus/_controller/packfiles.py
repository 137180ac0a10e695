"""A package's files as read to ship: which travel, which never do, the size limit.

:func:`snapshot` reads a package's files once into a zip named by the digest of
their contents. Caches, version control and virtual environments never travel;
nor, whatever the package directory holds (:class:`Secrets`), the controller's
key and CurveZMQ secret-key files (by device and inode, and any file whose bytes
hold the key), any CurveZMQ secret-key file, any file only its owner may read (no
group or other read bit), and links to files outside the package. Those are left
out and listed (:attr:`Package.left_out`; :func:`say_left_out` says so). Bytes
count as they are read: a file that grew after it was measured, or a ``/proc``
file (which says it holds 0 bytes), cannot pass ``max_code_bytes``.
"""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import os
import re
import stat
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass

from .._errors import SerializationError
from .._wire.keys import key_file_of

__all__ = ["Package", "Secrets", "say_left_out", "snapshot", "too_large"]

log = logging.getLogger("colobus.controller")

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

    @classmethod
    def of_keys(cls, key: bytes, curve_file: str | os.PathLike[str] | None,
                curve: tuple[bytes, bytes] | None) -> Secrets:
        """A controller's: its key (the file ``load_key`` read it from, its bytes raw and
        as hex) and its CurveZMQ secret-key file and secret (``curve``: public, secret)."""
        return cls.of((key_file_of(key), curve_file),
                      (key, key.hex().encode(), key.hex().upper().encode(),
                       curve[1] if curve is not None else None))

    def why(self, st: os.stat_result, data: bytes | None) -> str | None:
        """Why a file (its ``fstat``, and its bytes once read) must not travel, or None."""
        if (st.st_dev, st.st_ino) in self.files:
            return "it is the controller's key file"
        if data is not None:
            if any(v in data for v in self.contents):
                return "it holds the controller's key"
            if b"secret-key" in data and _CURVE_SECRET.search(data):  # (find first: fast)
                return "it is a CurveZMQ secret-key file"
        return None


_NO_SECRETS = Secrets()


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
        dirnames[:] = sorted(
            d for d in dirnames if not (d.startswith(".") or d in SKIP_DIRS
                                        or d.endswith(".egg-info") or _environment(dirpath, d)))
        for d in dirnames:  # (os.walk never descends a link to a directory)
            path = os.path.join(dirpath, d)
            if os.path.islink(path) and not os.path.realpath(path).startswith(inside):
                out_links.append((_archive_path(name, rel, d), "a link to a directory outside "
                                                               "the package"))
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


def _read(fd: int, most: int, size: int) -> bytes:
    """Up to ``most`` bytes from ``fd``, read until its end: what it holds now, whatever
    its size said (``size``: the first read asks for that and one byte more, so a file
    that kept its size takes two reads; one that grew, or a ``/proc`` file, takes more)."""
    chunks, got = [], 0
    ask = size + 1
    while got < most:
        chunk = os.read(fd, min(most - got, ask))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
        ask = 1 << 20
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
                        fd, (1 << 62) if room is None else room - nbytes + 1, st.st_size)
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
