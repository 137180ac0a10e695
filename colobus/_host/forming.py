"""FORM on a host: join the cluster's JAX job, answer once in.

JAX's connect blocks until every host is in, so the join runs on a thread of its
own (:meth:`colobus._host.jaxjob.HostJob.join`); the answer, and what the worker
changes once it is in the job (its JAX devices, how values are presented, what
``jax.process_index()`` answers in host code), happen back on the loop thread. A
session that ended meanwhile leaves what was joined.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING, Any, Protocol

from .._model import jaxside as _hostside
from .._wire import protocol as P
from .._wire.protocol import Status
from .calls import WorkerServices, set_job
from .values import HostValues

if TYPE_CHECKING:
    from .._wire.envelope import Envelope
    from .jaxjob import HostJob

__all__ = ["Forming", "back_to_blocks", "on_form"]

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


def on_form(w: Forming, body: P.Form, env: Envelope) -> None:
    """Join the cluster's JAX job (on a thread of its own: JAX's connect blocks until
    every host is in); answer once in, with this host's JAX device ids there."""
    job = w.job
    if body.processes == 0:  # no job after all: the cluster runs the block view
        back_to_blocks(w)
        w.send(P.Result(body.call_id, Status.OK, None))
        return
    if job is None or not w._jax_session:
        w.reply_error(body.call_id, RuntimeError(
            "this session's hosts form no JAX job (the controller's WELCOME said so)"))
        return
    loop = asyncio.get_running_loop()
    epoch, host, reported = w.epoch, w.host_index, len(w._reported)

    def join() -> None:
        try:
            outcome: Any = job.join(body, host, w.connect, reported)
        except BaseException as exc:  # every failure is the FORM's answer
            outcome = exc
        try:
            loop.call_soon_threadsafe(_formed, w, epoch, body, outcome)
        except RuntimeError:  # the loop closed: the worker is exiting
            pass

    threading.Thread(target=join, name="colobus-jax-join", daemon=True).start()


def _formed(w: Forming, epoch: int, body: P.Form, outcome: Any) -> None:
    """Loop thread: the job is formed (or not); answer the FORM."""
    job = w.job
    assert job is not None
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
