"""The worker's side of a launched cluster: exit when the launcher's session ends.

A launcher (``ssh``, ``srun``) keeps the worker's stdin open after writing the
key there. When the session ends (the launcher exited or was killed, the ssh
connection dropped), the worker's stdin reaches end-of-file: the worker then
exits by itself, so no process stays behind on the far side. A worker of a
batch job has no such session: it gives up (exit status 3) once it has been
without a controller for ``--give-up-after`` seconds, so a driver that died
without cancelling the job leaves no worker running until the job's time limit.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Any

__all__ = ["GIVE_UP_STATUS", "exit_on_stdin_eof", "give_up_when_alone"]

log = logging.getLogger("colobus.launch.remote")

GIVE_UP_STATUS = 3  # the exit status of a worker that gave up (never restarted)
GRACE_S = 3.0  # after SIGTERM, how long the worker may take to leave before _exit


def _watch(grace: float) -> None:
    try:
        while sys.stdin.read(4096):
            pass  # a launcher writes nothing after the key; anything else is ignored
    except (OSError, ValueError):
        pass
    log.warning("stdin closed: the launcher's session ended; this worker exits")
    os.kill(os.getpid(), signal.SIGTERM)  # the worker's handler leaves its session
    time.sleep(grace)
    os._exit(1)


def exit_on_stdin_eof(grace: float = GRACE_S) -> threading.Thread:
    """Watch stdin on a daemon thread; at end-of-file, SIGTERM this process.

    The worker's SIGTERM handler leaves its session and exits; one that does
    not within ``grace`` seconds (stuck in user code) ends with ``os._exit``.
    """
    t = threading.Thread(target=_watch, args=(grace,), name="colobus-stdin-eof", daemon=True)
    t.start()
    return t


def _alone(worker: Any, seconds: float) -> None:
    last = time.monotonic()
    while True:
        time.sleep(0.5)
        if worker._joined:
            last = time.monotonic()
        elif time.monotonic() - last > seconds:
            log.warning("no controller for %.0f s: this worker gives up and exits", seconds)
            os._exit(GIVE_UP_STATUS)  # no session, nothing to leave cleanly


def give_up_when_alone(worker: Any, seconds: float) -> threading.Thread:
    """Exit with :data:`GIVE_UP_STATUS` once ``worker`` has had no session ``seconds`` long."""
    t = threading.Thread(target=_alone, args=(worker, seconds), name="colobus-give-up",
                         daemon=True)
    t.start()
    return t
