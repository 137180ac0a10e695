"""What comparing replicas costs: the digest of a large replicated output.

Every output of a call on a mesh over several hosts carries a digest of its
bytes, so the controller can tell replicas that disagree (``_outlayout.digest``).
This measures, for ``--mib`` MiB (default 256):

* ``digest``: the digest alone, in this process, on a numpy array of that size
  (chunked on threads above 8 MiB), and one SHA-256 / blake2b pass over the same
  bytes on one thread for comparison;
* ``call``: a call on a 2-host local cluster whose host code returns a replicated
  output of that size (a numpy array, so every host also places it on its devices),
  awaited; median of ``--rounds``. Run it with this tree and with one before the
  digest to see the call's difference (the digest is the only change on that path).

    python benchmarks/replica_digest.py --mib 256 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
import time
from typing import Any

import numpy as np

import colobus as cb


def _best(fn: Any, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def digest_alone(nbytes: int, rounds: int) -> None:
    a = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    try:
        from colobus._model.outlayout import digest
    except ImportError:
        digest = None
    if digest is not None:
        print(f"digest ({nbytes >> 20} MiB, chunked on threads): "
              f"{_best(lambda: digest(a), rounds) * 1e3:.0f} ms")
    print(f"one thread, sha256: {_best(lambda: hashlib.sha256(a.data).digest(), rounds) * 1e3:.0f}"
          f" ms; blake2b: {_best(lambda: hashlib.blake2b(a.data).digest(), rounds) * 1e3:.0f} ms")


@cb.colocated_python
def replicated(x: Any, nbytes: int) -> Any:
    return np.ones(nbytes // 4, np.float32)


async def call(nbytes: int, rounds: int) -> None:
    async with cb.local_cluster(hosts=2, devices_per_host=1) as ctl:
        mesh = cb.Mesh(np.array(ctl.devices()), ("hosts",))
        x = cb.device_put(np.arange(2, dtype=np.float32),
                          cb.NamedSharding(mesh, cb.PartitionSpec("hosts")))
        await replicated(x, 1 << 20)  # warm: code shipped, JAX compiled
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            out = await replicated(x, nbytes)
            times.append(time.perf_counter() - t)
            out.delete()
        print(f"call returning {nbytes >> 20} MiB replicated over 2 hosts: median "
              f"{statistics.median(times) * 1e3:.0f} ms (min {min(times) * 1e3:.0f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    nbytes = args.mib << 20
    digest_alone(nbytes, args.rounds)
    asyncio.run(call(nbytes, args.rounds))


if __name__ == "__main__":
    main()
