"""The envelope codec, MAC and array codec (pure functions)."""

from __future__ import annotations

import numpy as np
import pytest

from colobus import _protocol as P
from colobus._codec import from_buffer, to_buffer
from colobus._wire import Dropped, Envelope, decode, dumps, encode, loads

KEY = b"k" * 32


def _env(**kw: object) -> Envelope:
    base: dict[str, object] = dict(kind=P.Kind.CALL, sender=b"s" * 16, receiver=b"r" * 16,
                                   seq=7, body=[1, "x"], payload=b"pickle",
                                   buffers=[b"abc", memoryview(b"defg")])
    base.update(kw)
    return Envelope(**base)  # type: ignore[arg-type]


def test_round_trip_keeps_every_field() -> None:
    env = decode(KEY, encode(KEY, _env()))
    assert (env.kind, env.sender, env.receiver, env.seq, env.body) == (
        P.Kind.CALL, b"s" * 16, b"r" * 16, 7, [1, "x"])
    assert bytes(env.payload) == b"pickle"
    assert [bytes(b) for b in env.buffers] == [b"abc", b"defg"]


def test_fixed_layout_header_payload_mac_buffers() -> None:
    frames = encode(KEY, _env())
    assert len(frames) == 3 + 2
    assert len(frames[2]) == 32


@pytest.mark.parametrize("index", [0, 1, 2])
def test_any_flipped_bit_in_header_payload_or_mac_is_unauthenticated(index: int) -> None:
    frames = [bytes(f) for f in encode(KEY, _env())]
    b = bytearray(frames[index])
    b[len(b) // 2] ^= 1
    frames[index] = bytes(b)
    with pytest.raises(Dropped) as exc:
        decode(KEY, frames)
    assert exc.value.reason == "unauthenticated"


def test_wrong_key_is_unauthenticated() -> None:
    with pytest.raises(Dropped, match="unauthenticated"):
        decode(b"x" * 32, encode(KEY, _env()))


def test_truncated_and_bad_buffer_counts_are_malformed() -> None:
    frames = encode(KEY, _env())
    with pytest.raises(Dropped, match="malformed"):
        decode(KEY, frames[:2])
    with pytest.raises(Dropped, match="malformed"):
        decode(KEY, frames[:-1])  # a buffer missing: the header says two
    with pytest.raises(Dropped, match="malformed"):
        decode(KEY, [*frames[:-1], b"defgh"])  # wrong length


def test_oversized_payload_is_dropped() -> None:
    with pytest.raises(Dropped, match="oversized"):
        decode(KEY, encode(KEY, _env(payload=b"x" * 100)), max_payload=10)


def test_large_arrays_in_pickles_go_out_of_band() -> None:
    big = np.arange(1 << 16, dtype=np.float64)
    payload, bufs = dumps({"a": big, "small": np.arange(3)})
    assert len(bufs) == 1 and bufs[0].nbytes == big.nbytes
    assert len(payload) < 4096
    out = loads(payload, bufs)
    np.testing.assert_array_equal(out["a"], big)


def test_body_parse_checks_types() -> None:
    hello = P.Hello("w", 1, "h", [["cpu", "cpu", 0]], 1.0)
    assert P.parse(P.Kind.HELLO, hello.to_wire()) == hello
    with pytest.raises(ValueError):
        P.parse(P.Kind.HELLO, ["w", "not an int", "h", [], 1.0])
    with pytest.raises(ValueError):
        P.parse(999, [])


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(12).reshape(3, 4).T,
        np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        np.array(["a", "bcdé", ""], dtype=np.dtypes.StringDType()),
        np.zeros(3, dtype=[("a", "<i4"), ("b", "<c16", (2,))]),
        np.array(True),
        np.zeros((0, 3), np.float32),
    ],
)
def test_array_codec_round_trips(arr: np.ndarray) -> None:
    descr, buf = to_buffer(arr)
    out = from_buffer(descr, arr.shape, bytes(buf))
    assert out.dtype == arr.dtype
    np.testing.assert_array_equal(out, arr)


def test_object_arrays_do_not_travel() -> None:
    with pytest.raises(ValueError, match="object"):
        to_buffer(np.array([object()], dtype=object))
