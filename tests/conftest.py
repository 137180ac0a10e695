"""Shared fixtures: real local clusters of real worker subprocesses."""

from __future__ import annotations

import os

# The test process itself plays JAX with 8 CPU devices (sharding property tests).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import collections.abc
import pickle
import signal
import sys
import traceback
from typing import Any

import cloudpickle
import cloudpickle.cloudpickle
import pytest


def _take_interrupts() -> None:
    """Ctrl-C as a terminal gives it, in this process and every process a test starts.

    A run started in the background by a shell without job control (``cmd &`` in a
    script, as some CI runners start it) inherits SIGINT and SIGQUIT ignored, and so
    would every driver, launcher and worker a test starts: the tests that send them
    SIGINT (tests/test_ctrl_c.py, a job's worker told to stop) would then wait for an
    interrupt nothing takes. Python's own handler, as a foreground run has it."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)


_take_interrupts()


def _share_jax_compilations() -> str | None:
    """One JAX compilation cache for this run's processes (the suite's workers compile the
    same small programs again and again, and the suite is CPU-bound on 2 cores): a new
    owner-only directory per run, named in the environment that xdist's workers and
    every process they start inherit; removed at the run's end (pytest_sessionfinish)."""
    import tempfile

    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return None  # the user's own, or this run's (made by the main process)
    path = tempfile.mkdtemp(prefix="colobus-tests-jax-cache-")  # (mode 0700)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    return path


_JAX_CACHE = _share_jax_compilations()


def _compile_the_sources() -> list[str]:
    """Bytecode for the repository's own modules, made once per run where this environment
    has Python write none (``PYTHONDONTWRITEBYTECODE``, set where CI runs): every worker,
    driver and tool the suite starts (about 900 processes) would otherwise compile the
    colobus modules it imports from source, about 0.3 s of CPU each. The ``__pycache__``
    folders it made are removed at the run's end (pytest_sessionfinish)."""
    import compileall
    import pathlib

    if not sys.flags.dont_write_bytecode or os.environ.get("PYTEST_XDIST_WORKER"):
        return []  # (Python writes them itself; or the run's main process made them)
    root = pathlib.Path(__file__).resolve().parent.parent
    package, tests = root / "colobus", root / "tests"

    def caches() -> set[pathlib.Path]:
        return {*package.rglob("__pycache__"), *tests.glob("__pycache__")}

    before = caches()
    compileall.compile_dir(package, quiet=2)
    compileall.compile_dir(tests, maxlevels=0, quiet=2)  # (the helpers workers import)
    return sorted(str(c) for c in caches() - before)


_PYCACHES = _compile_the_sources()


