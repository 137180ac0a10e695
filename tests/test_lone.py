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
    await counter.aclose()
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
