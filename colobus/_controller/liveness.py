"""The controller's liveness tick: heartbeats out, silent hosts judged, resends.

Every ``heartbeat_interval`` the controller reads what waits, then judges each host it
serves directly (a relay judges its own: :mod:`colobus._relay.relay`). Liveness is the
host's process and link, never its Python code: a host silent past the liveness
timeout is lost only when its connection closed since it last spoke (ZeroMQ's own
heartbeats, in libzmq's I/O thread, close the connection of a process that stopped
answering: :mod:`colobus._wire.links`, :mod:`colobus._controller.hangups`); one
silent on a live link (its function holds the GIL) is waited for. A tick that comes
late means this process did not run (its loop was held, or it was frozen): that time
is nobody's silence (:mod:`colobus._wire.stalls`), and how long it was is logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .._wire import protocol as P
from .._wire.stalls import StallClock
from .hangups import link_up
from .ops import Parts

if TYPE_CHECKING:
    from .hangups import Hangups
    from .hosts import Host
    from .relays import Relays

__all__ = ["Liveness", "LivenessOwner"]

log = logging.getLogger("colobus.controller")


class LivenessOwner(Parts, Protocol):
    """What :class:`Liveness` uses of the controller."""

    @property
    def _hangups(self) -> Hangups | None: ...
    @property
    def _relays(self) -> Relays | None: ...
    @property
    def _resend_after(self) -> float: ...
    @property
    def heartbeat_interval(self) -> float: ...
    @property
    def liveness_timeout(self) -> float: ...
    def _send(self, host: Host, body: P.Body, payload: Any = b"",
              buffers: Any = (), pbufs: int = 0) -> None: ...


class Liveness:
    """The tick's state: when it last ran, and the hosts said to be silent on a live link.

    Args:
        ctl: the controller.
        lose: declares a host lost, with why (``Sessions.lose``).
        flush: runs before each judgement (rate-limited warnings, said now).
    """

    def __init__(self, ctl: LivenessOwner, lose: Callable[[Host, str], None],
                 flush: Callable[[], None]) -> None:
        self._ctl = ctl
        self._lose = lose
        self._flush = flush
        self._stalls = StallClock(ctl.heartbeat_interval)
        self._last_tick = time.monotonic()
        self._quiet: set[int] = set()  # hosts silent on a live link, said once each time

    def start(self) -> None:
        """The clock starts with liveness: the time between building the controller and
        starting it was no stall (hosts that join at once are judged from then on)."""
        self._stalls = StallClock(self._ctl.heartbeat_interval)
        self._last_tick = time.monotonic()

    def forget(self, host: Host) -> None:
        """``host`` was lost."""
        self._quiet.discard(host.index)

    def tick(self) -> None:
        """Heartbeats out, lost hosts declared, unacknowledged messages resent.

        A host is lost when it has been silent past the liveness timeout and its link
        does not prove it alive (its connection closed since it last spoke: ZeroMQ's
        heartbeats close the connection of a process that stopped answering, see
        :mod:`colobus._wire.links`); a host silent on a live link (its Python code holds
        the GIL) is waited for. One that talks but acknowledges nothing for the timeout
        is lost too: only the time it talked counts.
        """
        ctl = self._ctl
        chan = ctl._chan
        assert chan is not None
        # Read what already arrived before judging silence: a loop that was busy
        # (a large pickle, a GC pause) must not declare live hosts lost.
        chan.drain()
        hangups = ctl._hangups
        if hangups is not None:
            hangups.read()  # and the connections that closed meanwhile
        self._flush()
        now = time.monotonic()
        frozen = self._stalls.frozen(now)  # this process did not run: nobody's silence
        elapsed, self._last_tick = now - self._last_tick, now
        if frozen:
            self._held(elapsed)
        live = ctl.liveness_timeout
        alive = []
        if ctl._relays is not None:
            ctl._relays.tick(frozen)
        for h in ctl._hosts.alive():
            if h.peer.via is not None:
                continue  # its relay judges its silence and sends its heartbeats
            peer = h.peer
            if frozen:  # (never past now: what the drain just read is heard now)
                h.last_seen = min(h.last_seen + frozen, now)
            if peer.unacked:
                if h.last_seen < now - elapsed:  # it said nothing since the last tick: it
                    peer.ack_wait = min(peer.ack_wait + elapsed, now)  # could not
                    # acknowledge either (stopped, its GIL held)
                elif frozen:
                    peer.ack_wait = min(peer.ack_wait + frozen, now)
            silent = now - h.last_seen
            waited = now - peer.ack_wait if peer.unacked else 0.0
            if silent > live and not link_up(h, hangups):
                self._lose(h, f"no message for {silent:.1f} s")
            elif waited > live:
                # It talks but takes nothing in: as good as silent (what we keep for it
                # stays bounded by the window meanwhile).
                self._lose(h, f"it acknowledged nothing for {waited:.1f} s")
            else:
                if silent > live:
                    self._silent_on_live_link(h, silent)
                elif h.index in self._quiet:
                    self._quiet.discard(h.index)
                    log.info("host %d (%r) speaks again", h.index, h.name)
                ctl._send(h, P.Heartbeat(0, 0, 0, 0, time.monotonic_ns()))
                alive.append(peer)
        chan.resend_stale(alive, ctl._resend_after)

    def _held(self, elapsed: float) -> None:
        """This loop ran no tick for ``elapsed`` s: say so once it runs again."""
        held = elapsed - self._ctl.heartbeat_interval
        level = (logging.WARNING if held >= self._ctl.liveness_timeout else
                 logging.INFO if held >= 1.0 else logging.DEBUG)  # (a loaded machine's lag)
        log.log(level, "the controller's event loop did not run for %.1f s (code on it held "
                "it: a long computation, input(), a debugger; or the process was stopped); "
                "hosts stay: liveness is their links', and no host was judged on that time. "
                "Run long blocking work with `await asyncio.to_thread(...)` to keep the loop "
                "running", held)

    def _silent_on_live_link(self, host: Host, silent: float) -> None:
        if host.index not in self._quiet:
            self._quiet.add(host.index)
            log.warning("host %d (%r): no message for %.1f s, but its connection is alive "
                        "(its I/O thread answers): kept. Its Python code holds the GIL or "
                        "its event loop (a long native call?); calls wait for it",
                        host.index, host.name, silent)
