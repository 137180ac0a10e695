"""The figures ``Controller.stats()`` reports, read from the controller's parts."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .._wire import protocol as P
from .._wire.describe import read_store_counts
from .current import State

if TYPE_CHECKING:
    from .._wire.channel import Channel
    from .._wire.envelope import Envelope
    from .future import Future
    from .hosts import Host, HostRegistry
    from .ops import Operations
    from .sessions import Sessions
    from .uploads import Uploads

__all__ = ["collect_stats", "host_health", "refresh_stats", "scrape_stats"]

log = logging.getLogger("colobus.controller")

SCRAPE_REFRESH_S = 1.0  # a metrics scrape waits this long for the hosts' fresh figures


def collect_stats(sessions: Sessions, counters: collections.Counter[str], chan: Channel | None,
                  ops: Operations, hosts: HostRegistry, uploads: Uploads) -> dict[str, Any]:
    """See :meth:`colobus.Controller.stats`."""
    return {
        "dropped": dict(sessions.dropped),
        "dropped_total": sum(sessions.dropped.values()),
        "hosts_dropped": sessions.hosts_dropped,
        "tick_errors": sessions.tick_errors,
        "join_challenges": len(sessions.challenges),
        "code_sent": counters["code_sent"],
        "code_bytes": counters["code_bytes"],
        "packages_sent": counters["packages_sent"],  # the user's packages (codeship), per host
        "package_bytes": counters["package_bytes"],  # their zips' bytes, all hosts together
        "bytes_put": counters["bytes_put"],
        "bytes_fetched": counters["bytes_fetched"],
        "bytes_resharded": counters["bytes_resharded"],
        "bytes_relayed": counters["bytes_relayed"],  # sent host to host (broadcast trees)
        "tree_overdue": counters["tree_overdue"],  # tree children sent the block whole
        "calls": counters["calls"],
        "batches": chan.batches_sent if chan is not None else 0,
        "batches_received": sessions.batches_received,
        "resent": chan.resent if chan is not None else 0,
        "backlog": len(ops.backlog),
        "queued": ops.queued,
        "pending": len(ops.pending),
        "hosts": {
            h.index: {
                "name": h.name,
                "state": "alive" if h.alive else "lost",
                "arrays": h.store[0],
                "bytes": h.store[1],
                "objects": h.store[2],
                "results": h.store[3],
                "code_sent": len(h.code_sent),
                "inflight": ops.inflight_count(h),
                "queued_bytes": uploads.queued(h.index),
                **host_health(h),
            }
            for h in list(hosts.hosts)
        },
    }


def host_health(host: Any) -> dict[str, Any]:
    """A host's figures from its last heartbeat, for ``Controller.stats()``.

    The heartbeat was read off the wire: only ``str -> int`` drop counters are
    kept, a few at most.
    """
    beat: P.Heartbeat | None = host.health
    dropped: dict[str, int] = {}
    if beat is not None:
        items = [(k, v) for k, v in beat.dropped.items()
                 if isinstance(k, str) and type(v) is int][:32]
        dropped = {k[:64]: v for k, v in items}
    return {
        "devices": len(host.devices),
        "rtt": host.rtt,
        "rss": beat.rss if beat is not None else None,
        "cpu": beat.cpu / 1e9 if beat is not None else None,
        "dropped": dropped,
        # its call pool's threads, and those stuck in calls of an ended session
        "threads": beat.threads if beat is not None else None,
        "stuck": beat.stuck if beat is not None else None,
        # the code it holds: functions and classes, and their pickled bytes
        "code": beat.code if beat is not None else None,
        "code_bytes": beat.code_bytes if beat is not None else None,
    }


def refresh_stats(ops: Operations, hosts: HostRegistry,
                  send: Callable[[Host, P.Body], None],
                  stats: Callable[[], dict[str, Any]]) -> Future[dict[str, Any]]:
    """Ask every live host for its store counters; resolves to ``stats()`` once all answer."""
    alive = tuple(h.index for h in hosts.alive())

    def decode(host: Host, body: P.Result, env: Envelope) -> None:
        host.store = read_store_counts(body.meta)

    def send_all(call_id: int) -> None:
        for i in alive:
            send(hosts[i], P.Stats(call_id))

    return ops.submit(alive, send_all, decode, lambda _: stats(), backpressure=False)


class Scraped(Protocol):
    """What a metrics scrape reads of the controller."""

    @property
    def state(self) -> State: ...
    def _on_loop_thread(self) -> bool: ...
    def refresh_stats(self) -> Future[dict[str, Any]]: ...
    def stats(self) -> dict[str, Any]: ...


def scrape_stats(ctl: Scraped) -> dict[str, Any]:
    """``ctl.stats()`` for a metrics scrape (its HTTP thread): fresh from every live
    host, with the call times they counted, if all answer within
    :data:`SCRAPE_REFRESH_S`; else as last reported by their heartbeats."""
    if ctl.state is State.RUNNING and not ctl._on_loop_thread():
        try:
            return ctl.refresh_stats().result(timeout=SCRAPE_REFRESH_S)
        except Exception as exc:  # a slow or lost host, a closing controller
            log.debug("scrape: hosts' figures as last reported (%r)", exc)
    return ctl.stats()
