"""FORM on a host: join the cluster's JAX job, answer once in; COORD; the exit.

JAX's connect blocks until every host is in, so the join runs on a thread of its
own (:meth:`colobus._host.jaxjob.HostJob.join`); the answer, and what the worker
changes once it is in the job (its JAX devices, how values are presented, what
``jax.process_index()`` answers in host code), happen back on the loop thread. A
session that ended meanwhile leaves what was joined. JAX's own connect never gives
up (its giving up would end the process), so the FORM is answered with an error
once its timeout passed, and that join is left to finish, or not, on its thread.

A process that was once in a job exits without Python's finalization (:func:`run`):
a thread may wait in JAX's C++ for good (a collective with a lost peer, a connect),
and the finalization would abort under it, Ctrl-C's exit (130) included.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .._model import jaxside as _hostside
from .._wire import protocol as P
from .._wire.coordpipe import LINK
from .._wire.protocol import Status
from .calls import WorkerServices, set_job
from .coordfwd import Forwarder
from .values import HostValues

if TYPE_CHECKING:
    from .._wire.envelope import Envelope
    from .jaxjob import HostJob

__all__ = ["INTERRUPTED", "Forming", "back_to_blocks", "on_coord", "on_form", "run"]

INTERRUPTED = 130  # the exit status of a worker stopped by Ctrl-C (SIGINT), as a shell's

log = logging.getLogger("colobus.worker")


class Forming(WorkerServices, Protocol):
    """What a FORM uses of the worker (``colobus._host.worker.Worker``)."""

    name: str
    connect: str
    job: HostJob | None
    _jax_session: bool  # this session's hosts form one JAX job (its WELCOME said so)
    _jax_devices: list[Any]
    _reported: list[list[Any]]
    _devices_stale: bool
    _welcome_ids: list[int]  # this host's colobus device ids, as its WELCOME gave them

    def _discover_devices(self) -> None: ...

    def _drop(self, reason: str) -> None: ...


def on_form(w: Forming, body: P.Form, env: Envelope) -> None:
    """Join the cluster's JAX job (on a thread of its own: JAX's connect blocks until
    every host is in); answer once in, with this host's JAX device ids there."""
    job = w.job
    if body.processes == 0:  # no job after all: the cluster runs the block view
        back_to_blocks(w)
        w.send(P.Result(body.call_id, Status.OK, None))
        return
    if job is None or not w._jax_session or body.coordinator != LINK:
        w.reply_error(body.call_id, RuntimeError(
            "this session's hosts form no JAX job (the controller's WELCOME said so)"
            if body.coordinator == LINK else
            f"the controller names {body.coordinator!r} as the JAX job's coordinator; this "
            "worker reaches it only through its colobus link: run the same colobus on both"))
        return
    loop = asyncio.get_running_loop()
    epoch, host, reported = w.epoch, w.host_index, len(w._reported)

    def send(coord: P.Coord, data: bytes) -> None:  # (this session's link only)
        if w.epoch == epoch:
            w.send(coord, data)

    try:
        forwarder = Forwarder(loop, send, body.generation)
    except OSError as exc:
        w.reply_error(body.call_id, RuntimeError(
            f"host {host} cannot listen for its JAX client: {exc}"))
        return
    answered: list[bool] = [False]

    def join() -> None:
        try:
            outcome: Any = job.join(body, host, w.connect, reported, forwarder)
        except BaseException as exc:  # every failure is the FORM's answer
            outcome = exc
        try:
            loop.call_soon_threadsafe(_formed, w, epoch, body, outcome, answered)
        except RuntimeError:  # the loop closed: the worker is exiting
            pass

    def overdue() -> None:  # JAX never gives up (that would end us): colobus does
        if not answered[0] and epoch == w.epoch:
            _formed(w, epoch, body, RuntimeError(
                f"host {host} did not join the JAX job within {body.timeout:.0f} s (the "
                "other hosts did not all reach the coordination service)"), answered)

    threading.Thread(target=join, name="colobus-jax-join", daemon=True).start()
    loop.call_later(max(1.0, body.timeout), overdue)


def on_coord(w: Forming, body: P.Coord, env: Envelope) -> None:
    """Bytes of the coordination service for this host's JAX client (its forwarder)."""
    forwarder = w.job.forwarder if w.job is not None else None
    if forwarder is None or forwarder.generation != body.generation:
        w._drop("stale")  # (a job this host has left)
        return
    forwarder.on_coord(body, env.payload)


def _formed(w: Forming, epoch: int, body: P.Form, outcome: Any, answered: list[bool]
            ) -> None:
    """Loop thread: the job is formed (or not, or not in time); answer the FORM once."""
    job = w.job
    assert job is not None
    if answered[0]:
        return  # (answered overdue: the controller ends this session, and the job with it)
    answered[0] = True
    if epoch != w.epoch:  # the session ended meanwhile: leave what was joined
        if w.epoch and job.index >= 0 and not w._jax_session:
            job.leave()
            w._devices_stale = True
        return
    if isinstance(outcome, BaseException):  # (the controller says it, or falls back)
        log.info("host %s could not join the cluster's JAX job: %s", w.name, outcome)
        w.reply_error(body.call_id, outcome)
        return
    mine, every = outcome
    w._jax_devices = mine
    by_local = {(d.platform, d.id): d for d in mine}
    for (platform, _kind, reported), d in zip(w._reported, mine, strict=True):
        by_local.setdefault((platform, reported), d)  # (a host's ids before the job)
    w.values = HostValues(w._jax, by_local, job)
    _hostside.install_job(w.host_index, every, body.processes)
    set_job(job)
    log.info("host %s joined the cluster's JAX job as process %d of %d", w.name,
             w.host_index, body.processes)
    w.send(P.Result(body.call_id, Status.OK, [d.id for d in mine]))


def run(serve: Callable[[], int], job: Callable[[], HostJob | None]) -> int:
    """``serve()``'s exit status; a process that was in a JAX job exits here, without
    Python's finalization (Ctrl-C: :data:`INTERRUPTED`), and never aborts."""
    try:
        code = serve()
    except KeyboardInterrupt:
        held = job()
        if held is None or not held.ever:
            raise
        code = INTERRUPTED
    held = job()
    if held is not None and held.ever:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def back_to_blocks(w: Forming) -> None:
    """The session's hosts form no job after all (the default view fell back): leave
    what was joined and serve the block view with this process's own JAX."""
    job = w.job
    if job is not None and job.index >= 0:
        job.leave()
    set_job(None)
    if not w._jax_session:
        return
    w._jax_session = False
    w._discover_devices()  # (joining dropped the backend the devices came from)
    _hostside.install(w.host_index, dict(zip(w._welcome_ids, w._jax_devices, strict=True)),
                      _hostside.host_count())
    log.info("host %s runs the block view: the cluster's hosts form no JAX job", w.name)
