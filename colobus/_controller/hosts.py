"""The controller's host registry: who joined, under which index, with which devices.

Hosts are numbered in join order, or by name where the cluster started the
workers itself (:meth:`HostRegistry.reserve`: each name's number is set before
any joins, so no join waits for another). A worker that joins again under the
same name gets its old index and device ids back, with a new *generation*:
handles made before remember the generation they saw, so data of the old
session is known to be gone. Everything here runs on the controller's loop thread.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._errors import HostLostError
from .._model.devices import Device
from .._wire import protocol as P
from .._wire.channel import Peer
from .._wire.guard import shown

__all__ = ["Host", "HostInfo", "HostRegistry", "host_mask"]

log = logging.getLogger("colobus.controller")

DEAD_SESSIONS_MAX = 4096  # sessions of lost hosts remembered (to answer them RESET)


_masks: dict[tuple[int, ...], int] = {}


def host_mask(indices: tuple[int, ...]) -> int:
    """The bit mask of these host indices (cached: a fan-out names the same hosts on
    every call, and a mask of a thousand bits costs a thousand big-int steps)."""
    if len(indices) == 1 and indices[0] >= 0:  # a call to one host: no cache, no bytes
        return 1 << indices[0]
    mask = _masks.get(indices)
    if mask is None:
        if len(indices) > 32:  # set in numpy: no Python step per host
            at = np.fromiter(indices, dtype=np.intp, count=len(indices))
            if at.min() < 0:
                raise ValueError(f"host indices are >= 0, got {at.min()}")
            flags = np.zeros(int(at.max()) + 1, dtype=bool)
            flags[at] = True
            mask = int.from_bytes(np.packbits(flags, bitorder="little").tobytes(), "little")
            if len(_masks) >= 256:
                _masks.clear()
            _masks[indices] = mask
            return mask
        if indices and min(indices) < 0:
            raise ValueError(f"host indices are >= 0, got {min(indices)}")
        bits = bytearray((max(indices, default=0) >> 3) + 1)
        for i in indices:
            bits[i >> 3] |= 1 << (i & 7)
        mask = int.from_bytes(bits, "little")
        if len(indices) > 4:  # (small masks are cheap to make)
            if len(_masks) >= 256:
                _masks.clear()
            _masks[indices] = mask
    return mask


@dataclass(frozen=True, slots=True)
class HostInfo:
    """What the controller knows of one host.

    Attributes:
        index: host index (== ``Device.host`` == process index), in join order.
        name: the worker's ``--name`` (stable across rejoins).
        address: the worker's host name as it reported it.
        pid: the worker process id.
        devices: the host's devices, sorted by id.
        state: ``"alive"``, ``"lost"``, or ``"joining"`` (a host the cluster
            numbered by name that has not joined yet).
        versions: what the worker reported at join: ``python``, ``colobus``, ``jax``,
            ``jaxlib``, ``numpy`` and ``cloudpickle`` versions (``""``: not installed).
    """

    index: int
    name: str
    address: str
    pid: int
    devices: tuple[Device, ...]
    state: str
    versions: dict[str, str] = field(default_factory=dict, compare=False)


@dataclass(slots=True, eq=False)
class Host:
    """One joined worker, as the controller tracks it."""

    index: int
    name: str
    identity: bytes
    pid: int
    address: str
    devices: tuple[Device, ...]
    peer: Peer
    alive: bool = True
    last_seen: float = 0.0
    inflight: set[int] = field(default_factory=set)  # operations waiting for this host
    # Operations sent here whose reply has not come: a RESULT for any other call id
    # is a protocol violation (an operation that ended early still gets its reply).
    awaiting: set[int] = field(default_factory=set)
    code_sent: set[bytes] = field(default_factory=set)
    packages_sent: set[bytes] = field(default_factory=set)  # the user's packages (codeship)
    imports_asked: int = 0  # modules its host code imported and asked for (imports.py)
    objects_built: set[int] = field(default_factory=set)
    # what the worker last reported holding: arrays, bytes, objects, results
    store: tuple[int, int, int, int] = (0, 0, 0, 0)
    health: P.Heartbeat | None = None  # the worker's last heartbeat
    rtt: float | None = None  # the last heartbeat round trip, seconds
    # bumps on every (re)join; handles remember the one they saw (-1: numbered, not joined)
    generation: int = 0
    conn_fd: int = -1  # the connection it was last heard on (see _hangups)
    hung_up: float = 0.0  # when that connection closed, until it is heard from again
    data: str = ""  # its data-plane endpoint (colobus._host.dataplane), "" if none
    versions: dict[str, str] = field(default_factory=dict)  # as it reported them at join

    @property
    def session(self) -> bytes:
        return self.peer.their_session

    @property
    def joined(self) -> bool:
        """False for a number reserved under a name whose worker has not joined yet."""
        return self.generation >= 0

    def info(self) -> HostInfo:
        return HostInfo(self.index, self.name, self.address, self.pid, self.devices,
                        "alive" if self.alive else "lost" if self.joined else "joining",
                        dict(self.versions))

    def lost_error(self, why: str) -> HostLostError:
        return HostLostError(f"Host {self.index} ({self.name!r}) was lost: {why}", self.index)


def _data_endpoint(text: str) -> bool:
    return len(text) <= 512 and text.startswith(("tcp://", "ipc://"))


def _gone(what: str) -> str:
    return f"its {what} {'are' if what == 'devices' else 'is'} gone"


class HostRegistry:
    """Hosts by index, by routing identity and by name; device ids; lost sessions."""

    def __init__(self) -> None:
        self.hosts: list[Host] = []
        self.by_identity: dict[bytes, Host] = {}
        self.by_name: dict[str, Host] = {}
        # sessions of lost hosts (-> the RESET reason their worker gets), oldest first: bounded
        self.dead_sessions: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self._next_device_id = 0
        self._device_ids: set[int] = set()  # every id given out
        # Bumped whenever a host joins, rejoins or is lost: what a fan-out worked out per
        # host (generations, who is alive, which relay carries whom) holds while it holds.
        self.changes = 0
        self.alive_mask = 0  # the alive hosts' bits
        self._gens: dict[int, tuple[tuple[int, ...], int, dict[int, int]]] = {}
        # per fan-out (plan, code digest): what _CallOp.send worked out, and under which
        # changes (a release of the code drops it: serialization._forget_code)
        self.fanouts: dict[Any, tuple[Any, int, Any]] = {}

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __len__(self) -> int:
        return len(self.hosts)

    def alive(self) -> list[Host]:
        return [h for h in self.hosts if h.alive]

    def alive_count(self) -> int:
        return sum(1 for h in self.hosts if h.alive)

    def generations(self, hosts: tuple[int, ...]) -> tuple[int, dict[int, int]]:
        """``changes`` now and each of ``hosts``' generation (the dict is shared: do not
        change it); any thread (a stale answer is caught where the call is sent)."""
        changes = self.changes
        hit = self._gens.get(id(hosts))
        if hit is not None and hit[0] is hosts and hit[1] == changes:
            return changes, hit[2]
        known = self.hosts
        gens = {h: known[h].generation for h in hosts}
        # (the entry holds ``hosts``: its id stays its own; a plan's tuple is made once)
        if len(self._gens) >= 256:
            self._gens.clear()
        self._gens[id(hosts)] = (hosts, changes, gens)
        return changes, gens

    def devices(self) -> list[Device]:
        return sorted(d for h in self.hosts if h.alive for d in h.devices)

    def check(self, hosts: Any, generations: dict[int, int] | None = None,
              what: str = "data") -> None:
        """Raise ``HostLostError`` if a host is lost (or rejoined since ``generations``)."""
        for i in hosts:
            h = self.hosts[i]
            if not h.alive:
                raise h.lost_error(_gone(what))
            if generations is not None and generations.get(i, h.generation) != h.generation:
                raise h.lost_error(f"it rejoined since, and {_gone(what)}")

    def join(self, identity: bytes, hello: P.Hello, their_session: bytes, our_session: bytes,
             seq: int) -> Host:
        """Register a worker's HELLO: a new host, or the next generation of a named one
        (which the caller declared lost first)."""
        devices_raw = hello.devices
        if not all(isinstance(d, list) and len(d) == 3 for d in devices_raw):
            raise ValueError("bad device list")
        old = self.by_name.get(hello.name)
        if old is not None:
            index = old.index
            ids = [d.id for d in old.devices]
            if not old.joined:
                ids = self._slot_device_ids(index, len(devices_raw))
            elif len(ids) != len(devices_raw):
                ids = self._new_device_ids(len(devices_raw))
            generation = old.generation + 1
        else:
            index = len(self.hosts)
            ids = self._new_device_ids(len(devices_raw))
            generation = 0
        devices = tuple(
            Device(id=gid, host=index, platform=str(p), device_kind=str(k), local_id=int(lid))
            for gid, (p, k, lid) in zip(ids, devices_raw, strict=True)
        )
        host = Host(
            index=index, name=hello.name, identity=identity, pid=hello.pid,
            address=hello.hostname, devices=tuple(sorted(devices)),
            peer=Peer([identity], our_session, their_session, recv_seq=seq),
            last_seen=time.monotonic(), generation=generation,
            data=hello.data if _data_endpoint(hello.data) else "",
            versions=dict(hello.versions),
        )
        if old is not None:
            self.hosts[index] = host
        else:
            self.hosts.append(host)
        self.changes += 1
        self.alive_mask |= 1 << index
        self.by_name[hello.name] = host
        self.by_identity[identity] = host
        return host

    def reserve(self, names: Sequence[str]) -> None:
        """Number these names 0, 1, ... (after any host already known) before they join.

        Each gets a host that is not alive and not joined (``"joining"``): its
        worker's HELLO takes that number whenever it comes, so a slow host holds up
        no other. Names already known keep theirs.
        """
        for name in names:
            if name not in self.by_name:
                host = Host(index=len(self.hosts), name=name, identity=b"", pid=0, address="",
                            devices=(), peer=Peer([], b"", b""), alive=False, generation=-1)
                self.hosts.append(host)
                self.by_name[name] = host

    def missing_names(self) -> list[str]:
        """The names numbered by :meth:`reserve` whose worker has not joined yet."""
        return [h.name for h in self.hosts if not h.joined]

    def _slot_device_ids(self, index: int, n: int) -> list[int]:
        """Device ids for the first join of a reserved number: those it would have had if
        the hosts before it had joined first (all of them joined, or each with ``n``
        devices, as in a cluster of one kind of host), unless taken."""
        before = self.hosts[:index]
        if all(h.joined for h in before):
            base = sum(len(h.devices) for h in before)
        else:
            base = index * n
        ids = list(range(base, base + n))
        if self._device_ids.intersection(ids):
            return self._new_device_ids(n)
        self._device_ids.update(ids)
        self._next_device_id = max(self._next_device_id, base + n)
        return ids

    def taken(self, ids: Sequence[int]) -> None:
        """Device ids given out otherwise (a JAX job's, ``jobview.renumber``): never again."""
        self._device_ids.update(ids)
        self._next_device_id = max(self._next_device_id, max(ids, default=-1) + 1)

    def _new_device_ids(self, n: int) -> list[int]:
        ids = list(range(self._next_device_id, self._next_device_id + n))
        self._next_device_id += n
        self._device_ids.update(ids)
        return ids

    def mark_lost(self, host: Host, last_word: str = P.RESET_REJOIN) -> bool:
        """Take a host out of service; False if it already was.

        ``last_word`` is the RESET reason its worker gets if it speaks again:
        ``P.RESET_REJOIN`` (join again) or ``P.RESET_EXIT`` (its process was seen
        to end: whatever still talks under that session exits, never rejoins).
        """
        if not host.alive:
            return False
        # Its queues go first: a thread that sees it lost (``ctl.hosts()``) sees them empty.
        host.peer.forget()
        host.alive = False
        self.changes += 1
        self.alive_mask &= ~(1 << host.index)
        self.dead_sessions[host.session] = last_word
        while len(self.dead_sessions) > DEAD_SESSIONS_MAX:
            self.dead_sessions.popitem(last=False)
        if self.by_identity.get(host.identity) is host:
            del self.by_identity[host.identity]
        return True

    def describe(self, host: Host, rejoined: bool, expected: int) -> str:
        kinds = collections.Counter(d.platform for d in host.devices)
        # (the worker's strings shown quoted where not plain: it cannot forge a line)
        return (f"host {host.index} {'rejoined' if rejoined else 'joined'}: {host.name!r} "
                f"(pid {host.pid} on {shown(host.address)}) with "
                f"{', '.join(f'{n} {shown(p)}' for p, n in sorted(kinds.items())) or 'no devices'} "
                f"[{self.alive_count()}/{expected} alive]")
