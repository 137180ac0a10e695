"""Transport rows: a transfer over a shaped link against raw pyzmq, and the loop's
longest stall under an unauthenticated flood.

* ``shaped``: one worker in a network namespace whose link is limited to
  ``--rate`` both ways (``tc`` tbf, ``tests/netbed.py``). colobus moves
  ``--mb`` MB up (``device_put`` until the host holds it) and down
  (``device_get``); in the same run, raw pyzmq moves the same bytes over the same
  link (one multipart message, DEALER to DEALER) each way. The row is colobus's
  rate over raw's (target: at least 0.8). Needs root (namespaces).
* ``flood``: a controller with one real worker; another process opens 4
  connections without the key, sends 3 frames of 64 MiB on each, then 512 KiB
  messages as fast as it can for ``--flood-s`` seconds. The row is the
  controller loop's longest gap between 5 ms ticks (wall) and its longest stretch
  of work (the loop thread's CPU time), flood against no flood.

    python benchmarks/transport.py                 # both rows, 80 MB at 80 Mbit/s
    python benchmarks/transport.py --rows flood --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import colobus as cb  # noqa: E402

RAW_RECEIVER = """
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 0)
mode, endpoint, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
s.connect(endpoint)
s.send(b"ready")
if mode == "down":  # this side sends the bytes
    s.recv()
    s.send_multipart([b"data", bytes(nbytes)], copy=False)
    s.recv()
else:
    frames = s.recv_multipart(copy=False)
    assert sum(len(f.buffer) for f in frames) >= nbytes
    s.send(b"done")
s.close(0)
ctx.term()
"""


def _raw(bed: Any, nbytes: int) -> dict[str, float]:
    """Seconds raw pyzmq takes for ``nbytes`` up and down over host 0's link."""
    import zmq

    out: dict[str, float] = {}
    ctx = zmq.Context()
    try:
        for mode in ("up", "down"):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            port = sock.bind_to_random_port(f"tcp://{bed.controller_ip}")
            proc = subprocess.Popen(["ip", "netns", "exec", bed.hosts[0].ns, sys.executable,
                                     "-c", RAW_RECEIVER, mode,
                                     f"tcp://{bed.controller_ip}:{port}", str(nbytes)])
            try:
                assert sock.recv() == b"ready"
                t0 = time.perf_counter()
                if mode == "up":
                    sock.send_multipart([b"data", bytes(nbytes)], copy=False)
                    sock.recv()
                else:
                    sock.send(b"go")
                    sock.recv_multipart(copy=False)
                    sock.send(b"thanks")
                out[mode] = time.perf_counter() - t0
                proc.wait(60)
            finally:
                if proc.poll() is None:
                    proc.kill()
                sock.close(0)
    finally:
        ctx.term()
    return out


async def _colobus(bed: Any, nbytes: int) -> dict[str, float]:
    out: dict[str, float] = {}
    async with cb.Controller(bed.bind(), hosts=0, key=bed.key, join_timeout=60) as ctl:
        bed.start_worker(0, ctl.address, name="bench", devices=1)
        await ctl.wait_for_hosts(1, timeout=60)
        dev = ctl.devices()[0]
        data = np.ones(nbytes // 8)
        t0 = time.perf_counter()
        x = cb.device_put(data, dev)
        await cb.block_until_ready(x)
        out["up"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        await cb.device_get(x)
        out["down"] = time.perf_counter() - t0
        out["resent"] = float(ctl.stats()["resent"])
        out["lost"] = float(sum(h.state != "alive" for h in ctl.hosts()))
    return out


def shaped_row(mb: int, rate: str) -> dict[str, Any]:
    from netbed import NetBed, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        return {"row": "shaped", "skipped": reason}
    nbytes = mb * 1_000_000
    bed = NetBed(hosts=1)
    try:
        bed.create()
        bed.shape(0, rate)
        raw = _raw(bed, nbytes)
        ours = asyncio.run(_colobus(bed, nbytes))
    finally:
        bed.close()
    row: dict[str, Any] = {"row": "shaped", "mb": mb, "rate": rate}
    for d in ("up", "down"):
        row[f"colobus_{d}_s"] = round(ours[d], 2)
        row[f"raw_{d}_s"] = round(raw[d], 2)
        row[f"{d}_vs_raw"] = round(raw[d] / ours[d], 2)
    row["resent"], row["hosts_lost"] = int(ours["resent"]), int(ours["lost"])
    return row


def flood_row(seconds: float) -> dict[str, Any]:
    import tempfile

    from test_transport import FLOOD

    from colobus._wire.keys import write_key

    key_dir = tempfile.TemporaryDirectory()
    key_file = os.path.join(key_dir.name, "key")
    key = write_key(key_file)
    ctl = cb.Controller("tcp://127.0.0.1:*", hosts=0, key=key)
    ctl.start_in_thread()
    env = dict(os.environ, COLOBUS_PARENT_PID=str(os.getpid()))
    worker = subprocess.Popen([sys.executable, "-m", "colobus", "worker", "--connect",
                               ctl.address, "--name", "steady", "--key-file", key_file],
                              env=env, stdin=subprocess.DEVNULL)
    try:
        ctl.run_sync(ctl.wait_for_hosts(1, timeout=120))
        loop = ctl._loop
        assert loop is not None
        probe = {"wall": 0.0, "cpu": 0.0}

        def tick(then: float, cpu_then: float) -> None:
            now, cpu = time.monotonic(), time.thread_time()
            probe["wall"] = max(probe["wall"], now - then - 0.005)
            if cpu_then >= 0:
                probe["cpu"] = max(probe["cpu"], cpu - cpu_then)
            if ctl.state.value == "running":
                loop.call_later(0.005, tick, time.monotonic(), time.thread_time())

        loop.call_soon_threadsafe(tick, time.monotonic(), -1.0)
        time.sleep(seconds)
        quiet = dict(probe)
        probe.update(wall=0.0, cpu=0.0)
        flood = subprocess.run([sys.executable, "-c", FLOOD, ctl.address, str(seconds)],
                               capture_output=True, text=True, timeout=300)
        loud = dict(probe)
        alive = ctl.hosts()[0].state == "alive"
        dropped = dict(ctl.stats()["dropped"])
    finally:
        ctl.close()
        worker.kill()
        worker.wait(30)
        key_dir.cleanup()
    return {"row": "flood", "seconds": seconds,
            "junk_messages": int(flood.stdout or 0),
            "longest_stall_ms": round(loud["wall"] * 1e3, 1),
            "longest_work_ms": round(loud["cpu"] * 1e3, 1),
            "quiet_stall_ms": round(quiet["wall"] * 1e3, 1),
            "quiet_work_ms": round(quiet["cpu"] * 1e3, 1),
            "host_alive": alive, "dropped": dropped}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="shaped,flood")
    ap.add_argument("--mb", type=int, default=80)
    ap.add_argument("--rate", default="80mbit")
    ap.add_argument("--flood-s", type=float, default=4.0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = []
    for name in args.rows.split(","):
        row = shaped_row(args.mb, args.rate) if name == "shaped" else flood_row(args.flood_s)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
