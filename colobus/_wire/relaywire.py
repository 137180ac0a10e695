"""What the controller and its relays say to each other.

A relay (:mod:`colobus._relay`) carries many hosts' sessions for the controller:
it numbers, authenticates and acknowledges each host's messages the way the
controller would, and talks to the controller in few, large messages:

* FORWARD (controller to relay): messages for the hosts it carries, as entries
  ``[hosts, kind, body, payload offset, payload length, first buffer, buffers,
  pbufs, extras]``; a message several hosts get the same (a fan-out's frees,
  its shared argument payload) travels once; one whose bodies differ only in their
  end (a fan-out's CALLs: each host's part of the mesh) is one entry too, each host's
  own end in ``extras`` (its body is ``body`` and then that).
* UP (relay to controller): its hosts' messages, authenticated, in the same
  entries; equal RESULTs of one call from several hosts are one entry, with
  each host's ``times`` in ``extras``.
* ADOPT, GONE, READY: a host joined and moves to the relay; a host the relay
  no longer carries (either side); the relay is up, at this endpoint.
* DELIVERED, an entry of an UP (no hosts): how many of the bytes the relay was
  given for each host that host acknowledged (the controller's upload back-pressure
  counts the rest).
* OFFER, SETUP: a relay that connected by itself (``colobus relay --connect``, on
  any machine) offers to carry hosts, proving the relay key, after a CHALLENGE as a
  worker's join; the controller takes it with the settings a relay it starts reads
  on its standard input.

Each FORWARD and UP stays within :mod:`.limits` (``GATHER_MAX_*``): a gather
closes one message before the next would pass a limit and goes on in another.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import add
from typing import Any

from . import protocol as P
from .envelope import Buffer, Dropped, mac_key
from .limits import GATHER_MAX_BODY, GATHER_MAX_BUFFERS, GATHER_MAX_BYTES

__all__ = ["MAX_REPORTED", "NEVER_REACHED", "RELAY_ONLY", "RELAY_REASONS", "Adopt", "Delivered",
           "Entry", "Gather", "Gone", "Offer", "Ready", "Setup", "entries", "entry",
           "relay_proof", "report_fault"]

# The kinds only a controller and its relays say to each other. A host that says one is
# breaking the protocol: its relay drops it, as the controller does a host whose relay
# passed one on (a relay's own reports are the entries of an UP that name no host).
RELAY_ONLY = frozenset(map(int, (P.Kind.ADOPT, P.Kind.FORWARD, P.Kind.UP, P.Kind.GONE,
                                 P.Kind.READY, P.Kind.DELIVERED, P.Kind.OFFER,
                                 P.Kind.SETUP)))
# Every reason a relay counts a message it dropped for (its heartbeat's ``dropped``), or
# drops a host for (a GONE's ``reason``): what its channel, envelopes and guard refuse
# (``tests/test_relay_hostile.py`` holds this equal to the reasons in ``_relay`` and
# ``_wire``). A relay's report beyond them breaks the protocol: the controller drops the
# relay, so its ``stats()`` and metrics labels stay this set.
RELAY_REASONS = frozenset({"unauthenticated", "malformed", "oversized", "stale",
                           "unknown_peer", "replay", "gap", "unexpected_kind"})
MAX_REPORTED = 1 << 62  # the largest count a relay reports (a cumulative count of drops)
SMALL = 4096  # payloads up to this size are shared by value (replies), larger by identity
# What an entry adds to its message's packed body besides the host's packed body (an
# estimate, on the high side): the entry's fields, each host index, a reply's times.
ENTRY_BYTES = 48
HOST_BYTES = 5
EXTRA_BYTES = 64


@dataclass(frozen=True, slots=True)
class Adopt(P.Body):
    """Carry host ``host``'s session from here on, numbering on from these."""

    kind = P.Kind.ADOPT
    types = (int, bytes, bytes, int, int, int, int)
    host: int
    identity: bytes  # the worker's routing id (it keeps it on the relay's socket)
    session: bytes  # the worker's session id
    send_seq: int  # the last number the controller sent it
    recv_seq: int  # the last number the controller took from it
    max_window: int
    max_part: int


