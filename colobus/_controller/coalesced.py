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

if TYPE_CHECKING:
    from .._wire.envelope import Envelope
    from .hosts import Host
    from .ops import Decoder, Operation, Operations

__all__ = ["HOST_BLIND", "on_results"]

# Decoders whose value does not depend on the host (a call's output description): a
# group's equal replies are decoded once and the value shared.
HOST_BLIND: set[Decoder] = set()


def on_results(ops: Operations, hosts: list[Host], body: P.Result, env: Envelope,
               times: list[Any] | None) -> None:
    """The same RESULT from several hosts, coalesced by their relay (loop thread):
    what :meth:`Operations.on_result` does for each, with the operation looked up, the reply
    checked and the operation ended once for the group. ``times``: each host's own
    call times (``body.times`` for all where None)."""
    ctl = ops.ctl
    call_id = body.call_id
    status, meta = body.status, body.meta
    violation = ctl._sessions.violation
    if status == P.Status.OK and type(meta) is int and not 0 <= meta < P.MAX_OUTPUTS:
        for host in hosts:
            if call_id in host.awaiting:
                host.awaiting.discard(call_id)
                violation(host, "malformed", f"{meta} outputs")
            else:
                violation(host, "unsolicited", f"result for call {call_id}")
        return
    op = ops.pending.get(call_id)
    rec = op.future._timing if op is not None else None
    stray = status == P.Status.OK and type(meta) is int  # outputs nobody will own
    remaining = op.remaining if op is not None else 0
    group: list[Host] = []
    for j, host in enumerate(hosts):
        awaiting = host.awaiting
        if call_id not in awaiting:  # never sent to this host, or answered already
            violation(host, "unsolicited", f"result for call {call_id}")
            continue
        awaiting.discard(call_id)
        host.inflight.discard(call_id)
        if not remaining >> host.index & 1:  # (no operation: remaining is 0)
            if stray:
                ops.free_outputs(host.index, call_id, meta)
            continue
        if rec is not None:
            rec.add_reply(host.index, time.perf_counter(),
                          body.times if times is None else times[j])
        group.append(host)
    if op is not None and group and not (
            len(group) > 1 and op.decode in HOST_BLIND and status == P.Status.OK
            and _answered_alike(op, group, body, env)):
        for host in group:
            bad = op.answered(host, body, env)
            if bad is not None:  # the call fails with a ProtocolError; the host goes
                violation(host, "bad_reply", str(bad))
    if op is not None and not op.remaining and ops.pending.get(call_id) is op:
        op.end(ops)
    if ops.backlog:
        ops.pump()


def _answered_alike(op: Operation, group: list[Host], body: P.Result, env: Envelope) -> bool:
    """:meth:`Operation.answered` for each host of ``group`` (equal OK replies, a
    host-blind decoder): decoded once, the value shared, the hosts' bits cleared at once.
    False if the decoder raised: nothing recorded (each host is then answered alone, for
    its own error and violation)."""
    try:
        value = op.decode(group[0], body, env)
    except BaseException:
        return False
    values, outputs, meta = op.values, op.outputs, body.meta
    bits = bytearray((max(h.index for h in group) >> 3) + 1)
    for host in group:
        i = host.index
        values[i] = value
        bits[i >> 3] |= 1 << (i & 7)
    if type(meta) is int:
        for host in group:
            outputs[host.index] = meta
    op.remaining &= ~int.from_bytes(bits, "little")
    return True
