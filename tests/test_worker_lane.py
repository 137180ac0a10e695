"""The worker's lane (colobus._host.messages and outbound): what arrives is handled, refused and
counted, and what leaves is numbered, kept and sent, exactly as on the general path
(``COLOBUS_CALL_LANE=0``). The same sequences run both ways on real sockets and the
outcomes are compared."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from colobus._host import messages, outbound
from colobus._host.messages import MessagePath
from colobus._wire import envelope as E
from colobus._wire import protocol as P
from colobus._wire.channel import Channel, Peer
from colobus._wire.lane import fast_encode
from colobus._wire.protocol import Kind
from colobus._wire.sockio import recv_frames

KEY = b"w" * 32
WORKER, CONTROLLER = b"W" * 16, b"C" * 16


class _Store:
    def __init__(self, seen: list[Any]) -> None:
        self.seen = seen
        self.trees: dict[int, Any] = {}

    def release(self, refs: list[int], calls: list[int], code: Any = (), seq: int = 0) -> None:
        self.seen.append(("release", refs, calls, list(code), seq))


class _Sched:
    def drain_starts(self) -> None:
        pass

    def wait_briefly(self) -> bool:
        return False

    def drain_ends(self) -> None:
        pass


class _Path(MessagePath):
    """The message path alone, with handlers that record what they were given."""

    def __init__(self, chan: Channel, loop: asyncio.AbstractEventLoop) -> None:
        self.connect = "inproc://test"
        self.dropped = {}
        self._key = KEY
        self._hostname = "here"
        self._chan = chan
        self._peer = Peer([], WORKER, CONTROLLER)
        self._joined = True
        self._last_heard = 0.0
        self.seen: list[Any] = []
        self.store = _Store(self.seen)  # type: ignore[assignment]
        self.sched = _Sched()  # type: ignore[assignment]
        self.loop = loop
        self._handlers = {Kind.CALL: self._on_call, Kind.RELEASE: self._on_release,
                          Kind.CANCEL: self._on_cancel}
        self._lane_call = self._handlers[Kind.CALL]
        self._lane_release = self._handlers[Kind.RELEASE]

    def _on_call(self, body: P.Call, env: E.Envelope) -> None:
        self.seen.append(("call", body, env.kind, env.seq, bytes(env.payload),
                          [bytes(b) for b in env.buffers], env.pbufs))

    def _on_release(self, body: P.Release, env: E.Envelope) -> None:
        self.store.release(body.refs, body.calls, body.code, env.seq)

    def _on_cancel(self, body: P.Cancel, env: E.Envelope) -> None:
        self.seen.append(("cancel", body, env.kind, env.seq))


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any], asyncio.AbstractEventLoop]]:
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for s in (router, dealer):
        s.setsockopt(zmq.LINGER, 0)
    router.bind("inproc://worker-lane")
    dealer.connect("inproc://worker-lane")
    loop = asyncio.new_event_loop()
    try:
        yield router, dealer, loop
    finally:
        loop.close()
        router.close(0)
        dealer.close(0)
        ctx.term()


CALL = [7, 1, b"d" * 32, 0, "", [[0, 5]], [[0], [1], ["x"]], 1]
RELEASE = [[3 << 16], [2]]


def _batch(*entries: tuple[int, Any, bytes, tuple[bytes, ...], int]) -> Any:
    return E.batched(list(entries), CONTROLLER, WORKER)[0]


def _sequence() -> list[tuple[E.Envelope, int | None]]:
    """Envelopes from the controller, each with the sequence number it carries
    (None: the next one)."""
    mk = E.Envelope
    calls = [
        _batch((Kind.RELEASE, RELEASE, b"", (), 0), (Kind.CALL, CALL, b"args", (), 0)),
        mk(Kind.CALL, CONTROLLER, WORKER, 0, [8, *CALL[1:]], b"a2"),  # alone
        mk(Kind.RELEASE, CONTROLLER, WORKER, 0, [[1], [], [b"c" * 32]]),  # alone, 3 fields
        _batch((Kind.CALL, [9, 1, b"d", 0, "", [], [], True], b"", (), 0),  # a bool: parsed
               (Kind.CALL, [10, *CALL[1:]], b"xy", (b"buf1", b"buf2"), 1),
               (Kind.CANCEL, [9], b"", (), 0)),
        _batch((Kind.RELEASE, [[1], "no"], b"", (), 0),  # malformed: dropped, the rest runs
               (Kind.CALL, [11, *CALL[1:7]], b"", (), 0)),  # 7 fields: parsed
        _batch((Kind.CALL, [12, "s", *CALL[2:]], b"", (), 0),  # a bad field: dropped
               (Kind.RELEASE, [[4], [5]], b"p", (), 0)),  # a payload: the general path
        _batch((Kind.RELEASE, [[], [6]], b"", (), 0), (Kind.CALL, [13, *CALL[1:]], b"q", (), 0)),
    ]
    out: list[tuple[E.Envelope, int | None]] = [(env, None) for env in calls]
    out.insert(3, (mk(Kind.CALL, CONTROLLER, WORKER, 0, [20, *CALL[1:]]), 1))  # a replay
    out.insert(4, (mk(Kind.CALL, CONTROLLER, WORKER, 0, [21, *CALL[1:]]), 99))  # a gap
    return out


def _malformed_batches() -> list[E.Envelope]:
    good = _batch((Kind.RELEASE, RELEASE, b"", (), 0), (Kind.CALL, CALL, b"args", (), 0))
    out = []
    for body in ([], "x", [[11, RELEASE, 0, 0]], [[11, RELEASE, 0, 0, 0], b"\x01" * 5],
                 [[11, RELEASE, 0, 0, 0], [6, CALL, 5, 0, 0]],  # lengths past the payload
                 [[11, RELEASE, 0, 0, 0], [6, CALL, 3, 0, 0]],  # lengths short of it
                 [[11, RELEASE, 0, 0, 0], [17, CALL, 4, 0, 0]],  # a batch inside
                 [[11, RELEASE, 0, 0, 1], [6, CALL, 4, 0, 0]],  # pbufs over nbufs
                 [[11, RELEASE, 0, 0, 0], [6, CALL, 4, True, 0]]):  # a bool count
        out.append(E.Envelope(Kind.BATCH, CONTROLLER, WORKER, 0, body, good.payload))
    return out


def _run(lane: bool, pair: Any, monkeypatch: pytest.MonkeyPatch,
         envs: list[tuple[E.Envelope, int | None]]) -> tuple[Any, ...]:
    _router, dealer, loop = pair
    monkeypatch.setattr(messages, "ON", lane)
    monkeypatch.setattr(outbound, "ON", lane)
    chan = Channel(dealer, KEY, loop, lambda frames: None)
    path = _Path(chan, loop)
    peer = path._peer
    assert peer is not None
    seq = 0
    for env, carried in envs:
        if carried is None:
            seq += 1
        env.seq = seq if carried is None else carried
        path._on_frames([zmq.Frame(bytes(f)) for f in fast_encode(KEY, env)])
    loop.remove_reader(chan._fd)
    return path.seen, path.dropped, peer.recv_seq, peer.nack_due


@pytest.mark.parametrize("which", ["calls", "malformed"])
def test_what_arrives_is_handled_alike_both_ways(which: str, pair: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    envs = _sequence() if which == "calls" else [(e, None) for e in _malformed_batches()]
    lane = _run(True, pair, monkeypatch, envs)
    general = _run(False, pair, monkeypatch, envs)
    assert lane == general
    seen, dropped = lane[0], lane[1]
    if which == "calls":
        assert [s[1].call_id for s in seen if s[0] == "call"] == [7, 8, 9, 10, 11, 13]
        assert dropped == {"replay": 1, "gap": 1, "malformed": 2}
    else:
        assert seen == [] and dropped == {"malformed": len(envs)}


def _send_all(lane: bool, pair: Any, monkeypatch: pytest.MonkeyPatch,
              uncorks: list[int]) -> tuple[Any, ...]:
    """Results sent one per step; ``uncorks``: which left through Channel.uncork."""
    router, dealer, loop = pair
    monkeypatch.setattr(messages, "ON", lane)
    monkeypatch.setattr(outbound, "ON", lane)
    chan = Channel(dealer, KEY, loop, lambda frames: None, send_flags=zmq.NOBLOCK)
    general_uncork = chan.uncork
    current = [0]

    def uncork(corked: bool) -> None:
        uncorks.append(current[0])
        general_uncork(corked)

    chan.uncork = uncork  # type: ignore[method-assign]
    path = _Path(chan, loop)
    peer = path._peer
    assert peer is not None
    peer.recv_seq = 4
    big = bytes(range(256)) * 600
    sent: list[Any] = []
    sends: list[tuple[Any, ...]] = [
        (P.Result(1, 0, 1, [5, 6]),), (P.Result(2, 0, None), b"pay"),
        (P.Result(3, 0, 2), b"", [b"b1", memoryview(big)], 1),
        (P.Result(4, 0, list(range(40000))),),  # a body over the header's limit
        (P.Result(5, 0, 0), big * 20)]  # in parts
    for current[0], args in enumerate(sends, 1):
        corked = path.cork()
        path.send(*args)
        path.uncork(corked)
        loop.call_soon(loop.stop)
        loop.run_forever()  # the end of the step (the general path's)
        while router.poll(100):
            sent.append([bytes(f) for f in recv_frames(router)[1:]])
    # two sent in one corked step leave as one batch both ways
    corked = path.cork()
    path.send(P.Result(6, 0, 1))
    path.send_packed(Kind.RESULT, msgpack.packb([7, 0, 1, []]))
    current[0] = 6
    path.uncork(corked)
    while router.poll(100):
        sent.append([bytes(f) for f in recv_frames(router)[1:]])
    kept = [(seq, frames, n, d) for seq, _, frames, n, d in peer.unacked]
    loop.remove_reader(chan._fd)
    return sent, [(s, [bytes(f) for f in fr], n, d) for s, fr, n, d in kept], (
        peer.send_seq, peer.inflight, peer.held, peer.acked_sent, peer.outbox, len(peer.pending))


def test_what_leaves_is_the_same_bytes_both_ways(pair: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    lane_uncorks: list[int] = []
    general_uncorks: list[int] = []
    lane = _send_all(True, pair, monkeypatch, lane_uncorks)
    general = _send_all(False, pair, monkeypatch, general_uncorks)
    assert lane == general
    sent = lane[0]
    assert len(sent) >= 4 and lane[2][5] >= 1  # the large one: parts wait for the window
    assert general_uncorks == [1, 2, 3, 4, 5, 6]
    assert lane_uncorks == [4, 5, 6]  # the lane sent the first three itself
    first = E.decode(KEY, sent[0])
    assert (first.kind, first.seq, first.ack, first.body) == (Kind.RESULT, 1, 4, [1, 0, 1, [5, 6]])
    bodies = [E.decode(KEY, frames).body for frames in sent[:4]]  # sent whole
    assert bodies == [P.Result(1, 0, 1, [5, 6]).to_wire(), P.Result(2, 0, None).to_wire(),
                      P.Result(3, 0, 2).to_wire(), P.Result(4, 0, list(range(40000))).to_wire()]
