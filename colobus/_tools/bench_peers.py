"""``colobus bench``'s peers: the same workloads on Ray and on IPython Parallel.

After colobus's own rows are measured, each peer that is installed (the
optional ``bench`` extra: ``pip install 'colobus[bench]'``) runs the workloads
it has an equivalent for, with the same :class:`~colobus._tools.bench_base.Sizes`, and
each figure is attached to colobus's row of the same name with the ratio
``colobus / peer``. A peer that is not installed is skipped with one line; a
peer that fails to start or run is reported and skipped, never fatal.

Equivalents (see ``docs/performance.md`` for the table):

* Ray: one actor per host; the tiny array is held by the actor (Ray's fastest
  way: passing an ``ObjectRef`` of a ``ray.put`` array costs about twice as
  much per call here, and is reported as ``objectref_arg_us``); pipelined
  calls keep a window of ObjectRefs and ``ray.get`` the oldest; object
  construct = create an actor + its first method call; transfers = pass the
  array to an actor method that keeps it / ``ray.get`` of the array an actor
  returns; the chain passes each call's ObjectRef unawaited to the next.
* IPython Parallel: one engine per host, a ``DirectView``; the tiny array is
  pushed to the engines first and named by ``ipyparallel.Reference``;
  transfers are ``push`` / ``pull``. No equivalent (skipped): construct an
  engine-side object plus its first call, and a chain of calls given unawaited
  results.

No peer runs peak-memory rows. Every measurement stops early (with at least
:data:`MIN_SAMPLES` samples) once it has run :data:`CAP_S` seconds, so slow
peers keep ``colobus bench`` under its time budget; the figure's ``note`` then
says how many calls it measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import logging
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .peer_sampling import (
    CAP_S,
    PeerFigure,
    PeerRun,
    cut_note,
    latency_figure,
    median_us,
    pipelined_figure,
    sample,
    sample_async,
    transfer_rows,
)

if TYPE_CHECKING:
    from .bench_base import Row, Sizes

__all__ = ["CAP_S", "INSTALL_HINT", "PEERS", "PeerFigure", "PeerRun", "attach",
           "format_peer_line", "peer_lines", "run_ipyparallel", "run_peers", "run_ray"]

log = logging.getLogger("colobus.bench_peers")

#: Peer name -> the module that must be importable for it to run.
PEERS: dict[str, str] = {"ray": "ray", "ipyparallel": "ipyparallel"}
INSTALL_HINT = "pip install 'colobus[bench]'"
#: Workers (actors / engines) for the fan-out rows, as colobus's 4 hosts.
FANOUT_HOSTS = 4
#: Ray's object store: a small fixed footprint (256 MiB transfers fit twice).
RAY_OBJECT_STORE = 1 << 30

# -- Ray -----------------------------------------------------------------------------------


def _ray_classes(ray: Any) -> tuple[Any, Any]:
    """The actor classes, defined here so that Ray ships them by value.

    Defined at module level they would travel by reference, and every new
    actor process would import colobus (and JAX) first: the object benchmark
    would bill that to Ray.
    """

    class BenchActor:
        def __init__(self) -> None:
            self.x = np.zeros(4, np.float32)
            self.kept: Any = None

        def noop(self) -> None:
            """The no-op call on the array the actor holds."""
            self.x  # noqa: B018
            return None

        def noop_arg(self, x: Any) -> None:
            """The no-op call given an ObjectRef (resolved by Ray before the call)."""
            return None

        def inc(self, x: Any) -> Any:
            return x + 1

        def keep(self, x: Any) -> None:
            self.kept = x

        def give(self) -> Any:
            return self.kept

    class BenchObject:
        def __init__(self, n: int) -> None:
            self.n = n

        def ping(self) -> None:
            return None

    return ray.remote(BenchActor), ray.remote(BenchObject)


def run_ray(sizes: Sizes, groups: Iterable[str], hosts: int = FANOUT_HOSTS,
            figures: dict[str, PeerFigure] | None = None) -> dict[str, PeerFigure]:
    """Run colobus's workloads on Ray (started here, shut down before returning).

    Args:
        sizes: the same sizes as colobus's run.
        groups: the benchmark groups to run (those of ``colobus._tools.bench.BENCHMARKS``).
        hosts: actors for the fan-out rows.
        figures: filled in as rows are measured (so a failure keeps the earlier ones).

    Returns:
        Figures by colobus row name.
    """
    import ray

    groups = list(groups)
    figures = {} if figures is None else figures
    ray.init(num_cpus=hosts, include_dashboard=False, log_to_driver=False,
             object_store_memory=RAY_OBJECT_STORE, logging_level=logging.WARNING)
    try:
        actor_cls, object_cls = _ray_classes(ray)
        n_actors = hosts if "fanout" in groups else 1
        actors = [actor_cls.remote() for _ in range(n_actors)]
        ray.get([a.noop.remote() for a in actors])
        a = actors[0]
        x = ray.put(np.zeros(4, np.float32))
        held = "one actor holding the tiny array"
        if "latency" in groups:
            n = sizes.latency_calls

            async def one_async() -> None:
                await a.noop.remote()

            figures["latency_async"] = latency_figure(
                asyncio.run(sample_async(one_async, n, CAP_S)), n,
                f"`await actor.noop.remote()`, {held}")
            ref_arg = sample(lambda: ray.get(a.noop_arg.remote(x)), n, CAP_S)
            figures["latency_sync"] = latency_figure(
                sample(lambda: ray.get(a.noop.remote()), n, CAP_S), n,
                f"`ray.get(actor.noop.remote())`, {held}; passing an ObjectRef of the "
                "array `ray.put` before instead: objectref_arg_us")
            figures["latency_sync"].extra["objectref_arg_us"] = median_us(ref_arg)
        if "pipelined" in groups:
            figures["pipelined"] = pipelined_figure(
                a.noop.remote, ray.get, sizes.pipelined_calls, sizes.window,
                f"actor method calls, {sizes.window} ObjectRefs in flight, `ray.get` of the "
                f"oldest, {held}")
        if "fanout" in groups:
            def fan() -> list[Any]:
                return [b.noop.remote() for b in actors]

            n = sizes.latency_calls
            figures[f"fanout{hosts}_latency"] = latency_figure(
                sample(lambda: ray.get(fan()), n, CAP_S), n,
                f"`ray.get` of one no-op method call on each of {hosts} actors")
            figures[f"fanout{hosts}_pipelined"] = pipelined_figure(
                fan, ray.get, sizes.pipelined_calls // 2, sizes.window,
                f"one no-op call on each of {hosts} actors, {sizes.window} such calls in "
                "flight")
        if "object" in groups:
            times: list[float] = []
            deadline = time.perf_counter() + CAP_S
            for i in range(sizes.object_reps + 2):
                t = time.perf_counter()
                obj = object_cls.remote(i)
                ray.get(obj.ping.remote())
                times.append(time.perf_counter() - t)
                ray.kill(obj)
                if time.perf_counter() > deadline and len(times) >= 4:
                    break
            figures["object_first_call"] = PeerFigure(
                median_us(times[2:]),
                "create an actor + its first method call (a new worker process)"
                + cut_note(len(times) - 2, sizes.object_reps), {"reps": len(times) - 2})
        if "transfer" in groups:
            figures.update(transfer_rows(
                sizes, lambda d: ray.get(a.keep.remote(d)), lambda: ray.get(a.give.remote()),
                lambda: ray.get(a.keep.remote(None)),
                "`ray.get(actor.keep.remote(array))` of {size} (into the object store, "
                "the actor maps it)",
                "`ray.get(actor.give.remote())` of the {size} the actor holds (shared memory)"))
        if "chain" in groups:
            n = sizes.chain_len
            chained: list[float] = []
            for _ in range(sizes.chain_reps + 1):
                t = time.perf_counter()
                y: Any = x
                for _ in range(n):
                    y = a.inc.remote(y)
                out = ray.get(y)
                chained.append(time.perf_counter() - t)
                if float(out[0]) != n:
                    raise RuntimeError(f"chain gave {out[0]}, expected {n}")
            figures[f"chain{n}"] = PeerFigure(
                statistics.median(chained[1:]) * 1e3,
                f"{n} dependent actor method calls, each given the previous call's ObjectRef "
                "unawaited")
    finally:
        ray.shutdown()
    return figures


# -- IPython Parallel --------------------------------------------------------------------------


def _ipp_noop(x: Any) -> None:
    """The no-op call (runs on an engine)."""
    return None


def run_ipyparallel(sizes: Sizes, groups: Iterable[str], hosts: int = FANOUT_HOSTS,
                    figures: dict[str, PeerFigure] | None = None) -> dict[str, PeerFigure]:
    """Run colobus's workloads on IPython Parallel (a local cluster started here).

    Args and returns as :func:`run_ray`.
    """
    import ipyparallel as ipp

    groups = list(groups)
    figures = {} if figures is None else figures
    n_engines = hosts if "fanout" in groups else 1
    cluster = ipp.Cluster(n=n_engines, log_level=logging.WARNING)
    try:
        rc = cluster.start_and_connect_sync(activate=False)
        try:
            dv = rc[:n_engines]
            v0 = rc[0]
            dv.push({"x": np.zeros(4, np.float32)}, block=True)
            ref = ipp.Reference("x")
            pushed = "the tiny array pushed to the engine before, named by a Reference"
            if "latency" in groups:
                n = sizes.latency_calls

                async def one_async() -> None:
                    await asyncio.wrap_future(v0.apply_async(_ipp_noop, ref))

                figures["latency_async"] = latency_figure(
                    asyncio.run(sample_async(one_async, n, CAP_S)), n,
                    f"`await asyncio.wrap_future(view.apply_async(noop, x))`, 1 engine, {pushed}")
                figures["latency_sync"] = latency_figure(
                    sample(lambda: v0.apply_sync(_ipp_noop, ref), n, CAP_S), n,
                    f"`view.apply_sync(noop, x)`, 1 engine, {pushed}")
            if "pipelined" in groups:
                figures["pipelined"] = pipelined_figure(
                    lambda: v0.apply_async(_ipp_noop, ref), lambda r: r.get(),
                    sizes.pipelined_calls, sizes.window,
                    f"`view.apply_async`, 1 engine, {sizes.window} in flight, `.get()` of the "
                    "oldest")
            if "fanout" in groups:
                n = sizes.latency_calls
                figures[f"fanout{hosts}_latency"] = latency_figure(
                    sample(lambda: dv.apply_sync(_ipp_noop, ref), n, CAP_S), n,
                    f"`apply_sync` on a DirectView of {hosts} engines")
                figures[f"fanout{hosts}_pipelined"] = pipelined_figure(
                    lambda: dv.apply_async(_ipp_noop, ref), lambda r: r.get(),
                    sizes.pipelined_calls // 2, sizes.window,
                    f"`apply_async` on a DirectView of {hosts} engines, {sizes.window} in "
                    "flight")
            if "transfer" in groups:
                figures.update(transfer_rows(
                    sizes, lambda d: v0.push({"a": d}, block=True),
                    lambda: v0.pull("a", block=True),
                    lambda: v0.execute("a = None", block=True),
                    "`view.push({{'a': array}}, block=True)` of {size}, 1 engine",
                    "`view.pull('a', block=True)` of {size}, 1 engine"))
        finally:
            rc.close()
    finally:
        cluster.stop_cluster_sync()
    return figures


RUNNERS: dict[str, Callable[..., dict[str, PeerFigure]]] = {
    "ray": run_ray, "ipyparallel": run_ipyparallel}
SKIPPED_GROUPS: dict[str, dict[str, str]] = {
    "ray": {},
    "ipyparallel": {
        "object": "no equivalent: engines hold names, not remote objects with methods",
        "chain": "no equivalent: a call cannot take another call's unawaited result",
    },
}


# -- driving and reporting ---------------------------------------------------------------------


def _version(module: str) -> str:
    with contextlib.suppress(Exception):
        return str(getattr(importlib.import_module(module), "__version__", ""))
    return ""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # e.g. a parent package missing, or blocked in sys.modules
        return False


def run_peers(sizes: Sizes, groups: Sequence[str], enabled: bool,
              modules: Mapping[str, str] | None = None,
              why_disabled: str = "--no-peers") -> list[PeerRun]:
    """Run each peer's workloads for ``groups``; print one line per peer and per figure.

    Args:
        sizes: the sizes of colobus's run.
        groups: colobus's benchmark groups of this run.
        enabled: False skips every peer (one line says why: ``why_disabled``).
        modules: peer name -> module to import (default :data:`PEERS`); a peer
            whose module is not importable is skipped as not installed.
        why_disabled: the reason printed when ``enabled`` is False.

    Returns:
        One :class:`PeerRun` per peer, in :data:`PEERS` order.
    """
    modules = dict(PEERS if modules is None else modules)
    if not enabled:
        print(f"peers ({', '.join(modules)}) skipped: {why_disabled}", flush=True)
        return [PeerRun(peer, "skipped", detail=why_disabled) for peer in modules]
    runs: list[PeerRun] = []
    for peer, module in modules.items():
        if not _installed(module):
            print(f"{peer} not installed: {INSTALL_HINT}", flush=True)
            runs.append(PeerRun(peer, "not installed", detail=INSTALL_HINT))
            continue
        skipped = {g: why for g, why in SKIPPED_GROUPS.get(peer, {}).items() if g in groups}
        if not [g for g in groups if g not in skipped]:
            detail = "; ".join(f"{g}: {why}" for g, why in skipped.items())
            print(f"{peer} skipped: {detail}", flush=True)
            runs.append(PeerRun(peer, "skipped", version=_version(module), detail=detail))
            continue
        run = PeerRun(peer, "measured", version=_version(module))
        print(f"-- {peer} {run.version}: running the same workloads ...", flush=True)
        t0 = time.perf_counter()
        try:
            RUNNERS[peer](sizes, groups, figures=run.figures)
        except Exception as e:
            log.warning("%s failed", peer, exc_info=True)
            run.status = "failed"
            run.detail = f"{type(e).__name__}: {e}"
            print(f"{peer} failed: {run.detail}", flush=True)
        run.seconds = time.perf_counter() - t0
        if skipped and run.status == "measured":
            run.detail = "; ".join(f"{g}: {why}" for g, why in skipped.items())
        runs.append(run)
        print(f"-- {peer}: {len(run.figures)} rows in {run.seconds:.0f} s"
              + (f"; skipped {run.detail}" if skipped and run.status == "measured" else ""),
              flush=True)
    return runs


def attach(rows: Iterable[Row], runs: Iterable[PeerRun]) -> None:
    """Put each peer figure on colobus's row of the same name (``row.peers[peer]``).

    ``ratio`` there is ``colobus / peer``, read as the row's own ratio (for
    latencies lower is better, for rates higher is better).
    """
    by_name = {r.name: r for r in rows}
    for run in runs:
        for name, fig in run.figures.items():
            row = by_name.get(name)
            if row is None:
                continue
            ratio = row.colobus / fig.value if fig.value else float("nan")
            row.peers[run.peer] = {"value": fig.value, "ratio": ratio, "note": fig.note,
                                   **fig.extra}


def peer_lines(rows: Iterable[Row]) -> list[str]:
    """One printed line per peer figure, in row order."""
    return [format_peer_line(row, peer) for row in rows for peer in row.peers]


def format_peer_line(row: Row, peer: str) -> str:
    """``latency_async   vs ray:  585.0 us (colobus/ray 0.55: colobus 1.82x ahead)``."""
    p = row.peers[peer]
    fmt = "{:,.2f}" if row.unit == "GB/s" else "{:,.1f}"
    ratio = float(p["ratio"])
    ahead = ratio if row.better == "higher" else (1 / ratio if ratio else float("inf"))
    verdict = (f"colobus {ahead:.2f}x ahead" if ahead >= 1
               else f"colobus {1 / ahead:.2f}x behind")
    return (f"{row.name:<26} vs {peer}: {fmt.format(p['value'])} {row.unit} "
            f"(colobus/{peer} {ratio:.3g}: {verdict})")
