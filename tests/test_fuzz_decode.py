"""Property-based fuzzing of the pure envelope decoder and the body parser.

``colobus._wire.envelope.decode`` (and the lane's ``fast_decode``, with the same
verdict) must only ever raise ``Dropped`` and
``colobus._wire.protocol.parse`` only ``ValueError``, whatever the bytes; nothing is
unpickled by either (a payload whose unpickling would create a file proves it).
Example counts are bounded so this runs in a few seconds in CI.
"""

from __future__ import annotations

import os
import pathlib
import pickle
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from colobus._wire import protocol as P
from colobus._wire.envelope import MAC_SIZE, Dropped, Envelope, decode, encode, mac
from colobus._wire.lane import fast_decode

KEY = b"k" * 32
OTHER_KEY = b"x" * 32

FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])

# Any value msgpack can carry (what a hostile but key-holding peer could put in a body).
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=6)
    | st.dictionaries(st.text(max_size=5) | st.integers(-5, 5), children, max_size=4),
    max_leaves=20,
)


def _envelope(kind: int = P.Kind.HEARTBEAT, body: Any = (0, 0, 0), payload: bytes = b"",
              buffers: tuple[bytes, ...] = ()) -> Envelope:
    return Envelope(int(kind), b"s" * 16, b"r" * 16, 7, list(body), payload, list(buffers),
                    0)


def _frames(env: Envelope, key: bytes = KEY) -> list[bytes]:
    return [bytes(f) for f in encode(key, env)]


class _Touch:
    """Unpickling this creates a file: the canary for "nothing is unpickled"."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def _one(fn: Any, frames: list[bytes], key: bytes, **kw: Any) -> Envelope | Dropped:
    try:
        return fn(key, frames, **kw)  # type: ignore[no-any-return]
    except Dropped as d:  # the only exception decode may raise
        return d


def _decode_or_drop(frames: list[bytes], key: bytes = KEY, **kw: Any) -> Envelope | Dropped:
    """``decode``'s verdict, which the lane's decoder (what the controller and the workers
    run: ``colobus._wire.lane.fast_decode``) must give too, for every input fuzzed here."""
    out = _one(decode, frames, key, **kw)
    fast = _one(fast_decode, frames, key, **kw)
    if isinstance(out, Dropped):
        assert isinstance(fast, Dropped) and fast.reason == out.reason, (out, fast)
    else:
        assert isinstance(fast, Envelope), fast
        assert (fast.kind, fast.sender, fast.receiver, fast.seq, fast.pbufs) == (
            out.kind, out.sender, out.receiver, out.seq, out.pbufs)
        # the bodies packed (a NaN in a body is equal to itself only as bytes)
        assert msgpack.packb(fast.body) == msgpack.packb(out.body)
        assert bytes(fast.payload) == bytes(out.payload)
        assert [bytes(x) for x in fast.buffers] == [bytes(x) for x in out.buffers]
    return out


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=6))
def test_random_frames_are_dropped(frames: list[bytes]) -> None:
    out = _decode_or_drop(frames)
    assert isinstance(out, Dropped)
    assert out.reason in ("malformed", "unauthenticated", "oversized")


@FUZZ
@given(st.binary(max_size=200), st.data())
def test_flipped_bit_in_header_payload_or_mac_fails_authentication(
        payload: bytes, data: st.DataObject) -> None:
    frames = _frames(_envelope(payload=payload, body=[1, 2, 3]))
    which = data.draw(st.sampled_from([0, 1, 2]).filter(lambda i: len(frames[i]) > 0))
    frame = bytearray(frames[which])
    bit = data.draw(st.integers(0, len(frame) * 8 - 1))
    frame[bit // 8] ^= 1 << (bit % 8)
    frames[which] = bytes(frame)
    out = _decode_or_drop(frames)
    assert isinstance(out, Dropped) and out.reason == "unauthenticated"


@FUZZ
@given(st.lists(st.binary(min_size=1, max_size=50), min_size=1, max_size=4), st.data())
def test_truncated_or_extended_frames_are_dropped(bufs: list[bytes], data: st.DataObject) -> None:
    frames = _frames(_envelope(buffers=tuple(bufs)))
    i = data.draw(st.integers(0, len(frames) - 1))
    how = data.draw(st.sampled_from(["cut", "grow", "drop_frame", "add_frame"]))
    if how == "cut":
        assume(len(frames[i]) > 0)
        frames[i] = frames[i][: data.draw(st.integers(0, max(0, len(frames[i]) - 1)))]
    elif how == "grow":
        frames[i] = frames[i] + data.draw(st.binary(min_size=1, max_size=8))
    elif how == "drop_frame":
        del frames[i]
    else:
        frames.insert(i + 1, data.draw(st.binary(max_size=8)))
    out = _decode_or_drop(frames)
    if isinstance(out, Envelope):
        pytest.fail(f"a {how} edit of frame {i} was accepted")
    assert out.reason in ("malformed", "unauthenticated", "oversized")


@FUZZ
@given(st.binary(min_size=1, max_size=64), st.data())
def test_buffer_contents_are_not_maced_but_lengths_are(buf: bytes, data: st.DataObject) -> None:
    """The documented trade-off: buffer bytes are not authenticated (CurveZMQ covers them)."""
    frames = _frames(_envelope(buffers=(buf,)))
    flipped = bytearray(buf)
    bit = data.draw(st.integers(0, len(buf) * 8 - 1))
    flipped[bit // 8] ^= 1 << (bit % 8)
    frames[3] = bytes(flipped)
    out = _decode_or_drop(frames)
    assert isinstance(out, Envelope) and bytes(out.buffers[0]) == bytes(flipped)


def test_oversized_frames_are_dropped() -> None:
    frames = _frames(_envelope(payload=b"p" * 1000))
    out = _decode_or_drop(frames, max_payload=999)
    assert isinstance(out, Dropped) and out.reason == "oversized"
    big_header = [b"h" * ((1 << 20) + 1), b"", b"m" * MAC_SIZE]
    out = _decode_or_drop(big_header)
    assert isinstance(out, Dropped) and out.reason == "oversized"


@FUZZ
@given(msgpack_values)
def test_any_header_with_a_valid_mac_is_dropped_or_parsed(header_obj: Any) -> None:
    """A key holder's garbage: decode drops it as malformed or returns an Envelope."""
    header = msgpack.packb(header_obj, use_bin_type=True)
    frames = [header, b"", mac(KEY, header, b"")]
    out = _decode_or_drop(frames)
    if isinstance(out, Dropped):
        assert out.reason == "malformed"
    else:
        _parse_only_value_error(out.kind, out.body)


