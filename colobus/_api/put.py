"""``device_put``: moving data onto hosts (a numpy value's blocks, or an array resharded
from where it lives), by the star or down broadcast trees."""

from __future__ import annotations

import collections
import time
from typing import Any

import numpy as np

from .._controller.controller import Controller, default_controller
from .._model import moves as _moves
from .._model.blocks import host_blocks
from .._model.devices import Device
from .._model.jaxside import is_key_array
from .._model.moves import plan_reshard
from .._model.sharding import Sharding, SingleDeviceSharding
from .._wire import protocol as P
from .._wire.chunks import MAX_PART
from .._wire.codec import key_impl_name, to_buffer
from .._wire.envelope import pack_body
from .array import Array, _is_array_leaf, _spec_of, check_owner
from .reshard import Reshard, mesh_message
from .treeput import plan_trees, upload_sizes

SLICE_S = 0.005  # a put's messages leave in slices of this long on the loop thread
BOX_HEADROOM = 1 << 17  # a reshard box plus its FETCH reply's or PIECE's header fits a part

__all__ = ["device_put"]

def _to_sharding(ctl: Controller, target: Any) -> Sharding:
    if isinstance(target, Sharding):
        return target
    if isinstance(target, Device):
        return SingleDeviceSharding(target)
    raise TypeError(f"device_put needs a colobus Device or Sharding, got {type(target).__name__}; "
                    "use cb.devices() or cb.NamedSharding(cb.Mesh(...), cb.PartitionSpec(...))")


def _check_devices(ctl: Controller, sharding: Sharding) -> None:
    known = {d.id: d for h in ctl.hosts() for d in h.devices}
    for d in sharding.device_set:
        if d.id not in known or known[d.id] != d or known[d.id].host != d.host:
            raise ValueError(f"{d!r} is not a device of this controller; use ctl.devices()")
    ctl._hosts.check(sorted({d.host for d in sharding.device_set}), None, "devices")


def _host_array(x: Any) -> tuple[np.ndarray[Any, Any], Any, str | None]:
    """numpy data, the dtype the handle reports, and the PRNG impl for key arrays."""
    if is_key_array(x):
        import jax

        return np.asarray(jax.random.key_data(x)), x.dtype, key_impl_name(x)
    arr = np.asarray(x)
    # numpy 2's StringDType reports hasobject, but travels (as UTF-8, see _codec)
    if arr.dtype.hasobject and not isinstance(arr.dtype, np.dtypes.StringDType):
        raise ValueError(
            "device_put cannot send arrays of dtype object; convert to a numeric, string "
            "or structured dtype first")
    return arr, arr.dtype, None


class _PreparedPut:
    """One leaf of a ``device_put``, checked and cut into host blocks, not yet sent."""

    __slots__ = ("dtype", "impl", "msgs", "ref", "shape", "sharding", "trees")

    def __init__(self, ctl: Controller, x: Any, sharding: Sharding) -> None:
        data, self.dtype, self.impl = _host_array(x)
        impl = self.impl
        self.shape = tuple(data.shape[: data.ndim - 1]) if impl else tuple(data.shape)
        self.sharding = sharding
        blocks = host_blocks(sharding, self.shape)  # validates rank and divisibility
        _check_devices(ctl, sharding)
        self.ref = ctl._ops.next_id() << 16
        spec = P.encode_spec(_spec_of(sharding))
        self.msgs: list[tuple[int, P.Put, memoryview]] = []
        for h, b in blocks.items():
            block = data[b.index] if data.ndim else data  # 0-d StringDType indexes to a str
            descr, buf = to_buffer(block)
            body = P.Put(self.ref, list(block.shape), descr, mesh_message(b), spec, impl,
                         sharding.memory_kind)
            pack_body(body.to_wire())  # SerializationError here, at the call, not when sent
            self.msgs.append((h, body, buf))
        self.trees = plan_trees(ctl, self.msgs, [b.index for b in blocks.values()])

    def handle(self, ctl: Controller) -> Array:
        return Array(ctl, self.ref, self.shape, self.dtype, self.sharding, key_impl=self.impl)


