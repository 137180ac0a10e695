"""What forming the hosts' JAX job costs (``jax_distributed=True``), next to the block model.

For each host count: start a local cluster of ``--hosts`` CPU-only workers (1 device
each) with and without ``jax_distributed``, and report the time to enter it (workers
started, joined, and with a job: formed), the forming alone (FORM sent to every host
in: ``ctl.stats()["jax_job"]["form_s"]``), and a cross-host jitted sum's first and
later times. Then kill one host (``restart=1``) and time until the job formed again.

    python benchmarks/jax_job.py --hosts 2 8
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time

import numpy as np

import colobus as cb


@cb.colocated_python
def total(x):  # type: ignore[no-untyped-def]
    import jax

    out = jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec())
    return jax.jit(lambda v: v.sum(), out_shardings=out)(x)


def one(hosts: int, job: bool, reform: bool) -> dict[str, float]:
    t0 = time.perf_counter()
    with cb.local_cluster(hosts=hosts, devices_per_host=1, jax_distributed=job,
                          restart=1 if reform else 0) as ctl:
        entered = time.perf_counter() - t0
        out = {"enter_s": entered}
        if not job:
            return out
        out["form_s"] = ctl.stats()["jax_job"]["form_s"]
        mesh = cb.make_mesh((hosts,), ("x",))
        x = cb.device_put(np.arange(hosts, dtype=np.float32), cb.NamedSharding(mesh,
                                                                         cb.PartitionSpec("x")))
        t = time.perf_counter()
        cb.block_until_ready(total(x))
        out["first_sum_s"] = time.perf_counter() - t
        times = []
        for _ in range(20):
            t = time.perf_counter()
            cb.block_until_ready(total(x))
            times.append(time.perf_counter() - t)
        out["sum_ms"] = statistics.median(times) * 1e3
        if reform:
            os.kill(ctl.hosts()[hosts - 1].pid, signal.SIGKILL)
            t = time.perf_counter()
            while ctl.stats()["jax_job"]["state"] == "formed":
                time.sleep(0.01)
            ctl.run_sync(ctl.wait_for_hosts(timeout=300))
            out["reform_s"] = time.perf_counter() - t
            out["reform_form_s"] = ctl.stats()["jax_job"]["form_s"]
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--no-reform", action="store_true", help="skip the loss and re-forming")
    args = ap.parse_args()
    for n in args.hosts:
        block = one(n, False, False)
        job = one(n, True, not args.no_reform)
        print(f"{n} hosts: enter {block['enter_s']:.2f} s without a job, "
              f"{job['enter_s']:.2f} s with one (forming {job['form_s']:.2f} s); "
              f"first cross-host sum {job['first_sum_s']:.2f} s, then {job['sum_ms']:.1f} ms"
              + (f"; a host killed: formed again in {job['reform_s']:.2f} s (forming "
                 f"{job['reform_form_s']:.2f} s)" if "reform_s" in job else ""), flush=True)


if __name__ == "__main__":
    main()
