"""A relay's fast paths and their general twins give the same bytes and the same state.

The relay sends a FORWARD's messages to each host as one envelope without a Python
step per host (``colobus/_relay/fanout.py``), reads its hosts' common replies inline
(``colobus/_relay/inflow.py``) and gathers them with ``Gather.reply``. Each has a
general twin: ``Channel.enqueue_packed`` and ``flush``, ``Channel.drain`` with
``Relay._from_host``, ``Gather.add``. Here two relays with the same state, on real
sockets (inproc), one taking the fast path and one the general, get the same input;
the hosts must receive the same frames, and the relays must end in the same state
with the same UP to send.
"""

from __future__ import annotations

import asyncio
import random
import secrets
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from colobus._relay.fanout import call_id_of, forward
from colobus._relay.inflow import HostsChannel
from colobus._relay.relay import Relay
from colobus._wire import protocol as P
from colobus._wire.channel import Channel
from colobus._wire.envelope import Envelope, decode, encode, pack_body
from colobus._wire.relaywire import Adopt, Gather, entries
from colobus._wire.sockio import router_socket

KEY = secrets.token_bytes(32)
CTL = secrets.token_bytes(16)
HOSTS = 6


class Side:
    """One relay (fast or general) with HOSTS hosts on DEALERs, all on inproc sockets."""

    def __init__(self, ctx: zmq.Context[Any], loop: asyncio.AbstractEventLoop, fast: bool,
                 sessions: list[bytes]) -> None:
        cfg = {"key": KEY, "session": secrets.token_bytes(16), "ctl_session": CTL,
               "heartbeat": 1.0, "liveness": 10.0, "resend_after": 3.0,
               "max_message_bytes": 1 << 26, "times": True}
        self.relay = r = Relay(cfg)
        sock = router_socket(ctx, 1 << 26)
        where = f"inproc://relay-paths-{secrets.token_hex(8)}"
        sock.bind(where)
        cls = HostsChannel if fast else Channel
        r.down = cls(sock, KEY, loop, r._from_host, after_reads=lambda: None,
                     on_release=r._released)
        if isinstance(r.down, HostsChannel):
            r.down.relay = r
        self.hosts: list[zmq.Socket[Any]] = []
        for h in range(HOSTS):
            identity = b"w%d" % h
            r._handle(Envelope(P.Kind.ADOPT, CTL, cfg["session"], 0, Adopt(
                h, identity, sessions[h], 1, 0, 1 << 24, 1 << 22).to_wire()))
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.ROUTING_ID, identity)
            s.connect(where)
            self.hosts.append(s)
        self.seq = [0] * HOSTS
        self.ack = [0] * HOSTS

    def send(self, h: int, kind: int, body: Any, payload: bytes = b"", *,
             seq: int | None = None, buffers: list[bytes] | None = None) -> None:
        """Host ``h`` sends one message (numbered next unless ``seq``)."""
        if seq is None:
            self.seq[h] += 1
            seq = self.seq[h]
        env = Envelope(kind, self.relay.peers[h].their_session if h in self.relay.peers
                       else b"x" * 16, CTL, seq, body, payload, list(buffers or []),
                       ack=self.ack[h])
        self.hosts[h].send_multipart([bytes(f) for f in encode(KEY, env)])

    def received(self, h: int) -> list[list[bytes]]:
        """The messages host ``h`` got since last asked (raw frames)."""
        out = []
        s = self.hosts[h]
        while s.poll(20):
            frames = s.recv_multipart()
            out.append(frames)
            env = decode(KEY, frames)
            self.ack[h] = max(self.ack[h], env.seq)
        return out

    def close(self) -> None:
        for s in self.hosts:
            s.close()
        self.relay.down.close()


@pytest.fixture
def sides(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Side, Side]]:
    # a window sized by how late acknowledgements come would differ between the two
    # sides on a loaded machine (and with it what travels in parts): it only grows here
    monkeypatch.setattr("colobus._wire.peer.TARGET_DELAY_S", 1e9)
    ctx: zmq.Context[Any] = zmq.Context()
    loop = asyncio.new_event_loop()
    sessions = [secrets.token_bytes(16) for _ in range(HOSTS)]
    fast, general = Side(ctx, loop, True, sessions), Side(ctx, loop, False, sessions)
    try:
        for side in (fast, general):  # every host says its first word: it arrived
            for h in range(HOSTS):
                side.send(h, P.Kind.ACK, [], seq=0)
        _drain(fast, general)
        yield fast, general
    finally:
        fast.close()
        general.close()
        loop.close()
        ctx.term()


def _drain(*sides: Side) -> None:
    for side in sides:
        sock = side.relay.down.sock
        while sock.poll(20):
            side.relay.down.drain()


