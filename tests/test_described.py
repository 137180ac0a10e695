"""A host's output descriptions, cached per output layout (colobus._host.values): each one
the same bytes as described afresh, whatever came before it."""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from colobus._host.values import HostValues

Pair = collections.namedtuple("Pair", "a b")


@jax.tree_util.register_pytree_node_class
class Tagged:
    """A custom node whose data compares equal (True == 1) but packs differently."""

    def __init__(self, v: Any, tag: Any) -> None:
        self.v, self.tag = v, tag

    def tree_flatten(self) -> tuple[tuple[Any], Any]:
        return (self.v,), self.tag

    @classmethod
    def tree_unflatten(cls, tag: Any, kids: Any) -> Tagged:
        return cls(kids[0], tag)


def _values() -> HostValues:
    devices = jax.devices("cpu")
    return HostValues(jax, {(d.platform, d.id): d for d in devices})


@pytest.fixture
def loop() -> Any:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _pins(loop: asyncio.AbstractEventLoop, *args: Any) -> list[asyncio.Future[Any]]:
    out = []
    for a in args:
        f = loop.create_future()
        f.set_result(a)
        out.append(f)
    return out


def test_each_cached_description_is_the_one_made_afresh(loop: Any) -> None:
    dev = jax.devices("cpu")[0]
    x = jax.device_put(jnp.arange(4, dtype=jnp.int32), dev)
    y = jax.device_put(jnp.arange(4, dtype=jnp.int32) + 1, dev)  # its own sharding object
    f = jax.device_put(jnp.ones((2, 3), jnp.float32), dev)
    key = jax.device_put(jax.random.key(0), dev)
    outs: list[tuple[Any, list[Any]]] = [
        (x, [x]), (x, [x]), (x, [y, x]), (x, [y, x]), (y, [x]), (y, [y]), (x, []),
        ((x, f), [x]), ((x, f), [x]), ([x, f], [f, x]), (Pair(x, f), [x]), ((x, f), [x]),
        (None, []), (None, []), ((), []), ({1: x}, [x]), ({True: x}, [x]), ({1: x}, [x]),
        ({1.0: x}, [x]), (Tagged(x, 1), [x]), (Tagged(x, True), [x]), (Tagged(x, 1), [x]),
        (key, [x]), (key, [x]), (f, [x]), (f, [x]), ((x, key), [x]), ((x, key), [x]),
        (jnp.zeros(3), [x]), (1.5, [x]), (x, [x]),
    ]
    cached = _values()
    hits = 0
    for out, args in outs:
        before = dict(cached._described)
        got = cached.outputs(out, dev, _pins(loop, *args))
        want = _values().outputs(out, dev, _pins(loop, *args))
        assert got[2] == want[2], out
        assert got[1] == want[1]
        assert len(got[0]) == len(want[0])
        assert all(a is b for a, b in zip(got[0], jax.tree_util.tree_leaves(out), strict=True)
                   if isinstance(b, jax.Array) and b is not key)
        hits += before == cached._described and bool(before)
    assert hits >= 8  # the repeats were served from the cache
    # nothing whose description could differ under an equal key was cached
    assert not any(k[0] in (jax.tree_util.tree_structure({1: 0}),
                            jax.tree_util.tree_structure(Tagged(0, 1))) for k in cached._described)
