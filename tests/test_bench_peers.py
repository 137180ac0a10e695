"""`colobus bench`'s peers (Ray, IPython Parallel): skipping, JSON shape, and the workloads.

CI installs only `.[test]`, so everything here except the two tests that run a
peer on tiny sizes must pass without Ray and IPython Parallel; "not installed"
is simulated by pointing the peers at module names that do not exist.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from colobus._tools import bench_peers as peers
from colobus._tools import peer_sampling as sampling
from colobus._tools.bench import BENCHMARKS, Row, Sizes, run_bench
from colobus._tools.cli import build_parser

MISSING = {"ray": "colobus_test_no_such_ray", "ipyparallel": "colobus_test_no_such_ipp"}

TINY = Sizes(latency_calls=20, pipelined_calls=100, window=10, object_reps=2,
             transfer=(("small", 256 * 1024, 2), ("large", 2 << 20, 1)), chain_reps=1,
             chain_len=10)

TINY_ROWS = {"latency_async", "latency_sync", "pipelined", "fanout2_latency",
             "fanout2_pipelined", "object_first_call", "put_small", "get_small", "put_large",
             "get_large", "chain10"}


def test_missing_peers_skip_line_and_json(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert run_bench("object", json_path=str(out), quick=True, peers=True,
                     peer_modules=MISSING) == 0
    printed = capsys.readouterr().out
    assert "ray not installed: pip install 'colobus[bench]'" in printed
    assert "ipyparallel not installed: pip install 'colobus[bench]'" in printed
    assert " vs ray" not in printed
    doc = json.loads(out.read_text())
    assert set(doc["peers"]) == {"ray", "ipyparallel"}
    for run in doc["peers"].values():
        assert run["status"] == "not installed"
        assert run["rows"] == []
        assert "colobus[bench]" in run["detail"]
    assert set(doc["benchmarks"]) == {"object_first_call"}
    assert doc["benchmarks"]["object_first_call"]["peers"] == {}


def test_peers_disabled_prints_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    runs = peers.run_peers(TINY, list(BENCHMARKS), enabled=False, modules=MISSING,
                           why_disabled="--no-peers")
    assert [r.status for r in runs] == ["skipped", "skipped"]
    assert [r.peer for r in runs] == ["ray", "ipyparallel"]
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["peers (ray, ipyparallel) skipped: --no-peers"]


def test_cli_peer_flags() -> None:
    parse = build_parser().parse_args
    assert parse(["bench"]).peers is None
    assert parse(["bench", "--quick"]).peers is None
    assert parse(["bench", "--quick", "--peers"]).peers is True
    assert parse(["bench", "--no-peers"]).peers is False
    with pytest.raises(SystemExit):
        parse(["bench", "--peers", "--no-peers"])


def test_attach_ratio_and_line() -> None:
    lat = Row("latency_async", "us", 300.0, 90.0, "lower")
    rate = Row("pipelined", "calls/s", 15000.0, 80000.0, "higher")
    gone = Row("peak_rss_put_worker", "MiB", 256.0, 256.0, "lower")
    run = peers.PeerRun("ray", "measured", figures={
        "latency_async": peers.PeerFigure(600.0, "actor", {"calls": 20}),
        "pipelined": peers.PeerFigure(30000.0, "window"),
        "not_a_row": peers.PeerFigure(1.0, "ignored"),
    })
    peers.attach([lat, rate, gone], [run])
    assert lat.peers["ray"] == {"value": 600.0, "ratio": 0.5, "note": "actor", "calls": 20}
    assert rate.peers["ray"]["ratio"] == 0.5
    assert gone.peers == {}
    assert lat.as_dict()["peers"]["ray"]["value"] == 600.0
    lines = peers.peer_lines([lat, rate, gone])
    assert len(lines) == 2
    assert "vs ray: 600.0 us" in lines[0] and "colobus 2.00x ahead" in lines[0]
    assert "vs ray: 30,000.0 calls/s" in lines[1] and "colobus 2.00x behind" in lines[1]


def test_window_stops_at_cap_with_min_samples() -> None:
    calls: list[int] = []
    rate, done = sampling._window(lambda: calls.append(1), lambda _: None, total=10_000,
                               window=5, cap_s=0.0)
    assert sampling.MIN_SAMPLES <= done < 10_000
    assert done == len(calls)  # every call sent was waited for
    assert rate > 0
    rate, done = sampling._window(lambda: 1, lambda _: None, total=50, window=5, cap_s=60.0)
    assert done == 50
    assert "stopped after 3 of 50 calls" in sampling.cut_note(3, 50)
    assert sampling.cut_note(50, 50) == ""


def _check_figures(figures: dict[str, peers.PeerFigure], expected: set[str]) -> None:
    assert set(figures) == expected
    for name, fig in figures.items():
        assert math.isfinite(fig.value) and fig.value > 0, name
        assert fig.note, name


@pytest.mark.filterwarnings("ignore")
def test_ray_runs_the_workloads_tiny() -> None:
    pytest.importorskip("ray")
    figures = peers.run_ray(TINY, BENCHMARKS, hosts=2)
    _check_figures(figures, TINY_ROWS)
    assert figures["latency_sync"].extra["objectref_arg_us"] > 0
    import ray

    assert not ray.is_initialized()


@pytest.mark.filterwarnings("ignore")
def test_ipyparallel_runs_the_workloads_tiny() -> None:
    pytest.importorskip("ipyparallel")
    figures = peers.run_ipyparallel(TINY, BENCHMARKS, hosts=2)
    _check_figures(figures, TINY_ROWS - {"object_first_call", "chain10"})
