"""JAX's colocated Python user guide as a client: every cell, run as a plain script.

``userguide_client.py`` is the guide's code with its imports changed (see its header);
it asserts, cell by cell, what the guide shows, in a ``with cb.local_cluster(...)``
script of its own, as a porting user runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_every_cell_of_the_user_guide_runs_as_the_guide_shows(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, str(HERE / "userguide_client.py"), str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0 and "the guide ran" in out, (
        f"exit {proc.returncode}\n{out[-4000:]}\n{proc.stderr[-4000:]}")
    for cell in range(1, 11):
        assert f"cell {cell} ok" in out, out
    assert "cell 10, first calls ok" in out
    # The class's __init__ and __del__ ran on both hosts (their prints, relayed).
    for host in (0, 1):
        assert f"[stdout:{host}] Adder created" in out, out
        assert f"[stdout:{host}] Adder destroyed" in out, out
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
