"""What the controller and its relays say to each other.

A relay (:mod:`colobus._relay`) carries many hosts' sessions for the controller:
it numbers, authenticates and acknowledges each host's messages the way the
controller would, and talks to the controller in few, large messages:

* FORWARD (controller to relay): messages for the hosts it carries, as entries
  ``[hosts, kind, body, payload offset, payload length, first buffer, buffers,
  pbufs, extras]``; a message several hosts get the same (a fan-out's frees,
  its shared argument payload) travels once.
* UP (relay to controller): its hosts' messages, authenticated, in the same
  entries; equal RESULTs of one call from several hosts are one entry, with
  each host's ``times`` in ``extras``.
* ADOPT, GONE, READY: a host joined and moves to the relay; a host the relay
  no longer carries (either side); the relay is up, at this endpoint.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from . import protocol as P
from .envelope import Buffer, Dropped

__all__ = ["NEVER_REACHED", "Adopt", "Entry", "Gather", "Gone", "Ready", "entries"]

SMALL = 4096  # payloads up to this size are shared by value (replies), larger by identity


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
    ``reason``, a protocol violation's counter, or "" (silence)."""

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
class Ready(P.Body):
    kind = P.Kind.READY
    types = (str,)
    endpoint: str


def _nbytes(b: Buffer) -> int:
    return len(b) if type(b) is bytes else memoryview(b).nbytes


class Gather:
    """Messages for (or from) many hosts, gathered into one message's entries."""

    def __init__(self) -> None:
        self.entries: list[list[Any]] = []
        self.buffers: list[Buffer] = []
        self._same: dict[tuple[Any, ...], tuple[list[Any], int]] = {}
        self._last: dict[int, int] = {}  # host -> the index of its last entry
        self._payloads: list[Buffer] = []
        self._size = 0
        self._pay_at: dict[Any, int] = {}
        self._buf_at: dict[tuple[int, ...], int] = {}
        self._pay_last: Any = None  # the last payload and buffers added, and where they
        self._bufs_last: Any = None  # went: a fan-out adds the same objects per host
        self._pay_last_at = self._bufs_last_at = 0

    def __bool__(self) -> bool:
        return bool(self.entries)

    def add_many(self, hosts: list[int], kind: int, body: bytes, payload: Buffer,
                 bufs: Sequence[Buffer], pbufs: int) -> None:
        """The same message for each of ``hosts`` (a fan-out): one new entry, after every
        host's earlier ones; per host only its place is noted (in C)."""
        at, plen, boff = self._place(payload, bufs)
        n = len(self.entries)
        entry = [hosts, kind, body, at, plen, boff, len(bufs), pbufs, None]
        self.entries.append(entry)
        self._same[(kind, body, at, plen, boff, len(bufs), pbufs, True)] = (entry, n)
        self._last.update(dict.fromkeys(hosts, n))

    def _place(self, payload: Buffer, bufs: Sequence[Buffer]) -> tuple[int, int, int]:
        """Where ``payload`` and ``bufs`` sit in the message (each added once): the
        payload's offset and length, the first buffer's index."""
        plen = _nbytes(payload)
        at = 0
        if plen:
            if payload is self._pay_last:
                at = self._pay_last_at
            else:
                pkey: Any = bytes(payload) if plen <= SMALL else id(payload)
                found = self._pay_at.get(pkey)
                if found is None:
                    found = self._pay_at[pkey] = self._size
                    self._payloads.append(payload)  # (held: its id stays its own)
                    self._size += plen
                at = self._pay_last_at = found
                self._pay_last = payload
        boff = 0
        if bufs:
            if bufs is self._bufs_last:
                boff = self._bufs_last_at
            else:
                bkey = tuple(map(id, bufs))
                bfound = self._buf_at.get(bkey)
                if bfound is None:
                    bfound = self._buf_at[bkey] = len(self.buffers)
                    self.buffers.extend(bufs)
                boff = self._bufs_last_at = bfound
                self._bufs_last = bufs
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
            return
        entry, n = same
        entry[0].append(host)
        self._last[host] = n
        if extra is not None:
            entry[8].append(extra)

    def take(self) -> tuple[list[list[Any]], bytes, list[Buffer]]:
        """The entries, payload and buffers of one message; empties this gather."""
        out = self.entries, b"".join(self._payloads), self.buffers
        self.__init__()  # type: ignore[misc]
        return out


# One entry as read: hosts, kind, packed body, payload, buffers, pbufs, extras
Entry = tuple[list[int], int, bytes, Buffer, list[Buffer], int, "list[Any] | None"]


_INT = frozenset((int,))


def _ints(values: list[Any]) -> bool:
    """Whether every one of ``values`` is an ``int`` (not a bool): in C, for long lists."""
    return set(map(type, values)) <= _INT


def entries(body: Any, payload: Buffer, buffers: Sequence[Buffer]) -> Iterator[Entry]:
    """The entries of an authenticated FORWARD or UP.

    Raises:
        Dropped: ``malformed``, an entry that does not describe the message's bytes.
    """
    if not isinstance(body, list):
        raise Dropped("malformed", "relay body")
    view = memoryview(payload)
    for e in body:
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
        yield (hosts, kind, packed, view[at:at + plen] if plen else b"",
               list(buffers[boff:boff + nbufs]), pbufs, extras)
