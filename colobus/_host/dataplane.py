"""The host's data plane: blocks that go on from host to host down a broadcast tree.

A block that many hosts need (a replicated ``device_put``) leaves the controller
a bounded number of times (:mod:`colobus._api.treeput`): the controller sends it
to a few roots over their authenticated links, and every host serves it on to
its children from its own data socket, chunk by chunk, as the chunks arrive.

Nothing on these links is authenticated by a MAC, and nothing needs to be: a
child asks with a token that the controller gave it over its authenticated link,
a parent serves only the tokens the controller gave *it*, and every chunk a child
takes must match the SHA-256 digest the controller sent it over that link. A
relay can delay a block (the controller then sends it directly: a lost relay), but
it cannot change it, and it cannot make a host take bytes the controller did not
send. Chunks are raw bytes, never unpickled.

Frames (no envelope)::

    request  [b"G", token (16 bytes), chunk index (4 bytes, big-endian)]
    reply    [b"D", token, chunk index, the chunk's bytes]

One thread (``colobus-data``) owns every socket here: the ROUTER children ask, and
one DEALER per block this host pulls from its parent. The worker's loop thread
talks to it through commands (:meth:`DataPlane.offer`, ``pull``, ``fill``,
``drop``, ``clear``); a finished pull is reported through ``on_done`` on this
thread (the worker hands it to its loop).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from .._wire.endpoint import Endpoint, data_address
from .._wire.protocol import TOKEN_BYTES

__all__ = ["Blob", "DataPlane", "start_dataplane"]

log = logging.getLogger("colobus.host.dataplane")

WINDOW = 4  # chunks a child asks its parent for ahead
# A request unanswered this long is asked again. Over a live connection nothing is lost
# (ZeroMQ may drop what was queued when a connection breaks): a parent that is slow
# because its own parent is must not get every request again and answer it twice.
RETRY_S = 5.0
PARKED_MAX = 4096  # requests for tokens not offered yet (the parent's TREEPUT may lag)
PARKED_TTL_S = 30.0
_IDX = struct.Struct(">I")


class Blob:
    """One block's bytes on this host: whole (a root's frame), or the chunks as they came
    (views on the received frames: nothing is copied on the way through)."""

    __slots__ = ("buf", "chunk", "count", "digests", "have", "missing", "nbytes", "parts",
                 "waiting")

    def __init__(self, nbytes: int, chunk: int, digests: list[bytes],
                 buf: memoryview | None = None) -> None:
        self.chunk = chunk
        self.count = max(1, -(-nbytes // chunk))
        self.digests = digests
        self.nbytes = nbytes
        self.buf = buf  # the whole block, or None: the chunks are in ``parts``
        self.parts: list[memoryview | None] = [None] * self.count
        self.have = [buf is not None] * self.count
        self.missing = 0 if buf is not None else self.count
        self.waiting: dict[int, list[tuple[bytes, bytes]]] = {}  # index -> [(identity, token)]

    def part(self, i: int) -> memoryview:
        if self.buf is not None:
            return self.buf[i * self.chunk:(i + 1) * self.chunk]
        part = self.parts[i]
        assert part is not None
        return part

    def part_size(self, i: int) -> int:
        return min(self.chunk, self.nbytes - i * self.chunk)

    def chunks(self) -> list[memoryview]:
        """The block's bytes as its chunks, in order (once it is whole)."""
        if self.buf is not None:
            return [self.part(i) for i in range(self.count)]
        return [p for p in self.parts if p is not None]


class _Pull:
    """A block this host takes from its parent."""

    __slots__ = ("asked", "blob", "last", "next", "on_done", "ref", "sock", "token")

    def __init__(self, ref: int, sock: zmq.Socket[Any], token: bytes, blob: Blob,
                 on_done: Callable[[], None]) -> None:
        self.ref = ref
        self.sock = sock
        self.token = token
        self.blob = blob
        self.on_done = on_done
        self.next = 0
        self.asked: set[int] = set()
        self.last = time.monotonic()


