"""The controller's side of every worker session: join, authenticate, dispatch, liveness.

Each incoming message is authenticated (MAC, then its session, then its place
in the sequence) before anything reads its body; what fails is dropped and
counted by reason. A worker joins by answering a challenge: JOIN gets a fresh
nonce (CHALLENGE), and a HELLO carrying it joins the worker (a new host, or
the next generation of a named one). A joined host's messages go to the
handler of their kind; a joined host that breaks the protocol is dropped.
Every ``heartbeat_interval`` its liveness tick (:mod:`.liveness`) reads what waits,
declares lost the hosts silent beyond the liveness timeout whose link does not prove
them alive (exactly their operations fail), sends heartbeats, and resends what a host
left unacknowledged (a dropped connection).
Everything here runs on the controller's loop thread.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .._wire import protocol as P
from .._wire.chunks import ACK_KIND
from .._wire.envelope import PROTOCOL_VERSION, Dropped, Envelope, unpack_batch
from .._wire.guard import RESET_SEQ, Challenges, PeerWarnings, Refusals, join_key_id, shown
from .._wire.lane import ON, decode
from .._wire.limits import MAX_HEADER_BYTES, MAX_OBJECTS, UNKNOWN_PEER_MAX_BYTES
from .._wire.protocol import Kind
from .._wire.relaywire import NEVER_REACHED, Offer
from .._wire.versions import compare, local_versions
from .environ import join_level
from .hangups import link_up
from .hosts import Host
from .imports import ImportAnswers, ImportsOwner
from .joinwait import WrongKeys
from .liveness import Liveness
from .ops import Parts
from .relays import NO_RELAYS, refuse
from .resultlane import ResultLane, on_result

if TYPE_CHECKING:
    from .._wire.envelope import Buffer
    from .hangups import Hangups
    from .jaxjob import JaxJob
    from .ops import Operations
    from .relays import Relays
    from .uploads import Uploads

__all__ = ["Sessions", "SessionsOwner"]

log = logging.getLogger("colobus.controller")

MAX_HOSTS = 4096  # distinct host names one controller keeps
MAX_DEVICES_PER_HOST = 4096
MAX_NAME = 256  # characters of a host name or address


class SessionsOwner(Parts, ImportsOwner, Protocol):
    """What :class:`Sessions` uses of the controller that owns it."""

    @property
    def _ops(self) -> Operations: ...
    @property
    def _hangups(self) -> Hangups | None: ...
    @property
    def _relays(self) -> Relays | None: ...
    @property
    def _job(self) -> JaxJob | None: ...
    @property
    def _uploads(self) -> Uploads: ...
    @property
    def _session(self) -> bytes: ...
    @property
    def _key(self) -> bytes: ...
    @property
    def _expected_hosts(self) -> int: ...
    @property
    def _exit_workers(self) -> bool: ...
    @property
    def _resend_after(self) -> float: ...
    @property
    def heartbeat_interval(self) -> float: ...
    @property
    def liveness_timeout(self) -> float: ...
    @property
    def max_message_bytes(self) -> int: ...
    @property
    def send_window_bytes(self) -> int: ...
    def _joined(self) -> None: ...
    def _send(self, host: Host, body: P.Body, payload: Buffer = b"",
              buffers: Any = (), pbufs: int = 0) -> None: ...


class Sessions:
    """Joins workers, checks each envelope against its session, dispatches, judges silence."""

    def __init__(self, ctl: SessionsOwner) -> None:
        self._ctl = ctl
        self.dropped: collections.Counter[str] = collections.Counter()
        self.batches_received = 0
        self.tick_errors = 0  # liveness ticks that raised (logged)
        self.hosts_dropped = 0  # joined hosts dropped for breaking the protocol
        self.challenges = Challenges()  # join nonces: bounded, expiring
        self._peer_warnings = PeerWarnings(log)
        self.refusals = Refusals(log)  # joins refused, rate-limited
        self.wrong_keys = WrongKeys(ctl._key)  # workers that join with another key
        self.join_level = join_level(launched=False)  # launchers: cluster.announce_joins
        # Names a launcher numbers its hosts by (names[0] is host 0), set from any thread
        # before its workers start; the loop thread reserves their numbers at the next HELLO.
        self.number_by_name: list[str] | None = None
        # Names of hosts that never reached the relay they were sent to: served directly.
        self.direct: set[str] = set()
        # What the channel calls with each message: the common reply's lane, which
        # hands everything else to on_frames (COLOBUS_CALL_LANE=0: on_frames itself).
        self.reader: Callable[[list[Any]], None] = (ResultLane(self).on_frames if ON
                                                    else self.on_frames)
        self.judge = Liveness(ctl, self.lose, self._flush_warnings)  # silence, per tick
        # Keyed by Kind, found by the plain int off the wire (IntEnum hashes as int).
        self._handlers: dict[int, Callable[[Host, Any, Envelope], None]] = {
            Kind.HEARTBEAT: self._on_heartbeat,
            Kind.RESULT: functools.partial(on_result, ctl._ops),  # (and a FETCH it answers)
            Kind.IMPORT: ImportAnswers(ctl).on_import,  # host code imports what it lacks
        }

    def handle_kind(self, kind: Kind, handler: Callable[[Host, Any, Envelope], None]) -> None:
        """Hand joined hosts' messages of ``kind`` to ``handler`` (a part's own kind)."""
        self._handlers[kind] = handler

    # -- receiving ------------------------------------------------------------------------

    def drop(self, reason: str, identity: bytes, detail: str = "", frames: Any = ()) -> None:
        self.dropped[reason] += 1
        if reason == "unauthenticated" and (theirs := join_key_id(frames)) is not None:
            self.wrong_keys.note(theirs)  # a worker's JOIN with another key: both ids said
        elif reason in ("unauthenticated", "version", "oversized"):
            self._peer_warnings.note(reason, identity, detail)  # rate-limited
        else:
            log.debug("dropped message (%s) %s", reason, detail)

    def violation(self, host: Host, reason: str, detail: str = "") -> None:
        """``host`` broke the protocol with a valid MAC: count it and drop the host."""
        self.dropped[reason] += 1
        if host.alive:
            self.hosts_dropped += 1
            self.lose(host, f"it broke the protocol ({reason}: {detail:.200})")

    def on_frames(self, frames: list[Any]) -> None:
        """One multipart message off the ROUTER: authenticate, then handle or drop."""
        if len(frames) < 2:
            self.dropped["malformed"] += 1
            return
        ctl = self._ctl
        identity = frames[0].bytes
        relays = ctl._relays
        if relays is not None and identity in relays.by_identity:
            relays.on_frames(relays.by_identity[identity], frames)
            return
        # A peer that has not joined sends small messages only (JOIN, HELLO): anything
        # larger is dropped from its frame lengths, before any MAC work.
        limit = (ctl.max_message_bytes if identity in ctl._hosts.by_identity
                 else UNKNOWN_PEER_MAX_BYTES)
        try:
            # Sizes from the frame lengths first, then the MAC, then the header.
            env = decode(ctl._key, frames[1:], max_payload=limit, max_total=limit,
                         max_body=MAX_HEADER_BYTES, max_objects=MAX_OBJECTS)
        except Dropped as d:
            host = ctl._hosts.by_identity.get(identity)
            if host is not None and d.reason == "oversized":
                self.violation(host, d.reason, d.detail)  # its workers stay under the limit
            else:
                self.drop(d.reason, identity, d.detail, frames[1:])
            return
        self.on_envelope(identity, env, frames[0])

    def on_envelope(self, identity: bytes, env: Envelope, frame: Any) -> None:
        """One authenticated envelope that came in ``frame``'s connection: check it
        against its session, then handle or drop it."""
        ctl = self._ctl
        host: Host | None = None
        try:
            if env.kind == Kind.JOIN:
                self._on_join(identity, env)
                return
            if env.kind == Kind.HELLO:
                self._on_hello(identity, env, frame)
                return
            if env.kind == Kind.OFFER:  # a relay that connected by itself (colobus relay)
                if not self._refuse_version(identity, env):
                    if ctl._relays is not None:
                        ctl._relays.on_offer(identity, env)
                    else:
                        Offer.from_wire(env.body)  # (ValueError: malformed)
                        self.drop("relay_refused", identity, NO_RELAYS)
                        refuse(ctl, identity, env, NO_RELAYS)
                return
            host = ctl._hosts.by_identity.get(identity)
            if host is None or env.sender != host.session:
                last_word = ctl._hosts.dead_sessions.get(env.sender)
                if last_word is not None:
                    self.drop("stale", identity)
                    # The last word of that session: the worker takes a RESET outside
                    # the session's numbering and joins again (or exits).
                    self._send_raw(identity, env.sender, P.Reset(last_word), seq=RESET_SEQ)
                else:
                    self.drop("unknown_peer", identity)
                return
            if env.receiver != ctl._session:
                self.drop("stale", identity)
                return
            if env.version != PROTOCOL_VERSION:
                self.drop("version", identity)
                return
            if host.peer.via is not None and env.kind != ACK_KIND:
                # its session moved to a relay: a message sent before the move goes again
                self.drop("relayed", identity)
                return
            assert ctl._chan is not None
            got = ctl._chan.take(host.peer, env, ctl.max_message_bytes)
            if isinstance(got, str):
                self.drop(got, identity)
                return
            host.last_seen = time.monotonic()
            if ctl._hangups is not None:
                ctl._hangups.heard(host, frame)
            if got is None:  # an ACK, or a part of a larger message
                return
            env = got
            if env.kind != Kind.BATCH:
                self._dispatch(host, identity, env)
                return
            subs = unpack_batch(env)
            self.batches_received += 1
        except Dropped as d:
            if host is not None:
                self.violation(host, d.reason, d.detail)
            else:
                self.drop(d.reason, identity, d.detail)
            return
        except ValueError as exc:
            self.drop("malformed", identity, str(exc))
            return
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # a bug in a handler must not kill the reader
            self.dropped["handler_error"] += 1
            log.exception("error handling a message from %s", identity.hex())
            return
        for sub in subs:
            if not host.alive:
                return  # dropped for an earlier message of the batch
            self._dispatch(host, identity, sub)

    def _dispatch(self, host: Host, identity: bytes, env: Envelope) -> None:
        """Handle one authenticated message of a joined host."""
        try:
            body = P.parse(env.kind, env.body)
        except ValueError as exc:
            self.violation(host, "malformed", str(exc))
            return
        self.handle(host, identity, env, body)

    def handle(self, host: Host, identity: bytes, env: Envelope, body: P.Body) -> None:
        """Handle one authenticated, parsed message of a joined host (or of one a relay
        carries: :mod:`colobus._controller.relays`)."""
        try:
            handler = self._handlers.get(env.kind)
            if env.kind in (Kind.HELLO, Kind.JOIN):  # a join resent by a joined host
                self.drop("stale", identity, "join of a joined host")
                return
            if handler is None:
                self.violation(host, "unexpected_kind", Kind(env.kind).name)
                return
            handler(host, body, env)
        except ValueError as exc:
            self.violation(host, "malformed", str(exc))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # a bug in a handler (a CancelledError too) must not
            # end the batch it came in: the rest of the batch is still handled
            self.dropped["handler_error"] += 1
            log.exception("error handling a message from %s", identity.hex())

    def _send_raw(self, identity: bytes, receiver: bytes, body: P.Body, seq: int = 1) -> None:
        chan = self._ctl._chan
        if chan is not None:
            chan.send_raw([identity], Envelope(body.kind, self._ctl._session, receiver, seq,
                                               body.to_wire()))

    # -- handlers ------------------------------------------------------------------------

    def _refuse_version(self, identity: bytes, env: Envelope) -> bool:
        if env.version == PROTOCOL_VERSION:
            return False
        self.drop("version", identity, f"peer speaks protocol {env.version}")
        self._send_raw(identity, env.sender, P.Reject(
            f"protocol version mismatch: worker speaks {env.version}, controller speaks "
            f"{PROTOCOL_VERSION}; install the same colobus version on both sides"))
        return True

    def _on_join(self, identity: bytes, env: Envelope) -> None:
        """A worker asks to join: answer with a fresh nonce its HELLO must carry."""
        if self._refuse_version(identity, env) or self._ctl._closed:
            return
        P.parse(env.kind, env.body)  # no fields: ValueError (malformed) otherwise
        if len(env.sender) != 16 or env.buffers or len(env.payload) > 8:  # (its key id)
            self.drop("malformed", identity, "join")
            return
        current = self._ctl._hosts.by_identity.get(identity)
        if current is not None and current.session == env.sender:
            # A JOIN the worker sent again before our WELCOME reached it: already
            # joined. Its number is taken, so the worker's next message follows it.
            self._joined_again(current, env)
            return
        nonce = self.challenges.issue(identity, env.sender)
        self._send_raw(identity, env.sender, P.Challenge(nonce))

    def _joined_again(self, host: Host, env: Envelope) -> None:
        """A JOIN or HELLO a joined worker sent again before our WELCOME reached it: its
        number is taken, so its next message follows it (a relayed host: the WELCOME,
        which only this side could resend, goes again)."""
        advanced = env.seq > host.peer.recv_seq
        host.peer.recv_seq = max(host.peer.recv_seq, env.seq)
        if host.peer.via is not None and self._ctl._relays is not None:
            self._ctl._relays.joined_again(host, advanced)

    def _on_hello(self, identity: bytes, env: Envelope, frame: Any = None) -> None:
        ctl = self._ctl
        if self._refuse_version(identity, env):
            return
        hello = P.parse(env.kind, env.body)
        assert isinstance(hello, P.Hello)
        hosts = ctl._hosts
        current = hosts.by_identity.get(identity)
        if current is not None and current.session == env.sender:
            # A HELLO the worker resent while our WELCOME was on its way: already
            # joined. Its number is taken, so the worker's next message follows it.
            self._joined_again(current, env)
            return
        # The nonce this controller issued to this connection and session, once:
        # a recorded HELLO is worthless to any later controller or connection.
        if not self.challenges.take(identity, env.sender, hello.nonce):
            self.drop("replay", identity, "hello without a fresh challenge")
            return
        if ctl._closed:
            return
        if not (len(hello.devices) <= MAX_DEVICES_PER_HOST and all(
                isinstance(d, list) and len(d) == 3 and isinstance(d[0], str)
                and isinstance(d[1], str) and type(d[2]) is int for d in hello.devices)):
            raise ValueError("bad device list")
        if len(hello.name) > MAX_NAME or len(hello.hostname) > MAX_NAME:
            raise ValueError("host name too long")
        if not (len(hello.versions) <= 16 and all(
                type(k) is str and type(v) is str and len(k) + len(v) <= MAX_NAME
                for k, v in hello.versions.items())):
            raise ValueError("bad versions")
        why, warnings = compare(hello.versions, local_versions())
        if why is not None:  # one line, on both sides; the worker exits
            self.refusals.note(f"host {hello.name!r} ({shown(hello.hostname)}) refused: {why}")
            self._send_raw(identity, env.sender, P.Reject(why))
            return
        for line in warnings:  # (the worker's strings quoted: it cannot forge a line)
            log.warning("host %r (%s): %s", hello.name, shown(hello.hostname), line)
        names, self.number_by_name = self.number_by_name, None
        if names is not None:
            ctl._hosts.reserve(names)
        self._admit(identity, env, hello, frame)

    def _admit(self, identity: bytes, env: Envelope, hello: P.Hello, frame: Any = None) -> None:
        """Join a worker whose HELLO passed every check: a new host, or a rejoin."""
        ctl = self._ctl
        hosts = ctl._hosts
        old = hosts.by_name.get(hello.name)
        if old is None and len(hosts.hosts) >= MAX_HOSTS:
            self.drop("too_many_hosts", identity, hello.name[:64])
            self._send_raw(identity, env.sender, P.Reject(
                f"this controller already has {MAX_HOSTS} hosts; rejoin under an existing name"))
            return
        if old is not None and old.alive:
            # A second worker under a live host's name waits until the first is
            # proven gone: swapping would destroy the live host's data each time.
            gone = self._gone(old)
            if gone is None:
                self.dropped["name_in_use"] += 1
                self._send_raw(identity, env.sender, P.Reject(
                    f"host {old.index} ({hello.name!r}) is alive under this name (pid "
                    f"{old.pid} on {old.address}); a second worker with the same --name is "
                    f"refused while the first is alive (retrying)", retry=True))
                return
            self.lose(old, gone)
        limit = ctl._expected_hosts
        if limit and (old is None or not old.alive) and hosts.alive_count() >= limit:
            # hosts=N is the cluster's size: a returning name waits for a place; a new
            # one is refused for this session (a long-running worker waits for a place or
            # the next driver, one a launcher started exits: the worker decides).
            self.dropped["too_many_hosts"] += 1
            self._send_raw(identity, env.sender, P.Reject(
                f"the controller runs hosts={limit} and {limit} hosts are alive: "
                + ("this worker waits for a place (retrying)" if old is not None else
                   f"a worker under a new name ({hello.name!r}) is refused; start the "
                   f"controller with a larger hosts= or rejoin under a lost host's name"),
                retry=old is not None, full=old is None))
            return
        host = hosts.join(identity, hello, env.sender, ctl._session, env.seq)
        if frame is not None and ctl._hangups is not None:
            ctl._hangups.heard(host, frame)  # its connection, watched from its first word
        host.peer.max_window = max(host.peer.window, ctl.send_window_bytes)
        relays = ctl._relays
        relay = relays.pick() if relays is not None and hello.name not in self.direct else None
        welcome = P.Welcome(host.index, [d.id for d in host.devices], ctl.heartbeat_interval,
                            ctl.liveness_timeout, ctl._exit_workers, ctl.max_message_bytes,
                            ctl.observer is not None, max(ctl._expected_hosts, len(hosts)),
                            relay.welcome_endpoint() if relay is not None else "",
                            ctl._job is not None)
        if relays is not None and relay is not None:
            relays.welcome(host, relay, welcome)  # its session moves to that relay
        else:
            ctl._send(host, welcome)
        log.log(self.join_level, "%s", hosts.describe(host, old is not None and old.joined,
                                                        ctl._expected_hosts))
        ctl._joined()
        if ctl._job is not None:  # the JAX job forms once every host joined
            if ctl._chan is not None:  # the WELCOME leaves alone: a worker not joined
                ctl._chan.flush()      # yet drops a batch (a FORM would ride with it)
            ctl._job.host_joined(host)

    def _gone(self, host: Host) -> str | None:
        """Why a live host's session is over (silent past the liveness timeout with its
        connection closed, or closed and silent past the grace), or None: it may live."""
        ctl = self._ctl
        now = time.monotonic()
        silent = now - host.last_seen
        hangups = ctl._hangups
        if (silent > ctl.liveness_timeout and host.peer.via is None  # (a relay judges its own)
                and not link_up(host, hangups)):
            return f"no message for {silent:.1f} s"
        if host.hung_up and hangups is not None and now - host.hung_up >= hangups.grace:
            return (f"its connection closed and it did not come back within "
                    f"{hangups.grace:.1f} s; a new worker took its name")
        return None

    def _on_heartbeat(self, host: Host, body: P.Heartbeat, env: Envelope) -> None:
        host.store = (body.arrays, body.nbytes, body.objects, body.results)
        host.health = body
        if body.ping:  # it echoes our ping: the round trip, less the time it held it
            host.rtt = max(0, time.monotonic_ns() - body.ping - body.held) / 1e9
        if body.calls:  # its calls' queued and run times, since its last heartbeat
            obs = self._ctl.observer
            bad = len(body.calls) if obs is None else obs.add_host_calls(body.calls)
            if bad:  # the rest of the heartbeat stands: a bad entry says nothing of liveness
                self.dropped["malformed"] += bad
                log.debug("host %d: %d call-time entries dropped", host.index, bad)

    # -- liveness ------------------------------------------------------------------------

    async def liveness(self) -> None:
        """Tick every ``heartbeat_interval``; one bad turn (a bug, a callback's
        BaseException) is logged and counted, and never ends liveness."""
        self.judge.start()  # the stall clock starts now, not when the controller was built
        while True:
            await asyncio.sleep(self._ctl.heartbeat_interval)
            try:
                self.judge.tick()
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException:
                self.tick_errors += 1
                log.exception("the liveness tick raised; it runs again next interval")

    def _flush_warnings(self) -> None:
        """Rate-limited lines said now: unauthenticated peers, refused joins."""
        self._peer_warnings.flush()
        self.refusals.flush()

    def lose(self, host: Host, why: str, last_word: str = P.RESET_REJOIN) -> None:
        """A host is gone: exactly the operations waiting for it fail.

        ``last_word``: what its worker is told if it speaks again (see
        :meth:`HostRegistry.mark_lost`).
        """
        if not self._ctl._hosts.mark_lost(host, last_word):
            return
        self.judge.forget(host)
        log.warning("host %d (%r) lost: %s", host.index, host.name, why)
        if host.peer.via is not None and self._ctl._relays is not None:
            if why.startswith(NEVER_REACHED):  # the relay's word: it never heard it
                # It reached our port but never its relay's (a firewall, NAT): rejoining
                # through the relay again would only be lost again.
                self.direct.add(host.name)
                log.warning("host %d (%r) is served directly from its next join on (open "
                            "the relays' ports to it, or relays=0)", host.index, host.name)
            self._ctl._relays.drop(host, last_word)
        self._ctl._ops.host_lost(host, why)
        if self._ctl._job is not None:  # a JAX job ends with any of its hosts
            self._ctl._job.host_lost(host, why)
        self._ctl._uploads.on_release()  # puts waiting for it go on (and fail)
