"""Fan-out without per-host Python on the controller (issue 25): the pieces and the
real stack.

A call, a free or a cancel to many relayed hosts is one entry of each relay's next
FORWARD (``FanoutChannel.send_packed_many``, ``Gather.add_many``); frees of a fan-out
are one RELEASE for all its hosts; relayed hosts' heartbeats go up only with news.
What must hold: each host's messages in order, frees of arrays on different host sets
in one step reach exactly their hosts, and a host's figures still reach the
controller.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from typing import Any

import numpy as np
import pytest
from lifecycle import eventually

import colobus as cb
from colobus._controller.hosts import host_mask
from colobus._relay.relay import HEALTH_EVERY_S, Relay
from colobus._wire.envelope import pack_body
from colobus._wire.relaywire import Gather, entries

HB, LIVENESS = 0.2, 4.0


def test_a_message_for_many_hosts_is_one_entry_after_each_hosts_earlier_ones() -> None:
    g = Gather()
    g.add(2, 4, b"\x90", b"", (), 0, alone=True)  # host 2 was sent something first
    call = pack_body([7])
    g.add_many([0, 1, 2, 3], 9, call, b"args", (), 0)
    g.add(1, 4, pack_body([1]), b"", (), 0)  # then host 1 gets more
    g.add(5, 9, call, b"args", (), 0)  # a host added later joins the fan-out's entry
    g.add(2, 9, call, b"args", (), 0)  # the same again for host 2: a new entry, after
    [(body, payload, bufs)] = g.take()
    got = list(entries(body, payload, bufs))
    assert [e[0] for e in got] == [[2], [0, 1, 2, 3, 5], [1], [2]]
    assert payload == b"args"  # the shared arguments travel once
    order: dict[int, list[int]] = {}
    for i, e in enumerate(got):
        for h in e[0]:
            order.setdefault(h, []).append(i)
    assert all(v == sorted(v) and len(set(v)) == len(v) for v in order.values())


def test_host_masks_match_the_bits_of_their_hosts() -> None:
    rng = random.Random(5)
    for n in (0, 1, 7, 32, 33, 500, 2048):
        hosts = tuple(rng.sample(range(4096), n))
        want = 0
        for i in hosts:
            want |= 1 << i
        assert host_mask(hosts) == want
        assert host_mask(hosts) == want  # (cached)
    for bad in ((-1,), (-3, *range(40))):
        with pytest.raises(ValueError, match="host indices are >= 0"):
            host_mask(bad)


def _relay() -> Relay:
    return Relay({"key": b"k" * 32, "session": b"s" * 16, "ctl_session": b"c" * 16,
                  "heartbeat": 1.0, "liveness": 5.0, "resend_after": 1.0,
                  "max_message_bytes": 1 << 20})


def test_a_relay_sends_a_hosts_heartbeat_up_only_with_news(monkeypatch: Any) -> None:
    relay = _relay()
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    beat = [3, 300, 1, 2, 0, 0, 1000, 5000, {}, [], 4, 0, 1, 10]
    assert relay._health_news(0, beat)  # the first one goes
    now[0] += 1
    assert not relay._health_news(0, [*beat[:4], 77, 1, 2000, 6000, *beat[8:]])  # memory, CPU
    assert relay._health_news(1, beat)  # another host's first
    assert relay._health_news(0, [4, *beat[1:]])  # its store changed
    now[0] += 1
    assert relay._health_news(0, [*beat[:8], {"gap": 1}, *beat[9:]])  # it dropped something
    assert relay._health_news(0, [*beat[:8], {"gap": 1}, [["f", 1]], *beat[10:]])  # call times
    quiet = [*beat[:8], {"gap": 1}, [], *beat[10:]]
    now[0] += 1
    assert not relay._health_news(0, quiet)
    now[0] += HEALTH_EVERY_S
    assert relay._health_news(0, quiet)  # at least every HEALTH_EVERY_S
    assert relay._health_news(0, "not a list")  # malformed: the controller judges it


@cb.colocated_python
def plus(x: Any) -> Any:
    return x + 1


async def test_frees_of_arrays_on_different_hosts_in_one_step_reach_exactly_theirs() -> None:
    async with cb.local_cluster(hosts=4, relays=1, heartbeat_interval=HB,
                                liveness_timeout=LIVENESS) as ctl:
        devs = ctl.devices()

        def on(hosts: list[int]) -> cb.Array:
            d = [devs[i] for i in hosts]
            return cb.device_put(np.zeros(2 * len(d), np.float32), cb.NamedSharding(
                cb.Mesh(np.array(d), ("d",)), cb.PartitionSpec("d")))

        every, low, high = on([0, 1, 2, 3]), on([0, 1]), on([2, 3])
        outs = [await plus(x) for x in (every, low, high, every)]
        counts = (await ctl.refresh_stats())["hosts"]
        assert all(counts[i]["arrays"] >= 4 for i in range(4))
        del every, low, high, outs  # frees of three host sets, queued in one step
        await eventually(lambda: ctl._frees._queue == type(ctl._frees._queue)(), 5,
                         "the frees to leave")
        counts = (await ctl.refresh_stats())["hosts"]
        assert [counts[i]["arrays"] for i in range(4)] == [0, 0, 0, 0]
        assert [counts[i]["results"] for i in range(4)] == [0, 0, 0, 0]
        # the hosts still take fan-out calls, and heartbeats with news still come up
        y = on([0, 1, 2, 3])
        await eventually(lambda: all(ctl.stats()["hosts"][i]["arrays"] == 1 for i in range(4)),
                         10, "the hosts' heartbeats to report the new array")
        assert np.asarray(await cb.device_get(await plus(y))).tolist() == [1.0] * 8
        assert not {"unsolicited", "malformed", "gap"} & set(ctl.stats()["dropped"])


@cb.colocated_python
def mark(path: str) -> None:
    """Each host adds a byte to its own file: which hosts a call reached, and how often."""
    with open(os.path.join(path, str(cb.host_index())), "a") as f:
        f.write("x")


async def test_a_fan_out_made_again_after_its_hosts_moved_reaches_them_where_they_are(
        tmp_path: Any) -> None:
    """The controller keeps how a fan-out's hosts are reached (their relays, who is
    alive) while no host joins or is lost; a relay killed moves its hosts to the other
    relay, and the same specialized call then reaches every host there, once."""
    def reached() -> list[int]:
        return [len((tmp_path / str(i)).read_text()) if (tmp_path / str(i)).exists() else 0
                for i in range(6)]

    async with cb.local_cluster(hosts=6, relays=2, heartbeat_interval=HB,
                                liveness_timeout=LIVENESS) as ctl:
        f = mark.specialize(devices=ctl.devices())
        for _ in range(3):  # the first works the fan-out out, the rest reuse it
            assert await f(str(tmp_path)) is None
        assert reached() == [3] * 6
        doomed = ctl.stats()["relays"][0]
        os.kill(doomed["pid"], signal.SIGKILL)
        await eventually(lambda: not ctl.stats()["relays"][0]["alive"], 20,
                         "the killed relay declared lost")
        await eventually(lambda: all(h.state == "alive" for h in ctl.hosts()), 60,
                         "its hosts to rejoin")
        assert sorted(ctl.stats()["relays"][1]["hosts"]) == list(range(6))
        for _ in range(3):  # (a call sent the old way would never end)
            assert await asyncio.wait_for(f(str(tmp_path)), 30) is None
        assert reached() == [6] * 6
        assert not {"unsolicited", "relayed"} & set(ctl.stats()["dropped"])


def test_a_relay_holds_a_calls_replies_while_they_keep_coming_and_never_past_its_last() -> None:
    from colobus._relay.hold import HOLD_MAX_S, HOLD_S, ReplyHold

    hold = ReplyHold()
    hold.forwarded(7, 3)
    assert not hold.holding and hold.left(time.monotonic()) == 0.0  # nothing gathered yet
    hold.answered(7)
    first = time.monotonic()
    assert hold.holding and 0.0 < hold.left(first) <= HOLD_S
    assert hold.left(first + HOLD_S + 0.001) == 0.0  # no further reply for HOLD_S: it goes
    hold.answered(7)  # a second reply: the wait runs from it, never past HOLD_MAX_S
    assert hold.left(time.monotonic()) > 0.0
    assert hold.left(first + HOLD_MAX_S + 0.001) == 0.0
    hold.urgent = True  # a transfer's part among what is gathered: nothing waits
    assert hold.left(time.monotonic()) == 0.0
    hold.urgent = False
    hold.answered(7)  # the call's last reply here releases it at once
    assert not hold.holding and hold.left(time.monotonic()) == 0.0
    hold.sent()
    assert not hold.holding
