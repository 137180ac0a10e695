"""The common message's lane (colobus._wire.lane): the same bytes and the same checks as
colobus._wire.envelope, in fewer Python calls."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import zmq

from colobus._wire import envelope as E
from colobus._wire import lane as L
from colobus._wire.chunks import envelope_bytes

KEY = b"k" * 32


def _items() -> list[list[Any]]:
    big = b"p" * (E.BATCH_MAX_PAYLOAD + 1)
    arr = np.arange(12, dtype=np.float32)
    return [
        [(3, b"\x91\x01", b"", (), 0)],  # one message
        [(5, [1, [2, 3]], b"pay", (), 0), (3, b"\x91\x01", b"x" * 200, (b"buf",), 1)],
        [(5, [1, 2], b"", (), 0)] * 20,  # a long batch (array header over 15)
        [(5, [1, 2], b"a", (), 0), (7, b"\x90", big, (), 0), (5, [3], b"", (), 0)],
        [(200, [1], memoryview(b"abc"), (memoryview(arr.tobytes()), b"zz"), 1),
         (6, [2], b"q" * 300, (), 0)],
        [(5, [i], b"", (), 0) for i in range(E.BATCH_MAX_ITEMS + 3)],  # two batches
    ]


def _same(a: E.Envelope, b: E.Envelope) -> None:
    assert (a.kind, a.sender, a.receiver, a.seq, a.body, a.pbufs, a.packed_body) == (
        b.kind, b.sender, b.receiver, b.seq, b.body, b.pbufs, b.packed_body)
    assert bytes(a.payload) == bytes(b.payload)
    assert [bytes(x) for x in a.buffers] == [bytes(x) for x in b.buffers]


@pytest.mark.parametrize("items", _items())
def test_batched_and_encoded_as_the_envelope_module_does(items: list[Any]) -> None:
    ours, theirs = L.fast_batched(items, b"s", b"r"), E.batched(items, b"s", b"r")
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        _same(a, b)
        assert L.fast_envelope_bytes(a) == envelope_bytes(b)
        a.seq = b.seq = 7
        fa, fb = L.fast_encode(KEY, a), E.encode(KEY, b)
        assert [bytes(x) for x in fa] == [bytes(x) for x in fb]
        _same(L.fast_decode(KEY, fa), E.decode(KEY, fb))


def _packed(items: list[Any]) -> list[Any]:
    return [(k, b if type(b) is bytes else E.pack_body(b), p, bs, pb) for k, b, p, bs, pb in items]


@pytest.mark.parametrize("items", [
    *map(_packed, _items()),
    [(6, b"\x91" + b"\xc4\x00", b"", (), 0)] * 2,
    [(6, b"\x90", b"z" * 300_000, (), 0)],  # over ``whole`` below: in parts
    [(6, b"\x90", b"z" * 60_000, (), 0), (6, b"\x90", b"y" * 60_000, (), 0)],
    [(int(E.BATCH_KIND) - 1, b"\x90", b"", (), 0), (6, b"\x90", b"", (), 0)],
    [(2, b"\x90", b"", (), 0), (6, b"\x90", b"", (), 0)],  # a heartbeat among two
    [(6, bytes(range(256)) * 300, b"tail", (), 0)],  # a body over BODY_INLINE_MAX
    [(6, [1], b"", (), 0)],  # not packed
])
def test_one_envelope_sent_whole_is_the_general_paths(items: list[Any]) -> None:
    """lane.fast_one_envelope: the frames the channel's general path sends (batched,
    numbered, encoded), or None wherever that path would not send one whole envelope."""
    from colobus._wire.chunks import part_size
    from colobus._wire.peer import HEARTBEAT_KIND

    whole = part_size(1 << 18)
    got = L.fast_one_envelope(KEY, items, b"s", b"r", 9, 4, whole)
    packed = all(type(i[1]) is bytes for i in items)
    envs = E.batched(items, b"s", b"r") if packed else []
    alone = [i for i in items if i[0] == HEARTBEAT_KIND] if len(items) > 1 else []
    body = envs[0].packed_body if envs else None
    n = envelope_bytes(envs[0]) if envs else 0
    if (len(envs) != 1 or alone or body is None or (n and n + len(body) > whole)):
        assert got is None
        return
    assert got is not None
    frames, size, data, plen, batch = got
    env = envs[0]
    env.seq, env.ack = 9, 4
    theirs = E.encode(KEY, env)
    assert [bytes(x) for x in frames] == [bytes(x) for x in theirs]
    assert size == sum(len(bytes(x)) for x in theirs)
    assert plen == len(bytes(theirs[1]))
    assert data == envelope_bytes(env)
    assert batch == (env.kind == E.BATCH_KIND)


def test_a_body_too_large_for_the_header_travels_in_the_payload_alike() -> None:
    env = E.Envelope(5, b"s", b"r", 1, list(range(40000)), b"tail")
    ours, theirs = L.fast_encode(KEY, env), E.encode(KEY, env)
    assert [bytes(x) for x in ours] == [bytes(x) for x in theirs]
    _same(L.fast_decode(KEY, ours), E.decode(KEY, theirs))
    _same(L.fast_decode(KEY, ours, max_objects=10**6), E.decode(KEY, theirs))


def _reason(fn: Any, frames: list[Any], **kw: Any) -> str:
    try:
        fn(KEY, frames, **kw)
    except E.Dropped as exc:
        return str(exc)
    return "accepted"


def test_what_comes_in_is_refused_for_the_same_reasons() -> None:
    """Frames cut, grown, flipped or forged: both readers refuse them alike (or accept
    them alike), as zmq frames and as bytes."""
    rng = random.Random(5)
    good = E.encode(KEY, E.Envelope(5, b"s", b"r", 3, [1, 2], b"pay", [b"b1", b"bb2"], 1))
    cases: list[tuple[list[Any], dict[str, Any]]] = [
        (good, {}), (good[:2], {}), (good, {"max_frames": 4}), (good, {"max_payload": 2}),
        (good, {"max_total": 10}), ([good[0], good[1], b"short", *good[3:]], {}),
        ([good[0], good[1], bytes(32), *good[3:]], {}), (good[:3], {}), (good[:4], {}),
        ([*good, b"extra"], {}),
    ]
    for _ in range(60):  # a byte flipped somewhere: the MAC catches it
        frames = [bytearray(bytes(f)) for f in good]
        f = rng.randrange(len(frames))
        if frames[f]:
            frames[f][rng.randrange(len(frames[f]))] ^= 1 << rng.randrange(8)
        cases.append(([bytes(x) for x in frames], {}))
    # Forged with the key: malformed headers behind a valid MAC
    for fields in ([9, 5, b"s", b"r", 3, 0, [], 0, None, 5], [9, True, b"s", b"r", 3, 0, [], 0, 1],
                   [9, 5, "s", b"r", 3, 0, [], 0, 1], [9, 5, b"s", b"r", 3, 0, [4], 0, 1],
                   [9, 5, b"s", b"r", 3, 0, [], 2, 1], "junk", [1, 2, 3]):
        import msgpack

        header = msgpack.packb(fields, use_bin_type=True)
        cases.append(([header, b"", E.mac(KEY, header, b"")], {}))
    for frames, kw in cases:
        want = _reason(E.decode, frames, **kw)
        assert _reason(L.fast_decode, frames, **kw) == want, (frames, kw)
        as_frames = [zmq.Frame(bytes(f)) for f in frames]
        assert _reason(L.fast_decode, as_frames, **kw) == want, (frames, kw)


def test_the_switch_picks_the_helpers_when_off() -> None:
    """COLOBUS_CALL_LANE=0 (read at import) keeps envelope's own functions."""
    import subprocess
    import sys

    code = ("from colobus._wire import lane, envelope; "
            "print(lane.ON, lane.encode is envelope.encode, lane.decode is envelope.decode)")
    for value, want in (("0", "False True True"), ("1", "True False False")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**__import__("os").environ, "COLOBUS_CALL_LANE": value},
                             check=True).stdout.strip()
        assert out == want


