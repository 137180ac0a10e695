"""Whether the hosts of a job reach each other where their collectives will connect.

A JAX job's collectives run host to host (gloo on CPU, listening at the address each host
reaches the controller from: ``colobus._host.jaxjob``). Hosts that reach the controller
need not reach each other (a firewall, one NAT per host); their first collective would
then hang. So joining a job ends with a probe: each host listens on a TCP port at that
address, publishes it in the job's key-value store, connects to every other host's, and
publishes what failed; past a barrier every host reads every host's outcome, and all of
them fail the forming alike when one host cannot reach another (the controller then says
so, or runs the block view: ``colobus._controller.jobview``). Hosts on one machine
(``ipc://``) are not probed.
"""

from __future__ import annotations

import errno
import os
import selectors
import socket
import time
from typing import Any

__all__ = ["PROBE_S", "probe_peers"]

PROBE_S = 5.0  # how long a host waits for its peers to answer a connect


def probe_peers(client: Any, host: int, processes: int, generation: int, listen: str | None,
                timeout_s: float) -> None:
    """Probe every other host of the job from this one (blocking: the join's thread).

    Args:
        client: JAX's distributed client, connected.
        listen: the address this host's collectives listen at (None: on one machine,
            nothing is probed).
        timeout_s: the longest wait for the other hosts' keys and for the barrier.

    Raises:
        RuntimeError: a host of the job cannot reach another (every host raises it).
    """
    if listen is None or processes < 2:
        return
    family = socket.AF_INET6 if ":" in listen else socket.AF_INET
    key = f"colobus/reach/{generation}"
    wait_ms = max(1000, int(timeout_s * 1000))
    with socket.socket(family, socket.SOCK_STREAM) as server:
        server.bind((listen, 0))
        server.listen(processes)
        port = server.getsockname()[1]
        client.key_value_set(f"{key}/at/{host}", f"{listen} {port}")
        peers = {p: client.blocking_key_value_get(f"{key}/at/{p}", wait_ms)
                 for p in range(processes) if p != host}
        failed = _connect_all(host, peers, family)
        client.key_value_set(f"{key}/said/{host}", "; ".join(failed))
        client.wait_at_barrier(f"colobus-reach-{generation}", wait_ms)
    said = [client.blocking_key_value_get(f"{key}/said/{p}", wait_ms) for p in range(processes)]
    problems = [s for s in said if s]
    if problems:
        raise RuntimeError(
            "the hosts cannot reach each other where their collectives connect: "
            + "; ".join(problems) + " (open the hosts' ports to each other, or bind where "
            "they reach each other)")


def _connect_all(host: int, peers: dict[int, str], family: int) -> list[str]:
    """Connect to each peer's ``"address port"`` at once, within :data:`PROBE_S`; the
    failures, one phrase each."""
    failed: list[str] = []
    sel = selectors.DefaultSelector()
    pending: dict[socket.socket, tuple[int, str]] = {}
    try:
        for p, at in peers.items():
            address, port = at.rsplit(" ", 1)
            s = socket.socket(family, socket.SOCK_STREAM)
            s.setblocking(False)
            err = s.connect_ex((address, int(port)))
            if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
                failed.append(f"host {p} at {address}:{port}: {os.strerror(err)}")
                s.close()
                continue
            pending[s] = (p, f"{address}:{port}")
            sel.register(s, selectors.EVENT_WRITE, s)
        deadline = time.monotonic() + PROBE_S
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for sk, _ in sel.select(left):
                s = sk.data
                p, at = pending.pop(s)
                sel.unregister(s)
                err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    failed.append(f"host {p} at {at}: {os.strerror(err)}")
                s.close()
        for s, (p, at) in pending.items():
            failed.append(f"host {p} at {at}: no answer within {PROBE_S:g} s")
            s.close()
    finally:
        sel.close()
    return [f"host {host} cannot reach {f}" for f in failed]
