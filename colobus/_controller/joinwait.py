"""What the driver says while it waits for hosts: how many joined, and what to run.

:meth:`Controller.wait_for_hosts` logs a progress line at WARNING (so it shows
with no logging set up at all: Python's last-resort handler prints warnings)
a few seconds into a wait and then every ``EVERY_S``, and its timeout names the
key the workers need. Local clusters, whose workers start by themselves, wait
in short steps and never reach the first line.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from .._wire.keys import is_private_key_file, key_file_of, key_id

__all__ = ["JoinProgress", "JoinWaiters", "WrongKeys", "worker_command"]

log = logging.getLogger("colobus.controller")

FIRST_AFTER_S = 5.0
EVERY_S = 15.0
# Where the workers `colobus launch` started say what they do: it relays their output.
LAUNCHED_LOGS = ("their output shows in the terminal of `colobus launch` as [host N] lines; "
                 "COLOBUS_LOG_LEVEL=INFO there shows their progress")


def worker_command(address: str, key: bytes) -> str:
    """The ``colobus worker`` command line a host runs to join ``address``."""
    connect = address
    if address.startswith("tcp://"):
        host = urlsplit(address).hostname or ""
        if host in ("0.0.0.0", "::", "*", ""):  # bound to every interface: name this one
            connect = address.replace(f"//{host}", f"//{socket.gethostname()}", 1)
            connect = connect.replace("//[::]", f"//{socket.gethostname()}", 1)
    command = f"colobus worker --connect {connect}"
    if key:
        command += f" --key-file {key_file_of(key) or 'KEY_FILE'}"
    return command


def key_words(key: bytes) -> str:
    """The key as the driver names it: its file (where known) and its id."""
    if not key:
        return "no key"
    path = key_file_of(key)
    where = f"from {path}, " if path else ""
    return f"key {where}id {key_id(key)}"


class JoinProgress:
    """Logs, during one wait for ``expected`` hosts, how far the joining got."""

    def __init__(self, address: str, key: bytes, expected: int,
                 missing: Callable[[], Sequence[str]] | None = None,
                 launched: bool = False) -> None:
        self._address = address
        self._key = key
        self._expected = expected
        self._missing = missing  # the names numbered before they joined, not joined yet
        self._launched = launched  # `colobus launch` started the workers: nothing to run
        self._next = time.monotonic() + FIRST_AFTER_S

    def next_report_in(self) -> float:
        """Seconds until the next progress line is due."""
        return max(0.0, self._next - time.monotonic())

    def report(self, alive: int) -> None:
        """Log the progress line if it is due."""
        if time.monotonic() < self._next:
            return
        self._next = time.monotonic() + EVERY_S
        if self._launched:
            log.warning("waiting for hosts: %d of %d joined %s; the workers `colobus launch` "
                        "started are still starting (%s)", alive, self._expected,
                        self._address, LAUNCHED_LOGS)
            return
        log.warning("waiting for hosts: %d of %d joined %s; on each host run: %s (%s)",
                    alive, self._expected, self._address,
                    worker_command(self._address, self._key), key_words(self._key))

    def timeout_message(self, alive: int, timeout: float) -> str:
        """The text of the ``TimeoutError`` that ends a wait."""
        names = self._missing() if self._missing is not None else ()
        missing = ", ".join(repr(name) for name in names[:20]) + (" ..." if len(names) > 20 else "")
        if self._launched:
            return (f"only {alive} of the {self._expected} workers `colobus launch` started "
                    f"joined {self._address} within {timeout:.0f} s"
                    f"{f'; missing: {missing}' if missing else ''} ({LAUNCHED_LOGS}: they "
                    "say why)")
        path = key_file_of(self._key) if self._key else None
        if path is not None and is_private_key_file(path):
            # The controller's own key file goes when it closes, which this timeout is
            # about to do: point at a key that stays instead of at a file about to vanish.
            return (f"only {alive} of {self._expected} colobus hosts joined {self._address} "
                    f"within {timeout:.0f} s{f'; missing: {missing}' if missing else ''}. "
                    f"This controller was given no key: the key it made ({path}, key id "
                    f"{key_id(self._key)}) is removed as it closes now, so workers cannot "
                    "join with it later. Make a key that stays with `colobus keygen "
                    "colobus.key`, start the controller with key=cb.load_key('colobus.key'), "
                    f"and on each host run `{worker_command(self._address, b'')} "
                    "--key-file colobus.key` (with a copy of that file)")
        return (f"only {alive} of {self._expected} colobus hosts joined {self._address} within "
                f"{timeout:.0f} s{f'; missing: {missing}' if missing else ''}; start workers "
                f"with `{worker_command(self._address, self._key)}` ({key_words(self._key)}; "
                "a worker with another key is never answered and logs 'wrong key or wrong "
                "address?')")


class JoinWaiters:
    """Those waiting for hosts to join (``Controller.wait_for_hosts``), woken per join."""

    def __init__(self) -> None:
        self._waiters: list[asyncio.Future[None]] = []

    def wake(self) -> None:
        for w in self._waiters:
            if not w.done():
                w.set_result(None)
        self._waiters.clear()

    async def wait(self, loop: asyncio.AbstractEventLoop, n: int, alive: Callable[[], int],
                   progress: JoinProgress, timeout: float, check_open: Callable[[], None]
                   ) -> None:
        """Until ``alive() >= n``, with a progress line now and then.

        Raises:
            TimeoutError: fewer joined within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        while alive() < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(progress.timeout_message(alive(), timeout))
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, min(left, progress.next_report_in() + 0.01))
            except TimeoutError:
                progress.report(alive())
            check_open()


class WrongKeys:
    """Workers that try to join with another key than the controller's, named on the
    driver with both key ids: one line per key id they hold (at most ``bound`` ids are
    said; the messages themselves are counted as ``unauthenticated`` in ``stats()``)."""

    def __init__(self, key: bytes, bound: int = 16) -> None:
        self._key = key
        self._said: set[str] = set()
        self._bound = bound

    def note(self, theirs: str) -> None:
        """A JOIN that failed authentication said its worker's key id is ``theirs``."""
        if theirs in self._said or len(self._said) >= self._bound:
            return
        self._said.add(theirs)
        path = key_file_of(self._key)
        log.warning("a worker tries to join with another key: its key id is %s, this "
                    "controller's is %s (%s). Its messages are dropped unread "
                    "(unauthenticated); start it with this controller's key%s", theirs,
                    key_id(self._key), key_words(self._key),
                    f" (colobus worker --key-file {path} ...)" if path else "")
