"""Controller side of colocated objects: built on first use, destroyed with the handle.

Constructing a wrapper pickles its arguments and sends nothing. The first call
whose device set includes a host sends that host a CONSTRUCT (then the call);
each host keeps one instance per wrapper. When the wrapper is closed or
garbage-collected, every host that built the instance gets a DESTROY, which
the host runs in the dropping caller's stream (after its earlier calls, before
its later ones), once the calls it already holds for that object finished.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar, cast

from .._controller.controller import Controller
from .._controller.hosts import Host
from .._model.devices import Device
from .._wire import protocol as P
from .array import check_owner
from .func import (
    _LANE,
    CallPlan,
    Code,
    ColocatedObjectBase,
    PickledArgs,
    Target,
    _stream_id,
    invoke,
    pickle_args,
    returned,
)
from .joblayout import job_refs
from .pending import Pending, wait_outputs
from .specs import merge_check, merge_specialization

__all__ = ["aclose", "close", "colocated_python_class"]

_obj_ids = itertools.count(1)

T = TypeVar("T")


class ObjectState:
    """The controller's record of one colocated object."""

    def __init__(self, code: Code, cls_name: str, init: PickledArgs) -> None:
        self.obj_id = next(_obj_ids)
        self.code = code
        self.cls_name = cls_name
        self.init = init
        self.ctl: Controller | None = None
        self.built: dict[int, int] = {}  # host -> generation it was built in
        self.closed = False
        self.destroy_sent = False  # loop thread: DESTROY went out, nothing may build it again
        self._lock = threading.Lock()

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError(
                f"this {self.cls_name} colocated object was closed; make a new one")

    def bind(self, ctl: Controller) -> None:
        """Caller's thread, at each call: tie the object to ``ctl``.

        Done before the call is submitted, so a wrapper dropped right after the
        call (before the loop thread sent it) still knows where to send DESTROY.
        """
        with self._lock:
            self.check_open()
            if self.ctl is None:
                self.ctl = ctl
            elif self.ctl is not ctl:
                raise ValueError(
                    f"this {self.cls_name} object belongs to the controller that first used "
                    f"it, {self.ctl!r}; it cannot be used with another controller, {ctl!r}")

    def check_plan(self, ctl: Controller, plan: CallPlan) -> None:
        self.bind(ctl)
        for handle in self.init.keep:  # arrays and futures given to __init__
            if not isinstance(handle, ColocatedObjectBase):
                check_owner(handle, ctl)
        for state in self.init.objects:  # objects given to __init__ are built with it
            if state.ctl is None:
                state.bind(ctl)
        for h in plan.hosts:
            gen = self.built.get(h)
            if gen is None:
                continue
            host = ctl._hosts[h]
            if not host.alive or host.generation != gen:
                raise host.lost_error(f"the {self.cls_name} instance lived there")

    def ensure_built(self, ctl: Controller, host: Host) -> None:
        """Loop thread: send CONSTRUCT to ``host`` unless it built (or lost) the instance."""
        if self.ctl is None:
            self.ctl = ctl
        if self.destroy_sent:  # closed while a call naming it waited to be sent
            raise RuntimeError(
                f"this {self.cls_name} colocated object was closed; make a new one")
        gen = self.built.get(host.index)
        if gen is not None:
            if gen != host.generation or not host.alive:
                raise host.lost_error(f"the {self.cls_name} instance lived there")
            return
        digest = self.code.ship(ctl, host)
        init = self.init
        if init.needs:  # the user's packages the constructor's arguments name
            ctl._shipper.ship(ctl, host, init.needs)
        for state in init.objects:
            state.ensure_built(ctl, host)
        refs = init.refs if ctl._job is None else job_refs(init.refs, init.keep)
        ctl._send(host, P.Construct(self.obj_id, digest, refs), init.payload, init.buffers,
                 len(init.buffers))
        self.built[host.index] = host.generation
        ctl._count("objects_built")

    def destroy(self) -> None:
        """Idempotent; safe from finalizers on any thread.

        The DESTROY is ordered like a call of the caller that dropped (or closed)
        the wrapper: hosts run it after that caller's earlier calls and before its
        later ones, once every call of the object they hold has finished.
        """
        stream = _stream_id()
        with self._lock:
            if self.closed:
                return
            self.closed = True
            ctl = self.ctl
            if ctl is None:  # never called: nothing is built and no call names it
                self.destroy_sent = True
        if ctl is None or ctl.state.value != "running":
            return

        def send() -> None:
            for h, gen in list(self.built.items()):
                host = ctl._hosts[h]
                if host.alive and host.generation == gen:
                    ctl._send(host, P.Destroy(self.obj_id, stream))
            self.built.clear()
            self.destroy_sent = True
            self.init = PickledArgs(b"", [], [], [], [])

        try:
            ctl._ops.post(send)
        except Exception:  # controller already closed: the hosts dropped everything
            pass


