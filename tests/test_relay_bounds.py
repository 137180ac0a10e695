"""A relay is bounded as a host is: its reports name only the reasons relays have, and
its entries only hosts it was given; a relay that goes beyond is dropped, said once.

Each test runs a real relay process that holds the relay key (``colobus relay
--connect``), patched at start to misbehave as an outside review found relays could:
heartbeats reporting ever more made-up drop reasons (the controller grew by 63 MB with
80,000 of them in ``stats()`` and the metrics' labels), and a relay that carries no
host flooding results for a host it does not carry (a real host's 1 ms call took 7 s).
"""

from __future__ import annotations

import ast
import logging
import os
import re
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import colobus as cb
from colobus._controller.controller import _pop_current, _push_current
from colobus._controller.relaylink import Relay
from colobus._wire.keys import write_key
from colobus._wire.relaywire import RELAY_REASONS

ROOT = Path(__file__).resolve().parent.parent

HOSTILE = textwrap.dedent("""
    import sys
    import colobus._relay.relay as R
    from colobus._wire import protocol as P
    from colobus._wire.envelope import pack_body

    mode = sys.argv.pop(1)
    tick = R.tick

    def hostile(r):
        tick(r)
        if mode == "reasons":  # ever more made-up reasons, each heartbeat
            r.dropped.update({f"made-up-{len(r.dropped) + i}": 1 for i in range(2000)})
        else:  # results for host 0, which it does not carry: 20 UPs of 500 each
            entries = [[[0], int(P.Kind.RESULT), pack_body([k, 0, 0]), 0, 0, 0, 0, 0, None]
                       for k in range(500)]
            for _ in range(20):
                r.up.send_packed(r.ctl, P.Kind.UP, pack_body(entries), b"", [], 0)

    R.tick = hostile
    from colobus._tools.cli import main
    sys.exit(main())
""")


