"""Relays on the hosts' own machines (``relays_on_hosts=N``): one per N hosts, each a
``colobus relay`` process a launcher starts beside a host's worker before the workers,
so that the controller's machine pays per relay, not per host, on every call.

:class:`RelaysOnHosts` is the part of :class:`colobus._launch.base.LaunchedCluster`
that starts them, waits until each has offered itself to the controller, and reaps
them with the cluster; a launcher says how to start one (``Launcher.relay_command``).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .._controller.procwatch import describe_exit
from .._wire.keys import generate_key

if TYPE_CHECKING:
    from .._controller.controller import Controller

__all__ = ["RelaysOnHosts", "relay_argv", "relays_on_hosts_option"]


def relay_argv(connect: str, i: int) -> list[str]:
    """``colobus relay``'s arguments for the relay beside host ``i`` (after the Python
    command and ``-m colobus``): both keys read from stdin, which the launcher keeps
    open; it ends with the controller's session."""
    return ["relay", "--connect", connect, "--key-file", "-", "--relay-key-file", "-",
            "--name", f"relay-{i}", "--once", "--exit-on-stdin-eof"]


def relays_on_hosts_option(per: int, options: dict[str, Any]) -> int:
    """``relays_on_hosts``, checked: one relay per ``per`` hosts on the hosts' own
    machines (0: none). With some, the controller ``options`` get a fresh ``relay_key``
    (the relays prove it; workers never see it) and no relays of the controller's own
    unless ``relays=`` asks.

    Raises:
        ValueError: ``per`` below 0.
    """
    if per < 0:
        raise ValueError(f"relays_on_hosts must be >= 0, got {per}")
    if per:
        if options.get("relay_key") is None:
            options["relay_key"] = generate_key()
        options.setdefault("relays", 0)
    return int(per)


class RelayLauncher(Protocol):
    """What :class:`RelaysOnHosts` uses of a cluster's launcher (``base.Launcher``)."""

    @property
    def names(self) -> Sequence[str]: ...
    def describe(self, i: int) -> str: ...
    def start_relay(self, i: int, connect: str, key: bytes,
                    relay_key: bytes) -> subprocess.Popen[bytes]: ...
    def stop(self, proc: subprocess.Popen[bytes]) -> None: ...


class RelaysOnHosts:
    """Starts, waits for and reaps the relays on the hosts' machines (a cluster's part)."""

    launcher: RelayLauncher
    controller: Controller
    _key: bytes
    relays_on_hosts: int  # one relay per this many hosts, on the machines of 0, N, 2N, ...
    relay_procs: list[subprocess.Popen[bytes]]

    def connect_address(self) -> str:
        raise NotImplementedError

    async def _start_relays(self) -> None:
        """Start the relays on the hosts' machines and wait until each offered itself to
        the controller (its hosts then move to them as they join).

        Raises:
            RuntimeError: a relay's process ended first.
            TimeoutError: not all were there within ``join_timeout``.
        """
        per = self.relays_on_hosts
        ctl = self.controller
        if not per:
            return
        relays = ctl._relays
        assert relays is not None and relays.relay_key is not None
        where = list(range(0, len(self.launcher.names), per))
        for i in where:
            self.relay_procs.append(self.launcher.start_relay(
                i, self.connect_address(), self._key, relays.relay_key))
        deadline = time.monotonic() + ctl.join_timeout
        while True:
            for i, proc in zip(where, self.relay_procs, strict=True):
                code = proc.poll()
                if code is not None:
                    raise RuntimeError(f"the relay on {self.launcher.describe(i)}'s machine "
                                       f"{describe_exit(code)} before it connected")
            try:
                await relays.wait_ready(len(where), min(0.5, max(0.0, deadline
                                                                 - time.monotonic())))
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise

    def _stop_relays(self) -> None:
        """After the controller closed (its relays' sessions ended): reap the relays."""
        procs, self.relay_procs = self.relay_procs, []
        for proc in procs:
            self.launcher.stop(proc)
        for proc in procs:
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