class _PreparedReshard:
    """One ``cb.Array`` leaf of a ``device_put`` onto another sharding, checked, planned."""

    __slots__ = ("plan", "sharding", "src")

    def __init__(self, src: Array, sharding: Sharding) -> None:
        src.check_usable()
        ctl = src._ctl
        host_blocks(sharding, src.shape)  # validates rank and divisibility
        _check_devices(ctl, sharding)
        # A typed key's dtype has no useful itemsize: its key data is a few words.
        itemsize = 16 if src._key_impl else src.itemsize
        # Each box is one FETCH reply: well under what the controller accepts (a host
        # keeps REPLY_MARGIN, 1 MiB, for the reply's header and batch), and with its
        # header within one part, so that once the window is full-size the reply and
        # each PIECE travel whole: no reassembly copy at the controller or the host
        # (8 MiB boxes, each cut in parts and put together again, cost twice the CPU).
        chunk = min(_moves.CHUNK_BYTES, MAX_PART - BOX_HEADROOM,
                    max(1 << 16, (ctl.max_message_bytes - (1 << 20)) // 2))
        self.plan = plan_reshard(src.sharding, sharding, src.shape, itemsize, chunk)
        self.src = src
        self.sharding = sharding

    def start(self) -> Array:
        src = self.src
        ctl = src._ctl
        new = Array(ctl, ctl._ops.next_id() << 16, src.shape, src.dtype, self.sharding,
                    key_impl=src._key_impl)
        new._call = src._call  # a pending source: the new array waits for its call too
        Reshard(ctl, src, new, self.sharding, self.plan, src._key_impl).start()
        return new


def _prepare(ctl: Controller, x: Any, sharding: Sharding
             ) -> Array | _PreparedPut | _PreparedReshard:
    if isinstance(x, Array):
        check_owner(x, ctl)  # a reshard of another controller's array would move wrong data
        if x.sharding == sharding and x.sharding.device_list == sharding.device_list:
            return x
        return _PreparedReshard(x, sharding)  # each host gets the blocks it lacks
    return _PreparedPut(ctl, x, sharding)


def device_put(x: Any, device_or_sharding: Any) -> Any:
    """Place ``x`` (numpy or JAX arrays, scalars, or a pytree of them) on hosts.

    Returns ``cb.Array`` handles at once; the upload runs in the background and the arrays
    can be used in calls immediately. Each host receives only its own block (a block that
    many hosts hold goes down a tree of them: ``docs/moving_arrays.md``, "Broadcast trees"). Every
    leaf is checked before anything is sent: a bad leaf raises and no part of the tree
    leaves this process. Large inputs are sent without copying: do not modify a numpy
    input until ``cb.block_until_ready`` on the result returned.

    A ``cb.Array`` leaf onto another sharding is resharded: each host gets the
    parts of its new block it lacks, through the controller (``docs/moving_arrays.md``,
    "Resharding"); onto its own sharding it is returned as is.

    Args:
        x: the data.
        device_or_sharding: a ``cb.Device``, a ``cb.Sharding``, or a pytree of
            them matching ``x``.

    Raises:
        ValueError: a shape the sharding cannot divide, a spec naming an unknown
            axis, an object-dtype array, a device not in this cluster.
        HostLostError: the sharding uses devices of a lost host, or a ``cb.Array``
            to reshard has data on one.
        RuntimeError: a ``cb.Array`` to reshard was deleted.
    """
    import jax

    ctl = default_controller()
    if isinstance(device_or_sharding, Device | Sharding):
        sharding = _to_sharding(ctl, device_or_sharding)
        prepared = jax.tree_util.tree_map(lambda leaf: _prepare(ctl, leaf, sharding), x,
                                          is_leaf=_is_array_leaf)
    else:
        prepared = jax.tree_util.tree_map(
            lambda leaf, target: _prepare(ctl, leaf, _to_sharding(ctl, target)), x,
            device_or_sharding, is_leaf=_is_array_leaf)
    sends: list[tuple[Array, _PreparedPut]] = []

    def finish(p: Array | _PreparedPut | _PreparedReshard) -> Array:
        if isinstance(p, Array):
            return p
        if isinstance(p, _PreparedReshard):
            return p.start()
        arr = p.handle(ctl)
        sends.append((arr, p))
        return arr

    out = jax.tree_util.tree_map(finish, prepared, is_leaf=_is_prepared_leaf)
    if sends:
        _send_all(ctl, sends)
    return out


def _send_all(ctl: Controller, sends: list[tuple[Array, _PreparedPut]]) -> None:
    """Send a put's messages, in order with everything asked of the controller before
    and after it, in slices of :data:`SLICE_S` on the loop thread (a pytree of many
    leaves: reads and heartbeats go on between them); a tree's digests, when the caller
    is the loop thread, are computed on another thread first."""
    ctl._uploads.reserve(upload_sizes([(p.msgs, p.trees) for _, p in sends]))  # may wait
    hashing = [t for _, p in sends for t in p.trees if t.digests is None]
    if hashing:  # (only on the loop thread: a plain thread hashed in TreePut)
        def digests() -> None:
            for t in hashing:
                t.hash()

        ctl._ops.hold_for(digests)
    leaves = iter(sends)

    def step() -> bool:
        """One slice: True while leaves are left."""
        handed: collections.Counter[int] = collections.Counter()
        end = time.monotonic() + SLICE_S
        try:
            for arr, p in leaves:
                for h, body, buf in p.msgs:
                    handed[h] += buf.nbytes
                    host = ctl._hosts[h]
                    if host.alive and host.generation == arr._gens[h]:
                        ctl._send(host, body, b"", [buf])
                        ctl._count("bytes_put", buf.nbytes)
                for tree in p.trees:
                    handed.update(tree.sizes())
                    tree.start(arr._gens)
                if time.monotonic() > end:
                    return True
            return False
        finally:  # the channel counts them now (or nobody: a lost host's)
            for h, n in handed.items():
                ctl._uploads.handed(h, n)

    ctl._ops.post_steps(step)


def _is_prepared_leaf(x: Any) -> bool:
    return isinstance(x, Array | _PreparedPut | _PreparedReshard)
