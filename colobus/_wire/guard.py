"""Bounds on what peers can make the controller hold or log: join challenges,
size-capped tables, rate-limited warnings about peers that fail authentication and
about refused joins, and peers' strings shown so that they cannot forge a log line.

Everything here is per controller and bounded whatever peers send: a table
never holds more than its capacity (the oldest entry goes first), challenges
expire, and warnings about unauthenticated peers are one line, then one summary
per interval, whatever the number of peers.
"""

from __future__ import annotations

import collections
import logging
import re
import secrets
import time
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import msgpack

__all__ = ["RESET_SEQ", "BoundedDict", "Challenges", "PeerWarnings", "Refusals", "join_key_id",
           "shown"]

RESET_SEQ = 1 << 62  # sequence number of a RESET: above any a session reaches

_PLAIN = re.compile(r"[0-9A-Za-z._+-]{1,64}")


def shown(text: object) -> str:
    """A peer's string as a log line shows it: as it is where it is a plain token (a
    version such as ``0.4.35``, a platform), else quoted (``repr``), so newlines and
    escape codes a worker sends cannot forge lines or colour a terminal."""
    if isinstance(text, str) and _PLAIN.fullmatch(text):
        return text
    return repr(text)


_KEY_ID = re.compile(rb"[0-9a-f]{8}")
_JOIN = 18  # (protocol.Kind.JOIN: the guard reads bytes only)


def join_key_id(frames: Sequence[Any]) -> str | None:
    """The key id a JOIN that failed authentication says its worker holds, or None.

    A worker's JOIN carries its key id (:func:`colobus._wire.keys.key_id`, 8 hex
    digits, never the key) as its payload, so that a controller that cannot
    authenticate it can say it holds another key and name both. Read without trust,
    only to name it in a line: a small header parsed with every count bounded, a
    payload shown only when it is 8 hex digits. Anyone can claim any id; a claim
    costs no more than any unauthenticated message.
    """
    if len(frames) != 3:
        return None
    header, payload = (f.bytes if hasattr(f, "bytes") else bytes(f) for f in frames[:2])
    if len(header) > 256 or not _KEY_ID.fullmatch(payload):
        return None
    try:
        fields = msgpack.unpackb(header, raw=False, max_bin_len=64, max_str_len=64,
                                 max_array_len=16, max_map_len=0, max_ext_len=0)
    except Exception:  # (msgpack raises several types on garbage)
        return None
    if not isinstance(fields, list) or len(fields) < 2 or fields[1] != _JOIN:
        return None
    return payload.decode()


K = TypeVar("K")
V = TypeVar("V")

NONCE_BYTES = 16


class BoundedDict(collections.OrderedDict[K, V], Generic[K, V]):
    """A dict that forgets its oldest entries beyond ``capacity``."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.capacity:
            self.popitem(last=False)


class Challenges:
    """Join challenges: a fresh random nonce per connecting worker, used once.

    The controller hands one out in answer to an authenticated JOIN; the
    worker's HELLO must carry it (inside the MAC) from the same connection and
    session. A nonce lives ``ttl`` seconds (monotonic clock: no wall clocks, no
    clock skew between machines), and at most ``capacity`` are outstanding (a
    flood of JOINs evicts the oldest, never grows the table).
    """

    def __init__(self, capacity: int = 1024, ttl: float = 30.0) -> None:
        self.capacity = capacity
        self.ttl = ttl
        self._open: collections.OrderedDict[bytes, tuple[bytes, bytes, float]] = (
            collections.OrderedDict())  # nonce -> (identity, worker session, expiry)

    def __len__(self) -> int:
        return len(self._open)

    def issue(self, identity: bytes, session: bytes) -> bytes:
        """A new nonce for the worker session ``session`` on connection ``identity``."""
        now = time.monotonic()
        self._expire(now)
        while len(self._open) >= self.capacity:
            self._open.popitem(last=False)
        nonce = secrets.token_bytes(NONCE_BYTES)
        self._open[nonce] = (identity, session, now + self.ttl)
        return nonce

    def take(self, identity: bytes, session: bytes, nonce: bytes) -> bool:
        """True (once) if ``nonce`` was issued to this connection and session and is fresh."""
        self._expire(time.monotonic())
        entry = self._open.get(nonce)
        if entry is None or entry[0] != identity or entry[1] != session:
            return False
        del self._open[nonce]
        return True

    def _expire(self, now: float) -> None:
        # Insertion order is expiry order (one ttl for all).
        while self._open:
            nonce, (_, _, expiry) = next(iter(self._open.items()))
            if expiry > now:
                return
            del self._open[nonce]


class PeerWarnings:
    """Warnings about peers whose messages fail authentication or speak another version.

    The first is logged at once; after that at most one summary line per
    ``interval`` seconds says how many more were dropped, from how many peers
    (counted up to a bound). The per-reason counts are in ``ctl.stats()``.
    """

    def __init__(self, log: logging.Logger, interval: float = 60.0) -> None:
        self.log = log
        self.interval = interval
        self._last: float | None = None
        self._pending: collections.Counter[str] = collections.Counter()
        self._peers: BoundedDict[bytes, None] = BoundedDict(1024)
        self.suppressed = 0

    def note(self, reason: str, identity: bytes, detail: str) -> None:
        now = time.monotonic()
        if self._last is None:
            self._last = now
            self.log.warning(
                "dropping %s messages from peer %s%s (further ones are summarised every "
                "%.0f s)", reason, identity.hex(), f": {detail}" if detail else "",
                self.interval)
            return
        self.suppressed += 1
        self._pending[reason] += 1
        self._peers[identity] = None
        self.flush(now)

    def flush(self, now: float | None = None) -> None:
        """Log the summary if one is due (the controller calls this every heartbeat)."""
        now = time.monotonic() if now is None else now
        if not self._pending or self._last is None or now - self._last < self.interval:
            return
        self.log.warning(
            "dropped %s from %d peer(s) in the last %.0f s",
            ", ".join(f"{n} {r}" for r, n in sorted(self._pending.items())),
            len(self._peers), now - self._last)
        self._last = now
        self._pending.clear()
        self._peers.clear()


class Refusals:
    """Log lines about joins the controller refused, rate-limited: the first at once,
    then at most one line per ``interval`` seconds, saying how many more were refused
    and the last one's reason (a worker that retries, or many, make one line a minute).
    The lines quote what the worker sent (its name, host name, versions)."""

    def __init__(self, log: logging.Logger, interval: float = 60.0) -> None:
        self.log = log
        self.interval = interval
        self._last: float | None = None
        self._pending = 0
        self._latest = ""
        self.count = 0

    def note(self, line: str) -> None:
        """A join was refused: ``line`` says whose and why (its worker strings quoted)."""
        self.count += 1
        now = time.monotonic()
        if self._last is None or (not self._pending and now - self._last >= self.interval):
            self._last = now
            self.log.warning("%s (further refusals are summarised every %.0f s)", line,
                             self.interval)
            return
        self._pending += 1
        self._latest = line
        self.flush(now)

    def flush(self, now: float | None = None) -> None:
        """Log the summary if one is due (the controller calls this every heartbeat)."""
        now = time.monotonic() if now is None else now
        if not self._pending or self._last is None or now - self._last < self.interval:
            return
        self.log.warning("%d more joins refused in the last %.0f s; the last: %s",
                         self._pending, now - self._last, self._latest)
        self._last = now
        self._pending = 0
        self._latest = ""
