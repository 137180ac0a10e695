"""What the controller pickles for hosts: code (once, by digest) and call arguments.

Trust runs one way: everything here is *sent* to workers, which run it; nothing
here ever unpickles what a worker sent. Functions and classes of importable
modules travel by reference (so module state on a host persists), others (and
those of modules registered with ``cloudpickle.register_pickle_by_value``) by
value with cloudpickle; the user's own packages that code names go first
(``_controller.codeship``). In arguments, host-resident values (``cb.Array``
leaves, futures of colocated calls, colocated objects) become persistent ids
that each host resolves to its own value; device-model objects become the
host's JAX objects (``_hostside``). Large buffers go out of band, zero-copy.
"""

from __future__ import annotations

import collections
import hashlib
import importlib
import io
import pickle
import pickletools
import sys
import threading
import types
import weakref
from collections import ChainMap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import cloudpickle

from .._controller.codeship import user_package
from .._controller.future import Future
from .._errors import SerializationError
from .._model.jaxside import HOST_REDUCERS, std_dispatch_table
from .._wire import protocol as P
from .._wire.envelope import Buffer, StdPickler, oob_callback
from .._wire.pickling import handles_payload as _handles_payload
from .array import Array, MisusedHandle, check_owner
from .joblayout import job_refs
from .plan import CallPlan

if TYPE_CHECKING:
    from .._controller.controller import Controller
    from .._controller.hosts import Host

__all__ = ["Code", "ColocatedObjectBase", "PickledArgs", "arg_path", "pickle_args"]


# -- code, pickled once and named by digest ---------------------------------------------


def _load_wrapped(module: str, qualname: str) -> Any:
    """On a host: the original function or class behind a colobus wrapper in ``module``."""
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return getattr(obj, "__wrapped__", obj)


class Code:
    """A function or class, pickled once (lazily) and named by its digest.

    Functions and classes of importable modules travel by reference, so module
    state on a host persists between calls; others travel by value (cloudpickle).
    """

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self._lock = threading.Lock()
        self._blob: tuple[bytes, bytes] | None = None
        self.needs: tuple[str, ...] = ()  # the user's packages it names (read with _blob)
        self.ready = 0  # the serial of the code shipper that read those packages (prepare)
        self.name = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', obj)}"
        self.shipped: collections.Counter[int] = collections.Counter()  # host -> times sent

    def get(self) -> tuple[bytes, bytes]:
        """``(digest, pickled code)``; raises ``SerializationError``."""
        blob = self._blob
        if blob is None:
            with self._lock:
                if self._blob is None:
                    self._blob = self._pickle()
                    _code_born(self, self._blob[0])
                blob = self._blob
        return blob

    def prepare(self, ctl: Controller) -> None:
        """Caller's thread, once per controller: pickle, and read the packages it needs,
        so that one past ``max_code_bytes`` fails the call here, nothing sent (raises
        ``SerializationError``), and the loop thread only sends them."""
        self.get()
        ctl._shipper.packages(self.needs)
        self.ready = ctl._shipper.serial

    def ship(self, ctl: Controller, host: Host) -> bytes:
        """Loop thread: send the code to ``host`` unless it has it; returns the digest."""
        digest, blob = self.get()
        if digest not in host.code_sent:  # sent once; later calls name it
            ctl._shipper.ship(ctl, host, self.needs)  # the packages it needs, first
            host.code_sent.add(digest)
            ctl._count("code_sent")
            ctl._count("code_bytes", len(blob))
            ctl._send(host, P.Code(digest, self.name), blob)
            self.shipped[host.index] += 1
            with _code_lock:
                _code_where.setdefault(digest, set()).add((weakref.ref(ctl), host.index))
        return digest


    def _pickle(self) -> tuple[bytes, bytes]:
        obj = self.obj
        module = getattr(obj, "__module__", None)
        qualname = getattr(obj, "__qualname__", "")
        data: bytes | None = None
        if module and module != "__main__" and "<locals>" not in qualname and not (
                _by_value(module)):
            try:
                found = _load_wrapped(module, qualname)
            except Exception:
                found = None
            if found is obj:
                data = pickle.dumps(_ByRef(module, qualname), protocol=5)
        if data is None:
            try:
                f = io.BytesIO()
                _CodePickler(f, protocol=5).dump(obj)
                data = f.getvalue()
            except Exception as exc:
                raise SerializationError(
                    f"{qualname or obj!r} cannot be pickled to send to hosts: {exc}") from exc
        self.needs = _packages_named(data)
        return hashlib.blake2b(data, digest_size=16).digest(), data


