"""The relay's channel to its hosts: replies read and coalesced in bulk.

Every host answers a fan-out call with one small RESULT, and heartbeats once a
second. Through the general path (:meth:`Channel.drain` -> :func:`recv_frames` ->
:meth:`Relay._from_host` -> ``decode`` -> :meth:`Channel.take` -> :meth:`Peer.accept`
-> :meth:`Peer.acked` -> the gather) that is a dozen Python calls per host.
:class:`HostsChannel` reads its socket in one loop and takes the common message
inline: a carried host's next message in sequence, whole, one small RESULT or
HEARTBEAT with no buffers, from the session the relay carries; authenticated,
checked and taken as the general path would (the MAC, the header's fields and their
types, the sequence, the acknowledgement it carries and the send window it sizes,
the hold's count, the reply's entry, a heartbeat's news). Anything else, or
anything the inline checks are not sure of, goes to the general path untouched,
which decides as it always did (its drops, violations and losses). The twins:
:meth:`Channel.drain` for the loop, :meth:`Channel.take`, :meth:`Peer.acked` and
:meth:`Relay._from_host` for the message (``tests/test_relay_paths.py`` holds the
two paths equal).
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import TYPE_CHECKING, Any

import msgpack
import zmq

from .._wire import peer as peer_mod
from .._wire import protocol as P
from .._wire.channel import DRAIN_BUDGET_S, Channel
from .._wire.envelope import _LEN, MAC_SIZE, PROTOCOL_VERSION
from .._wire.lane import _keyed
from .._wire.limits import COUNT_ABOVE
from .._wire.links import SRCFD
from .._wire.peer import WINDOW_MIN
from .._wire.relaywire import SMALL
from .._wire.sockio import NOBLOCK
from .._wire.sockio import _recv as recv

if TYPE_CHECKING:
    from .carrier import Carrier

__all__ = ["HostsChannel"]

log = logging.getLogger("colobus.relay")

RESULT = int(P.Kind.RESULT)
HEARTBEAT = int(P.Kind.HEARTBEAT)
INLINE = frozenset((RESULT, HEARTBEAT))  # the kinds taken inline
_pack = msgpack.Packer(use_bin_type=True).pack
_unpack = msgpack.unpackb
_compare = hmac.compare_digest
_len = _LEN.pack


class HostsChannel(Channel):
    """The relay's ROUTER to its hosts (see the module docstring); ``relay`` is set
    once the relay made it."""

    relay: Carrier
    inline = 0  # replies taken inline (tests check the fast path ran)

    def drain(self) -> None:
        """Read and handle every waiting message, the common ones inline (the twin of
        :meth:`Channel.drain`: the same budget, hooks and reads after sends)."""
        sock = self.sock
        if sock.closed:
            return
        corked, self._corked = self._corked, True
        r = self.relay
        keyed = _keyed(self._key)
        by_identity, peers, arrived = r.by_identity, r.peers, r.arrived
        last_seen, released, ups = r.last_seen, r.released, r.ups
        conn_fd = r.links.conn_fd
        ctl_session, times = r.ctl_session, r.times
        on_frames = self._on_frames
        after_reads = self._after_reads
        answered: dict[int, int] = {}  # call id -> its replies taken inline, not yet told
        target = peer_mod.TARGET_DELAY_S  # (Peer.acked's)
        start = time.monotonic()
        try:
            while True:
                while True:
                    try:  # (no poll per message: 2 us each; one EAGAIN per drain)
                        f = recv(sock, NOBLOCK, False)
                    except zmq.Again:
                        break
                    frames = [f]
                    while f.more:
                        f = recv(sock, NOBLOCK, False)
                        frames.append(f)
                    # A carried host's next message in sequence: one small RESULT or
                    # HEARTBEAT, no buffers, authenticated, every field as the general
                    # path requires (decode's checks, inline); else the general path.
                    fields: Any = None
                    h = by_identity.get(frames[0].bytes) if len(frames) == 4 else None
                    if h is not None and h in arrived:  # (a first word: general path)
                        # (small frames: their bytes cost less than views on them)
                        hb, pb, tb = frames[1].bytes, frames[2].bytes, frames[3].bytes
                        hlen, plen = len(hb), len(pb)
                        if hlen <= COUNT_ABOVE and plen <= SMALL and len(tb) == MAC_SIZE:
                            m = keyed.copy()
                            m.update(_len(hlen) + hb + _len(plen))
                            if plen:
                                m.update(pb)
                            if _compare(m.digest(), tb):
                                try:
                                    fields = _unpack(hb, raw=False, use_list=True)
                                except Exception:  # (the general path drops it)
                                    fields = None
                    peer = peers[h] if fields is not None and h is not None else None
                    if (peer is not None and type(fields) is list and len(fields) == 9
                            and fields[1] in INLINE and type(fields[1]) is int
                            and fields[0] == PROTOCOL_VERSION and type(fields[0]) is int
                            and type(fields[4]) is int and fields[4] == peer.recv_seq + 1
                            and type(fields[5]) is int and fields[6] == [] and fields[7] == 0
                            and type(fields[7]) is int
                            and fields[2] == peer.their_session and type(fields[2]) is bytes
                            and fields[3] == ctl_session and type(fields[3]) is bytes
                            and peer.assembly is None and type(fields[8]) is list
                            and (fields[1] == HEARTBEAT or (len(fields[8]) >= 3
                                                            and type(fields[8][0]) is int))):
                        assert h is not None  # (as peer is not None)
                        # taken: Channel.take (its accept) and Relay._from_host, inline
                        self.inline += 1
                        kind, seq, ack, body = fields[1], fields[4], fields[5], fields[8]
                        unacked = peer.unacked
                        now = last_seen[h] = time.monotonic()
                        try:  # (links.source_fd, inline)
                            fd = frames[0].get(SRCFD)
                        except zmq.ZMQError:  # (inproc: no descriptor)
                            fd = -1
                        if fd >= 0 and conn_fd.get(h) != fd:  # (Relay._from_host's)
                            r.links.heard(h, fd)
                        if unacked and unacked[0][0] <= ack:
                            # (Peer.acked, inline: the peer has everything up to ack)
                            freed = data = 0
                            sent = 0.0
                            while unacked and unacked[0][0] <= ack:
                                _, sent, _, n, d = unacked.popleft()
                                freed += n
                                data += d
                            peer.inflight -= freed
                            peer.held -= data
                            peer.ack_wait = now
                            peer.backoff = 1.0
                            delay = now - sent
                            if delay < peer.base_delay:
                                peer.base_delay = delay
                            queued = delay - peer.base_delay
                            if queued < target:
                                window = peer.window + freed
                                peer.window = (window if window < peer.max_window
                                               else peer.max_window)
                            elif queued > 2 * target and now - peer.last_cut > delay:
                                peer.window = max(WINDOW_MIN, peer.window * 7 // 10)
                                peer.last_cut = now
                            if data:  # (Relay._released)
                                released.add(h)
                        peer.recv_seq = seq
                        if kind == RESULT:
                            r._due = True
                            cid = body[0]
                            answered[cid] = answered.get(cid, 0) + 1
                            ups.reply(h, RESULT, _pack(body[:3]), pb,
                                      (body[3] if len(body) > 3 else []) if times else None)
                        elif r._health_news(h, body):  # (a heartbeat with news goes up)
                            ups.add(h, HEARTBEAT, _pack(body), pb, (), 0, alone=True)
                    else:
                        if answered:  # the hold hears of replies in the order they came
                            self._told(answered)
                        on_frames(frames)
                        if sock.closed:
                            return
                        now = time.monotonic()
                    if now - start > DRAIN_BUDGET_S:
                        # (as Channel.drain: a flood must not hold the loop)
                        self._told(answered)
                        if after_reads is not None:
                            after_reads()
                        self.flush()
                        self._loop.call_soon(self.drain)
                        return
                self._told(answered)
                if after_reads is not None:
                    after_reads()
                    if sock.closed:
                        return
                sent = self.flush()
                if self._after_flush is not None and self._after_flush():
                    continue
                if not sent:
                    break  # else read again: the sends may have taken the FD's edge
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EAGAIN, zmq.ENOTSOCK):
                log.warning("socket error: %s", exc)
        finally:
            self._corked = corked
            if self._after_drain is not None:
                self._after_drain()

    def _told(self, answered: dict[int, int]) -> None:
        """The hold hears of the replies taken inline (``answered``, emptied)."""
        hold = self.relay.hold
        for cid, n in answered.items():
            hold.answered(cid, n)
        answered.clear()