@pytest.mark.parametrize("call_id, stream, refs, hosts", [
    (1, 1, [], 1), (300, 70000, [[5, 0]], 4), (2**40, 3, [[1, 2], [3, 4]] * 20, 200)])
def test_a_call_body_spliced_by_the_lane_is_the_one_packed_whole(
        call_id: int, stream: int, refs: list[Any], hosts: int) -> None:
    """colobus._api.lane.call_body: the CALL's body from bytes packed once, as P.Call
    packs it (digest, object, method in the middle; the host's mesh near the end)."""
    from colobus._api.lane import call_body
    from colobus._wire import protocol as P
    from colobus._wire.splice import pack_body

    digest, obj, method, mesh = b"d" * 32, 0, "", [[0], [1], ["devices"]]
    whole = pack_body(P.Call(call_id, stream, digest, obj, method, refs, mesh,
                             hosts).to_wire())
    mid = L.pack(digest) + L.pack(obj) + L.pack(method)
    assert call_body(call_id, stream, mid, refs, pack_body(mesh), hosts) == whole


@pytest.mark.parametrize("cap", [4096, 1])
def test_cache_info_counts_the_lanes_calls_as_note_does(ctl: Any, cap: int,
                                                        monkeypatch: Any) -> None:
    """The lane counts a call like the last one as a hit without making its key; the
    counts are those of ``Signatures.note`` (also when the set of signatures starts over:
    ``MAX_SIGNATURES`` of 1 makes every change of signature a miss)."""
    import colobus as cb
    from colobus._api import cacheinfo

    monkeypatch.setattr(cacheinfo, "MAX_SIGNATURES", cap)

    @cb.colocated_python
    def same(x: Any) -> Any:
        return x

    d0 = cb.devices()[0]
    x, y = cb.device_put(np.zeros(2), d0), cb.device_put(np.zeros(3), d0)
    x2 = cb.device_put(np.ones(2), d0)  # x's signature (its sharding equal, maybe not x's)
    z = cb.device_put(np.zeros(2, np.int32), d0)  # x's shape and sharding, not its dtype
    for arg in (x, x, y, y, x, x2, z, z, x):
        cb.block_until_ready(same(arg))
    info = same.cache_info()
    # distinct: x, y, z; with a cap of 1 every change starts the set over: x y x z x
    assert (info.misses, info.hits) == ((3, 6) if cap > 1 else (5, 4))


