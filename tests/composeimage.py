"""The compose simulation's image, built where the tests can use it (``python
tests/composeimage.py`` prints the base image's tag last).

The base is the Dockerfile's public ``python:3.11-slim`` where it is here, or
``COLOBUS_BASE_IMAGE``, or else one built from Debian's packages
(``docker/build-base``, with the dependencies as wheels from this host:
``docker/fetch-wheels``). ``tests/early.py`` starts the build with the session,
at the lowest CPU priority, so that ``tests/test_compose.py`` waits for it only
if it is not done by then.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMAGE = "colobus:local"  # what docker-compose.yml runs
PUBLIC_BASE = "python:3.11-slim"
LOCAL_BASE = "colobus-base:bookworm"  # docker/build-base
# A bound on each probe, not a wait on timing: beside the suite at a low CPU priority on
# a loaded machine, Compose v1 (a Python program) took over 30 s just to start.
PROBE_TIMEOUT_S = 300


def _run(*argv: str, timeout: float = 120, check: bool = True,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} -> {proc.returncode}\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _engine_missing() -> str | None:
    """Why the Docker tests cannot run here, or None."""
    if shutil.which("docker") is None:
        return "no docker command (.ci/run installs Debian's docker.io where it can)"
    info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"],
                          capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    if info.returncode != 0:
        return f"no Docker engine answers: {info.stderr.strip()[-200:]}"
    if not _compose_commands():
        return "neither `docker compose` (v2) nor `docker-compose` (v1) is installed"
    return None


def _compose_commands() -> dict[str, list[str]]:
    """The Compose versions installed here, v2 first: ``{"v2": argv, "v1": argv}``."""
    found: dict[str, list[str]] = {}
    for version, argv in (("v2", ["docker", "compose"]), ("v1", ["docker-compose"])):
        if shutil.which(argv[0]) is None:
            continue
        proc = subprocess.run([*argv, "version", "--short"], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S)
        if proc.returncode == 0 and proc.stdout.strip().lstrip("v").startswith(version[1]):
            found[version] = argv
    return found


def _base_image() -> str:
    """The Dockerfile's BASE: as given, the public image if here, else one built locally."""
    given = os.environ.get("COLOBUS_BASE_IMAGE")
    if given:
        return given
    if _run("docker", "image", "inspect", PUBLIC_BASE, check=False).returncode == 0:
        return PUBLIC_BASE
    _run(str(ROOT / "docker" / "build-base"), LOCAL_BASE, timeout=900)
    return LOCAL_BASE


def build() -> str:
    """Build the image (docker's layer cache makes a rebuild quick); the base's tag."""
    base = _base_image()
    if base == LOCAL_BASE:  # no registry: the dependencies come as wheels from this host
        _run(str(ROOT / "docker" / "fetch-wheels"), sys.executable, timeout=600)
    _run("docker", "build", "-q", "--build-arg", f"BASE={base}", "-t", IMAGE, ".",
         timeout=1200)
    return base


if __name__ == "__main__":
    why = _engine_missing()
    if why:
        sys.exit(f"no image built: {why}")
    print(build())
