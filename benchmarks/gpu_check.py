"""A check for a machine with an accelerator: what a worker there reports, end to end.

Starts ``local_cluster(hosts=2)`` (two worker processes on this machine, each
importing JAX as it is installed here) and prints, as one JSON object:

* each host's devices as the controller sees them (an accelerator first, then the
  host's CPU devices: ``colobus._host.values.local_devices``);
* ``colocated_cpu_devices`` of the accelerators: the CPU device of the same host;
* a colocated call on those CPU devices that reports what JAX sees inside the
  worker (its backend and devices), and the host's PID;
* a ``device_put`` of an array onto an accelerator of each host, a colocated
  call on the accelerator devices that computes on it there (``x * 2`` in JAX on
  the device), and ``device_get`` of the result, checked against numpy.

With no accelerator the workers report CPU devices only; the script says so and
exits 0 (nothing to check). It exits 1 when a check fails.

    python benchmarks/gpu_check.py
    python benchmarks/gpu_check.py --dry-run   # CPU devices stand in for accelerators
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import numpy as np

import colobus as cb


@cb.colocated_python
def what_jax_sees(x: Any) -> Any:
    """Runs on each host's CPU device: JAX's backend and devices there, as text."""
    import jax

    report = {"pid": os.getpid(), "backend": jax.default_backend(),
              "devices": [f"{d.platform}:{d.id}:{d.device_kind}" for d in jax.devices()]}
    print("GPU_CHECK_HOST " + json.dumps(report), flush=True)
    return x


@cb.colocated_python
def double_on_device(x: Any) -> Any:
    """Runs where ``x`` lives (an accelerator): ``x * 2`` computed there by JAX."""
    import jax

    y = jax.jit(lambda a: a * 2)(x)
    devs = {f"{d.platform}:{d.id}" for d in y.devices()}
    print("GPU_CHECK_DOUBLE " + json.dumps(sorted(devs)), flush=True)
    return y


async def _check(dry_run: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with cb.local_cluster(hosts=2, devices_per_host=2) as ctl:
        hosts = ctl.hosts()
        out["hosts"] = [[repr(d) + f" {d.device_kind}" for d in h.devices] for h in hosts]
        accels = [d for d in cb.devices() if d.platform != "cpu" or dry_run]
        out["accelerators"] = len(accels)
        if not accels:
            out["result"] = "no accelerator: workers report CPU devices only"
            return out
        one_per_host = [next(d for d in accels if d.host == h.index) for h in hosts]
        cpus = cb.colocated_cpu_devices(one_per_host)
        out["colocated_cpu_devices"] = {repr(a): repr(c) for a, c in zip(one_per_host, cpus,
                                                                          strict=True)}
        assert all(c.platform == "cpu" and c.host == a.host
                   for a, c in zip(one_per_host, cpus, strict=True))
        mesh = cb.Mesh(np.array(cpus, dtype=object), ("hosts",))
        probe = cb.device_put(np.arange(len(cpus), dtype=np.float32),
                              cb.NamedSharding(mesh, cb.PartitionSpec("hosts")))
        await what_jax_sees(probe)
        gmesh = cb.Mesh(np.array(one_per_host, dtype=object), ("hosts",))
        data = np.arange(8 * len(one_per_host), dtype=np.float32).reshape(len(one_per_host), 8)
        x = cb.device_put(data, cb.NamedSharding(gmesh, cb.PartitionSpec("hosts")))
        y = await double_on_device(x)
        got = np.asarray(await cb.device_get(y))
        out["double_ok"] = bool(np.array_equal(got, data * 2))
        out["result"] = "ok" if out["double_ok"] else "mismatch"
    return out


def main() -> int:
    # --dry-run: take each host's CPU devices as its accelerators (checks this script).
    out = asyncio.run(_check("--dry-run" in sys.argv))
    print(json.dumps(out, indent=1))
    return 0 if out.get("result", "").startswith(("ok", "no accelerator")) else 1


if __name__ == "__main__":
    sys.exit(main())
