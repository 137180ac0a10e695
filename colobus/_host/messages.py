"""The worker's message path: frames in, to their handlers; bodies out, to its controller.

:class:`Worker` (:mod:`colobus._host.worker`) joins and leaves sessions; this part
of it reads what the session's :class:`~colobus._wire.channel.Channel` receives
(authenticated, in sequence, unbatched, parsed, dispatched by kind) and sends what
its handlers and scheduler answer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from .._wire import protocol as P
from .._wire.channel import Channel, Peer
from .._wire.envelope import Buffer, Dropped, Envelope, unpack_batch
from .._wire.failures import describe_error
from .._wire.lane import decode
from .._wire.protocol import Kind, Status

__all__ = ["Exit", "MessagePath"]

log = logging.getLogger("colobus.worker")


class Exit(Exception):
    """Leave the worker's serve loop with this exit code (from a handler)."""

    def __init__(self, code: int) -> None:
        self.code = code


class MessagePath:
    """The worker's side of one session's messages (a base of :class:`Worker`)."""

    connect: str
    dropped: dict[str, int]
    _key: bytes
    _hostname: str
    _chan: Channel | None
    _peer: Peer | None
    _joined: bool
    _last_heard: float
    _handlers: dict[int, Any]

    def _on_reset(self, env: Envelope) -> None:
        raise NotImplementedError

    # -- out ---------------------------------------------------------------------------

    def send(self, body: P.Body, payload: Buffer = b"", buffers: Sequence[Buffer] = (),
             pbufs: int = 0) -> None:
        """Send a message to this session's controller (batched while corked)."""
        if self._chan is not None and self._peer is not None:
            self._chan.send(self._peer, body, payload, buffers, pbufs)

    def cork(self) -> bool:
        return self._chan.cork() if self._chan is not None else False

    def uncork(self, corked: bool) -> None:
        if self._chan is not None:
            self._chan.uncork(corked)

    def reply_error(self, call_id: int, exc: BaseException, times: list[int] | None = None
                    ) -> None:
        """Report ``exc`` as data (type name, plain args, message, notes, traceback)."""
        self.send(P.Result(call_id, Status.ERROR, None, times or []),
                  describe_error(exc, self._hostname))

    def _send_join_raw(self, body: P.Body) -> None:
        """JOIN and HELLO: numbered outside the session's acknowledged stream."""
        assert self._chan is not None and self._peer is not None
        self._peer.send_seq += 1
        self._chan.send_raw([], Envelope(body.kind, self._peer.session, b"",
                                         self._peer.send_seq, body.to_wire()))

    # -- in ----------------------------------------------------------------------------

    def _drop(self, reason: str, detail: str = "") -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        log.debug("dropped message (%s) %s", reason, detail)

    def _on_frames(self, frames: list[Any]) -> None:
        peer = self._peer
        if peer is None:
            return
        try:
            env = decode(self._key, frames)
        except Dropped as d:
            if d.reason == "unauthenticated" and not self._joined:
                log.warning("a message from %s failed authentication: is the key the same "
                            "on both sides?", self.connect)
            self._drop(d.reason, d.detail)
            return
        if env.receiver != peer.session:
            self._drop("stale")
            return
        if not self._joined:
            if env.kind not in (Kind.WELCOME, Kind.REJECT, Kind.CHALLENGE):
                self._drop("unexpected_kind")
                return
            peer.recv_seq = env.seq - 1
        elif env.sender != peer.their_session:
            self._drop("stale")
            return
        elif env.kind == Kind.RESET:  # the controller's last word, outside the numbering
            self._on_reset(env)
            return
        try:
            got = self._chan.take(peer, env, 1 << 62) if self._chan is not None else None
            if isinstance(got, str):
                self._drop(got, f"seq {env.seq}, expecting {peer.recv_seq + 1}")
                return
            self._last_heard = time.monotonic()
            if got is None:  # an ACK, or a part of a larger message
                return
            env = got
            if env.kind != Kind.BATCH:
                self._dispatch(env)
                return
            subs = unpack_batch(env)
        except Dropped as d:
            self._drop(d.reason, d.detail)
            return
        for sub in subs:
            self._dispatch(sub)

    def _dispatch(self, env: Envelope) -> None:
        """Handle one authenticated message of this session's controller."""
        try:
            body = P.parse(env.kind, env.body)
            self._handlers[env.kind](body, env)
        except (ValueError, KeyError) as exc:
            self._drop("malformed", str(exc))
        except Exit:
            raise
        except Exception:
            log.exception("error handling %s", env.kind)
