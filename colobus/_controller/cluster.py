"""What a cluster that owns its workers' processes tells the controller.

``local_cluster`` and the launchers (:mod:`colobus._launch`) start the worker
processes themselves, so they can number the hosts by name before the workers
start, and declare a host lost the moment its process ends instead of after
the liveness timeout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from .._errors import ControllerClosedError
from .._wire import protocol as P
from .controller import Controller, State
from .environ import join_level

__all__ = ["announce_joins", "host_process_ended", "number_hosts_by_name"]


def number_hosts_by_name(ctl: Controller, names: Sequence[str]) -> None:
    """Give the first hosts to join these names the numbers 0, 1, ... in this order.

    Before the workers start: each name's number is reserved at the next HELLO
    (:meth:`HostRegistry.reserve`), so each worker joins as soon as it says HELLO,
    whatever the others do.
    """
    ctl._sessions.number_by_name = list(names)


def announce_joins(ctl: Controller) -> None:
    """A launcher's workers join ``ctl``: on a terminal, a line per host as it joins
    shows without logging set up (:func:`~colobus._controller.environ.join_level`)."""
    ctl._sessions.join_level = join_level(launched=True)


def host_process_ended(ctl: Controller, name: str, pid: int | None, why: str) -> None:
    """The process of host ``name`` (pid ``pid``) is gone: declare it lost now.

    Called from any thread by whoever owns the process, so the host is lost at
    once rather than after ``liveness_timeout``. ``pid`` None: the worker ran
    on another machine (its ssh session or srun step ended), whatever pid it
    reported.
    """
    def lose() -> None:
        host = ctl._hosts.by_name.get(name)
        if host is not None and (pid is None or host.pid == pid):
            # Its process is gone: a worker still talking under that session (the far
            # side of a dead ssh session, until it notices) exits instead of rejoining.
            ctl._sessions.lose(host, why, P.RESET_EXIT)

    if ctl.state is State.RUNNING:
        with contextlib.suppress(RuntimeError, ControllerClosedError):  # closed meanwhile
            ctl._call_soon(lose)
