"""The controller's bounded tables: join challenges, capped dicts, rate-limited warnings."""

from __future__ import annotations

import logging
import time

import pytest

from colobus._wire.guard import BoundedDict, Challenges, PeerWarnings


def test_challenges_are_single_use_bound_to_connection_and_session() -> None:
    ch = Challenges(capacity=4, ttl=60.0)
    nonce = ch.issue(b"conn-a", b"s" * 16)
    assert not ch.take(b"conn-b", b"s" * 16, nonce)  # another connection
    assert not ch.take(b"conn-a", b"t" * 16, nonce)  # another session
    assert ch.take(b"conn-a", b"s" * 16, nonce)
    assert not ch.take(b"conn-a", b"s" * 16, nonce)  # used once
    assert not ch.take(b"conn-a", b"s" * 16, b"x" * 16)  # never issued


def test_challenges_stay_bounded_and_expire() -> None:
    ch = Challenges(capacity=8, ttl=0.05)
    nonces = [ch.issue(b"c%d" % i, b"s" * 16) for i in range(100)]
    assert len(ch) == 8  # a flood evicts the oldest
    assert not ch.take(b"c0", b"s" * 16, nonces[0])
    time.sleep(0.1)
    assert not ch.take(b"c99", b"s" * 16, nonces[99])  # expired
    assert len(ch) == 0


def test_bounded_dict_forgets_the_oldest() -> None:
    d: BoundedDict[int, int] = BoundedDict(3)
    for i in range(10):
        d[i] = i
    assert list(d) == [7, 8, 9]


def test_peer_warnings_are_one_line_then_summaries(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("colobus.test_guard")
    caplog.set_level(logging.WARNING, logger="colobus.test_guard")
    warn = PeerWarnings(log, interval=3600)
    for i in range(1000):
        warn.note("unauthenticated", b"peer%d" % i, "")
    assert len(caplog.records) == 1 and warn.suppressed == 999
    warn.interval = 0.0
    warn.flush()
    assert len(caplog.records) == 2
    assert "999 unauthenticated from" in caplog.records[1].getMessage()
    warn.flush()  # nothing new: no line
    assert len(caplog.records) == 2
