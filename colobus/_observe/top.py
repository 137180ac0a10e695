"""``colobus top``: a live table of a running cluster, read from its Prometheus endpoint.

Each refresh scrapes ``/metrics``, parses it with prometheus_client's own parser
into a :class:`Snapshot`, and draws it with ``rich``: the hosts (state, devices,
calls in flight, held bytes, heartbeat round trip, worker memory and CPU), the
busiest functions with p50/p99 latency (from the histogram's buckets, the way
Prometheus' ``histogram_quantile`` reads them), and totals.
"""

from __future__ import annotations

import http.client
import math
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FunctionRow", "HostRow", "Snapshot", "Watch", "metrics_url", "parse", "quantile",
           "run_top"]

MISSING = "colobus top needs rich and prometheus_client: pip install 'colobus[metrics]'"
BUSIEST = 10  # functions shown


def metrics_url(where: str) -> str:
    """``http://HOST:PORT/metrics`` from ``HOST:PORT``, a base URL, or the full URL."""
    url = where if "://" in where else f"http://{where}"
    return url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"


@dataclass
class HostRow:
    index: int
    name: str
    up: bool = False
    devices: int = 0
    inflight: int = 0
    held_bytes: float = 0.0
    arrays: int = 0
    objects: int = 0
    rtt: float | None = None
    rss: float | None = None
    cpu_seconds: float | None = None
    cpu_percent: float | None = None  # from two scrapes


@dataclass
class FunctionRow:
    name: str
    started: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    buckets: list[tuple[float, float]] = field(default_factory=list)  # (le, cumulative)
    latency_sum: float = 0.0
    run_buckets: list[tuple[float, float]] = field(default_factory=list)

    @property
    def p50(self) -> float | None:
        return quantile(0.5, self.buckets)

    @property
    def p99(self) -> float | None:
        return quantile(0.99, self.buckets)

    @property
    def run_p50(self) -> float | None:
        return quantile(0.5, self.run_buckets)


