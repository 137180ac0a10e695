"""Pytest fixtures for the real Slurm bed (:mod:`slurmbed`); conftest imports them.

- ``slurm_bed`` (session): one 2-node :class:`slurmbed.SlurmBed` for the whole
  run, started on first use (about a second), closed at the end; skips with
  the reason where the bed cannot run (not root, no namespaces, no Slurm).
  While it is open ``os.environ["SLURM_CONF"]`` points at its config.
- ``slurm``: the same bed for one test, whose jobs are all cancelled after it
  (and every node idle again), so tests do not see each other's jobs.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from slurmbed import SlurmBed, unavailable_reason


@pytest.fixture(scope="session")
def slurm_bed() -> Iterator[SlurmBed]:
    """A real 2-node Slurm cluster (slurmctld + a slurmd per netns + munged), session-wide."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    bed = SlurmBed(nodes=2, cpus_per_node=4)
    try:
        bed.create()
        yield bed
    finally:
        bed.close()


@pytest.fixture
def slurm(slurm_bed: SlurmBed) -> Iterator[SlurmBed]:
    """The session's Slurm bed; every job is cancelled after the test, all nodes idle again."""
    yield slurm_bed
    slurm_bed.scancel_all()
    slurm_bed.wait_nodes_idle(30)
