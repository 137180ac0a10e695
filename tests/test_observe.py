"""Seeing a running cluster: the metrics endpoint, ``colobus top``, timings and traces.

One 2-host cluster with metrics and tracing on serves the module. Each test uses
functions of its own, so per-function counts are exact; byte counters are read
as differences between two scrapes.
"""

from __future__ import annotations

import collections.abc
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from lifecycle import in_async

import colobus as cb
from colobus._api.fetch import fetch_tree

pytest.importorskip("prometheus_client", reason="prometheus_client is in the [test] extra")
pytest.importorskip("rich", reason="rich is in the [test] extra")

from prometheus_client.parser import text_string_to_metric_families

from colobus._observe.top import quantile

COLOBUS = Path(sys.executable).parent / "colobus"  # the installed console script


@cb.colocated_python
def obs_inc(x: Any) -> Any:
    return x + 1


@cb.colocated_python
def obs_fail(x: Any) -> Any:
    raise ValueError("obs_fail fails on purpose")


@cb.colocated_python
def obs_traced(x: Any) -> Any:
    return x * 2


@cb.colocated_python
def obs_top(x: Any) -> Any:
    return x - 1


@cb.colocated_python
def obs_live(x: Any) -> Any:
    return x + 3


@cb.colocated_python
def obs_otel(x: Any) -> Any:
    return x + 4


@cb.colocated_python
def obs_now(x: Any) -> Any:
    return x * 3


@cb.colocated_python_class
class ObsCounter:
    def __init__(self) -> None:
        self.n = 0

    def bump(self, x: Any) -> Any:
        self.n += 1
        return x


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> collections.abc.Iterator[cb.Controller]:
    trace = tmp_path_factory.mktemp("trace") / "calls.json"
    with cb.local_cluster(hosts=2, devices_per_host=2, metrics="127.0.0.1:0",
                          trace=trace) as ctl:
        yield ctl


@pytest.fixture
def octl(watched: cb.Controller) -> collections.abc.Iterator[cb.Controller]:
    from colobus._controller.controller import _pop_current, _push_current

    _push_current(watched)
    try:
        yield watched
    finally:
        _pop_current(watched)


def _sharded(ctl: cb.Controller, n: int) -> cb.Array:
    mesh = cb.Mesh(np.array(ctl.devices()), ("d",))
    return cb.device_put(np.arange(n, dtype=np.float32),
                         cb.NamedSharding(mesh, cb.PartitionSpec("d")))


