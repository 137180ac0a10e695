"""Replicated outputs, as JAX keeps them, and compared where a call asks.

An output that is not sharded over the hosts is replicated: each device's shard holds
what its host (and device) returned, ``addressable_shards[i].data`` reads that one, and
the array's value is the first shard's (JAX never compares replicas). With
``specialize(check_replicas=True)`` each host sends a digest of every such output
(hashed in chunks on threads when large; its devices' copies compared first); the
controller compares them and fails the call with a ``ValueError`` naming the function,
the output's path and the hosts. Sizes: 16 KiB (one hash), 128 KiB (above the old 64 KiB
limit of the comparison) and 16 MiB (chunked), a single differing element at the end
included.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

import colobus as cb
from colobus._model import outlayout

P = cb.PartitionSpec
SIZES = {"16KiB": 16 << 10, "128KiB": 128 << 10, "16MiB": 16 << 20}


@cb.colocated_python
def host_valued(x: jax.Array, nbytes: int, last_only: bool) -> Any:
    """A replicated output whose value is the host's index (everywhere, or in its last
    element only), beside one every host agrees on."""
    value = np.zeros(nbytes // 4, np.float32)
    if last_only:
        value[-1] = cb.host_index()
    else:
        value[:] = cb.host_index()
    return {"same": np.ones(4, np.float32), "mine": (x, value)}


@cb.colocated_python
def agreed(x: jax.Array, nbytes: int) -> jax.Array:
    return np.arange(nbytes // 4, dtype=np.float32)


def _over_hosts(ctl: cb.Controller) -> cb.Array:
    mesh = cb.Mesh(np.array(ctl.devices()).reshape(2, 4), ("hosts", "devices"))
    return cb.device_put(np.arange(8, dtype=np.float32).reshape(2, 4),
                         cb.NamedSharding(mesh, P("hosts", "devices")))


@pytest.mark.parametrize("size", list(SIZES))
async def test_replicas_that_differ_fail_the_call_naming_function_path_and_hosts(
        ctl: cb.Controller, size: str) -> None:
    nbytes = SIZES[size]
    x = _over_hosts(ctl)
    with pytest.raises(ValueError) as info:
        await host_valued.specialize(check_replicas=True)(x, nbytes, size == "16MiB")
    text = str(info.value)
    assert text.startswith("host_valued: output['mine'][1] is replicated over hosts [0, 1]"), text
    assert "host 0 and host 1 returned different values" in text, text
    assert "shard the output over the hosts" in text, text


def test_replicas_are_kept_per_device_and_read_shard_by_shard(ctl: cb.Controller) -> None:
    """Without the check (the default, as JAX): each host's value on its devices' shards
    (its last element differs per host), the whole array's value the first shard's."""
    x = _over_hosts(ctl)
    out = host_valued(x, 64, True)  # plain code: the call's arrays (its first call waits)
    mine = out["mine"][1]
    assert mine.is_fully_replicated
    lasts = [float(s.data[-1]) for s in mine.addressable_shards]
    assert lasts == [0.0] * 4 + [1.0] * 4, lasts
    assert np.asarray(mine)[-1] == 0.0  # the first shard's, as np.asarray of JAX's
    assert float(mine.addressable_data(5)[-1]) == 0.0  # replicated: the first shard's too


@cb.colocated_python
def per_device(x: jax.Array) -> jax.Array:
    """A scalar replicated over the host's devices, each device holding its own position
    among them (10 * host + position): what JAX keeps as given."""
    devices = list(x.sharding.addressable_devices_indices_map(x.shape))
    sharding = jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec())
    order = list(sharding.mesh.devices.flat)
    pieces = [jax.device_put(np.int32(10 * cb.host_index() + order.index(d)), d)
              for d in devices]
    return jax.make_array_from_single_device_arrays((), sharding, pieces)


def test_within_a_host_each_devices_value_is_kept(ctl: cb.Controller) -> None:
    x = _over_hosts(ctl)
    out = per_device(x)
    assert [int(s.data) for s in out.addressable_shards] == [0, 1, 2, 3, 10, 11, 12, 13]
    assert int(np.asarray(out)) == 0
    with pytest.raises(ValueError, match=r"output 0 is replicated over this host's devices"):
        cb.block_until_ready(per_device.specialize(check_replicas=True)(x))


def test_check_replicas_is_given_once() -> None:
    checked = agreed.specialize(check_replicas=True)
    with pytest.raises(ValueError, match="check_replicas already specified"):
        checked.specialize(check_replicas=True)


async def test_replicas_that_agree_come_back_at_every_size(ctl: cb.Controller) -> None:
    x = _over_hosts(ctl)
    for nbytes in SIZES.values():
        # One function per size: the output's shape follows a number, which the input
        # signature leaves out (arrays returned at once take the shape learned for it).
        checked = agreed.specialize(check_replicas=True)
        out = await checked(x, nbytes)
        assert out.sharding.is_fully_replicated and out.shape == (nbytes // 4,)
        np.testing.assert_array_equal(cb.device_get(out),
                                      np.arange(nbytes // 4, dtype=np.float32))


def test_a_large_digest_is_chunked_and_sees_every_byte() -> None:
    n = 3 * outlayout.DIGEST_CHUNK_BYTES + 5  # chunks on threads, a short last one
    a = np.zeros(n, np.uint8)
    base = outlayout.digest(a)
    assert base == outlayout.digest(a.copy()) and len(base) == 16
    for i in (0, outlayout.DIGEST_CHUNK_BYTES, n - 1):  # each chunk, the last byte
        b = a.copy()
        b[i] = 1
        assert outlayout.digest(b) != base, i
    # chunks swapped: the same bytes elsewhere are another value
    c = np.concatenate([np.ones(outlayout.DIGEST_CHUNK_BYTES, np.uint8),
                        np.zeros(outlayout.DIGEST_CHUNK_BYTES, np.uint8)])
    assert outlayout.digest(c) != outlayout.digest(c[::-1].copy())
