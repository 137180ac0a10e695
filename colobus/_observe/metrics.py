"""A controller's Prometheus endpoint: ``/metrics`` in the text format, via prometheus_client.

Nothing is counted for Prometheus on the hot path: a private
``CollectorRegistry`` holds one collector that, at each scrape (on the HTTP
server's thread), reads the controller's :meth:`~Controller.stats` and its
:class:`~colobus._observe.observer.Observer`'s per-function counters and builds the
metric families then. Several controllers in one process each have their own
registry and port. Metric names and meanings: ``docs/observability.md``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

from .observer import Observer
from .trace import ChromeTrace, OtelSpans

__all__ = ["MetricsServer", "observing", "parse_address", "stop_observing"]

log = logging.getLogger("colobus.metrics")

MISSING = ("colobus metrics need the prometheus_client package: "
           "pip install 'colobus[metrics]'")


def parse_address(address: str, public: bool) -> tuple[str, int]:
    """``"HOST:PORT"`` (IPv6 in brackets; port 0: any free port) as ``(host, port)``.

    Raises:
        ValueError: malformed, or not a loopback address while ``public`` is False.
    """
    host, sep, port_text = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"metrics address must be HOST:PORT, e.g. 127.0.0.1:9464; "
                         f"got {address!r}")
    loopback = host == "localhost"
    if not loopback:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
    if not loopback and not public:
        raise ValueError(
            f"metrics address {address!r} is not loopback: the endpoint has no "
            "authentication, and anyone who reaches it reads your function names, host "
            "names, pids and call counts. Serve it on 127.0.0.1 and let the scraper reach "
            "it through a tunnel or a local agent, or pass metrics_public=True to serve it "
            "on the network on purpose (docs/observability.md).")
    return host, int(port_text)


def _require_client() -> None:
    try:
        import prometheus_client  # noqa: F401
    except ImportError as exc:
        raise ImportError(MISSING) from exc


class _Collector:
    """Builds every metric family from the controller's state at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]], observer: Observer) -> None:
        self._stats = stats
        self._observer = observer

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        s = self._stats()
        hosts = GaugeMetricFamily("colobus_hosts", "Hosts by state.", labels=["state"])
        states = [h["state"] for h in s["hosts"].values()]
        for state in ("alive", "lost", "joining"):
            hosts.add_metric([state], states.count(state))
        yield hosts

        per_host: list[tuple[str, str, str, Any]] = [
            ("gauge", "colobus_host_up", "1 while the host is alive, 0 once lost.", "up"),
            ("gauge", "colobus_host_devices", "Devices of the host.", "devices"),
            ("gauge", "colobus_host_calls_in_flight",
             "Remote operations sent to the host and not answered yet.", "inflight"),
            ("gauge", "colobus_host_arrays", "Arrays the host holds.", "arrays"),
            ("gauge", "colobus_host_objects", "Colocated objects the host holds.", "objects"),
            ("gauge", "colobus_host_held_bytes", "Bytes of array data the host holds.",
             "bytes"),
            ("gauge", "colobus_host_heartbeat_rtt_seconds",
             "Heartbeat round trip, controller to host and back.", "rtt"),
            ("gauge", "colobus_host_resident_memory_bytes",
             "Resident memory of the host's worker process.", "rss"),
            ("counter", "colobus_host_cpu_seconds",
             "CPU time of the host's worker process (user + system).", "cpu"),
        ]
        for kind, name, doc, key in per_host:
            cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            fam = cls(name, doc, labels=["host", "name"])
            for index, h in s["hosts"].items():
                value = (1 if h["state"] == "alive" else 0) if key == "up" else h.get(key)
                if value is None:  # not reported yet (the first heartbeat's round trip)
                    continue
                fam.add_metric([str(index), h["name"]], float(value))
            yield fam
        host_drops = CounterMetricFamily(
            "colobus_host_messages_dropped", "Messages a host's worker dropped, by reason.",
            labels=["host", "name", "reason"])
        for index, h in s["hosts"].items():
            for reason, n in sorted(h.get("dropped", {}).items()):
                host_drops.add_metric([str(index), h["name"], reason], n)
        yield host_drops

        functions = self._observer.functions()
        counts = [("started", "Colocated calls made."),
                  ("finished", "Colocated calls that returned their outputs."),
                  ("failed", "Colocated calls that raised (on a host, or a lost host)."),
                  ("cancelled", "Colocated calls cancelled.")]
        for field, doc in counts:
            fam = CounterMetricFamily(f"colobus_calls_{field}", doc, labels=["function"])
            for fn, st in sorted(functions.items()):
                fam.add_metric([fn], getattr(st, field))
            yield fam
        hists = [("latency", "colobus_call_latency_seconds",
                  "Colocated call latency, from the call to its future settling."),
                 ("run", "colobus_call_run_seconds",
                  "Time a colocated call ran on a host (one observation per host per call)."),
                 ("queue", "colobus_call_host_queue_seconds",
                  "Time a colocated call waited on a host before it ran (per host per call).")]
        for attr, name, doc in hists:
            hist = HistogramMetricFamily(name, doc, labels=["function"])
            for fn, st in sorted(functions.items()):
                h = getattr(st, attr)
                hist.add_metric([fn], h.cumulative(), sum_value=h.total)
            yield hist
        yield GaugeMetricFamily("colobus_calls_in_flight",
                                "Colocated calls made and not settled yet.",
                                value=self._observer.in_flight())
        yield GaugeMetricFamily(
            "colobus_calls_backlog",
            "Calls made but not sent yet: on their way to the controller's loop, or waiting "
            "for room under max_inflight.", value=s["queued"])
        yield GaugeMetricFamily("colobus_operations_pending",
                                "Remote operations (calls, puts, fetches) not answered yet.",
                                value=s["pending"])
        yield CounterMetricFamily("colobus_put_bytes", "Array bytes sent to hosts (device_put).",
                                  value=s["bytes_put"])
        yield CounterMetricFamily("colobus_fetched_bytes",
                                  "Array bytes fetched from hosts (device_get, np.asarray).",
                                  value=s["bytes_fetched"])
        yield CounterMetricFamily("colobus_code_shipped",
                                  "Pickled functions and classes sent to hosts.",
                                  value=s["code_sent"])
        yield CounterMetricFamily("colobus_code_shipped_bytes",
                                  "Bytes of pickled code sent to hosts.", value=s["code_bytes"])
        drops = CounterMetricFamily("colobus_messages_dropped",
                                    "Messages the controller dropped, by reason.",
                                    labels=["reason"])
        for reason, n in sorted(s["dropped"].items()):
            drops.add_metric([reason], n)
        yield drops


