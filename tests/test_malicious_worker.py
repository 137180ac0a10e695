"""A malicious worker cannot run code in the controller, wedge it, or grow its memory.

The fake worker (``tests/fakeworker.py``) is raw pyzmq plus colobus's own wire
module, and it holds the key: it joins (JOIN, CHALLENGE, HELLO) like a real worker, then answers the
controller with hostile replies. Every field that carries bytes gets a pickle
whose ``__reduce__`` would create a marker file; descriptions name classes and
functions the controller must never call or import; counts are huge or
negative; kinds are unknown; replies are for calls it was never sent or that
belong to another host; frames are oversized; HELLOs flood in or are replayed to
a restarted controller. After each: the marker file never appears, a real host
keeps completing calls, the fake host is dropped and counted by reason, and the
controller's tables stay bounded.
"""

from __future__ import annotations

import collections.abc
import contextlib
import gc
import logging
import os
import pathlib
import pickle
import secrets
import subprocess
import sys
import time
import tracemalloc
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from fakeworker import FakeWorker
from lifecycle import in_async

import colobus as cb
from colobus._api.fetch import fetch_tree
from colobus._api.shards import fetch_shard
from colobus._wire import protocol as P
from colobus._wire.protocol import Kind, Status

FAST: dict[str, Any] = dict(heartbeat_interval=0.5, liveness_timeout=60.0, join_timeout=120.0)


