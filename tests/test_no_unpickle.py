"""Nothing in the controller process unpickles what a worker sent.

Runs a slice of the suite (functions and their outputs and errors, arrays of
every dtype, colocated objects) in a child pytest whose process has
``pickle.loads``, ``pickle.load``, ``pickle.Unpickler`` and ``cloudpickle.loads``
replaced by functions that record the attempt and raise (``conftest.py``). The
workers are separate processes and still unpickle what the controller sends
them; the controller side must not need unpickling at all.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

SLICE = [
    "tests/test_functions.py",
    "tests/test_objects.py",
    "tests/test_arrays.py::test_round_trip_every_dtype",
    "tests/test_arrays.py::test_round_trip_pytrees",
    "tests/test_arrays.py::test_round_trip_scalars",
    "tests/test_arrays.py::test_strings_exact",
    "tests/test_arrays.py::test_ml_dtypes_keep_their_type",
    "tests/test_smoke.py",
]


def test_suite_slice_passes_with_unpickling_forbidden_in_the_controller(
        tmp_path: pathlib.Path) -> None:
    record = tmp_path / "unpickled-in-controller.txt"
    env = dict(os.environ, COLOBUS_TEST_FORBID_UNPICKLE=str(record))
    env.pop("PYTEST_XDIST_WORKER", None)  # the child is a session of its own
    root = pathlib.Path(__file__).resolve().parent.parent
    # In one process (-n 0): the patch that forbids unpickling is in that process.
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider",
         *SLICE],
        cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    tail = out.stdout[-4000:] + out.stderr[-2000:]
    assert not record.exists(), "the controller unpickled:\n" + record.read_text()[:4000]
    assert out.returncode == 0, tail
    assert " passed" in out.stdout and "failed" not in out.stdout, tail