class MetricsServer:
    """Serves one controller's metrics over HTTP on a thread of its own."""

    def __init__(self, host: str, port: int, stats: Callable[[], dict[str, Any]],
                 observer: Observer) -> None:
        _require_client()
        self._host = host
        self._port = port
        self._stats = stats
        self._observer = observer
        self._server: Any = None
        self._thread: Any = None
        self.url = ""

    def start(self) -> str:
        """Bind and serve; returns the URL of ``/metrics``.

        Raises:
            OSError: the address cannot be bound.
        """
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self._stats, self._observer))
        try:
            self._server, self._thread = start_http_server(self._port, addr=self._host,
                                                           registry=registry)
        except OSError as exc:
            raise OSError(f"colobus metrics cannot listen on {self._host}:{self._port}: "
                          f"{exc.strerror or exc}; give another HOST:PORT (port 0: any free "
                          "one)") from exc
        port = self._server.server_port
        host = f"[{self._host}]" if ":" in self._host else self._host
        self.url = f"http://{host}:{port}/metrics"
        log.info("metrics on %s (watch with: colobus top --metrics %s)", self.url,
                 self.url.removesuffix("/metrics"))
        return self.url

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(5)
            self._server = self._thread = None


def observing(metrics: str | None, public: bool, trace: bool | str | os.PathLike[str] | None,
              stats: Callable[[], dict[str, Any]]
              ) -> tuple[Observer | None, MetricsServer | None, ChromeTrace | None]:
    """A controller's ``(observer, metrics server, Chrome trace)``; Nones when off.

    Raises:
        ValueError: a malformed ``metrics`` address, or one not loopback
            without ``public``.
        ImportError: ``metrics`` given without ``prometheus_client``.
    """
    if metrics is None and not trace:
        return None, None, None
    server_at = parse_address(metrics, public) if metrics is not None else None
    chrome = ChromeTrace(None if trace is True else trace) if trace else None
    observer = Observer(chrome, otel=bool(trace) and OtelSpans.available())
    server = MetricsServer(*server_at, stats, observer) if server_at is not None else None
    return observer, server, chrome


def stop_observing(server: MetricsServer | None, chrome: ChromeTrace | None) -> None:
    """A closing controller's: stop serving metrics; write the trace where it has a path."""
    if server is not None:
        server.close()
    if chrome is not None and chrome.path is not None:
        try:
            log.info("trace written to %s", chrome.write())
        except OSError as exc:
            log.warning("could not write the trace to %s: %s", chrome.path, exc)
