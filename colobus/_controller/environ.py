"""What ``colobus launch`` tells the driver's ``Controller()`` through the environment.

``colobus launch`` starts the workers, then runs the driver with
``COLOBUS_ADDRESS`` (the endpoint to bind), ``COLOBUS_KEY_FILE`` (the key
file's path, never the key), ``COLOBUS_HOSTS`` (how many workers) and
``COLOBUS_HOST_NAMES`` (their names, host 0 first), and ``COLOBUS_PY_MODULES``
(``--py-module`` paths, joined by ``os.pathsep``). A ``Controller`` reads each
of them for an argument it was not given.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from .._wire import keys as _keys

__all__ = ["ADDRESS_ENV", "HOSTS_ENV", "HOST_NAMES_ENV", "PY_MODULES_ENV", "from_environment",
           "from_environment_modules"]

ADDRESS_ENV = "COLOBUS_ADDRESS"
HOSTS_ENV = "COLOBUS_HOSTS"
HOST_NAMES_ENV = "COLOBUS_HOST_NAMES"
PY_MODULES_ENV = "COLOBUS_PY_MODULES"
DEFAULT_BIND = "tcp://127.0.0.1:*"


def from_environment(bind: str | None, hosts: int | None, key: bytes | None
                     ) -> tuple[str, int, bytes | None, list[str]]:
    """``(bind, hosts, key, names)``: the arguments not given, from the environment.

    ``names`` (the order to number hosts in) is given only with the address: a
    ``bind`` of the caller's own ignores ``$COLOBUS_HOST_NAMES``.

    Raises:
        ValueError: ``$COLOBUS_HOSTS`` is not a whole number.
        AuthenticationError, OSError: ``$COLOBUS_KEY_FILE`` is not a readable key.
    """
    names: list[str] = []
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


def from_environment_modules(py_modules: Iterable[Any] | None) -> list[Any]:
    """``py_modules``, else the paths ``colobus launch --py-module`` left in the environment."""
    if py_modules is not None:
        return list(py_modules)
    return [p for p in os.environ.get(PY_MODULES_ENV, "").split(os.pathsep) if p]
