"""What ``colobus launch`` tells the driver's ``Controller()`` through the environment.

``colobus launch`` starts the workers, then runs the driver with
``COLOBUS_ADDRESS`` (the endpoint to bind), ``COLOBUS_KEY_FILE`` (the key
file's path, never the key), ``COLOBUS_HOSTS`` (how many workers) and
``COLOBUS_HOST_NAMES`` (their names, host 0 first),
``COLOBUS_DEVICES_PER_HOST`` (each worker's ``--devices``) and ``COLOBUS_PY_MODULES``
(``--py-module`` paths, joined by ``os.pathsep``). A ``Controller`` reads each
of them for an argument it was not given; ``local_cluster`` and ``init`` check
theirs against them (:func:`check_launched`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from .._wire import keys as _keys

__all__ = ["ADDRESS_ENV", "DEVICES_ENV", "HOSTS_ENV", "HOST_NAMES_ENV", "PY_MODULES_ENV",
           "check_launched", "from_environment", "from_environment_modules", "join_level",
           "launched_here", "own_workers"]

ADDRESS_ENV = "COLOBUS_ADDRESS"
HOSTS_ENV = "COLOBUS_HOSTS"
HOST_NAMES_ENV = "COLOBUS_HOST_NAMES"
DEVICES_ENV = "COLOBUS_DEVICES_PER_HOST"
PY_MODULES_ENV = "COLOBUS_PY_MODULES"
DEFAULT_BIND = "tcp://127.0.0.1:*"
# Set while a launcher (ssh_cluster, slurm_cluster) makes the controller of the workers it
# starts itself: the address it binds is its own, whatever a surrounding launch says.
_OWN_WORKERS: contextvars.ContextVar[bool] = contextvars.ContextVar("colobus_own_workers",
                                                                    default=False)


@contextlib.contextmanager
def own_workers() -> Iterator[None]:
    """Controllers made inside start workers of their own (a launcher's), so the address
    they bind is theirs even under ``colobus launch``."""
    token = _OWN_WORKERS.set(True)
    try:
        yield
    finally:
        _OWN_WORKERS.reset(token)


def from_environment(bind: str | None, hosts: int | None, key: bytes | None
                     ) -> tuple[str, int, bytes | None, list[str]]:
    """``(bind, hosts, key, names)``: the arguments not given, from the environment.

    ``names`` (the order to number hosts in) is given only with the address: a
    ``bind`` of the caller's own ignores ``$COLOBUS_HOST_NAMES``.

    Raises:
        ValueError: ``$COLOBUS_HOSTS`` is not a whole number, or ``bind`` is not the address
            ``colobus launch`` chose (its workers connect there, never to ``bind``).
        AuthenticationError, OSError: ``$COLOBUS_KEY_FILE`` is not a readable key.
    """
    names: list[str] = []
    launched = os.environ.get(ADDRESS_ENV)
    if bind is not None and launched and bind != launched and not _OWN_WORKERS.get():
        # Else both sides wait until their join timeouts, neither saying why.
        raise ValueError(
            f"cb.Controller(bind={bind!r}) runs under `colobus launch`, whose workers "
            f"connect to the address it chose, {launched!r} ($COLOBUS_ADDRESS): none would "
            f"reach a controller bound to {bind!r}. Under `colobus launch`, leave out bind= "
            "(cb.Controller() binds the launch's address); to bind an address of your own, "
            "run the script without `colobus launch` and start the workers with `colobus "
            "worker --connect ...`")
    if bind is None:
        bind = os.environ.get(ADDRESS_ENV) or DEFAULT_BIND
        if os.environ.get(ADDRESS_ENV):
            names = [n for n in os.environ.get(HOST_NAMES_ENV, "").split(",") if n]
    if hosts is None:
        text = os.environ.get(HOSTS_ENV, "")
        try:
            hosts = int(text) if text else 1
        except ValueError:
            raise ValueError(f"${HOSTS_ENV} is {text!r}, not a number of hosts") from None
    if key is None and os.environ.get(_keys.KEY_ENV):
        key = _keys.load_key(os.environ[_keys.KEY_ENV])  # a path in the environment, never a key
    return bind, hosts, key, names


def launched_here(bind: str) -> bool:
    """Whether a controller bound to ``bind`` serves the workers ``colobus launch`` started
    (it binds the launch's address): its messages then never ask to start workers."""
    return bool(bind) and bind == os.environ.get(ADDRESS_ENV) and not _OWN_WORKERS.get()


def check_launched(caller: str, hosts: int | None, devices_per_host: int | None) -> bool:
    """Whether this process runs under ``colobus launch`` (``$COLOBUS_ADDRESS`` set).

    There ``caller`` (``local_cluster`` or ``init``) serves the script with the
    launched workers; a ``hosts`` or ``devices_per_host`` it was given must be
    the launch's.

    Raises:
        ValueError: an argument contradicts the launch; the message names
            ``colobus launch``.
    """
    if not os.environ.get(ADDRESS_ENV):
        return False
    launched = {"hosts": os.environ.get(HOSTS_ENV, ""),
                "devices_per_host": os.environ.get(DEVICES_ENV, "")}
    given = {"hosts": hosts, "devices_per_host": devices_per_host}
    for name, value in given.items():
        if value is not None and launched[name] and str(value) != launched[name]:
            raise ValueError(
                f"cb.{caller}({name}={value}) contradicts `colobus launch`, which started "
                f"{launched['hosts'] or '?'} worker(s) with "
                f"{launched['devices_per_host'] or '?'} device(s) each: under `colobus "
                f"launch`, cb.{caller}() serves the script with the launched workers. Leave "
                f"out {name}= (or change the launch's --hosts/--devices), or write "
                "cb.Controller() for a script meant only for `colobus launch`")
    return True


def join_level(launched: bool) -> int:
    """The level of the line a controller logs per host as it joins.

    WARNING where the workers were ``launched`` for this driver (``colobus launch``:
    ``$COLOBUS_ADDRESS`` set, or a launcher's cluster) and stderr is a terminal, so
    the line per host that launchers promise shows without logging set up
    (Python's last-resort handler prints warnings); else INFO (a pipe, a log
    file, CI, a local cluster's own workers).
    """
    launched = launched or bool(os.environ.get(ADDRESS_ENV))
    tty = sys.stderr is not None and sys.stderr.isatty()
    return logging.WARNING if launched and tty else logging.INFO


def from_environment_modules(py_modules: Iterable[Any] | None) -> list[Any]:
    """``py_modules``, else the paths ``colobus launch --py-module`` left in the environment."""
    if py_modules is not None:
        return list(py_modules)
    return [p for p in os.environ.get(PY_MODULES_ENV, "").split(os.pathsep) if p]
