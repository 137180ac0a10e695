# Adapted from JAX's user guide "Colocated Python", docs/notebooks/colocated-python.md in
# https://github.com/jax-ml/jax. Copyright The JAX Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License"); you may not use this
# file except in compliance with the License. You may obtain a copy of the License at
#
#     https://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software distributed under
# the License is distributed on an "AS IS" BASIS, WITHOUT WARRANTIES OR CONDITIONS OF ANY
# KIND, either express or implied. See the License for the specific language governing
# permissions and limitations under the License.
#
# Changed from the original: the imports (colobus for jax.experimental.colocated_python;
# JAX's device and array calls that place data for colobus's, as a porting user writes
# them: cb.devices, cb.Mesh, cb.NamedSharding, cb.PartitionSpec, cb.device_put,
# cb.ShapeDtypeStruct; JAX's jax.block_until_ready stays), the file '/tmp/foo' made a
# file of this run, each cell followed by the asserts of what the guide shows, and cell
# 10 followed by a variant that shows its concurrency with a barrier on the hosts
# instead of a clock (in the default view, one JAX job,
# calls on several hosts run one at a time: that variant runs on host 0's devices, where
# calls keep their concurrency). A call's value is used as the guide uses it (its arrays, as JAX
# returns them). Run as a plain script (the guide's habits are sync):
# `python tests/userguide_client.py DIRECTORY`.
"""JAX's colocated Python user guide, every cell, on a colobus cluster of 2 hosts."""

from __future__ import annotations

import concurrent.futures
import gc
import os
import sys
import time

import habits_hostside
import jax
import jax.numpy as jnp

import colobus as cb
import colobus as colocated_python  # was: import jax.experimental.colocated_python as ...

WORK = sys.argv[1] if len(sys.argv) > 1 else "."
FOO = os.path.join(WORK, "foo")  # was: '/tmp/foo'


