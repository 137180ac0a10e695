"""A hypothesis state machine that explores a live 2-host cluster (issue 12).

Random sequences of calls (fast, slow, raising; on one host or both), cancels,
awaits, dropped futures, array puts, fetches, deletes and drops, colocated
objects made, called, closed and dropped, bursts past a small ``max_inflight``
(back-pressure), pauses that let replies race the next step, and a host killed
and restarted under its ``--name`` (standalone ``colobus worker`` processes).

Invariants: after every step, no future is past its bound unsettled; every
future settles with an outcome its operation allows; at the end of each
example, once everything is settled, dropped and collected, every live host's
store (arrays, objects, call results) is back where it started per
``refresh_stats()``, and nothing is pending or in the backlog; when the cluster
closes, every worker process exits on its own.

``test_explorer_bounded`` is the CI run (a few derandomized examples);
``test_explorer_long`` (marked ``slow``, run with ``--run-slow``) explores
longer with shrinking.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import endings_hostside as hs
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)
from lifecycle import STORE_KEYS, OnLoop, Workers, calls_return_futures

import colobus as cb
from colobus._wire.keys import write_key

BOUND = 20.0  # seconds within which any operation must settle, beyond its own run time
SLOW_S = 0.4
WHERE = st.sampled_from([(0,), (1,), (0, 1)])
PICK = st.integers(0, 255)  # which tracked future, array or object a rule acts on
_tokens = itertools.count(1)


class Bed:
    """A sync-face controller and two standalone workers that can be killed and restarted."""

    def __init__(self, key_file: str) -> None:
        self.key = write_key(key_file)
        self.workers = Workers(key_file)
        self.restarts_per_example = 1
        self.gen = [0, 0]  # restarts per host index, as the model counts them
        self.ctl = cb.Controller("tcp://127.0.0.1:*", hosts=0, key=self.key,
                                 heartbeat_interval=0.25, liveness_timeout=4.0,
                                 max_inflight=2, max_backlog=1024,
                                 exit_workers_on_close=True, join_timeout=90)
        self.procs: dict[str, Any] = {}

    def start(self) -> None:
        self.ctl.__enter__()
        for name in ("ex-0", "ex-1"):
            self.procs[name] = self.workers.start(self.ctl.address, name)
        self.ctl.run_sync(self.ctl.wait_for_hosts(2, timeout=90), timeout=120)

    def restart(self, h: int) -> None:
        """SIGKILL host ``h``'s worker, start a new one under its name, wait until it rejoined."""
        name = self.ctl.hosts()[h].name
        self.workers.kill(self.procs[name])
        new = self.workers.start(self.ctl.address, name)
        self.procs[name] = new
        deadline = time.monotonic() + 90
        while not (self.ctl.hosts()[h].state == "alive" and self.ctl.hosts()[h].pid == new.pid):
            assert new.poll() is None, f"restarted worker {name} exited with {new.returncode}"
            assert time.monotonic() < deadline, f"restarted worker {name} never rejoined"
            time.sleep(0.05)
        self.gen[h] += 1

    def close(self) -> list[str]:
        """Close the controller; the names of workers that did not exit on their own."""
        try:
            self.ctl.__exit__(None, None, None)
            left = []
            for name, p in self.procs.items():
                try:
                    p.wait(15)
                except Exception:
                    left.append(name)
            return left
        finally:
            self.workers.close()


_bed: list[Bed] = []
_on_loop: list[OnLoop] = []  # where the rules make their calls (Futures)


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    b = Bed(str(tmp_path_factory.mktemp("explorer") / "key"))
    try:
        b.start()
        _bed.append(b)
        yield b
    finally:
        _bed.clear()
        left = b.close()
    assert not left, f"worker processes left after the controller closed: {left}"


