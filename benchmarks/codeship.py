"""Shipping the user's package with the first call: a 10 MB package to 8 hosts.

Builds a package of ``--mib`` MiB of real Python source (copied from the
standard library, so it compresses as source does), imports its ``steps``
module from a directory outside the installed environment, and times the first
call of a function of it on a fresh ``local_cluster`` of ``--hosts`` workers:

* ``ship``: ``ship_code=True`` (the default): the call reads and zips the
  package, sends it to every host, each unpacks and imports it;
* ``noship``: ``ship_code=False``: the workers import it from the driver's own
  directory (local workers share ``sys.path``), as an installed package would.

Rounds alternate the two, each on a new cluster; then the second call's time
(everything already there). Also the controller's read-and-zip time alone.

    python benchmarks/codeship.py --hosts 8 --mib 10 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

import colobus as cb
from colobus._controller.codeship import snapshot

STEPS = '''
import colobus as cb
from . import helpers


@cb.colocated_python
def step(x):
    return x + helpers.ONE
'''


def make_package(where: Path, name: str, mib: float) -> Path:
    """``name/`` with ``__init__``, ``helpers``, ``steps`` and ~``mib`` MiB of stdlib
    source under ``name/vendored/`` (never imported: it only has to travel)."""
    pkg = where / name
    (pkg / "vendored").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "helpers.py").write_text("ONE = 1\n")
    (pkg / "steps.py").write_text(STEPS)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    left = int(mib * (1 << 20))
    for i, src in enumerate(sorted(stdlib.rglob("*.py"))):
        if left <= 0:
            break
        data = src.read_bytes()[:left]
        (pkg / "vendored" / f"m{i}_{src.name}").write_bytes(data)  # (flat: a source tree)
        left -= len(data)
    return pkg


async def first_calls(name: str, hosts: int, ship: bool) -> tuple[float, float]:
    """A fresh cluster: the first call's and the second call's seconds."""
    steps = sys.modules[f"{name}.steps"]
    async with cb.local_cluster(hosts=hosts, ship_code=ship) as ctl:
        mesh = cb.Mesh(np.array(ctl.devices()), ("h",))
        x = cb.device_put(np.zeros(hosts, np.float32),
                          cb.NamedSharding(mesh, cb.PartitionSpec("h")))
        await cb.block_until_ready(x)
        t0 = time.perf_counter()
        await cb.block_until_ready(await steps.step(x))
        t1 = time.perf_counter()
        await cb.block_until_ready(await steps.step(x))
        t2 = time.perf_counter()
        assert (ctl.stats()["packages_sent"] == hosts) == ship
        return t1 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--mib", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    where = Path(tempfile.mkdtemp(prefix="codeship-bench-"))
    name = f"benchpkg_{os.getpid()}"
    try:
        pkg = make_package(where, name, args.mib)
        sys.path.insert(0, str(where))
        __import__(f"{name}.steps")
        t = time.perf_counter()
        snap = snapshot(name, str(pkg))
        zip_s = time.perf_counter() - t
        print(f"package: {snap.nbytes / 1e6:.1f} MB of files, zip {len(snap.archive) / 1e6:.1f} "
              f"MB; read + zip + digest on the controller {zip_s * 1e3:.0f} ms")
        out: dict[str, list[tuple[float, float]]] = {"ship": [], "noship": []}
        for r in range(args.rounds):
            for mode in (("ship", "noship") if r % 2 == 0 else ("noship", "ship")):
                first, second = asyncio.run(first_calls(name, args.hosts, mode == "ship"))
                out[mode].append((first, second))
                print(f"round {r} {mode:6}: first call {first * 1e3:7.0f} ms, "
                      f"second {second * 1e3:6.1f} ms", flush=True)
        summary = {m: {"first_ms": statistics.median(f for f, _ in v) * 1e3,
                       "second_ms": statistics.median(s for _, s in v) * 1e3}
                   for m, v in out.items()}
        summary["package"] = {"files_mb": snap.nbytes / 1e6, "zip_mb": len(snap.archive) / 1e6,
                              "zip_ms": zip_s * 1e3, "hosts": args.hosts}
        print(json.dumps(summary, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=1))
    finally:
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