class MethodTarget(Target):
    """A method of one object (one per object, method and specialization: what the
    call's lane works out for it is kept here)."""

    def __init__(self, state: ObjectState, method: str) -> None:
        self.state = state
        self.obj_id = state.obj_id
        self.method = method
        self.name = f"{state.cls_name}.{method}"
        self.built = state.built  # (the dict itself: emptied, never replaced)

    def stats_key(self, digest: bytes) -> tuple[bytes, str]:
        return (self.state.code.get()[0], self.method)  # hosts know the object's class

    def check(self, ctl: Controller, plan: CallPlan) -> None:
        self.state.check_plan(ctl, plan)
        if self.state.code.ready != ctl._shipper.serial:  # its class's first call with ctl
            self.state.code.prepare(ctl)
        if self.state.init.needs:  # past max_code_bytes: fails here, nothing sent
            ctl._shipper.packages(self.state.init.needs)

    def prepare(self, ctl: Controller, host: Host) -> None:
        self.state.ensure_built(ctl, host)


class ColocatedMethod:
    """A method of a colocated object: behaves as a colocated function.

    Like a Python bound method it keeps its object alive (``owner``), so
    ``Loader(path).next_batch(x)`` works and the temporary object is destroyed
    after that call. A method assigned back onto its object is stored without
    the owner (no reference cycle) and bound again on each attribute access.
    """

    def __init__(self, state: ObjectState, name: str, fn: Callable[..., Any], *,
                 in_specs: Any = None, out_specs_fn: Callable[..., Any] | None = None,
                 devices: Sequence[Device] | None = None, owner: Any = None,
                 check_replicas: bool = False) -> None:
        functools.update_wrapper(self, fn)
        self._owner = owner
        self._state = state
        self._name = name
        self._fn = fn
        self._target = MethodTarget(state, name)
        self._in_specs = in_specs
        self._out_specs_fn = out_specs_fn
        self._devices = tuple(devices) if devices is not None else None
        self._check_replicas = check_replicas
        # the common call's lane (colobus._api.lane): no input specs, no fixed devices
        self._lane = (_LANE[0] is not None and in_specs is None and devices is None
                      and not check_replicas)

    def __repr__(self) -> str:
        return f"<colocated method {self._target.name}>"

    def specialize(self, in_specs: Any = None, out_specs_fn: Callable[..., Any] | None = None,
                   devices: Sequence[Device] | None = None,
                   check_replicas: bool | None = None) -> ColocatedMethod:
        """A new method with fixed specs or devices (or ``check_replicas=True``: see
        ``ColocatedFunction.specialize``); assign it back onto the object."""
        in_specs, out_specs_fn, devices = merge_specialization(
            (self._in_specs, self._out_specs_fn, self._devices), in_specs, out_specs_fn,
            devices)
        return ColocatedMethod(self._state, self._name, self._fn, in_specs=in_specs,
                               out_specs_fn=out_specs_fn, devices=devices, owner=self._owner,
                               check_replicas=merge_check(self._check_replicas,
                                                          check_replicas))

    def _rebind(self, owner: Any) -> ColocatedMethod:
        """The same method (same specialization, the same target) held by ``owner``, or
        by nothing: its attributes copied, not made again (a method is bound on every
        attribute access; tests/test_call_forms.py holds the copy equal to a new one)."""
        method: ColocatedMethod = _new(ColocatedMethod)
        method.__dict__.update(self.__dict__)
        method._owner = owner
        return method

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = self._state
        if state.closed:
            state.check_open()  # (raises)
        target = self._target
        if self._lane and not kwargs:
            fut = _LANE[0](target, args, self._out_specs_fn)  # type: ignore[misc]
            if fut is not None:
                r = fut._returns  # (colobus._api.func.returned, inline)
                if r is None:  # the controller's loop thread: its Future
                    return fut
                return r.tree if type(r) is Pending else wait_outputs(fut, r)
        fut = invoke(target, args, kwargs, in_specs=self._in_specs,
                     out_specs_fn=self._out_specs_fn, devices=self._devices,
                     check_replicas=self._check_replicas)
        return returned(fut)


_new = object.__new__


class _MethodDescriptor:
    """Class attribute: ``obj.name`` gives a bound :class:`ColocatedMethod`.

    A non-data descriptor, so a specialized method assigned onto the instance wins.
    """

    def __init__(self, name: str, fn: Callable[..., Any]) -> None:
        self.name = name
        self.fn = fn
        functools.update_wrapper(cast(Any, self), fn)  # name and docstring for help()

    def __get__(self, inst: Any, owner: type | None = None) -> Any:
        if inst is None:
            return self
        assigned = inst._colobus_methods.get(self.name)
        if assigned is None:  # the plain method: made once per object, bound on each access
            assigned = inst._colobus_plain.get(self.name)
            if assigned is None:
                assigned = inst._colobus_plain[self.name] = ColocatedMethod(
                    inst._colobus_state, self.name, self.fn)
        method: ColocatedMethod = _new(ColocatedMethod)  # (assigned._rebind(inst), inline)
        method.__dict__.update(assigned.__dict__)
        method._owner = inst
        return method


