"""One relay as the controller sees it: the link its hosts' messages leave by.

A :class:`Relay` is the :class:`~colobus._wire.peer.Via` of the hosts it carries:
what the controller sends them in a loop step is gathered into FORWARD messages on
the relay's own peer (``link``), as few as the wire's limits allow
(:mod:`colobus._wire.limits`: a FORWARD closes before ``GATHER_MAX_BUFFERS``
buffers or ``GATHER_MAX_BYTES`` bytes). It also counts, per host, the payload and
buffer bytes it was given and the relay has not yet seen that host acknowledge
(``held_for``): the relay acknowledges a FORWARD as soon as it reads it, so the
link's own count would let uploads run ahead of a stopped or slow host.
"""

from __future__ import annotations

import collections
import subprocess
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .._wire import protocol as P
from .._wire.channel import Peer
from .._wire.envelope import pack_body
from .._wire.lane import pack
from .._wire.peer import data_bytes
from .._wire.relaywire import Gather
from .ops import Parts

if TYPE_CHECKING:
    from .._wire.envelope import Buffer
    from .uploads import Uploads

__all__ = ["LinkOwner", "Relay"]

FORWARD = int(P.Kind.FORWARD)


class LinkOwner(Parts, Protocol):
    """What :class:`Relay` uses of the controller."""

    @property
    def _uploads(self) -> Uploads: ...
    @property
    def _session(self) -> bytes: ...
    @property
    def send_window_bytes(self) -> int: ...


class Relay:
    """One relay process, as the controller sees it (a :class:`~colobus._wire.peer.Via`
    for the hosts it carries)."""

    def __init__(self, index: int, ctl: LinkOwner, proc: subprocess.Popen[bytes] | None,
                 identity: bytes, session: bytes, recv_seq: int = 0) -> None:
        self.index = index
        self.proc = proc  # None: a relay that connected by itself (``colobus relay``)
        self.pid = proc.pid if proc is not None else 0  # (another machine's, if it connected)
        self.name = f"relay {index}"
        self.identity = identity
        self.session = session
        self.link = Peer([identity], ctl._session, session, recv_seq, ctl.send_window_bytes)
        self.endpoint = ""  # where hosts connect, once it said READY
        self.reset_sent = False  # a relay declared lost that spoke again was told
        self.carries: dict[bytes, int] = {}  # host routing id -> host index
        self.carried_mask = 0  # the bits of the hosts it carries
        # ... and of every host it ever carried: an entry for another breaks the
        # protocol, one for a host it carried before (lost meanwhile) is skipped
        self.ever_mask = 0
        self.last_seen = time.monotonic()
        self.alive = True
        self.conn_fd = -1  # the connection it was last heard on, and when that closed
        self.hung_up = 0.0  # (colobus._controller.hangups: its link proves it alive)
        self.dropped: dict[str, int] = {}
        self.forwards = 0  # FORWARD messages sent to it
        self.ups = 0  # UP messages from it
        self.carried_up = 0  # host messages those carried
        self.most_buffers = 0  # the most buffers one FORWARD or UP carried (stats)
        self.most_bytes = 0  # the most payload and buffer bytes one carried
        # Per host index: payload and buffer bytes given to it for the host, and of
        # those, what the relay said the host acknowledged (Delivered; since ADOPT).
        self.given: collections.Counter[int] = collections.Counter()
        self.delivered: dict[int, int] = {}
        self._gather = Gather(given=self.given)
        # (Via.add_indices: the gather's own, one call less on every fan-out's send;
        # it counts what each host is given)
        self.add_indices = self._gather.add_many
        self.add_spliced = self._gather.add_spliced  # (Via.add_spliced)
        self._ctl = ctl

    def held_for(self, index: int) -> int:
        """The bytes given for host ``index`` that it has not acknowledged (any thread)."""
        return max(0, self.given[index] - self.delivered.get(index, 0))

    def adopted(self, index: int) -> None:
        """Host ``index`` is carried from now on, by a new session: counts start over."""
        self.given.pop(index, None)
        self.delivered.pop(index, None)

    def on_delivered(self, counts: list[Any]) -> None:
        """The relay's count of what its hosts acknowledged (a DELIVERED's ``counts``):
        room for uploads. Only for the hosts it carries, and never more than it was given
        for one: a count read off the wire neither grows this table nor turns a host's
        bound off."""
        carried = self.carried_mask
        given = self.given
        delivered = self.delivered
        released = False
        for i in range(0, len(counts) - 1, 2):
            h, n = counts[i], counts[i + 1]
            if type(h) is not int or type(n) is not int or h < 0 or not carried >> h & 1:
                continue
            n = min(n, given[h])  # (a Counter: 0 for one given nothing, nothing stored)
            if n > delivered.get(h, 0):
                delivered[h] = n
                released = True
        if released:
            uploads = self._ctl._uploads
            if uploads._blocked or uploads._waiters:  # (on_release's own first test)
                uploads.on_release()

    def collect(self, peer: Peer) -> None:
        items, peer.outbox = peer.outbox, []
        h = self.carries.get(peer.route[0])
        held = peer.held
        peer.held = 0  # it is the relay's to hold now (held_for)
        if held:
            self._ctl._uploads.on_release(peer)
        if h is None:
            return  # a host it no longer carries: nothing more goes to it
        add = self._gather.add
        for kind, body, payload, bufs, pbufs in items:
            add(h, kind, body if type(body) is bytes else pack_body(body), payload, bufs, pbufs)
            if payload or bufs:
                self.given[h] += data_bytes(payload, bufs)

    def add(self, peer: Peer, kind: int, packed: bytes, payload: Buffer,
            buffers: Sequence[Buffer], pbufs: int) -> None:
        if peer.outbox:  # queued before it moved here: those go first
            self.collect(peer)
        h = self.carries.get(peer.route[0])
        if h is not None:  # else a host it no longer carries: nothing more goes to it
            self._gather.add(h, kind, packed, payload, buffers, pbufs)
            if payload or buffers:
                self.given[h] += data_bytes(payload, buffers)

    def carried(self, peers: list[Peer]) -> list[int]:
        carries = self.carries
        for peer in peers:
            if peer.outbox:  # (rare) queued before it moved here: those go first
                self.collect(peer)
        hosts = [carries.get(p.route[0], -1) for p in peers]
        if -1 in hosts:  # hosts it no longer carries: nothing more goes to them
            hosts = [h for h in hosts if h >= 0]
        return hosts

    def emit(self) -> Peer | None:
        gather = self._gather
        if not gather.entries and not gather._closed:  # (bool(gather), inline)
            return None
        chan = self._ctl._chan
        if chan is None:
            return None
        for body, payload, bufs in gather.take():
            chan.enqueue_packed(self.link, FORWARD, pack(body), payload, bufs, 0)
            self.forwards += 1
            self.most_buffers = max(self.most_buffers, len(bufs))
            self.most_bytes = max(self.most_bytes, data_bytes(payload, bufs))
            if len(body) > 1:  # several messages in one: counted as a batch
                chan.batches_sent += 1
        return self.link

    def welcome_endpoint(self) -> str:
        """The endpoint a WELCOME names: a relay the controller started, on TCP, as
        ``tcp://*:PORT`` (the host reaches it at the address it reached the controller
        at); one that connected by itself, as it said."""
        if self.proc is not None and self.endpoint.startswith("tcp://"):
            return "tcp://*:" + self.endpoint.rsplit(":", 1)[1]
        return self.endpoint  # (one that connected by itself said where hosts reach it)
