"""The sync face's own loop thread runs uvloop where installed (issue 7)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import colobus as cb


async def _loop_class() -> str:
    return type(asyncio.get_running_loop()).__module__


@pytest.mark.parametrize("switch", [None, "0"])
def test_the_sync_controller_runs_on_uvloop_unless_turned_off(
        switch: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("uvloop")
    if switch is not None:
        monkeypatch.setenv("COLOBUS_UVLOOP", switch)
    with cb.local_cluster(hosts=1, devices_per_host=1) as ctl:
        module = ctl.run_sync(_loop_class(), timeout=10)
        x = cb.device_put(np.arange(4.0), ctl.devices()[0])
        np.testing.assert_array_equal(cb.device_get(x), np.arange(4.0))
    assert module.startswith("uvloop") == (switch is None), module
