"""This machine's accelerators, shared out among local workers without opening them.

The controller process never opens an accelerator: it counts the chips from what
the system shows (``/dev/accel*`` or ``/dev/vfio/N`` for TPUs,
``/proc/driver/nvidia/gpus`` or ``nvidia-smi -L`` for NVIDIA GPUs, narrowed by
``TPU_VISIBLE_CHIPS`` / ``CUDA_VISIBLE_DEVICES`` where set) and gives each worker
its own through the environment, as JAX's multi-process tests do. Each worker is an
independent JAX process (no ``jax.distributed``): its chips form a slice of their own.

``COLOBUS_ACCELERATORS`` (``"tpu:4"``, ``"gpu:2"``, ``"0"``) tells the detector
instead, for machines it misreads (and tests).
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

__all__ = ["ACCELERATORS_ENV", "Accelerators", "detect", "driver_backend", "local_worker_envs",
           "share_out"]

log = logging.getLogger("colobus.cluster")

ACCELERATORS_ENV = "COLOBUS_ACCELERATORS"

# A worker's chips as one slice of its own: TPU_CHIPS_PER_PROCESS_BOUNDS by chip count
# (the host shapes of JAX's jax/_src/test_multiprocess.py; 8: a 2x4 host).
TPU_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}
TPU_PORT_BASE = 8476  # TPU_PROCESS_PORT of worker i: base + i (libtpu's default is 8476)
_PLATFORMS = {"tpu": "tpu,cpu", "gpu": "cuda,cpu"}


@dataclass(frozen=True)
class Accelerators:
    """What a machine has: ``kind`` ``"tpu"``, ``"gpu"`` or ``""`` and the chip ids."""

    kind: str
    count: int
    ids: tuple[str, ...] = ()

    def id_list(self) -> tuple[str, ...]:
        return self.ids or tuple(str(i) for i in range(self.count))


NONE = Accelerators("", 0)


def _listed(var: str) -> tuple[str, ...] | None:
    value = os.environ.get(var)
    if value is None:
        return None
    return tuple(v.strip() for v in value.split(",") if v.strip())


def _count_tpus() -> Accelerators:
    listed = _listed("TPU_VISIBLE_CHIPS")
    if listed is not None:
        return Accelerators("tpu", len(listed), listed)
    accel = [p for p in glob.glob("/dev/accel*") if re.fullmatch(r"/dev/accel\d+", p)]
    if accel:
        return Accelerators("tpu", len(accel))
    vfio = [p for p in glob.glob("/dev/vfio/*") if re.fullmatch(r"/dev/vfio/\d+", p)]
    # vfio also passes other PCI devices through: count it only on a TPU VM
    if vfio and (os.environ.get("TPU_ACCELERATOR_TYPE") or os.environ.get("TPU_WORKER_ID")
                 or importlib.util.find_spec("libtpu") is not None):
        return Accelerators("tpu", len(vfio))
    return NONE


def _count_gpus() -> Accelerators:
    listed = _listed("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return Accelerators("gpu", len(listed), listed) if listed else NONE
    gpus = glob.glob("/proc/driver/nvidia/gpus/*")
    if gpus:
        return Accelerators("gpu", len(gpus))
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return NONE
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return NONE
    n = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    return Accelerators("gpu", n) if n else NONE


def detect() -> Accelerators:
    """This machine's accelerators, without opening any."""
    told = os.environ.get(ACCELERATORS_ENV)
    if told is not None:
        kind, _, n = told.strip().partition(":")
        if kind in ("", "0", "none", "cpu"):
            return NONE
        if kind not in ("tpu", "gpu") or not n.isdigit():
            raise ValueError(f"{ACCELERATORS_ENV}={told!r}: expected 'tpu:N', 'gpu:N' or '0'")
        return Accelerators(kind, int(n)) if int(n) else NONE
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not re.search(r"tpu|cuda|gpu|rocm", platforms):
        return NONE  # JAX is told to use the CPU here: so are the workers
    found = _count_tpus()
    return found if found.count else _count_gpus()


