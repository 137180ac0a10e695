"""Replies a relay coalesced: one RESULT for many hosts, settled as a group.

A relay sends the equal RESULTs of a call's hosts as one entry (their hosts' own
call times beside it, :mod:`colobus._wire.relaywire`). Handing each host's copy to
:meth:`~colobus._controller.ops.Operations.on_result` repeats, per host, work that
is the same for all of them (parsing, the operation's lookup, the reply's checks,
the look for an end); here it is done once per entry and only each host's own
bookkeeping runs per host.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .._wire import protocol as P
from .hosts import host_mask

if TYPE_CHECKING:
    from .._wire.envelope import Envelope
    from .hosts import Host
    from .ops import Decoder, Operation, Operations

__all__ = ["HOST_BLIND", "on_results"]

# Decoders whose value does not depend on the host (a call's output description): a
# group's equal replies are decoded once and the value shared.
HOST_BLIND: set[Decoder] = set()


def on_results(ops: Operations, via: object, indices: list[int], body: P.Result,
               env: Envelope, extras: list[Any] | None) -> None:
    """The same RESULT from the hosts ``indices`` that relay ``via`` carries, coalesced
    by it (loop thread): what :meth:`Operations.on_result` does for each, with the
    operation looked up, the reply checked and the operation ended once for the group,
    and per host only its own bookkeeping, in one pass. ``extras``: each host's own
    call times (``body.times`` for all where None); a host the relay no longer carries
    is skipped."""
    ctl = ops.ctl
    call_id = body.call_id
    status, meta = body.status, body.meta
    violation = ctl._sessions.violation
    known = ctl._hosts.hosts
    n = len(known)
    if status == P.Status.OK and type(meta) is int and not 0 <= meta < P.MAX_OUTPUTS:
        for i in indices:
            host = known[i] if 0 <= i < n else None
            if host is None or not host.alive or host.peer.via is not via:
                continue
            if ops.owed(host, call_id):
                if call_id in ops.late:
                    ops.settle_late(call_id, 1 << i)
                host.awaiting.discard(call_id)
                violation(host, "malformed", f"{meta} outputs")
            else:
                violation(host, "unsolicited", f"result for call {call_id}")
        return
    op = ops.pending.get(call_id)
    if op.wide if op is not None else call_id in ops.late:
        _wide(ops, via, indices, body, env, extras, op)
        return
    group: list[Host] = []
    answered: list[int] = []
    for i in indices:
        host = known[i] if 0 <= i < n else None
        if host is None or not host.alive or host.peer.via is not via:
            continue  # a host it no longer carries (lost meanwhile)
        awaiting = host.awaiting
        if call_id not in awaiting:  # never sent to this host, or answered already
            violation(host, "unsolicited", f"result for call {call_id}")
            continue
        awaiting.discard(call_id)
        host.inflight.discard(call_id)
        group.append(host)
        answered.append(i)
    remaining = op.remaining if op is not None else 0
    mask = host_mask(tuple(answered))
    if remaining & mask != mask:  # some the operation no longer waits for (ended, lost)
        waited = [k for k, i in enumerate(answered) if remaining >> i & 1]
        if status == P.Status.OK and type(meta) is int:  # outputs nobody will own
            for i in set(answered) - {answered[k] for k in waited}:
                ops.free_outputs(i, call_id, meta)
        group = [group[k] for k in waited]
        answered = [answered[k] for k in waited]
    rec = op.future._timing if op is not None else None
    if rec is not None:  # traced: each host's own times
        at = {i: j for j, i in enumerate(indices)}
        for i in answered:
            t = body.times if extras is None else extras[at[i]]
            rec.add_reply(i, time.perf_counter(), t if isinstance(t, list) else [])
    if op is not None and group and not (
            len(group) > 1 and op.decode in HOST_BLIND and status == P.Status.OK
            and _answered_alike(op, answered, group[0], body, env)):
        for host in group:
            bad = op.answered(host, body, env)
            if bad is not None:  # the call fails with a ProtocolError; the host goes
                violation(host, "bad_reply", str(bad))
    if op is not None and not op.remaining and ops.pending.get(call_id) is op:
        op.end(ops)
    if ops.backlog:
        ops.pump()


def _wide(ops: Operations, via: Any, indices: list[int], body: P.Result, env: Envelope,
          extras: list[Any] | None, op: Operation | None) -> None:
    """:func:`on_results` for a wide operation (its hosts in masks only, see
    :mod:`.operation`), pending (``op``) or ended: per host nothing but in the rare
    reply a host did not owe (or that its relay no longer carries it)."""
    call_id, status, meta = body.call_id, body.status, body.meta
    known = ops.ctl._hosts.hosts
    if indices and (min(indices) < 0 or max(indices) >= len(known)):
        indices = [i for i in indices if 0 <= i < len(known)]
    got = host_mask(tuple(indices))
    carried = got & via.carried_mask  # (a lost host's bit is cleared there)
    owed = op.remaining if op is not None else ops.late.get(call_id, 0)
    answered = carried & owed
    if answered != got or len(indices) != answered.bit_count():
        keep: list[int] = []
        seen = 0
        for i in indices:  # some not carried (lost meanwhile), or not owed: one by one
            b = 1 << i
            if not carried & b:
                continue
            if not owed & b or seen & b:
                ops.ctl._sessions.violation(known[i], "unsolicited", f"result for call {call_id}")
                continue
            seen |= b
            keep.append(i)
        indices, answered = keep, seen
    if op is None:  # ended before these replies came: nobody will own their outputs
        ops.settle_late(call_id, answered)
        if status == P.Status.OK and type(meta) is int:
            for i in indices:
                ops.free_outputs(i, call_id, meta)
    elif indices:
        rec = op.future._timing
        if rec is not None:  # traced: each host's own times
            at = {i: j for j, i in enumerate(indices)}
            for i in indices:
                t = body.times if extras is None else extras[at[i]]
                rec.add_reply(i, time.perf_counter(), t if isinstance(t, list) else [])
        if not (len(indices) > 1 and op.decode in HOST_BLIND and status == P.Status.OK
                and _answered_alike(op, indices, known[indices[0]], body, env, answered)):
            for i in indices:
                flaw = op.answered(known[i], body, env)
                if flaw is not None:  # the call fails with a ProtocolError; the host goes
                    ops.ctl._sessions.violation(known[i], "bad_reply", str(flaw))
        if not op.remaining and ops.pending.get(call_id) is op:
            op.end(ops)
    if ops.backlog:
        ops.pump()


def _answered_alike(op: Operation, answered: list[int], first: Host, body: P.Result,
                    env: Envelope, mask: int | None = None) -> bool:
    """:meth:`Operation.answered` for each of the hosts ``answered`` (equal OK replies,
    a host-blind decoder): decoded once, the value shared, the hosts' bits cleared at
    once. False if the decoder raised: nothing recorded (each host is then answered
    alone, for its own error and violation)."""
    try:
        value = op.decode(first, body, env)
    except BaseException:
        return False
    op.values.update(dict.fromkeys(answered, value))
    if type(body.meta) is int:
        op.outputs.update(dict.fromkeys(answered, body.meta))
    op.remaining &= ~(host_mask(tuple(answered)) if mask is None else mask)
    return True
