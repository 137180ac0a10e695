"""Host code for tests/test_globalview.py (importable on the workers)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np


def centered(x: Any) -> Any:
    """``v - v.sum()`` over the global array: a collective across the hosts."""
    import jax

    return jax.jit(lambda v: v - v.sum(), out_shardings=x.sharding)(x)


def find_devices(x: Any, ids: list[int]) -> Any:
    """For each id sent (plain ints), the device this host's JAX has under it: its id and
    process index (-1, -1 where none)."""
    import jax

    rows = []
    for i in ids:
        found = [d for d in jax.devices() if d.id == i]
        rows.append([found[0].id, found[0].process_index] if len(found) == 1 else [-1, -1])
    return np.asarray(rows, np.int64)


def save_at_index(x: Any, folder: str) -> Any:
    """orbax's pattern: each addressable shard written at its ``shard.index`` into one
    file of the array's shape (shared by the hosts), each write counted per row."""
    rows = x.shape[0]
    data = np.memmap(f"{folder}/data", dtype=np.float32, mode="r+", shape=x.shape)
    counts = np.memmap(f"{folder}/counts", dtype=np.int32, mode="r+", shape=(rows,))
    for shard in x.addressable_shards:
        data[shard.index] = np.asarray(shard.data)
        counts[shard.index[0]] += 1
    data.flush()
    counts.flush()
    return np.int32(len(x.addressable_shards))


def fetch_whole(x: Any) -> Any:
    """Block-view code: the host's array argument read whole (in a job it is global, and
    JAX cannot fetch what this process does not address)."""
    return np.asarray(x) * 2


def build_global(x: Any, n: int) -> Any:
    """Global-view code: the global array made of this host's shards (in the block view
    the shards are the block's, too few for the global shape)."""
    import jax

    return jax.make_array_from_single_device_arrays((n,), x.sharding,
                                                    [s.data for s in x.addressable_shards])


def build_over_struct(x: Any, struct: Any, global_shape: tuple[int, ...]) -> Any:
    """A loader that builds the struct's global shape over its sharding (the block view
    then holds the whole array on each host); returns the warning's words, if one came."""
    import jax

    heard: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            heard.append(record.getMessage())

    log = logging.getLogger("colobus.worker")
    keep = Keep()
    log.addHandler(keep)
    try:
        jax.make_array_from_callback(global_shape, struct.sharding,
                                     lambda index: np.zeros(global_shape, np.float32)[index])
        jax.make_array_from_callback(struct.shape, struct.sharding,  # the block: no word
                                     lambda index: np.zeros(struct.shape, np.float32)[index])
    finally:
        log.removeHandler(keep)
    said = " ".join(heard)
    return np.asarray([len(heard), "jax_distributed" in said, str(struct.shape) in said],
                      np.int32)


def block_and_devices(x: Any) -> Any:
    """What this host sees: its argument's length and how many devices its JAX lists."""
    import jax

    return np.asarray([x.shape[0], len(jax.devices())], np.int32)


def add_by_device(x: Any, y: Any) -> Any:
    """JAX's upstream ``add``: ``y``'s shards plus ``x``'s on the same devices, laid out
    like ``y`` (a global array over ``y``'s mesh, whatever the call's device order)."""
    import jax

    by_device = {s.device: s.data for s in x.addressable_shards}
    arrays = [s.data + by_device[s.device] for s in y.addressable_shards]
    return jax.make_array_from_single_device_arrays(y.shape, y.sharding, arrays)


def upper(s: Any) -> Any:
    """Strings upper-cased where they live, shard by shard (JAX holds them on one device
    but makes no global array of them: in a job too, they arrive as the host's block)."""
    import jax

    out = [jax.device_put(np.vectorize(str.upper, otypes=[np.dtypes.StringDType()])(
        np.asarray(shard.data)), shard.device) for shard in s.addressable_shards]
    return jax.make_array_from_single_device_arrays(s.shape, s.sharding, out)
