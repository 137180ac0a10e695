"""Every common call form on the call's lane (colobus._api.lane) gives what the general
path (:func:`colobus._api.func.invoke`) gives: a function specialized with
``out_specs_fn``, an object's methods (plain and specialized), the sync face
from a plain thread (a call returns its arrays at once, as JAX's) and from a thread
running an event loop of its own (its arrays too: SPEC 4), one host and a fan-out.

The same sequence runs twice on the shared cluster: once as the lane takes it, once
with the lane refusing every call (so each goes the general path); the results,
errors, layouts and cache counts must be equal. The worker's side of the same forms
(its lone path for methods) is compared in ``tests/test_lone.py``.
"""

from __future__ import annotations

import asyncio
import threading
from types import MethodType
from typing import Any, ClassVar

import numpy as np
import pytest

import colobus as cb
from colobus._api import func
from colobus._api.obj import ColocatedMethod
from colobus._host.construct import plain_method

_SPEC_CALLS: list[int] = []  # out_specs_fn's calls (controller side)


@cb.colocated_python
def form_ident(x: Any) -> Any:
    return x


@cb.colocated_python
def form_pair(x: Any) -> Any:
    return (x, [x])


def _same_specs(x: Any) -> Any:
    _SPEC_CALLS.append(1)
    return x


def _pair_specs(x: Any) -> Any:
    _SPEC_CALLS.append(1)
    return (x, [x])


def _wrong_specs(x: Any) -> Any:
    return cb.ShapeDtypeStruct((x.shape[0] + 1,), x.dtype, x.sharding)


@cb.colocated_python_class
class Keeper:
    def __init__(self, start: int) -> None:
        self.n = start

    def ident(self, x: Any) -> Any:
        return x

    def bump(self, x: Any) -> Any:
        self.n += 1
        return x + self.n

    def fails(self, x: Any) -> Any:
        raise KeyError(f"no {self.n}")


def _layout(a: Any) -> Any:
    s = a.sharding
    return (a.shape, str(a.dtype), type(s).__name__, getattr(s, "spec", None),
            sorted(d.id for d in s.device_set))


def _value(a: Any) -> Any:
    return (np.asarray(cb.device_get(a)).tolist(), _layout(a))  # (blocks: a plain thread)


def _forms(x1: Any, x8: Any) -> list[Any]:
    """The sequence, from this (plain) thread: each form, alone and repeated."""
    seen: list[Any] = []
    ident_s = form_ident.specialize(out_specs_fn=_same_specs)
    pair_s = form_pair.specialize(out_specs_fn=_pair_specs)
    wrong = form_ident.specialize(out_specs_fn=_wrong_specs)
    for x in (x1, x8, x1):  # one host, a fan-out over both hosts, one host again
        for _ in range(3):
            seen.append(_value(ident_s(x)))
        a, (b,) = pair_s(x)  # unpacked at once, as JAX's outputs
        seen += [_value(a), _value(b)]
        for _ in range(2):
            with pytest.raises(ValueError, match="expected shape") as err:
                cb.block_until_ready(wrong(x))
            seen.append(str(err.value))
    seen.append(ident_s.cache_info()[:2])
    keeper = Keeper(10)
    ident_m = keeper.ident
    specialized = keeper.ident.specialize(out_specs_fn=_same_specs)
    keeper.ident_s = specialized  # assigned back: bound again on each access
    for x in (x1, x8, x1):
        seen.append(_value(ident_m(x)))
        seen.append(_value(keeper.ident(x)))
        seen.append(_value(keeper.ident_s(x)))
        seen.append(_value(keeper.bump(x)))
        with pytest.raises(KeyError, match="no") as kerr:
            cb.block_until_ready(keeper.fails(x))
        seen.append(str(kerr.value).splitlines()[0])
    # many in flight from this thread, then read in order
    outs = [keeper.bump(x1) for _ in range(5)] + [ident_s(x1) for _ in range(5)]
    seen += [_value(o) for o in outs]
    cb.close(keeper)
    with pytest.raises(RuntimeError, match="closed"):
        keeper.ident(x1)
    return seen


def _run(ctl: cb.Controller) -> list[Any]:
    d = ctl.devices()
    x1 = cb.device_put(np.arange(4, dtype=np.float32), d[0])
    mesh = cb.Mesh(np.array(d, dtype=object), ("i",))
    x8 = cb.device_put(np.arange(16, dtype=np.float32),
                       cb.NamedSharding(mesh, cb.PartitionSpec("i")))
    return _forms(x1, x8)


