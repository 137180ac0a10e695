"""One relay process: carries the sessions of the hosts the controller moves to it.

Toward its hosts a relay is the controller: it binds a ROUTER, numbers,
authenticates (the controller's key: a relay shares its trust, see
``docs/security.md``) and acknowledges every host's messages, sends each
host the controller's heartbeats and resends what a host left unacknowledged,
and declares a host silent past the liveness timeout lost (when its connection,
kept open by ZeroMQ's heartbeats while its process runs, closed since it last
spoke: :mod:`colobus._wire.links`). Toward the
controller it is one peer on the controller's ROUTER: FORWARD messages carry
what many hosts are sent, UP messages what they sent back, equal replies of
one call coalesced (:mod:`colobus._wire.relaywire`).

A relay the controller starts reads its settings (and the key) from its standard
input and exits when that closes (:mod:`.process`): the controller holds the other
end, so it never outlives it. One that runs anywhere connects and offers itself
(:mod:`.connect`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from typing import Any

import zmq

from .._wire import protocol as P
from .._wire.channel import Channel, Peer
from .._wire.envelope import (
    PROTOCOL_VERSION,
    Dropped,
    Envelope,
    decode,
    pack_body,
    unpack_batch,
)
from .._wire.guard import RESET_SEQ
from .._wire.limits import MAX_HEADER_BYTES, MAX_OBJECTS, UNKNOWN_PEER_MAX_BYTES
from .._wire.links import Closes, PeerLinks, heartbeat_options, source_fd
from .._wire.relaywire import (
    RELAY_ONLY,
    SMALL,
    Adopt,
    Delivered,
    Gather,
    Gone,
    Ready,
)
from .._wire.sockio import router_socket
from .._wire.stalls import StallClock
from .fanout import forward
from .hold import HOLD_S, ReplyHold
from .inflow import HostsChannel
from .liveness import tick

__all__ = ["Relay", "advertised"]

log = logging.getLogger("colobus.relay")

DEAD_MAX = 4096
RESULT = int(P.Kind.RESULT)
CALL = int(P.Kind.CALL)
HEARTBEAT = int(P.Kind.HEARTBEAT)
DELIVERED = int(P.Kind.DELIVERED)
# Hosts' acknowledgements that freed this many bytes since the last report go up at
# once (an upload may wait for them); fewer ride with the next UP.
DELIVER_NOW = 1 << 18
DELIVER_EVERY_S = 0.5  # fewer ride with the first UP this long after the last report
# A host's heartbeat goes up when its figures other than memory, CPU time and the ping
# echo changed, or this long after the last that went up; the relay judges liveness.
HEALTH_EVERY_S = 5.0
# Heartbeats that go up wait for the next UP that goes anyway, or this long: an UP costs
# the controller's loop a wake-up and a decode however little it carries.
HEALTH_FLUSH_S = 0.5


class Relay:
    """The relay's two channels and the hosts it carries (all on its loop thread)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.key: bytes = cfg["key"]
        self.session: bytes = cfg["session"]
        self.ctl_session: bytes = cfg["ctl_session"]
        self.heartbeat = float(cfg["heartbeat"])
        self.liveness = float(cfg["liveness"])
        self.resend_after = float(cfg["resend_after"])
        self.times = bool(cfg.get("times", True))  # pass each host's call times up (traces)
        self.max_message = int(cfg["max_message_bytes"])
        self.cfg = cfg
        self.peers: dict[int, Peer] = {}  # host index -> its session, as the controller's
        self.by_identity: dict[bytes, int] = {}
        self.last_seen: dict[int, float] = {}
        self.arrived: set[int] = set()  # hosts heard from on this relay's socket
        # host -> when its last heartbeat went up, and that one's figures (_health_news)
        self.health_up: dict[int, tuple[float, list[Any]]] = {}
        self.dead: collections.OrderedDict[bytes, tuple[bytes, str]] = collections.OrderedDict()
        self.dropped: collections.Counter[str] = collections.Counter()
        self.ups = Gather()
        self.whole = 0  # hosts' envelopes a FORWARD sent whole at once (.fanout)
        self.sent_down = False  # .fanout sent on the hosts' socket since the last flush
        self.hold = ReplyHold()  # the replies of a call wait for its last one (.hold)
        self._hold_timer: asyncio.TimerHandle | None = None
        self._due = False  # self.ups holds more than heartbeats
        self._beat_timer: asyncio.TimerHandle | None = None
        self.ctl = Peer([], self.session, self.ctl_session)
        # Per host: the payload and buffer bytes FORWARDs gave it, of those what the last
        # DELIVERED said it acknowledged, and the hosts whose acknowledgements freed
        # some since (.relaywire.Delivered).
        self.given: dict[int, int] = {}
        self.reported: dict[int, int] = {}
        self.released: set[int] = set()
        self._acks: dict[int, int] = {}  # host -> its DELIVERED count, for the next UP
        self._acks_freed = 0  # bytes they freed since the last DELIVERED
        self._acks_at = 0.0  # when the last DELIVERED went up
        self.ctl_heard = time.monotonic()
        self._stalls = StallClock(self.heartbeat)  # liveness ticks that came late
        self._last_tick = time.monotonic()
        # The hosts' links, and ctl_heard when the controller's closed (colobus._wire.links)
        self.links = PeerLinks(self.last_seen)
        self._ctl_closed_at: float | None = None
        self.done: asyncio.Future[str] | None = None

    async def run(self, ctx: zmq.Context[Any] | None = None,
                  up: zmq.Socket[Any] | None = None) -> str:
        """Carry hosts until the session ends; returns why it ended.

        Args:
            ctx: the ZeroMQ context to use (None: one of its own, ended with it).
            up: a DEALER already joined to the controller (a relay that connected by
                itself: :mod:`.connect`); None: connect one and say READY (a relay the
                controller started, which also ends when its standard input closes).
        """
        loop = asyncio.get_running_loop()
        self.done = loop.create_future()
        own = ctx is None
        context: zmq.Context[Any] = zmq.Context() if ctx is None else ctx
        started = up is None
        if up is None:
            up = context.socket(zmq.DEALER)
            up.setsockopt(zmq.LINGER, 0)
            up.setsockopt(zmq.SNDHWM, 0)
            up.setsockopt(zmq.RCVHWM, 0)
            up.setsockopt(zmq.ROUTING_ID, self.cfg["identity"])
            heartbeat_options(up, self.heartbeat, self.liveness)
            up.connect(self.cfg["controller"])
        down = router_socket(context, self.max_message)
        heartbeat_options(down, self.heartbeat, self.liveness)
        down.bind(self.cfg["bind"])
        self.up = Channel(up, self.key, loop, self._from_controller, send_flags=zmq.NOBLOCK,
                          after_reads=self._flush_down)
        self.down = HostsChannel(down, self.key, loop, self._from_host,
                                 after_reads=self._flush_up, on_release=self._released)
        self.down.relay = self
        endpoint = down.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.cfg.get("advertise"):  # (on another machine than the controller's)
            endpoint = advertised(endpoint, self.cfg["advertise"])
        self.up.send(self.ctl, Ready(endpoint))
        if started:
            loop.add_reader(0, self._stdin)
        closes = [Closes(down, loop, self.links.closed), Closes(up, loop, self._ctl_closed)]
        ticks = loop.create_task(self._ticks())
        try:
            why = await self.done
            await asyncio.sleep(0.2)  # what the controller sent last (its SHUTDOWNs)
            self.up.drain()
            self.down.flush()
        finally:
            ticks.cancel()
            for c in closes:
                c.close()
            if started:
                loop.remove_reader(0)
            self.down.close(linger_ms=1000)
            self.up.close()
            if own:
                context.term()
        return why

    def end(self, why: str) -> None:
        """The session is over (``why``): :meth:`run` returns."""
        if self.done is not None and not self.done.done():
            self.done.set_result(why)

    def _stdin(self) -> None:
        try:
            data = os.read(0, 4096)
        except OSError:
            data = b""
        if not data:
            self.end("the controller closed its end")  # gone, or closing

    # -- from the controller -------------------------------------------------------------

    def _from_controller(self, frames: list[Any]) -> None:
        try:
            env = decode(self.key, frames)
            if env.sender != self.ctl_session or env.receiver != self.session:
                self.dropped["stale"] += 1
                return
            if env.kind == P.Kind.RESET and env.seq == RESET_SEQ:  # (outside the numbering)
                self.end("the controller ended this relay's session")
                return
            got = self.up.take(self.ctl, env, 1 << 62)
            if got is None or isinstance(got, str):
                return
            self.ctl_heard = time.monotonic()
            for sub in unpack_batch(got) if got.kind == P.Kind.BATCH else [got]:
                self._handle(sub)
        except Dropped as d:
            self.dropped[d.reason] += 1

    def _handle(self, env: Envelope) -> None:
        kind = env.kind
        if kind == P.Kind.FORWARD:
            forward(self, env.body, env.payload, env.buffers)  # (.fanout)
        elif kind == P.Kind.ADOPT:
            a = Adopt.from_wire(env.body)
            assert isinstance(a, Adopt)
            known = self.peers.get(a.host)
            if known is not None and known.their_session == a.session:
                # the worker's JOIN or HELLO, sent again before its WELCOME came, took a number
                known.recv_seq = max(known.recv_seq, a.recv_seq)
                return
            peer = Peer([a.identity], self.ctl_session, a.session, a.recv_seq, a.max_window)
            peer.send_seq = a.send_seq
            peer.max_part = a.max_part
            self.peers[a.host] = peer
            self.given[a.host] = self.reported[a.host] = 0
            self.by_identity[a.identity] = a.host
            self.last_seen[a.host] = time.monotonic()
        elif kind == P.Kind.SHUTDOWN:  # (a relay that connected by itself: the session ends)
            self.end("the controller closed")
        elif kind == P.Kind.GONE:
            g = Gone.from_wire(env.body)
            assert isinstance(g, Gone)
            gone = self._forget(g.host, g.why)
            if gone is None:  # it left here already: say the last word if it speaks
                return
            self._reset(gone.route[0], gone.their_session, g.why)

    def _flush_down(self) -> None:
        sent, self.sent_down = self.sent_down, False  # (what .fanout sent at once)
        if self.down.flush() or sent:
            # The FD is edge-triggered: a send can take the edge that announced a host's
            # message, so read what waits after sending (as a channel's own steps do).
            asyncio.get_running_loop().call_soon(self.down.drain)

    # -- from the hosts ------------------------------------------------------------------

    def _from_host(self, frames: list[Any]) -> None:
        if len(frames) < 2:
            self.dropped["malformed"] += 1
            return
        identity = frames[0].bytes
        h = self.by_identity.get(identity)
        limit = self.max_message if h is not None else UNKNOWN_PEER_MAX_BYTES
        try:
            env = decode(self.key, frames[1:], max_payload=limit, max_total=limit,
                         max_body=MAX_HEADER_BYTES, max_objects=MAX_OBJECTS)
        except Dropped as d:
            if h is not None and d.reason == "oversized":  # its worker stays under the limit
                self._lose(h, f"{d.detail:.200}", d.reason)
            else:
                self.dropped[d.reason] += 1
            return
        peer = self.peers.get(h) if h is not None else None
        if peer is None or env.sender != peer.their_session:
            dead = self.dead.get(env.sender)
            if dead is not None:  # a lost session's worker: told its last word
                self._reset(identity, env.sender, dead[1])
            self.dropped["stale" if dead is not None else "unknown_peer"] += 1
            return
        if env.receiver != self.ctl_session or env.version != PROTOCOL_VERSION:
            self.dropped["stale"] += 1
            return
        assert h is not None
        try:
            got = self.down.take(peer, env, self.max_message)
            if isinstance(got, str):
                self.dropped[got] += 1
                return
            self.last_seen[h] = time.monotonic()
            fd = source_fd(frames[0])
            if fd >= 0 and self.links.conn_fd.get(h) != fd:
                self.links.heard(h, fd)
            if h not in self.arrived:
                # Its first word here: what was sent before it connected (ROUTER_MANDATORY
                # refused it) goes again now, not after a resend timeout.
                self.arrived.add(h)
                if peer.undelivered:
                    peer.undelivered = False
                    self.down.resend_stale([peer], 0.0)
            if got is None:
                return
            subs = unpack_batch(got) if got.kind == P.Kind.BATCH else [got]
        except Dropped as d:  # a joined host broke the protocol: the controller drops it
            self._lose(h, f"{d.detail:.200}", d.reason)
            return
        add = self.ups.add
        hold = self.hold
        for sub in subs:
            if sub.kind in RELAY_ONLY:  # a relay's word from a host: its messages before
                # it go up, then the controller drops it (a violation, as it would)
                name = P.Kind(sub.kind).name
                self._lose(h, name, "unexpected_kind")
                return
            body = sub.body
            if sub.kind == HEARTBEAT:
                if not self._health_news(h, body):
                    continue
            else:
                self._due = True
            if sub.kind == RESULT and isinstance(body, list) and body and type(body[0]) is int:
                hold.answered(body[0])
            elif sub.kind != HEARTBEAT:
                hold.urgent = True
            if (sub.kind == RESULT and not sub.buffers and isinstance(body, list)
                    and len(body) >= 3 and memoryview(sub.payload).nbytes <= SMALL):
                # equal replies of one call travel once; each host's times beside them
                add(h, RESULT, pack_body(body[:3]), bytes(sub.payload), (), 0,
                    (body[3] if len(body) > 3 else []) if self.times else None)
            else:
                add(h, sub.kind, pack_body(body), sub.payload, sub.buffers, sub.pbufs,
                    alone=True)

    def _health_news(self, h: int, body: Any) -> bool:
        """Whether host ``h``'s heartbeat goes up: the controller reads figures from it,
        not liveness (the relay judges that), so one that changes only the memory, CPU
        time and ping echo waits until :data:`HEALTH_EVERY_S` after the last that went."""
        if not isinstance(body, list):
            return True  # malformed: the controller judges it
        now = time.monotonic()
        figures = body[:4] + body[8:9] + body[10:]  # the store, drops, threads, code
        last = self.health_up.get(h)
        if (last is not None and now - last[0] < HEALTH_EVERY_S and last[1] == figures
                and not (len(body) > 9 and body[9])):  # (call times always go)
            return False
        self.health_up[h] = (now, figures)
        return True

    def _released(self, peer: Peer) -> None:
        h = self.by_identity.get(peer.route[0])
        if h is not None:
            self.released.add(h)

    def _delivered(self) -> None:
        """What the hosts acknowledged, for an UP (one DELIVERED entry however many
        drains it gathers over): it goes now if that freed DELIVER_NOW bytes or more
        since the last (uploads may wait for them), else with the first UP that goes
        DELIVER_EVERY_S after the last (a call's arguments, a few bytes per host: a
        report per call would cost the controller a step per host and call)."""
        acks = self._acks
        freed = 0
        for h in self.released:
            peer = self.peers.get(h)
            if peer is not None:
                n = self.given.get(h, 0) - peer.held
                freed += n - self.reported.get(h, 0)
                self.reported[h] = acks[h] = n
        self.released.clear()
        self._acks_freed += freed
        if self._acks_freed >= DELIVER_NOW:
            self._due = True

    def _flush_up(self) -> None:
        """After the hosts' messages were read: say what they acknowledged, and send
        their messages up, unless they wait for the rest of their calls' replies
        (:mod:`.hold`)."""
        if self.released:
            self._delivered()
        if not self.ups and not self._acks:
            return
        if self.hold.holding:
            if self._hold_timer is None:
                self._hold_timer = asyncio.get_running_loop().call_later(HOLD_S, self._held)
            return
        if not self._due:  # heartbeats only: they go with the next UP, or soon
            if self._beat_timer is None:
                self._beat_timer = asyncio.get_running_loop().call_later(HEALTH_FLUSH_S,
                                                                         self._beats)
            return
        self._send_up()

    def _held(self) -> None:
        self._hold_timer = None
        left = self.hold.left(time.monotonic())
        if left > 0:  # its calls' replies still coming
            self._hold_timer = asyncio.get_running_loop().call_later(left, self._held)
        elif self.ups or self._acks:
            self._send_up()

    def _beats(self) -> None:
        self._beat_timer = None
        if (self.ups or self._acks) and self._hold_timer is None:
            self._send_up()

    def _send_up(self) -> None:
        for timer in (self._hold_timer, self._beat_timer):
            if timer is not None:
                timer.cancel()
        self._hold_timer = self._beat_timer = None
        self._due = False
        self.hold.sent()
        now = time.monotonic()
        if self._acks and (self._acks_freed >= DELIVER_NOW or not self.ups
                           or now - self._acks_at >= DELIVER_EVERY_S):
            counts: list[int] = []  # (Delivered: [host, bytes, ...])
            for h, n in self._acks.items():
                counts += (h, n)
            self._acks.clear()
            self._acks_freed, self._acks_at = 0, now
            self.ups.add_many([], DELIVERED, pack_body(Delivered(counts).to_wire()), b"", (), 0)
        self.ups.sort_shared()  # (the controller keys a group's mask on its host list)
        for body, payload, bufs in self.ups.take():  # each within the limits (.limits)
            self.up.send_packed(self.ctl, P.Kind.UP, pack_body(body), payload, bufs, 0)

    # -- liveness ------------------------------------------------------------------------

    def _ctl_closed(self, fd: int) -> None:
        self._ctl_closed_at = self.ctl_heard

    async def _ticks(self) -> None:
        self._stalls = StallClock(self.heartbeat)  # from now: the start was no stall
        self._last_tick = time.monotonic()
        while True:
            await asyncio.sleep(self.heartbeat)
            try:
                tick(self)
            except Exception:  # one bad turn never ends the relay's liveness
                log.exception("relay tick failed")

    def _lose(self, h: int, why: str, reason: str = "") -> None:
        if self._forget(h, P.RESET_REJOIN) is not None:
            if self.ups:  # what it answered before it was lost goes first (held replies)
                self._send_up()
            self.up.send(self.ctl, Gone(h, why, reason))

    def _forget(self, h: int, last_word: str) -> Peer | None:
        peer = self.peers.pop(h, None)
        if peer is None:
            return None
        self.by_identity.pop(peer.route[0], None)
        self.last_seen.pop(h, None)
        self.links.forget(h)
        self.health_up.pop(h, None)
        self.given.pop(h, None)
        self.reported.pop(h, None)
        self.released.discard(h)
        self._acks.pop(h, None)
        self.arrived.discard(h)
        self.dead[peer.their_session] = (peer.route[0], last_word)
        while len(self.dead) > DEAD_MAX:
            self.dead.popitem(last=False)
        return peer

    def _reset(self, identity: bytes, session: bytes, why: str) -> None:
        self.down.send_raw([identity], Envelope(P.Kind.RESET, self.ctl_session, session,
                                                RESET_SEQ, P.Reset(why).to_wire()))


def advertised(endpoint: str, host: str) -> str:
    """``endpoint`` as hosts on other machines reach it: a wildcard address bound
    (``tcp://0.0.0.0:PORT``, ``tcp://[::]:PORT``) becomes ``host``'s."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    bound, port = endpoint[6:].rsplit(":", 1)
    if bound not in ("0.0.0.0", "[::]", "*", "[::0]"):
        return endpoint
    return f"tcp://{'[' + host + ']' if ':' in host else host}:{port}"