@dataclass(frozen=True, slots=True)
class Gone(P.Body):
    """A host the relay no longer carries. To the relay: ``why`` is its last word (the
    RESET reason it is told if it speaks again). From it: why the host is lost, and
    ``reason``, a protocol violation's counter (``why`` is then its detail), or ""
    (silence)."""

    kind = P.Kind.GONE
    types = (int, str, str)
    host: int
    why: str
    reason: str = ""


# How a relay's GONE ``why`` begins for a host silent since it was adopted that never
# said a word there (it reaches the controller's port, not the relay's): the controller
# serves it directly from its next join on.
NEVER_REACHED = "it never reached its relay"


@dataclass(frozen=True, slots=True)
class Delivered(P.Body):
    """Of the payload and buffer bytes FORWARDs gave the relay for each host since it
    adopted it, how many the host acknowledged: ``counts`` is ``[host, bytes, ...]``.
    The relay acknowledges a FORWARD as soon as it reads it; the controller counts what
    it gave each host until it hears here that the host has it (upload back-pressure)."""

    kind = P.Kind.DELIVERED
    types = (list,)
    counts: list[int]


@dataclass(frozen=True, slots=True)
class Ready(P.Body):
    kind = P.Kind.READY
    types = (str,)
    endpoint: str


@dataclass(frozen=True, slots=True)
class Offer(P.Body):
    """A relay that connected to the controller (``colobus relay --connect``) offers to
    carry hosts: its name, process and machine, the nonce of the controller's CHALLENGE
    to this session, ``proof`` (:func:`relay_proof`: what only a holder of the relay key
    can make; workers hold the cluster key only), and its versions."""

    kind = P.Kind.OFFER
    types = (str, int, str, bytes, bytes, dict)
    name: str
    pid: int
    hostname: str
    nonce: bytes
    proof: bytes
    versions: dict[str, str]


@dataclass(frozen=True, slots=True)
class Setup(P.Body):
    """The controller took a relay's offer: what the relay carries its hosts with (the
    settings a relay the controller starts reads on its standard input)."""

    kind = P.Kind.SETUP
    types = (int, (int, float), (int, float), (int, float), int, bool)
    index: int
    heartbeat: float
    liveness: float
    resend_after: float
    max_message_bytes: int
    times: bool


def report_fault(dropped: Any) -> str:
    """What is wrong with a relay's heartbeat report of its drops (a map of reason to
    cumulative count), in words; ``""`` when it is within bounds."""
    if not isinstance(dropped, dict):
        return "a report of drops that is not a map"
    if len(dropped) > len(RELAY_REASONS):
        return f"drops for {len(dropped)} reasons (relays have {len(RELAY_REASONS)})"
    for reason, n in dropped.items():
        if reason not in RELAY_REASONS:
            return f"drops for a reason relays do not have ({str(reason)[:40]!r})"
        if type(n) is not int or not 0 <= n <= MAX_REPORTED:
            return f"a count of {str(n)[:40]} drops ({reason})"
    return ""


def relay_proof(relay_key: bytes, nonce: bytes, session: bytes) -> bytes:
    """What an :class:`Offer` carries: the relay key's keyed BLAKE2b of the challenge's
    nonce and the relay's session (fresh per challenge: a recorded one is worthless)."""
    import hashlib

    return hashlib.blake2b(nonce + session, key=mac_key(relay_key), digest_size=32,
                           person=b"colobus-relay").digest()


def _count(given: dict[int, int], hosts: list[int], n: int) -> None:
    """``given[h] += n`` for each of ``hosts`` (distinct), in C: no Python step per host
    (``dict.update``, not a Counter's, which would add the pairs themselves)."""
    dict.update(given, zip(hosts, map(add, map(given.get, hosts, repeat(0)), repeat(n)),
                           strict=False))  # (repeat is endless: hosts end it)


def _nbytes(b: Buffer) -> int:
    return len(b) if type(b) is bytes else memoryview(b).nbytes