async def _on_a_loop(ctl: cb.Controller) -> list[Any]:
    """The sequence from a thread running an event loop that is not the controller's (a
    notebook's, ``asyncio.run`` beside a ``with`` cluster): the same arrays."""
    return _run(ctl)


def test_each_form_gives_on_the_lane_what_the_general_path_gives(ctl: cb.Controller) -> None:
    lane = func._LANE[0]
    if lane is None:
        pytest.skip("COLOBUS_CALL_LANE=0: there is no lane to compare")
    taken = [0]

    def counted(*args: Any) -> Any:
        fut = lane(*args)
        if fut is not None:
            taken[0] += 1
        return fut

    try:  # (the hook's list is shared: func and obj read its item at each call)
        func._LANE[0] = counted
        _SPEC_CALLS.clear()
        on_lane = _run(ctl)
        lane_specs = len(_SPEC_CALLS)
        assert taken[0] == 43, taken  # every call of the sequence took the lane
        on_a_loop = asyncio.run(_on_a_loop(ctl))
        assert taken[0] == 86, taken  # there too
        func._LANE[0] = lambda *args: None  # each call the general path
        _SPEC_CALLS.clear()
        general = _run(ctl)
    finally:
        func._LANE[0] = lane
    assert on_lane == general == on_a_loop
    # out_specs_fn runs once per input signature on the lane (the general path: per call)
    assert lane_specs < len(_SPEC_CALLS)


def test_out_specs_fn_runs_once_per_input_signature_on_the_lane(ctl: cb.Controller) -> None:
    if func._LANE[0] is None:
        pytest.skip("COLOBUS_CALL_LANE=0")
    calls: list[Any] = []

    def specs(x: Any) -> Any:
        calls.append((x.shape, str(x.dtype)))
        return x

    f = form_ident.specialize(out_specs_fn=specs)
    d0 = ctl.devices()[0]
    x = cb.device_put(np.zeros(3, np.float32), d0)
    y = cb.device_put(np.zeros(5, np.float32), d0)
    for a in (x, x, x, y, y, x):
        assert f(a).shape == a.shape
    assert calls == [((3,), "float32"), ((5,), "float32"), ((3,), "float32")]


async def test_methods_and_specialized_calls_awaited_on_the_controllers_loop() -> None:
    """The same forms awaited on the controller's own loop (the lane that sends at once),
    also behind a full window (max_inflight=1: the backlog), and their frees."""
    from lifecycle import quiesced

    async with cb.local_cluster(hosts=1, devices_per_host=1, max_inflight=1) as ctl:
        d0 = ctl.devices()[0]
        x = cb.device_put(np.arange(3.0), d0)
        f = form_ident.specialize(out_specs_fn=lambda a: a)
        keeper = Keeper(0)
        for _ in range(5):
            y = await f(x)
            z = await keeper.bump(y)
        assert np.asarray(await cb.device_get(z)).tolist() == [5.0, 6.0, 7.0]
        outs = await cb.gather(*[keeper.bump(x) for _ in range(4)], *[f(x) for _ in range(4)])
        assert [np.asarray(await cb.device_get(o)).tolist()[0] for o in outs[:4]] == [
            6.0, 7.0, 8.0, 9.0]
        await cb.aclose(keeper)
        del y, z, outs
        hosts = await quiesced(ctl, base={0: {"arrays": 1, "bytes": 24}})
        assert (hosts[0]["arrays"], hosts[0]["results"]) == (1, 0), hosts


def test_a_method_bound_again_is_the_method_made_anew(ctl: cb.Controller) -> None:
    """``obj.m`` copies the method made once per object (ColocatedMethod._rebind and the
    descriptor's inline copy): the attributes a new one has, the target shared."""
    keeper = Keeper(1)
    state = keeper._colobus_state
    made = ColocatedMethod(state, "bump", Keeper.__wrapped__.bump, owner=keeper)
    for got in (keeper.bump, keeper.bump._rebind(keeper)):
        assert set(got.__dict__) == set(made.__dict__)
        for k, v in made.__dict__.items():
            if k == "_target":
                assert type(got._target) is type(v)
                assert vars(got._target).keys() >= {"state", "obj_id", "method", "name"}
                assert (got._target.name, got._target.obj_id) == (v.name, v.obj_id)
            else:
                assert got.__dict__[k] == v, k
    assert keeper.bump._target is keeper.bump._target  # one target per object and method
    assert keeper.bump.__name__ == "bump" and keeper.bump._owner is keeper
    cb.close(keeper)