def _by_value(module: str) -> bool:
    """Whether ``module`` (or a package above it) is in cloudpickle's by-value registry."""
    registry = cloudpickle.list_registry_pickle_by_value()
    return bool(registry) and any(
        module == name or module.startswith(name + ".") for name in registry)


def _packages_named(data: bytes) -> tuple[str, ...]:
    """The user's packages a code pickle names (a module by reference, a global of one):
    every string in it that names an imported module of the user's, by its top level.
    Modules pickled by value are not among them: their code travels in the pickle."""
    found: dict[str, None] = {}
    try:
        for op, arg, _ in pickletools.genops(data):
            if isinstance(arg, str) and ("UNICODE" in op.name or op.name == "GLOBAL"):
                name = arg.partition(" ")[0] if op.name == "GLOBAL" else arg
                if name in sys.modules and not _by_value(name):
                    top = user_package(name)
                    if top is not None:
                        found[top] = None
    except Exception:  # (a pickle of ours: not expected) ship what was found
        pass
    return tuple(found)


# Code lives on a host as long as some Code object with its digest lives here: a
# function's wrappers (and specializations) hold it, and so does every call made
# with it until its Future is gone. Then every host it was sent to drops it.
_code_lock = threading.Lock()
_code_live: collections.Counter[bytes] = collections.Counter()  # digest -> live Code objects
_code_where: dict[bytes, set[tuple[weakref.ref[Controller], int]]] = {}  # sent to (ctl, host)


def _code_born(code: Code, digest: bytes) -> None:
    with _code_lock:
        _code_live[digest] += 1
    weakref.finalize(code, _code_gone, digest)


def _code_gone(digest: bytes) -> None:
    """The last Code object of ``digest`` went (any thread): hosts may drop it."""
    with _code_lock:
        _code_live[digest] -= 1
        if _code_live[digest] > 0:
            return
        del _code_live[digest]
        places = _code_where.pop(digest, set())
    for ctl_ref, host in places:
        ctl = ctl_ref()
        if ctl is None or ctl._closed:
            continue
        try:  # after every operation submitted before (never ahead of a CALL using it)
            ctl._ops.post(_forget_code, ctl, host, digest)
        except Exception:  # the controller closed meanwhile: its hosts dropped everything
            pass


def _forget_code(ctl: Controller, index: int, digest: bytes) -> None:
    """Loop thread: tell host ``index`` to drop ``digest``, unless it came back to life."""
    with _code_lock:
        if _code_live.get(digest):  # a new Code of the same digest uses the host's copy
            _code_where.setdefault(digest, set()).add((weakref.ref(ctl), index))
            return
    host = ctl._hosts[index]
    if digest in host.code_sent:
        host.code_sent.discard(digest)
        fanouts = ctl._hosts.fanouts  # (a kept fan-out took its code as shipped)
        for key in [k for k in fanouts if k[1] == digest]:
            del fanouts[key]
        ctl._count("code_freed")
        ctl._send(host, P.Release([], [], [digest]))

def _code_at(args: tuple[Any, ...], filename: str) -> types.CodeType:
    """On a host: a code object pickled by value, with the name of the file it came from
    (so a remote traceback shows the script's file and line, not ``<dynamic-code>``)."""
    return types.CodeType(*args).replace(co_filename=filename)


def _reduce_code(code: types.CodeType) -> tuple[Any, ...]:
    _, args = _CLOUDPICKLE_CODE(code)  # cloudpickle blanks co_filename
    return _code_at, (args, code.co_filename)