def _settled(fut: cb.Future[Any], seconds: float) -> BaseException | None:
    """Wait (bounded) for ``fut``; its exception (CancelledError if cancelled) or None."""
    try:
        return fut.exception(timeout=max(0.01, seconds))
    except asyncio.CancelledError as exc:
        return exc
    except TimeoutError:
        raise AssertionError(f"{fut!r} did not settle within {seconds:.1f} s (hang)") from None


F = TypeVar("F", bound=Callable[..., None])


def step(fn: F) -> F:
    """A rule that marks the machine busy while it runs: if it raises, the example
    failed there, and teardown only settles (its frames still hold handles, so a
    store check would report them as leaks)."""

    @functools.wraps(fn)
    def run(self: Explorer, *args: Any, **kwargs: Any) -> None:
        self.failed = True
        fn(self, *args, **kwargs)
        self.failed = False

    return run  # type: ignore[return-value]


@dataclass(eq=False)
class Obj:
    obj: Any
    start: int
    counts: dict[int, int] = field(default_factory=dict)  # host -> count, where known
    unknown: set[int] = field(default_factory=set)  # hosts whose count the model lost track of
    touched: set[int] = field(default_factory=set)
    lost_ok: set[int] = field(default_factory=set)  # hosts restarted after it was called there


@dataclass(eq=False)
class Arr:
    arr: cb.Array
    hosts: tuple[int, ...]
    gens: tuple[int, ...]
    expected: np.ndarray[Any, Any] | None


@dataclass(eq=False)
class Op:
    fut: cb.Future[Any]
    what: str
    hosts: tuple[int, ...]
    gens: tuple[int, ...]
    deadline: float
    error: type[BaseException] | None = None  # the error the call raises by design
    expected: np.ndarray[Any, Any] | None = None  # its value, where the model knows it
    may_lose: bool = False
    cancelled: bool = False
    obj: Obj | None = None  # the colocated object a method call ran on
    may_disagree: bool = False  # replicas may differ (ValueError), where the model lost count


