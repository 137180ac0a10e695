"""Resharding plans: which pieces of an array each host lacks, and where each comes from.

Pure layout math on :mod:`colobus._model.blocks`. For a global array moving from
one sharding to another, every destination host's new block is cut into

* **local** pieces: the part of the new block the host already holds under the
  old sharding (one box: the intersection of two boxes). These never travel.
* **moves**: the rest, as boxes of at most ``chunk_bytes`` each, every one read
  from one source host that holds it. A box several destinations need (the
  same source region, e.g. sharded -> replicated) is one move with several
  destinations: it is fetched once and sent to each.

Boxes are tuples of ``(start, stop)`` per array dimension. A move's ``box`` is
in the *source host's block* coordinates (what it fetches from its stored
block); each destination's box is in *its new block's* coordinates.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .blocks import HostBlock, host_blocks
from .sharding import Sharding

__all__ = ["Box", "Move", "ReshardPlan", "plan_reshard"]

Box = tuple[tuple[int, int], ...]

CHUNK_BYTES = 8 << 20
"""Moves are cut into boxes of at most this many bytes (at least one row of the last
dimension): the controller holds a bounded window of them at a time."""


@dataclass(frozen=True, slots=True)
class Move:
    """One box read once from ``source`` and written into each destination's block."""

    source: int
    box: Box  # in the source host's block
    to: tuple[tuple[int, Box], ...]  # (destination host, box in its new block)
    nbytes: int


@dataclass(slots=True)
class ReshardPlan:
    """Everything a reshard moves and keeps.

    Attributes:
        blocks: each destination host's new block.
        local: per destination host, ``(box in its old block, box in its new block)``
            of what it already holds (at most one: two boxes intersect in one box).
        moves: what travels, in an order that spreads the sources.
        pieces: per destination host, how many moves write into its block.
        lenders: the hosts that send data (their source entries are held until the
            reshard ends).
    """

    blocks: dict[int, HostBlock]
    local: dict[int, list[tuple[Box, Box]]] = field(default_factory=dict)
    moves: list[Move] = field(default_factory=list)
    pieces: dict[int, int] = field(default_factory=dict)
    lenders: set[int] = field(default_factory=set)

    @property
    def hosts(self) -> list[int]:
        """Every host the reshard involves: destinations and lenders."""
        return sorted(set(self.blocks) | self.lenders)

    @property
    def moved_bytes(self) -> int:
        """Bytes written into destination blocks over the wire (per destination)."""
        return sum(m.nbytes * len(m.to) for m in self.moves)


def _box(block: HostBlock) -> Box:
    return tuple((s.start, s.stop) for s in block.index)


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    if any(lo >= hi for lo, hi in out):
        return None
    return out


def _shift(box: Box, origin: Box) -> Box:
    return tuple((lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin, strict=True))


