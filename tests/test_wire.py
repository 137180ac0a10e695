"""The envelope codec, MAC and array codec (pure functions)."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colobus._wire import protocol as P
from colobus._wire.codec import from_buffer, to_buffer
from colobus._wire.envelope import (
    BATCH_MAX_ITEMS,
    BATCH_MAX_PAYLOAD,
    Dropped,
    Envelope,
    batched,
    decode,
    dumps,
    encode,
    loads,
    pack_batch,
    unpack_batch,
)

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
    hello = P.Hello("w", 1, "h", [["cpu", "cpu", 0]], b"n" * 16)
    assert P.parse(P.Kind.HELLO, hello.to_wire()) == hello
    with pytest.raises(ValueError):
        P.parse(P.Kind.HELLO, ["w", "not an int", "h", [], b"n" * 16])
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


# -- BATCH envelopes ----------------------------------------------------------------------

S, R = b"s" * 16, b"r" * 16


def _item(i: int, payload: bytes = b"", bufs: tuple[bytes, ...] = (), pbufs: int = 0) -> tuple:
    return (int(P.Kind.CALL), [i, "x"], payload, list(bufs), pbufs)


def _wire_round_trip(env: Envelope) -> Envelope:
    return decode(KEY, [bytes(f) for f in encode(KEY, env)])


def test_a_batch_carries_its_messages_in_order_with_their_payloads_and_buffers() -> None:
    items = [_item(0, b"p0", (b"a", b"bb"), 1), _item(1), _item(2, b"payload-2", (b"ccc",), 0)]
    [env] = batched(items, S, R)
    assert env.kind == P.Kind.BATCH
    env.seq = 5
    subs = unpack_batch(_wire_round_trip(env))
    assert [(s.kind, s.body, bytes(s.payload), [bytes(b) for b in s.buffers], s.pbufs)
            for s in subs] == [
        (P.Kind.CALL, [0, "x"], b"p0", [b"a", b"bb"], 1),
        (P.Kind.CALL, [1, "x"], b"", [], 0),
        (P.Kind.CALL, [2, "x"], b"payload-2", [b"ccc"], 0),
    ]
    assert all((s.sender, s.receiver, s.seq) == (S, R, 5) for s in subs)


def test_lone_and_large_messages_travel_as_themselves_and_long_runs_split() -> None:
    [single] = batched([_item(0, b"p")], S, R)
    assert single.kind == P.Kind.CALL and bytes(single.payload) == b"p"
    big = b"x" * BATCH_MAX_PAYLOAD
    envs = batched([_item(0), _item(1), _item(2, big), _item(3)], S, R)
    assert [e.kind for e in envs] == [P.Kind.BATCH, P.Kind.CALL, P.Kind.CALL]
    assert envs[1].payload is big  # not copied into a batch
    many = batched([_item(i) for i in range(2 * BATCH_MAX_ITEMS + 1)], S, R)
    assert [len(e.body) if e.kind == P.Kind.BATCH else 1 for e in many] == [
        BATCH_MAX_ITEMS, BATCH_MAX_ITEMS, 1]


def test_a_batch_whose_header_would_be_too_large_goes_as_its_messages() -> None:
    huge = [(int(P.Kind.RESULT), [i, 1, ["T", "m", "t" * 300_000]], b"", [], 0)
            for i in range(4)]
    envs = batched(huge, S, R)
    assert [e.kind for e in envs] == [P.Kind.RESULT] * 4


@pytest.mark.parametrize("body", [
    [], "x", [[6, [], 0, 0]], [[6, [], 0, 0, 0, 0]], [["6", [], 0, 0, 0]],
    [[17, [], 0, 0, 0]],  # a batch inside a batch
    [[6, [], 1, 0, 0]],  # more payload than there is
    [[6, [], 0, 0, 0]],  # less payload than there is
    [[6, [], 3, 1, 0]],  # a buffer that is not there
    [[6, [], 3, 0, 1]],  # pbufs above nbufs
    [[6, [], -1, 0, 0]],
])
def test_malformed_batches_are_dropped(body: object) -> None:
    env = Envelope(int(P.Kind.BATCH), S, R, 1, body, b"abc")
    with pytest.raises(Dropped) as info:
        unpack_batch(env)
    assert info.value.reason == "malformed"


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.integers(-3, 300) | st.binary(max_size=4) | st.text(max_size=3),
                    lambda c: st.lists(c, max_size=6), max_leaves=30),
       st.binary(max_size=40), st.lists(st.binary(max_size=5), max_size=3))
def test_any_batch_body_splits_exactly_or_is_dropped(body: object, payload: bytes,
                                                     bufs: list[bytes]) -> None:
    env = Envelope(int(P.Kind.BATCH), S, R, 1, body, payload, list(bufs))
    try:
        subs = unpack_batch(env)
    except Dropped as d:
        assert d.reason == "malformed"
        return
    assert b"".join(bytes(s.payload) for s in subs) == payload
    assert [b for s in subs for b in s.buffers] == bufs
    assert all(s.kind != P.Kind.BATCH for s in subs)


def test_pack_batch_concatenates_payloads() -> None:
    body, payload, bufs = pack_batch([_item(0, b"ab", (b"1",)), _item(1, b"cde")])
    assert payload == b"abcde" and bufs == [b"1"]
    assert [e[2:] for e in body] == [[2, 1, 0], [3, 0, 0]]


def test_batch_body_packed_once_encodes_the_same_bytes() -> None:
    """A BATCH carries its body packed once (for the size check); the header spliced
    from those bytes is byte for byte the one packing the body again would make."""
    from colobus._wire.envelope import (
        BATCH_KIND,
        Envelope,
        batched,
        decode,
        encode,
        pack_batch,
        unpack_batch,
    )

    key = b"k" * 32
    items: list[Any] = [(6, [1, 2, b"d" * 16, -1, "", [], [[0], [1], ["x"]]], b"pay", [], 0),
                        (11, [[1, 2], [3]], b"", [], 0)]
    (env,) = batched(items, b"s" * 16, b"r" * 16)
    assert env.kind == BATCH_KIND and env.packed_body is not None
    env.seq, env.ack = 5, 3
    again = Envelope(env.kind, env.sender, env.receiver, 5, pack_batch(items)[0], env.payload,
                     env.buffers, env.pbufs, env.version, 3)
    assert [bytes(f) for f in encode(key, env)] == [bytes(f) for f in encode(key, again)]
    subs = unpack_batch(decode(key, encode(key, env)))
    assert [s.kind for s in subs] == [6, 11] and subs[0].payload == b"pay"


def test_an_output_description_is_parsed_once_and_checked_every_time() -> None:
    """Repeated descriptions come from a cache of checked leaves; the tree is rebuilt."""
    import jax

    from colobus._wire import describe as _describe
    from colobus._wire import protocol as P

    tree = ({"w": 1}, [2, 3])
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    metas = [P.OutLeaf(i, (2, 3), np.dtype(np.float32), None, None, None, None, -1)
             for i in range(len(leaves))]
    payload = _describe.describe_outputs(treedef, metas)
    _describe._parsed.cache_clear()
    first = _describe.read_outputs(payload, len(leaves))
    second = _describe.read_outputs(memoryview(payload), len(leaves))
    assert _describe._parsed.cache_info().hits == 1
    assert first == second and first is not second  # equal trees, built anew
    assert type(first) is tuple and first[0]["w"] == metas[0]
    first[1].append("mutated")  # a caller changing its tree changes no later call's
    assert _describe.read_outputs(payload, len(leaves))[1] == [metas[1], metas[2]]
    for _ in range(2):  # a bad one fails every time: failures are not remembered
        with pytest.raises(_describe.BadReply):
            _describe.read_outputs(payload, len(leaves) + 1)
        with pytest.raises(_describe.BadReply):
            _describe.read_outputs(b"\xc1garbage", 1)


@settings(max_examples=60, deadline=None)
@given(payload=st.sampled_from([0, 10, 300_000]),
       sizes=st.lists(st.sampled_from([0, 1, 100, 70_000, 300_000, 1 << 20]), max_size=6),
       parts=st.lists(st.sampled_from([1 << 18, 1 << 20, 4 << 20]), min_size=1, max_size=4))
def test_parts_of_any_size_reassemble_and_whole_buffers_are_not_copied(
        payload: int, sizes: list[int], parts: list[int]) -> None:
    """A message cut into parts of changing sizes (as the window grows) comes back
    byte for byte; a buffer that fits in a part is never cut across two, and arrives
    as a view of the part's frame (read-only: not copied into fresh memory)."""
    from colobus._wire.chunks import Assembly, Splitter

    rng = np.random.default_rng(len(sizes) * 7 + payload)
    data = rng.integers(0, 256, payload, dtype=np.uint8).tobytes()
    bufs = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    if not data and not any(bufs):
        return  # nothing to cut: such a message always travels whole
    key = b"k" * 32
    splitter = Splitter(Envelope(5, b"s" * 16, b"r" * 16, 0, [1, 2], data, bufs, 0))
    envs = []
    while not splitter.done:
        envs.append(splitter.next(parts[len(envs) % len(parts)]))
    for seq, e in enumerate(envs, 1):
        e.seq = seq
    asm = Assembly(decode(key, encode(key, envs[0])), 1 << 40)
    out = None
    for e in envs[1:]:
        assert out is None
        out = asm.feed(decode(key, encode(key, e)))
    assert out is not None and out.kind == 5 and out.body == [1, 2]
    assert bytes(out.payload) == data
    assert [bytes(b) for b in out.buffers] == bufs
    smallest = min(parts)
    for b, n in zip(out.buffers, sizes, strict=True):
        if 0 < n <= smallest:
            assert memoryview(b).readonly, f"a {n}-byte buffer was copied"


