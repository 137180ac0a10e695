"""Nothing in the controller process unpickles what a worker sent.

Runs a slice of the suite (``early.NO_UNPICKLE_SLICE``: functions and their outputs
and errors, arrays of every dtype, colocated objects) in a child pytest whose process has
``pickle.loads``, ``pickle.load``, ``pickle.Unpickler`` and ``cloudpickle.loads``
replaced by functions that record the attempt and raise (``conftest.py``). The
workers are separate processes and still unpickle what the controller sends
them; the controller side must not need unpickling at all.
"""

from __future__ import annotations

import early


def test_suite_slice_passes_with_unpickling_forbidden_in_the_controller() -> None:
    # The child pytest over early.NO_UNPICKLE_SLICE, started with the session (tests/early.py)
    out = early.result("no-unpickle")
    tail = out.stdout[-4000:] + out.stderr[-2000:]
    record = out.files.get(early.NO_UNPICKLE_RECORD)
    assert record is None, "the controller unpickled:\n" + record[:4000]
    assert out.returncode == 0, tail
    assert " passed" in out.stdout and "failed" not in out.stdout, tail
