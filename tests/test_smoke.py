"""End-to-end smoke: a real cluster, a real call."""

from __future__ import annotations

import numpy as np

import colobus as cb


@cb.colocated_python
def add_one(x):
    return x + 1


async def test_async_round_trip(ctl: cb.Controller) -> None:
    d = cb.devices()[0]
    x = cb.device_put(np.arange(4, dtype=np.float32), d)
    y = await add_one(x)
    assert isinstance(y, cb.Array)
    np.testing.assert_array_equal(cb.device_get(y), np.arange(4) + 1)


def test_sync_round_trip(ctl: cb.Controller) -> None:
    d = cb.devices()[5]
    x = cb.device_put(np.arange(4, dtype=np.int32), d)
    y = add_one(x)  # its array, as JAX's
    np.testing.assert_array_equal(np.asarray(y), np.arange(4) + 1)
