"""A/B pairs of ``colobus bench`` runs: is a change (or an option) worth its cost?

``python benchmarks/ab.py GROUP [--row ROW] [--pairs N] [--a ARGS] [--b ARGS] [--quick]``

Runs ``colobus bench GROUP --no-peers`` as side A and as side B, alternating
which goes first in each pair (A B, B A, ...), and reads ROW's colobus figure
(default: the row named like the group, e.g. ``pipelined``) from each run's
JSON. It prints both sides' medians, and the median and
quartiles of the per-pair ratios ``B / A``. On a shared or small machine the
rate of one run drifts by several per cent from minute to minute; the ratio
within a pair, taken seconds apart, drifts much less, which is why pairs are
compared rather than two separate series.

Sides differ by extra ``colobus bench`` arguments (``--b=--metrics``: metrics
off against on) or by environment (``--b-env NAME=VALUE``, repeatable). To
compare two checkouts, point one side at the other's tree
(``--a-env PYTHONPATH=/tmp/old``, e.g. a ``git worktree``). Every run starts in
a scratch directory, so the directory this is run from never shadows it (``-m``
puts the current directory first on ``sys.path``), and the script prints which
``colobus`` each side imports.

Example (what metrics cost pipelined calls; docs/observability.md)::

    python benchmarks/ab.py pipelined --pairs 24 --b=--metrics
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_once(group: str, row: str, extra: list[str], env: dict[str, str],
             quick: bool) -> float:
    """One ``colobus bench GROUP`` run; ROW's colobus figure."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        argv = [sys.executable, "-m", "colobus", "bench", group, "--no-peers", "--json", str(out),
                *(["--quick"] if quick else []), *extra]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                              env={**os.environ, **env}, cwd=tmp)
        if proc.returncode != 0:
            raise SystemExit(f"colobus bench failed ({' '.join(argv[2:])}):\n{proc.stderr[-2000:]}")
        doc = json.loads(out.read_text())
    bench = doc["benchmarks"].get(row)
    if bench is None:
        raise SystemExit(f"colobus bench {group} has no row {row!r}; rows it has: "
                         f"{', '.join(sorted(doc['benchmarks']))}")
    return float(bench["colobus"])


def which(env: dict[str, str]) -> str:
    """The ``colobus`` package a side's runs import."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-c", "import colobus; print(colobus.__file__)"],
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, **env}, cwd=tmp)
    return proc.stdout.strip() or proc.stderr.strip()[-200:]


def _env(pairs: list[str]) -> dict[str, str]:
    out = {}
    for item in pairs:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--a-env/--b-env take NAME=VALUE, got {item!r}")
        out[name] = value
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("group", help="a colobus bench group, e.g. pipelined or calls")
    p.add_argument("--row", help="the row to compare (default: the group's name)")
    p.add_argument("--pairs", type=int, default=16, help="A/B pairs to run (default 16)")
    p.add_argument("--a", default="", help="extra colobus bench arguments for side A")
    p.add_argument("--b", default="", help="extra colobus bench arguments for side B")
    p.add_argument("--a-env", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--b-env", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--quick", action="store_true", help="colobus bench --quick sizes")
    args = p.parse_args(argv)
    if args.pairs < 1:
        p.error("--pairs must be at least 1")
    row = args.row or args.group
    sides = {"A": (args.a.split(), _env(args.a_env)), "B": (args.b.split(), _env(args.b_env))}
    results: dict[str, list[float]] = {"A": [], "B": []}
    for side, (_, env) in sides.items():
        print(f"side {side} imports {which(env)}", flush=True)
    for i in range(args.pairs):
        for side in ("A", "B") if i % 2 == 0 else ("B", "A"):
            extra, env = sides[side]
            results[side].append(run_once(args.group, row, extra, env, args.quick))
        print(f"pair {i + 1}: A {results['A'][-1]:,.1f}  B {results['B'][-1]:,.1f}  "
              f"B/A {results['B'][-1] / results['A'][-1]:.3f}", flush=True)
    ratios = [b / a for a, b in zip(results["A"], results["B"], strict=True)]
    print(f"{row}: A median {statistics.median(results['A']):,.1f}, "
          f"B median {statistics.median(results['B']):,.1f}")
    line = f"B/A per pair: median {statistics.median(ratios):.3f}"
    if len(ratios) >= 4:
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        line += f", quartiles {q1:.3f} / {q3:.3f}"
    print(line + f" ({len(ratios)} pairs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