def _size(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


def _cells(region: Box, cuts: Sequence[set[int]]) -> list[Box]:
    """``region`` cut along every boundary in ``cuts`` (per dimension)."""
    per_dim = []
    for (lo, hi), cs in zip(region, cuts, strict=True):
        points = sorted({lo, hi} | {c for c in cs if lo < c < hi})
        per_dim.append(list(itertools.pairwise(points)))
    return [tuple(c) for c in itertools.product(*per_dim)]


def chunks(box: Box, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> list[Box]:
    """``box`` cut into C-order slabs of at most ``chunk_bytes`` (never below one element
    row of the innermost dimensions that fit)."""
    if not box:
        return [box]
    extents = [hi - lo for lo, hi in box]
    inner = max(1, itemsize)
    d = len(box) - 1
    # the outermost dimension d whose inner slab (dims after d) fits in a chunk
    while d > 0 and inner * extents[d] <= chunk_bytes:
        inner *= extents[d]
        d -= 1
    if inner * extents[d] <= chunk_bytes:
        return [box]
    step = max(1, chunk_bytes // inner)
    out: list[Box] = []
    outer = [range(lo, hi) for lo, hi in box[:d]]
    for prefix in itertools.product(*outer):
        head = tuple((i, i + 1) for i in prefix)
        lo, hi = box[d]
        for s in range(lo, hi, step):
            out.append((*head, (s, min(s + step, hi)), *box[d + 1:]))
    return out


def plan_reshard(old: Sharding, new: Sharding, shape: Sequence[int], itemsize: int,
                 chunk_bytes: int | None = None) -> ReshardPlan:
    """What moves, and from where, to take an array of ``shape`` from ``old`` to ``new``.

    A destination keeps what its old block covers of its new block; every other
    region comes from one source host holding it: sources are tried starting from
    the destination's own position among them, so replicas share the load.

    Raises:
        ValueError: as :func:`~colobus._model.blocks.host_blocks` for either layout.
    """
    chunk = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    src = host_blocks(old, shape)
    dst = host_blocks(new, shape)
    plan = ReshardPlan(dst)
    src_boxes = {h: _box(b) for h, b in src.items()}
    sources = sorted(src_boxes)
    cuts = [set() for _ in shape]  # type: list[set[int]]
    for box in src_boxes.values():
        for d, (lo, hi) in enumerate(box):
            cuts[d].update((lo, hi))
    wanted: dict[tuple[int, Box], list[tuple[int, Box]]] = {}
    for k, (h, block) in enumerate(sorted(dst.items())):
        region = _box(block)
        plan.local[h] = []
        if _size(region) == 0:
            continue
        mine = _intersect(region, src_boxes[h]) if h in src_boxes else None
        if mine is not None:
            plan.local[h].append((_shift(mine, src_boxes[h]), _shift(mine, region)))
        if mine == region:
            continue
        order = sources[k % len(sources):] + sources[:k % len(sources)]
        for cell in _cells(region, cuts):
            if mine is not None and _intersect(cell, mine) == cell:
                continue
            s = next(s for s in order if _intersect(cell, src_boxes[s]) == cell)
            wanted.setdefault((s, cell), []).append((h, _shift(cell, region)))
    # merge: one move per (source, destinations) whose cells are that source's whole overlap
    by_source: dict[int, list[tuple[Box, list[tuple[int, Box]]]]] = {}
    for (s, cell), to in wanted.items():
        by_source.setdefault(s, []).append((cell, to))
    for s, cells in sorted(by_source.items()):
        for cell, to in _merge(cells):
            plan.lenders.add(s)
            for piece in chunks(cell, itemsize, chunk):
                local = _shift(piece, src_boxes[s])
                targets = tuple((h, _shift_into(piece, cell, box)) for h, box in to)
                plan.moves.append(Move(s, local, targets, _size(piece) * itemsize))
    for m in plan.moves:
        for h, _ in m.to:
            plan.pieces[h] = plan.pieces.get(h, 0) + 1
    plan.moves = _interleave(plan.moves)
    return plan


def _shift_into(piece: Box, cell: Box, at: Box) -> Box:
    """``piece`` (inside ``cell``, global) at the place ``cell`` has in a block (``at``)."""
    return tuple((a0 + p0 - c0, a0 + p1 - c0)
                 for (p0, p1), (c0, _), (a0, _) in zip(piece, cell, at, strict=True))


def _merge(cells: list[tuple[Box, list[tuple[int, Box]]]]
           ) -> list[tuple[Box, list[tuple[int, Box]]]]:
    """Adjacent cells of one source with the same destinations joined along each dimension
    where they line up (the common case: a source's whole block is one move)."""
    changed = True
    items = [(c, sorted(to)) for c, to in cells]
    while changed:
        changed = False
        for i, j in itertools.permutations(range(len(items)), 2):
            (a, ta), (b, tb) = items[i], items[j]
            if [h for h, _ in ta] != [h for h, _ in tb]:
                continue
            joined = _join(a, b)
            if joined is None:
                continue
            ok = all(_join(x, y) == _shift_box(joined, a, x)
                     for (_, x), (_, y) in zip(ta, tb, strict=True))
            if not ok:
                continue
            items[i] = (joined, [(h, _shift_box(joined, a, x)) for h, x in ta])
            del items[j]
            changed = True
            break
    return items


def _join(a: Box, b: Box) -> Box | None:
    """The box ``a`` and ``b`` make when they differ in one dimension, where they touch."""
    diff = [d for d, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    if len(diff) != 1:
        return None
    d = diff[0]
    if a[d][1] != b[d][0]:
        return None
    return (*a[:d], (a[d][0], b[d][1]), *a[d + 1:])


def _shift_box(joined: Box, a: Box, x: Box) -> Box:
    """``joined`` (which starts where ``a`` starts) placed where ``a`` sits at ``x``."""
    return tuple((x0, x0 + (j1 - j0))
                 for (j0, j1), (x0, _) in zip(joined, x, strict=True))


def _interleave(moves: list[Move]) -> list[Move]:
    """Round-robin over sources, so a bounded window keeps every source busy."""
    by: dict[int, list[Move]] = {}
    for m in moves:
        by.setdefault(m.source, []).append(m)
    queues = [by[s] for s in sorted(by)]
    out: list[Move] = []
    for group in itertools.zip_longest(*queues):
        out.extend(m for m in group if m is not None)
    return out