class _Plain:
    def m(self) -> int:
        return 1

    @staticmethod
    def s() -> int:
        return 2

    @classmethod
    def c(cls) -> int:
        return 3

    async def a(self) -> int:
        return 4

    @property
    def p(self) -> Any:
        return self.m


class _Own(_Plain):
    def __getattribute__(self, name: str) -> Any:
        return object.__getattribute__(self, name)


def test_the_workers_lone_method_is_getattr_where_it_finds_one() -> None:
    """colobus._host.construct.plain_method: the bound plain method getattr gives, or None
    where finding it could run the user's code or give something else."""
    loop = asyncio.new_event_loop()
    try:
        def built(inst: Any) -> asyncio.Future[Any]:
            fut = loop.create_future()
            fut.set_result(inst)
            return fut

        inst = _Plain()
        got = plain_method(built(inst), "m")
        assert type(got) is MethodType and got == inst.m and got() == 1
        for name in ("s", "c", "a", "p", "missing"):
            assert plain_method(built(inst), name) is None, name
        shadowed = _Plain()
        shadowed.m = lambda: 9  # type: ignore[method-assign]
        assert plain_method(built(shadowed), "m") is None
        assert plain_method(built(_Own()), "m") is None
        failed = loop.create_future()
        failed.set_exception(ValueError("init"))
        failed.exception()
        assert plain_method(failed, "m") is None
        assert plain_method(loop.create_future(), "m") is None  # not built yet
    finally:
        loop.close()


def test_one_host_calls_from_many_threads_keep_each_threads_order(ctl: cb.Controller) -> None:
    """The sync face's lane (a call posted to the loop in one hop): per-thread order,
    with the back-pressure of ``max_backlog`` left to ``_take_slot``."""
    keeper = Keeper(0)
    d0 = ctl.devices()[0]
    x = cb.device_put(np.zeros(1), d0)
    cb.block_until_ready(keeper.bump(x))
    got: dict[int, list[float]] = {}

    def run(i: int) -> None:
        f = form_ident.specialize(out_specs_fn=_same_specs)
        outs = [f(keeper.bump(x)) for _ in range(20)]  # pending arrays, chained
        got[i] = [float(np.asarray(cb.device_get(o))[0]) for o in outs]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for seq in got.values():
        assert seq == sorted(seq) and len(set(seq)) == 20  # each thread's calls in order
    assert sorted(v for seq in got.values() for v in seq) == [float(v) for v in range(2, 62)]
    cb.close(keeper)


@cb.colocated_python
def unpicklings(x: Any, on: bool) -> Any:
    """The worker's argument unpicklings since counting started (``on``: count from now
    on, as a subclass of its loader; off: the worker's own loader back)."""
    from colobus._host import calls

    loader = calls.ArgsLoader
    counted = getattr(loader, "counted", None)
    if on and counted is None:
        class Counted(loader):  # type: ignore[misc, valid-type]
            counted: ClassVar[list[int]] = [0]

            def load(self) -> Any:
                Counted.counted[0] += 1
                return super().load()

        calls.ArgsLoader = Counted
        counted = Counted.counted
    elif not on and counted is not None:
        calls.ArgsLoader = loader.__bases__[0]
    return np.int64(counted[0] if counted else 0)


@cb.colocated_python
def form_add(x: Any, y: Any, scale: float = 1.0) -> Any:
    return (x + y) * scale


def _got(a: Any) -> Any:
    return np.asarray(cb.device_get(a))


def test_arrays_alone_by_position_are_the_arguments_without_unpickling(
        ctl: cb.Controller) -> None:
    """``f(x)``, ``f(x, y)``: the controller's payload for arrays alone is the same bytes
    every time, and the worker takes the values as the arguments without unpickling
    them; any other argument (a number, a keyword) is unpickled as before."""
    d0 = ctl.devices()[0]
    x = cb.device_put(np.arange(4, dtype=np.float32), d0)
    y = cb.device_put(np.ones(4, dtype=np.float32), d0)
    start = int(_got(unpicklings(x, True)))  # (this call: a bool, unpickled)
    try:
        for _ in range(5):
            assert _got(form_ident(x)).tolist() == [0, 1, 2, 3]
            assert _got(form_add(x, y)).tolist() == [1, 2, 3, 4]
        assert _got(unpicklings(x, True)) - start == 1  # only the count's own call
        assert _got(form_add(x, y, 2.0)).tolist() == [2, 4, 6, 8]
        assert _got(form_add(x, y=y)).tolist() == [1, 2, 3, 4]
        assert _got(unpicklings(x, True)) - start == 4
    finally:
        unpicklings(x, False)