class Gather:
    """Messages for (or from) many hosts, gathered into the entries of as few messages
    as the limits allow (:data:`~.limits.GATHER_MAX_BUFFERS`, ``GATHER_MAX_BYTES``,
    ``GATHER_MAX_BODY``): one closes before a message would take it past a limit, and
    the next goes on where it stopped (entries are delivered in order, message after
    message). A message over a limit on its own travels alone, as on the star."""

    def __init__(self, max_buffers: int = GATHER_MAX_BUFFERS,
                 max_bytes: int = GATHER_MAX_BYTES, max_body: int = GATHER_MAX_BODY,
                 given: dict[int, int] | None = None) -> None:
        self.max_buffers = max_buffers
        self.max_bytes = max_bytes
        self.max_body = max_body
        # per host, the payload and buffer bytes added for it (a Counter: the controller's
        # count of what a relay holds for each host); None: not counted
        self.given = given
        self._closed: list[tuple[list[list[Any]], bytes, list[Buffer]]] = []
        self._open()

    def _open(self) -> None:
        self.entries: list[list[Any]] = []
        self.buffers: list[Buffer] = []
        self._same: dict[tuple[Any, ...], tuple[list[Any], int]] = {}
        self._last: dict[int, int] = {}  # host -> the index of its last entry
        self._payloads: list[Buffer] = []
        self._size = 0  # payload bytes placed
        self._data = 0  # payload and buffer bytes placed
        self._body = 0  # about what the entries pack to
        self._pay_at: dict[Any, int] = {}
        self._buf_at: dict[tuple[int, ...], int] = {}
        self._pay_last: Any = None  # the last payload and buffers added, and where they
        self._bufs_last: Any = None  # went: a fan-out adds the same objects per host
        self._pay_last_at = self._bufs_last_at = 0

    def _close(self) -> None:
        self._closed.append((self.entries, b"".join(self._payloads), self.buffers))
        self._open()

    def __bool__(self) -> bool:
        return bool(self.entries) or bool(self._closed)

    def add_many(self, hosts: list[int], kind: int, body: bytes, payload: Buffer,
                 bufs: Sequence[Buffer], pbufs: int) -> None:
        """The same message for each of ``hosts`` (a fan-out): one new entry, after every
        host's earlier ones; per host only its place is noted (in C), and what it was
        given counted (``given``). ``hosts`` is copied (a later message may join the
        entry)."""
        hosts = list(hosts)
        if payload or bufs:
            given = self.given
            if given is not None:
                n = len(payload) if type(payload) is bytes else memoryview(payload).nbytes
                for b in bufs:
                    n += len(b) if type(b) is bytes else memoryview(b).nbytes
                _count(given, hosts, n)
            at, plen, boff = self._place(payload, bufs)
        else:
            at = plen = boff = 0  # (what _place gives for nothing to place)
            if self.entries and (len(self.buffers) > self.max_buffers
                                 or self._data > self.max_bytes):
                self._close()
        n = len(self.entries)
        entry = [hosts, kind, body, at, plen, boff, len(bufs), pbufs, None]
        self.entries.append(entry)
        self._same[(kind, body, at, plen, boff, len(bufs), pbufs, True)] = (entry, n)
        self._last.update(dict.fromkeys(hosts, n))
        self._body += len(body) + ENTRY_BYTES + HOST_BYTES * len(hosts)  # (_grew, inline)
        if self._body >= self.max_body:
            self._close()

    def add_spliced(self, hosts: list[int], kind: int, head: bytes, tails: list[bytes],
                    payload: Buffer, bufs: Sequence[Buffer], pbufs: int) -> None:
        """One message for each of ``hosts`` whose body is ``head`` and then that host's
        own ``tails[j]`` (a fan-out's CALLs: each host's part of the mesh): one new entry,
        the tails in its last field, after every host's earlier ones (no later message
        joins it); what each host is given counted (``given``)."""
        hosts = list(hosts)
        given = self.given
        if (payload or bufs) and given is not None:
            n = len(payload) if type(payload) is bytes else memoryview(payload).nbytes
            for b in bufs:
                n += len(b) if type(b) is bytes else memoryview(b).nbytes
            _count(given, hosts, n)
        at, plen, boff = self._place(payload, bufs)
        n = len(self.entries)
        self.entries.append([hosts, kind, head, at, plen, boff, len(bufs), pbufs, tails])
        self._last.update(dict.fromkeys(hosts, n))
        self._body += len(head) + ENTRY_BYTES + (HOST_BYTES + 32) * len(hosts)
        if self._body >= self.max_body:
            self._close()

    def _grew(self, body: int) -> None:
        self._body += body
        if self._body >= self.max_body:
            self._close()

    def _place(self, payload: Buffer, bufs: Sequence[Buffer]) -> tuple[int, int, int]:
        """Where ``payload`` and ``bufs`` sit in the message (each added once): the
        payload's offset and length, the first buffer's index. If placing them would take
        the message past a limit, it closes first and they go in the next one."""
        plen = len(payload) if type(payload) is bytes else memoryview(payload).nbytes
        at = boff = -1  # -1: not in this message yet
        pkey: Any = None
        bkey: tuple[int, ...] = ()
        if not plen:
            at = 0
        elif payload is self._pay_last:
            at = self._pay_last_at
        else:
            pkey = bytes(payload) if plen <= SMALL else id(payload)
            at = self._pay_at.get(pkey, -1)
        if not bufs:
            boff = 0
        elif bufs is self._bufs_last:
            boff = self._bufs_last_at
        else:
            bkey = tuple(map(id, bufs))
            boff = self._buf_at.get(bkey, -1)
        data = (plen if at < 0 else 0) + (sum(map(_nbytes, bufs)) if boff < 0 else 0)
        nbufs = len(bufs) if boff < 0 else 0
        if self.entries and (len(self.buffers) + nbufs > self.max_buffers
                             or self._data + data > self.max_bytes):
            self._close()
            return self._place(payload, bufs)
        self._data += data
        if at < 0:
            at = self._pay_at[pkey] = self._size
            self._payloads.append(payload)  # (held: its id stays its own)
            self._size += plen
        if plen:
            self._pay_last = payload
            self._pay_last_at = at
        if boff < 0:
            boff = self._buf_at[bkey] = len(self.buffers)
            self.buffers.extend(bufs)
        if bufs:
            self._bufs_last = bufs
            self._bufs_last_at = boff
        return at, plen, boff

    def add(self, host: int, kind: int, body: bytes, payload: Buffer, bufs: Sequence[Buffer],
            pbufs: int, extra: Any = None, *, alone: bool = False) -> None:
        """One message for (from) ``host``; ``extra``: that host's own part of an entry
        shared with others (a reply's times); ``alone``: never shared."""
        at, plen, boff = self._place(payload, bufs)
        key = (kind, body, at, plen, boff, len(bufs), pbufs, extra is None)
        last = self._last.get(host, -1)
        same = None if alone else self._same.get(key)
        # A host's messages keep their order: one joins an entry only if that entry comes
        # after the host's last one (entries are delivered in order).
        if same is None or same[1] <= last:
            n = len(self.entries)
            self.entries.append([[host], kind, body, at, plen, boff, len(bufs), pbufs,
                                 None if extra is None else [extra]])
            self._last[host] = n
            if not alone:
                self._same[key] = (self.entries[n], n)
            self._grew(len(body) + ENTRY_BYTES + (EXTRA_BYTES if extra is not None else 0))
            return
        entry, n = same
        entry[0].append(host)
        self._last[host] = n
        if extra is not None:
            entry[8].append(extra)
        self._grew(HOST_BYTES + (EXTRA_BYTES if extra is not None else 0))

    def reply(self, host: int, kind: int, body: bytes, payload: bytes, extra: Any) -> None:
        """:meth:`add` of a reply with no buffers and a payload of :data:`SMALL` bytes at
        most (``bytes``): the same entries, in one call (a relay's common reply, per
        host; ``tests/test_relay_paths.py`` holds the two equal)."""
        plen = len(payload)  # (_place, inline)
        if not plen:
            at = 0
        elif payload is self._pay_last:
            at = self._pay_last_at
        else:
            at = self._pay_at.get(payload, -1)
        if self.entries and (len(self.buffers) > self.max_buffers
                             or self._data + (plen if at < 0 else 0) > self.max_bytes):
            self._close()
            at = -1 if plen else 0
        if at < 0:
            self._data += plen
            at = self._pay_at[payload] = self._size
            self._payloads.append(payload)
            self._size += plen
        if plen:
            self._pay_last = payload
            self._pay_last_at = at
        key = (kind, body, at, plen, 0, 0, 0, extra is None)
        last = self._last.get(host, -1)
        same = self._same.get(key)
        if same is None or same[1] <= last:
            n = len(self.entries)
            entry: list[Any] = [[host], kind, body, at, plen, 0, 0, 0,
                                None if extra is None else [extra]]
            self.entries.append(entry)
            self._last[host] = n
            self._same[key] = (entry, n)
            self._body += len(body) + ENTRY_BYTES + (EXTRA_BYTES if extra is not None else 0)
        else:
            entry, n = same
            entry[0].append(host)
            self._last[host] = n
            if extra is not None:
                entry[8].append(extra)
            self._body += HOST_BYTES + (EXTRA_BYTES if extra is not None else 0)
        if self._body >= self.max_body:  # (_grew, inline)
            self._close()

    def sort_shared(self) -> None:
        """List the hosts of every entry several share with no extras in order (the
        order of replies varies from call to call; a receiver that keys on a list of
        hosts finds the same list again). Within an entry order means nothing."""
        for entries in [self.entries, *(c[0] for c in self._closed)]:
            for e in entries:
                if e[8] is None and len(e[0]) > 1:
                    e[0].sort()

    def take(self) -> list[tuple[list[list[Any]], bytes, list[Buffer]]]:
        """The entries, payload and buffers of each message gathered, in order; empties
        this gather."""
        if self.entries:  # (_close, inline)
            self._closed.append((self.entries, b"".join(self._payloads), self.buffers))
            self._open()
        out, self._closed = self._closed, []
        return out


