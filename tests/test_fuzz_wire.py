"""Wire-level fuzzing of a running controller and a running worker.

Raw pyzmq sockets throw random multipart messages, truncated and oversized
frames, messages with a wrong key, messages with a valid MAC but the wrong
kind, session or sequence number (replays) at a live controller and a live
worker. Neither crashes, both keep serving, ``stats()["dropped"]`` (resp. the
worker's answers) show what was dropped, and a payload whose unpickling would
create a file is never unpickled: not without the key, and not with the key
outside a session either.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import random
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq

import colobus as cb
from colobus._wire import protocol as P
from colobus._wire.envelope import Envelope, decode, encode
from colobus._wire.protocol import Kind
from colobus._wire.versions import local_versions

N_RANDOM = 1500


class _Touch:
    """Unpickling this creates a file: the canary for "nothing was unpickled"."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (self.path,))


@cb.colocated_python
def double(x: Any) -> Any:
    return x * 2


def _random_frames(rng: random.Random, max_frames: int = 6, max_len: int = 80) -> list[bytes]:
    return [rng.randbytes(rng.randint(0, max_len)) for _ in range(rng.randint(1, max_frames))]


def _wait_until(pred: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _frames(key: bytes, kind: int, sender: bytes, receiver: bytes, seq: int, body: Any,
            payload: bytes = b"") -> list[bytes]:
    return [bytes(f) for f in encode(key, Envelope(int(kind), sender, receiver, seq, body,
                                                   payload))]


@pytest.fixture
def fuzz_cluster() -> Iterator[cb.Controller]:
    # Incoming messages over 2 MiB are refused (ZMQ_MAXMSGSIZE: the sender is
    # disconnected); headers over 1 MiB are dropped and counted as oversized.
    with cb.local_cluster(hosts=1, devices_per_host=2, max_message_bytes=2 << 20) as ctl:
        ctl._expected_hosts = 2  # room for the test's fake host: hosts=N bounds live hosts
        yield ctl


def test_fuzz_controller(fuzz_cluster: cb.Controller, tmp_path: pathlib.Path) -> None:
    ctl = fuzz_cluster
    key = ctl._key
    canary = tmp_path / "unpickled-on-controller"
    evil = pickle.dumps(_Touch(canary))
    rng = random.Random(1234)
    zctx = zmq.Context()
    raw = zctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(ctl.address)
    fake = zctx.socket(zmq.DEALER)
    fake.setsockopt(zmq.LINGER, 0)
    fake.connect(ctl.address)
    try:
        # 1. Random garbage: any number of frames of any bytes.
        for _ in range(N_RANDOM):
            raw.send_multipart(_random_frames(rng))
        # 2. Well-formed envelopes under a wrong key, carrying the canary.
        bad_key = secrets.token_bytes(32)
        for kind in Kind:
            raw.send_multipart(_frames(bad_key, kind, b"s" * 16, ctl._session, 1, [], evil))
        # 3. Valid MAC (a key holder) but from no session: never unpickled.
        for kind in (Kind.RESULT, Kind.CODE, Kind.CALL, Kind.HEARTBEAT):
            raw.send_multipart(_frames(key, kind, b"u" * 16, ctl._session, 5,
                                       [1, 1, None], evil))
        # 4. Truncated envelopes: each frame cut short, frames missing.
        good = _frames(key, Kind.HEARTBEAT, b"t" * 16, ctl._session, 1, [0, 0, 0, 0])
        for i in range(3):
            cut = list(good)
            cut[i] = cut[i][: len(cut[i]) // 2]
            raw.send_multipart(cut)
            raw.send_multipart(good[:i + 1])
        # 5. Oversized: a 1.5 MiB header (dropped, counted), a 3 MiB frame (refused
        # by ZeroMQ: this socket is disconnected, then reconnects by itself).
        raw.send_multipart([rng.randbytes(3 << 19), b"", b"m" * 32])
        raw.send_multipart([b"x" * (3 << 20), b"", b"m" * 32])

        # 6. A key holder that joins (JOIN, CHALLENGE, HELLO with the nonce), then
        # misbehaves: replays and stale messages are dropped; a RESULT for a call it
        # was never sent breaks the protocol, so the host is dropped (not unpickled).
        sess = secrets.token_bytes(16)
        fake.send_multipart(_frames(key, Kind.JOIN, sess, b"", 1, []))
        assert fake.poll(30_000), "the controller did not answer a JOIN"
        challenge = decode(key, fake.recv_multipart())
        assert challenge.kind == Kind.CHALLENGE and challenge.receiver == sess
        nonce = challenge.body[0]
        hello = P.Hello("fuzz-fake", 1, "nowhere", [], nonce, "", local_versions()).to_wire()
        fake.send_multipart(_frames(key, Kind.HELLO, sess, b"", 2, hello))
        assert fake.poll(30_000), "the controller did not answer a valid HELLO"
        welcome = decode(key, fake.recv_multipart())
        assert welcome.kind == Kind.WELCOME and welcome.receiver == sess
        ctl_sess = welcome.sender
        # The same HELLO from another session: its nonce was this session's, used once.
        fake.send_multipart(_frames(key, Kind.HELLO, secrets.token_bytes(16), b"", 1, hello))
        fake.send_multipart(_frames(key, Kind.HEARTBEAT, sess, ctl_sess, 3, [0, 0, 0, 0]))
        fake.send_multipart(_frames(key, Kind.HEARTBEAT, sess, ctl_sess, 3, [0, 0, 0, 0]))  # replay
        fake.send_multipart(_frames(key, Kind.HEARTBEAT, sess, b"z" * 16, 4, [0, 0, 0, 0]))  # stale
        fake.send_multipart(_frames(key, Kind.RESULT, sess, ctl_sess, 4,
                                    [123456789, int(P.Status.ERROR), None], evil))
        fake.send_multipart(_frames(key, Kind.CODE, sess, ctl_sess, 5, [b"d" * 16], evil))

        expected = {"malformed": 1, "unauthenticated": len(Kind), "unknown_peer": 4,
                    "oversized": 1, "replay": 2, "unsolicited": 1, "stale": 2}

        def all_counted() -> bool:
            dropped = ctl.stats()["dropped"]
            return all(dropped.get(r, 0) >= n for r, n in expected.items())

        _wait_until(all_counted, f"drop counters {expected}")
        dropped = ctl.stats()["dropped"]
        assert dropped["malformed"] + dropped["unauthenticated"] >= N_RANDOM
    finally:
        raw.close(0)
        fake.close(0)
        zctx.term()

    # Still serving: the real host computes, and nothing was unpickled.
    d = [dev for dev in cb.devices() if dev.host == 0]
    x = cb.device_put(np.arange(4.0), d[0])
    assert np.asarray(double(x)).tolist() == [0.0, 2.0, 4.0, 6.0]
    assert not canary.exists()
    assert ctl.stats()["dropped"].get("handler_error", 0) == 0


def _spawn_worker(address: str, key: bytes) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "colobus", "worker", "--connect", address, "--devices", "1",
         "--name", "fuzzed", "--key-file", "-"], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(key.hex().encode() + b"\n")
    proc.stdin.close()
    return proc


def test_fuzz_worker(tmp_path: pathlib.Path) -> None:
    key = secrets.token_bytes(32)
    canary = tmp_path / "unpickled-on-worker"
    evil = pickle.dumps(_Touch(canary))
    rng = random.Random(4321)
    zctx = zmq.Context()
    router = zctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    proc = _spawn_worker(f"tcp://127.0.0.1:{port}", key)
    try:
        assert router.poll(60_000), "the worker never asked to JOIN"
        ident, *frames = router.recv_multipart()
        join_env = decode(key, frames)
        assert join_env.kind == Kind.JOIN
        wsess = join_env.sender
        csess = secrets.token_bytes(16)

        def to_worker(parts: list[bytes]) -> None:
            router.send_multipart([ident, *parts])

        # The challenge: its HELLO must carry our nonce (inside its MAC).
        nonce = secrets.token_bytes(16)
        to_worker(_frames(key, Kind.CHALLENGE, csess, wsess, 1, [nonce]))
        while True:
            assert router.poll(60_000), "the worker never said HELLO"
            _, *frames = router.recv_multipart()
            hello_env = decode(key, frames)
            if hello_env.kind == Kind.HELLO:
                break
        hello = P.parse(hello_env.kind, hello_env.body)
        assert isinstance(hello, P.Hello) and hello.nonce == nonce
        assert hello_env.sender == wsess

        def garbage() -> None:
            for _ in range(N_RANDOM // 2):
                to_worker(_random_frames(rng))
            for kind in Kind:  # wrong key
                to_worker(_frames(secrets.token_bytes(32), kind, csess, wsess, 50, [], evil))
            to_worker([rng.randbytes(3 << 19), b"", b"m" * 32])  # oversized header
            to_worker([b"h", b"p"])  # truncated

        # Before it joined: garbage, and valid-MAC messages it must not accept yet.
        garbage()
        to_worker(_frames(key, Kind.CODE, csess, wsess, 1, [b"d" * 16], evil))
        to_worker(_frames(key, Kind.WELCOME, csess, b"not-its-session!", 1,
                          [0, [0] * len(hello.devices), 1.0, 60.0, False, 1 << 30]))
        # The worker keeps asking to JOIN (it is alive); now let it join.
        assert proc.poll() is None
        welcome = P.Welcome(0, list(range(len(hello.devices))), 1.0, 60.0, False, 1 << 30)
        to_worker(_frames(key, Kind.WELCOME, csess, wsess, 1, welcome.to_wire()))

        def next_from_worker(kind: Kind) -> Envelope:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if router.poll(500):
                    _, *fr = router.recv_multipart()
                    env = decode(key, fr)
                    if env.kind == kind and env.receiver == csess:
                        return env
            raise AssertionError(f"no {kind.name} from the worker")

        next_from_worker(Kind.HEARTBEAT)  # joined: it heartbeats our session
        # After it joined: garbage, replays and wrong sessions with a valid MAC.
        garbage()
        to_worker(_frames(key, Kind.CODE, csess, wsess, 1, [b"d" * 16], evil))  # replay
        to_worker(_frames(key, Kind.CODE, b"other-session-x", wsess, 9, [b"d" * 16], evil))
        to_worker(_frames(key, Kind.CODE, csess, b"old-session-xxxx", 9, [b"d" * 16], evil))
        to_worker(_frames(key, 99, csess, wsess, 2, []))  # unknown kind
        to_worker(_frames(key, Kind.CALL, csess, wsess, 3, ["not", "a", "call"]))
        # Still serving: a STATS round trip.
        to_worker(_frames(key, Kind.STATS, csess, wsess, 4, [42]))
        result = next_from_worker(Kind.RESULT)
        body = P.parse(result.kind, result.body)
        assert isinstance(body, P.Result) and body.call_id == 42
        assert body.status == P.Status.OK and body.meta == [0, 0, 0, 0]
        assert proc.poll() is None
        assert not canary.exists()
        # A clean exit on request proves the session survived it all.
        to_worker(_frames(key, Kind.SHUTDOWN, csess, wsess, 5, ["exit"]))
        assert proc.wait(30) == 0
        assert not canary.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        router.close(0)
        zctx.term()
    assert not os.path.exists(canary)
