"""The versions each side reports at join, and which differences refuse a host.

A worker's HELLO carries :func:`local_versions`; the controller compares them
with its own (:func:`compare`). Pickled code and the wire protocol do not cross
a Python minor version or a colobus version: such a host is refused. A
different JAX, jaxlib or numpy is worth a warning line; cloudpickle is shown.
"""

from __future__ import annotations

import functools
import importlib.metadata
import platform
import sys

from .guard import shown

__all__ = ["MUST_MATCH", "PACKAGES", "WARN_ON", "compare", "local_versions"]

PACKAGES = ("jax", "jaxlib", "numpy", "cloudpickle")
MUST_MATCH = ("python", "colobus")
WARN_ON = ("jax", "jaxlib", "numpy")


@functools.cache
def _installed() -> tuple[tuple[str, str], ...]:
    colobus = sys.modules.get("colobus")
    found = [("python", platform.python_version()),
             ("colobus", str(getattr(colobus, "__version__", "")))]
    for name in PACKAGES:
        try:
            found.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            found.append((name, ""))  # "": not installed
    return tuple(found)


def local_versions() -> dict[str, str]:
    """This process's Python, colobus, JAX, jaxlib, numpy and cloudpickle versions."""
    return dict(_installed())


def _same(name: str, theirs: str, ours: str) -> bool:
    if name == "python":  # pickled code crosses patch releases, not minor ones
        return theirs.split(".")[:2] == ours.split(".")[:2]
    return theirs == ours


def compare(theirs: dict[str, str], ours: dict[str, str]) -> tuple[str | None, list[str]]:
    """``(why the host is refused or None, warning lines)``. A host that did not report
    its Python or colobus version is refused (every worker of this protocol reports
    them); another version a host did not report is not compared. The host's strings
    are shown as they are only where they are plain tokens, else quoted
    (:func:`~colobus._wire.guard.shown`): they are the worker's, not ours."""
    refused = [f"{name} {shown(theirs[name])} on the host, {ours.get(name, '?')} on the controller"
               for name in MUST_MATCH
               if name in theirs and not _same(name, theirs[name], ours.get(name, ""))]
    missing = [name for name in MUST_MATCH if not theirs.get(name)]
    if missing:
        refused.append(f"the host reported no {' or '.join(missing)} version")
    why = None
    if refused:
        why = ("version mismatch: " + "; ".join(refused) + " (pickled code and the wire "
               "protocol do not cross them: run the same Python and colobus on every host)")
    warnings = [f"{name} {shown(theirs[name])} on the host, {ours.get(name) or 'missing'} "
                "on the controller" if theirs[name] else
                f"{name} missing on the host, {ours.get(name) or 'missing'} on the controller"
                for name in WARN_ON
                if name in theirs and theirs[name] != ours.get(name, "")]
    return why, warnings
