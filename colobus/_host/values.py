"""What values look like on a host: JAX set-up, stored blocks, and call outputs.

Pure host-side conversions, safe on any thread: a PUT block becomes what the
store keeps (a ``jax.Array``, or a :class:`NumpyBlock` where JAX cannot hold
the dtype exactly, or a lazy view on the received frame); a stored value
becomes what user code receives; a call's return value becomes the values the
host stores and the description it reports.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._model import outlayout as _outlayout
from .._model.devices import jax_axis_types
from .._model.jaxside import host_count, is_key_array
from .._wire import protocol as P
from .._wire.codec import key_impl_name
from .._wire.describe import describe_outputs
from .._wire.envelope import Buffer

__all__ = [
    "LAZY_PUT_BYTES", "ChunkedBlock", "HostValues", "NumpyBlock", "PiecedBlock", "is_string",
    "jax_exact",
    "numpy_block", "present", "setup_jax", "local_devices"]

log = logging.getLogger("colobus.worker")

LAZY_PUT_BYTES = 1 << 20  # PUT blocks this large become jax.Arrays on first use


def setup_jax(cpu_devices: int | None) -> Any:
    """Import JAX with ``cpu_devices`` host-platform devices; return the module."""
    if cpu_devices:
        flags = os.environ.get("XLA_FLAGS", "")
        flags = " ".join(f for f in flags.split() if "host_platform_device_count" not in f)
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={cpu_devices}".strip()
        )
    import jax

    if cpu_devices:
        try:
            jax.config.update("jax_num_cpu_devices", cpu_devices)
        except Exception:  # older JAX: XLA_FLAGS above does it
            pass
    # JAX's own default (x64 off) unless the controller side asks otherwise;
    # local_cluster passes its process's setting (docs/moving_arrays.md, "`device_put`").
    jax.config.update("jax_enable_x64", os.environ.get("COLOBUS_JAX_X64", "0") == "1")
    return jax


def jax_exact(jax: Any, dtype: Any) -> bool:
    """Whether JAX holds ``dtype`` without changing it (x64 off narrows int64...)."""
    if isinstance(dtype, np.dtypes.StringDType):
        # JAX's string arrays fail on empty and replicated layouts: keep numpy.
        return False
    if dtype.fields is not None or dtype.hasobject:
        return False
    # ml_dtypes (bfloat16, float8_*, int4...) are kind "V" to numpy, yet JAX's own.
    ml = dtype.type.__module__.split(".")[0] == "ml_dtypes"
    if dtype.kind in "VSUMm" and not ml:
        return False
    try:
        return bool(jax.dtypes.canonicalize_dtype(dtype) == dtype)
    except Exception:
        return False


class NumpyBlock(np.ndarray):
    """A host block kept as numpy (its exact bytes), with the layout JAX would give it.

    Stored when JAX cannot hold the dtype as is (64-bit types while x64 is off,
    structured dtypes, some string layouts), so fetching returns exactly what was
    put. A numeric block is presented to user code as a ``jax.Array``, converted
    the way ``jax.device_put`` would (int64 -> int32 while x64 is off).

    Large PUT blocks are stored this way too, even where JAX holds the dtype: a
    numpy view on the received frame, made a ``jax.Array`` only when a call first
    needs it (``lazy``). That conversion is cached, and the store entry then holds
    the ``jax.Array`` alone, so the frame is freed once no queued call holds it.
    """

    jax_sharding: Any = None
    lazy = False  # JAX holds the dtype exactly: cache the jax.Array once made
    jax_value: Any = None  # that cached jax.Array
    put_ref = 0  # the store entry a lazy block was PUT as


def numpy_block(arr: Any, sharding: Any) -> NumpyBlock:
    block = np.asarray(arr).view(NumpyBlock)
    block.jax_sharding = sharding
    return block


class PiecedBlock:
    """A large block a reshard built, kept as the pieces it arrived in until it is read.

    The pieces are numpy views on the received frames (and on the host's own old
    block, for what it already held). The first call, fetch or reshard that reads
    the block makes it whole (:meth:`materialize`: one copy, the one assembling on
    arrival would have made), as a lazy :class:`NumpyBlock` (a call then makes its
    ``jax.Array``, as for a large PUT); the pieces go then. Thread-safe.
    """

    __slots__ = ("_lock", "_parts", "dtype", "ref", "shape", "sharding", "value")

    def __init__(self, shape: tuple[int, ...], dtype: Any,
                 parts: list[tuple[tuple[slice, ...], Any]], sharding: Any, ref: int) -> None:
        self.shape = shape
        self.dtype = dtype
        self._parts = parts
        self.sharding = sharding
        self.ref = ref
        self.value: NumpyBlock | None = None
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * int(self.dtype.itemsize)

    def materialize(self) -> NumpyBlock:
        """The whole block (made once; later calls return the same)."""
        with self._lock:
            if self.value is None:
                data = np.empty(self.shape, self.dtype)
                for index, part in self._parts:
                    data[index] = part
                block = numpy_block(data, self.sharding)
                block.lazy = True
                block.put_ref = self.ref
                self.value = block
                self._parts = []
            return self.value


class ChunkedBlock(PiecedBlock):
    """A large block a broadcast tree brought, kept as the chunks it arrived in (views on
    the received frames, ``(None, chunk)`` parts back to back) until it is read: then made
    whole once, like a reshard's :class:`PiecedBlock`."""

    __slots__ = ()

    def materialize(self) -> NumpyBlock:
        with self._lock:
            if self.value is None:
                flat = np.empty(self.nbytes, np.uint8)
                at = 0
                for _, part in self._parts:
                    flat[at:at + len(part)] = np.frombuffer(part, np.uint8)
                    at += len(part)
                block = numpy_block(flat.view(self.dtype).reshape(self.shape), self.sharding)
                block.lazy = True
                block.put_ref = self.ref
                self.value = block
                self._parts = []
            return self.value


