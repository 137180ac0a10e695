"""``colobus bench reshard``: resharding sharded -> replicated over 4 hosts, against raw pyzmq.

An array of ``N`` bytes sharded over 4 hosts (one device each, ``P('hosts')``)
is resharded to replicated: each host lacks 3 quarters, so ``3 N`` bytes reach
the hosts, and with no host-to-host data plane each quarter goes source ->
controller -> the 3 others. The rate is those ``3 N`` bytes over the time from
``cb.device_put`` to ``block_until_ready`` of the result.

The baseline moves the same bytes with raw pyzmq in the same run: 4 DEALER
servers each holding a quarter as a frame; the ROUTER asks all 4 for theirs and
sends each reply, zero-copy, to the 3 others as it arrives, then waits for the
12 acknowledgements. (It holds the whole array at once, which colobus avoids by
its window of moves; the hosts keep the frames as they are, where colobus
copies each piece into the new block.)
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import numpy as np

import colobus as cb

from .bench_base import BenchRun, RawEcho, Row, quotient

__all__ = ["GROUPS", "run_groups"]

GROUPS = ("reshard",)
HOSTS = 4
MiB = 1 << 20
FULL_BYTES, FULL_REPS = 256 * MiB, 5
QUICK_BYTES, QUICK_REPS = 16 * MiB, 3


def _raw_reshard(raw: RawEcho, quarter: int) -> float:
    """The same bytes with raw pyzmq: each server's quarter to the 3 others; seconds."""
    sock, ids = raw.sock, raw.ids
    for i in ids:  # every server keeps its own quarter (untimed, as colobus's source)
        sock.send_multipart([i, b"p", np.full(quarter, 1, np.uint8).data], copy=False)
    for _ in ids:
        sock.recv_multipart()
    t = time.perf_counter()
    for i in ids:
        sock.send_multipart([i, b"g"])
    blocks = acks = 0
    while blocks < len(ids) or acks < len(ids) * (len(ids) - 1):
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 2:  # an ack of a forwarded quarter
            acks += 1
            continue
        blocks += 1
        src, _, data = frames
        for i in ids:
            if i != src.bytes:
                sock.send_multipart([i, b"p", data], copy=False)
    return time.perf_counter() - t


async def _reshard(bench: BenchRun, ctl: cb.Controller, raw: RawEcho) -> None:
    quick = bench.sizes.latency_calls < 1000
    nbytes, reps = (QUICK_BYTES, QUICK_REPS) if quick else (FULL_BYTES, FULL_REPS)
    mesh = cb.make_mesh((HOSTS,), ("hosts",), devices=[
        next(d for d in ctl.devices() if d.host == h) for h in range(HOSTS)])
    data = np.ones(nbytes // 4, np.float32).reshape(HOSTS, -1)
    src = cb.device_put(data, cb.NamedSharding(mesh, cb.PartitionSpec("hosts")))
    await cb.block_until_ready(src)
    replicated = cb.NamedSharding(mesh, cb.PartitionSpec())
    ours, base = [], []
    moved = (HOSTS - 1) * nbytes
    for _ in range(reps + 1):  # the first round of each warms up (page faults): not counted
        t = time.perf_counter()
        out = cb.device_put(src, replicated)
        await cb.block_until_ready(out)
        ours.append(time.perf_counter() - t)
        out.delete()
        await ctl.refresh_stats()  # freed before the next round
        base.append(await asyncio.to_thread(_raw_reshard, raw, nbytes // HOSTS))
    ours, base = ours[1:], base[1:]
    check = await cb.device_get(cb.device_put(src, replicated))
    assert check.shape == data.shape and float(check[-1, -1]) == 1.0
    gbs = moved / 1e9
    bench.add(Row(f"reshard_{nbytes // MiB}mib_{HOSTS}hosts", "GB/s",
                  quotient(gbs, statistics.median(ours)), quotient(gbs, statistics.median(base)),
                  "higher",
                  f"device_put of a {nbytes // MiB} MiB cb.Array sharded over {HOSTS} hosts to "
                  f"replicated ({moved // MiB} MiB reach the hosts, through the controller) "
                  "+ block_until_ready; baseline: raw pyzmq moving the same frames",
                  {"bytes": nbytes, "moved_bytes": moved}))


def run_groups(bench: BenchRun, groups: list[str], options: dict[str, Any]) -> None:
    """Run the ``reshard`` group if selected, on a 4-host cluster of its own."""
    if "reshard" not in groups:
        return

    async def main() -> None:
        # The raw servers start first: their start blocks this thread, which would stall
        # the controller's loop (and its heartbeats) if it ran already.
        with RawEcho(HOSTS) as raw:
            async with cb.local_cluster(hosts=HOSTS, devices_per_host=1, **options) as ctl:
                await _reshard(bench, ctl, raw)

    asyncio.run(main())