def _forbid_unpickling(record: str) -> None:
    """Make every unpickling in THIS process fail and leave a record of who tried.

    ``tests/test_no_unpickle.py`` runs a slice of the suite with it: workers are
    other processes (they still unpickle what the controller sends), so a record
    proves the controller unpickled something a worker sent.
    """

    def refuse(*args: Any, **kwargs: Any) -> Any:
        with open(record, "a") as f:
            f.write("".join(traceback.format_stack()) + "\n----\n")
        raise RuntimeError("unpickling is forbidden in the controller process")

    class RefusingUnpickler(pickle.Unpickler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            refuse()

    pickle.loads = refuse
    pickle.load = refuse
    pickle.Unpickler = RefusingUnpickler  # type: ignore[misc]
    cloudpickle.loads = refuse
    cloudpickle.load = refuse
    cloudpickle.cloudpickle.loads = refuse  # type: ignore[attr-defined]


if os.environ.get("COLOBUS_TEST_FORBID_UNPICKLE"):
    _forbid_unpickling(os.environ["COLOBUS_TEST_FORBID_UNPICKLE"])

from lifecycle import SHARED_LIVENESS_S, all_joined  # noqa: E402

import colobus as cb  # noqa: E402  (after the patch: no module keeps the real loads)


@pytest.fixture(scope="session")
def cluster() -> collections.abc.Iterator[cb.Controller]:
    """One 2-host x 4-CPU-device local cluster shared by the whole session (sync face);
    a star whatever ``COLOBUS_RELAYS`` says (``tests/relayed.py`` has one with a relay).
    The block view (``jax_distributed=False``): the tests on it are of that view (host
    code sees its host's block); ``job_cluster`` is the default view's.

    No test loses its hosts on purpose: a long liveness timeout keeps a machine
    loaded by another run from starving a host into loss (see :func:`all_joined`)."""
    with cb.local_cluster(hosts=2, devices_per_host=4, relays=0, jax_distributed=False,
                          liveness_timeout=SHARED_LIVENESS_S) as ctl:
        yield ctl



@pytest.fixture(scope="session")
def job_cluster() -> collections.abc.Iterator[cb.Controller]:
    """One 2-host x 2-CPU-device cluster in the default view, no option given: its hosts
    form one JAX job (the global view), shared by the files that test the job; each worker
    may be restarted once (one test, in tests/test_jaxjob.py, kills a host; the job forms
    again)."""
    with cb.local_cluster(hosts=2, devices_per_host=2, restart=1,
                          relays=0, liveness_timeout=SHARED_LIVENESS_S) as ctl:
        assert ctl.stats()["jax_job"]["state"] == "formed", ctl.stats()["jax_job"]
        yield ctl


@pytest.fixture
def job(job_cluster: cb.Controller) -> collections.abc.Iterator[cb.Controller]:
    """The shared JAX-job cluster, its job formed, made the default controller."""
    from colobus._controller.controller import _pop_current, _push_current

    all_joined(job_cluster)
    _push_current(job_cluster)
    try:
        yield job_cluster
    finally:
        _pop_current(job_cluster)


@pytest.fixture
def ctl(cluster: cb.Controller) -> collections.abc.Iterator[cb.Controller]:
    """The shared cluster, made the default controller for this test."""
    from colobus._controller.controller import _pop_current, _push_current

    all_joined(cluster)
    _push_current(cluster)
    try:
        yield cluster
    finally:
        _pop_current(cluster)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run the tests marked slow (long explorations)")


def _runs_checks_early() -> bool:
    # Not inside tests/test_no_unpickle.py's child session; not in an xdist worker (the
    # xdist controller starts them: it outlives the workers, and starts each once).
    return not (os.environ.get("COLOBUS_TEST_FORBID_UNPICKLE")
                or os.environ.get("PYTEST_XDIST_WORKER"))


def pytest_configure(config: pytest.Config) -> None:
    """The xdist controller: its early checks write where its workers will read them."""
    if _runs_checks_early() and getattr(config.option, "numprocesses", None):
        import early

        early.share()


def pytest_collection_finish(session: pytest.Session) -> None:
    """The long single-process checks start now, beside the suite (tests/early.py)."""
    if _runs_checks_early():
        import early

        early.start_collected(item.nodeid for item in session.items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """The xdist controller: a worker collected the session's tests; start their checks."""
    if _runs_checks_early():
        import early

        early.start_collected(ids)


def pytest_sessionfinish(session: pytest.Session) -> None:
    import shutil

    import early

    early.stop_all()
    if _JAX_CACHE is not None:  # the process that made it: the run's main one
        shutil.rmtree(_JAX_CACHE, ignore_errors=True)
    for folder in _PYCACHES:  # (the main process's: the folders it made)
        shutil.rmtree(folder, ignore_errors=True)


# Files whose tests make network-namespace hosts, sshd or Slurm daemons, or Docker
# containers, in two groups: under pytest-xdist (three workers by default, pyproject.toml)
# each group runs in one worker, one file after another; the two may run side by side
# (each bed picks its own subnet, names, ports and Compose project). The second holds
# the files of the session's sshd and Slurm beds, so each starts once. Every other file
# stays whole on a worker (its module fixtures start once). pytest_xdist_make_scheduler
# makes the groups.
BED_GROUPS = {
    "beds-netns": {"test_blip.py", "test_broadcast.py", "test_examples.py", "test_faults.py",
                   "test_transport.py"},
    "beds-launch": {"test_compose.py", "test_launch_cli.py", "test_launch_slurm_bed.py",
                    "test_launch_ssh.py", "test_slurmbed.py"},
}
BEDS = set().union(*BED_GROUPS.values())


def _group(nodeid: str) -> str:
    """A test's xdist group: its BED_GROUPS group for the BEDS files' tests, else its file."""
    path = nodeid.split("::", 1)[0]
    name = path.rsplit("/", 1)[-1]
    return next((group for group, files in BED_GROUPS.items() if name in files), path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` (pyproject.toml) with the groups of :func:`_group`, each sent
    whole to one worker. xdist's own loadgroup reads the group its workers append to each
    test's ``_nodeid`` from an ``xdist_group`` marker, but pytest 9's ``nodeid`` no longer
    reads ``_nodeid`` (xdist 3.8): every test was sent on its own, a file's module
    fixtures started on every worker, and all the beds ran side by side. Groups go out
    largest first, as xdist's do."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return ByGroup(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The BEDS files' tests get the marker ``bed``; the compose tests go last (their image
    builds beside the suite from its start: tests/early.py); tests marked ``slow`` stay
    out of the default run (and CI) unless ``--run-slow``."""
    for item in items:
        if item.path.name in BEDS:
            item.add_marker(pytest.mark.bed)  # the README's quick run: -m "not bed"
    items.sort(key=lambda item: item.path.name == "test_compose.py")  # (stable)
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# The real Slurm cluster (tests/slurmbed.py): fixtures `slurm_bed` (session) and `slurm`.
from slurm_fixtures import slurm, slurm_bed  # noqa: E402, F401

# An sshd in each host of a netns bed (tests/sshbed.py): `ssh_bed_session` and `ssh_bed`.
from sshbed import ssh_bed, ssh_bed_session  # noqa: E402, F401