def present(jax: Any, value: Any) -> Any:
    """What user code receives for a stored value (any thread)."""
    if isinstance(value, PiecedBlock):
        value = value.materialize()
    if not isinstance(value, NumpyBlock):
        return value
    cached = value.jax_value
    if cached is not None:
        return cached
    plain = value.view(np.ndarray)
    if value.lazy:
        out = jax.device_put(plain, value.jax_sharding)
        out.block_until_ready()  # the copy is done: the frame can go once unpinned
        value.jax_value = out
        return out
    if plain.dtype.kind in "biufc" and value.jax_sharding is not None:
        canonical = jax.dtypes.canonicalize_dtype(plain.dtype)
        return jax.device_put(plain.astype(canonical, copy=False), value.jax_sharding)
    return plain


def is_string(dtype: Any) -> bool:
    return isinstance(dtype, np.dtypes.StringDType)




class HostValues:
    """Conversions that need the host's JAX and its devices (thread-safe)."""

    def __init__(self, jax: Any, by_local: dict[tuple[str, int], Any], job: Any = None) -> None:
        self.jax = jax
        self._by_local = by_local
        self.job = job  # the worker's HostJob while in the cluster's JAX job, else None
        self.meshes: dict[str, Any] = {}  # local_mesh's, by the raw mesh's repr
        # A call's output description, per output layout (see ``outputs``): key -> (the
        # description, the objects whose ids the key holds, kept alive so no other
        # object can take their ids while the entry lives).
        self._described: dict[tuple[Any, ...], tuple[bytes, list[Any]]] = {}
        self._described_types: set[type] = set()  # jax.Array types seen kept (ArrayImpl)
        self._leaf = None if jax is None else jax.tree_util.tree_structure(0)  # one array's
        self._none = None if jax is None else jax.tree_util.tree_structure(None)  # nothing's

    def clear(self) -> None:
        self.meshes.clear()
        self._described.clear()

    def device(self, platform: str, local_id: int) -> Any:
        """This host's ``jax.Device`` of that platform and local id, or None."""
        return self._by_local.get((platform, local_id))

    def local_mesh(self, raw: list[Any]) -> Any:
        """A jax ``Mesh`` (or one ``jax.Device``) from ``[[platform, id]...], shape, names]``
        (and the axis types by name, where one is not Auto)."""
        key = repr(raw)
        mesh = self.meshes.get(key)
        if mesh is None:
            ids, shape, names = raw[:3]
            devs = [self._by_local[(str(p), int(i))] for p, i in ids]
            if not shape:
                mesh = devs[0]
            elif len(raw) > 3:
                mesh = self.jax.sharding.Mesh(
                    np.array(devs, dtype=object).reshape(shape), tuple(names),
                    axis_types=jax_axis_types(self.jax, [str(t) for t in raw[3]]))
            else:
                mesh = self.jax.sharding.Mesh(
                    np.array(devs, dtype=object).reshape(shape), tuple(names))
            self.meshes[key] = mesh
        return mesh

    def sharding(self, mesh: Any, spec: Any, memory_kind: str | None = None) -> Any:
        jax = self.jax
        if isinstance(mesh, jax.sharding.Mesh):
            return jax.sharding.NamedSharding(mesh, spec, memory_kind=memory_kind)
        return jax.sharding.SingleDeviceSharding(mesh, memory_kind=memory_kind)

    def to_host_value(self, arr: Any, mesh: Any, spec: Any, key_impl: str | None,
                      memory_kind: str | None = None) -> Any:
        """What the store keeps for a PUT block."""
        jax = self.jax
        sharding = self.sharding(mesh, spec, memory_kind)
        if key_impl:
            keys = jax.random.wrap_key_data(arr, impl=key_impl)
            return jax.device_put(keys, sharding)
        if jax_exact(jax, arr.dtype):
            return jax.device_put(arr, sharding)
        if is_string(arr.dtype) and arr.size:
            # A jax.Array where JAX can hold it (one distinct shard per device, as
            # in JAX's own string examples); numpy where it cannot (replicas).
            if sharding.is_fully_replicated and len(sharding.device_set) > 1:
                return arr  # JAX puts it, but cannot read it back (jax 0.10)
            try:
                return jax.device_put(arr, sharding)
            except Exception:
                return arr
        return numpy_block(arr, sharding)

    def to_host_value_ready(self, arr: Any, mesh: Any, spec: Any, key_impl: str | None,
                            memory_kind: str | None = None) -> Any:
        # jax.device_put returns before its copy is done: wait here (a pool thread),
        # so a PUT counts as stored (block_until_ready) only once the data is in place
        # and the received frame can be freed.
        value = self.to_host_value(arr, mesh, spec, key_impl, memory_kind)
        ready = getattr(value, "block_until_ready", None)
        return ready() if ready is not None else value

    def outputs(self, out: Any, mesh: Any, pins: Sequence[asyncio.Future[Any]] = (),
                fn: Any = None, argvals: Sequence[Any] | None = None, check: int = 0,
                ) -> tuple[list[Any], Any, bytes, list[Buffer]]:
        """A call's return value as the values the host stores, their tree, and the
        reply's pickled description (one :class:`~colobus._wire.protocol.OutLeaf` per leaf).

        ``pins`` are the call's host-resident arguments (for ``OutLeaf.ref``, see
        ``_outlayout``); ``argvals``, their values where the call knows them (else read
        from ``pins``); ``fn``, the function that returned ``out``, is named in the
        error for a leaf that is not an array; ``check`` (the CALL's, from
        ``check_replicas=True``): hash each output, every device's copy of a replicated
        one compared here, for the controller to compare the hosts'."""
        jax = self.jax
        kept = self._described_types
        job = self.job
        if job is not None:  # global arrays: this host's blocks of them (the common
            # case inline: one array of a sharding this host addresses whole)
            if type(out) in kept and id(out) not in job._blocks:
                sh = out._sharding
                hit = job.addressable.get(id(sh))
                if hit is None or hit[0] is not sh or not hit[1]:
                    out = job.to_blocks(out)
            elif out is not None:
                out = job.to_blocks(out)
        if type(out) in kept:  # one jax.Array: a leaf
            leaves, treedef = [out], self._leaf
        elif out is None:  # nothing returned (a no-op)
            leaves, treedef = [], self._none
        else:
            leaves, treedef = jax.tree_util.tree_flatten(out)
        if len(leaves) >= P.MAX_OUTPUTS:
            raise ValueError(f"a call may return at most {P.MAX_OUTPUTS - 1} arrays")
        # The common case: arrays kept as the function made them, in a layout described
        # before. The key is exact: the tree (cached only when made of None, tuples, lists
        # and namedtuples, whose description the tree's equality fixes: dict keys and
        # custom nodes' data can compare equal and pack differently, e.g. True and 1),
        # the mesh, and per leaf its type, sharding and dtype (by identity), shape and ref.
        parts: list[Any] = [treedef, id(mesh), check]
        args = argvals
        key: tuple[Any, ...] | None = None
        for leaf in leaves:
            if type(leaf) not in kept:
                break
            sh = leaf._sharding  # its sharding, dtype and shape, read in C (see _outputs)
            aval = leaf.aval
            if args is None:
                args = _pinned_values(pins) if pins else ()
            ref = -1
            for k, value in enumerate(args):
                if value is leaf or getattr(value, "sharding", None) is sh:
                    ref = k
                    break
            parts += (type(leaf), id(sh), id(aval.dtype), aval.shape, ref)
        else:
            key = tuple(parts)
            hit = self._described.get(key)
            if hit is not None:
                return leaves, treedef, hit[0], []
        values, description, keep = self._outputs(jax, out, leaves, treedef, mesh, pins, fn,
                                                  check)
        if key is not None and keep is not None:
            if len(self._described) >= _DESCRIBED_MAX:
                self._described.clear()
            self._described[key] = (description, keep)
        return values, treedef, description, []

    def _outputs(self, jax: Any, out: Any, leaves: list[Any], treedef: Any, mesh: Any,
                 pins: Sequence[asyncio.Future[Any]], fn: Any, check: int = 0,
                 ) -> tuple[list[Any], bytes, list[Any] | None]:
        """``outputs`` the long way: the values, the description, and what a cached
        description's key must keep alive (None: this description is not cached)."""
        metas: list[P.OutLeaf] = []
        values: list[Any] = []
        is_mesh = isinstance(mesh, jax.sharding.Mesh)
        # replicas to compare (every size), where the call asked (check_replicas=True)
        several = bool(check) and is_mesh
        # cached where nothing in it depends on the values (digests do)
        keep: list[Any] | None = (None if (several and leaves) or not _exact_tree(treedef, 0)
                                  else [mesh])
        for i, leaf in enumerate(leaves):
            spec = None
            layout = None
            ref = -1
            if isinstance(leaf, jax.Array):
                sh = leaf.sharding
                if (is_mesh and isinstance(sh, jax.sharding.NamedSharding)
                        and sh.mesh.axis_names == mesh.axis_names
                        and sh.mesh.devices.shape == mesh.devices.shape
                        and all(a == b for a, b in zip(sh.mesh.devices.flat, mesh.devices.flat,
                                                       strict=True))):
                    spec = sh.spec
                    value = leaf
                    if len(pins) > 1:  # which argument's layout, if it is one (_outlayout)
                        ref = _outlayout.arg_ref(sh, _pinned_values(pins))
                elif (layout := _outlayout.kept_layout(jax, leaf, mesh)) is not None:
                    spec = getattr(sh, "spec", None)  # the function's own layout, kept
                    value = leaf
                    ref = _outlayout.arg_ref(sh, _pinned_values(pins))
                elif is_string(leaf.dtype):  # JAX cannot replicate string arrays
                    value = np.asarray(leaf)
                else:
                    replicated = self.sharding(mesh, jax.sharding.PartitionSpec())
                    # Already there (``return x`` on one device): device_put would hand
                    # back the same array after ~13 us of dispatch.
                    value = leaf if sh == replicated else jax.device_put(leaf, replicated)
            elif isinstance(leaf, np.ndarray | np.generic | bool | int | float | complex):
                arr = np.asarray(leaf)
                if arr.dtype.hasobject and not isinstance(arr.dtype, np.dtypes.StringDType):
                    raise _not_an_array(jax, out, i, fn)
                replicated = self.sharding(mesh, jax.sharding.PartitionSpec())
                value = (jax.device_put(arr, replicated) if jax_exact(jax, arr.dtype)
                         else numpy_block(arr, replicated))
            else:
                raise _not_an_array(jax, out, i, fn)
            impl = key_impl_name(value) if is_key_array(value) else None
            memory = getattr(getattr(value, "sharding", None), "memory_kind", None)
            metas.append(P.OutLeaf(i, tuple(value.shape), value.dtype if impl is None else None,
                                   spec, impl, layout,
                                   # one device, or one host: no other holds a replica
                                   _outlayout.digest(value, i) if several else None,
                                   ref,
                                   None if memory in (None, "device") else memory))
            values.append(value)
            if keep is not None:
                if layout is None or impl is not None or type(value) is not type(leaf):
                    keep = None  # not kept as made, or a key array: described each time
                else:
                    keep += (leaf.sharding, leaf.dtype)
        if keep is not None:  # (types whose C attributes are their properties, as in jax 0.10)
            self._described_types.update(
                type(v) for v in values
                if getattr(v, "_sharding", None) is v.sharding and v.aval.dtype is v.dtype
                and v.aval.shape == v.shape)
        # msgpack, never a pickle: the controller does not unpickle what hosts send.
        return values, describe_outputs(treedef, metas), keep