class DataPlane:
    """The data socket of one worker and the thread that serves and pulls blocks."""

    def __init__(self, ctx: zmq.Context[Any], bind: str) -> None:
        self._ctx = ctx
        self._cmds: collections.deque[tuple[Any, ...]] = collections.deque()
        self._lock = threading.Lock()  # the drop counters (the heartbeat reads them)
        self._dropped: collections.Counter[str] = collections.Counter()
        wake = f"inproc://colobus-data-{id(self):x}"
        self._wake_rx: zmq.Socket[Any] = ctx.socket(zmq.PULL)
        self._wake_rx.bind(wake)
        self._wake_tx: zmq.Socket[Any] = ctx.socket(zmq.PUSH)
        self._wake_tx.connect(wake)
        router: zmq.Socket[Any] = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.MAXMSGSIZE, 64)  # requests are 21 bytes; floods stay small
        try:
            router.bind(bind)
        except zmq.ZMQError:
            router.close(0)
            self._wake_rx.close(0)
            self._wake_tx.close(0)
            raise
        self._router = router
        self.endpoint: str = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._offers: dict[bytes, Blob] = {}  # token -> blob, for the children
        self._offered: dict[int, list[bytes]] = {}  # ref -> its tokens
        self._blobs: dict[int, Blob] = {}  # ref -> blob
        self._pulls: dict[int, _Pull] = {}  # ref -> pull
        self._parked: dict[bytes, list[tuple[float, bytes, int]]] = {}
        self._n_parked = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="colobus-data", daemon=True)
        self._thread.start()

    # -- the loop thread's side ---------------------------------------------------------------

    def offer(self, ref: int, tokens: list[bytes], blob: Blob) -> None:
        """Serve ``blob`` to whoever asks with one of ``tokens``."""
        self._command("offer", ref, tokens, blob)

    def pull(self, ref: int, endpoint: str, token: bytes, blob: Blob,
             on_done: Callable[[], None]) -> None:
        """Fill ``blob`` from ``endpoint``; ``on_done()`` (on the data thread) once whole."""
        self._command("pull", ref, endpoint, token, blob, on_done)

    def fill(self, ref: int, buf: memoryview) -> None:
        """Block ``ref`` came whole another way: serve it from ``buf``, stop pulling."""
        self._command("fill", ref, buf)

    def drop(self, ref: int) -> None:
        """Stop serving and pulling block ``ref``."""
        self._command("drop", ref)

    def clear(self) -> None:
        """Drop every block (the session ended)."""
        self._command("clear")

    def dropped(self) -> dict[str, int]:
        """What the data socket dropped, by reason (any thread)."""
        with self._lock:
            return dict(self._dropped)

    def close(self) -> None:
        self._stop = True
        self._command("stop")
        self._thread.join(timeout=5.0)
        self._wake_tx.close(0)

    def _command(self, *cmd: Any) -> None:
        self._cmds.append(cmd)
        try:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:  # the wake queue is full: the thread has work already
            pass

    # -- the data thread ------------------------------------------------------------------------

    def _drop(self, reason: str) -> None:
        with self._lock:
            self._dropped[reason] += 1

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        poller.register(self._router, zmq.POLLIN)
        self._poller = poller
        try:
            while not self._stop:
                events = dict(poller.poll(200 if (self._pulls or self._parked) else 1000))
                if self._wake_rx in events:
                    self._drain_wake()
                    while self._cmds and not self._stop:
                        self._do(*self._cmds.popleft())
                if self._stop:
                    break
                if self._router in events:
                    self._serve()
                for pull in list(self._pulls.values()):
                    if pull.sock in events:
                        self._take(pull)
                self._tick(time.monotonic())
        except Exception:  # never silently: a dead data thread stalls puts (the relay is lost)
            log.exception("the data plane thread failed")
        finally:
            for pull in self._pulls.values():
                pull.sock.close(0)
            self._pulls.clear()
            self._router.close(0)
            self._wake_rx.close(0)
            if self.endpoint.startswith("ipc://"):  # libzmq may not unlink it before we exit
                try:
                    os.unlink(self.endpoint[6:])
                except OSError:
                    pass

    def _drain_wake(self) -> None:
        while True:
            try:
                self._wake_rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _do(self, what: str, *args: Any) -> None:
        if what == "offer":
            ref, tokens, blob = args
            self._blobs[ref] = blob
            self._offered.setdefault(ref, []).extend(tokens)
            for token in tokens:
                self._offers[token] = blob
                for _, ident, i in self._parked.pop(token, ()):
                    self._n_parked -= 1
                    self._ask_for(ident, token, i, blob)
        elif what == "pull":
            ref, endpoint, token, blob, on_done = args
            self._blobs[ref] = blob
            sock: zmq.Socket[Any] = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, blob.chunk + 1024)
            sock.connect(endpoint)
            pull = self._pulls[ref] = _Pull(ref, sock, token, blob, on_done)
            self._poller.register(sock, zmq.POLLIN)
            self._ask(pull)
        elif what == "fill":
            ref, buf = args
            self._end_pull(ref)
            blob = self._blobs.get(ref)
            if blob is not None and blob.missing:
                blob.buf = buf
                blob.have = [True] * blob.count
                blob.missing = 0
                for i in list(blob.waiting):
                    self._serve_waiting(blob, i)
        elif what == "drop":
            (ref,) = args
            self._forget(ref)
        elif what == "clear":
            for ref in list(self._blobs):
                self._forget(ref)
            self._parked.clear()
            self._n_parked = 0

    def _forget(self, ref: int) -> None:
        self._end_pull(ref)
        self._blobs.pop(ref, None)
        for token in self._offered.pop(ref, ()):
            self._offers.pop(token, None)

    def _end_pull(self, ref: int) -> None:
        pull = self._pulls.pop(ref, None)
        if pull is not None:
            self._poller.unregister(pull.sock)
            pull.sock.close(0)

    # serving children

    def _serve(self) -> None:
        router = self._router
        for _ in range(1024):  # then let the pulls and commands have a turn
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if (len(frames) != 4 or frames[1] != b"G" or len(frames[2]) != TOKEN_BYTES
                    or len(frames[3]) != _IDX.size):
                self._drop("data_malformed")
                continue
            ident, _, token, raw = frames
            (i,) = _IDX.unpack(raw)
            blob = self._offers.get(token)
            if blob is None:
                self._park(ident, token, i)
            else:
                self._ask_for(ident, token, i, blob)

    def _park(self, ident: bytes, token: bytes, i: int) -> None:
        """A request for a token not offered (yet: this host's TREEPUT may come later)."""
        if self._n_parked >= PARKED_MAX:
            self._drop("data_unknown_token")
            return
        parked = self._parked.setdefault(token, [])
        if any(p_ident == ident and p_i == i for _, p_ident, p_i in parked):
            return  # asked again: answered once
        parked.append((time.monotonic(), ident, i))
        self._n_parked += 1

    def _ask_for(self, ident: bytes, token: bytes, i: int, blob: Blob) -> None:
        if not 0 <= i < blob.count:
            self._drop("data_malformed")
        elif blob.have[i]:
            self._send_part(ident, token, i, blob)
        else:
            waiting = blob.waiting.setdefault(i, [])
            if (ident, token) not in waiting:  # asked again: answered once
                waiting.append((ident, token))

    def _send_part(self, ident: bytes, token: bytes, i: int, blob: Blob) -> None:
        try:
            self._router.send_multipart([ident, b"D", token, _IDX.pack(i), blob.part(i)],
                                        zmq.NOBLOCK, copy=False)
        except zmq.Again:  # that child's queue is full; it asks again
            self._drop("data_full")
        except zmq.ZMQError:
            self._drop("data_send_failed")

    def _serve_waiting(self, blob: Blob, i: int) -> None:
        for ident, token in blob.waiting.pop(i, ()):
            if self._offers.get(token) is blob:
                self._send_part(ident, token, i, blob)

    # pulling from the parent

    def _ask(self, pull: _Pull) -> None:
        blob = pull.blob
        while len(pull.asked) < WINDOW and pull.next < blob.count:
            i = pull.next
            pull.next += 1
            if blob.have[i]:
                continue
            self._request(pull, i)
            pull.asked.add(i)

    def _request(self, pull: _Pull, i: int) -> None:
        try:
            pull.sock.send_multipart([b"G", pull.token, _IDX.pack(i)], zmq.NOBLOCK)
        except zmq.ZMQError:  # not connected yet, or full: asked again on the next tick
            pass

    def _take(self, pull: _Pull) -> None:
        for _ in range(64):
            try:
                frames = pull.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if self._pulls.get(pull.ref) is not pull:
                return
            self._take_part(pull, frames)
            if pull.blob.missing == 0:
                return

    def _take_part(self, pull: _Pull, frames: list[Any]) -> None:
        blob = pull.blob
        if (len(frames) != 4 or frames[0].bytes != b"D" or frames[1].bytes != pull.token
                or len(frames[2]) != _IDX.size):
            self._drop("data_malformed")
            return
        (i,) = _IDX.unpack(frames[2].bytes)
        if not 0 <= i < blob.count:
            self._drop("data_malformed")
            return
        if blob.have[i]:
            self._drop("data_duplicate")  # asked again, answered twice
            return
        data = frames[3].buffer
        if len(data) != blob.part_size(i) or hashlib.sha256(data).digest() != blob.digests[i]:
            self._drop("data_bad_chunk")  # asked again after RETRY_S
            return
        blob.parts[i] = data  # the frame stays alive under it
        blob.have[i] = True
        blob.missing -= 1
        pull.asked.discard(i)
        pull.last = time.monotonic()
        self._serve_waiting(blob, i)
        if blob.missing == 0:
            self._end_pull(pull.ref)
            pull.on_done()
        else:
            self._ask(pull)

    def _tick(self, now: float) -> None:
        for pull in self._pulls.values():
            if now - pull.last >= RETRY_S:
                pull.last = now
                for i in sorted(pull.asked):
                    self._request(pull, i)
                self._ask(pull)
        if self._parked:
            for token in [t for t, reqs in self._parked.items() if now - reqs[0][0] > PARKED_TTL_S]:
                self._n_parked -= len(self._parked.pop(token))
                self._drop("data_unknown_token")


