"""A relay's own CPU per host and call, its fast paths against the general ones.

One relay object (no controller) carries ``--hosts`` hosts on inproc DEALERs; each
round it gets a fan-out's FORWARD (the frees of the last call for all hosts, each
host's CALL with its own mesh at the end), the hosts take their envelopes and answer
one small RESULT each, and the relay reads them. Printed: the relay's thread CPU per
host for the FORWARD (parsed, each host's envelope made and sent) and for the replies
(read, authenticated, taken, gathered for the UP), on the fast paths
(``_relay/fanout.py``, ``_relay/inflow.py``) and on the general ones (each message
through ``Channel.enqueue_packed``/``flush`` and ``Channel.drain``/``Relay._from_host``,
as relays did before). ZeroMQ's inproc sends wake each receiving socket: that cost is
in both.

    python benchmarks/relay_paths.py --hosts 256 --rounds 40
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import time
from typing import Any

import zmq

from colobus._relay.fanout import call_id_of, forward
from colobus._relay.inflow import HostsChannel
from colobus._relay.relay import Relay
from colobus._wire import protocol as P
from colobus._wire.channel import Channel
from colobus._wire.envelope import Envelope, decode, encode, pack_body
from colobus._wire.relaywire import Adopt, Gather, entries
from colobus._wire.sockio import router_socket

KEY = secrets.token_bytes(32)
CTL = secrets.token_bytes(16)


def _relay(ctx: zmq.Context[Any], loop: asyncio.AbstractEventLoop, fast: bool,
           hosts: int) -> tuple[Relay, list[zmq.Socket[Any]], list[bytes]]:
    cfg = {"key": KEY, "session": secrets.token_bytes(16), "ctl_session": CTL,
           "heartbeat": 1.0, "liveness": 60.0, "resend_after": 30.0,
           "max_message_bytes": 1 << 26, "times": False}
    r = Relay(cfg)
    sock = router_socket(ctx, 1 << 26)
    where = f"inproc://relay-paths-{secrets.token_hex(8)}"
    sock.bind(where)
    r.down = (HostsChannel if fast else Channel)(sock, KEY, loop, r._from_host,
                                                 after_reads=lambda: None,
                                                 on_release=r._released)
    if isinstance(r.down, HostsChannel):
        r.down.relay = r
    socks, sessions = [], []
    for h in range(hosts):
        identity, session = b"w%d" % h, secrets.token_bytes(16)
        r._handle(Envelope(P.Kind.ADOPT, CTL, cfg["session"], 0, Adopt(
            h, identity, session, 1, 0, 1 << 24, 1 << 22).to_wire()))
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTING_ID, identity)
        s.connect(where)
        s.send_multipart(encode(KEY, Envelope(P.Kind.ACK, session, CTL, 0, [])))  # arrived
        socks.append(s)
        sessions.append(session)
    time.sleep(0.1)
    r.down.drain()
    return r, socks, sessions


def _general_forward(r: Relay, body: Any, payload: Any, buffers: list[Any]) -> None:
    """A FORWARD as relays took it before ``fanout.forward``."""
    for (hosts, kind, packed, pay, bufs, pbufs, _), e in zip(
            entries(body, payload, buffers), body, strict=True):
        for j, h in enumerate(hosts):
            peer = r.peers.get(h)
            if peer is not None:
                own = packed + e[8][j] if e[8] is not None else packed
                r.down.enqueue_packed(peer, kind, own, pay, bufs, pbufs)
        if kind == P.Kind.CALL:
            cid = call_id_of(packed)
            if cid is not None:
                r.hold.forwarded(cid, len(hosts))
    r.down.flush()


def run(fast: bool, hosts: int, rounds: int) -> tuple[float, float]:
    ctx: zmq.Context[Any] = zmq.Context()
    loop = asyncio.new_event_loop()
    r, socks, sessions = _relay(ctx, loop, fast, hosts)
    seqs, acks = [0] * hosts, [0] * hosts
    down = up = 0.0
    try:
        for cid in range(100, 100 + rounds):
            g = Gather()
            ids = list(range(hosts))
            g.add_many(ids, int(P.Kind.RELEASE), pack_body([[cid - 1], []]), b"", (), 0)
            head = bytes((0x98,)) + pack_body([cid, 0, b"d" * 16, 0, "", []])[1:]
            g.add_spliced(ids, int(P.Kind.CALL), head,
                          [pack_body([[0], [1], ["x"]]) + pack_body(hosts)] * hosts,
                          b"args" * 20, (), 0)
            [(body, payload, bufs)] = g.take()
            t = time.thread_time()
            if fast:
                forward(r, body, payload, bufs)
                r.down.flush()
            else:
                _general_forward(r, body, payload, bufs)
            down += time.thread_time() - t
            for h, s in enumerate(socks):
                while s.poll(0):
                    acks[h] = max(acks[h], decode(KEY, s.recv_multipart()).seq)
                seqs[h] += 1
                s.send_multipart(encode(KEY, Envelope(P.Kind.RESULT, sessions[h], CTL, seqs[h],
                                                      [cid, 0, 0, [1, 2]], b"\x81\xa1v\x01",
                                                      ack=acks[h])))
            time.sleep(0.02)
            t = time.thread_time()
            r.down.drain()
            up += time.thread_time() - t
            r.ups.take()
    finally:
        for s in socks:
            s.close()
        r.down.close()
        loop.close()
        ctx.term()
    n = rounds * hosts
    return down / n * 1e6, up / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--pairs", type=int, default=2)
    args = ap.parse_args()
    for _ in range(args.pairs):
        for fast in (False, True):
            down, up = run(fast, args.hosts, args.rounds)
            print(f"{'fast' if fast else 'general':>8}: FORWARD {down:6.2f} us per host, "
                  f"replies {up:6.2f} us per host (relay thread CPU, {args.hosts} hosts)",
                  flush=True)


if __name__ == "__main__":
    main()