class _Touch:
    """Unpickling this creates a file: the canary for "nothing was unpickled"."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (self.path,))


@cb.colocated_python
def add_one(x: Any) -> Any:
    return x + 1


@cb.colocated_python
def make_one() -> Any:
    return np.ones(2, np.float32)


def _make_one_specs() -> cb.ShapeDtypeStruct:
    """``make_one``'s output specs: its calls return at once (a fake host answers them
    after; a first call without them would wait for that answer)."""
    return cb.ShapeDtypeStruct((2,), np.float32)


def _wait_until(pred: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> collections.abc.Iterator[dict[str, Any]]:
    """A controller (its own loop thread), one real worker, and a marker path."""
    tmp = tmp_path_factory.mktemp("malicious")
    key = secrets.token_bytes(32)
    ctl = cb.Controller("tcp://127.0.0.1:*", hosts=0, key=key,
                        max_message_bytes=4 << 20, **FAST)
    ctl.start_in_thread()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
    proc = subprocess.Popen([sys.executable, "-m", "colobus", "worker", "--connect", ctl.address,
                             "--devices", "2", "--name", "real", "--key-file", "-"],
                            stdin=subprocess.PIPE, env=env)
    assert proc.stdin is not None
    proc.stdin.write(key.hex().encode() + b"\n")
    proc.stdin.close()
    zctx: zmq.Context[Any] = zmq.Context()
    # A module that would create the marker if the controller ever imported it.
    (tmp / "colobus_evil_module.py").write_text(
        f"import pathlib\npathlib.Path({str(tmp / 'marker')!r}).touch()\n"
        "class Boom(Exception):\n    pass\n")
    sys.path.insert(0, str(tmp))
    try:
        _wait_until(lambda: len(ctl.hosts()) == 1, "the real worker to join", 120)
        yield {"ctl": ctl, "key": key, "marker": tmp / "marker", "zctx": zctx}
    finally:
        sys.path.remove(str(tmp))
        ctl.close()
        proc.kill()
        proc.wait(30)
        zctx.term()


@pytest.fixture
def mctl(bed: dict[str, Any]) -> collections.abc.Iterator[cb.Controller]:
    from colobus._controller.controller import _pop_current, _push_current

    ctl: cb.Controller = bed["ctl"]
    _push_current(ctl)
    try:
        yield ctl
    finally:
        _pop_current(ctl)
    # After every test: nothing unpickled or imported; no table grew without bound.
    assert not bed["marker"].exists()
    assert "colobus_evil_module" not in sys.modules
    stats = ctl.stats()
    assert stats["join_challenges"] <= 1024 and len(ctl._hosts.dead_sessions) <= 4096
    assert stats.get("dropped", {}).get("handler_error", 0) == 0


def _real_host_still_works(ctl: cb.Controller) -> None:
    real = [d for d in ctl.devices() if d.host == 0]
    x = cb.device_put(np.arange(4.0), real[0])
    assert np.asarray(add_one(x)).tolist() == [1.0, 2.0, 3.0, 4.0]


@contextlib.contextmanager
def _fake(bed: dict[str, Any], name: str) -> collections.abc.Iterator[FakeWorker]:
    """A joined fake host; closed, and declared lost if it still is alive, at the end."""
    ctl: cb.Controller = bed["ctl"]
    fake = FakeWorker(bed["zctx"], ctl.address, bed["key"], name)
    try:
        fake.join()
        yield fake
    finally:
        fake.close()
        if fake.index >= 0 and ctl.hosts()[fake.index].state == "alive":
            ctl._declare_lost(fake.index)
            _wait_until(lambda: ctl.hosts()[fake.index].state == "lost", "retired fake")


def _dropped(ctl: cb.Controller, host: int, reason: str, before: dict[str, int]) -> None:
    """``host`` was declared lost, and ``reason`` counted once more."""
    _wait_until(lambda: ctl.hosts()[host].state == "lost", f"host {host} dropped")
    assert ctl.stats()["dropped"].get(reason, 0) > before.get(reason, 0), ctl.stats()["dropped"]


def _answer_call(fake: FakeWorker, status: int, meta: Any, payload: bytes = b"",
                 buffers: list[bytes] | None = None) -> None:
    call = fake.expect(Kind.CALL)
    fake.send(Kind.RESULT, [call.body[0], status, meta], payload, buffers)


def _evil_payloads(marker: pathlib.Path) -> list[tuple[int, Any, bytes, list[bytes]]]:
    """(status, meta, payload, buffers) replies, each carrying hostile bytes or names."""
    evil = pickle.dumps(_Touch(marker))
    pack = msgpack.packb
    leaf = {"shape": [2], "dtype": "<f4", "spec": None, "key": None}
    return [
        (Status.OK, 1, evil, [evil]),  # a pickle as the output description
        (Status.ERROR, None, evil, [evil]),  # a pickle as the error description
        (Status.OK, evil, evil, []),  # a pickle as the count
        (Status.OK, 1, pack({"v": 1, "tree": "*", "leaves": [dict(leaf, dtype=evil)]}), []),
        (Status.OK, 1, pack({"v": 1, "tree": "*", "leaves": [dict(leaf, spec=evil)]}), []),
        (Status.OK, 1, pack({"v": 1, "tree": ["c", "os", "system", [str(marker)], ["*"]],
                             "leaves": [leaf]}), []),
        (Status.OK, 1, pack({"v": 1, "tree": ["n", "colobus_evil_module", "Boom", ["*"]],
                             "leaves": [leaf]}), []),
        (Status.OK, 1, pack({"v": 1, "tree": ["t", [["l", [["t", ["*"]]] * 3]] * 200],
                             "leaves": [leaf]}), []),  # leaves reused: not one per slot
    ]


@pytest.mark.parametrize("case", range(8))
def test_hostile_replies_never_run_code(bed: dict[str, Any], mctl: cb.Controller,
                                        case: int) -> None:
    with _fake(bed, f"evil-{case}") as fake:
        before = dict(mctl.stats()["dropped"])
        dev = [d for d in mctl.devices() if d.host == fake.index]
        out = make_one.specialize(devices=dev, out_specs_fn=_make_one_specs)()
        _answer_call(fake, *_evil_payloads(bed["marker"])[case])
        with pytest.raises(cb.ProtocolError, match="malformed reply"):
            cb.block_until_ready(out)
        _dropped(mctl, fake.index, "bad_reply", before)
    _real_host_still_works(mctl)


def test_errors_are_data_never_code(bed: dict[str, Any], mctl: cb.Controller) -> None:
    """Error descriptions name callables and modules: only imported Exception classes
    are rebuilt; everything else is a RemoteError; nothing is imported or called."""
    marker = str(bed["marker"])

    def error(module: str, qualname: str, args: Any) -> bytes:
        return msgpack.packb({"v": 1, "module": module, "qualname": qualname, "args": args,
                              "message": "m", "notes": ["n1"], "traceback": "tb", "host": "h"})

    with _fake(bed, "evil-errors") as fake:
        dev = [d for d in mctl.devices() if d.host == fake.index]
        cases: list[tuple[bytes, Any]] = [
            (error("os", "system", [f"touch {marker}"]), cb.RemoteError),
            (error("builtins", "exec", [f"open({marker!r}, 'w')"]), cb.RemoteError),
            (error("colobus_evil_module", "Boom", []), cb.RemoteError),  # not imported
            (error("pathlib", "Path.touch", [marker]), cb.RemoteError),
            (error("builtins", "KeyboardInterrupt", []), cb.RemoteError),  # not an Exception
            (error("builtins", "ValueError", ["plain", 1, [2.5, None]]), ValueError),
            (error("builtins", "KeyError", None), cb.RemoteError),  # args did not travel
            # Never colobus's own errors, nor what steers the caller's control flow
            # (issue 23): a worker cannot make a call look like a lost host or end a loop.
            (error("colobus._errors", "HostLostError", ["forged", 0]), cb.RemoteError),
            (error("colobus", "ControllerClosedError", ["forged"]), cb.RemoteError),
            (error("builtins", "StopIteration", ["forged"]), cb.RemoteError),
            (error("builtins", "StopAsyncIteration", []), cb.RemoteError),
            (error("builtins", "GeneratorExit", []), cb.RemoteError),
        ]
        for payload, expected in cases:
            out = make_one.specialize(devices=dev, out_specs_fn=_make_one_specs)()
            _answer_call(fake, Status.ERROR, None, payload)
            with pytest.raises(expected) as info:
                cb.block_until_ready(out)
            assert "n1" in info.value.__notes__
            assert f"raised on colobus host {fake.index}" in info.value.__notes__[1]
        assert mctl.hosts()[fake.index].state == "alive"  # errors as data are no violation
    _real_host_still_works(mctl)


@pytest.mark.parametrize("what", ["huge_count", "negative_count", "stats_counts",
                                  "fetch_shape", "shard_shape", "shard_size", "unknown_kind",
                                  "controller_kind",
                                  "never_sent", "other_hosts_call", "oversized_total"])
def test_protocol_violations_drop_the_host(bed: dict[str, Any], mctl: cb.Controller,
                                           what: str) -> None:
    reason = {"huge_count": "malformed", "negative_count": "malformed",
              "stats_counts": "bad_reply", "fetch_shape": "bad_reply",
              "shard_shape": "bad_reply", "shard_size": "bad_reply",
              "unknown_kind": "malformed", "controller_kind": "unexpected_kind",
              "never_sent": "unsolicited", "other_hosts_call": "unsolicited",
              "oversized_total": "oversized"}[what]
    evil = pickle.dumps(_Touch(bed["marker"]))
    other: Any = None
    with _fake(bed, f"bad-{what}") as fake:
        before = dict(mctl.stats()["dropped"])
        dev = [d for d in mctl.devices() if d.host == fake.index]
        if what in ("huge_count", "negative_count"):
            out = make_one.specialize(devices=dev, out_specs_fn=_make_one_specs)()
            # A count this size once built range(n) on the controller's loop.
            _answer_call(fake, Status.OK, (1 << 62) if what == "huge_count" else -1)
            with pytest.raises(cb.HostLostError):
                cb.block_until_ready(out)
        elif what == "stats_counts":
            fut = mctl.refresh_stats()
            st = fake.expect(Kind.STATS)
            fake.send(Kind.RESULT, [st.body[0], Status.OK, [-1, 1 << 63, evil, 0]])
            with pytest.raises(cb.ProtocolError):
                fut.result(30)
        elif what == "fetch_shape":
            arr = cb.device_put(np.zeros(2, np.float32), dev[0])
            fut = fetch_tree(arr)  # (cb.device_get would wait here for the answer below)
            fetch = fake.expect(Kind.FETCH)
            fake.send(Kind.RESULT, [fetch.body[0], Status.OK, [[1 << 40, 1 << 40], "<f4", None]],
                      b"", [evil])
            with pytest.raises(cb.ProtocolError):
                fut.result(30)
        elif what in ("shard_shape", "shard_size"):
            # Shard.data reads its block with the bounded reader and checks its shape
            # (issue 23): a block of another shape, or sizes the buffer does not hold.
            arr = cb.device_put(np.zeros(2, np.float32), dev[0])
            shard = arr.addressable_shards[0]  # (its .data would wait here for the answer)
            fut = fetch_shard(arr, shard.device, shard.index)
            fetch = fake.expect(Kind.FETCH)
            shape = [3] if what == "shard_shape" else [1 << 40]
            fake.send(Kind.RESULT, [fetch.body[0], Status.OK, [shape, "<f4", None]],
                      b"", [np.zeros(3, np.float32).tobytes()])
            with pytest.raises(cb.ProtocolError):
                fut.result(30)
        elif what == "unknown_kind":
            fake.send(99, [evil])
        elif what == "controller_kind":
            fake.send(Kind.CODE, [b"d" * 16], evil)
        elif what == "never_sent":
            fake.send(Kind.RESULT, [10**12, Status.OK, 1], evil)
        elif what == "other_hosts_call":
            real = [d for d in mctl.devices() if d.host == 0]
            other = add_one(cb.device_put(np.arange(3.0), real[0]))
            call_id = other.ref >> 16  # (P.output_ref: its call's id)
            fake.send(Kind.RESULT, [call_id, Status.ERROR, None], evil)
            fake.send(Kind.RESULT, [call_id + 1, Status.OK, 1], evil)
        elif what == "oversized_total":
            # Two frames under the limit each, over it together: counted, not buffered
            # into anything, and this host (whose real workers stay under) is dropped.
            half = b"\0" * (3 << 20)
            fake.send(Kind.HEARTBEAT, [0, 0, 0, 0], b"", [half, half])
        _dropped(mctl, fake.index, reason, before)
    if other is not None:  # the other host's call was not disturbed
        assert np.asarray(other).tolist() == [1.0, 2.0, 3.0]
    _real_host_still_works(mctl)
    assert mctl.stats()["hosts_dropped"] >= 1


@pytest.mark.parametrize("fetch", ["never_sent", "not_an_id"])
def test_a_reply_answering_a_wait_never_asked_drops_the_host(bed: dict[str, Any],
                                                             mctl: cb.Controller,
                                                             fetch: str) -> None:
    """A call's RESULT may also answer the FETCH_CALL its host held for the call (its
    times' fourth field, that FETCH's id: protocol 13). One naming a FETCH never sent to
    that host, or no id at all, is a violation as any unsolicited or malformed reply."""
    reason = {"never_sent": "unsolicited", "not_an_id": "malformed"}[fetch]
    with _fake(bed, f"fetch-{fetch}") as fake:
        before = dict(mctl.stats()["dropped"])
        dev = [d for d in mctl.devices() if d.host == fake.index]
        out = make_one.specialize(devices=dev, out_specs_fn=_make_one_specs)()
        call = fake.expect(Kind.CALL)
        leaf = {"shape": [2], "dtype": "<f4", "spec": None, "key": None}
        desc = msgpack.packb({"v": 1, "tree": "*", "leaves": [leaf]})
        times = [1_000, 2_000, 1, 10**12 if fetch == "never_sent" else "x"]
        fake.send(Kind.RESULT, [call.body[0], Status.OK, 1, times], desc)
        _dropped(mctl, fake.index, reason, before)
        del out
    _real_host_still_works(mctl)


def test_join_floods_stay_bounded(bed: dict[str, Any], mctl: cb.Controller,
                                  caplog: pytest.LogCaptureFixture) -> None:
    """JOIN, HELLO and bad-MAC floods: bounded tables, flat memory, few log lines."""
    ctl = mctl
    hosts_before = len(ctl.hosts())
    before = dict(ctl.stats()["dropped"])
    flood = FakeWorker(bed["zctx"], ctl.address, bed["key"], "flood")
    stranger = FakeWorker(bed["zctx"], ctl.address, secrets.token_bytes(32), "stranger")
    caplog.set_level(logging.WARNING, logger="colobus")
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        n = 3000
        for i in range(n):
            flood.send(Kind.JOIN, [], session=secrets.token_bytes(16), receiver=b"")
            hello = P.Hello(f"flood-{i}", 1, "x", [], secrets.token_bytes(16))
            flood.send(Kind.HELLO, hello.to_wire(), session=secrets.token_bytes(16), receiver=b"")
            stranger.send(Kind.HELLO, hello.to_wire(), receiver=b"")
        _wait_until(lambda: ctl.stats()["dropped"].get("unauthenticated", 0)
                    >= before.get("unauthenticated", 0) + n, "the flood to be read", 120)
        _wait_until(lambda: ctl.stats()["dropped"].get("replay", 0)
                    >= before.get("replay", 0) + n, "the HELLOs to be dropped", 120)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
        flood.close()
        stranger.close()
    assert len(ctl.hosts()) == hosts_before  # no HELLO without a fresh nonce joined
    assert ctl.stats()["join_challenges"] <= 1024  # bounded, whatever the flood
    assert grown < 2 << 20, f"the controller grew by {grown} bytes"
    warnings = [r for r in caplog.records if r.name == "colobus.controller"
                and "dropping" in r.getMessage()]
    assert len(warnings) <= 1  # one line, then periodic summaries
    _real_host_still_works(ctl)


def test_recorded_hello_is_worthless_to_a_restarted_controller(
        bed: dict[str, Any], mctl: cb.Controller) -> None:
    """A HELLO recorded from an earlier controller (same key) neither joins nor evicts."""
    key = bed["key"]
    with cb.Controller("tcp://127.0.0.1:*", hosts=0, key=key, **FAST) as earlier:
        recorder = FakeWorker(bed["zctx"], earlier.address, key, "victim")
        recorder.join()
        recorded = recorder.sent_hello
        recorder.close()
    replayer = bed["zctx"].socket(zmq.DEALER)
    replayer.setsockopt(zmq.LINGER, 0)
    replayer.connect(mctl.address)
    # ``victim``: the live host of that name on the current controller.
    with _fake(bed, "victim") as victim, contextlib.closing(replayer):
        before = dict(mctl.stats()["dropped"])
        replayer.send_multipart(recorded)
        # Also the live victim's own HELLO from another connection: its nonce was used.
        replayer.send_multipart(victim.sent_hello)
        _wait_until(lambda: mctl.stats()["dropped"].get("replay", 0)
                    >= before.get("replay", 0) + 2, "the replays to be dropped")
        assert mctl.hosts()[victim.index].state == "alive"
        assert [h.name for h in mctl.hosts()].count("victim") == 1
    _real_host_still_works(mctl)


def test_reply_over_the_limit_fails_its_call_with_a_clear_error(
        bed: dict[str, Any], mctl: cb.Controller) -> None:
    """A real worker never sends a message over the controller's max_message_bytes:
    the fetch fails with an error saying how to raise the limit; the host stays."""
    real = [d for d in mctl.devices() if d.host == 0]
    big = cb.device_put(np.zeros(6 << 20, np.uint8), real[0])  # over the bed's 4 MiB
    with pytest.raises(ValueError, match=r"max_message_bytes=4194304.*raise it"):
        cb.device_get(big)
    assert mctl.hosts()[0].state == "alive"
    _real_host_still_works(mctl)


def test_hostile_host_times_never_skew_metrics() -> None:
    """Run times reach the metrics only from heartbeats, as whole well-formed entries."""
    from colobus._controller.controller import _pop_current, _push_current
    from colobus._wire.calltimes import BUCKETS

    key = secrets.token_bytes(32)
    ctl = cb.Controller("tcp://127.0.0.1:*", hosts=0, key=key, metrics="127.0.0.1:0", **FAST)
    ctl.start_in_thread()
    zctx: zmq.Context[Any] = zmq.Context()
    fake = FakeWorker(zctx, ctl.address, key, "times")
    _push_current(ctl)
    try:
        fake.join()
        dev = [d for d in ctl.devices() if d.host == fake.index]
        # The times a RESULT carries are for traces only: hostile ones end the call, no more.
        hostile: list[Any] = [[1_000, 2_000], ["x", 3], [2, 1 << 63], [1, 2, 3], [None, None]]
        digest = b""
        for times in hostile:
            # (the call's Future, async code's: its cancellation is seen)
            fut = in_async(make_one.specialize(devices=dev, out_specs_fn=_make_one_specs))
            call = fake.expect(Kind.CALL)
            digest = call.body[2]
            fake.send(Kind.RESULT, [call.body[0], Status.CANCELLED, None, times])
            _wait_until(fut.done, "the call to end")
            assert fut.cancelled()

        def counts(bucket: int, n: int) -> list[Any]:
            out: list[Any] = [0] * (len(BUCKETS) + 1)
            out[bucket] = n
            return out

        good = [digest, "", counts(0, 2), 1_000, counts(1, 2), 300_000]
        bad: list[Any] = [
            "x", [digest, ""], [digest.hex(), "", *good[2:]], [digest, 3, *good[2:]],
            [digest, "", counts(0, 2)[:-1], 1_000, counts(1, 2), 300_000],  # a bucket short
            [digest, "", counts(0, -2), 1_000, counts(1, -2), 300_000],  # negative counts
            [digest, "", counts(0, 1 << 63), 1_000, counts(1, 1 << 63), 300_000],
            [digest, "", counts(0, 2), -1, counts(1, 2), 300_000],  # a negative sum
            [digest, "", counts(0, 2), 1.5, counts(1, 2), 300_000],  # not an int
            [digest, "", counts(0, 2), 1_000, counts(1, 3), 300_000],  # 2 queued, 3 ran
            [digest, "", [*counts(0, 1)[:-1], "x"], 1_000, counts(1, 1), 300_000],
            [b"never called", "", *good[2:]], [digest, "no_such_method", *good[2:]],
        ]
        dropped = ctl.stats()["dropped"].get("malformed", 0)
        fake.send(Kind.HEARTBEAT, [0, 0, 0, 0, 0, 0, 0, 0, {}, [*bad[:6], good, *bad[6:]]])

        def counted() -> bool:
            return ctl.stats()["dropped"].get("malformed", 0) == dropped + len(bad)

        _wait_until(counted, "the heartbeat's bad entries to be counted")
        stats = ctl.observer.functions()["make_one"] if ctl.observer else None
        assert stats is not None and stats.cancelled == len(hostile)
        assert sum(stats.run.counts) == sum(stats.queue.counts) == 2  # the good entry only
        assert stats.queue.counts[0] == 2 and stats.run.counts[1] == 2
        assert stats.run.total == pytest.approx(3e-4) and stats.queue.total == pytest.approx(1e-6)
        assert ctl.hosts()[fake.index].state == "alive"
    finally:
        _pop_current(ctl)
        fake.close()
        ctl.close()
        zctx.term()
