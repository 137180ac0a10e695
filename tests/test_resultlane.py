"""The common reply's lane (colobus._controller.resultlane) and the Future's waits: the
same outputs, errors and wake-ups as the general path.

A function's first reply takes the general path (its outputs are built from the
description and remembered); the same description again is settled in the lane. Each
test here compares what the two made, on the shared 2-host cluster (whose controller
runs on its own loop thread: the awaiting task here is woken across threads). The calls
are made as async code under ``async with`` makes them, on that thread
(``lifecycle.in_async``): their Futures' replies are what is compared (a call made here,
off that thread, returns its arrays, made before the reply).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest
from lifecycle import in_async

import colobus as cb
from colobus._api import outputs
from colobus._api.array import Array
from colobus._api.func import _decode_result
from colobus._controller import resultlane
from colobus._controller.future import Future
from colobus._wire.lane import ON

WAIT_S = 60.0


@cb.colocated_python
def lane_ident(x: Any) -> Any:
    return x


@cb.colocated_python
def lane_pair(x: Any) -> Any:
    return (x, {"b": x, "a": [x]})


@cb.colocated_python
def lane_nothing(x: Any) -> Any:
    return None


@cb.colocated_python
def lane_fails(x: Any) -> Any:
    if int(np.asarray(x).sum()) > 100:
        raise KeyError("too big")
    return x


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the lane's builds that hit (each a reply settled in the lane)."""
    hits = [0]
    build, learn, read = resultlane.SETTLERS[_decode_result]

    def counted(op: Any, host: int, raw: bytes, count: int, times: Any) -> Any:
        got = build(op, host, raw, count, times)
        if got is not resultlane.MISS:
            hits[0] += 1
        return got

    monkeypatch.setitem(resultlane.SETTLERS, _decode_result, (counted, learn, read))
    return hits


def _same_arrays(a: Array, b: Array) -> None:
    """Two outputs of the same function and arguments, made by different calls."""
    for slot in Array.__slots__:
        if slot == "__weakref__":
            continue
        va, vb = getattr(a, slot), getattr(b, slot)  # every slot set (none missing)
        if slot == "ref":
            assert va & 0xFFFF == vb & 0xFFFF
            assert va >> 16 != vb >> 16
        elif slot == "_finalizer":
            assert va is not None and vb is not None and va() is a and vb() is b
        else:
            assert va == vb, slot


async def test_outputs_settled_in_the_lane_are_those_the_general_path_builds(
        ctl: cb.Controller, monkeypatch: pytest.MonkeyPatch) -> None:
    hits = _counting(monkeypatch)
    x = cb.device_put(np.arange(6.0), cb.devices()[0])
    for fn in (lane_ident, lane_pair):
        first = await in_async(lambda fn=fn: fn(x))  # (learnt, if not already)
        leaves0 = [first] if isinstance(first, Array) else _leaves(first)
        for _ in range(3):
            again = await in_async(lambda fn=fn: fn(x))
            leaves = [again] if isinstance(again, Array) else _leaves(again)
            assert type(again) is type(first)
            assert len(leaves) == len(leaves0)
            for a, b in zip(leaves, leaves0, strict=True):
                _same_arrays(a, b)
                np.testing.assert_array_equal(cb.device_get(a), np.arange(6.0))
        if not isinstance(first, Array):
            assert list(again[1]) == list(first[1]) and isinstance(again[1]["a"], list)
    assert await in_async(lambda: lane_nothing(x)) is None
    assert await in_async(lambda: lane_nothing(x)) is None
    if ON:
        assert hits[0] >= 7