def _host_count() -> int:
    try:
        return host_count()
    except RuntimeError:  # (not joined: no count yet)
        return 0


_DESCRIBED_MAX = 1024  # output descriptions cached per host; all dropped when full


def _exact_tree(t: Any, depth: int) -> bool:
    """Whether an output tree's description follows from the tree's equality: nodes
    that are None, tuples, lists or namedtuples only (dict keys and custom nodes' data
    can compare equal and pack differently: True and 1)."""
    data = t.node_data()
    if data is None:
        return True
    cls = data[0]
    if not (cls is type(None) or cls is tuple or cls is list
            or (issubclass(cls, tuple) and hasattr(cls, "_fields"))) or depth > 64:
        return False
    return all(_exact_tree(c, depth + 1) for c in t.children())


def _pinned_values(pins: Sequence[asyncio.Future[Any]]) -> list[Any]:
    """A call's resolved host-resident arguments, as user code saw them (any thread)."""
    values = []
    for p in pins:
        value = p.result() if p.done() and not p.cancelled() and p.exception() is None else None
        if isinstance(value, PiecedBlock):  # the call made it whole (present)
            value = value.value
        values.append(value.jax_value if isinstance(value, NumpyBlock) else value)
    return values


def local_devices(jax: Any) -> list[Any]:
    """This host's JAX devices: its accelerators (if any), then its CPU devices."""
    devices: list[Any] = []
    try:
        backend = jax.default_backend()
    except RuntimeError as exc:  # e.g. the chip is held by another process
        log.warning("this host could not open its accelerator, so it joins with CPU devices "
                    "only: %s", exc)
        jax.config.update("jax_platforms", "cpu")
        backend = "cpu"
    if backend != "cpu":
        devices.extend(jax.devices())
    devices.extend(jax.devices("cpu"))
    return devices


def _not_an_array(jax: Any, out: Any, i: int, fn: Any) -> ValueError:
    """JAX's error for output leaf ``i`` of ``out``, with a note naming the function and
    the leaf's place in the tree (found only now: the common call never pays for it)."""
    path, leaf = jax.tree_util.tree_flatten_with_path(out)[0][i]
    exc = ValueError("colocated_python only supports jax.Array as input and output, "
                     f"but got {type(leaf)}.")
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    where = f"output{jax.tree_util.keystr(path)}" if path else "the output"
    of = f" of {getattr(fn, '__module__', None) or '?'}.{name}" if name else ""
    exc.add_note(f"colobus: {where}{of} is a {type(leaf).__qualname__}; return arrays "
                 "(jax.Array, numpy), Python numbers or None, and pass other values as "
                 "arguments or keep them in a colocated_python_class object")
    return exc
