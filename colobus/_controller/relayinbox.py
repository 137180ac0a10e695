"""What comes up from the relays: their UPs (each entry under its own guard), GONE,
READY and heartbeats, handed to the controller's handlers as if the hosts had sent them.

:class:`Inbox` is the receiving half of :class:`colobus._controller.relays.Relays`.
Its trust rules (``docs/security.md``): a relay's own reports are only the entries that
name no host, bounded (:meth:`Relay.on_delivered`); an entry that names hosts is
theirs, checked as their direct message would be; one that breaks the protocol costs
the hosts it names and never the entries after it. A relay is bounded as a host is:
its reports name only the reasons relays have (``RELAY_REASONS``), in counts and sizes
it could have, and its entries only hosts it was given; one that goes beyond breaks
the protocol and is dropped (lost, with the hosts it carries), said once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgpack

from .._wire import protocol as P
from .._wire.chunks import ACK_KIND, CHUNKED_KIND, PART_KIND
from .._wire.envelope import Dropped, Envelope, unpack_batch, unpack_bounded
from .._wire.guard import RESET_SEQ
from .._wire.lane import decode
from .._wire.limits import COUNT_ABOVE
from .._wire.peer import Peer, data_bytes
from .._wire.relaywire import RELAY_ONLY, RELAY_REASONS, Gone, Ready, report_fault
from .coalesced import on_results
from .hosts import host_mask
from .relaylink import LinkOwner, Relay

if TYPE_CHECKING:
    from .._wire.guard import Challenges
    from .hangups import Hangups
    from .hosts import Host
    from .ops import Operations

__all__ = ["Inbox", "Judge", "RelaysOwner", "taken_in_order"]

log = logging.getLogger("colobus.controller")

MAX_ENDPOINT = 1024  # the characters of the endpoint a relay's READY gives
MAX_HOST_INDEX = 1 << 16  # above any host index (the controller knows at most 4096 names)
RESULT = int(P.Kind.RESULT)
DELIVERED = int(P.Kind.DELIVERED)
_NOT_WHOLE = frozenset((ACK_KIND, CHUNKED_KIND, PART_KIND))  # (Channel.take's other cases)
_INT = frozenset((int,))
unpack = msgpack.unpackb


class Judge(Protocol):
    """What :class:`Relays` uses of the controller's sessions."""

    dropped: collections.Counter[str]
    batches_received: int
    challenges: Challenges

    def drop(self, reason: str, identity: bytes, detail: str = "") -> None: ...
    def violation(self, host: Host, reason: str, detail: str = "") -> None: ...
    def lose(self, host: Host, why: str, last_word: str = ...) -> None: ...
    def handle(self, host: Host, identity: bytes, env: Envelope, body: P.Body) -> None: ...


class RelaysOwner(LinkOwner, Protocol):
    """What :class:`Relays` uses of the controller."""

    @property
    def _sessions(self) -> Judge: ...
    @property
    def _ops(self) -> Operations: ...
    @property
    def _key(self) -> bytes: ...
    @property
    def _address(self) -> str: ...
    @property
    def _bind(self) -> str: ...
    @property
    def _hangups(self) -> Hangups | None: ...
    @property
    def _resend_after(self) -> float: ...
    @property
    def heartbeat_interval(self) -> float: ...
    @property
    def liveness_timeout(self) -> float: ...
    @property
    def max_message_bytes(self) -> int: ...


def taken_in_order(peer: Peer, env: Envelope, on_release: Callable[[Peer], None] | None
                   ) -> bool:
    """:meth:`Channel.take`'s common case, in one call: ``env`` is ``peer``'s next
    message in sequence, whole (no buffers, no part of a larger one, not an ACK): taken
    (the acknowledgement it carries counted, the sequence moved on); False, nothing
    changed, for anything else (``Channel.take`` decides). A relay's UP and heartbeat
    are (``tests/test_relay_paths.py`` holds the two equal)."""
    if (env.seq != peer.recv_seq + 1 or env.buffers or peer.assembly is not None
            or env.kind in _NOT_WHOLE):
        return False
    unacked = peer.unacked
    if unacked and unacked[0][0] <= env.ack:
        held = peer.held
        peer.acked(env.ack)
        if peer.held < held and on_release is not None:
            on_release(peer)
    peer.recv_seq = env.seq
    return True