@dataclass
class Snapshot:
    hosts: dict[int, HostRow] = field(default_factory=dict)
    functions: dict[str, FunctionRow] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)
    taken: float = 0.0  # time.monotonic() of the scrape
    wall: float = 0.0  # time.time() of the scrape, shown as "updated"


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of a histogram from its cumulative ``(le, count)`` buckets.

    Linear interpolation inside the bucket the rank falls in, as Prometheus'
    ``histogram_quantile`` does; a rank in the ``+Inf`` bucket answers the largest
    finite bound. None when the histogram is empty.
    """
    if not buckets:
        return None
    buckets = sorted(buckets)
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


_HOST_FIELDS = {
    "colobus_host_up": "up", "colobus_host_devices": "devices",
    "colobus_host_calls_in_flight": "inflight", "colobus_host_held_bytes": "held_bytes",
    "colobus_host_arrays": "arrays", "colobus_host_objects": "objects",
    "colobus_host_heartbeat_rtt_seconds": "rtt", "colobus_host_resident_memory_bytes": "rss",
    "colobus_host_cpu_seconds_total": "cpu_seconds",
}
_CALL_FIELDS = {f"colobus_calls_{k}_total": k for k in
                ("started", "finished", "failed", "cancelled")}
_TOTALS = {
    "colobus_calls_in_flight": "in flight", "colobus_calls_backlog": "backlog",
    "colobus_put_bytes_total": "put", "colobus_fetched_bytes_total": "fetched",
    "colobus_code_shipped_total": "code shipped",
}


def parse(text: str, previous: Snapshot | None = None) -> Snapshot:
    """A :class:`Snapshot` of one scrape; CPU % needs the ``previous`` one."""
    from prometheus_client.parser import text_string_to_metric_families

    snap = Snapshot(taken=time.monotonic(), wall=time.time())
    dropped = host_dropped = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name, labels, value = s.name, s.labels, s.value
            if name in _HOST_FIELDS:
                index = int(labels.get("host", "-1"))
                row = snap.hosts.setdefault(index, HostRow(index, labels.get("name", "")))
                attr = _HOST_FIELDS[name]
                kind = type(getattr(row, attr))
                setattr(row, attr, bool(value) if attr == "up" else
                        int(value) if kind is int else value)
            elif name in _CALL_FIELDS:
                fn = snap.functions.setdefault(labels["function"], FunctionRow(labels["function"]))
                setattr(fn, _CALL_FIELDS[name], int(value))
            elif name in ("colobus_call_latency_seconds_bucket", "colobus_call_run_seconds_bucket"):
                fn = snap.functions.setdefault(labels["function"], FunctionRow(labels["function"]))
                target = fn.buckets if "latency" in name else fn.run_buckets
                target.append((float(labels["le"]), value))
            elif name == "colobus_call_latency_seconds_sum":
                fn = snap.functions.setdefault(labels["function"], FunctionRow(labels["function"]))
                fn.latency_sum = value
            elif name in _TOTALS:
                snap.totals[_TOTALS[name]] = value
            elif name == "colobus_messages_dropped_total":
                dropped += value
            elif name == "colobus_host_messages_dropped_total":
                host_dropped += value
    snap.totals["dropped"] = dropped
    snap.totals["hosts dropped"] = host_dropped
    if previous is not None and snap.taken > previous.taken:
        wall = snap.taken - previous.taken
        for index, row in snap.hosts.items():
            old = previous.hosts.get(index)
            if old is not None and row.cpu_seconds is not None and old.cpu_seconds is not None:
                row.cpu_percent = max(0.0, 100.0 * (row.cpu_seconds - old.cpu_seconds) / wall)
    return snap


def scrape(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode("utf-8"))


# -- drawing ----------------------------------------------------------------------------


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _secs(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1.0:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def render(snap: Snapshot, url: str, note: str = "", stale: bool = False) -> Any:
    """The view of one snapshot, as a ``rich`` renderable.

    ``stale``: the endpoint stopped answering; these are the last figures read, dimmed,
    and the header says since when (never a table of zeros as if the cluster were idle).
    """
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    alive = sum(1 for h in snap.hosts.values() if h.up)
    when = time.strftime("%H:%M:%S", time.localtime(snap.wall or time.time()))
    status = (f"STALE: last read at {when}, {time.time() - snap.wall:.0f} s ago" if stale
              else f"updated {when}")
    header = Text.assemble(
        ("colobus top", "bold"), f"  {url}  ",
        f"{alive}/{len(snap.hosts)} hosts alive  ", (status, "bold red" if stale else ""),
        (f"  {note}" if note else "", "yellow"))
    dim = "dim" if stale else ""
    hosts = Table(title="hosts" + (" (stale)" if stale else ""), title_justify="left",
                  expand=False, style=dim, row_styles=[dim])
    for col in ("host", "name", "state", "devices", "in flight", "arrays", "held",
                "hb rtt", "rss", "cpu"):
        hosts.add_column(col, justify="left" if col in ("name", "state") else "right")
    for index in sorted(snap.hosts):
        h = snap.hosts[index]
        cpu = (f"{h.cpu_percent:.0f}%" if h.cpu_percent is not None
               else _secs(h.cpu_seconds) if h.cpu_seconds is not None else "-")
        hosts.add_row(str(index), h.name, "alive" if h.up else "[red]lost[/red]",
                      str(h.devices), str(h.inflight), str(h.arrays), _bytes(h.held_bytes),
                      _secs(h.rtt), _bytes(h.rss), cpu)
    fns = Table(title=f"busiest functions (top {BUSIEST} by calls)"
                + (" (stale)" if stale else ""), title_justify="left", style=dim,
                row_styles=[dim])
    for col in ("function", "calls", "ok", "failed", "cancelled", "p50", "p99", "run p50"):
        fns.add_column(col, justify="left" if col == "function" else "right")
    busiest = sorted(snap.functions.values(), key=lambda f: (-f.started, f.name))[:BUSIEST]
    for f in busiest:
        fns.add_row(f.name, str(f.started), str(f.finished), str(f.failed), str(f.cancelled),
                    _secs(f.p50), _secs(f.p99), _secs(f.run_p50))
    t = snap.totals
    calls = sum(f.started for f in snap.functions.values())
    failed = sum(f.failed for f in snap.functions.values())
    totals = Text(
        f"calls: {calls} made, {failed} failed, {t.get('in flight', 0):.0f} in flight, "
        f"{t.get('backlog', 0):.0f} in backlog\n"
        f"data: put {_bytes(t.get('put', 0))}, fetched {_bytes(t.get('fetched', 0))} | "
        f"code shipped {t.get('code shipped', 0):.0f} | "
        f"messages dropped: {t.get('dropped', 0):.0f} by the controller, "
        f"{t.get('hosts dropped', 0):.0f} by hosts", style=dim)
    return Group(header, hosts, fns, totals)


class Watch:
    """What ``colobus top`` shows at each refresh: the latest scrape, or, while the
    endpoint does not answer (the controller closed or is restarting), the last
    figures read, marked stale."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.last: Snapshot | None = None

    def view(self) -> Any:
        """Scrape once; the renderable to show."""
        try:
            snap = parse(scrape(self.url), self.last)
        except (OSError, urllib.error.URLError, http.client.HTTPException, ValueError) as exc:
            note = f"cannot read {self.url}: {exc}"
            if self.last is None:  # nothing read yet: no figures to show
                from rich.text import Text

                return Text.assemble(("colobus top", "bold"), f"  {self.url}  waiting: ",
                                     (note, "yellow"))
            return render(self.last, self.url, note, stale=True)
        self.last = snap
        return render(snap, self.url)


def run_top(where: str, once: bool = False, interval: float = 1.0) -> int:
    """The ``colobus top`` command; returns the exit code."""
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError:
        print(MISSING, file=sys.stderr)
        return 2
    url = metrics_url(where)
    console = Console(width=None if sys.stdout.isatty() else 120)
    if once:
        try:
            snap = parse(scrape(url))
        except (OSError, urllib.error.URLError, http.client.HTTPException) as exc:
            print(f"colobus top: cannot read {url}: {exc}", file=sys.stderr)
            return 1
        console.print(render(snap, url))
        return 0
    watch = Watch(url)
    try:
        with Live(console=console, auto_refresh=False, screen=False) as live:
            while True:
                live.update(watch.view(), refresh=True)
                time.sleep(interval)
    except KeyboardInterrupt:
        return 0