async def test_replies_in_a_batch_are_settled_in_the_lane_as_the_general_path_would(
        ctl: cb.Controller, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pipelined calls' replies come back in BATCHes: each RESULT settled in the lane
    (outputs as the general path builds them), a failed call among them failing alone,
    in order, with the batches counted."""
    hits = _counting(monkeypatch)
    batched = [0]
    batch = resultlane._batch

    def counted(entries: Any, total: int) -> Any:
        got = batch(entries, total)
        batched[0] += got is not None
        return got

    monkeypatch.setattr(resultlane, "_batch", counted)
    small = cb.device_put(np.arange(6.0), cb.devices()[0])
    big = cb.device_put(np.arange(30.0), cb.devices()[0])
    first = await in_async(lambda: lane_fails(small))  # (learnt, if not already)
    received = ctl.stats()["batches_received"]
    # (made as async code makes them, on the controller's loop: their Futures, at once)
    futs = in_async(lambda: [lane_fails(big if i == 150 else small) for i in range(300)])
    got = await asyncio.gather(*futs, return_exceptions=True)
    assert isinstance(got[150], KeyError) and "too big" in str(got[150])
    for i, out in enumerate(got):
        if i != 150:
            assert isinstance(out, Array), (i, out)
            _same_arrays(out, first)
    np.testing.assert_array_equal(cb.device_get(got[-1]), np.arange(6.0))
    assert ctl.stats()["batches_received"] > received
    if ON:
        assert batched[0] > 0 and hits[0] >= 100, (batched, hits)


def _leaves(tree: Any) -> list[Any]:
    import jax

    return list(jax.tree_util.tree_leaves(tree))


async def test_errors_and_cancellations_after_lane_hits(ctl: cb.Controller,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    hits = _counting(monkeypatch)
    small = cb.device_put(np.arange(3.0), cb.devices()[0])
    big = cb.device_put(np.arange(30.0), cb.devices()[0])
    for _ in range(3):
        assert isinstance(await in_async(lambda: lane_fails(small)), Array)
    with pytest.raises(KeyError, match="too big"):
        await in_async(lambda: lane_fails(big))
    def made_and_cancelled() -> Any:  # in one step of the controller's loop: before its reply
        made = lane_fails(small)
        made.cancel()
        return made

    fut = in_async(made_and_cancelled)
    with pytest.raises(asyncio.CancelledError):
        await fut
    assert isinstance(await in_async(lambda: lane_fails(small)), Array)  # the lane serves it
    if ON:
        assert hits[0] >= 3


def test_result_from_threads_waits_and_times_out(ctl: cb.Controller) -> None:
    x = cb.device_put(np.arange(4.0), cb.devices()[0])
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(lane_ident(x)), np.arange(4.0))
    fut: Future[int] = Future()
    with pytest.raises(TimeoutError):
        fut.result(0.01)
    with pytest.raises(TimeoutError):
        fut.result(0)  # no wait at all
    got: list[Any] = []
    threads = [threading.Thread(target=lambda: got.append(fut.result(WAIT_S))) for _ in range(4)]
    for t in threads:
        t.start()
    fut.set_result(5)  # every waiting thread goes on (each lets the next one in)
    for t in threads:
        t.join(WAIT_S)
    assert got == [5, 5, 5, 5]
    assert fut.result(0) == 5


async def test_two_tasks_awaiting_one_future_both_wake() -> None:
    fut: Future[str] = Future()
    tasks = [asyncio.ensure_future(_await(fut)) for _ in range(3)]
    await asyncio.sleep(0)
    fut.set_result("v")
    assert await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S) == ["v"] * 3
    done: Future[str] = Future()
    done.set_result("w")
    assert await done == "w"  # done before awaited: no wait at all


async def _await(fut: Future[Any]) -> Any:
    return await fut


async def test_fan_out_results_are_those_of_the_general_path(ctl: cb.Controller) -> None:
    """A fan-out's replies before its last are recorded in the lane; its outputs are
    built from all of them as before (the description read per host)."""
    mesh = cb.Mesh(np.array(cb.devices()).reshape(2, 4), ("hosts", "d"))
    sharding = cb.NamedSharding(mesh, cb.PartitionSpec("hosts"))
    x = cb.device_put(np.arange(8.0).reshape(2, 4), sharding)
    for _ in range(3):
        out = await in_async(lambda: lane_pair(x))
        assert out[0].sharding == x.sharding and out[0].shape == (2, 4)
        np.testing.assert_array_equal(cb.device_get(out[1]["a"][0]),
                                      np.arange(8.0).reshape(2, 4))
    y = cb.device_put(np.array([[0.0, 1, 2, 3], [100, 100, 100, 100]]), sharding)
    for _ in range(2):
        assert isinstance(await in_async(lambda: lane_fails(x)), cb.Array)
        with pytest.raises(KeyError, match="too big") as info:  # host 1's error, host 0's
            await in_async(lambda: lane_fails(y))  # output freed
        assert any("host 1" in note for note in info.value.__notes__)


def test_remembered_outputs_stay_bounded() -> None:
    assert outputs._BUILT_MAX >= 64
    assert len(outputs._BUILT) <= outputs._BUILT_MAX


# -- the lane's acknowledgement: Peer.acked written out ----------------------------------


class _Dispatched:
    """The sessions a ResultLane hands what it does not settle (here: everything after
    the acknowledgement, the call being nobody's)."""

    def __init__(self, ctl: Any) -> None:
        self._ctl = ctl
        self.dropped: Any = __import__("collections").Counter()
        self.handed: list[Any] = []

    def on_frames(self, frames: list[Any]) -> None:
        self.handed.append(("frames", frames))

    def on_envelope(self, identity: bytes, env: Any, frame: Any) -> None:
        self.handed.append(("envelope", env.seq))

    def _dispatch(self, host: Any, identity: bytes, env: Any) -> None:
        self.handed.append(("dispatch", env.seq))


@pytest.mark.parametrize("sent_ago, acks", [
    (0.001, [1]), (0.001, [3]), (0.9, [2, 4]), (0.3, [1, 2, 3, 4]), (5.0, [4])])
def test_the_lanes_acknowledgement_is_peer_acked(monkeypatch: pytest.MonkeyPatch,
                                                 sent_ago: float, acks: list[int]) -> None:
    """ResultLane.on_frames reads a RESULT's ``ack`` as :meth:`Peer.acked` does (written
    out there): the same peer afterwards, whatever it frees and however the window moves
    (grows on a quick round trip, shrinks on a slow one)."""
    import types

    import zmq

    from colobus._wire import peer as peer_module
    from colobus._wire import protocol as P
    from colobus._wire.envelope import Envelope
    from colobus._wire.lane import encode
    from colobus._wire.peer import Peer

    now = 1000.0
    monkeypatch.setattr(resultlane, "_monotonic", lambda: now)
    monkeypatch.setattr(peer_module, "time", types.SimpleNamespace(monotonic=lambda: now))

    def made() -> Peer:
        p = Peer([b"w1"], b"ours", b"theirs", recv_seq=6)
        for seq in range(1, 5):  # four envelopes sent, unacknowledged
            p.unacked.append((seq, now - sent_ago * seq, [b"x"], 1000 * seq, 10 * seq))
            p.inflight += 1000 * seq
            p.held += 10 * seq
        p.base_delay = 0.002
        p.last_cut = now - 10.0
        return p

    key = b"k" * 32
    lane_peer, acked_peer = made(), made()
    host = types.SimpleNamespace(peer=lane_peer, index=0, last_seen=0.0, awaiting=set(),
                                 inflight=set())
    ctl = types.SimpleNamespace(
        _relays=None, _hosts=types.SimpleNamespace(by_identity={b"w1": host}),
        max_message_bytes=1 << 30, _key=key, _session=b"ours",
        _uploads=types.SimpleNamespace(_blocked=False, _waiters=[]), _hangups=None,
        _ops=types.SimpleNamespace(pending={}, backlog=None))
    sessions = _Dispatched(ctl)
    lane = resultlane.ResultLane(sessions)  # type: ignore[arg-type]
    for i, ack in enumerate(acks):
        env = Envelope(int(P.Kind.RESULT), b"theirs", b"ours", 7 + i, [99, 0, 0, []], b"",
                       ack=ack)
        lane.on_frames([zmq.Frame(b"w1"), *(zmq.Frame(f) for f in encode(key, env))])
        acked_peer.acked(ack)
        acked_peer.recv_seq += 1
    assert sessions.handed == [("dispatch", 7 + i) for i in range(len(acks))]
    for slot in Peer.__slots__:
        assert getattr(lane_peer, slot) == getattr(acked_peer, slot), slot