def _general_forward(r: Relay, body: Any, payload: Any, buffers: list[Any]) -> None:
    """The general path a FORWARD took before ``fanout.forward``: each host's copy of
    each message through ``Channel.enqueue_packed``, then a flush."""
    for (hosts, kind, packed, pay, bufs, pbufs, _), e in zip(
            entries(body, payload, buffers), body, strict=True):
        sent = 0
        for j, h in enumerate(hosts):
            peer = r.peers.get(h)
            if peer is not None:  # (an entry's ends: each host's body is its and then that)
                own = packed + e[8][j] if e[8] is not None else packed
                r.down.enqueue_packed(peer, kind, own, pay, bufs, pbufs)
                sent += 1
                r.given[h] += len(pay) + sum(len(b) for b in bufs)
        if kind == P.Kind.CALL and sent:
            cid = call_id_of(packed)
            assert cid is not None
            r.hold.forwarded(cid, sent)
    r.down.flush()


def _state(r: Relay) -> Any:
    peers = {h: (p.send_seq, p.recv_seq, p.held, p.inflight, len(p.unacked),
                 [u[2] for u in p.unacked], p.acked_sent, p.undelivered, p.window,
                 p.backoff, p.max_window)
             for h, p in r.peers.items()}
    return peers, dict(r.given), sorted(r.released), dict(r.hold._expect and {
        c: e[0] for c, e in r.hold._expect.items()}), r._due


def _forward_body(rng: random.Random, call_id: int) -> tuple[Any, bytes, list[Any]]:
    """A FORWARD as a controller's gather makes it: frees for all, a CALL per host (its
    own mesh), sometimes a shared payload or a large one, sometimes a host left out."""
    g = Gather()
    hosts = [h for h in range(HOSTS) if rng.random() > 0.15] or [0]
    if rng.random() < 0.7:
        g.add_many(hosts, int(P.Kind.RELEASE), pack_body([[call_id - 1], []]), b"", (), 0)
    payload = rng.choice([b"", b"args" * rng.randint(1, 50), bytes(300_000)])
    bufs = [b"buf" * rng.randint(1, 9)] if rng.random() < 0.2 else []
    if rng.random() < 0.5:  # each host's CALL as one entry, its own mesh at the end
        head = pack_body([call_id, 0, b"d" * 16, 0, "", []])[1:]
        head = bytes((0x98,)) + head
        tails = [pack_body([[h], [1], ["x"]]) + pack_body(HOSTS) for h in hosts]
        g.add_spliced(hosts, int(P.Kind.CALL), head, tails, payload, bufs, len(bufs))
        [(body, pay, out_bufs)] = g.take()
        return body, pay, out_bufs
    for h in hosts:
        if rng.random() < 0.1:  # a host with a message of its own first: another shape
            g.add(h, int(P.Kind.CANCEL), pack_body([call_id - 2]), b"", (), 0)
        call = pack_body([call_id, 0, b"d" * 16, 0, "", [], [[h] * rng.randint(1, 3), [1],
                                                            ["x"]], HOSTS])
        g.add(h, int(P.Kind.CALL), call, payload, bufs, len(bufs))
    [(body, pay, bufs)] = g.take()
    return body, pay, bufs


def test_call_ids_read_from_the_packed_body() -> None:
    for cid in (0, 1, 127, 128, 255, 256, 65535, 65536, 1 << 32, (1 << 64) - 1):
        assert call_id_of(pack_body([cid, 0, b"x"])) == cid
    assert call_id_of(pack_body({"a": 1})) is None
    assert call_id_of(pack_body([-1, 2])) is None
    assert call_id_of(b"\x92") is None


def test_forward_sends_what_the_general_path_sends(sides: tuple[Side, Side]) -> None:
    fast, general = sides
    rng = random.Random(7)
    for round_ in range(30):
        if round_ == 5:  # something waits in one host's outbox: it goes first, in order
            for side in (fast, general):
                side.relay.down.enqueue(side.relay.peers[2], P.Heartbeat(0, 0, 0, 0, 9))
        body, payload, bufs = _forward_body(rng, 100 + round_)
        forward(fast.relay, body, payload, bufs)
        fast.relay.down.flush()
        _general_forward(general.relay, body, payload, bufs)
        for h in range(HOSTS):
            assert fast.received(h) == general.received(h), (round_, h)
        assert _state(fast.relay) == _state(general.relay)
        for side in (fast, general):  # what they got is acknowledged: room in the window
            for h in range(HOSTS):
                side.send(h, P.Kind.ACK, [], seq=0)
        _drain(fast, general)
    assert fast.relay.whole > 25 and general.relay.whole == 0  # the fast path ran


