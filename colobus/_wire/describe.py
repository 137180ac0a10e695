"""What a worker tells the controller about results and errors: msgpack, never pickle.

The controller never unpickles anything a worker sent (``docs/security.md``).
This module is the one place where a worker's replies are written (``describe_*``,
worker side) and read back (``read_*``, controller side). Readers trust nothing:
every count, length and nesting depth is bounded, types are checked, and a
class named by a worker is only looked up among modules the controller has
already imported (never imported, never a pickle). A reader raises
:class:`BadReply` on anything wrong; the controller drops that host.

Formats (msgpack maps with string keys, so fields can be added without a
protocol bump: readers ignore keys they do not know; a new field must be
optional for readers)::

    outputs (RESULT payload of a call, status OK; RESULT meta = number of leaves)
        {"v": 1, "tree": TREE, "leaves": [LEAF, ...]}
        LEAF  = {"shape": [int, ...], "dtype": DTYPE | None,
                 "spec": PartitionSpec entries | None, "key": PRNG impl name | None,
                 "layout": LAYOUT | None, "digest": bytes (<= 64) | None,
                 "ref": int (-1: none),          (these three: see ``_outlayout``)
                 "mem": memory kind}             (only where not "device")
        LAYOUT = [kind "named" | "single", [device id, ...], mesh shape, axis names,
                  fully replicated]
        TREE  = "*"                          a leaf (the next one of "leaves")
              | None                         None
              | ["t", [TREE, ...]]           tuple
              | ["l", [TREE, ...]]           list
              | ["d", [key, ...], [TREE, ...]]   dict (keys in jax's sorted order)
              | ["o", [key, ...], [TREE, ...]]   collections.OrderedDict
              | ["n", module, qualname, [TREE, ...]]         a namedtuple class
              | ["c", module, qualname, aux, [TREE, ...]]    a registered pytree node
        DTYPE = :func:`colobus._wire.codec.dtype_to_wire`: numpy descr, ml_dtypes name, or ["T", na]

    fetched block (RESULT meta of a FETCH; the data is buffer 0, raw bytes)
        [shape, DTYPE, PRNG impl name | None]
"""

from __future__ import annotations

import collections
import functools
import math
import sys
import types
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from . import codec as _codec
from . import protocol as P
from .envelope import TooManyObjects, unpack_bounded

__all__ = [
    "BadReply",
    "describe_outputs",
    "dtype_from_wire",
    "lookup_class",
    "read_fetched",
    "read_outputs",
    "read_store_counts",
]

VERSION = 1
MAX_DEPTH = 64  # nesting of an output tree
MAX_NDIM = 64
MAX_NODES = 1 << 17  # tree nodes in one output description
MAX_TEXT = 1 << 16  # characters of a message, note or traceback kept
MAX_NOTES = 64
MAX_ARGS_DEPTH = 8
MAX_NAME = 512  # a module or qualified name
MAX_DIM = 1 << 62
MAX_LAYOUT_DEVICES = 1 << 16
MAX_DESCRIPTION = 1 << 26  # bytes of an output description
MAX_ERROR_BYTES = 1 << 20  # bytes of an error description (writers stay below it)
MAX_ERROR_OBJECTS = 1 << 12  # lists and maps in one (args included)
LEAF_OBJECTS = 16  # lists and maps an output leaf may use, besides MAX_NODES in all

_UNPACK_LIMITS = dict(
    max_str_len=1 << 20, max_bin_len=1 << 20, max_array_len=1 << 18, max_map_len=1 << 12,
    max_ext_len=0,
)


class BadReply(ValueError):
    """A worker's reply does not follow the formats above (the host broke the protocol)."""


def unpack(raw: Any, max_objects: int = MAX_NODES, max_bytes: int = MAX_DESCRIPTION) -> Any:
    """A description, read with bounds on its size and on how many lists and maps it
    makes in all (not only per container)."""
    if len(raw) > max_bytes:
        raise BadReply(f"a {len(raw)}-byte description (at most {max_bytes})")
    try:
        return unpack_bounded(bytes(raw), max_objects, strict_map_key=False,
                              **_UNPACK_LIMITS)
    except TooManyObjects as exc:
        raise BadReply(f"description too large: {exc}") from None
    except Exception as exc:  # msgpack raises several types on garbage
        raise BadReply(f"not a msgpack description: {type(exc).__name__}") from None


def pack(obj: Any) -> bytes:
    out: bytes = msgpack.packb(obj, use_bin_type=True)
    return out


# -- dtypes ------------------------------------------------------------------------------


def dtype_from_wire(raw: Any) -> np.dtype[Any]:
    """A dtype description off the wire (``_codec.dtype_from_wire``); BadReply on garbage."""
    try:
        return _codec.dtype_from_wire(raw)
    except ValueError as exc:
        raise BadReply(f"bad dtype: {exc}") from None


