"""Every message kind and its typed body, in one place.

A body travels as a msgpack array of its fields in declaration order.
:func:`parse` turns an authenticated envelope's body into the dataclass of its
kind, checking field types, or raises ``ValueError`` (counted as malformed).
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .outleaf import MAX_OUTPUTS, OutLeaf, output_ref
from .specs import decode_spec, encode_spec

__all__ = [
    "BODIES", "Body", "Call", "Cancel", "Challenge", "Code", "Construct", "Coord", "Destroy",
    "Fetch", "Form", "Heartbeat", "Hello", "Import", "Join", "Kind", "MAX_OUTPUTS", "Module",
    "OutLeaf", "Piece", "Put", "Reject", "Release", "Reset", "Reshard", "Result", "Shutdown",
    "Stats", "Status", "TOKEN_BYTES", "TREE_CHUNK_BYTES", "TreePut", "Welcome",
    "chunk_digests", "decode_spec", "encode_spec", "output_ref", "parse",
]


class Kind(enum.IntEnum):
    """Message kinds. W: worker to controller; C: controller to worker."""

    HELLO = 1  # W: join request
    WELCOME = 2  # C: join accepted, host index and device ids
    REJECT = 3  # C: join refused (protocol version, cluster full, name in use)
    HEARTBEAT = 4  # both: liveness, and the worker's store counters
    CODE = 5  # C: a pickled function or class, or a package's files, named by digest
    CALL = 6  # C: run a function or method on this host
    RESULT = 7  # W: the outcome of a CALL, FETCH, CONSTRUCT or STATS
    CANCEL = 8  # C: drop a call that has not started
    PUT = 9  # C: store a host block of an array
    FETCH = 10  # C: send back a stored host block
    RELEASE = 11  # C: free arrays, call results
    CONSTRUCT = 12  # C: build an object (deferred)
    DESTROY = 13  # C: drop an object after its pending calls
    STATS = 14  # C: report store counters now
    SHUTDOWN = 15  # C: the controller is closing
    RESET = 16  # C: you were declared lost; join again
    BATCH = 17  # both: several of the above to one peer, in order, in one envelope
    JOIN = 18  # W: ask for a join challenge (first message of a session)
    CHALLENGE = 19  # C: a fresh nonce the worker's HELLO must carry
    CHUNKED = 20  # both: the head of a large message sent in parts (_chunks)
    PART = 21  # both: the next bytes of that message
    ACK = 22  # both: acknowledgement only, outside the numbering (sequence number 0)
    RESHARD = 23  # C: build a block of a resharded array from local pieces and PIECEs
    PIECE = 24  # C: one piece of a RESHARD's block, or the RESHARD abandoned
    TREEPUT = 25  # C: store a block that arrives here or from another host (broadcast tree)
    # Between the controller and its relays only (colobus._wire.relaywire):
    ADOPT = 26  # C: a host joined that you carry from now on
    FORWARD = 27  # C: messages to send to hosts you carry
    UP = 28  # R: messages your hosts sent, authenticated, same replies coalesced
    GONE = 29  # both: a host the relay no longer carries (lost, or it broke the protocol)
    READY = 30  # R: the relay is up, hosts connect to this endpoint
    DELIVERED = 31  # R: the bytes your hosts acknowledged (upload back-pressure)
    OFFER = 32  # R: a relay that connected offers to carry hosts (after a CHALLENGE)
    SETUP = 33  # C: the offer is taken: the settings the relay carries hosts with
    FORM = 40  # C: join the cluster's JAX job (jax_distributed); answered with a RESULT
    COORD = 41  # both: bytes of one connection to the JAX job's coordination service
    IMPORT = 42  # W: host code imports a module this host lacks (the controller may have it)
    MODULE = 43  # C: the answer to an IMPORT: its package went first as a CODE, or why not


class Status(enum.IntEnum):
    """Outcome carried by a RESULT."""

    OK = 0
    ERROR = 1
    CANCELLED = 2


class Body:
    """Base of the typed bodies: ``to_wire`` and a checked ``from_wire``."""

    kind: ClassVar[Kind]
    types: ClassVar[tuple[type | tuple[type, ...], ...]]
    required: ClassVar[int | None] = None  # fields a body must carry (None: all of them)

    def to_wire(self) -> list[Any]:
        return list(map(self.__getattribute__, self.__slots__))  # type: ignore[attr-defined]

    @classmethod
    def from_wire(cls, raw: Any) -> Body:
        most = len(cls.types)
        least = most if cls.required is None else cls.required
        if not isinstance(raw, list) or not least <= len(raw) <= most:
            raise ValueError(f"{cls.kind.name}: expected {most} fields")
        if not all(map(isinstance, raw, cls.types)):  # (in C; the loop only to say which)
            for value, typ in zip(raw, cls.types, strict=False):
                if not isinstance(value, typ):
                    raise ValueError(f"{cls.kind.name}: bad field {value!r:.40}")
        return cls(*raw)


_num = (int, float)


@dataclass(frozen=True, slots=True)
class Hello(Body):
    kind = Kind.HELLO
    types = (str, int, str, list, bytes, str, dict)
    required = 5
    name: str
    pid: int
    hostname: str
    devices: list[Any]  # [[platform, device_kind, local_id], ...]
    nonce: bytes  # the controller's CHALLENGE to this session, inside the MAC
    data: str = ""  # the worker's data-plane endpoint ("": none; _host/dataplane)
    versions: dict[str, str] = field(default_factory=dict)  # Python's and packages' (_versions)


@dataclass(frozen=True, slots=True)
class Welcome(Body):
    kind = Kind.WELCOME
    types = (int, list, _num, _num, bool, int, bool, int, str, bool)
    required = 6
    host: int
    device_ids: list[int]
    heartbeat: float
    liveness: float
    exit_with_controller: bool
    max_message_bytes: int  # the controller drops larger messages; replies stay under it
    host_stats: bool = False  # count calls' queued and run times; send them in heartbeats
    host_count: int = 0  # the cluster's host count (cb.host_count() in host code)
    relay: str = ""  # the relay to move this session to ("tcp://*:PORT": the controller's host)
    jax_job: bool = False  # the hosts form one JAX job (a FORM comes once all joined)


@dataclass(frozen=True, slots=True)
class Join(Body):
    kind = Kind.JOIN
    types = ()


@dataclass(frozen=True, slots=True)
class Challenge(Body):
    kind = Kind.CHALLENGE
    types = (bytes,)
    nonce: bytes


@dataclass(frozen=True, slots=True)
class Reject(Body):
    """A join refused. ``retry``: it may pass (the name is in use): join again with back-off;
    else exit non-zero, but ``full`` (a new name, the cluster full): a long-running worker waits."""

    kind = Kind.REJECT
    types = (str, bool, bool)
    required = 1
    reason: str
    retry: bool = False
    full: bool = False

    def to_wire(self) -> list[Any]:  # a final refusal keeps its one-field form
        return ([self.reason, self.retry, True] if self.full else
                [self.reason, True] if self.retry else [self.reason])


@dataclass(frozen=True, slots=True)
class Heartbeat(Body):
    """Liveness, both ways, and a worker's health.

    The controller's carries ``ping`` (its own clock, ns). A worker's echoes the
    last ping it got and ``held``, the ns between receiving that ping and sending
    this, so the controller reads the round trip without a message of its own.
    The other fields are the worker's: what its store holds, its process's
    resident memory and CPU time, the messages it dropped, by reason, and, when
    the WELCOME asked for them, how long its calls waited and ran since its last
    heartbeat, bucketed per function (``calls``, :mod:`colobus._wire.calltimes`).
    """

    kind = Kind.HEARTBEAT
    types = (int, int, int, int, int, int, int, int, dict, list, int, int, int, int)
    required = 4
    arrays: int
    nbytes: int
    objects: int
    results: int  # call results kept for futures still alive on the controller
    ping: int = 0
    held: int = 0
    rss: int = 0  # bytes
    cpu: int = 0  # ns of CPU time, user + system
    dropped: dict[str, int] = field(default_factory=dict)
    calls: list[Any] = field(default_factory=list)
    threads: int = 0  # threads of its call pool
    stuck: int = 0  # of them, busy with calls of an ended session
    code: int = 0  # functions and classes it holds (pickled code received)
    code_bytes: int = 0  # their pickled size


@dataclass(frozen=True, slots=True)
class Code(Body):
    kind = Kind.CODE
    types = (bytes, str, bool)
    required = 1
    digest: bytes
    name: str = ""  # the function's or class's module.qualname, or the package's import name
    package: bool = False  # the payload: a zip of the user's package (_controller.codeship)


@dataclass(frozen=True, slots=True)
class Call(Body):
    """Run ``digest`` (or method ``method`` of object ``obj``) on this host.

    ``refs`` lists the persistent ids of the pickled arguments: ``[tag, id]``
    with tag 0 an array ref, 1 a call's result tree, 2 an object (in a JAX job, ``[0, id,
    layout]``: ``colobus._api.joblayout``). ``mesh``: this host's part of the call's mesh.
    ``spread``: on several hosts (in a JAX job such calls start on every host in the
    order they arrive: ``colobus._host.sched``); both it and ``check`` left off where
    false, so a one-host call's body keeps its eight fields (the lanes splice those).
    """

    kind = Kind.CALL
    types = (int, int, bytes, int, str, list, list, int, bool, int)
    required = 7
    call_id: int
    stream: int
    digest: bytes
    obj: int
    method: str
    refs: list[Any]
    mesh: list[Any]
    hosts: int = 0  # the cluster's host count now (cb.host_count() in host code)
    spread: bool = False
    check: int = 0  # 1: hash replicated outputs, to compare replicas (check_replicas=True)

    def to_wire(self) -> list[Any]:
        out = [self.call_id, self.stream, self.digest, self.obj, self.method, self.refs,
               self.mesh, self.hosts]
        if self.spread or self.check:
            out.append(self.spread)
            if self.check:
                out.append(self.check)
        return out


@dataclass(frozen=True, slots=True)
class Result(Body):
    """The outcome of a request. ``times``: for a CALL that ran, ``[queued, ran]``,
    the ns it waited on the host (arrival to start) and the ns it ran, then for one that
    succeeded 1 if every output was computed when it answered (JAX's ``is_ready``), else
    0; else empty."""

    kind = Kind.RESULT
    types = (int, int, object, list)
    required = 3
    call_id: int
    status: int
    meta: Any
    times: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Cancel(Body):
    kind = Kind.CANCEL
    types = (int,)
    call_id: int


@dataclass(frozen=True, slots=True)
class Put(Body):
    """Store buffer 0 as array ``ref``: ``[local ids, shape, axis names]`` and spec."""

    kind = Kind.PUT
    types = (int, list, object, list, list, object, (str, type(None)))
    required = 6
    ref: int
    shape: list[int]
    dtype: Any
    mesh: list[Any]
    spec: list[Any]
    key_impl: Any  # None, or the PRNG impl name of a typed key array
    memory_kind: str | None = None  # of the host's JAX sharding (None: the default)


@dataclass(frozen=True, slots=True)
class Fetch(Body):
    kind = Kind.FETCH
    types = (int, int, int, list, list)
    required = 3
    call_id: int
    ref: int
    data: int  # what to answer when: a FETCH_ below (True: FETCH_DATA); see docs/protocol.md
    box: list[Any] = field(default_factory=list)  # [[start, stop], ...]: only that box
    # [platform, local id] of one device: its own buffer of the value (its shard, where
    # a JAX array keeps one per device), else the box of the block
    device: list[Any] = field(default_factory=list)

    def to_wire(self) -> list[Any]:
        out = [self.call_id, self.ref, self.data, self.box]
        if self.device:
            out.append(self.device)
        return out

FETCH_WAIT, FETCH_DATA, FETCH_PROBE, FETCH_CALL = 0, 1, 2, 3  # computed; data; now?; a call's

@dataclass(frozen=True, slots=True)
class Reshard(Body):
    """Build array ``ref``'s block on this host (``shape``, ``dtype``, laid out on
    ``mesh`` with ``spec`` and ``memory_kind``) from ``local`` boxes of arrays the host
    holds (``[[src ref, box in it, box in the block], ...]``) and ``pieces`` PIECE
    messages; answer once it is stored. ``holds`` (``[[src ref, hold ref], ...]``)
    keeps source entries under another ref for the reshard's FETCHes, so a release
    of the source after this message cannot break the move. ``ref`` 0: this host
    only lends (it answers at once). Boxes are ``[[start, stop], ...]``."""

    kind = Kind.RESHARD
    types = (int, int, list, object, list, list, object, (str, type(None)), list, int, list)
    call_id: int
    ref: int
    shape: list[int]
    dtype: Any  # None for a typed key array: the pieces' key data tell
    mesh: list[Any]
    spec: list[Any]
    key_impl: Any
    memory_kind: str | None
    local: list[Any]
    pieces: int
    holds: list[Any]


@dataclass(frozen=True, slots=True)
class Piece(Body):
    """Buffer 0 (``shape`` and ``dtype`` as a FETCH reply has them) goes into ``box``
    of RESHARD block ``ref``; answer once it is taken. With ``error`` set (and no
    buffer): the reshard failed; drop the block, and fail what waits for it with
    that text (a ``HostLostError`` where ``lost``: a host was lost, else a
    ``RuntimeError``)."""

    kind = Kind.PIECE
    types = (int, int, list, list, object, str, bool)
    required = 5
    call_id: int
    ref: int
    box: list[Any]
    shape: list[int]
    dtype: Any
    error: str = ""
    lost: bool = False


@dataclass(frozen=True, slots=True)
class TreePut(Body):
    """Store array ``ref`` as a PUT would (``shape`` .. ``memory_kind``); its
    ``nbytes`` come as buffer 0, or (``source`` ``[endpoint, token]``) from another
    host's data plane in chunks of ``chunk`` bytes, each checked against its SHA-256
    in ``digests``. Serve them on to whoever asks with a token in ``serve``. Answer
    once stored. A second TREEPUT of the same ``ref`` with buffer 0 (the source
    host was lost) completes it from that buffer; after the block is stored it is
    ignored. A RELEASE of ``call_id`` ends the serving."""

    kind = Kind.TREEPUT
    types = (int, int, list, object, list, list, object, (str, type(None)), int, int, list,
             list, list)
    call_id: int
    ref: int
    shape: list[int]
    dtype: Any
    mesh: list[Any]
    spec: list[Any]
    key_impl: Any
    memory_kind: str | None
    nbytes: int
    chunk: int
    digests: list[bytes]
    source: list[Any]  # [] (buffer 0 attached) or [endpoint, token]
    serve: list[bytes]  # tokens of the hosts this one serves


TREE_CHUNK_BYTES = 1 << 22  # a TREEPUT's chunk: one data-plane request, reply and digest
TOKEN_BYTES = 16  # of a data-plane token


def chunk_digests(buf: memoryview, chunk: int) -> list[bytes]:
    """The SHA-256 of each ``chunk``-byte piece of ``buf`` (hashlib lets go of the GIL)."""
    return [hashlib.sha256(buf[i:i + chunk]).digest() for i in range(0, max(len(buf), 1), chunk)]


@dataclass(frozen=True, slots=True)
class Release(Body):
    kind = Kind.RELEASE
    types = (list, list, list)
    required = 2
    refs: list[int]
    calls: list[int]
    code: list[bytes] = field(default_factory=list)  # digests of code nobody calls any more


@dataclass(frozen=True, slots=True)
class Construct(Body):
    kind = Kind.CONSTRUCT
    types = (int, bytes, list)
    obj: int
    digest: bytes
    refs: list[Any]


@dataclass(frozen=True, slots=True)
class Destroy(Body):
    """Drop an object: in ``stream`` (after its earlier calls, before its later
    ones), once every call of the object already received has finished."""

    kind = Kind.DESTROY
    types = (int, int)
    obj: int
    stream: int


@dataclass(frozen=True, slots=True)
class Stats(Body):
    kind = Kind.STATS
    types = (int,)
    call_id: int


@dataclass(frozen=True, slots=True)
class Shutdown(Body):
    kind = Kind.SHUTDOWN
    types = (str,)
    reason: str


@dataclass(frozen=True, slots=True)
class Form(Body):
    """Join the JAX job of ``coordinator`` (``*:PORT``: at the controller's address) as
    process (host index) of ``processes``; ``devices``: every host's device ids, host 0
    first. The RESULT carries the host's JAX device ids in the job (``_host.jaxjob``)."""

    kind = Kind.FORM
    types = (int, int, str, int, list, _num)
    call_id: int
    generation: int
    coordinator: str
    processes: int
    devices: list[list[int]]
    timeout: float


@dataclass(frozen=True, slots=True)
class Coord(Body):
    """The payload's bytes on connection ``conn`` of a host's JAX client to the job's
    coordination service (``end``: that side closed it); ``generation``: the job's."""

    kind = Kind.COORD
    types = (int, int, bool)
    generation: int
    conn: int
    end: bool


@dataclass(frozen=True, slots=True)
class Reset(Body):
    """The controller's last word to a lost session: rejoin, or (``RESET_EXIT``) exit."""

    kind = Kind.RESET
    types = (str,)
    reason: str


RESET_REJOIN = "declared lost; join again"
RESET_EXIT = "exit"  # its process was seen to end (a launcher): it exits, never rejoins


@dataclass(frozen=True, slots=True)
class Import(Body):
    kind = Kind.IMPORT
    types = (str,)
    name: str  # the top-level module host code imports (_host/fetched.py)


@dataclass(frozen=True, slots=True)
class Module(Body):
    kind = Kind.MODULE
    types = (str, str, str)
    name: str  # as the IMPORT asked
    package: str  # the package whose CODE went just before ("": none)
    why: str = ""  # why none: what the host's error says (_controller/imports.py)


BODIES: dict[Kind, type[Body]] = {cls.kind: cls for cls in (
    Hello, Welcome, Reject, Join, Challenge, Heartbeat, Code, Call, Result, Cancel, Put, Fetch,
    Release, Construct, Destroy, Stats, Shutdown, Reset, Reshard, Piece, TreePut, Form, Coord,
    Import, Module,
)}

_BY_INT: dict[int, type[Body]] = {int(k): v for k, v in BODIES.items()}  # by wire int


def parse(kind: int, raw: Any) -> Body:
    """The typed body of an authenticated envelope; ``ValueError`` if malformed."""
    cls = _BY_INT.get(kind)
    if cls is None:
        raise ValueError(f"unknown message kind {kind}")
    return cls.from_wire(raw)