class _ColocatedObject(ColocatedObjectBase):
    """Base of every wrapper class (the user's class is ``__wrapped__``)."""

    __wrapped__: type
    _colobus_code: Code
    _colobus_methods: dict[str, ColocatedMethod]  # methods assigned back, without owner
    _colobus_plain: dict[str, ColocatedMethod]  # its methods as first bound, without owner
    _colobus_finalizer: weakref.finalize[Any, Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cls = type(self).__wrapped__
        init = pickle_args((args, kwargs), f"{cls.__qualname__}.__init__")
        state = ObjectState(type(self)._colobus_code, cls.__qualname__, init)
        object.__setattr__(self, "_colobus_state", state)
        object.__setattr__(self, "_colobus_methods", {})
        object.__setattr__(self, "_colobus_plain", {})
        object.__setattr__(self, "_colobus_finalizer", weakref.finalize(self, state.destroy))

    def __setattr__(self, name: str, value: Any) -> None:
        # ``obj.m = obj.m.specialize(...)``: keep the method without its owner, so
        # the object does not hold itself (and dies, and is destroyed, by refcount).
        if isinstance(value, ColocatedMethod) and value._state is self._colobus_state:
            self._colobus_methods[name] = value._rebind(None)
            self.__dict__.pop(name, None)
            return
        self._colobus_methods.pop(name, None)
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self._colobus_methods.pop(name, None) is None:
            object.__delattr__(self, name)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_colobus_"):  # not set yet (e.g. during unpickling)
            raise AttributeError(name)
        assigned = self._colobus_methods.get(name)
        if assigned is not None:
            return assigned._rebind(self)
        cls = type(self).__wrapped__
        if hasattr(cls, name):
            raise AttributeError(
                f"{cls.__qualname__}.{name} is not a method; colocated objects live on hosts, "
                "so only their methods can be reached from the controller")
        raise AttributeError(f"{cls.__qualname__!r} colocated object has no attribute {name!r}")

    # colobus's own lifecycle is ``cb.close(obj)`` / ``await cb.aclose(obj)``, ``with``,
    # ``async with`` and ``del``: every name a user's class may use is the user's method

    def __enter__(self: T) -> T:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._colobus_finalizer()

    async def __aenter__(self: T) -> T:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        self._colobus_finalizer()

    def __repr__(self) -> str:
        st = self._colobus_state
        where = f"built on hosts {sorted(st.built)}" if st.built else "not built yet"
        if st.closed:
            where = "closed"
        return f"<colocated {st.cls_name} object, {where}>"


def close(obj: Any) -> None:
    """Destroy a colocated object on every host that built it, after the calls it holds
    there (as leaving ``with obj:`` or ``del obj`` does): colobus's own close, named so
    that no method of the user's class (``obj.close(...)`` is the user's) is hidden.

    Raises:
        TypeError: ``obj`` is not a colocated object.
    """
    if not isinstance(obj, _ColocatedObject):
        raise TypeError(f"cb.close closes colocated objects (made by a "
                        f"colocated_python_class), not {type(obj).__name__}")
    obj._colobus_finalizer()


async def aclose(obj: Any) -> None:
    """:func:`close`, for ``await cb.aclose(obj)`` in async code."""
    close(obj)


def colocated_python_class(cls: type[T]) -> type[T]:
    """Make ``cls`` a colocated class: instances live on hosts, built on first use.

    The returned wrapper class has ``cls``'s name, docstring and methods.
    Constructing it sends nothing (the arguments are pickled at once); each
    method call runs on every host of its device set, building the host's
    instance first if needed. Every method of ``cls`` is reachable, whatever its name
    (``close`` too): colobus's own are ``cb.close(obj)`` and ``await cb.aclose(obj)``.
    """
    if not isinstance(cls, type):
        raise TypeError("colocated_python_class decorates a class")
    namespace: dict[str, Any] = {
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "__wrapped__": cls,
        "_colobus_code": Code(cls),
    }
    for name, member in inspect.getmembers(cls):
        if name.startswith("__"):
            continue
        if inspect.isfunction(member) or inspect.iscoroutinefunction(member):
            namespace[name] = _MethodDescriptor(name, member)
    wrapper = type(cls.__name__, (_ColocatedObject,), namespace)
    return cast(type[T], wrapper)