def _shape(raw: Any) -> tuple[int, ...]:
    if not (isinstance(raw, list) and len(raw) <= MAX_NDIM
            and all(type(n) is int and 0 <= n < MAX_DIM for n in raw)
            and math.prod(raw) < MAX_DIM):
        raise BadReply("bad shape")
    return tuple(raw)


def _key_impl(raw: Any) -> str | None:
    if raw is None:
        return None
    if not (isinstance(raw, str) and 0 < len(raw) <= 64 and raw.isprintable()):
        raise BadReply("bad PRNG implementation name")
    return raw


# -- outputs -----------------------------------------------------------------------------


def describe_outputs(treedef: Any, leaves: list[P.OutLeaf]) -> bytes:
    """Worker side: the RESULT payload describing a call's outputs.

    Raises:
        ValueError: the output tree holds a node that cannot be described
            (a pytree node whose auxiliary data is not plain data).
    """
    global _NONE_TREEDEF
    if not leaves and treedef == _NONE_TREEDEF:
        return _NONE_DESCRIPTION  # a function that returns None: the common case, packed once
    tree = _tree_to_wire(treedef, 0)
    if tree is None:
        # The treedef of None, met for the first time: remembered here rather than
        # built at import, so that importing colobus does not import JAX.
        _NONE_TREEDEF = treedef
        return _NONE_DESCRIPTION
    return pack({"v": VERSION, "tree": tree, "leaves": [_leaf_to_wire(m) for m in leaves]})


def _leaf_to_wire(m: P.OutLeaf) -> dict[str, Any]:
    out: dict[str, Any] = {
        "shape": list(m.shape), "dtype": None if m.dtype is None else _codec.dtype_to_wire(m.dtype),
        "spec": None if m.spec is None else P.encode_spec(m.spec), "key": m.key_impl}
    if m.layout is not None:
        out["layout"] = m.layout
    if m.digest is not None:
        out["digest"] = m.digest
    if m.ref != -1:
        out["ref"] = m.ref
    if m.memory_kind is not None:
        out["mem"] = m.memory_kind
    return out


