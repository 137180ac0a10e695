"""How long the command line's quick commands and ``import colobus`` take, as a user sees it.

Each row starts a fresh interpreter (``--runs`` times, alternating the rows so that the
machine's load falls on all of them alike) and prints the median and the fastest wall
time and the median CPU time (user + system, of the child). Wall time on a loaded
machine follows the load; the CPU time much less, and the fastest run is the closest
to an idle machine's figure.

    python benchmarks/cli_start.py                 # 15 runs of each row
    python benchmarks/cli_start.py --runs 5 --with-jax

``--with-jax`` adds ``python -c "import jax"``, the cost these commands no longer pay.
The tests check that the quick commands do not import JAX
(``tests/test_first_hour.py``); this measures, and asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _rows(with_jax: bool, key_dir: str) -> list[tuple[str, list[str]]]:
    script = str(Path(sys.executable).parent / "colobus")
    if not os.path.exists(script):
        script = shutil.which("colobus") or script
    rows = [
        ("python -c pass", [sys.executable, "-c", "pass"]),
        ("colobus --version", [script, "--version"]),
        ("colobus --help", [script, "--help"]),
        ("colobus keygen PATH", [script, "keygen", "--force", os.path.join(key_dir, "k")]),
        ("python -c 'import colobus'", [sys.executable, "-c", "import colobus"]),
    ]
    if with_jax:
        rows.append(("python -c 'import jax'", [sys.executable, "-c", "import jax"]))
    return rows


def _one(argv: list[str]) -> tuple[float, float]:
    """(wall seconds, child CPU seconds) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--with-jax", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = _rows(args.with_jax, tmp)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in rows}
        for _, argv in rows:  # a first, unmeasured run of each: the page cache
            _one(argv)
        for _ in range(args.runs):
            for name, argv in rows:
                times[name].append(_one(argv))
    print(f"{'command':<30} {'wall median':>12} {'wall fastest':>13} {'CPU median':>11}"
          f"   ({args.runs} runs each, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})")
    for name, _ in rows:
        walls = [w for w, _ in times[name]]
        cpus = [c for _, c in times[name]]
        print(f"{name:<30} {statistics.median(walls):>11.3f}s {min(walls):>12.3f}s "
              f"{statistics.median(cpus):>10.3f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
