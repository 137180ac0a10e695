"""Replicated device_put to many hosts: the star against the broadcast tree (issue 25).

Two parts, each printing colobus and a raw pyzmq baseline measured in the same run:

* ``local`` (default): ``--hosts`` (32) real workers of a ``local_cluster`` on this
  machine, one device each. Rounds alternate the star (``ctl.broadcast_tree = 0``)
  and the tree (``= 2``): ``device_put`` of ``--mib`` (64) MiB replicated over every
  host + ``block_until_ready``; median time, and the bytes the controller sent
  (``bytes_put``) as a multiple of the payload. The baseline is a raw star: a
  ROUTER here sending the same buffer (zero-copy) to ``--hosts`` DEALERs in a
  subprocess, each acknowledging it. Here every copy shares the same two cores.
* ``shaped`` (``--shaped RATE``, root only): ``--hosts`` workers in network
  namespaces (``tests/netbed.py``), each with its own address, and the
  controller's side of the bridge shaped to RATE (``tc`` tbf on the bridge's
  egress: what the controller sends, not what hosts send each other). There the
  controller's link is the limit, and the tree is about N/2 times faster. The
  raw baseline: the same raw star over the same shaped link.

    python benchmarks/broadcast.py --hosts 32 --mib 64 --rounds 5
    sudo python benchmarks/broadcast.py --shaped 400mbit --hosts 8 --mib 16 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
import zmq

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # netbed, for --shaped

import colobus as cb  # noqa: E402

MiB = 1 << 20

_RECEIVER = r"""
import sys, zmq
ctx = zmq.Context()
socks = []
for i in range(int(sys.argv[2])):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, b"r%d" % i)
    s.connect(sys.argv[1])
    s.send(b"hi")
    socks.append(s)
poller = zmq.Poller()
for s in socks:
    poller.register(s, zmq.POLLIN)
while True:
    for s, _ in poller.poll():
        msg = s.recv(copy=False)
        if len(msg) == 0:
            sys.exit(0)
        s.send(b"ok")
"""


class RawStar:
    """A ROUTER here, ``n`` DEALERs in one subprocess (optionally inside a netns)."""

    def __init__(self, n: int, bind: str, prefix: list[str] | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.bind(bind)
        endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.proc = subprocess.Popen([*(prefix or []), sys.executable, "-c", _RECEIVER,
                                      endpoint, str(n)])
        self.ids = [self.sock.recv_multipart()[0] for _ in range(n)]

    def put(self, data: np.ndarray[Any, Any]) -> float:
        t = time.perf_counter()
        for ident in self.ids:
            self.sock.send_multipart([ident, data], copy=False)
        for _ in self.ids:
            self.sock.recv_multipart()
        return time.perf_counter() - t

    def close(self) -> None:
        for ident in self.ids:
            self.sock.send_multipart([ident, b""])
        self.proc.wait(30)
        self.sock.close(0)
        self.ctx.term()


async def _rounds(ctl: cb.Controller, devices: list[cb.Device], mib: int, rounds: int,
                  raw: RawStar) -> dict[str, Any]:
    sharding = cb.NamedSharding(cb.Mesh(np.array(devices), ("h",)), cb.PartitionSpec())
    data = np.random.default_rng(0).integers(0, 255, mib * MiB, dtype=np.uint8)
    times: dict[str, list[float]] = {"star": [], "tree": [], "raw": []}
    sent: dict[str, list[float]] = {"star": [], "tree": []}
    for r in range(rounds):
        order = ("star", "tree") if r % 2 == 0 else ("tree", "star")
        for side in order:
            ctl.broadcast_tree = 0 if side == "star" else 2
            before = ctl.stats()["bytes_put"]
            t = time.perf_counter()
            a = cb.device_put(data, sharding)
            await cb.block_until_ready(a)
            times[side].append(time.perf_counter() - t)
            await ctl.refresh_stats()  # the tree's last answers are in
            sent[side].append((ctl.stats()["bytes_put"] - before) / data.nbytes)
            del a
            gc.collect()
        times["raw"].append(raw.put(data))
    med = {k: statistics.median(v) for k, v in times.items()}
    hosts = ctl.stats()["hosts"].values()  # drops as of the hosts' last heartbeats
    dropped: dict[str, int] = {}
    for h in hosts:
        for reason, n in h["dropped"].items():
            if reason.startswith("data_"):
                dropped[reason] = dropped.get(reason, 0) + n
    return {
        "hosts": len(devices), "mib": mib, "rounds": rounds,
        "seconds": {k: sorted(v) for k, v in times.items()},
        "median_s": med,
        "controller_sent_x": {k: statistics.median(v) for k, v in sent.items()},
        "tree_over_star": med["tree"] / med["star"],
        "star_over_raw": med["star"] / med["raw"],
        "tree_over_raw": med["tree"] / med["raw"],
        "data_plane_dropped": dropped,
    }


async def local(args: argparse.Namespace) -> dict[str, Any]:
    async with cb.local_cluster(hosts=args.hosts, devices_per_host=1,
                                join_timeout=600.0) as ctl:
        raw = RawStar(args.hosts, f"ipc:///tmp/colobus-bcast-raw-{os.getpid()}")
        try:
            return await _rounds(ctl, ctl.devices(), args.mib, args.rounds, raw)
        finally:
            raw.close()


async def shaped(args: argparse.Namespace) -> dict[str, Any]:
    from netbed import NetBed

    bed = NetBed(hosts=args.hosts)
    bed.create()
    try:
        async with cb.Controller(bed.bind(), hosts=0, key=bed.key,
                                 join_timeout=600.0) as ctl:
            for i in range(args.hosts):
                bed.start_worker(i, ctl.address, name=f"nb-{i}", devices=1)
            await ctl.wait_for_hosts(args.hosts, timeout=600)
            bed.shape_controller(args.shaped)
            # the raw receivers in host 0's namespace: their traffic crosses the shaped egress
            raw = RawStar(args.hosts, bed.bind(), ["ip", "netns", "exec", bed.hosts[0].ns])
            try:
                devices = sorted(ctl.devices(), key=lambda d: d.host)
                out = await _rounds(ctl, devices, args.mib, args.rounds, raw)
            finally:
                raw.close()
            out["shaped"] = args.shaped
            return out
    finally:
        bed.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=32)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shaped", metavar="RATE", help="netns bed, controller link at RATE")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    out = asyncio.run(shaped(args) if args.shaped else local(args))
    med = out["median_s"]
    sent = out["controller_sent_x"]
    where = f"shaped {args.shaped}" if args.shaped else "this machine"
    print(f"replicated device_put of {args.mib} MiB to {out['hosts']} hosts ({where}), "
          f"{args.rounds} rounds, medians")
    print(f"  star  {med['star'] * 1e3:9.0f} ms   controller sent {sent['star']:.1f}x")
    print(f"  tree  {med['tree'] * 1e3:9.0f} ms   controller sent {sent['tree']:.1f}x")
    print(f"  raw pyzmq star {med['raw'] * 1e3:6.0f} ms")
    print(f"  tree/star {out['tree_over_star']:.2f}   star/raw {out['star_over_raw']:.2f}   "
          f"tree/raw {out['tree_over_raw']:.2f}   hosts' data-plane drops "
          f"{out['data_plane_dropped'] or 'none'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