_CLOUDPICKLE_CODE = cloudpickle.Pickler.dispatch_table[types.CodeType]
_BY_VALUE_REDUCERS = ChainMap({types.CodeType: _reduce_code}, HOST_REDUCERS,
                              cloudpickle.Pickler.dispatch_table)


class _CodePickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle, with device-model objects made the host's JAX objects (``_hostside``)
    and code keeping its file's name."""

    dispatch_table: ClassVar[ChainMap[Any, Any]] = _BY_VALUE_REDUCERS


class _ByRef:
    __slots__ = ("module", "qualname")

    def __init__(self, module: str, qualname: str) -> None:
        self.module = module
        self.qualname = qualname

    def __reduce__(self) -> tuple[Any, ...]:
        return (_load_wrapped, (self.module, self.qualname))


class ColocatedObjectBase:
    """Base of the wrappers ``colocated_python_class`` makes (see ``_obj``)."""

    _colobus_state: Any


# -- argument pickling ---------------------------------------------------------------------


class _HandleIds:
    """Persistent ids for host-resident values (mixed into both picklers)."""

    refs: list[list[int]]
    keep: list[Any]
    objects: list[Any]
    ctl: Controller | None  # whose call: handles of another controller are refused

    def _reset_ids(self) -> None:
        self.refs = []
        self.keep = []  # keeps handles alive until the call is sent
        self.objects = []

    def persistent_id(self, obj: Any) -> int | None:
        if isinstance(obj, Array):
            if self.ctl is not None:
                check_owner(obj, self.ctl)
            obj.check_usable()
            self.refs.append([0, obj.ref])
        elif isinstance(obj, Future) and isinstance(obj.info, CallPlan):
            if self.ctl is not None:
                check_owner(obj, self.ctl)
            obj._read()  # its error, if any, is the dependent call's: never logged as unread
            self.refs.append([1, obj.call_id])
        elif isinstance(obj, ColocatedObjectBase):
            state = obj._colobus_state
            state.check_open()
            self.refs.append([2, state.obj_id])
            self.objects.append(state)
        else:
            return None
        self.keep.append(obj)
        return len(self.refs) - 1


class _FastArgsPickler(_HandleIds, StdPickler):
    """The stdlib (C) pickler: most arguments are arrays, numbers and plain containers."""

    def __init__(self, file: io.BytesIO, buffers: list[Buffer],
                 ctl: Controller | None = None) -> None:
        self.dispatch_table = std_dispatch_table()  # read by the C pickler's __init__
        super().__init__(file, protocol=5, buffer_callback=oob_callback(buffers))
        self._reset_ids()
        self.ctl = ctl


class _ArgsPickler(_HandleIds, cloudpickle.Pickler):  # type: ignore[misc]
    """Pickles call arguments with cloudpickle; host-resident values become persistent ids."""

    dispatch_table: ClassVar[ChainMap[Any, Any]] = _BY_VALUE_REDUCERS

    def __init__(self, file: io.BytesIO, buffers: list[Buffer],
                 ctl: Controller | None = None) -> None:
        super().__init__(file, protocol=5, buffer_callback=oob_callback(buffers))
        self._reset_ids()
        self.ctl = ctl


@dataclass(slots=True)
class PickledArgs:
    payload: bytes
    buffers: list[Buffer]
    refs: list[list[int]]
    keep: list[Any]
    objects: list[Any]
    # the user's packages the arguments name (a closure's module, a function's, a user
    # class's): they travel before the call as the function's own do
    needs: tuple[str, ...] = ()


_user_tops: tuple[int, tuple[bytes, ...]] = (-1, ())  # (len(sys.modules), the user's tops)


