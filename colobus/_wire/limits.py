"""The wire's limits, in one table that both sides read.

Every message colobus builds stays under what its own receiver accepts, on every
path (star, relay, tree, resends, chunked parts): the sender keeps each limit by
construction (batches and a relay's gathered messages close before it, bodies
past 64 KiB leave the header), and the receiver checks the same constant and drops
what passes it. :data:`TABLE` lists them for ``docs/protocol.md`` (a test checks
that the page states each with this value).

The settings a controller is given (``max_message_bytes``, ``send_window_bytes``,
``max_queued_bytes``) are not here: they are per controller, their defaults beside
their parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BATCH_MAX_BUFFERS",
    "BATCH_MAX_BYTES",
    "BATCH_MAX_ITEMS",
    "BATCH_MAX_PAYLOAD",
    "BODY_INLINE_MAX",
    "CHUNK_BYTES",
    "COUNT_ABOVE",
    "GATHER_MAX_BODY",
    "GATHER_MAX_BUFFERS",
    "GATHER_MAX_BYTES",
    "MAX_BUFFERS",
    "MAX_FRAMES",
    "MAX_FRAME_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_OBJECTS",
    "MAX_PART",
    "TABLE",
    "UNKNOWN_PEER_MAX_BYTES",
    "Limit",
]

# -- what a receiver accepts -------------------------------------------------------------
MAX_FRAMES = 1 << 16  # frames in one envelope (header, payload and MAC included)
MAX_BUFFERS = MAX_FRAMES - 3  # buffers in one message, whole or chunked
MAX_HEADER_BYTES = 1 << 20  # one header; also a worker's body at the head of the payload
MAX_FRAME_BYTES = 1 << 22  # one incoming frame at the controller (ZMQ_MAXMSGSIZE)
MAX_OBJECTS = 1 << 17  # lists and maps in a worker's header or body
COUNT_ABOVE = 1 << 12  # headers and bodies up to this size are not counted (too small)
UNKNOWN_PEER_MAX_BYTES = 1 << 18  # a message from a peer that has not joined

# -- what a sender keeps under them --------------------------------------------------------
BODY_INLINE_MAX = 1 << 16  # a larger body travels at the head of the payload
# The smallest part of a chunked message, and the largest message always sent whole.
CHUNK_BYTES = 1 << 18
# The largest part, and the largest message sent whole where the window allows: under
# MAX_FRAME_BYTES with room for the header.
MAX_PART = MAX_FRAME_BYTES - (1 << 16)
BATCH_MAX_ITEMS = 256  # messages in one BATCH
BATCH_MAX_PAYLOAD = 1 << 18  # a message this large travels alone, never in a batch
BATCH_MAX_BYTES = 1 << 20  # a batch stops short of this (bodies, payloads, buffers)
BATCH_MAX_BUFFERS = 4096  # ... and of this many buffers
# A relay's FORWARD (controller to relay) or UP (relay to controller) gathers many
# hosts' messages; it closes before this many buffers, or this many bytes of payloads
# and buffers, and once its entries' bodies pass GATHER_MAX_BODY (so the body, at most
# this plus one host's body, stays one frame under MAX_FRAME_BYTES). A message over
# a limit on its own travels alone, as it would on the star.
GATHER_MAX_BUFFERS = BATCH_MAX_BUFFERS
GATHER_MAX_BYTES = 1 << 24
GATHER_MAX_BODY = 1 << 20


@dataclass(frozen=True, slots=True)
class Limit:
    """One row of the table: a limit's name, its value, and what it bounds."""

    name: str
    value: int
    bounds: str


TABLE: tuple[Limit, ...] = (
    Limit("MAX_FRAMES", MAX_FRAMES, "frames in one envelope"),
    Limit("MAX_BUFFERS", MAX_BUFFERS, "buffers in one message, whole or in parts"),
    Limit("MAX_HEADER_BYTES", MAX_HEADER_BYTES, "one header; a worker's body"),
    Limit("MAX_FRAME_BYTES", MAX_FRAME_BYTES, "one frame at the controller"),
    Limit("MAX_OBJECTS", MAX_OBJECTS, "lists and maps in a worker's header or body"),
    Limit("UNKNOWN_PEER_MAX_BYTES", UNKNOWN_PEER_MAX_BYTES,
          "a message from a peer that has not joined"),
    Limit("BODY_INLINE_MAX", BODY_INLINE_MAX, "a body inside the header"),
    Limit("CHUNK_BYTES", CHUNK_BYTES, "the smallest part"),
    Limit("MAX_PART", MAX_PART, "the largest part, or message sent whole"),
    Limit("BATCH_MAX_ITEMS", BATCH_MAX_ITEMS, "messages in one BATCH"),
    Limit("BATCH_MAX_PAYLOAD", BATCH_MAX_PAYLOAD, "a message that travels alone"),
    Limit("BATCH_MAX_BYTES", BATCH_MAX_BYTES, "bytes in one BATCH"),
    Limit("BATCH_MAX_BUFFERS", BATCH_MAX_BUFFERS, "buffers in one BATCH"),
    Limit("GATHER_MAX_BUFFERS", GATHER_MAX_BUFFERS, "buffers in one FORWARD or UP"),
    Limit("GATHER_MAX_BYTES", GATHER_MAX_BYTES, "payload and buffer bytes in one FORWARD or UP"),
    Limit("GATHER_MAX_BODY", GATHER_MAX_BODY, "bodies in one FORWARD or UP"),
)
