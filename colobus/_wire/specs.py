"""A ``PartitionSpec`` on the wire: msgpack entries None, str, or a list of str."""

from __future__ import annotations

from typing import Any

__all__ = ["decode_spec", "encode_spec"]


def encode_spec(spec: Any) -> list[Any]:
    """A ``PartitionSpec`` as msgpack: entries None, str, or list of str."""
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def decode_spec(raw: Any) -> Any:
    """The ``PartitionSpec`` :func:`encode_spec` wrote; ``ValueError`` if malformed."""
    from jax.sharding import PartitionSpec

    if not isinstance(raw, list):
        raise ValueError("bad partition spec")
    entries: list[Any] = []
    for e in raw:
        if e is None or isinstance(e, str):
            entries.append(e)
        elif isinstance(e, list) and all(isinstance(x, str) for x in e):
            entries.append(tuple(e))
        else:
            raise ValueError("bad partition spec entry")
    return PartitionSpec(*entries)
