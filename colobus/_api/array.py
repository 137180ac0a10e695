"""Array handles: data that lives on hosts (one ref per host of the sharding, each host
holding only its own block), and moving it there and back; dropping the handle (or
``delete()``) frees the data on the hosts, batched."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from .._controller.controller import Controller, default_controller
from .._controller.future import Future
from .._controller.hosts import Host
from .._errors import HostLostError
from .._model import moves as _moves
from .._model.blocks import HostBlock, assemble, host_blocks
from .._model.devices import Device
from .._model.jaxside import is_key_array
from .._model.moves import plan_reshard
from .._model.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding
from .._wire import protocol as P
from .._wire.chunks import MAX_PART
from .._wire.codec import key_impl_name, to_buffer
from .._wire.describe import read_fetched
from .._wire.envelope import Envelope, pack_body
from .reshard import Reshard, mesh_message
from .shards import Shard, addressable_shards
from .treeput import plan_trees, upload_sizes

BOX_HEADROOM = 1 << 17  # a reshard box plus its FETCH reply's or PIECE's header fits a part

__all__ = ["Array", "MisusedHandle", "block_until_ready", "check_owner", "device_get",
           "device_put", "mesh_message"]


class MisusedHandle(ValueError):
    """A handle used where it does not belong (never a pickling problem)."""


def check_owner(handle: Any, ctl: Controller) -> None:
    """Raise ``ValueError`` unless ``handle`` (an Array or Future) was made by ``ctl``.

    Ids restart per controller, so a handle of another controller would name
    whatever the hosts of ``ctl`` hold under the same number.
    """
    owner = handle._ctl if isinstance(handle, Array) else getattr(handle, "_owner", None)
    if owner is not None and owner is not ctl:
        kind = "cb.Array" if isinstance(handle, Array) else "cb.Future"
        raise MisusedHandle(f"this {kind} belongs to the controller that made it, {owner!r}; it "
                         f"cannot be used with another controller, {ctl!r}")


def _spec_of(sharding: Sharding) -> PartitionSpec:
    return sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()


_HOSTS: dict[int, tuple[tuple[Any, ...], tuple[int, ...]]] = {}  # id(device list) ->


def _hosts_of(sharding: Sharding) -> tuple[int, ...]:
    """The hosts of ``sharding``, sorted: one tuple per device list (a mesh's list is one
    object, so the registry's generations cache on the tuple)."""
    if type(sharding) is SingleDeviceSharding:
        return (sharding.device.host,)
    devices = sharding.device_list
    hit = _HOSTS.get(id(devices))
    if hit is not None and hit[0] is devices:
        return hit[1]
    hosts = tuple(sorted({d.host for d in devices}))
    if len(_HOSTS) >= 256:
        _HOSTS.clear()
    _HOSTS[id(devices)] = (devices, hosts)
    return hosts


class Array:
    """A handle to an array whose blocks live on hosts.

    Attributes:
        shape, dtype, sharding: the global array's layout.
    """

    __slots__ = ("__weakref__", "_checked", "_ctl", "_deleted", "_failed", "_finalizer", "_gens",
                 "_key_impl", "_ready", "dtype", "ref", "shape", "sharding")

    def __init__(self, ctl: Controller, ref: int, shape: tuple[int, ...], dtype: Any,
                 sharding: Sharding, *, key_impl: str | None = None,
                 ready: bool = False, owns_ref: bool = True) -> None:
        self._ctl = ctl
        self.ref = ref
        self.shape = tuple(map(int, shape))
        self.dtype = dtype
        self.sharding = sharding
        self._key_impl = key_impl
        self._ready = ready
        self._deleted = False
        self._failed: BaseException | None = None  # the reshard that makes it failed
        self._checked = -1  # the host registry's ``changes`` when check_usable last passed
        # each host's generation now (a dict the registry shares: never changed)
        self._gens = ctl._hosts.generations(_hosts_of(sharding))[1]
        # frees the blocks on the hosts once this handle goes (or at ``delete``); a weak
        # reference with a callback costs a third of a ``weakref.finalize``
        self._finalizer: weakref.ref[Array] | None = None
        if owns_ref:
            self._finalizer = fin = weakref.ref(self, _release_array)
            _array_refs[fin] = (ctl, self._gens, ref)

    # -- metadata -------------------------------------------------------------------------

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * int(self.dtype.itemsize)

    @property
    def itemsize(self) -> int:
        return int(self.dtype.itemsize)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    @property
    def hosts(self) -> tuple[int, ...]:
        return tuple(self._gens)

    def devices(self) -> set[Device]:
        return set(self.sharding.device_set)

    @property
    def is_fully_replicated(self) -> bool:
        """Whether every device holds the whole array."""
        return self.sharding.is_fully_replicated

    @property
    def is_fully_addressable(self) -> bool:
        """Always True: the controller addresses every host (a single-controller view)."""
        return True

    @property
    def addressable_shards(self) -> list[Shard]:
        """Every device's shard, in the sharding's device order; ``.data`` is a Future."""
        return addressable_shards(self)

    def is_deleted(self) -> bool:
        return self._deleted

    def delete(self) -> None:
        """Free the data on the hosts now; using the handle afterwards raises."""
        if self._deleted:
            return
        self._deleted = True
        if self._finalizer is not None:
            _release_array(self._finalizer)

    def __repr__(self) -> str:
        state = ", deleted" if self._deleted else ""
        return (f"colobus.Array(shape={self.shape}, dtype={self.dtype}, "
                f"sharding={self.sharding}, hosts={list(self._gens)}, "
                f"devices={[d.id for d in self.sharding.device_list]}{state})")

    def check_usable(self) -> None:
        """Raise if deleted or if a host holding its data was lost."""
        if self._deleted:
            raise RuntimeError(f"{self!r} was deleted; it cannot be used any more")
        if (exc := self._failed) is not None:
            text = f"{self!r} is not stored: the device_put that resharded it failed: {exc}"
            if isinstance(exc, HostLostError):
                raise HostLostError(text, exc.host) from exc
            raise RuntimeError(text) from exc
        registry = self._ctl._hosts
        if self._checked != (changes := registry.changes):  # hosts lost or joined since
            registry.check(self._gens, self._gens, "array data")
            self._checked = changes

    # -- fetching -----------------------------------------------------------------------------

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray[Any, Any]:
        if self._ctl._on_loop_thread():
            raise RuntimeError(
                "np.asarray(colobus.Array) blocks, which would stall the controller's event "
                "loop; use `await cb.device_get(arr)` in async code.")
        out = device_get(self).result()
        if is_key_array(out):
            raise TypeError("typed PRNG key arrays do not convert to numpy; use cb.device_get")
        return np.asarray(out, dtype=dtype)

    def _fetch_block_hosts(self) -> dict[int, HostBlock]:
        """One host per distinct block: replicas are fetched once."""
        blocks = host_blocks(self.sharding, self.shape)
        chosen: dict[int, HostBlock] = {}
        seen: set[tuple[tuple[int, int], ...]] = set()
        for h, b in blocks.items():
            key = tuple((s.start, s.stop) for s in b.index)
            if key not in seen:
                seen.add(key)
                chosen[h] = b
        return chosen


_array_refs: dict[weakref.ref[Array], tuple[Controller, dict[int, int], int]] = {}


def _release_array(fin: weakref.ref[Array]) -> None:
    """Free an array's blocks on its hosts, once (its handle went, or ``delete``)."""
    entry = _array_refs.pop(fin, None)
    if entry is not None:
        ctl, gens, ref = entry
        ctl._frees.release_on(gens, ref=ref)


# -- device_put -----------------------------------------------------------------------------


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
    many hosts hold goes down a tree of them: ``docs/arrays.md``, "Broadcast trees"). Every
    leaf is checked before anything is sent: a bad leaf raises and no part of the tree
    leaves this process. Large inputs are sent without copying: do not modify a numpy
    input until ``cb.block_until_ready`` on the result returned.

    A ``cb.Array`` leaf onto another sharding is resharded: each host gets the
    parts of its new block it lacks, through the controller (``docs/arrays.md``,
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
        sizes = upload_sizes([(p.msgs, p.trees) for _, p in sends])
        ctl._uploads.reserve(sizes)  # back-pressure: a plain thread may wait here

        def send() -> None:
            try:
                for arr, p in sends:
                    for h, body, buf in p.msgs:
                        host = ctl._hosts[h]
                        if host.alive and host.generation == arr._gens[h]:
                            ctl._send(host, body, b"", [buf])
                            ctl._count("bytes_put", buf.nbytes)
                    for tree in p.trees:
                        tree.start(arr._gens)
            finally:  # the channel counts them now (or nobody: a lost host's)
                for h, n in sizes.items():
                    ctl._uploads.handed(h, n)

        ctl._ops.post(send)
    return out


def _is_prepared_leaf(x: Any) -> bool:
    return isinstance(x, Array | _PreparedPut | _PreparedReshard)


def _is_array_leaf(x: Any) -> bool:
    return isinstance(x, Array)


# -- device_get / block_until_ready ------------------------------------------------------


def _ctl_of(leaves: list[Array]) -> Controller:
    ctl = leaves[0]._ctl if leaves else default_controller()
    for a in leaves:
        check_owner(a, ctl)
    return ctl


def _fetch_many(arrays: list[Array], data: bool,
                finish: Callable[[list[Any]], Any]) -> Future[Any]:
    """One operation fetching (or only awaiting) every array's blocks."""
    ctl = _ctl_of(arrays)
    plan: list[tuple[int, int, Array, HostBlock | None]] = []  # (host, array idx, arr, block)
    for i, a in enumerate(arrays):
        a.check_usable()
        if data:
            for h, blk in a._fetch_block_hosts().items():
                plan.append((h, i, a, blk))
        elif not a._ready:
            for h in a.hosts:
                plan.append((h, i, a, None))
    by_host: dict[int, list[tuple[int, Array, HostBlock | None]]] = {}
    for h, i, a, b in plan:
        by_host.setdefault(h, []).append((i, a, b))
    # One sub-call id per (host, block); the op completes when all replied.
    sub_ids: dict[int, tuple[int, int, Array, HostBlock | None]] = {}
    for h, items in by_host.items():
        for i, a, b in items:
            sub_ids[ctl._ops.next_id()] = (h, i, a, b)
    if not sub_ids:
        fut: Future[Any] = ctl._ops.new_future()
        fut.set_result(finish([None] * len(arrays)))
        return fut
    results: list[dict[int, np.ndarray[Any, Any]]] = [{} for _ in arrays]
    outer = ctl._ops.new_future()
    remaining = [len(sub_ids)]

    def on_one(sub: int, f: Future[Any]) -> None:
        h, i, _, _ = sub_ids[sub]
        if outer.done():
            return
        exc = f.exception() if not f.cancelled() else None
        if exc is not None:
            outer.set_exception(exc)
            return
        if data:
            results[i][h] = f.result()
        remaining[0] -= 1
        if remaining[0] == 0:
            try:
                outer.set_result(finish(results))
            except BaseException as e:
                outer.set_exception(e)

    def decode(host: Host, body: P.Result, env: Envelope) -> Any:
        if not data:
            return None
        block = read_fetched(body.meta, env.buffers)
        ctl._count("bytes_fetched", block.nbytes)
        return block

    for sub, (h, _, a, _) in sub_ids.items():
        def send(call_id: int, h: int = h, a: Array = a) -> None:
            ctl._send(ctl._hosts[h], P.Fetch(call_id, a.ref, data))

        f = ctl._ops.submit((h,), send, decode, functools.partial(_value_of, h), call_id=sub,
                       backpressure=False)
        f.add_done_callback(functools.partial(on_one, sub))
    return outer


def _value_of(host: int, values: dict[int, Any]) -> Any:
    return values[host]


def _assemble(a: Array, blocks: dict[int, np.ndarray[Any, Any]]) -> Any:
    hb = host_blocks(a.sharding, a.shape)
    if a._key_impl:
        import jax

        sample = next(iter(blocks.values()))
        extra = sample.shape[len(a.shape):]
        data_hb = {h: hb[h] for h in blocks}
        full = _assemble_blocks(a.shape + extra, sample.dtype, blocks, data_hb, len(extra))
        return jax.random.wrap_key_data(full, impl=a._key_impl)  # type: ignore[arg-type]
    return assemble(a.shape, a.dtype, blocks, {h: hb[h] for h in blocks})


def _assemble_blocks(shape: tuple[int, ...], dtype: Any, blocks: dict[int, Any],
                     hb: dict[int, HostBlock], extra: int) -> np.ndarray[Any, Any]:
    out = np.empty(shape, dtype)
    for h, blk in blocks.items():
        out[hb[h].index + (slice(None),) * extra] = blk
    return out


def device_get(tree: Any) -> Future[Any]:
    """Fetch every ``cb.Array`` in ``tree``; a Future of the same tree with numpy leaves.

    Non-array leaves pass through. Typed PRNG key arrays come back as JAX key arrays.
    """
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_array_leaf)
    arrays = [x for x in leaves if isinstance(x, Array)]
    tdef: Any = treedef

    def finish(results: list[Any]) -> Any:
        it = iter(_assemble(a, r) for a, r in zip(arrays, results, strict=True))
        return tdef.unflatten([next(it) if isinstance(x, Array) else x for x in leaves])

    return _fetch_many(arrays, True, finish)


def block_until_ready(tree: Any) -> Future[Any]:
    """A Future that resolves to ``tree`` once every ``cb.Array`` in it is stored on its hosts."""
    import jax

    arrays = [x for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_array_leaf)
              if isinstance(x, Array)]

    def finish(_: list[Any]) -> Any:
        return tree

    return _fetch_many(arrays, False, finish)
