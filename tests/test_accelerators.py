"""Accelerators without one (CI): readiness as JAX's, chips shared out, a failed open.

Readiness: ``cb.block_until_ready`` and ``is_ready`` answer for the value computed on
the hosts, not only stored (JAX dispatches asynchronously). Chip sharing: the
environment each local worker gets for K accelerators and N hosts, read from inside
the workers; K is told to the detector by ``COLOBUS_ACCELERATORS``. A worker whose
accelerator cannot be opened joins with CPU devices only.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import ready_hostside as hs

import colobus as cb
from colobus._api.fetch import fetch_tree
from colobus._api.ready import ready_future
from colobus._launch.accel import Accelerators, local_worker_envs, share_out


def test_block_until_ready_waits_until_the_host_says_computed(ctl: cb.Controller) -> None:
    dev = next(d for d in cb.devices() if d.host == 0)
    x = cb.device_put(np.arange(4, dtype=np.float32), cb.SingleDeviceSharding(dev))
    try:
        y = hs.hold(x)
        assert y.is_ready() is False
        waiter = ready_future(y)  # (cb.block_until_ready would block here: its Future)
        # The host answers this probe after it received the wait above: had the wait been
        # answered at once, its reply would have come first.
        assert y.is_ready() is False
        assert not waiter.done()
        cb.block_until_ready(hs.release(x))  # opens the gate on the host
        assert waiter.result(timeout=60) is y
        assert y.is_ready() is True
        np.testing.assert_array_equal(np.asarray(y), np.arange(4, dtype=np.float32) * 2)
    finally:
        cb.block_until_ready(hs.release(x))
        cb.block_until_ready(hs.unpatch(x))


def test_a_fetch_waits_for_the_computation_too(ctl: cb.Controller) -> None:
    dev = next(d for d in cb.devices() if d.host == 1)
    x = cb.device_put(np.arange(4, dtype=np.float32), cb.SingleDeviceSharding(dev))
    try:
        y = hs.hold(x)
        got = fetch_tree(y)  # (cb.device_get would block here: its Future)
        assert y.is_ready() is False
        assert not got.done()
        cb.block_until_ready(hs.release(x))
        np.testing.assert_array_equal(got.result(timeout=60), np.arange(4) * 2)
    finally:
        cb.block_until_ready(hs.release(x))
        cb.block_until_ready(hs.unpatch(x))


def test_block_until_ready_of_a_calls_future_waits_behind_the_call(ctl: cb.Controller) -> None:
    dev = next(d for d in cb.devices() if d.host == 0)
    x = cb.device_put(np.arange(4, dtype=np.float32), cb.SingleDeviceSharding(dev))
    try:
        y = hs.hold.specialize(out_specs_fn=lambda a: a)(x)  # its array at once (pending)
        waiter = ready_future({"y": y, "x": x})  # sent before the call answered
        assert y.is_ready() is False
        assert not waiter.done()
        cb.block_until_ready(hs.release(x))
        got = waiter.result(timeout=60)
        assert got["y"] is y and got["x"] is x  # the same arrays back, ready
        assert y._ready  # the hosts said so: a later wait sends nothing
        np.testing.assert_array_equal(np.asarray(y), np.arange(4, dtype=np.float32) * 2)
    finally:
        cb.block_until_ready(hs.release(x))
        cb.block_until_ready(hs.unpatch(x))


def test_block_until_ready_of_a_failed_call_raises_its_error(ctl: cb.Controller) -> None:
    dev = next(d for d in cb.devices() if d.host == 1)
    x = cb.device_put(np.arange(4, dtype=np.float32), cb.SingleDeviceSharding(dev))
    with pytest.raises(Exception, match="no such thing"):
        cb.block_until_ready(hs.fail(x))
    # a finished call's Future: its outputs are waited for as arrays
    done = hs.long_computation(x)
    assert cb.block_until_ready(done).shape == (768, 768)


def test_after_block_until_ready_a_long_computation_is_done_on_its_host(
        ctl: cb.Controller) -> None:
    dev = next(d for d in cb.devices() if d.host == 0)
    x = cb.device_put(np.ones((2, 2), np.float32), cb.SingleDeviceSharding(dev))
    y = hs.long_computation(x)
    assert cb.block_until_ready(y) is y
    # Asked of JAX on the host, right after: computed (before, the wait returned at
    # once while JAX still ran it).
    assert np.asarray(hs.computed_here(y)).tolist() == [True]
    assert y.is_ready() is True


# -- sharing accelerators out -------------------------------------------------------------


def test_share_out_gives_each_worker_its_chips() -> None:
    four = share_out(Accelerators("tpu", 4), hosts=2, per_host=None)
    assert [e["TPU_VISIBLE_CHIPS"] for e in four] == ["0,1", "2,3"]
    assert {e["TPU_CHIPS_PER_PROCESS_BOUNDS"] for e in four} == {"1,2,1"}
    assert {e["TPU_PROCESS_BOUNDS"] for e in four} == {"1,1,1"}
    assert len({e["TPU_PROCESS_PORT"] for e in four}) == 2
    eight = share_out(Accelerators("tpu", 8), hosts=8, per_host=None)
    assert [e["TPU_VISIBLE_CHIPS"] for e in eight] == [str(i) for i in range(8)]
    assert {e["TPU_CHIPS_PER_PROCESS_BOUNDS"] for e in eight} == {"1,1,1"}
    # one worker, every chip: JAX's own view, nothing narrowed
    assert "TPU_VISIBLE_CHIPS" not in share_out(Accelerators("tpu", 4), 1, None)[0]
    gpus = share_out(Accelerators("gpu", 4), hosts=2, per_host=None)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in gpus] == ["0,1", "2,3"]
    fewer = share_out(Accelerators("gpu", 2), hosts=3, per_host=None)
    assert [e.get("CUDA_VISIBLE_DEVICES") for e in fewer] == ["0", "1", None]
    assert [e.get("JAX_PLATFORMS") for e in fewer] == ["cuda,cpu", "cuda,cpu", "cpu"]
    assert all(e == {"JAX_PLATFORMS": "cpu"}
               for e in share_out(Accelerators("tpu", 4), 2, per_host=0))
    assert [e["TPU_VISIBLE_CHIPS"] for e in share_out(Accelerators("tpu", 8), 2, 2)] == [
        "0,1", "2,3"]
    with pytest.raises(ValueError, match="only 4"):
        share_out(Accelerators("tpu", 4), 2, per_host=4)
    # accelerators_per_host=0: CPU-only, also where the detector finds nothing
    assert local_worker_envs(2, 0) == [{"JAX_PLATFORMS": "cpu"}] * 2


@cb.colocated_python
def _worker_view(x: Any) -> Any:
    keys = ("TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "JAX_PLATFORMS")
    import jax

    seen = [os.environ.get(k, "-") for k in keys] + [jax.default_backend()]
    return np.asarray([" ".join(seen)])


def test_workers_get_their_chips_and_one_that_cannot_open_joins_cpu_only(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    # Three hosts told 2 TPU chips: the first two get one each, the third is CPU-only.
    # Without a TPU here, opening it fails in the first two: they join CPU-only.
    monkeypatch.setenv("COLOBUS_ACCELERATORS", "tpu:2")
    with cb.local_cluster(hosts=3, devices_per_host=1, relays=0) as ctl:
        assert [[d.platform for d in h.devices] for h in ctl.hosts()] == [["cpu"]] * 3
        views = []
        for dev in cb.devices():
            x = cb.device_put(np.zeros(1, np.float32), cb.SingleDeviceSharding(dev))
            views.append(str(np.asarray(_worker_view(x))[0]))
    assert views == ["0 1,1,1 tpu,cpu cpu", "1 1,1,1 tpu,cpu cpu", "- - cpu cpu"]
    assert "2 tpu chips for 3 hosts: hosts 0-1 get 1 each, host 2 is CPU-only" in caplog.text
    err = capfd.readouterr().err
    assert err.count("could not open its accelerator") == 2, err
