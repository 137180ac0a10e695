"""The user's own code, sent to hosts: which modules travel, their files, the size limit.

A module the driver imported from outside its installed environment (not the
standard library, not site-packages or dist-packages, not a folder where pip
installed it, not colobus) is the user's: its top-level package (or the lone
module) travels to a host with the first code that names it, as a zip of its
source and data files, named by the digest of its contents. :class:`CodeShipper`
keeps one snapshot per package and controller (read once, when first needed), so a
session ships what the files held when it first needed them; the next controller
reads them again.

What a package's zip holds, and which files never travel (keys, owner-only files,
links out), is :mod:`colobus._controller.packfiles`'s; a package that holds such a
file ships without it and the controller says so once.

Trust runs one way: packages go to hosts; nothing here reads what a host sent.
"""

from __future__ import annotations

import functools
import importlib.machinery
import itertools
import logging
import os
import site
import sys
import sysconfig
import threading
import types
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from .._errors import SerializationError
from .._wire import protocol as P
from .packfiles import Package, Secrets, say_left_out, snapshot

if TYPE_CHECKING:
    from .._wire.envelope import Buffer
    from .hosts import Host

__all__ = ["DEFAULT_MAX_CODE_BYTES", "CodeShipper", "Package", "Secrets", "imports_of",
           "locate", "snapshot", "user_package"]

log = logging.getLogger("colobus.controller")

DEFAULT_MAX_CODE_BYTES = 64 << 20


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


def _installed(top: str, root: str) -> bool:
    """Whether the module ``top`` found at ``root`` is installed code, not the user's."""
    parts = root.split(os.sep)
    return ("site-packages" in parts or "dist-packages" in parts
            or root.startswith(_installed_roots()) or top in _distributed(os.path.dirname(root)))


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
    if root is not None and _installed(top, root):
        root = None
    _user_roots[top] = root
    return top if root is not None else None


def locate(top: str) -> tuple[str | None, str]:
    """Where top-level module ``top`` of the user's lives here (its package directory, or
    its file), or None and why it does not travel (words for a host's error).

    Found as Python's import system would find it on this process's ``sys.path``
    (:class:`importlib.machinery.PathFinder`), without importing or running it: a host
    that asks for a module never makes the controller run anything.
    """
    if top in sys.stdlib_module_names:
        return None, (f"{top!r} is a module of Python's standard library, which this host's "
                      "Python lacks (colobus never ships it): run the same Python build there")
    if top in _NEVER:
        return None, f"{top!r} never travels"
    module = sys.modules.get(top)
    root: str | None
    if module is not None:
        root, origin = _module_root(module), getattr(module, "__file__", None) or ""
    else:
        try:
            spec = importlib.machinery.PathFinder.find_spec(top)
        except (ImportError, ValueError, OSError):
            spec = None
        if spec is None:
            return None, (f"the controller cannot import {top!r} either (it is on neither "
                          "side): check the name, or give its file or directory in "
                          "py_modules=")
        origin = spec.origin if spec.has_location and spec.origin else ""
        locations = list(spec.submodule_search_locations or [])
        if origin.endswith("__init__.py"):
            root = os.path.dirname(os.path.realpath(origin))
        elif locations and not origin:  # a namespace package: one directory of it only
            root = os.path.realpath(locations[0]) if len(locations) == 1 else None
        else:
            root = os.path.realpath(origin) if origin.endswith(".py") else None
    if root is None:
        return None, (f"{top!r} is compiled code on the controller ({origin or 'no file'}), "
                      "which never travels: build and install it on this host")
    if _installed(top, root):
        return None, (f"{top!r} is an installed package on the controller ({root}): install "
                      "it on this host, in the environment the workers run in (colobus ships "
                      "only your own modules)")
    return root, ""


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
                 secrets: Secrets | None = None) -> None:
        self.auto = ship_code
        self.secrets = secrets if secrets is not None else Secrets()
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

    def provide(self, name: str) -> tuple[Package | None, str]:
        """Any thread: the package a host that lacks top-level module ``name`` gets (read
        once, as the packages code names are), or None and why not, in words for the
        host's error (:func:`locate`; ``ship_code=False``; ``max_code_bytes``)."""
        if not self.auto:
            return None, ("this controller ships only its py_modules (ship_code=False): name "
                          "the module in py_modules=, or install it on the host")
        with self._lock:
            if self._packages.get(name) is not None:
                pkg = self._packages[name]
                assert pkg is not None
                return pkg, ""
            root, why = locate(name)
            if root is None:
                return None, why
            try:
                pkg = self._admit(name, root)
            except SerializationError as exc:
                return None, str(exc)
            log.info("shipping %s (%s, %.1f MB) to a host whose code imports it", name, root,
                     pkg.nbytes / 1e6)
            return pkg, ""

    def send(self, ctl: _Controller, host: Host, pkg: Package) -> None:
        """Loop thread: send ``host`` package ``pkg`` unless it has it."""
        if pkg.digest not in host.packages_sent:
            host.packages_sent.add(pkg.digest)
            ctl._count("packages_sent")
            ctl._count("package_bytes", len(pkg.archive))
            ctl._send(host, P.Code(pkg.digest, pkg.name, True), pkg.archive)

    def ship(self, ctl: _Controller, host: Host, names: tuple[str, ...]) -> None:
        """Loop thread: send ``host`` the packages code naming ``names`` needs, unless sent."""
        for pkg in self.packages(names):
            self.send(ctl, host, pkg)