def _tree_to_wire(t: Any, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError(f"output trees nest at most {MAX_DEPTH} deep")
    data = t.node_data()
    if data is None:
        return "*"
    cls, aux = data
    kids = [_tree_to_wire(c, depth + 1) for c in t.children()]
    if cls is type(None):
        return None
    if cls is tuple:
        return ["t", kids]
    if cls is list:
        return ["l", kids]
    if cls is dict:
        return ["d", _plain_keys(aux), kids]
    if cls is collections.OrderedDict:
        return ["o", _plain_keys(aux), kids]
    name = [cls.__module__, cls.__qualname__]
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return ["n", *name, kids]
    if not is_plain(aux, 0):
        raise ValueError(
            f"output pytree node {cls.__qualname__} has auxiliary data that is not plain "
            "data (numbers, strings, lists, dicts), so it cannot be described to the "
            "controller; return a dict or tuple instead")
    return ["c", *name, aux, kids]


def _plain_keys(keys: Any) -> list[Any]:
    out = list(keys)
    if not all(_hashable(k) for k in out):
        raise ValueError("output dict keys must be str, int, float, bytes, bool or None")
    return out


def read_outputs(payload: Any, count: int) -> Any:
    """Controller side: the output tree with :class:`~colobus._wire.protocol.OutLeaf` leaves.

    Raises:
        BadReply: the payload does not describe ``count`` outputs.
    """
    raw = bytes(payload)
    if count == 0 and raw == _NONE_DESCRIPTION:
        return None  # the common no-op reply, read without parsing
    # A function returns the same description call after call (shapes, dtypes,
    # layouts): parsed and checked once, then only the tree is rebuilt.
    leaves, raw_tree = (_parsed(raw, count) if len(raw) <= PARSED_CACHE_MAX_BYTES
                        else _parse(raw, count))
    if raw_tree == "*" and len(leaves) == 1:
        return leaves[0]  # one array: what the reader below returns, without it
    reader = _TreeReader(leaves)
    tree = reader.read(raw_tree, 0)
    if reader.next != len(leaves):
        raise BadReply("output tree does not use every leaf")
    return tree


PARSED_CACHE_MAX_BYTES = 4096  # descriptions up to this size are remembered (512 of them)


def _parse(raw: bytes, count: int) -> tuple[tuple[P.OutLeaf, ...], Any]:
    """The checked leaves and the raw tree description of an output description."""
    if not (type(count) is int and 0 <= count <= P.MAX_OUTPUTS):
        raise BadReply(f"{count!r:.40} outputs")
    desc = unpack(raw, MAX_NODES + LEAF_OBJECTS * count)
    if not isinstance(desc, dict) or desc.get("v") != VERSION:
        raise BadReply("bad output description")
    raw_leaves = desc.get("leaves")
    if not isinstance(raw_leaves, list) or len(raw_leaves) != count:
        raise BadReply("output description does not match its leaf count")
    return tuple(_leaf_from_wire(i, leaf) for i, leaf in enumerate(raw_leaves)), desc.get("tree")


_parsed = functools.lru_cache(maxsize=512)(_parse)


# What a function that returns None replies (the tree of None is described as None).
_NONE_DESCRIPTION = pack({"v": VERSION, "tree": None, "leaves": []})
_NONE_TREEDEF: Any = object()  # JAX's treedef of None once describe_outputs has met it


def _leaf_from_wire(i: int, raw: Any) -> P.OutLeaf:
    if not isinstance(raw, dict):
        raise BadReply("bad output leaf")
    key = _key_impl(raw.get("key"))
    dtype = None if key is not None else dtype_from_wire(raw.get("dtype"))
    spec = raw.get("spec")
    if spec is not None:
        try:
            spec = P.decode_spec(spec)
        except ValueError:
            raise BadReply("bad partition spec") from None
    digest = raw.get("digest")
    if digest is not None and not (isinstance(digest, bytes) and len(digest) <= 64):
        raise BadReply("bad output digest")
    ref = raw.get("ref", -1)
    if not (type(ref) is int and -1 <= ref < P.MAX_OUTPUTS):
        raise BadReply("bad output argument ref")
    mem = raw.get("mem")
    if mem is not None and not (isinstance(mem, str) and 0 < len(mem) <= 64
                                and mem.isprintable()):
        raise BadReply("bad output memory kind")
    return P.OutLeaf(i, _shape(raw.get("shape")), dtype, spec, key,
                     _layout(raw.get("layout")), digest, ref, mem)


def _layout(raw: Any) -> list[Any] | None:
    """A kept output layout (``_outlayout``), its fields checked; ids are checked
    against the call's devices where it is used."""
    if raw is None:
        return None
    if not (isinstance(raw, list) and len(raw) == 5):
        raise BadReply("bad output layout")
    kind, ids, shape, names, replicated = raw
    if not (kind in ("named", "single") and isinstance(ids, list)
            and 0 < len(ids) <= MAX_LAYOUT_DEVICES and all(type(d) is int for d in ids)
            and isinstance(shape, list) and len(shape) <= MAX_NDIM
            and all(type(n) is int and n > 0 for n in shape)
            and math.prod(shape) == len(ids) and isinstance(names, list)
            and len(names) == len(shape) and all(isinstance(n, str) for n in names)
            and isinstance(replicated, bool)):
        raise BadReply("bad output layout")
    return raw


class _TreeReader:
    """Rebuilds a tree description depth-first, handing out leaves in order."""

    def __init__(self, leaves: Sequence[P.OutLeaf]) -> None:
        self.leaves = leaves
        self.next = 0
        self.nodes = 0

    def read(self, raw: Any, depth: int) -> Any:
        self.nodes += 1
        if depth > MAX_DEPTH or self.nodes > MAX_NODES:
            raise BadReply("output tree too deep or too large")
        if raw == "*":
            if self.next >= len(self.leaves):
                raise BadReply("output tree has more leaves than described")
            self.next += 1
            return self.leaves[self.next - 1]
        if raw is None:
            return None
        if not (isinstance(raw, list) and raw and isinstance(raw[0], str)):
            raise BadReply("bad output tree node")
        tag, *rest = raw
        if tag in ("t", "l") and len(rest) == 1:
            kids = self._kids(rest[0], depth)
            return tuple(kids) if tag == "t" else kids
        if tag in ("d", "o") and len(rest) == 2:
            keys = rest[0]
            if not isinstance(keys, list):
                raise BadReply("bad dict keys")
            kids = self._kids(rest[1], depth)
            if len(keys) != len(kids) or not all(_hashable(k) for k in keys):
                raise BadReply("bad dict keys")
            return dict(zip(keys, kids, strict=True)) if tag == "d" else (
                collections.OrderedDict(zip(keys, kids, strict=True)))
        if tag == "n" and len(rest) == 3:
            cls = lookup_class(rest[0], rest[1])
            kids = self._kids(rest[2], depth)
            if not (isinstance(cls, type) and issubclass(cls, tuple)
                    and len(getattr(cls, "_fields", ())) == len(kids)):
                raise BadReply(f"output namedtuple {_name(rest)} is not defined here")
            return cls(*kids)
        if tag == "c" and len(rest) == 4:
            return self._custom(rest, depth)
        raise BadReply("bad output tree node")

    def _kids(self, raw: Any, depth: int) -> list[Any]:
        if not isinstance(raw, list):
            raise BadReply("bad output tree children")
        return [self.read(c, depth + 1) for c in raw]

    def _custom(self, rest: list[Any], depth: int) -> Any:
        cls = lookup_class(rest[0], rest[1])
        unflatten = _registered_unflatten(cls) if isinstance(cls, type) else None
        if unflatten is None:
            raise BadReply(
                f"output pytree node {_name(rest)} is not a registered pytree node here "
                "(import its module in the controller)")
        kids = self._kids(rest[3], depth)
        try:
            return unflatten(_tuples(rest[2]), kids)
        except Exception as exc:
            raise BadReply(f"output pytree node {_name(rest)} does not rebuild: {exc}") from None


def _registered_unflatten(cls: type) -> Any:
    """JAX's unflatten function for a registered pytree node class, or None.

    JAX has no public lookup of its pytree registry, so this reads a private one
    (``jax._src.tree_util._registry``, a dict of entries with ``from_iter``), and JAX
    may change it in any release (the requirement has no upper bound): a JAX without
    it gives a clear error for outputs with custom nodes, and every other output
    still works.

    Raises:
        BadReply: this JAX no longer has the registry colobus reads.
    """
    try:
        from jax._src import tree_util

        registry = tree_util._registry
        entry = registry.get(cls)
        return None if entry is None else entry.from_iter
    except (ImportError, AttributeError, TypeError) as exc:
        import jax

        raise BadReply(
            f"output pytree node {cls.__qualname__}: custom pytree nodes in outputs need "
            f"JAX's pytree registry, which colobus cannot read in jax {jax.__version__} "
            f"({exc!r}); return a dict or tuple instead") from None


def _name(rest: list[Any]) -> str:
    return f"{rest[0]!s:.200}.{rest[1]!s:.200}"


def _hashable(k: Any) -> bool:
    return k is None or isinstance(k, str | int | float | bytes | bool)


def _tuples(x: Any) -> Any:
    """msgpack turns tuples into lists; pytree auxiliary data is tuples (hashable)."""
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def is_plain(x: Any, depth: int) -> bool:
    if depth > MAX_ARGS_DEPTH:
        return False
    if x is None or isinstance(x, bool | str | bytes | float):
        return True
    if isinstance(x, int):
        return -(1 << 63) <= x < (1 << 64)
    if type(x) in (list, tuple):
        return all(is_plain(v, depth + 1) for v in x)
    if type(x) is dict:
        return all(isinstance(k, str) and is_plain(v, depth + 1) for k, v in x.items())
    return False



def lookup_class(module: Any, qualname: Any) -> Any:
    """``module.qualname`` if ``module`` is already imported here, else None.

    Never imports and runs no code: attributes are read from ``__dict__`` only
    (a module ``__getattr__`` could import or compute).
    """
    if not (isinstance(module, str) and isinstance(qualname, str)
            and len(module) <= MAX_NAME and len(qualname) <= MAX_NAME):
        return None
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        if not part.isidentifier():
            return None
        # The namespaces of modules and classes only, through the base types'
        # own descriptors: no __getattr__, no property of a metaclass runs.
        if isinstance(obj, types.ModuleType):
            space = _MODULE_DICT.__get__(obj)
        elif isinstance(obj, type):
            space = _TYPE_DICT.__get__(obj)
        else:
            return None
        obj = space.get(part)
    return obj


_MODULE_DICT: Any = vars(types.ModuleType)["__dict__"]
_TYPE_DICT: Any = vars(type)["__dict__"]


# -- fetched blocks and counters ---------------------------------------------------------


def read_fetched(meta: Any, buffers: list[Any]) -> np.ndarray[Any, Any]:
    """Controller side: a FETCH reply as a numpy array on the buffer's memory.

    Raises:
        BadReply: the description does not match the one buffer.
    """
    from .codec import from_buffer

    if not (isinstance(meta, list) and len(meta) == 3 and len(buffers) == 1):
        raise BadReply("bad fetch reply")
    shape = _shape(meta[0])
    _key_impl(meta[2])
    try:
        return from_buffer(meta[1], shape, buffers[0])
    except (ValueError, TypeError) as exc:
        raise BadReply(f"fetch reply: {exc}") from None


def read_store_counts(meta: Any) -> tuple[int, int, int, int]:
    """Controller side: a STATS reply's (arrays, bytes, objects, results)."""
    if not (isinstance(meta, list) and len(meta) == 4
            and all(type(n) is int and 0 <= n < MAX_DIM for n in meta)):
        raise BadReply("bad stats reply")
    return meta[0], meta[1], meta[2], meta[3]