def _scrape(ctl: cb.Controller) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a real scrape, parsed by prometheus_client's own parser."""
    assert ctl.metrics_url is not None
    text = urllib.request.urlopen(ctl.metrics_url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _value(samples: dict[Any, float], metric: str, **labels: str) -> float:
    """The one sample of ``metric`` whose labels include ``labels``."""
    found = [v for (name, have), v in samples.items()
             if name == metric and set(labels.items()) <= set(have)]
    assert len(found) == 1, (metric, labels, found)
    return found[0]


def _eventually(check: collections.abc.Callable[[], bool], what: str, timeout: float = 20.0
                ) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_scrape_counts_known_work(octl: cb.Controller) -> None:
    before = _scrape(octl)
    n_calls, floats = 7, 1024  # 4 KiB, split over 4 devices on 2 hosts
    x = _sharded(octl, floats)
    futs = in_async(lambda: [obs_inc(x) for _ in range(n_calls)])  # (Futures: timings())
    outs = [f.result(timeout=60) for f in futs]
    with pytest.raises(ValueError, match="on purpose"):
        cb.block_until_ready(obs_fail(x))
    np.testing.assert_array_equal(cb.device_get(outs[-1]),
                                  np.arange(floats, dtype=np.float32) + 1)

    # A scrape asks the hosts for what they hold and how long each call waited
    # and ran there; the heartbeat round trip needs a heartbeat (one a second).
    def reported() -> bool:
        s = _scrape(octl)
        return all(("colobus_host_heartbeat_rtt_seconds", (("host", str(h)), ("name", n)))
                   in s for h, n in ((0, "local-0"), (1, "local-1")))

    _eventually(reported, "the hosts' first heartbeat round trips")
    after = _scrape(octl)
    assert _value(after, "colobus_calls_started_total", function="obs_inc") == n_calls
    assert _value(after, "colobus_calls_finished_total", function="obs_inc") == n_calls
    assert _value(after, "colobus_calls_failed_total", function="obs_inc") == 0
    assert _value(after, "colobus_calls_failed_total", function="obs_fail") == 1
    assert _value(after, "colobus_call_latency_seconds_count", function="obs_inc") == n_calls
    assert _value(after, "colobus_call_latency_seconds_bucket", function="obs_inc",
                  le="+Inf") == n_calls
    # Host-side run time: one observation per host per call.
    assert _value(after, "colobus_call_run_seconds_count", function="obs_inc") == 2 * n_calls
    assert _value(after, "colobus_call_host_queue_seconds_count",
                  function="obs_inc") == 2 * n_calls
    assert _value(after, "colobus_call_run_seconds_bucket", function="obs_inc",
                  le="+Inf") == 2 * n_calls
    assert 0 < _value(after, "colobus_call_run_seconds_sum", function="obs_inc") < _value(
        after, "colobus_call_latency_seconds_sum", function="obs_inc") * 2
    put = (_value(after, "colobus_put_bytes_total")
           - _value(before, "colobus_put_bytes_total"))
    fetched = (_value(after, "colobus_fetched_bytes_total")
               - _value(before, "colobus_fetched_bytes_total"))
    assert put == floats * 4 and fetched == floats * 4
    assert _value(after, "colobus_hosts", state="alive") == 2
    assert _value(after, "colobus_calls_in_flight") == 0
    assert _value(after, "colobus_code_shipped_total") >= 4  # two functions, two hosts
    for h in (0, 1):
        labels = {"host": str(h)}
        assert _value(after, "colobus_host_devices", **labels) == 2
        assert 0 < _value(after, "colobus_host_heartbeat_rtt_seconds", **labels) < 5
        assert _value(after, "colobus_host_resident_memory_bytes", **labels) > 10e6
        assert _value(after, "colobus_host_cpu_seconds_total", **labels) > 0

    t = futs[0].timings()
    assert t is not None and t.function == "obs_inc" and t.outcome == "finished"
    assert [h.host for h in t.hosts] == [0, 1]
    assert all(h.run > 0 and h.queue >= 0 and h.reply >= 0 for h in t.hosts)
    assert t.total >= t.controller_queue + t.send + max(h.queue + h.run for h in t.hosts)
    assert fetch_tree(x).timings() is None  # only colocated calls are timed (a fetch's Future)


def test_a_scrape_right_after_calls_counts_their_host_times(octl: cb.Controller) -> None:
    """A scrape asks the hosts for what they counted since their last heartbeat."""
    x = _sharded(octl, 16)
    for _ in range(5):
        cb.block_until_ready(obs_now(x))
    s = _scrape(octl)  # no waiting for a heartbeat
    assert _value(s, "colobus_call_run_seconds_count", function="obs_now") == 2 * 5
    assert _value(s, "colobus_call_host_queue_seconds_count", function="obs_now") == 2 * 5
    for h in (0, 1):
        assert _value(s, "colobus_host_arrays", host=str(h)) >= 1


def test_host_times_of_method_calls_count_per_class_and_method(octl: cb.Controller) -> None:
    """Hosts name a method's calls by its class: every object's calls count, even one
    destroyed before the host's next heartbeat."""
    x = _sharded(octl, 8)  # on both hosts: each call runs, and is timed, on two
    first, second = ObsCounter(), ObsCounter()
    outs = [first.bump(x) for _ in range(3)] + [second.bump(x) for _ in range(2)]
    cb.block_until_ready(outs)
    cb.block_until_ready(ObsCounter().bump(x))  # a temporary object, destroyed after its call

    def reported() -> bool:
        return _value(_scrape(octl), "colobus_call_run_seconds_count",
                      function="ObsCounter.bump") >= 2 * 6

    _eventually(reported, "the hosts' heartbeats to report the method's run times")
    s = _scrape(octl)
    assert _value(s, "colobus_calls_finished_total", function="ObsCounter.bump") == 6
    assert _value(s, "colobus_call_run_seconds_count", function="ObsCounter.bump") == 12
    assert _value(s, "colobus_call_host_queue_seconds_count", function="ObsCounter.bump") == 12


def test_trace_has_one_event_per_host_per_call(octl: cb.Controller, tmp_path: Path) -> None:
    x = _sharded(octl, 8)
    futs = in_async(lambda: [obs_traced(x) for _ in range(3)])  # (Futures: their call ids)
    for f in futs:
        f.result(timeout=60)
    path = octl.write_trace(tmp_path / "trace.json")
    doc = json.loads(Path(path).read_text())
    events = [e for e in doc["traceEvents"] if e.get("name") == "obs_traced"]
    assert all(e["ph"] == "X" and e["dur"] >= 0 and isinstance(e["ts"], float)
               for e in events)
    per_call: dict[int, list[int]] = {}
    for e in events:
        per_call.setdefault(e["args"]["call_id"], []).append(e["tid"])
    assert sorted(per_call) == sorted(f.call_id for f in futs)
    assert all(sorted(tids) == [0, 1] for tids in per_call.values())
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e.get("name") == "thread_name"}
    assert names[0] == "host 0" and names[1] == "host 1"


