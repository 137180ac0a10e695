"""Another test module's tests, run again with every controller they start using a relay.

``tests/test_relayed_*.py`` each take one semantics module (ordering, cancellation,
frees, host loss, endings, back-pressure) with :func:`take`: its tests and fixtures
run there once more, with ``COLOBUS_RELAYS=1`` set for the module, so every
``Controller`` (``local_cluster``'s too) starts one relay and every host's session
moves to it. The same assertions then hold through a relay as without one.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(autouse=True, scope="module")
def _through_a_relay() -> Iterator[None]:
    old = os.environ.get("COLOBUS_RELAYS")
    os.environ["COLOBUS_RELAYS"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("COLOBUS_RELAYS", None)
        else:
            os.environ["COLOBUS_RELAYS"] = old


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """The shared cluster of ``tests/conftest.py``, for this module, through a relay."""
    import colobus as cb

    with cb.local_cluster(hosts=2, devices_per_host=4, relays=1, jax_distributed=False) as ctl:
        yield ctl


def take(into: dict[str, Any], name: str) -> None:
    """Put module ``name``'s tests and fixtures (all its names) into ``into``."""
    mod = importlib.import_module(name)
    for k, v in vars(mod).items():
        if not k.startswith("__") and k not in into:
            into[k] = v
    into["_through_a_relay"] = _through_a_relay
    into["cluster"] = cluster  # this module's, not the session's star
