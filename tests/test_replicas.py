"""Replicated outputs that differ between hosts fail the call, whatever their size.

An output that is not sharded over the hosts is replicated: every host that holds
its block must return the same value, or a fetch would read one host's copy as
everyone's. Each host sends a digest of every such output (hashed in chunks on
threads when large); the controller compares them and fails the call with a
``ValueError`` naming the function, the output's path and the hosts. Sizes: 16 KiB
(one hash), 128 KiB (above the old 64 KiB limit of the comparison) and 16 MiB
(chunked), a single differing element at the end included.
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
        await host_valued(x, nbytes, size == "16MiB")
    text = str(info.value)
    assert text.startswith("host_valued: output['mine'][1] is replicated over hosts [0, 1]"), text
    assert "host 0 and host 1 returned different values" in text, text
    assert "shard the output over the hosts" in text, text


async def test_replicas_that_agree_come_back_at_every_size(ctl: cb.Controller) -> None:
    x = _over_hosts(ctl)
    for nbytes in SIZES.values():
        out = await agreed(x, nbytes)
        assert out.sharding.is_fully_replicated and out.shape == (nbytes // 4,)
        np.testing.assert_array_equal(await cb.device_get(out),
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
