"""Which view host code runs: one JAX job (the global view) or each host's block.

SPEC 13: the global view is the default. A cluster whose size is known and above one
forms a JAX job with no option given (:class:`colobus._controller.jaxjob.JaxJob`);
``jax_distributed=False`` keeps the block view, ``jax_distributed=True`` insists on the
job. Where the hosts run the block view and nobody chose it (the size unknown, or a
job that could not form), the controller says so once, in one line: never silently.
A single host needs no job (its block is every array's whole).

Once a job formed, each ``cb.Device.id`` is the id host code's JAX gives the device
(``jaxjob._renumber``), so an id sent to a host finds its device there.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Protocol

from .._wire import protocol as P
from .jaxjob import JaxJob, JobOwner, wants_job

if TYPE_CHECKING:
    from .._wire.envelope import Envelope
    from .hosts import Host

__all__ = ["ViewOwner", "choose_view", "fall_back", "job_wanted", "unknown_size_note"]


class ViewOwner(JobOwner, Protocol):
    """What the view's choice uses of the controller: the job's owner, and where a job
    that fell back is kept."""

    _job: JaxJob | None  # (None once a job nobody insisted on fell back)
    _job_off: dict[str, Any] | None  # that job's last figures, and why it fell back


log = logging.getLogger("colobus.controller")

_SILENCE = "jax_distributed=False chooses the block view (and silences this line)"
_CHOOSE = f"{_SILENCE}; jax_distributed=True makes it an error"


def choose_view(ctl: ViewOwner, jax_distributed: bool | None, hosts: int) -> JaxJob | None:
    """The cluster's job (None: the block view). Where the controller runs the block view
    and nobody chose it, it says so in one line, now."""
    mode = wants_job(jax_distributed)
    note = unknown_size_note(mode, hosts)
    if note is not None:
        log.warning("%s", note)
    if not job_wanted(mode, hosts):
        return None
    return JaxJob(ctl, None if mode else functools.partial(fall_back, ctl))


def job_wanted(mode: bool | None, hosts: int) -> bool:
    """Whether a controller of ``hosts`` hosts forms a job, given ``jax_distributed``
    (or its variable) as ``mode``: True insists, False never, None where ``hosts > 1``."""
    if mode is None:
        return hosts > 1
    return mode


def unknown_size_note(mode: bool | None, hosts: int) -> str | None:
    """The line a controller logs as it starts when it runs the block view because
    nobody chose a view and its size is unknown; None where there is nothing to say."""
    if mode is not None or hosts > 0:
        return None
    return ("the hosts run the block view (host code sees each host's block of an array), "
            "not one JAX job: the cluster's size is unknown; pass hosts=N for the global "
            f"view (one JAX job); {_SILENCE}")


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def fall_back(ctl: ViewOwner, job: JaxJob, exc: BaseException) -> None:
    """The default view's job did not form: say so in one line, bring every host back to
    its own JAX (a FORM of no processes), then run the block view.

    What was submitted meanwhile waits behind the job's gate until every host is back.
    """
    job.state = "off"
    job.error = exc
    job._cancel_expiry()
    job._stop_service()
    hosts = ctl._hosts
    alive = [h.index for h in hosts.alive()]
    log.warning("the cluster's %d hosts run the block view (host code sees each host's block "
                "of an array), not one JAX job: they could not form one (%s); %s",
                ctl._expected_hosts, _first_line(exc), _CHOOSE)
    ctl._job_off = job.describe()
    ctl._job = None  # from now on a plain cluster: hosts that join are told no job comes

    def done(_: Any) -> None:
        job._release()
        job._wake()

    if not alive:
        done(None)
        return

    def send(call_id: int) -> None:
        for i in alive:
            ctl._send(hosts[i], P.Form(call_id, job.generation, "", 0, [], 1.0))

    fut = ctl._ops.submit(tuple(alive), send, _no_reply, dict, backpressure=False,
                          urgent=True)
    fut.add_done_callback(done)


def _no_reply(host: Host, body: P.Result, env: Envelope) -> None:
    return None