@cb.colocated_python
def _plus_one(x: Any) -> Any:
    return x + 1


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A controller that takes relays that connect (metrics on), and a real worker that
    joined it directly before any relay did."""
    tmp = tmp_path_factory.mktemp("relay-bounds")
    key_file, relay_file = str(tmp / "cluster.key"), str(tmp / "relay.key")
    write_key(key_file)
    write_key(relay_file)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p or os.getcwd() for p in sys.path))
    env.pop("COLOBUS_KEY_FILE", None)
    ctl = cb.Controller("tcp://127.0.0.1:*", hosts=1, key=cb.load_key(key_file),
                        relay_key=cb.load_key(relay_file), heartbeat_interval=0.2,
                        liveness_timeout=30.0, metrics="127.0.0.1:0", join_timeout=120)
    ctl.start_in_thread()
    worker = subprocess.Popen([sys.executable, "-m", "colobus", "worker", "--connect",
                               ctl.address, "--name", "real", "--key-file", key_file],
                              env=env, stdin=subprocess.DEVNULL)
    try:
        ctl.run_sync(ctl.wait_for_hosts())
        _push_current(ctl)
        yield {"ctl": ctl, "key_file": key_file, "relay_file": relay_file, "env": env}
    finally:
        _pop_current(ctl)
        ctl.close()
        worker.kill()
        worker.wait(30)


def _hostile_relay(bed: dict[str, Any], mode: str) -> subprocess.Popen[bytes]:
    ctl: cb.Controller = bed["ctl"]
    return subprocess.Popen(
        [sys.executable, "-c", HOSTILE, mode, "relay", "--connect", ctl.address, "--key-file",
         bed["key_file"], "--relay-key-file", bed["relay_file"], "--name", mode, "--bind",
         "tcp://127.0.0.1:*", "--once"], env=bed["env"], stdin=subprocess.DEVNULL)


def _wait(pred: Any, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _dropped_relay(bed: dict[str, Any], mode: str,
                   caplog: pytest.LogCaptureFixture) -> Relay:
    """Start the hostile relay; return it once the controller dropped it (and it ended)."""
    ctl: cb.Controller = bed["ctl"]
    assert ctl._relays is not None
    before = len(ctl._relays.relays)
    with caplog.at_level(logging.WARNING, logger="colobus.controller"):
        proc = _hostile_relay(bed, mode)
        try:
            _wait(lambda: len(ctl._relays.relays) > before  # type: ignore[union-attr]
                  and not ctl._relays.relays[before].alive,  # type: ignore[union-attr]
                  f"the {mode} relay dropped")
            relay: Relay = ctl._relays.relays[before]
            assert not relay.carries  # it carried no host: none was lost with it
            assert proc.wait(120) == 0  # told its session ended, it left (--once)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    said = [r.getMessage() for r in caplog.records if f"relay {relay.index} lost" in
            r.getMessage()]
    assert len(said) == 1, said  # said once, however much more it sent
    assert "it broke the protocol: " in said[0], said[0]
    assert ctl.hosts()[0].state == "alive"
    x = cb.device_put(np.arange(3.0), ctl.devices()[0])
    assert np.asarray(ctl.run_sync(_awaited(_plus_one(x)))).tolist() == [1.0, 2.0, 3.0]
    return relay


async def _awaited(fut: Any) -> Any:
    return await fut


def test_a_relay_reporting_made_up_drop_reasons_is_dropped_and_they_are_not_kept(
        bed: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    ctl: cb.Controller = bed["ctl"]
    relay = _dropped_relay(bed, "reasons", caplog)
    (said,) = [r.getMessage() for r in caplog.records if "lost" in r.getMessage()]
    assert "its heartbeat reported drops for 200" in said or "do not have" in said, said
    dropped = ctl.stats()["dropped"]
    assert not [k for k in dropped if "made-up" in k], sorted(dropped)[:10]
    assert len(dropped) < 32, sorted(dropped)
    assert not relay.dropped.keys() - RELAY_REASONS
    assert ctl.metrics_url is not None
    with urllib.request.urlopen(ctl.metrics_url, timeout=30) as page:
        text = page.read().decode()
    assert "colobus_messages_dropped" in text and "made-up" not in text


def test_a_relay_flooding_results_for_a_host_it_does_not_carry_is_dropped_at_once(
        bed: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    ctl: cb.Controller = bed["ctl"]
    unsolicited = ctl.stats()["dropped"].get("unsolicited", 0)
    relay = _dropped_relay(bed, "flood", caplog)
    (said,) = [r.getMessage() for r in caplog.records if "lost" in r.getMessage()]
    assert "an entry for host 0, which it was never given" in said, said
    # read one UP and dropped it there: its other 10,000 entries were never parsed
    assert relay.ups == 1 and relay.carried_up == 0, (relay.ups, relay.carried_up)
    assert ctl.stats()["dropped"].get("unsolicited", 0) == unsolicited + 1


def test_the_reasons_a_relay_may_report_are_every_reason_it_has() -> None:
    """``RELAY_REASONS`` holds every reason the relay's code and the wire it reads drop a
    message for (a new one must be added there, or relays would be dropped for it)."""
    found: set[str] = set()
    sources = [*(ROOT / "colobus" / "_relay").glob("*.py"), *(ROOT / "colobus" / "_wire")
               .glob("*.py")]
    for path in sources:
        text = path.read_text()
        found.update(re.findall(r'Dropped\("(\w+)"', text))
        if path.parent.name == "_relay":
            found.update(re.findall(r'dropped\["(\w+)"\]', text))
            found.update(re.findall(r'dropped\["(\w+)" if', text))
            found.update(re.findall(r'else "(\w+)"\] \+= 1', text))
            found.update(re.findall(r'_lose\([^)]*, "(\w+)"\)', text))
    tree = ast.parse((ROOT / "colobus" / "_wire" / "peer.py").read_text())
    found.update(node.value.value for node in ast.walk(tree)  # what deliver() refuses
                 if isinstance(node, ast.Return) and isinstance(node.value, ast.Constant)
                 and isinstance(node.value.value, str))
    assert {"stale", "unknown_peer", "malformed", "replay", "gap"} <= found, found
    assert found <= RELAY_REASONS, found - RELAY_REASONS