async def test_calls_on_the_controllers_loop_free_and_order_as_the_general_path() -> None:
    """Calls made on the controller's own loop thread (the lane that sends in one go):
    results, stream order behind a full window (max_inflight=1 sends later calls through
    the backlog), errors, and frees (each call's output and result slot, whatever thread
    drops them) leave the host holding only what the program still holds."""
    import asyncio
    import gc
    import threading

    from lifecycle import quiesced

    import colobus as cb

    @cb.colocated_python
    def plus(x: Any, y: Any) -> Any:
        return x + y

    @cb.colocated_python
    def same(x: Any) -> Any:
        return x

    async with cb.local_cluster(hosts=1, devices_per_host=1, max_inflight=1) as ctl:
        d0 = ctl.devices()[0]
        x = cb.device_put(np.arange(4.0), d0)
        assert np.asarray(await cb.device_get(await same(x))).tolist() == [0, 1, 2, 3]
        y = x
        for _ in range(20):  # awaited one by one: each frees the one before
            y = await plus(y, x)
        assert np.asarray(await cb.device_get(y)).tolist() == [21 * v for v in range(4)]
        futs = [same(x) for _ in range(10)]  # behind the window: the backlog, in order
        outs = await cb.gather(*futs)
        assert all(o.shape == (4,) for o in outs)
        gone = cb.device_put(np.zeros(2), d0)
        gone.delete()
        with pytest.raises(RuntimeError, match="deleted"):
            same(gone)
        kept = await asyncio.gather(*[asyncio.create_task(_awaited(same, x)) for _ in range(5)])
        dropped = threading.Thread(target=kept.clear)  # dropped on another thread
        dropped.start()
        dropped.join()
        del futs, outs, y
        gc.collect()
        hosts = await quiesced(ctl, base={0: {"arrays": 1, "bytes": 32}})
        assert (hosts[0]["arrays"], hosts[0]["results"]) == (1, 0), hosts


async def _awaited(fn: Any, *args: Any) -> Any:
    return await fn(*args)  # (the Future dropped here, on the loop thread)


async def test_a_function_called_under_one_controller_then_another() -> None:
    """What the lane keeps per function (plans, generations, the packed digest) is the
    registry's it was read from: a second controller's calls run, and free, as its own."""
    from lifecycle import quiesced

    import colobus as cb

    @cb.colocated_python
    def same(x: Any) -> Any:
        return x

    for _ in range(2):
        async with cb.local_cluster(hosts=1, devices_per_host=1) as ctl:
            x = cb.device_put(np.arange(3.0), ctl.devices()[0])
            for _ in range(5):
                y = await same(x)
            assert np.asarray(await cb.device_get(y)).tolist() == [0.0, 1.0, 2.0]
            del y
            hosts = await quiesced(ctl, base={0: {"arrays": 1, "bytes": 24}})
            assert (hosts[0]["arrays"], hosts[0]["results"]) == (1, 0), hosts
