"""The controller's side of the cluster's JAX job (``jax_distributed=True``).

Once the cluster's ``hosts`` have joined, :class:`JaxJob` forms one JAX
multi-controller job of them: it starts JAX's coordination service in the
controller's process (a gRPC server of JAX's own) on a Unix socket in a private
directory, reached by the hosts only through their colobus links
(:mod:`colobus._controller.coordlink`), then sends every host a FORM, which the worker
answers once it is in (``colobus._host.jaxjob``). Host ``i`` is JAX process ``i``. The
job is an operation like any other (a host lost meanwhile fails it); until every host
answered, a gate at the head of the backlog holds back every other operation, so no
call reaches a host before its JAX is the job's.

The coordinator runs in the controller, not in host 0's worker, because the
controller outlives every host: a job whose process 0 died would take its
coordination service with it.

A lost host breaks the job for every host (JAX's collectives would wait for it
forever): every operation still in flight fails with ``HostLostError`` naming the
lost host, the other hosts are declared lost too (their sessions end, their workers
leave the job and join again), and the gate holds what is submitted meanwhile. Once
every host is back (``restart=``, or a worker returning under its name) the job
forms again, a new generation with a new coordination service. What waits behind the
gate longer than ``join_timeout`` fails with ``HostLostError`` naming the hosts still
missing. No JAX client hears a service end: its connections are cut first (see
:mod:`.coordlink`), and JAX's own timeouts (heartbeats, registration) are set beyond
any session, since JAX ends a process on any of them. Everything here runs on the
controller's loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .._errors import ControllerClosedError, HostLostError
from .._wire import protocol as P
from .._wire.coordpipe import LINK
from .._wire.describe import BadReply
from .coordlink import CoordLink
from .ops import Gate, Operation

if TYPE_CHECKING:
    from .._wire.envelope import Envelope
    from .hosts import Host, HostRegistry
    from .ops import Operations

__all__ = ["JAX_DISTRIBUTED_ENV", "JaxJob", "JobOwner", "wants_job"]

log = logging.getLogger("colobus.controller")

JAX_DISTRIBUTED_ENV = "COLOBUS_JAX_DISTRIBUTED"  # "1": jax_distributed where a cluster does not say
OLD_PORT_ENV = "COLOBUS_JAX_PORT"  # (the service had a port once: said unused if set)
SERVICE_HEARTBEAT_S = 86400  # JAX's own liveness checks: off in effect (colobus judges)
SERVICE_REGISTER_S = 1 << 30  # JAX's wait for every task to register: never its own end
SERVICE_SHUTDOWN_S = 5  # (its clients are cut before: it waits for none)
RETRIES = 1  # a job that failed to form (not for a lost host) is tried again this often


def wants_job(jax_distributed: bool | None) -> bool | None:
    """``jax_distributed``, else ``$COLOBUS_JAX_DISTRIBUTED``: True (``1``), False (``0``), or
    None where neither says (the default view: ``colobus._controller.jobview``).

    Raises:
        ValueError: the variable holds something else.
    """
    if jax_distributed is not None:
        return bool(jax_distributed)
    text = os.environ.get(JAX_DISTRIBUTED_ENV, "").strip().lower()
    if text in ("0", "false", "no", "off") or not text:
        return False if text else None
    if text in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"${JAX_DISTRIBUTED_ENV} is {text!r}: expected 1 or 0")


class _Sessions(Protocol):
    dropped: Any

    def lose(self, host: Host, why: str, last_word: str = ...) -> None: ...
    def violation(self, host: Host, reason: str, detail: str = ...) -> None: ...
    def handle_kind(self, kind: P.Kind, handler: Any) -> None: ...


class JobOwner(Protocol):
    """What :class:`JaxJob` uses of the controller that owns it."""

    @property
    def _hosts(self) -> HostRegistry: ...
    @property
    def _ops(self) -> Operations: ...
    @property
    def _sessions(self) -> _Sessions: ...
    @property
    def _expected_hosts(self) -> int: ...
    @property
    def _address(self) -> str: ...
    @property
    def join_timeout(self) -> float: ...
    def _send(self, host: Host, body: P.Body, payload: Any = b"", buffers: Any = (),
              pbufs: int = 0) -> None: ...


class JaxJob:
    """Forms, re-forms and ends the cluster's JAX job (loop thread).

    States: ``waiting`` (for the hosts), ``forming``, ``formed``, ``broken`` (a host
    was lost: waiting for the hosts to be back), ``failed`` (it could not form).
    """

    def __init__(self, ctl: JobOwner,
                 fall_back: Callable[[JaxJob, BaseException], None] | None = None) -> None:
        if ctl._expected_hosts <= 0:
            raise ValueError("jax_distributed=True needs the cluster's size: pass hosts=N "
                             "(every host is one process of the JAX job)")
        self._ctl = ctl
        self._fall_back = fall_back  # a job nobody insisted on that never formed (jobview)
        self.state = "waiting"
        self.generation = 0
        self.coordinator = ""  # where the coordination service listens (unix:PATH)
        self.error: BaseException | None = None  # why it failed to form
        self.formed_count = 0  # times it formed (re-forms included)
        self.form_s = 0.0  # how long the last forming took, FORM sent to every host in
        self._form_began = 0.0
        self._members: dict[int, int] = {}  # host index -> its generation in this job
        self._service: Any = None
        self._stopping: list[threading.Thread] = []  # services being shut down
        self._gate: Gate | None = None
        self._waiters: list[asyncio.Future[None]] = []
        self._expiry: asyncio.TimerHandle | None = None
        self._failures = 0
        self._lost: tuple[int, str] | None = None  # the host whose loss broke the job
        # the hosts' connections to the service: only through their colobus links
        self._link = CoordLink(ctl, ctl._sessions.violation, ctl._sessions.dropped)
        ctl._sessions.handle_kind(P.Kind.COORD, self._link.on_coord)
        self.services_stopped = 0  # coordination services stopped (each a thread's wait)
        if os.environ.get(OLD_PORT_ENV, "").strip():
            log.warning("$%s is set but unused: the JAX job's coordination service listens "
                        "on no port now (the hosts reach it through their colobus links)",
                        OLD_PORT_ENV)

    # -- the controller's events ----------------------------------------------------------

    def started(self) -> None:
        """The controller started: nothing is sent to a host before the job formed."""
        self._hold()

    def host_joined(self, host: Host) -> None:
        """A host joined: form the job once every host of the cluster has."""
        if self.state in ("forming", "formed"):
            return
        hosts = self._ctl._hosts
        n = self._ctl._expected_hosts
        if hosts.alive_count() < n:
            return
        indices = sorted(h.index for h in hosts.alive())
        if indices != list(range(n)):
            self._fail(RuntimeError(
                f"the cluster's JAX job needs hosts 0..{n - 1}, one process each, but hosts "
                f"{indices} are alive: a worker under a new name took a lost host's place. "
                f"Start the missing host's worker under its old name (--name), or restart "
                "the cluster"))
            return
        self._form(indices)

    def host_lost(self, host: Host, why: str) -> None:
        """A host was lost: if it was in the job (or forming it), the job ends for all."""
        self._link.cut(host.index)
        if self.state not in ("forming", "formed") or host.index not in self._members:
            return
        self._break(host, why)

    async def wait_formed(self, timeout: float) -> None:
        """Until the job formed (at once if it has).

        Raises:
            TimeoutError: it did not form within ``timeout``.
            RuntimeError: it failed to form (the error a host raised joining it).
        """
        if self.state in ("formed", "off"):  # (off: the block view instead, jobview)
            return
        if self.state == "failed" and self.error is not None:
            raise self.error
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except TimeoutError:
            raise TimeoutError(
                f"the cluster's JAX job did not form within {timeout:.0f} s "
                f"({self.describe()})") from None
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
        if self.state == "failed" and self.error is not None:
            raise self.error

    def close(self) -> None:
        """The controller closes: the coordination service stops (waited for, briefly: a
        gRPC server still stopping as the process exits would abort it); waiters are
        told."""
        self._cancel_expiry()
        self._stop_service()
        for thread in self._stopping:
            thread.join(SERVICE_SHUTDOWN_S)
        self._stopping.clear()
        self._link.close()
        if self.state != "formed" and self.error is None:
            self.error = ControllerClosedError(
                "the colobus controller closed before the cluster's JAX job formed")
        self.state = "failed" if self.state != "formed" else "closed"
        self._wake()

    def describe(self) -> dict[str, Any]:
        """What ``ctl.stats()["jax_job"]`` shows."""
        return {"state": self.state, "generation": self.generation,
                "coordinator": self.coordinator, "formed": self.formed_count,
                "form_s": self.form_s,
                "processes": self._ctl._expected_hosts,
                "error": None if self.error is None else str(self.error)}

    # -- forming ----------------------------------------------------------------------------

    def _form(self, indices: list[int]) -> None:
        ctl = self._ctl
        self._hold()
        self._stop_service()
        hosts = ctl._hosts
        members = {i: hosts[i].generation for i in indices}
        try:
            self.coordinator = self._start_service(
                self._link.open(self.generation + 1, members), len(indices))
        except Exception as exc:
            self._fail(RuntimeError(f"cannot start JAX's coordination service for the "
                                    f"cluster's job: {exc}"))
            return
        self.state = "forming"
        self.generation += 1
        self._members = members
        table = [[d.id for d in hosts[i].devices] for i in indices]
        form = (self.generation, LINK, len(indices), table,
                float(max(1.0, ctl.join_timeout)))
        log.info("forming the cluster's JAX job (generation %d) of %d hosts; coordinator %s",
                 self.generation, len(indices), self.coordinator)

        def send(call_id: int) -> None:
            for i in indices:
                ctl._send(hosts[i], P.Form(call_id, *form))

        self._form_began = time.monotonic()
        fut = ctl._ops.submit(tuple(indices), send, _decode_ids, dict, backpressure=False,
                              urgent=True)
        generation = self.generation
        fut.add_done_callback(lambda f: self._form_done(generation, f))

    def _form_done(self, generation: int, fut: Any) -> None:
        if generation != self.generation or self.state != "forming":
            return  # a loss broke it meanwhile: that is handled
        exc = fut.exception()
        if exc is not None:
            if isinstance(exc, HostLostError):
                # (the loss's own handler runs next, unless the host was gone already)
                asyncio.get_running_loop().call_soon(self._lost_while_forming, generation, exc)
                return
            if self._fall_back is not None and not self.formed_count:
                self._fall_back(self, exc)
                return
            self._failures += 1
            log.error("the cluster's JAX job (generation %d) did not form: %s", generation, exc)
            if self._failures <= RETRIES:
                log.warning("every host leaves and joins again; the job forms once more")
                self._break(None, f"the JAX job did not form: {exc}")
            else:
                self._fail(exc)
            return
        ids: dict[int, list[int]] = fut.result()
        hosts = self._ctl._hosts
        for i, jax_ids in ids.items():
            _renumber(hosts[i], jax_ids)
            hosts.taken(jax_ids)
        hosts.changes += 1  # (plans and fan-outs worked out per host see the new ids)
        self.state = "formed"
        self.form_s = time.monotonic() - self._form_began
        self.error = None
        self._failures = 0
        self._lost = None
        self.formed_count += 1
        log.info("the cluster's JAX job formed (generation %d, %d processes)", generation,
                 len(ids))
        self._cancel_expiry()
        self._release()
        self._wake()

    def _lost_while_forming(self, generation: int, exc: BaseException) -> None:
        if generation == self.generation and self.state == "forming":
            host = getattr(exc, "host", None)
            lost = self._ctl._hosts[host] if isinstance(host, int) and 0 <= host < len(
                self._ctl._hosts) else None
            self._break(lost, str(exc))

    # -- breaking ---------------------------------------------------------------------------

    def _break(self, lost: Host | None, why: str) -> None:
        """End the job for every host: what is in flight fails, the hosts join again."""
        ctl = self._ctl
        self.state = "broken"
        self._hold()
        if lost is not None:
            self._lost = (lost.index, lost.name)
            log.warning("host %d (%r) was lost: the cluster's JAX job ends for every host; "
                        "it forms again once every host is back", lost.index, lost.name)
        ops = ctl._ops
        for op in list(ops.pending.values()):
            if lost is not None:
                err = lost.lost_error(f"{why}; the cluster's JAX job ended with it, on "
                                      "every host")
            else:
                err = HostLostError(f"the cluster's JAX job ended: {why}")
            op.end(ops, err)
        if lost is not None:
            reason = (f"the cluster's JAX job ended: host {lost.index} ({lost.name!r}) was "
                      "lost")
        else:
            reason = f"the cluster's JAX job ended: {why}"
        for h in ctl._hosts.alive():
            ctl._sessions.lose(h, reason)  # its worker leaves the job and joins again
        self._stop_service()
        self._arm_expiry()

    def _fail(self, exc: BaseException) -> None:
        """It cannot form: waiters get ``exc``; what waits for it fails now, and what is
        submitted later within ``join_timeout`` (it forms again only once a host was
        lost and is back). A job nobody insisted on that never formed falls back."""
        if self._fall_back is not None and not self.formed_count:
            self._fall_back(self, exc)
            return
        self.state = "failed"
        self.error = exc
        self._stop_service()
        self._wake()
        self._fail_waiting(lambda: RuntimeError(f"the cluster's JAX job could not form: {exc}"))
        self._arm_expiry()

    # -- the gate: nothing reaches a host before the job formed -------------------------

    def _hold(self) -> None:
        if self._gate is not None and not self._gate.open:
            return
        self._gate = Gate()
        self._ctl._ops.backlog.appendleft(self._gate)

    def _release(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.open = True
            self._ctl._ops.pump()

    def _arm_expiry(self) -> None:
        self._cancel_expiry()
        self._expiry = asyncio.get_running_loop().call_later(
            max(1.0, self._ctl.join_timeout), self._expire)

    def _cancel_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def _expire(self) -> None:
        """The job has not formed again within ``join_timeout``: what waits fails."""
        self._expiry = None
        if self.state == "formed":
            return
        ctl = self._ctl
        missing = [i for i in range(ctl._expected_hosts)
                   if i >= len(ctl._hosts) or not ctl._hosts[i].alive]
        first = missing[0] if missing else None
        what = (f"host{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} "
                f"{'are' if len(missing) > 1 else 'is'} still missing" if missing
                else f"it is {self.state}")
        text = (f"the cluster's JAX job has not formed again within "
                f"{ctl.join_timeout:.0f} s ({what}); operations waiting for it fail")
        error = self.error
        if self.state == "failed" and error is not None:
            self._fail_waiting(lambda: RuntimeError(
                f"the cluster's JAX job could not form: {error}"))
        else:
            log.warning("%s", text)
            self._fail_waiting(lambda: HostLostError(text, first))
        self._arm_expiry()

    def _fail_waiting(self, error: Any) -> None:
        """Fail the operations waiting behind the gate (they were never sent)."""
        ops = self._ctl._ops
        gate = self._gate
        if gate is None:
            return
        kept: list[Any] = []
        behind = False
        for item in ops.backlog:
            if item is gate:
                behind = True
            elif behind and isinstance(item, Operation):
                if item.backpressure:
                    ops._give_slot()
                if not item.future.done():
                    item.future.set_exception(error())
                continue
            kept.append(item)
        ops.backlog.clear()
        ops.backlog.extend(kept)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    # -- JAX's coordination service, in this process -------------------------------------

    def _start_service(self, address: str, processes: int) -> str:
        """Start it on ``address`` (``unix:PATH``, in the controller's private directory);
        returns that address. No port: the hosts reach it through their links."""
        from jax._src.lib import _jax  # type: ignore[attr-defined]  # (no backend is made)

        try:
            self._service = _jax.get_distributed_runtime_service(
                address, processes, heartbeat_timeout=SERVICE_HEARTBEAT_S,
                cluster_register_timeout=SERVICE_REGISTER_S,
                shutdown_timeout=SERVICE_SHUTDOWN_S, recoverable=True)
        except TypeError:  # a jaxlib without recoverable tasks
            self._service = _jax.get_distributed_runtime_service(
                address, processes, heartbeat_timeout=SERVICE_HEARTBEAT_S,
                cluster_register_timeout=SERVICE_REGISTER_S,
                shutdown_timeout=SERVICE_SHUTDOWN_S)
        return address

    def _stop_service(self) -> None:
        """Cut every host's connection to the service, then stop it (no client is left
        to hear of its end: JAX's clients end their process on that)."""
        self._link.cut()
        service, self._service = self._service, None
        if service is None:
            return

        def stop() -> None:  # (off the loop: a gRPC server's shutdown waits on threads)
            try:
                service.shutdown()
            except Exception as exc:
                log.debug("stopping the JAX coordination service: %s", exc)
            self.services_stopped += 1

        thread = threading.Thread(target=stop, name="colobus-jax-service", daemon=True)
        thread.start()
        self._stopping = [t for t in self._stopping if t.is_alive()] + [thread]


def _decode_ids(host: Host, body: P.Result, env: Envelope) -> list[int]:
    ids = body.meta
    if not (isinstance(ids, list) and len(ids) == len(host.devices)
            and all(type(i) is int for i in ids)):
        raise BadReply(f"a FORM's reply lists {ids!r:.80} as the host's JAX device ids")
    return ids


def _renumber(host: Host, jax_ids: list[int]) -> None:
    """The host's devices as the job's JAX numbers them: ``id`` and ``local_id`` both
    become the id of the matching JAX device in the job (the id every host's JAX knows
    it by; the devices are in the order the worker reported them)."""
    from .._model.devices import Device

    host.devices = tuple(sorted(Device(lid, d.host, d.platform, d.device_kind, lid)
                                for d, lid in zip(host.devices, jax_ids, strict=True)))