class Explorer(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bed = _bed[0]
        self.ctl = self.bed.ctl
        self.on_loop = _on_loop[0]  # calls made as async code makes them: Futures, one stream
        self.ops: list[Op] = []
        self.dropped: list[tuple[weakref.ref[cb.Future[Any]], float, str]] = []
        self.arrays: list[Arr] = []
        self.objects: list[Obj] = []
        self.failed = False  # a rule raised: the example already failed there
        self.restarts_left = self.bed.restarts_per_example
        self.base = self._steady_store()

    # -- helpers ---------------------------------------------------------------------------

    def _store(self) -> dict[int, dict[str, Any]]:
        stats = self.ctl.refresh_stats().result(BOUND)
        return {i: h for i, h in stats["hosts"].items() if h["state"] == "alive"}

    def _steady_store(self) -> dict[int, dict[str, Any]]:
        """The store once frees of the previous example have landed (two equal readings)."""
        gc.collect()
        last = self._store()
        for _ in range(50):
            time.sleep(0.1)
            now = self._store()
            if now == last:
                return now
            last = now
        return last

    def _devs(self, where: tuple[int, ...]) -> list[cb.Device]:
        return [self.ctl.hosts()[h].devices[0] for h in where]

    def _gens(self, where: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.bed.gen[h] for h in where)

    def _lost(self, hosts: tuple[int, ...], gens: tuple[int, ...]) -> bool:
        return any(self.bed.gen[h] != g for h, g in zip(hosts, gens, strict=True))

    def _track(self, fut: cb.Future[Any], what: str, where: tuple[int, ...], seconds: float,
               error: type[BaseException] | None = None,
               expected: np.ndarray[Any, Any] | None = None, may_lose: bool = False) -> None:
        self.ops.append(Op(fut, what, where, self._gens(where),
                           time.monotonic() + seconds + BOUND, error, expected, may_lose))

    def _check(self, op: Op) -> None:
        """Wait for ``op`` (bounded) and check its outcome is one its operation allows."""
        exc = _settled(op.fut, op.deadline - time.monotonic())
        lost = op.may_lose or self._lost(op.hosts, op.gens)
        if isinstance(exc, asyncio.CancelledError):
            assert op.cancelled, f"{op.what}: cancelled, but nobody cancelled it"
            assert op.fut.cancelled(), f"{op.what}: raised CancelledError but is not cancelled"
            return
        if op.cancelled:
            raise AssertionError(f"{op.what}: cancel() returned True, yet it settled {exc!r}")
        if isinstance(exc, cb.HostLostError):
            assert lost, f"{op.what}: HostLostError though no host of it was lost: {exc}"
            return
        if op.may_disagree and isinstance(exc, ValueError) and "different values" in str(exc):
            return
        if exc is not None:
            assert op.error is not None and isinstance(exc, op.error), (
                f"{op.what}: unexpected {exc!r}")
            return
        assert op.error is None, f"{op.what}: should have raised {op.error.__name__}"
        out = op.fut.result()
        if isinstance(out, cb.Array):
            self.arrays.append(Arr(out, op.hosts, op.gens, op.expected))
            if op.expected is not None and not lost:
                got = np.asarray(cb.device_get(out))
                np.testing.assert_array_equal(got, op.expected, err_msg=op.what)

    @staticmethod
    def _pick(i: int, items: list[Any]) -> Any:
        """The ``i``-th item (modulo), or None: a rule draws the same whatever the state,
        so a replayed example draws alike even where timing changed what it holds."""
        return items[i % len(items)] if items else None

    # -- calls -------------------------------------------------------------------------------

    @rule(kind=st.sampled_from(["fast", "slow", "raising"]), where=WHERE)
    @step
    def call(self, kind: str, where: tuple[int, ...]) -> None:
        devs = self._devs(where)
        tok = next(_tokens)
        if kind == "fast":
            fut = self.on_loop(lambda: hs.value.specialize(devices=devs)(tok))
            self._track(fut, f"fast call {tok} on {where}", where, 0.0,
                        expected=np.full(2, tok, np.int32))
        elif kind == "slow":
            fut = self.on_loop(lambda: hs.nap.specialize(devices=devs)(SLOW_S, tok))
            self._track(fut, f"slow call {tok} on {where}", where, SLOW_S,
                        expected=np.asarray(np.int32(tok)))
        else:
            fut = self.on_loop(lambda: hs.fail.specialize(devices=devs)(f"raising call {tok}"))
            self._track(fut, f"raising call {tok} on {where}", where, 0.0, error=ValueError)

    @rule(slow_host=st.sampled_from([0, 1]))
    @step
    def call_lopsided(self, slow_host: int) -> None:
        """A call on both hosts where one answers at once and the other after SLOW_S."""
        tok = next(_tokens)
        pid = self.ctl.hosts()[slow_host].pid
        nap_on = hs.nap_on.specialize(devices=self._devs((0, 1)))
        fut = self.on_loop(lambda: nap_on(pid, SLOW_S, tok))
        self._track(fut, f"lopsided call {tok} (host {slow_host} slow)", (0, 1), SLOW_S,
                    expected=np.asarray(np.int32(tok)))

    @rule(i=PICK)
    @step
    def call_on_array(self, i: int) -> None:
        a: Arr | None = self._pick(i, self.arrays)
        if a is None:
            return
        lost = self._lost(a.hosts, a.gens)
        try:
            fut = self.on_loop(lambda: hs.plus_one(a.arr))
        except cb.HostLostError:
            assert lost, "HostLostError at a call on an array whose hosts were not lost"
            return
        expected = None if a.expected is None else a.expected + 1
        self._track(fut, f"plus_one on an array of {a.hosts}", a.hosts, 0.0,
                    expected=expected, may_lose=lost)
        self.ops[-1].gens = a.gens  # its output lives where the input did

    @rule(where=st.sampled_from([0, 1]), n=st.integers(3, 8))
    @step
    def burst(self, where: int, n: int) -> None:
        """More calls than ``max_inflight`` on one host: the rest wait in the backlog."""
        f = hs.value.specialize(devices=self._devs((where,)))
        for _ in range(n):
            tok = next(_tokens)
            fut = self.on_loop(lambda tok=tok: f(tok))
            self._track(fut, f"burst call {tok} on {where}", (where,), 0.0,
                        expected=np.full(2, tok, np.int32))

    @rule(i=PICK)
    @step
    def await_one(self, i: int) -> None:
        op: Op | None = self._pick(i, self.ops)
        if op is None:
            return
        self.ops.remove(op)
        self._check(op)

    @rule(i=PICK)
    @step
    def cancel(self, i: int) -> None:
        op: Op | None = self._pick(i, self.ops)
        if op is None:
            return
        if op.fut.cancel():
            op.cancelled = True
            if op.obj is not None:  # a cancelled method call may or may not have counted
                op.obj.unknown.update(op.hosts)

    @rule(i=PICK)
    @step
    def drop_future(self, i: int) -> None:
        op: Op | None = self._pick(i, self.ops)
        if op is None:
            return
        self.ops.remove(op)
        self.dropped.append((weakref.ref(op.fut), op.deadline, op.what))

    @rule(seconds=st.sampled_from([0.05, 0.2, 0.5]))
    @step
    def pause(self, seconds: float) -> None:
        """Let replies arrive (and race the next step)."""
        time.sleep(seconds)

    # -- arrays --------------------------------------------------------------------------------

    @rule(where=WHERE)
    @step
    def put(self, where: tuple[int, ...]) -> None:
        tok = next(_tokens)
        value = np.arange(4, dtype=np.int32) + 10 * tok
        devs = self._devs(where)
        target: Any = devs[0]
        if len(devs) > 1:
            mesh = cb.Mesh(np.array(devs, dtype=object), ("h",))
            target = cb.NamedSharding(mesh, cb.PartitionSpec("h"))
        self.arrays.append(Arr(cb.device_put(value, target), where, self._gens(where), value))

    @rule(i=PICK)
    @step
    def fetch(self, i: int) -> None:
        a: Arr | None = self._pick(i, self.arrays)
        if a is None:
            return
        lost = self._lost(a.hosts, a.gens)
        try:
            got = np.asarray(cb.device_get(a.arr))
        except cb.HostLostError:
            assert lost, "HostLostError fetching an array whose hosts were not lost"
            return
        except TimeoutError:
            raise AssertionError(f"device_get of an array on {a.hosts} hung") from None
        assert not lost, "an array of a restarted host was fetched"
        if a.expected is not None:
            np.testing.assert_array_equal(got, a.expected)

    @rule(i=PICK, how=st.sampled_from(["delete", "drop"]))
    @step
    def release_array(self, i: int, how: str) -> None:
        a: Arr | None = self._pick(i, self.arrays)
        if a is None:
            return
        self.arrays.remove(a)
        if how == "delete":
            a.arr.delete()
            assert a.arr.is_deleted()

    # -- objects ---------------------------------------------------------------------------------

    @rule(start=st.integers(0, 5))
    @step
    def make_object(self, start: int) -> None:
        self.objects.append(Obj(hs.Counter(start), start))

    @rule(i=PICK, where=WHERE)
    @step
    def call_object(self, i: int, where: tuple[int, ...]) -> None:
        o: Obj | None = self._pick(i, self.objects)
        if o is None:
            return
        lost = bool(o.lost_ok & set(where))
        method = o.obj.incr.specialize(devices=self._devs(where))
        try:
            fut = self.on_loop(method)
        except cb.HostLostError:
            assert lost, "HostLostError calling an object whose hosts were not lost"
            return
        finally:
            del method
        expected = None
        error: type[BaseException] | None = None
        for h in where:
            o.counts[h] = o.counts.get(h, o.start) + 1
        o.touched.update(where)
        uncertain = bool((o.unknown | o.lost_ok) & set(where))
        counts = {o.counts[h] for h in where}
        if not uncertain and len(counts) == 1:
            expected = np.asarray(np.int32(o.counts[where[0]]))
        elif not uncertain:
            error = ValueError  # a replicated output whose hosts disagree is an error
        self._track(fut, f"object {self.objects.index(o)} incr on {where}", where, 0.0,
                    error=error, expected=expected, may_lose=lost)
        self.ops[-1].obj = o
        self.ops[-1].may_disagree = uncertain

    @rule(i=PICK, how=st.sampled_from(["close", "drop"]))
    @step
    def release_object(self, i: int, how: str) -> None:
        o: Obj | None = self._pick(i, self.objects)
        if o is None:
            return
        self.objects.remove(o)
        if how == "close":
            cb.close(o.obj)

    # -- hosts -----------------------------------------------------------------------------------

    @rule(h=st.sampled_from([0, 1]))
    @step
    def restart_host(self, h: int) -> None:
        if self.restarts_left == 0:  # the example's budget: restarts cost seconds
            return
        self.restarts_left -= 1
        self.bed.restart(h)
        for op in self.ops:
            if h in op.hosts:
                op.may_lose = True
        for o in self.objects:
            if h in o.touched:
                o.lost_ok.add(h)
                o.unknown.add(h)
        self.base = {i: self.base.get(i, {}) for i in self.base}
        self.base[h] = {}  # a fresh host starts empty

    # -- invariants --------------------------------------------------------------------------------

    @invariant()
    def nothing_overdue(self) -> None:
        now = time.monotonic()
        for op in self.ops:
            assert op.fut.done() or now < op.deadline, f"{op.what} did not settle in time"
        for ref, deadline, what in self.dropped:
            fut = ref()
            assert fut is None or fut.done() or now < deadline, f"{what} did not settle in time"

    def teardown(self) -> None:
        try:
            self._settle_all()
        finally:
            self.ops.clear()
            self.dropped.clear()
            self.arrays.clear()
            self.objects.clear()
        if self.failed:
            return
        deadline = time.monotonic() + 15
        while True:
            gc.collect()
            now = self._store()
            extra = {i: {k: h[k] - self.base.get(i, {}).get(k, 0) for k in STORE_KEYS if k in h}
                     for i, h in now.items()}
            clean = all(v <= 0 for e in extra.values() for v in e.values())
            if clean or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert clean, f"after quiescence the hosts still hold {extra} (stats {now})"
        stats = self.ctl.stats()
        assert stats["pending"] == 0 and stats["backlog"] == 0, (
            f"pending {stats['pending']}, backlog {stats['backlog']} after quiescence")

    def _settle_all(self) -> None:
        """Every future still tracked or dropped (but alive) settles, as its operation allows."""
        for op in list(self.ops):
            self._check(op)
        for ref, deadline, what in self.dropped:
            fut = ref()
            if fut is not None and not fut.done():
                try:
                    _settled(fut, deadline - time.monotonic())
                except AssertionError as exc:
                    raise AssertionError(f"dropped {what}: {exc}") from None


def _run(examples: int, steps: int, shrink: bool, derandomize: bool) -> None:
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    with calls_return_futures(_bed[0].ctl) as on_loop:  # (it follows each call's Future)
        _on_loop.append(on_loop)
        try:
            _run_machine(phases, examples, steps, derandomize)
        finally:
            _on_loop.clear()


def _run_machine(phases: list[Phase], examples: int, steps: int, derandomize: bool) -> None:
    run_state_machine_as_test(Explorer, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
        derandomize=derandomize, phases=phases, suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False))


def test_explorer_bounded(bed: Bed) -> None:
    _run(examples=8, steps=30, shrink=False, derandomize=True)


@pytest.mark.slow
def test_explorer_long(bed: Bed) -> None:
    bed.restarts_per_example = 2
    _run(examples=60, steps=50, shrink=True, derandomize=False)
