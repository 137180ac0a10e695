"""The controller's relays: processes that carry hosts' sessions for it, on its machine
(``relays=``) or on any other that offers one (``relay_key=``, ``colobus relay``).

With many hosts the controller's loop spends most of its time on per-host
envelopes: numbering, MACs, sends and acknowledgements, one of each per host
per call. A relay (:mod:`colobus._relay.relay`) takes that over for the hosts
it carries: a host that joins is told in its WELCOME to move its session to a
relay, the relay adopts the session's numbering, and from then on the
controller sends a relay one FORWARD for all its hosts in a loop step and
gets one UP back per relay drain, equal replies coalesced.

A relay shares the controller's trust (its key, over a pipe; one that connects
proves the relay key too). What comes up from relays: :mod:`.relayinbox`. A relay
that is lost takes its hosts with it: exactly their operations fail with
``HostLostError``, and their workers join again (directly, or through another
relay) as the next generation of their host.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
import struct
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import msgpack
import zmq

from .._wire import protocol as P
from .._wire.envelope import Envelope
from .._wire.keys import check_key
from .._wire.relaywire import (
    Adopt,
    Gone,
    Offer,
    Setup,
    relay_proof,
)
from .._wire.sockio import send_frames
from .._wire.versions import compare, local_versions
from .hangups import link_up
from .relayinbox import Inbox, RelaysOwner
from .relaylink import Relay

if TYPE_CHECKING:
    from .hosts import Host

__all__ = ["Relay", "Relays", "relay_count"]

log = logging.getLogger("colobus.controller")

READY_TIMEOUT_S = 60.0
HOSTS_PER_RELAY = 256  # relays= None: one relay per this many hosts (cores allowing)
PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The relay imports only colobus._wire (not colobus/__init__, which imports JAX).
BOOT = ("import sys, types; m = types.ModuleType('colobus'); m.__path__ = [sys.argv[1]]; "
        "sys.modules['colobus'] = m; from colobus._relay.process import main; sys.exit(main())")


NO_RELAYS = ("this controller takes no relays that connect by themselves: start it with "
             "relay_key= (a launcher's relays_on_hosts= does)")


def refuse(ctl: Any, identity: bytes, env: Envelope, why: str) -> None:
    """Tell a relay that offered itself (``env``) why it is refused (as Sessions does a
    worker: a REJECT outside the numbering); it exits."""
    chan = ctl._chan
    if chan is not None:
        chan.send_raw([identity], Envelope(P.Kind.REJECT, ctl._session, env.sender, 1,
                                           P.Reject(why).to_wire()))


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


class Relays(Inbox):
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
            ValueError: ``relays`` below 0, relays asked for with CurveZMQ on, or
                ``relay_key`` is the controller's key.
            AuthenticationError: ``relay_key`` is shorter than 32 bytes.
        """
        count = relay_count(relays, threshold, hosts)
        if relay_key is not None:
            relay_key = check_key(relay_key, "Controller(relay_key=...)")
            if relay_key == ctl._key:  # workers hold that one: any of them could carry hosts
                raise ValueError("relay_key must not be the controller's key: workers hold "
                                 "that one (make another with `colobus keygen`)")
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
        # A session of its own, as the workers': a Ctrl-C in the terminal reaches the driver
        # only, which then closes its relays in order (it holds their stdin: they never
        # outlive it).
        proc = subprocess.Popen([sys.executable, "-P", "-c", BOOT, PACKAGE], stdin=subprocess.PIPE,
                                close_fds=True, start_new_session=True)
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
        why, reason = None, "relay_refused"  # (every refusal counted: one reason each)
        if self.relay_key is None:
            why = NO_RELAYS
        elif not hmac.compare_digest(offer.proof, relay_proof(self.relay_key, offer.nonce,
                                                               env.sender)):
            why = "the relay key is not this controller's (--relay-key-file)"
            reason = "unauthenticated"
        else:
            why = compare(offer.versions, local_versions())[0]
        if why is not None:
            sessions.drop(reason, identity, why)
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
        relay.ever_mask |= 1 << host.index
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
        """Heartbeats to the relays; a relay whose process ended, or that is silent with no
        live link (as a host, ``Sessions.tick``), is lost (``frozen``: seconds this process
        did not run, see :mod:`colobus._wire.stalls`)."""
        chan = self._ctl._chan
        assert chan is not None
        now = time.monotonic()
        links = []
        for r in self.relays:
            if not r.alive:
                continue
            r.last_seen = min(r.last_seen + frozen, now)  # (what was just read: heard now)
            code = r.proc.poll() if r.proc is not None else None
            if code is not None:
                self.lost(r, f"its process exited with status {code}")
            elif (r.endpoint  # (until READY, start() waits for it, its process watched)
                  and now - r.last_seen > self._ctl.liveness_timeout
                  and not link_up(r, self._ctl._hangups)):
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