def share_out(acc: Accelerators, hosts: int, per_host: int | None) -> list[dict[str, str]]:
    """The environment each of ``hosts`` workers gets for ``acc``'s chips.

    ``per_host`` None: ``count // hosts`` each; with fewer chips than hosts, the first
    ones get one each and the rest none. 0: none for any. A worker with none gets
    ``JAX_PLATFORMS=cpu``.
    """
    if not acc.count:
        return [{} for _ in range(hosts)]
    cpu_only = {"JAX_PLATFORMS": "cpu"}
    if per_host == 0:
        return [dict(cpu_only) for _ in range(hosts)]
    if per_host is not None and per_host * hosts > acc.count:
        raise ValueError(
            f"accelerators_per_host={per_host} for {hosts} hosts needs {per_host * hosts} "
            f"{acc.kind} accelerators; this machine has only {acc.count}")
    per = per_host or max(acc.count // hosts, 1)
    if acc.kind == "tpu":
        per = max(n for n in TPU_BOUNDS if n <= per)  # the slice shapes libtpu accepts
    ids = acc.id_list()
    envs: list[dict[str, str]] = []
    for i in range(hosts):
        mine = ids[i * per:(i + 1) * per]
        if len(mine) < per:
            envs.append(dict(cpu_only))
            continue
        env = {"JAX_PLATFORMS": _PLATFORMS[acc.kind]}
        if per == acc.count and not acc.ids:
            envs.append(env)  # every chip: JAX's own view, nothing narrowed
            continue
        if acc.kind == "gpu":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
        else:
            port = TPU_PORT_BASE + i
            env.update(TPU_VISIBLE_CHIPS=",".join(mine),
                       TPU_CHIPS_PER_PROCESS_BOUNDS=TPU_BOUNDS[per], TPU_PROCESS_BOUNDS="1,1,1",
                       CLOUD_TPU_TASK_ID="0",
                       TPU_PROCESS_PORT=str(port), TPU_PROCESS_ADDRESSES=f"localhost:{port}",
                       ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        envs.append(env)
    return envs


def driver_backend() -> str | None:
    """The accelerator backend JAX already opened in this process, if any (without
    importing JAX or opening anything)."""
    if "jax" not in sys.modules:
        return None
    try:
        from jax._src import xla_bridge
    except ImportError:
        return None
    opened = getattr(xla_bridge, "_backends", None) or {}
    return next((name for name in opened if name != "cpu"), None)


def local_worker_envs(hosts: int, per_host: int | None) -> list[dict[str, str]]:
    """Detect, check that this process does not hold the chips, and share them out."""
    if per_host is not None and per_host < 0:
        raise ValueError(f"accelerators_per_host must be >= 0 or None, got {per_host}")
    if per_host == 0:  # CPU-only, whatever the machine has (nothing to detect)
        return [{"JAX_PLATFORMS": "cpu"} for _ in range(hosts)]
    acc = detect()
    envs = share_out(acc, hosts, per_host)
    given = sum(1 for e in envs if e.get("JAX_PLATFORMS", "cpu") != "cpu")
    if not given:
        return envs
    held = driver_backend()
    if held is not None:
        raise RuntimeError(
            f"this process already holds the accelerator the local workers need: JAX opened "
            f"its {held!r} backend here (e.g. jax.devices()) before the cluster started, and "
            f"one process at a time can hold a {acc.kind.upper()}. Start the local cluster "
            "before using JAX on the accelerator in this process, run this process with "
            "JAX_PLATFORMS=cpu, or pass accelerators_per_host=0 for CPU-only workers")
    if given < hosts:
        per = acc.count // given
        log.warning("%d %s %s for %d hosts: %s, %s CPU-only", acc.count, acc.kind,
                    "chip" if acc.count == 1 else "chips", hosts,
                    _hosts(0, given, f"gets {per}", f"get {per} each"),
                    _hosts(given, hosts, "is", "are"))
    return envs


def _hosts(start: int, stop: int, one: str, many: str) -> str:
    """``"host 2 is"`` or ``"hosts 2-5 are"``."""
    if stop - start == 1:
        return f"host {start} {one}"
    return f"hosts {start}-{stop - 1} {many}"
