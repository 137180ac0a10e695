"""The controller's relays: processes on its machine that carry hosts' sessions for it.

With many hosts the controller's loop spends most of its time on per-host
envelopes: numbering, MACs, sends and acknowledgements, one of each per host
per call. A relay (:mod:`colobus._relay.relay`) takes that over for the hosts
it carries: a host that joins is told in its WELCOME to move its session to a
relay, the relay adopts the session's numbering, and from then on the
controller sends a relay one FORWARD for all its hosts in a loop step and
gets one UP back per relay drain, equal replies coalesced.

A relay shares the controller's trust (its key, over a pipe). A relay that is
lost takes its hosts with it: exactly their operations fail with
``HostLostError``, and their workers join again (directly, or through another
relay) as the next generation of their host.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import logging
import os
import secrets
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgpack
import zmq

from .._wire import protocol as P
from .._wire.chunks import ACK_KIND, CHUNKED_KIND, PART_KIND
from .._wire.envelope import Dropped, Envelope, unpack_batch, unpack_bounded
from .._wire.guard import RESET_SEQ
from .._wire.lane import decode
from .._wire.limits import COUNT_ABOVE
from .._wire.peer import Peer, data_bytes
from .._wire.relaywire import (
    RELAY_ONLY,
    Adopt,
    Gone,
    Offer,
    Ready,
    Setup,
    relay_proof,
)
from .._wire.sockio import send_frames
from .._wire.versions import compare, local_versions
from .coalesced import on_results
from .relaylink import LinkOwner, Relay

if TYPE_CHECKING:
    from .._wire.guard import Challenges
    from .hosts import Host
    from .ops import Operations

__all__ = ["Relay", "Relays", "relay_count"]

log = logging.getLogger("colobus.controller")

READY_TIMEOUT_S = 60.0
RESULT = int(P.Kind.RESULT)
_NOT_WHOLE = frozenset((ACK_KIND, CHUNKED_KIND, PART_KIND))  # (Channel.take's other cases)
DELIVERED = int(P.Kind.DELIVERED)
_INT = frozenset((int,))
unpack = msgpack.unpackb
HOSTS_PER_RELAY = 256  # relays= None: one relay per this many hosts (cores allowing)
PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The relay imports only colobus._wire (not colobus/__init__, which imports JAX).
BOOT = ("import sys, types; m = types.ModuleType('colobus'); m.__path__ = [sys.argv[1]]; "
        "sys.modules['colobus'] = m; from colobus._relay.relay import main; sys.exit(main())")


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
    def _resend_after(self) -> float: ...
    @property
    def heartbeat_interval(self) -> float: ...
    @property
    def liveness_timeout(self) -> float: ...
    @property
    def max_message_bytes(self) -> int: ...


NO_RELAYS = ("this controller takes no relays that connect by themselves: start it with "
             "relay_key= (a launcher's relays_on_hosts= does)")


def refuse(ctl: Any, identity: bytes, env: Envelope, why: str) -> None:
    """Tell a relay that offered itself (``env``) why it is refused (as Sessions does a
    worker: a REJECT outside the numbering); it exits."""
    chan = ctl._chan
    if chan is not None:
        chan.send_raw([identity], Envelope(P.Kind.REJECT, ctl._session, env.sender, 1,
                                           P.Reject(why).to_wire()))


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


def relay_count(relays: int | None, threshold: int, hosts: int) -> int:
    """How many relays a controller starts: ``relays``, or ``$COLOBUS_RELAYS``, or by the
    cluster's size: none below ``threshold`` hosts, else one per 256 hosts, at most one
    per core but one."""
    if relays is None and os.environ.get("COLOBUS_RELAYS", "").strip():
        relays = int(os.environ["COLOBUS_RELAYS"])
    if relays is not None:
        if relays < 0:
            raise ValueError(f"relays must be >= 0, got {relays}")
        return relays
    if threshold <= 0 or hosts < threshold:
        return 0
    cores = os.cpu_count() or 2
    return max(1, min(-(-hosts // HOSTS_PER_RELAY), cores - 1))


class Relays:
    """The controller's relays: started with it, each carrying the hosts it adopted."""

    def __init__(self, ctl: RelaysOwner, count: int, relay_key: bytes | None = None) -> None:
        self._ctl = ctl
        self.count = count
        self.relay_key = relay_key  # relays that connect by themselves prove it (None: none)
        self.relays: list[Relay] = []
        self.by_identity: dict[bytes, Relay] = {}
        self._ready: asyncio.Event | None = None

    @classmethod
    def configure(cls, ctl: Any, relays: int | None, threshold: int, hosts: int,
                  relay_key: bytes | None = None) -> Relays | None:
        """The relays a new controller will start, and whether it takes relays that
        connect by themselves (None: neither, it runs a star).

        Raises:
            ValueError: ``relays`` below 0, or relays asked for with CurveZMQ on.
        """
        count = relay_count(relays, threshold, hosts)
        if (count or relay_key is not None) and ctl._curve is not None:
            if relays or relay_key is not None:
                raise ValueError("relays do not work with CurveZMQ yet: pass relays=0 and "
                                 "no relay_key")
            log.info("CurveZMQ is on: no relays (%d hosts go directly)", hosts)
            return None
        return cls(ctl, count, relay_key) if count or relay_key is not None else None

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Start the relays and wait until each is READY.

        Raises:
            OSError: a relay did not start (its output says why).
        """
        self._ready = asyncio.Event()
        for i in range(self.count):
            self._spawn(i)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not all(r.endpoint for r in self.relays if r.proc is not None):
            dead = [(r.index, r.proc.poll()) for r in self.relays
                    if r.proc is not None and r.proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = (f"relay {dead[0][0]} exited with status {dead[0][1]}"
                       if dead else f"no relay READY within {READY_TIMEOUT_S:.0f} s")
                raise OSError(f"colobus controller cannot start its relays: {why}")
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), 0.5)
            except TimeoutError:
                pass
        if self.relays:
            log.info("%d relays ready: %s", len(self.relays),
                     ", ".join(r.endpoint for r in self.relays))

    async def wait_ready(self, n: int, timeout: float) -> None:
        """Wait until ``n`` relays are live and ready (relays that connect by themselves:
        a launcher starts its hosts' workers once their relays are there).

        Raises:
            TimeoutError: fewer were ready within ``timeout`` seconds.
        """
        if self._ready is None:
            self._ready = asyncio.Event()
        deadline = time.monotonic() + timeout
        while sum(1 for r in self.relays if r.alive and r.endpoint) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                ready = sum(1 for r in self.relays if r.alive and r.endpoint)
                raise TimeoutError(f"only {ready} of {n} relays connected to "
                                   f"{self._ctl._address} within {timeout:g} s")
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), min(left, 0.5))
            except TimeoutError:
                pass

    def _spawn(self, i: int) -> None:
        ctl = self._ctl
        identity, session = b"r" + secrets.token_bytes(16), secrets.token_bytes(16)
        address = ctl._address.replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//[::1]:")
        bind = ctl._address
        if bind.startswith("tcp://"):
            bind = bind.rsplit(":", 1)[0] + ":*"
        else:
            bind = f"{bind}.relay{i}"
        settings = {
            "key": ctl._key, "session": session, "ctl_session": ctl._session,
            "identity": identity, "controller": address, "bind": bind,
            "heartbeat": ctl.heartbeat_interval, "liveness": ctl.liveness_timeout,
            "resend_after": ctl._resend_after, "max_message_bytes": ctl.max_message_bytes,
            "times": ctl.observer is not None and ctl.observer.records,  # (traces read them)
        }
        data = msgpack.packb(settings)
        proc = subprocess.Popen([sys.executable, "-P", "-c", BOOT, PACKAGE], stdin=subprocess.PIPE,
                                close_fds=True)
        assert proc.stdin is not None
        proc.stdin.write(struct.pack("!I", len(data)) + data)  # the key: never argv or env
        proc.stdin.flush()
        relay = Relay(i, ctl, proc, identity, session)
        self.relays.append(relay)
        self.by_identity[identity] = relay

    async def aclose(self) -> None:
        """Let every relay deliver what it was sent last, then end it (one that connected
        by itself ends its session: it offers itself to the next controller)."""
        chan = self._ctl._chan
        for r in self.relays:
            if r.proc is None:
                if r.alive and chan is not None and chan.open:
                    chan.send(r.link, P.Shutdown("controller closed"))
                    chan.flush()
                continue
            if r.proc.stdin is not None and not r.proc.stdin.closed:
                try:
                    r.proc.stdin.close()  # its cue to flush and exit
                except OSError:
                    pass
        procs = [r.proc for r in self.relays if r.proc is not None]
        deadline = time.monotonic() + 3.0
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for r in self.relays:
            if r.proc is None:
                continue
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()
            if r.endpoint.startswith("ipc://"):  # a relay that was killed leaves its socket file
                with contextlib.suppress(OSError):
                    os.unlink(r.endpoint[6:])

    def on_offer(self, identity: bytes, env: Envelope) -> None:
        """A relay that connected by itself offers to carry hosts (after a CHALLENGE):
        taken if it proves the relay key and runs this Python and colobus; SETUP tells
        it how to carry them, and its READY makes it one of the relays hosts go to.

        Raises:
            ValueError: a malformed offer (counted by the caller).
        """
        ctl = self._ctl
        sessions = ctl._sessions
        offer = Offer.from_wire(env.body)
        assert isinstance(offer, Offer)
        if not sessions.challenges.take(identity, env.sender, offer.nonce):
            sessions.drop("replay", identity, "relay offer without a fresh challenge")
            return
        if identity in self.by_identity or len(env.sender) != 16:
            sessions.drop("malformed", identity, "relay offer")
            return
        why = None
        if self.relay_key is None:
            why = NO_RELAYS
        elif not hmac.compare_digest(offer.proof, relay_proof(self.relay_key, offer.nonce,
                                                               env.sender)):
            sessions.drop("unauthenticated", identity, "relay offer")
            why = "the relay key is not this controller's (--relay-key-file)"
        else:
            why = compare(offer.versions, local_versions())[0]
        if why is not None:
            log.warning("relay %r (%s, pid %d) refused: %s", offer.name[:64],
                        offer.hostname[:64], offer.pid, why)
            refuse(ctl, identity, env, why)
            return
        relay = Relay(len(self.relays), ctl, None, identity, env.sender, env.seq)
        relay.pid, relay.name = offer.pid, f"{offer.name[:64]} on {offer.hostname[:64]}"
        self.relays.append(relay)
        self.by_identity[identity] = relay
        chan = ctl._chan
        assert chan is not None
        observer = ctl.observer  # (traces read each host's call times)
        chan.send(relay.link, Setup(relay.index, ctl.heartbeat_interval, ctl.liveness_timeout,
                                    ctl._resend_after, ctl.max_message_bytes,
                                    bool(observer is not None and observer.records)))
        log.info("relay %d (%s, pid %d) connected", relay.index, relay.name, relay.pid)

    # -- hosts ---------------------------------------------------------------------------

    def describe(self) -> list[dict[str, Any]]:
        """Each relay, for :meth:`Controller.stats`."""
        return [{"index": r.index, "pid": r.pid, "name": r.name, "connected": r.proc is None,
                 "endpoint": r.endpoint, "alive": r.alive,
                 "hosts": sorted(r.carries.values()), "forwards": r.forwards, "ups": r.ups,
                 "carried_up": r.carried_up, "most_buffers": r.most_buffers,
                 "most_bytes": r.most_bytes}
                for r in self.relays]

    def pick(self) -> Relay | None:
        """The live relay carrying fewest hosts (None: there is none)."""
        live = [r for r in self.relays if r.alive and r.endpoint]
        return min(live, key=lambda r: len(r.carries)) if live else None

    def welcome(self, host: Host, relay: Relay, welcome: P.Welcome) -> None:
        """Send a new host its WELCOME (naming ``relay``); the relay carries it from then on.

        The relay hears of it first (ADOPT, numbering on from the WELCOME's number),
        so the host's first word there finds it known.
        """
        chan = self._ctl._chan
        assert chan is not None
        peer = host.peer
        expect = peer.send_seq + 1  # a new host: nothing queued, the WELCOME is next
        adopt = Adopt(host.index, host.identity, host.session, expect, peer.recv_seq,
                      peer.max_window, peer.max_part)
        chan.send(relay.link, adopt)
        chan.send_now(relay.link)
        chan.send(peer, welcome)
        chan.send_now(peer)  # the WELCOME goes directly; all after it through the relay
        if peer.send_seq != expect:  # (never, for a new host) the numbering it must take
            chan.send(relay.link, Adopt(host.index, host.identity, host.session,
                                        peer.send_seq, peer.recv_seq, peer.max_window,
                                        peer.max_part))
        relay.carries[host.identity] = host.index
        relay.adopted(host.index)
        relay.carried_mask |= 1 << host.index
        peer.via = relay
        self._ctl._hosts.changes += 1  # (fan-outs worked out before go another way now)

    def joined_again(self, host: Host, advanced: bool) -> None:
        """A relayed host's worker sent a JOIN or HELLO again before its WELCOME came:
        the WELCOME goes again, and if that JOIN or HELLO took a number the relay has not
        seen, the relay is told (else the host's next message there would be a gap)."""
        relay = host.peer.via
        chan = self._ctl._chan
        if advanced and isinstance(relay, Relay) and relay.alive and chan is not None:
            peer = host.peer
            chan.send(relay.link, Adopt(host.index, host.identity, host.session, peer.send_seq,
                                        peer.recv_seq, peer.max_window, peer.max_part))
        self.resend_welcome(host)

    def resend_welcome(self, host: Host) -> None:
        """A relayed host asked to join again: its WELCOME was lost on the way."""
        chan = self._ctl._chan
        if chan is not None and host.peer.unacked and chan.open:
            try:
                send_frames(chan.sock, [*host.peer.route, *host.peer.unacked[0][2]])
            except zmq.ZMQError:
                pass

    def drop(self, host: Host, last_word: str) -> None:
        """``host`` was lost: its relay forgets it (and tells its worker ``last_word``)."""
        relay = host.peer.via
        if not isinstance(relay, Relay) or relay.carries.pop(host.identity, None) is None:
            return
        relay.carried_mask &= ~(1 << host.index)
        chan = self._ctl._chan
        if relay.alive and chan is not None:
            chan.send(relay.link, Gone(host.index, last_word))

    # -- liveness ------------------------------------------------------------------------

    def tick(self, frozen: float = 0.0) -> None:
        """Heartbeats to the relays; a relay whose process ended, or that is silent, is lost
        (``frozen``: seconds this process did not run, see :mod:`colobus._wire.stalls`)."""
        chan = self._ctl._chan
        assert chan is not None
        now = time.monotonic()
        links = []
        for r in self.relays:
            if not r.alive:
                continue
            r.last_seen += frozen
            code = r.proc.poll() if r.proc is not None else None
            if code is not None:
                self.lost(r, f"its process exited with status {code}")
            elif now - r.last_seen > self._ctl.liveness_timeout:
                self.lost(r, f"no message for {now - r.last_seen:.1f} s")
            else:
                chan.send(r.link, P.Heartbeat(0, 0, 0, 0, 0))
                links.append(r.link)
        chan.resend_stale(links, self._ctl._resend_after)

    def lost(self, relay: Relay, why: str) -> None:
        """A relay is gone: exactly the operations of the hosts it carried fail."""
        relay.alive = False
        log.warning("relay %d lost (%s): its %d hosts are lost with it", relay.index, why,
                    len(relay.carries))
        hosts = self._ctl._hosts
        carried, relay.carries = relay.carries, {}
        relay.carried_mask = 0
        for index in carried.values():
            self._ctl._sessions.lose(hosts[index], f"its relay was lost ({why})")
        if relay.proc is None:  # one that connected by itself: told if it speaks again
            return
        if relay.proc.poll() is None:
            relay.proc.kill()

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
            if got.kind == P.Kind.UP:  # (the common message: no batch, no dispatch)
                self._up(relay, got)
                return
            subs = unpack_batch(got) if got.kind == P.Kind.BATCH else [got]
        except Dropped as d:
            sessions.drop(d.reason, relay.identity, d.detail)
            return
        for sub in subs:
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
            counts = self._ctl._sessions.dropped
            for reason, n in beat.dropped.items():
                if type(n) is int and n > relay.dropped.get(reason, 0):
                    counts[str(reason)[:64]] += n - relay.dropped.get(reason, 0)
                    relay.dropped[reason] = n
        elif kind == P.Kind.GONE:
            g = Gone.from_wire(env.body)
            assert isinstance(g, Gone)
            host = self._carried(relay, g.host)
            if host is None:
                return
            if g.reason:
                self._ctl._sessions.violation(host, g.reason, g.why)
            else:
                self._ctl._sessions.lose(host, g.why)
        elif kind == P.Kind.READY:
            r = Ready.from_wire(env.body)
            assert isinstance(r, Ready)
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
            try:
                if (type(e) is list and len(e) == 9 and e[1] == DELIVERED and e[0] == []
                        and type(e[2]) is bytes and len(e[2]) <= COUNT_ABOVE):
                    # the relay's own report of what its hosts acknowledged (the common
                    # second entry of an UP; _entry's DELIVERED branch, inline)
                    raw = unpack(e[2], raw=False, use_list=True)
                    if type(raw) is list and len(raw) == 1 and type(raw[0]) is list:
                        relay.on_delivered(raw[0])
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
                relay.on_delivered(raw[0])  # (Delivered.from_wire, inline)
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