def _packages_in_args(data: bytes, ctl: Controller | None) -> tuple[str, ...]:
    """:func:`_packages_named` of an arguments pickle, read only where it can name one:
    most arguments (numbers, arrays, strings) hold no user package's name at all. With
    ``ctl``, packages that would pass its ``max_code_bytes`` raise ``SerializationError``
    here, at the call, nothing sent."""
    global _user_tops
    n, tops = _user_tops
    if n != len(sys.modules):  # something was imported since: who is the user's again
        names = {name.partition(".")[0] for name in list(sys.modules)}
        tops = tuple(sorted(t.encode() for t in names if user_package(t) is not None))
        _user_tops = (len(sys.modules), tops)
    for top in tops:
        if top in data:
            needs = _packages_named(data)
            if needs and ctl is not None:
                ctl._shipper.packages(needs)
            return needs
    return ()


def pickle_args(tree: Any, what: str, ctl: Controller | None = None) -> PickledArgs:
    """Pickle ``(args, kwargs)`` once for every host; ``SerializationError`` names the leaf.

    With ``ctl``, a handle another controller made raises ``ValueError`` (also one
    inside an object that is no pytree node); in ``ctl``'s JAX job, each array's ref
    names its global layout too (``colobus._api.joblayout``).
    """
    import jax

    args, kwargs = tree
    if not kwargs and type(args) is tuple and (not args or set(map(type, args)) == {Array}):
        # Only arrays, by position (``f(x)``, ``f(x, y)``): the payload names
        # persistent ids 0..n-1 and is the same bytes every time.
        refs = []
        for a in args:
            if ctl is not None:
                check_owner(a, ctl)
            a.check_usable()
            refs.append([0, a.ref])
        if ctl is not None and ctl._job is not None:
            refs = job_refs(refs, list(args))
        return PickledArgs(_handles_payload(len(args)), [], refs, list(args), [])
    f = io.BytesIO()
    buffers: list[Buffer] = []
    fast = _FastArgsPickler(f, buffers, ctl)
    try:
        fast.dump(tree)
        refs = fast.refs
        if ctl is not None and ctl._job is not None:
            refs = job_refs(refs, fast.keep)
        data = f.getvalue()
        return PickledArgs(data, buffers, refs, fast.keep, fast.objects,
                           _packages_in_args(data, ctl))
    except (SerializationError, RuntimeError, MisusedHandle) as exc:
        if isinstance(exc, SerializationError | MisusedHandle) or "deleted" in str(exc) or (
                "was closed" in str(exc)):
            raise
    except Exception:  # ByValue, or what only cloudpickle can pickle: start over
        pass
    f = io.BytesIO()
    buffers = []
    pickler = _ArgsPickler(f, buffers, ctl)
    try:
        pickler.dump(tree)
    except (SerializationError, RuntimeError, MisusedHandle) as exc:
        # a deleted array, a closed object, a handle of another controller: the
        # caller's misuse, not a pickling problem
        if isinstance(exc, SerializationError | MisusedHandle) or "deleted" in str(exc) or (
                "was closed" in str(exc)):
            raise
        raise SerializationError(f"arguments of {what} cannot be pickled: {exc}") from exc
    except Exception as exc:
        where = "an argument"
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if isinstance(leaf, Array | Future):
                continue
            try:
                cloudpickle.dumps(leaf)
            except Exception:
                where = f"argument {arg_path(path)} ({type(leaf).__name__})"
                break
        raise SerializationError(
            f"{where} of {what} cannot be pickled, so nothing was sent: {exc}") from exc
    refs = pickler.refs
    if ctl is not None and ctl._job is not None:
        refs = job_refs(refs, pickler.keep)
    data = f.getvalue()
    return PickledArgs(data, buffers, refs, pickler.keep, pickler.objects,
                       _packages_in_args(data, ctl))


def arg_path(path: Sequence[Any]) -> str:
    """A leaf's path in ``(args, kwargs)`` as written at the call: ``args[0]['k']``."""
    import jax

    first = path[0] if path else None
    if isinstance(first, jax.tree_util.SequenceKey) and first.idx in (0, 1):
        return ("args", "kwargs")[first.idx] + jax.tree_util.keystr(tuple(path[1:]))
    return jax.tree_util.keystr(tuple(path))