def test_top_once_through_the_console_script(octl: cb.Controller) -> None:
    x = _sharded(octl, 8)
    for _ in range(3):
        cb.block_until_ready(obs_top(x))
    assert octl.metrics_url is not None
    base = octl.metrics_url.removesuffix("/metrics")
    out = subprocess.run([str(COLOBUS), "top", "--metrics", base, "--once"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "colobus top" in out.stdout and "2/2 hosts alive" in out.stdout
    assert "local-0" in out.stdout and "local-1" in out.stdout
    row = next(line for line in out.stdout.splitlines() if "obs_top" in line)
    assert row.split("│")[2].strip() == "3", row  # the calls column


def test_top_without_a_cluster_says_so() -> None:
    out = subprocess.run([str(COLOBUS), "top", "--metrics", "http://127.0.0.1:9", "--once"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "cannot read http://127.0.0.1:9/metrics" in out.stderr


def _tmux(sock: str, *args: str) -> str:
    return subprocess.run(["tmux", "-L", sock, *args], capture_output=True, text=True,
                          timeout=30, check=True).stdout


def test_live_view_refreshes_under_tmux(octl: cb.Controller) -> None:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install tmux); .ci/run installs it")
    assert octl.metrics_url is not None
    sock = f"colobus-test-{os.getpid()}"  # a private tmux server, with our environment
    # COLUMNS pinned: run from pytest, rich measured 80 columns in this 150-column pane.
    cmd = f"env COLUMNS=150 LINES=50 {COLOBUS} top --metrics {octl.metrics_url} --interval 0.3"
    _tmux(sock, "new-session", "-d", "-s", "top", "-x", "150", "-y", "50", cmd)
    try:
        def screen() -> str:
            return _tmux(sock, "capture-pane", "-p", "-t", "top")

        _eventually(lambda: "busiest functions" in screen(), "the live view to draw")
        first = screen()
        assert "obs_live" not in first
        x = _sharded(octl, 8)
        for _ in range(4):
            cb.block_until_ready(obs_live(x))

        def shows_calls() -> bool:
            rows = [ln for ln in screen().splitlines() if "obs_live" in ln]
            return bool(rows) and rows[0].split("│")[2].strip() == "4"

        _eventually(shows_calls, "the live view to show the new calls")
        last = screen()
        assert "colobus top" in last and "local-1" in last, last
    finally:
        subprocess.run(["tmux", "-L", sock, "kill-server"], capture_output=True, timeout=30)


def test_otel_spans_one_per_call_with_a_child_per_host(octl: cb.Controller) -> None:
    pytest.importorskip("opentelemetry.sdk", reason="opentelemetry-sdk is in the [test] extra")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel = octl.observer.otel if octl.observer is not None else None
    assert otel is not None, "trace= with opentelemetry importable emits spans"
    otel._tracer = provider.get_tracer("colobus")  # not the process-wide provider
    x = _sharded(octl, 8)
    for _ in range(2):
        cb.block_until_ready(obs_otel(x))
    spans = exporter.get_finished_spans()
    parents = [s for s in spans if s.name == "obs_otel"]
    children = [s for s in spans if s.name.startswith("obs_otel on host")]
    assert len(parents) == 2 and len(children) == 4
    ids = {p.context.span_id for p in parents}
    assert all(c.parent is not None and c.parent.span_id in ids for c in children)
    assert all(p.start_time is not None and p.end_time is not None
               and p.start_time <= p.end_time for p in parents)


def test_a_public_metrics_address_is_refused_unless_asked_for() -> None:
    with pytest.raises(ValueError, match="not loopback"):
        cb.Controller(metrics="0.0.0.0:9464")
    with pytest.raises(ValueError, match="HOST:PORT"):
        cb.Controller(metrics="9464")
    ctl = cb.Controller(metrics="0.0.0.0:0", metrics_public=True)  # allowed on purpose
    assert ctl.metrics_url is None  # not started: nothing served yet
    assert cb.Controller().observer is None  # off by default: nothing recorded


def test_quantiles_from_histogram_buckets() -> None:
    buckets = [(0.001, 0.0), (0.01, 50.0), (0.1, 100.0), (float("inf"), 100.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.01)
    assert quantile(0.99, buckets) == pytest.approx(0.01 + 0.09 * 0.98)
    assert quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    assert quantile(0.99, [(0.1, 1.0), (float("inf"), 10.0)]) == 0.1  # rank past the bounds


def test_demo_serves_metrics_and_says_how_to_watch() -> None:
    out = subprocess.run([str(COLOBUS), "demo", "--metrics", "127.0.0.1:0", "--steps", "3",
                          "--hosts", "1", "--devices", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if "watch live:" in ln)
    assert line.strip().startswith("watch live: colobus top --metrics http://127.0.0.1:")
    assert int(line.rsplit(":", 1)[1]) > 0  # the port it got, not 0


async def test_trace_path_is_written_on_close(tmp_path: Path) -> None:
    path = tmp_path / "closing.json"
    async with cb.Controller(hosts=0, trace=path) as ctl:
        assert ctl.observer is not None and ctl.metrics_url is None
    doc = json.loads(path.read_text())
    assert doc["traceEvents"][0]["ph"] == "M"  # no calls: the process name alone
    assert [e for e in doc["traceEvents"] if e["ph"] == "X"] == []


def test_metrics_alone_count_every_call_and_keep_no_record_per_call() -> None:
    with cb.local_cluster(hosts=1, devices_per_host=1, metrics="127.0.0.1:0") as ctl:
        x = cb.device_put(np.arange(4, dtype=np.float32), ctl.devices()[0])
        futs = in_async(lambda: [obs_inc(x) for _ in range(50)])  # (Futures: one cancelled)
        futs[-1].cancel()  # cancelled (or finished, if it was too late to cancel)
        for f in futs[:-1]:
            f.result(timeout=60)
        _eventually(lambda: futs[-1].done(), "the cancelled call to settle")
        assert futs[0].timings() is None  # no per-call record without trace=
        s = _scrape(ctl)
        ended = sum(_value(s, f"colobus_calls_{what}_total", function="obs_inc")
                    for what in ("finished", "failed", "cancelled"))
        assert _value(s, "colobus_calls_started_total", function="obs_inc") == 50 == ended
        assert _value(s, "colobus_call_latency_seconds_count", function="obs_inc") == 50
        assert _value(s, "colobus_calls_in_flight") == 0


def test_fold_moves_samples_into_counters_and_histograms() -> None:
    from colobus._observe.observer import FunctionStats

    stats = FunctionStats()
    for outcome, latency in ((0, 0.0002), (1, 0.02), (2, 3.0)):
        stats.ends[outcome].append(latency)
    stats.fold()
    assert (stats.finished, stats.failed, stats.cancelled) == (1, 1, 1)
    assert sum(stats.latency.counts) == 3 and stats.latency.total == pytest.approx(3.0202)
    assert stats.latency.counts[1] == stats.latency.counts[7] == stats.latency.counts[14] == 1
    assert not any(stats.ends)


def test_host_call_times_reach_the_function_they_belong_to() -> None:
    """What a host counts (queued, ran ns) arrives bucketed in seconds, per function."""
    from colobus._observe.observer import Observer
    from colobus._wire.calltimes import HostCallTimes

    host = HostCallTimes()
    for queued, ran in ((1_000, 2_000), (-5, 7), (30_000, 3_000_000_000)):
        host.add((b"f", ""), queued, ran)
    host.add((b"cls", "step"), 0, 400_000)
    entries = host.take()
    assert len(entries) == 2 and host.take() == []  # each sample is sent once
    obs = Observer()
    f, step = obs.function("f", (b"f", "")), obs.function("Model.step", (b"cls", "step"))
    assert obs.add_host_calls(entries) == 0
    assert sum(f.queue.counts) == sum(f.run.counts) == 3 and sum(step.run.counts) == 1
    assert f.queue.total == pytest.approx(31e-6)  # a negative time counts as 0
    assert f.run.total == pytest.approx(3.000002007)
    assert f.run.counts[0] == 2 and f.run.counts[14] == 1 and step.run.counts[2] == 1
    assert obs.add_host_calls([[b"g", "", *entries[0][2:]]]) == 1  # a function never called


def test_a_heartbeat_carries_call_times_within_its_byte_budget() -> None:
    """Many functions' times go out over several heartbeats, each far below any
    message limit, and none is lost or sent twice."""
    import msgpack

    from colobus._wire.calltimes import HostCallTimes

    host = HostCallTimes()
    for i in range(50):
        host.add((i.to_bytes(32, "big"), "m" * 100), 1, 2)
    budget, sent = 8 << 10, []
    while batch := host.take(budget):
        assert len(msgpack.packb(batch)) <= budget
        sent.extend(batch)
    assert sorted(e[0] for e in sent) == [i.to_bytes(32, "big") for i in range(50)]
    host.add((b"x" * 32, "y" * 10_000), 1, 2)
    assert len(host.take(100)) == 1  # one entry always goes, whatever the budget