def test_replies_taken_inline_as_the_general_path_takes_them(
        sides: tuple[Side, Side]) -> None:
    fast, general = sides
    rng = random.Random(11)
    for round_ in range(10):
        body, payload, bufs = _forward_body(rng, 200 + round_)
        for side in (fast, general):
            _general_forward(side.relay, body, payload, bufs)
            for h in range(HOSTS):
                side.received(h)  # (their acks follow)
        for h in range(HOSTS):
            outs = rng.choice([b"", b"\x81\xa1v\x01", b"o" * 5000])  # the last too big inline
            what = rng.random()
            for side in (fast, general):
                if what < 0.6:
                    side.send(h, P.Kind.RESULT, [200 + round_, 0, 0, [h, 2 * h]], outs)
                elif what < 0.7:  # a gap: refused, the host asked to resend
                    side.send(h, P.Kind.RESULT, [200 + round_, 0, 0, []],
                              seq=side.seq[h] + 2)
                elif what < 0.8:  # a replay of an old number
                    side.send(h, P.Kind.RESULT, [200 + round_, 0, 0, []], seq=1)
                elif what < 0.9:  # a heartbeat
                    side.send(h, P.Kind.HEARTBEAT, [0, 0, 0, 0, 0, 0, 0, 0, {}])
                else:  # a reply with a buffer
                    side.send(h, P.Kind.RESULT, [200 + round_, 0, 1, []], outs,
                              buffers=[b"b" * 10])
        _drain(fast, general)
        assert _state(fast.relay) == _state(general.relay), round_
        assert fast.relay.ups.take() == general.relay.ups.take(), round_
        assert fast.relay.dropped == general.relay.dropped
    assert isinstance(fast.relay.down, HostsChannel) and fast.relay.down.inline > 20


def test_gather_reply_is_add() -> None:
    rng = random.Random(3)
    for _ in range(200):
        a = Gather(max_bytes=rng.choice([64, 1 << 24]), max_body=rng.choice([200, 1 << 20]))
        b = Gather(max_bytes=a.max_bytes, max_body=a.max_body)
        for _ in range(rng.randint(1, 40)):
            h = rng.randrange(5)
            body = pack_body([rng.randrange(3), 0, rng.randrange(2)])
            payload = rng.choice([b"", b"p1", b"p2" * 20])
            extra = rng.choice([None, [h, 1]])
            if rng.random() < 0.2:
                other = rng.choice([b"", b"x" * 50])
                a.add(h, 4, b"\x90", other, (), 0, alone=True)
                b.add(h, 4, b"\x90", other, (), 0, alone=True)
            a.add(h, 7, body, payload, (), 0, extra)
            b.reply(h, 7, body, payload, extra)
        assert a.take() == b.take()


def test_taken_in_order_is_channel_take() -> None:
    """The controller takes a relay's next message in one call (``taken_in_order``) or
    through ``Channel.take``: the same peer state and the same message either way."""
    from colobus._controller.relayinbox import taken_in_order
    from colobus._wire.peer import Peer

    ctx: zmq.Context[Any] = zmq.Context()
    loop = asyncio.new_event_loop()
    socks = []
    try:
        chans, peers, released = [], [], [[], []]
        for side in range(2):
            sock = router_socket(ctx, 1 << 24)
            socks.append(sock)
            chans.append(Channel(sock, KEY, loop, lambda frames: None,
                                 on_release=released[side].append))
            peer = Peer([b"r"], CTL, b"s" * 16)
            for seq in range(1, 6):  # what the controller sent the relay, unacknowledged
                peer.send_seq = seq
                peer.unacked.append((seq, 0.0, [b"f"], 10, 4))
            peer.inflight, peer.held = 50, 20
            peers.append(peer)
        rng = random.Random(5)
        seq = 0
        for _ in range(300):
            kind = rng.choice([P.Kind.UP, P.Kind.UP, P.Kind.HEARTBEAT, P.Kind.ACK,
                               P.Kind.CHUNKED])
            step = rng.choice([1, 1, 1, 0, 2, -3])
            env_seq = 0 if kind == P.Kind.ACK else max(1, seq + step)
            if env_seq == seq + 1:
                seq = env_seq
            ack = rng.randrange(0, 7)
            bufs = [b"x"] if rng.random() < 0.1 else []
            for side in range(2):
                env = Envelope(int(kind), b"s" * 16, CTL, env_seq, [], b"", list(bufs), ack=ack)
                if side == 0:
                    try:
                        got: Any = chans[0].take(peers[0], env, 1 << 20)
                    except Exception as exc:
                        got = type(exc)
                else:
                    if taken_in_order(peers[1], env, chans[1]._on_release):
                        got = env
                    else:
                        try:
                            got = chans[1].take(peers[1], env, 1 << 20)
                        except Exception as exc:
                            got = type(exc)
                if side == 0:
                    first = got
            assert (first is None) == (got is None) and type(first) is type(got)
            a, b = peers
            assert (a.recv_seq, a.held, a.inflight, len(a.unacked), a.window, a.nacked) == (
                b.recv_seq, b.held, b.inflight, len(b.unacked), b.window, b.nacked)
            assert len(released[0]) == len(released[1])
        assert peers[1].recv_seq > 100
    finally:
        for c in chans:
            c.close()
        loop.close()
        ctx.term()
