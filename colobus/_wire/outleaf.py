"""A call's output leaves as a host reports them, and the refs hosts store them under.

Part of the protocol (re-exported by :mod:`colobus._wire.protocol`), apart from the
message bodies: it describes what a RESULT's reply description carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_OUTPUTS", "OutLeaf", "output_ref"]


@dataclass(frozen=True, slots=True)
class OutLeaf:
    """One output leaf of a call, as a host reports it (see ``_describe``).

    The host keeps the value under array ref ``(call_id << 16) | index``.
    ``spec`` is the ``PartitionSpec`` when the leaf is sharded over the host's
    part of the call's mesh, else None (replicated over the host's devices).
    ``layout``, ``digest`` and ``ref`` are described in ``_outlayout``.
    """

    index: int
    shape: tuple[int, ...]
    dtype: Any
    spec: Any
    key_impl: str | None
    # The function's own layout where the host kept it (see ``_outlayout``): plain
    # ints, strings and lists only, so it ports to a msgpack description as is.
    layout: list[Any] | None = None
    digest: bytes | None = None  # of a small output's bytes, to compare replicas
    ref: int = -1  # the argument (refs position) whose sharding object the output carries
    memory_kind: str | None = None  # where not the devices' default ("device")


MAX_OUTPUTS = 1 << 16


def output_ref(call_id: int, index: int) -> int:
    """The array ref under which a host stores output leaf ``index`` of ``call_id``."""
    return (call_id << 16) | index
