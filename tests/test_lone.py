"""The host's only call on an idle stream (colobus._host.sched ``_lone_call``): it runs
with no stream of its own unless another call arrives first, and nothing of it shows.

The same sequence runs against workers with the lane on and with ``COLOBUS_CALL_LANE=0``
(the general path only); both must give the same results, errors and order, and the
lane's workers must have taken the lone path. Real workers, real sockets.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import msgpack
import numpy as np
import pytest
from lifecycle import calls_return_futures

import colobus as cb
from colobus._wire import protocol as P
from colobus._wire.splice import pack_body

_LOG: list[int] = []  # on each host: the tokens logged, in run order
_LOCK = threading.Lock()


@cb.colocated_python
def ident(x: Any) -> Any:
    return x


@cb.colocated_python
def plus(x: Any) -> Any:
    return x + 1


@cb.colocated_python
def pair(x: Any) -> Any:
    return (x, [x + 1, None])


@cb.colocated_python
def fails(x: Any) -> Any:
    raise ValueError(f"fails on {int(np.asarray(x).sum())}")


@cb.colocated_python
def log(token: int) -> Any:
    with _LOCK:
        _LOG.append(token)
        return np.int32(len(_LOG))


@cb.colocated_python
def read_log() -> Any:
    with _LOCK:
        return np.array(_LOG, np.int32)


@cb.colocated_python
def lone_calls() -> Any:
    """How many calls this host ran on the lone path (its scheduler's count)."""
    import sys

    from colobus._host.sched import Scheduler

    frame = sys._getframe(1)  # up to the scheduler running this call
    while not isinstance(frame.f_locals.get("self"), Scheduler):
        frame = frame.f_back
    return np.int32(frame.f_locals["self"].lone_calls)


@cb.colocated_python_class
class Counter:
    def __init__(self) -> None:
        self.n = 0

    def bump(self, x: Any) -> Any:
        self.n += 1
        return x + self.n

    def peek(self, x: Any) -> Any:
        return x

    def fails(self, x: Any) -> Any:
        raise KeyError(f"nothing at {self.n}")


def _on(dev: cb.Device, *fns: Any) -> list[Any]:
    return [f.specialize(devices=[dev]) for f in fns]


async def _value(x: Any) -> Any:
    return np.asarray(await cb.device_get(x)).tolist()


async def _scenario() -> list[Any]:
    """What the host answers to a sequence of lone calls, pipelined calls on one stream,
    calls that name earlier calls' outputs, errors, an object's methods and readiness."""
    dev = cb.devices()[0]
    ident_, plus_, pair_, fails_, log_, read_ = _on(dev, ident, plus, pair, fails, log, read_log)
    x = cb.device_put(np.arange(6, dtype=np.int32), dev)
    seen: list[Any] = []
    y = await ident_(x)  # alone, awaited: the lone path
    z = await plus_(y)  # an output of the call before as the argument
    seen += [await _value(y), await _value(z)]
    a, (b, none) = await pair_(z)  # a tree of outputs
    seen += [await _value(a), await _value(b), none]
    # One stream, fired without awaiting: the first is alone when it arrives, the others
    # arrive behind it (it gets its stream), each naming the one before.
    f1 = plus_(x)
    f2 = plus_(f1)
    f3 = plus_(f2)
    seen.append(await _value(await f3))
    seen.append(await _value(await f1))
    for _ in range(3):
        try:
            await fails_(x)
        except ValueError as exc:
            seen.append(str(exc).splitlines()[0])
    tokens = list(range(100, 140))
    counts = await asyncio.gather(*[log_(t) for t in tokens])  # one stream: in order
    seen.append([int(np.asarray(await cb.device_get(n))) for n in counts][-1] >= len(tokens))
    logged = [t for t in await _value(await read_()) if t in tokens]
    seen.append(logged == tokens)
    done = ident_(x)
    await cb.block_until_ready(done)  # FETCH_CALL of a lone call
    seen.append(await _value(await done))
    counter = Counter()
    bump = counter.bump
    seen += [await _value(await bump(x)), await _value(await bump(x))]
    # methods alone on their stream (the lone path for a plain method), an error, and
    # the object's destroy ordered behind them
    seen += [await _value(await counter.peek(x)), await _value(await counter.bump(x))]
    try:
        await counter.fails(x)
    except KeyError as exc:
        seen.append(str(exc).splitlines()[0])
    last = counter.bump(x)
    await cb.aclose(counter)
    seen.append(await _value(await last))
    return seen


_EXPECTED = [
    [0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6],
    [1, 2, 3, 4, 5, 6], [2, 3, 4, 5, 6, 7], None,
    [3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6],
    "fails on 15", "fails on 15", "fails on 15",
    True, True,
    [0, 1, 2, 3, 4, 5],
    [1, 2, 3, 4, 5, 6], [2, 3, 4, 5, 6, 7],
    [0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8], "'nothing at 3'", [4, 5, 6, 7, 8, 9],
]


@pytest.mark.parametrize("lane", ["1", "0"], ids=["lane", "no-lane"])
async def test_the_same_answers_with_the_lone_path_and_without(
        lane: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLOBUS_CALL_LANE", lane)  # read at import, by the workers
    monkeypatch.setenv("COLOBUS_INLINE_CALLS", "1")
    async with cb.local_cluster(hosts=1, devices_per_host=1, relays=0):
        seen = await _scenario()
        (count,) = _on(cb.devices()[0], lone_calls)
        lone = int(np.asarray(await cb.device_get(await count())))
    assert seen == _EXPECTED
    if lane == "1":
        assert lone >= 8, lone  # the awaited calls alone on their stream took it
    else:
        assert lone == 0, lone


def test_a_result_body_packed_from_its_list_is_the_dataclass_one() -> None:
    from colobus._host.runs import _OK, _RESULT, _pack

    for meta, times in [(1, [5, 7]), (0, []), (300, [2**40, 1])]:
        body = P.Result(77, P.Status.OK, meta, times)
        assert _pack([77, _OK, meta, times]) == pack_body(body.to_wire())
        assert _RESULT == body.kind
        assert msgpack.unpackb(_pack([77, _OK, meta, times])) == [77, 0, meta, times]


# -- a CANCEL that arrives while the lone call starts --------------------------------------


@cb.colocated_python
def raced_start(x: Any) -> Any:
    return x


@cb.colocated_python
def slow_lone_starts(on: Any) -> Any:
    """Host side: while ``on``, the lone path's check of whether a ``raced_start`` call
    may start takes 0.5 s (the thread sleeps right after reading the call's state), so
    a CANCEL that the loop's next leader handles meanwhile meets that check half done."""
    import time

    from colobus._host import calls

    slot = calls._Call.__dict__["state"]
    real = getattr(slot, "real", slot)
    if not bool(np.asarray(on)):
        calls._Call.state = real
        return np.int32(0)

    class Slow:
        """The slot's own descriptor, and the sleep on the lone path's read."""

        def __init__(self) -> None:
            self.real = real

        def __get__(self, obj: Any, owner: Any = None) -> Any:
            if obj is None:
                return self
            value = real.__get__(obj, owner)
            if (sys._getframe(1).f_code.co_name == "_run_lone"
                    and getattr(obj.fn, "__name__", "") == "raced_start"):
                time.sleep(0.5)
            return value

        def __set__(self, obj: Any, value: Any) -> None:
            real.__set__(obj, value)

    import sys

    calls._Call.state = Slow()  # type: ignore[misc]
    return np.int32(1)


async def test_a_cancel_during_the_lone_calls_start_never_gets_a_result_after_it(
        ctl: cb.Controller) -> None:
    """The lone path takes a call's start under the state lock, as the pool's path does:
    a CANCEL that a new loop leader handles meanwhile waits for it, finds the call
    running, and answers nothing (the call runs to its end and its result is dropped).
    Without the lock the host answered CANCELLED and then sent the call's result, a reply
    to an operation already ended: the controller dropped the host for it."""
    dev = ctl.devices()[0]
    patch, raced = _on(dev, slow_lone_starts, raced_start)
    # its output specs given: the calls return at once, to be cancelled while they start
    # (off the controller's loop a first call would return only once it ran)
    raced = raced.specialize(out_specs_fn=lambda x: x)
    before = dict(ctl.stats()["dropped"])
    assert int(np.asarray(cb.device_get(await patch(np.bool_(True))))) == 1
    try:
        x = cb.device_put(np.arange(3, dtype=np.int32), dev)
        ident_ = ident.specialize(devices=[dev])
        # (the calls' Futures, one stream: made as async code under ``async with`` makes
        # them, on the controller's loop thread, and cancelled here)
        with calls_return_futures() as on_loop:
            for _ in range(3):
                # a quick call first: the host's next call takes the lone path
                quick = await on_loop(lambda: ident_(x))
                assert np.asarray(cb.device_get(quick)).tolist() == [0, 1, 2]
                fut = on_loop(lambda: raced(x))
                await asyncio.sleep(0.15)  # the host is inside the lone path's check now
                assert fut.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await fut
        # the next call on that host answers: the host is alive and kept in order
        assert np.asarray(cb.device_get(await ident_(x))).tolist() == [0, 1, 2]
    finally:
        cb.device_get(await patch(np.bool_(False)))
    assert ctl.hosts()[0].state == "alive"
    after = ctl.stats()["dropped"]
    assert {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)} == {}
