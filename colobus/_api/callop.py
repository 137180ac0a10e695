"""One colocated call in flight: its CALLs sent (one per host, a fan-out's spliced
from bytes packed once) and its outputs built from the hosts' replies."""

from __future__ import annotations

from typing import Any

from .._controller.coalesced import HOST_BLIND
from .._controller.controller import Controller
from .._controller.hosts import Host
from .._controller.resultlane import SETTLERS
from .._wire import protocol as P
from .._wire.describe import read_outputs
from .._wire.envelope import Envelope
from .._wire.peer import Peer
from .._wire.splice import CallSplicer
from .array import Array
from .outputs import Unlike, lane_outputs, learn_outputs
from .outputs import build_outputs as _build_outputs
from .pending import Pending
from .plan import CallPlan
from .serialization import PickledArgs
from .specs import _check_specs
from .target import Target

__all__ = ["_CallOp", "_decode_result"]


class _CallOp:
    """One call's sending and output building (a class, not closures: fewer objects
    per call for the collector to track while calls are in flight)."""

    __slots__ = ("call_id", "changes", "check", "ctl", "digest", "gens", "out_specs", "pending",
                 "pickled", "plan", "ref_shardings", "stream", "target")

    def __init__(self, ctl: Controller, target: Target, plan: CallPlan,
                 pickled: PickledArgs | None, stream: int, digest: bytes,
                 gens: dict[int, int], call_id: int, out_specs: Any, changes: int,
                 pending: Pending | None = None, check: bool = False) -> None:
        self.changes = changes  # the host registry's, when ``gens`` were read
        self.ctl = ctl
        self.target = target
        self.plan = plan
        self.pickled: PickledArgs | None = pickled
        self.stream = stream
        self.digest = digest
        self.gens = gens
        self.call_id = call_id
        self.out_specs = out_specs
        self.ref_shardings: tuple[Any, ...] = ()
        self.pending = pending  # the arrays the call returned when made (off the loop thread)
        self.check = check  # specialize(check_replicas=True): hosts hash, replicas compared

    def send(self, call_id: int) -> None:
        """Loop thread: one CALL per host; drops the pickled arguments once sent."""
        ctl, target, plan, pickled = self.ctl, self.target, self.plan, self.pickled
        assert pickled is not None
        self.pickled = None  # argument handles live until the call is sent, no longer
        if pickled.needs:  # the user's packages the arguments name go first
            for h in plan.hosts:
                ctl._shipper.ship(ctl, ctl._hosts[h], pickled.needs)
        if pickled.keep:  # an output laid out like an argument gets its global sharding
            shardings = []
            for k in pickled.keep:
                shardings.append(k.sharding if isinstance(k, Array) else None)
            self.ref_shardings = tuple(shardings)
        payload, bufs = pickled.payload, pickled.buffers
        hosts = max(ctl._expected_hosts, len(ctl._hosts))  # cb.host_count() on the hosts
        # P.Call's fields; all but the host's mesh and the host count packed once
        splice = CallSplicer([call_id, self.stream, self.digest, target.obj_id, target.method,
                              pickled.refs], len(plan.hosts) > 1)
        registry, objects, nbufs, chan = ctl._hosts, pickled.objects, len(bufs), ctl._chan
        if self.check:  # the CALL with its ninth field: the hosts hash replicated outputs
            self._send_checked(call_id, pickled)
            return
        # A fan-out made again with no host joined or lost since: its hosts are as checked
        # last time (generations, code shipped, alive, relays), their peers grouped.
        key = (id(plan), self.digest)
        again = registry.fanouts.get(key) if len(plan.hosts) > 1 and not objects else None
        if (again is not None and again[0] is plan and again[1] == registry.changes
                and self.changes == registry.changes and target.code is not None):
            if chan is not None:  # each body the head, then its host's mesh and count
                chan.send_fanned(again[2], P.Kind.CALL, splice.head, splice.end(hosts), payload,
                                 bufs, nbufs)
            ctl._count("calls")
            return
        meshes = plan.packed_meshes()
        known, gens = registry.hosts, self.gens
        prepare, code, digest = target.prepare, target.code, self.digest
        # the hosts by their mesh (one body each), sent together once all are prepared:
        # a fan-out's CALLs join their relay's next message as one entry
        to: dict[bytes, list[Peer]] = {}
        for h in plan.hosts:
            host = known[h]
            if host.generation != gens[h]:
                raise host.lost_error("it rejoined after this call was made")
            if code is None:
                prepare(ctl, host)
            elif digest not in host.code_sent:  # (what code.ship looks at, inline)
                code.ship(ctl, host)
            for state in objects:
                state.ensure_built(ctl, host)
            if host.alive:  # as ctl._send does
                mesh = meshes[h]
                peers = to.get(mesh)
                if peers is None:
                    to[mesh] = [host.peer]
                else:
                    peers.append(host.peer)
        if chan is not None:
            groups = []
            for mesh, peers in to.items():
                if len(peers) == 1:
                    chan.send_packed(peers[0], P.Kind.CALL, splice.packed(mesh, hosts), payload,
                                     bufs, nbufs)
                else:
                    fanned = chan.fanout(peers)
                    groups.append((mesh, fanned))
                    chan.send_packed_many(fanned, P.Kind.CALL, splice.packed(mesh, hosts), payload,
                                          bufs, nbufs)
            if len(plan.hosts) > 1 and not objects and code is not None and (
                    self.changes == registry.changes and len(groups) == len(to)):
                if len(registry.fanouts) >= 64:
                    registry.fanouts.clear()
                registry.fanouts[key] = (plan, registry.changes,
                                         chan.fanned(groups, splice.end(hosts)))
        ctl._count("calls")

    def _send_checked(self, call_id: int, pickled: PickledArgs) -> None:
        """Loop thread: :meth:`send`'s CALLs one by one, each asking its host to hash its
        replicated outputs (``P.Call.check``), for ``specialize(check_replicas=True)``."""
        ctl, target, plan = self.ctl, self.target, self.plan
        hosts = max(ctl._expected_hosts, len(ctl._hosts))
        bufs = pickled.buffers
        for h in plan.hosts:
            host = ctl._hosts.hosts[h]
            if host.generation != self.gens[h]:
                raise host.lost_error("it rejoined after this call was made")
            target.prepare(ctl, host)
            for state in pickled.objects:
                state.ensure_built(ctl, host)
            ctl._send(host, P.Call(call_id, self.stream, self.digest, target.obj_id,
                                   target.method, pickled.refs, plan.host_mesh[h], hosts,
                                   len(plan.hosts) > 1, 1),
                      pickled.payload, bufs, len(bufs))
        ctl._count("calls")

    def __call__(self, per_host: dict[int, Any]) -> Any:
        """The combiner: the call's outputs from each host's reply (loop thread).

        The op itself, not its bound method: one object less per call in flight.
        """
        pending = self.pending
        unlike: Unlike | None = None
        try:
            out = _build_outputs(self.ctl, self.call_id, self.plan, per_host,
                                 self.ref_shardings, self.target.name, pending, self.check)
        except Unlike as exc:
            unlike = exc
        if unlike is not None:  # an out_specs_fn's own error says it first, where it has one
            if self.out_specs is not None:
                _check_specs(unlike.came, self.out_specs, f"outputs of {self.target.name}")
            raise unlike
        if self.out_specs is not None:
            _check_specs(out, self.out_specs, f"outputs of {self.target.name}")
        if pending is not None:  # its arrays are its outputs, stored (settle_pending)
            for a in pending.leaves:
                a._call = None
        return out


def _decode_result(host: Host, body: P.Result, env: Envelope) -> Any:
    """A host's output description (msgpack; never a pickle: see ``_describe``)."""
    return read_outputs(env.payload, body.meta)


HOST_BLIND.add(_decode_result)  # equal replies of a relay's hosts: decoded once
SETTLERS[_decode_result] = (lane_outputs, learn_outputs, read_outputs)  # the reply's lane
