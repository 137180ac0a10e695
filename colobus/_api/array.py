"""Array handles: data that lives on hosts (one ref per host of the sharding, each host
holding only its own block); dropping the handle (or ``delete()``) frees the data on the
hosts, batched. A call's output is a handle from the moment the call is made (JAX's
arrays of a dispatched computation): until the call ends it is *pending*, and what reads
it waits for the call (``colobus._api.pending``); JAX's own methods (``block_until_ready``,
``copy_to_host_async``, ``__array__``) are here, so that ``jax.block_until_ready``,
``jax.device_get`` and ``np.asarray`` work on it as JAX's functions call them. colobus
adds one: ``await arr`` (any event loop) waits for its call without blocking the loop."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import numpy as np

from .._controller.controller import Controller
from .._controller.frees import release_now
from .._controller.future import _PENDING, Future
from .._errors import HostLostError
from .._model.blocks import HostBlock, host_blocks
from .._model.devices import Device
from .._model.jaxside import is_key_array
from .._model.sharding import NamedSharding, Sharding, SingleDeviceSharding
from .reshard import mesh_message
from .shards import Shard, addressable_shards

if TYPE_CHECKING:
    from jax.sharding import PartitionSpec

__all__ = ["WAYS", "Array", "MisusedHandle", "check_owner", "mesh_message", "off_loop"]

_get_ident = threading.get_ident


class Ways:
    """What the array's JAX methods call, set by the modules that do it as they load
    (``colobus._api.fetch``, ``.ready``: they import this one, so it cannot import them).

    Attributes:
        fetch: ``fetch(tree)``, a Future of the tree with each array's value.
        ready: ``ready(tree)``, a Future of the tree once every array in it is ready.
        probe: ``probe(array)``, a Future of whether its hosts hold it computed now.
    """

    fetch: Callable[[Any], Future[Any]]
    ready: Callable[[Any], Future[Any]]
    probe: Callable[[Any], Future[bool]]


WAYS = Ways()


def off_loop(fut: Future[Any]) -> Any:
    """``fut`` on its controller's event-loop thread (async code under ``async with``
    awaits it); on any other thread, its value, waited for, as JAX's ``device_get`` and
    ``block_until_ready`` block -- a thread running some other event loop (Jupyter's, an
    ``asyncio.run`` beside a ``with`` cluster) included: the controller's loop runs on a
    thread of its own there, so waiting cannot stall it."""
    loop_thread = fut._loop_thread
    if loop_thread is not None and _get_ident() == loop_thread:
        return fut
    return fut.result()


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

    __slots__ = ("__weakref__", "_call", "_checked", "_ctl", "_deleted", "_failed", "_finalizer",
                 "_gens", "_key_impl", "_prefetch", "_ready", "dtype", "ref", "shape", "sharding")

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
        self._call: Future[Any] | None = None  # the call that makes it, while it runs
        self._prefetch: Future[Any] | None = None  # its value on its way (copy_to_host_async)
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
        """Every device's shard, in the sharding's device order, as JAX lists them; a
        shard's ``.data`` is what that device holds (what its host returned there)."""
        return addressable_shards(self)

    def addressable_data(self, index: int) -> Any:
        """JAX's: ``addressable_shards[index].data``, or, where the array is fully
        replicated, the first shard's (as JAX's returns that one for any index).

        Returns:
            The shard's value (numpy; a JAX key array for PRNG keys), read from the one
            host holding it: off the controller's event-loop thread the value, waited
            for; on it a ``cb.Future`` of it, to ``await``.

        Raises:
            IndexError: ``index`` is not the index of a shard.
        """
        shards = addressable_shards(self)
        return (shards[0] if self.sharding.is_fully_replicated else shards[index]).data

    def is_ready(self) -> Any:
        """Whether the array is stored on every host and its value computed there (JAX's
        ``is_ready``: answered at once, never waiting for the computation; False while
        the call that makes it runs).

        Returns:
            A bool off the controller's event-loop thread (as JAX's: plain scripts,
            ``cb.init()``, worker threads, a thread running another event loop such as
            Jupyter's); on that thread (async code under ``async with``) a ``cb.Future``
            of the bool, to ``await``.

        Raises:
            Exception: the call that makes it failed: its error (as JAX raises it).
        """
        return off_loop(self._is_ready())

    def _is_ready(self) -> Future[bool]:
        """A Future of :meth:`is_ready`'s answer, on any thread."""
        self.check_usable()
        if self._ready or self._call is not None:
            fut: Future[bool] = self._ctl._ops.new_future()
            fut.set_result(self._call is None)
            return fut
        return WAYS.probe(self)

    def block_until_ready(self) -> Array:
        """JAX's: wait until the array is ready (stored on its hosts and computed there;
        the call that makes it ended), as ``cb.block_until_ready``; so
        ``jax.block_until_ready(tree)``, which calls this on each leaf, waits too.

        Returns:
            The array itself.

        Raises:
            RuntimeError: called on the controller's event-loop thread (async code under
                ``async with``), where waiting would stall it: ``await
                cb.block_until_ready(arr)`` there.
            Exception: the call that makes it failed: its error, with the host's
                traceback in its notes.
        """
        ctl = self._ctl
        if _get_ident() == ctl._loop_thread_id:
            raise RuntimeError(
                "arr.block_until_ready() would block the colobus controller's event loop; "
                "use `await cb.block_until_ready(arr)` in async code")
        call = self._call
        if call is not None and call._state == _PENDING:
            call._wait(None)  # its call's reply: often all it takes (it says "computed")
        if self._ready and self._call is None and not self._deleted:
            return self
        self.check_usable()
        if not self._ready:
            WAYS.ready(self).result()
        return self

    def __await__(self) -> Generator[Any, None, Array]:
        """colobus's, not JAX's: ``await arr`` waits until the call that makes the array
        ended, in any event loop and without blocking it, so that ``y = await f(x)`` reads
        alike wherever ``f(x)`` returns an array or its ``cb.Future``.

        Returns:
            The array itself (its value is not fetched: ``cb.device_get`` does that).

        Raises:
            Exception: the call that makes it failed: its error, with the host's
                traceback in its notes; the array was deleted, or a host holding it lost.

        Cancelling the awaiting task leaves the call running: the array is a value that
        other code may hold (``fut.cancel()`` of async code's Future cancels a call).
        """
        call = self._call
        if call is not None and call._state == _PENDING:
            yield from call._ended()
        self.check_usable()
        return self

    def copy_to_host_async(self) -> None:
        """JAX's: start fetching the array's value without waiting (``jax.device_get``
        calls it on every leaf first, so that their fetches overlap); the next
        ``np.asarray`` of it takes the value fetched."""
        if self._prefetch is None:
            self._prefetch = WAYS.fetch(self)

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
                f"sharding={self.sharding!r}, hosts={list(self._gens)}, "
                f"devices={[d.id for d in self.sharding.device_list]}{state})")

    def check_usable(self) -> None:
        """Raise if deleted, if the call that makes it failed (its error), or if a host
        holding its data was lost. Never waits: a call still running passes."""
        if self._deleted:
            raise RuntimeError(f"{self!r} was deleted; it cannot be used any more")
        call = self._call
        if call is not None and call._state != _PENDING:
            if call._exception is not None or call.cancelled():
                call._get()  # (raises its error, marked read)
            self._call = None
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
        """``np.asarray(arr)``: the array's value, fetched (the first shard's where
        several devices hold one block: JAX's value of a replicated array); waits for
        the call that makes it, and raises its error.

        Raises:
            RuntimeError: called on the controller's event-loop thread.
            TypeError: a typed PRNG key array (``cb.device_get`` keeps its type).
        """
        if self._ctl._on_loop_thread():
            raise RuntimeError(
                "np.asarray(colobus.Array) blocks, which would stall the controller's event "
                "loop; use `await cb.device_get(arr)` in async code.")
        fut, self._prefetch = self._prefetch, None
        out = (fut if fut is not None else WAYS.fetch(self)).result()
        if is_key_array(out):
            raise TypeError("typed PRNG key arrays do not convert to numpy; use cb.device_get")
        return np.asarray(out, dtype=dtype)

    def _fetch_block_hosts(self) -> dict[int, HostBlock]:
        """One host per distinct block, the one of the first device (in the sharding's
        order) that holds it: replicas are fetched once, the first shard's value."""
        blocks = host_blocks(self.sharding, self.shape)
        chosen: dict[int, HostBlock] = {}
        seen: set[tuple[tuple[int, int], ...]] = set()
        hosts = dict.fromkeys(d.host for d in self.sharding.device_list)
        for h in hosts:
            b = blocks[h]
            key = tuple((s.start, s.stop) for s in b.index)
            if key not in seen:
                seen.add(key)
                chosen[h] = b
        return chosen


def _is_array_leaf(x: Any) -> bool:
    return isinstance(x, Array)