def test_uint_is_msgpacks_own_encoding() -> None:
    """Batch entries splice cached small ints: the same bytes msgpack writes."""
    from colobus._wire.splice import uint as _uint
    for n in [*range(300), 65535, 65536, 1 << 32, (1 << 64) - 1]:
        assert _uint(n) == msgpack.packb(n), n


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**63), st.integers(0, 2**32), st.binary(max_size=40),
       st.integers(0, 2**40), st.text(max_size=20),
       st.lists(st.lists(st.integers(0, 2**40), min_size=2, max_size=2), max_size=300),
       st.lists(st.integers(0, 4096), max_size=20), st.integers(0, 10**6))
def test_call_splicer_packs_what_a_call_body_packs(
        call_id: int, stream: int, digest: bytes, obj: int, method: str, refs: list[Any],
        ids: list[int], hosts: int) -> None:
    """A fan-out's CALL bodies, spliced, are the bytes of packing each ``P.Call``."""
    from colobus._wire.envelope import pack_body
    from colobus._wire.splice import CallSplicer
    mesh = [ids, [len(ids)], ["x"]]
    call = P.Call(call_id, stream, digest, obj, method, refs, mesh, hosts)
    spliced = CallSplicer([call_id, stream, digest, obj, method, refs])(mesh, hosts)
    assert spliced == pack_body(call.to_wire())
    assert P.parse(P.Kind.CALL, msgpack.unpackb(spliced)) == call


def test_call_splicer_refuses_what_msgpack_cannot_write() -> None:
    """An unwritable mesh is a SerializationError, as packing a ``P.Call`` would be."""
    from colobus import SerializationError
    from colobus._wire.splice import CallSplicer
    with pytest.raises(SerializationError, match="cannot encode the message"):
        CallSplicer([1, 0, b"d", 0, "", []])([[0], [1], [object()]], 1)
    with pytest.raises(SerializationError, match="cannot encode the message"):
        CallSplicer([1, 0, b"d", 0, "", [object()]])