def _local_address(host: str, port: int) -> str:
    """The address of this machine's interface that reaches ``host`` (no packet sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port or 9))
        return str(s.getsockname()[0])


def start_dataplane(loop: asyncio.AbstractEventLoop, ctx: zmq.Context[Any],
                    endpoint: Endpoint, curve: bool,
                    ready: Callable[[DataPlane | None], None]) -> None:
    """Start this worker's data plane and hand it to ``ready`` (on the loop thread): now,
    or, where finding the address means a name lookup (which may wait on DNS), from a
    thread once found, so the first join never waits for it."""
    import ipaddress

    chosen = os.environ.get("COLOBUS_DATA_ADDRESS", "").strip()
    try:  # an address given (or none wanted): nothing to look up
        given = chosen == "off" or bool(data_address(chosen)[0])
    except ValueError:
        given = True  # _start says what is wrong with it
    lookup = endpoint.transport == "tcp" and not given
    if lookup:
        try:
            ipaddress.ip_address(endpoint.host)
            lookup = False
        except ValueError:
            pass
    if not lookup:
        ready(_start(ctx, endpoint, curve))
        return
    loop.run_in_executor(None, _start, ctx, endpoint, curve).add_done_callback(
        lambda fut: ready(None if fut.cancelled() or fut.exception() else fut.result()))


def _start(ctx: zmq.Context[Any], endpoint: Endpoint, curve: bool) -> DataPlane | None:
    """This worker's data plane, bound where other hosts can reach it, or None.

    ``$COLOBUS_DATA_ADDRESS`` names the address to bind and announce, with a port to pin
    it to (``ADDRESS``, ``ADDRESS:PORT``, ``:PORT``, ``[IPV6]:PORT``; ``off``: no data
    plane); by default, the address of the interface that reaches the controller, on an
    ephemeral port (an ``ipc://`` controller: an ``ipc://`` path beside it). Under
    CurveZMQ there is none: the data plane is not encrypted, so blocks keep to the
    encrypted links (the star).
    """
    import secrets
    import tempfile

    chosen = os.environ.get("COLOBUS_DATA_ADDRESS", "").strip()
    if curve or chosen == "off":
        return None
    try:
        if endpoint.transport == "ipc" and not chosen:
            path = os.path.join(tempfile.gettempdir(),
                                f"colobus-data-{os.getpid()}-{secrets.token_hex(4)}")
            bind = f"ipc://{path}"
        else:
            address, port = data_address(chosen)
            address = address or _local_address(endpoint.host, endpoint.port)
            bind = f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"
        plane = DataPlane(ctx, bind)
    except (OSError, ValueError, zmq.ZMQError) as exc:
        log.warning("no data plane (%s): replicated blocks come from the controller", exc)
        return None
    log.info("data plane at %s (other hosts fetch broadcast blocks here; "
             "$COLOBUS_DATA_ADDRESS sets it)", plane.endpoint)
    return plane