def _parse_only_value_error(kind: int, body: Any) -> None:
    try:
        parsed = P.parse(kind, body)
    except ValueError:
        return
    assert isinstance(parsed, P.Body) and parsed.kind == kind


@FUZZ
@given(st.integers(-(2**63), 2**64 - 1) | st.sampled_from([int(k) for k in P.Kind]),
       msgpack_values)
def test_valid_mac_wrong_kinds_and_bodies_parse_raises_only_value_error(
        kind: int, body: Any) -> None:
    env = Envelope(kind, b"a" * 16, b"b" * 16, 1, body)
    out = _decode_or_drop(_frames(env))
    if isinstance(out, Dropped):  # e.g. a map with int keys (msgpack strict_map_key)
        assert out.reason == "malformed"
        return
    _parse_only_value_error(out.kind, out.body)


@FUZZ
@given(st.sampled_from(list(P.BODIES.values())), st.data())
def test_right_kind_wrong_field_types(cls: Any, data: st.DataObject) -> None:
    body = data.draw(st.lists(msgpack_values, min_size=len(cls.types), max_size=len(cls.types)))
    _parse_only_value_error(int(cls.kind), body)


@FUZZ
@given(st.integers(0, 7), msgpack_values)
def test_header_fields_of_wrong_types_are_malformed(i: int, value: Any) -> None:
    fields: list[Any] = [1, 4, b"s" * 16, b"r" * 16, 1, [], 0, [0, 0, 0]]
    fields[i] = value
    header = msgpack.packb(fields, use_bin_type=True)
    out = _decode_or_drop([header, b"", mac(KEY, header, b"")])
    if isinstance(out, Envelope):  # the value happened to have the right type
        assert out.seq == fields[4] and out.kind == fields[1]


def test_nothing_is_unpickled_by_decode(tmp_path: pathlib.Path) -> None:
    canary = tmp_path / "unpickled"
    payload = pickle.dumps(_Touch(str(canary)))
    # The canary is live: unpickling it does create the file.
    live = tmp_path / "live"
    pickle.loads(pickle.dumps(_Touch(str(live))))
    assert live.exists()
    env = _envelope(kind=P.Kind.CODE, body=[b"d" * 16], payload=payload)
    # Wrong key: dropped, canary untouched.
    out = _decode_or_drop(_frames(env, OTHER_KEY))
    assert isinstance(out, Dropped) and out.reason == "unauthenticated"
    # Right key: decoded, still nothing unpickled (only holders of an
    # authenticated Envelope unpickle, after their session checks).
    out = _decode_or_drop(_frames(env))
    assert isinstance(out, Envelope) and bytes(out.payload) == payload
    assert not canary.exists()
    assert not os.path.exists(canary)