class Inbox:
    """The relays' messages in (the receiving half of ``Relays``)."""

    _ctl: RelaysOwner
    _ready: asyncio.Event | None

    def lost(self, relay: Relay, why: str) -> None:  # (Relays.lost)
        raise NotImplementedError

    def _broke(self, relay: Relay, reason: str, what: str) -> None:
        """``relay`` went beyond what a relay may say: counted, and dropped (lost, with
        the hosts it carries; said once: it is heard no more)."""
        self._ctl._sessions.dropped[reason] += 1
        self.lost(relay, f"it broke the protocol: {what}")

    # -- receiving -----------------------------------------------------------------------

    def on_frames(self, relay: Relay, frames: list[Any]) -> None:
        """A message from a relay: authenticate, then hosts' messages to their handlers."""
        ctl = self._ctl
        sessions = ctl._sessions
        try:
            env = decode(ctl._key, frames[1:])  # (the lane's: a relay speaks often)
            if env.sender != relay.session or env.receiver != ctl._session:
                sessions.drop("stale", relay.identity)
                return
            if not relay.alive:  # declared lost: its session is over, and it hears so once
                sessions.drop("stale", relay.identity)
                if not relay.reset_sent and ctl._chan is not None:
                    relay.reset_sent = True
                    ctl._chan.send_raw([relay.identity], Envelope(
                        P.Kind.RESET, ctl._session, relay.session, RESET_SEQ,
                        P.Reset("this relay was declared lost").to_wire()))
                return
            chan = ctl._chan
            assert chan is not None
            got: Envelope | str | None = env
            if not taken_in_order(relay.link, env, chan._on_release):
                got = chan.take(relay.link, env, 1 << 62)
            if got is None or isinstance(got, str):
                return
            relay.last_seen = time.monotonic()
            if ctl._hangups is not None:
                ctl._hangups.heard(relay, frames[0])  # (its link proves it alive)
            if got.kind == P.Kind.UP:  # (the common message: no batch, no dispatch)
                self._up(relay, got)
                return
            subs = unpack_batch(got) if got.kind == P.Kind.BATCH else [got]
        except Dropped as d:
            sessions.drop(d.reason, relay.identity, d.detail)
            return
        for sub in subs:
            if not relay.alive:  # dropped by what came before: the rest is not read
                return
            try:
                self._handle(relay, sub)
            except (Dropped, ValueError) as exc:
                sessions.drop("malformed", relay.identity, str(exc))

    def _handle(self, relay: Relay, env: Envelope) -> None:
        kind = env.kind
        if kind == P.Kind.UP:
            self._up(relay, env)
        elif kind == P.Kind.HEARTBEAT:  # what it dropped, counted as if dropped here
            beat = P.parse(kind, env.body)
            assert isinstance(beat, P.Heartbeat)
            fault = report_fault(beat.dropped)
            if fault:  # (the reasons are a fixed set: stats() and metrics labels stay so)
                self._broke(relay, "malformed", f"its heartbeat reported {fault}")
                return
            counts = self._ctl._sessions.dropped
            for reason, n in beat.dropped.items():
                if n > relay.dropped.get(reason, 0):
                    counts[reason] += n - relay.dropped.get(reason, 0)
                    relay.dropped[reason] = n
        elif kind == P.Kind.GONE:
            g = Gone.from_wire(env.body)
            assert isinstance(g, Gone)
            if g.reason and g.reason not in RELAY_REASONS:
                self._broke(relay, "malformed", f"it dropped host {g.host} for a reason relays "
                            f"do not have ({g.reason[:40]!r})")
                return
            host = self._carried(relay, g.host)
            if host is None:
                return
            if g.reason:
                self._ctl._sessions.violation(host, g.reason, g.why)
            else:
                self._ctl._sessions.lose(host, g.why[:500])
        elif kind == P.Kind.READY:
            r = Ready.from_wire(env.body)
            assert isinstance(r, Ready)
            if len(r.endpoint) > MAX_ENDPOINT:
                self._broke(relay, "malformed", f"an endpoint of {len(r.endpoint)} characters")
                return
            relay.endpoint = r.endpoint
            if self._ready is not None:
                self._ready.set()

    def _carried(self, relay: Relay, index: int) -> Host | None:
        hosts = self._ctl._hosts
        if not 0 <= index < len(hosts):
            return None
        host = hosts[index]
        return host if host.alive and host.peer.via is relay else None

    def _up(self, relay: Relay, env: Envelope) -> None:
        """The hosts' messages a relay passed on: each to its handler, as if direct. Each
        entry is handled under its own guard: one that is bad costs the hosts it names
        (or is counted, if it names none), never the entries after it."""
        sessions = self._ctl._sessions
        relay.ups += 1
        buffers = env.buffers
        payload = env.payload
        n = len(payload) if type(payload) is bytes else memoryview(payload).nbytes
        if buffers:
            relay.most_buffers = max(relay.most_buffers, len(buffers))
            n += data_bytes(b"", buffers)
        if n > relay.most_bytes:
            relay.most_bytes = n
        body = env.body
        if not isinstance(body, list):
            sessions.drop("malformed", relay.identity, "relay body")
            return
        if len(body) > 1:  # several hosts' messages, or several of one: a batch
            sessions.batches_received += 1
        view = memoryview(env.payload)
        for e in body:
            if not relay.alive:  # dropped by an entry before: the rest is not read
                return
            try:
                if (type(e) is list and len(e) == 9 and e[1] == DELIVERED and e[0] == []
                        and type(e[2]) is bytes and len(e[2]) <= COUNT_ABOVE):
                    # the relay's own report of what its hosts acknowledged (the common
                    # second entry of an UP; _entry's DELIVERED branch, inline)
                    raw = unpack(e[2], raw=False, use_list=True)
                    if type(raw) is list and len(raw) == 1 and type(raw[0]) is list:
                        self._delivered(relay, raw[0])
                        continue
                self._entry(relay, e, view, env.buffers)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException:  # as Sessions.handle: a handler's bug must not end the UP
                sessions.dropped["handler_error"] += 1
                log.exception("error handling an entry relayed by relay %d", relay.index)

    def _entry(self, relay: Relay, e: Any, view: memoryview, buffers: list[Any]) -> None:
        """One entry of an UP: the relay's own report (it names no host), or the message
        its hosts sent, to the handler of its kind."""
        sessions = self._ctl._sessions
        try:
            # (relaywire.entry, inline: its checks, in C where they can be)
            if not (type(e) is list and len(e) == 9 and type(e[0]) is list
                    and type(e[1]) is int and type(e[2]) is bytes
                    and set(map(type, e[3:8])) <= _INT
                    and (e[8] is None or (type(e[8]) is list and len(e[8]) == len(e[0])))
                    and set(map(type, e[0])) <= _INT):
                raise Dropped("malformed", "relay entry")
            hosts, kind, packed, at, plen, boff, nbufs, pbufs, extras = e
            if (at < 0 or plen < 0 or at + plen > len(view) or boff < 0 or nbufs < 0
                    or boff + nbufs > len(buffers) or not 0 <= pbufs <= nbufs):
                raise Dropped("malformed", "relay entry lengths")
            # each a host it was given (a mask, in C): else the relay is dropped, unparsed
            if hosts and (min(hosts) < 0 or max(hosts) >= MAX_HOST_INDEX or (
                    1 << hosts[0] if len(hosts) == 1 else host_mask(tuple(hosts)))
                    & ~relay.ever_mask):
                self._stranger(relay, hosts)
                return
            # a small body makes few objects: no count of them needed (as decode's header)
            raw = (unpack(packed, raw=False, use_list=True) if len(packed) <= COUNT_ABOVE
                   else unpack_bounded(packed))
        except Exception as exc:  # (msgpack's errors, too) the relay packs every entry
            named = e[0] if isinstance(e, list) and e and isinstance(e[0], list) else []
            self._broken(relay, named, "malformed", f"relay entry: {exc}")
            return
        if kind in RELAY_ONLY:
            if kind == P.Kind.DELIVERED and not hosts:  # what the relay's hosts acknowledged
                if not (type(raw) is list and len(raw) == 1 and type(raw[0]) is list):
                    sessions.drop("malformed", relay.identity, "DELIVERED")
                    return
                self._delivered(relay, raw[0])  # (Delivered.from_wire, inline)
                return
            # a host's message of a kind only a relay speaks (its relay should have
            # dropped the host): never taken as the relay's own
            self._broken(relay, hosts, "unexpected_kind", P.Kind(kind).name)
            return
        if not hosts:
            sessions.drop("malformed", relay.identity, f"relay entry of kind {kind} for no host")
            return
        payload = view[at:at + plen] if plen else b""
        bufs = buffers[boff:boff + nbufs] if nbufs else []
        sub = Envelope(kind, b"", self._ctl._session, 0, raw, payload, bufs, pbufs)
        try:
            body = P.Result.from_wire(raw) if kind == RESULT else P.parse(kind, raw)
        except ValueError as exc:
            self._broken(relay, hosts, "malformed", str(exc))
            return
        relay.carried_up += len(hosts)
        if kind == P.Kind.RESULT and isinstance(body, P.Result):
            # one entry for many hosts: settled as a group (.coalesced)
            on_results(self._ctl._ops, relay, hosts, body, sub, extras)
            return
        now = time.monotonic()
        for j, i in enumerate(hosts):
            host = self._carried(relay, i)
            if host is None:
                continue
            host.last_seen = now
            b = body
            if extras is not None and isinstance(body, P.Result):
                times = extras[j]
                b = P.Result(body.call_id, body.status, body.meta,
                             times if isinstance(times, list) else [])
            sessions.handle(host, relay.identity, sub, b)

    def _stranger(self, relay: Relay, hosts: list[int]) -> None:
        """An entry of ``relay``'s names a host it was never given: it breaks the protocol
        (the relay is dropped), before anything of the entry is parsed. (An entry for a
        host it carried and lost meanwhile, which it had not heard yet, is read as
        before: each handler skips a host its relay no longer carries.)"""
        named = next((i for i in hosts if not (0 <= i < MAX_HOST_INDEX
                                               and relay.ever_mask >> i & 1)), hosts[0])
        self._broke(relay, "unsolicited",
                    f"an entry for host {named}, which it was never given")

    def _delivered(self, relay: Relay, counts: list[Any]) -> None:
        """A relay's DELIVERED: at most one count for each host it was ever given."""
        if len(counts) > 2 * max(relay.ever_mask.bit_count(), 1):
            self._broke(relay, "malformed", f"a DELIVERED of {len(counts) // 2} hosts' counts, "
                        f"more than the {relay.ever_mask.bit_count()} it was given")
            return
        relay.on_delivered(counts)

    def _broken(self, relay: Relay, hosts: list[Any], reason: str, detail: str) -> None:
        """An entry of an UP that breaks the protocol: each host it names that ``relay``
        carries is dropped (its message is lost: its calls fail, they do not hang); one
        that names none is counted."""
        sessions = self._ctl._sessions
        carried = [h for i in hosts if type(i) is int
                   and (h := self._carried(relay, i)) is not None]
        if not carried:
            sessions.drop(reason, relay.identity, detail)
        for host in carried:
            sessions.violation(host, reason, detail)
