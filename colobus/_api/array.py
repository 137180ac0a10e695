"""Array handles: data that lives on hosts (one ref per host of the sharding, each host
holding only its own block), and moving it there and back; dropping the handle (or
``delete()``) frees the data on the hosts, batched."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .._controller.controller import Controller, default_controller
from .._controller.frees import release_now
from .._controller.future import Future
from .._controller.hosts import Host
from .._errors import HostLostError
from .._model.blocks import HostBlock, assemble, host_blocks
from .._model.devices import Device
from .._model.jaxside import is_key_array
from .._model.sharding import NamedSharding, Sharding, SingleDeviceSharding
from .._wire import protocol as P
from .._wire.describe import read_fetched
from .._wire.envelope import Envelope
from .reshard import mesh_message
from .shards import Shard, addressable_shards

if TYPE_CHECKING:
    from jax.sharding import PartitionSpec

__all__ = ["Array", "MisusedHandle", "check_owner", "device_get", "fetch_many", "fetch_tree",
           "mesh_message", "off_loop"]

_running_loop = asyncio._get_running_loop


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
    from jax.sharding import PartitionSpec

    return sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()


_ONE_HOST: dict[int, tuple[int]] = {}  # host -> (host,): one tuple, which generations cache


def _hosts_of(sharding: Sharding) -> tuple[int, ...]:
    """The hosts of ``sharding``, sorted (a mesh's: one tuple made once, on which the
    registry's generations cache)."""
    if isinstance(sharding, SingleDeviceSharding):
        host = sharding.device.host
        return _ONE_HOST.get(host) or _ONE_HOST.setdefault(host, (host,))
    assert isinstance(sharding, NamedSharding)
    return sharding.mesh.host_tuple


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
        # frees the blocks on the hosts once this handle goes (or at ``delete``)
        self._finalizer = ctl._frees.release_when_gone(self, self._gens, ref=ref) if owns_ref \
            else None

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

    def addressable_data(self, index: int) -> Future[Any]:
        """``addressable_shards[index].data``, as JAX's: a ``cb.Future`` of that shard's
        value (numpy; a JAX key array for PRNG keys), read from the one host holding it.

        Raises:
            IndexError: ``index`` is not the index of a shard.
        """
        return addressable_shards(self)[index].data

    def is_ready(self) -> Any:
        """Whether the array is stored on every host and its value computed there (JAX's
        ``is_ready``: the hosts answer at once, never waiting for the computation).

        Returns:
            A bool on a thread where no event loop runs (as JAX's); in async code (a
            thread running an event loop) a ``cb.Future`` of the bool, to ``await``.
        """
        return off_loop(self._is_ready())

    def _is_ready(self) -> Future[bool]:
        """A Future of :meth:`is_ready`'s answer, on any thread."""
        self.check_usable()
        ctl = self._ctl
        fut: Future[bool]
        if self._ready:
            fut = ctl._ops.new_future()
            fut.set_result(True)
            return fut
        ref = self.ref

        def send(call_id: int) -> None:
            for h in self.hosts:
                ctl._send(ctl._hosts[h], P.Fetch(call_id, ref, P.FETCH_PROBE))

        return ctl._ops.submit(self.hosts, send, _answer, _all_true, backpressure=False)

    def is_deleted(self) -> bool:
        return self._deleted

    def delete(self) -> None:
        """Free the data on the hosts now; using the handle afterwards raises."""
        if self._deleted:
            return
        self._deleted = True
        if self._finalizer is not None:
            release_now(self._finalizer)

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
        out = fetch_tree(self).result()
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


def _answer(host: Host, body: P.Result, env: Envelope) -> bool:
    return body.meta is True


def _all_true(values: dict[int, bool]) -> bool:
    return all(values.values())


def _is_array_leaf(x: Any) -> bool:
    return isinstance(x, Array)


# -- device_get / block_until_ready ------------------------------------------------------


def _ctl_of(leaves: list[Array]) -> Controller:
    ctl = leaves[0]._ctl if leaves else default_controller()
    for a in leaves:
        check_owner(a, ctl)
    return ctl


def fetch_many(arrays: list[Array], data: bool,
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


def _is_handle(x: Any) -> bool:
    return isinstance(x, Array | Future)


def off_loop(fut: Future[Any]) -> Any:
    """``fut`` where an event loop runs on this thread (async code: the controller's
    loop, or any other, awaits it); on a thread without one, its value, waited for, as
    JAX's ``device_get`` and ``block_until_ready`` block."""
    if _running_loop() is not None:
        return fut
    return fut.result()


def device_get(tree: Any) -> Any:
    """Fetch every ``cb.Array`` in ``tree``: the same tree with numpy leaves.

    A ``cb.Future`` in ``tree`` (a colocated call's) is waited for and replaced by its
    value, fetched the same way. Non-array leaves pass through. Typed PRNG key arrays
    come back as JAX key arrays.

    Returns:
        On a thread where no event loop runs (plain scripts under ``with``,
        ``cb.init()``, worker threads), the fetched tree, waited for as JAX's
        ``device_get`` does; in async code (a thread running an event loop: the
        controller's own, or another), a ``cb.Future`` of it, to ``await``.
    """
    return off_loop(fetch_tree(tree))


def fetch_tree(tree: Any) -> Future[Any]:
    """A Future of :func:`device_get`'s value, on any thread."""
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_handle)
    calls = [x for x in leaves if isinstance(x, Future)]
    if calls:
        return _after_futures(tree, leaves, treedef, calls)
    arrays = [x for x in leaves if isinstance(x, Array)]
    tdef: Any = treedef

    def finish(results: list[Any]) -> Any:
        it = iter(_assemble(a, r) for a, r in zip(arrays, results, strict=True))
        return tdef.unflatten([next(it) if isinstance(x, Array) else x for x in leaves])

    return fetch_many(arrays, True, finish)


def _after_futures(tree: Any, leaves: list[Any], treedef: Any,
                   futures: list[Future[Any]]) -> Future[Any]:
    """:func:`fetch_tree` of ``tree`` once its futures are done, each replaced by its
    value (its error, or its cancellation, is the fetch's)."""
    arrays = [x for x in leaves if isinstance(x, Array)]
    owner = futures[0]._owner
    ctl = owner if isinstance(owner, Controller) else _ctl_of(arrays)
    for h in (*arrays, *futures):
        check_owner(h, ctl)
    outer: Future[Any] = ctl._ops.new_future()
    left = [len(futures)]

    def copy(f: Future[Any]) -> None:
        if f.cancelled():
            outer._set_cancelled()
        elif (exc := f.exception()) is not None:
            outer.set_exception(exc)
        else:
            outer.set_result(f.result())

    def one(f: Future[Any]) -> None:
        if outer.done():
            return
        if f.cancelled() or f.exception() is not None:
            copy(f)
            return
        left[0] -= 1
        if left[0]:
            return
        values = [x.result() if isinstance(x, Future) else x for x in leaves]
        try:
            inner = fetch_tree(treedef.unflatten(values))
        except BaseException as exc:  # a deleted or lost array among the values
            outer.set_exception(exc)
            return
        inner.add_done_callback(copy)

    for f in futures:
        f.add_done_callback(one)
    return outer
