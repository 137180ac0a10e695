"""The user's packages a controller shipped to this host, for one session.

Each arrives as a CODE message with ``package`` set (a zip of its files,
``_controller.codeship``) and is unpacked into one directory of the session,
first on ``sys.path``, so the session's code imports from it and not from an
older copy. When the session ends the directory goes, and so does every module
imported from it (``sys.modules``): the next session imports what its own
controller ships.
"""

from __future__ import annotations

import importlib
import io
import logging
import os
import shutil
import sys
import tempfile
import weakref
import zipfile

log = logging.getLogger("colobus.worker")

__all__ = ["ShippedCode"]


class ShippedCode:
    """This session's directory of shipped packages (loop thread)."""

    def __init__(self) -> None:
        self.dir: str | None = None
        self.packages: dict[str, bytes] = {}  # import name -> digest
        self.nbytes = 0
        self._cleanup: weakref.finalize[..., ShippedCode] | None = None

    def install(self, name: str, digest: bytes, archive: bytes) -> None:
        """Unpack package ``name`` into the session's directory.

        Raises:
            ValueError: the archive holds a path outside the package.
            zipfile.BadZipFile, OSError: it cannot be unpacked here.
        """
        if self.packages.get(name) == digest:
            return
        if self.dir is None:
            self.dir = tempfile.mkdtemp(prefix="colobus-code-")
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)
            sys.path.insert(0, self.dir)
        with zipfile.ZipFile(io.BytesIO(archive)) as z:
            for info in z.infolist():
                parts = info.filename.split("/")
                if info.filename.startswith("/") or ".." in parts or parts[0] not in (
                        name, name + ".py"):
                    raise ValueError(f"package {name!r}: a path outside it, {info.filename!r}")
            z.extractall(self.dir)
            self.nbytes += sum(i.file_size for i in z.infolist())
        if name in sys.modules and not _from(sys.modules[name], self.dir):
            log.warning("package %s was shipped, but this worker already imported it from %s; "
                        "that copy stays in use", name, _where(sys.modules[name]))
        self.packages[name] = digest
        importlib.invalidate_caches()

    def clear(self) -> None:
        """The session ended: forget its modules, remove its directory."""
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
        if self._cleanup is not None:
            self._cleanup()  # removes the directory


def _where(module: object) -> str:
    file = getattr(module, "__file__", None)
    if file:
        return str(file)
    paths = list(getattr(module, "__path__", None) or [])
    return str(paths[0]) if paths else ""


def _from(module: object, directory: str) -> bool:
    """Whether ``module`` was imported from ``directory``."""
    return _where(module).startswith(os.path.join(directory, ""))