def main(ctl: cb.Controller) -> None:
    # -- Colocated CPU devices ------------------------------------------------------------
    devices = cb.devices()  # was: jax.devices()
    cpu_devices = colocated_python.colocated_cpu_devices(devices)
    print(cpu_devices)
    assert len(cpu_devices) == 4 and all(d.platform == "cpu" for d in cpu_devices)
    assert {d.host for d in cpu_devices} == {0, 1}
    print("cell 1 ok")

    cpu_mesh = cb.Mesh(cpu_devices, ["x"])  # was: jax.sharding.Mesh
    cpu_sharding = cb.NamedSharding(cpu_mesh, cb.PartitionSpec())  # was: jax.sharding..., jax.P()
    x = cb.device_put(1, cpu_sharding)  # was: jax.device_put
    # was: jax.jit(lambda x: x + 1)(x): colobus runs JAX where the devices are, on the hosts
    y = colocated_python.colocated_python(lambda x: jax.jit(lambda x: x + 1)(x))(x)
    print(y)
    assert int(cb.device_get(y)) == 2  # a future in the tree: waited for, then fetched
    print("cell 2 ok")

    # -- Colocated Python function ----------------------------------------------------------
    def f(x):
        return x + 1

    f = colocated_python.colocated_python(f)
    y = f(x)  # the first call ran synchronously: done already
    assert y.sharding == x.sharding
    print(y)
    assert int(cb.device_get(y)) == 2
    print("cell 3 ok")

    def f(x):
        with open(FOO, "w") as f:
            f.write(str(x))
        return x

    f = colocated_python.colocated_python(f)
    jax.block_until_ready(f(x))
    with open(FOO) as file:
        assert file.read() == "1"
    print("cell 4 ok")

    # -- Specialization -----------------------------------------------------------------------
    def f(x):
        return x + 1

    f = colocated_python.colocated_python(f)
    f = f.specialize(out_specs_fn=lambda x: x)
    y = f(x)
    assert y.sharding == x.sharding
    assert int(cb.device_get(y)) == 2
    print("cell 5 ok")

    def f(x):
        return x + 1

    f = colocated_python.colocated_python(f)
    f = f.specialize(
        in_specs=(
            # args
            (
                cb.ShapeDtypeStruct(  # was: jax.ShapeDtypeStruct
                    shape=(), dtype=jnp.int32, sharding=cpu_sharding
                ),
            ),
            # kwargs
            {},
        ),
        out_specs_fn=lambda x: cb.ShapeDtypeStruct(
            shape=(), dtype=jnp.int32, sharding=cpu_sharding
        ),
    )
    out = f(x)  # `x` must match the input spec.
    assert int(cb.device_get(out)) == 2
    print("cell 6 ok")

    def f():
        with open(FOO, "w") as f:
            f.write("foo")
        return

    f = colocated_python.colocated_python(f)
    f = f.specialize(devices=cpu_devices)
    f()  # Would be an error if `f` is not specialized with ``devices``.
    with open(FOO) as file:  # the first call ran synchronously: the file is written
        assert file.read() == "foo"
    print("cell 7 ok")

    # -- Colocated Python class ---------------------------------------------------------------
    class Adder:

        def __init__(self, increment):
            print('Adder created', flush=True)
            self.increment = increment

        def __del__(self):
            print('Adder destroyed', flush=True)

        def add(self, x):
            return x + self.increment

    Adder = colocated_python.colocated_python_class(Adder)
    adder = Adder(1)
    assert "not built yet" in repr(adder)  # created on the hosts only at the first call
    x = cb.device_put(1, cpu_sharding)
    y = adder.add(x)
    print(y)
    assert int(cb.device_get(y)) == 2
    assert "built on hosts [0, 1]" in repr(adder)
    print("cell 8 ok")

    del adder
    gc.collect()
    # Destroyed asynchronously, before any later call of this thread on those hosts.
    jax.block_until_ready(colocated_python.colocated_python(lambda x: x)(x))
    stats = ctl.refresh_stats().result(timeout=60)
    assert all(h["objects"] == 0 for h in stats["hosts"].values()), stats["hosts"]
    print("cell 9 ok")

    # -- Execution order and concurrency ------------------------------------------------------
    def f(x):
        time.sleep(1)
        return x + 1

    f = colocated_python.colocated_python(f)
    f = f.specialize(out_specs_fn=lambda x: x)  # Calls will be asynchronous.

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        fut1 = executor.submit(f, x)
        fut2 = executor.submit(f, x)
        # Will finish in approximately 1 second instead of 2 seconds.
        out = jax.block_until_ready([fut1.result(), fut2.result()])
    assert [int(cb.device_get(o)) for o in out] == [2, 2]
    print(f"cell 10 ok ({time.perf_counter() - start:.2f} s)")

    # The cluster runs the default view, one JAX job: there calls that span several
    # hosts start in one order on every host (their collectives pair up), so the two
    # calls above ran one after the other (about 2 s: docs/jax_job.md, "Calls in a job:
    # one order"). Calls on one host keep their concurrency. That they ran at the same
    # time there, asserted without a clock: the same cell on host 0's devices, without
    # specialization. Each thread's first call waits for its own call, so the pool runs
    # them on two threads for sure (above, a thread done submitting may take the second
    # call too, making both one thread's, in order), and both calls must be in g at once
    # on the host to get past the barrier there.
    assert ctl.stats()["jax_job"]["state"] == "formed"  # no option given: the global view
    host0 = cb.NamedSharding(cb.Mesh([d for d in cpu_devices if d.host == 0], ["x"]),
                             cb.PartitionSpec())
    x0 = cb.device_put(1, host0)

    def g(x):
        habits_hostside.meet("first calls")
        return x + 1

    g = colocated_python.colocated_python(g)
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        futs = [executor.submit(g, x0) for _ in range(2)]
        done = [fut.result() for fut in futs]
    assert all(d.is_ready() for d in done)  # each returned once its call had run
    assert [int(cb.device_get(d)) for d in done] == [2, 2]
    print("cell 10, first calls ok")


if __name__ == "__main__":
    with cb.local_cluster(hosts=2, devices_per_host=2) as ctl:
        main(ctl)
    print("the guide ran")