# One entry as read: hosts, kind, packed body, payload, buffers, pbufs, extras
Entry = tuple[list[int], int, bytes, Buffer, list[Buffer], int, "list[Any] | None"]


_INT = frozenset((int,))


def _ints(values: list[Any]) -> bool:
    """Whether every one of ``values`` is an ``int`` (not a bool): in C, for long lists."""
    return set(map(type, values)) <= _INT


def entry(e: Any, view: memoryview, buffers: Sequence[Buffer]) -> Entry:
    """One entry of an authenticated FORWARD or UP, read against its message's payload
    (``view``) and ``buffers``.

    Raises:
        Dropped: ``malformed``, an entry that does not describe the message's bytes.
    """
    if not (isinstance(e, list) and len(e) == 9 and isinstance(e[0], list)
            and type(e[1]) is int and type(e[2]) is bytes
            and _ints(e[3:8])
            and (e[8] is None or (isinstance(e[8], list) and len(e[8]) == len(e[0])))):
        raise Dropped("malformed", "relay entry")
    hosts, kind, packed, at, plen, boff, nbufs, pbufs, extras = e
    if (at < 0 or plen < 0 or at + plen > len(view) or boff < 0 or nbufs < 0
            or boff + nbufs > len(buffers) or not 0 <= pbufs <= nbufs
            or not _ints(hosts)):
        raise Dropped("malformed", "relay entry lengths")
    return (hosts, kind, packed, view[at:at + plen] if plen else b"",
            list(buffers[boff:boff + nbufs]), pbufs, extras)


def entries(body: Any, payload: Buffer, buffers: Sequence[Buffer]) -> Iterator[Entry]:
    """The entries of an authenticated FORWARD or UP (:func:`entry` for each).

    Raises:
        Dropped: ``malformed``, a body that is not a list, or an entry that does not
            describe the message's bytes (the entries before it were yielded).
    """
    if not isinstance(body, list):
        raise Dropped("malformed", "relay body")
    view = memoryview(payload)
    for e in body:
        yield entry(e, view, buffers)
