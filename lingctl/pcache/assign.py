"""Who writes what: place each write item on one of the ranks that hold it, so that nodes finish together.

The rule (PCache in the Ling report: spread the data-parallel group's writes over physical nodes instead of
concentrating them on rank 0):

1. Items only one rank holds (its shard of a sharded tensor) must be written by that rank; their bytes are
   counted first.
2. Replicated items go largest first to the holder on the node whose estimated finish time after taking
   the item, ``(node bytes + item bytes) / node bandwidth``, is least (ties: the lower node index); within
   that node, to the holder rank with the fewest bytes so far, so that per-rank staging and writer threads
   are balanced too (ties: the lower rank).

This is greedy list scheduling on machines of different speeds, largest item first. Items of one size held
by the same ranks (every expert's weights, every layer's norms) are placed as a block: the counts each node
receives are computed from the water level that the one-at-a-time greedy reaches, and only the last few
items go through the heap, so a million items plan in well under a second while the result is exactly what
placing them one at a time would give.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lingctl.pcache.topology import Topology


@dataclass(kw_only=True, slots=True)
class Placement:
    writers: np.ndarray  # int64 [items]: the rank that writes each item (its first ``kept_rows`` rows)
    rank_bytes: list[int]
    node_bytes: list[int]
    # Tail row ranges cut off items to even out the nodes: (item, first row, rows, writer rank).
    cuts: list[tuple[int, int, int, int]] = dataclasses.field(default_factory=list)
    kept_rows: np.ndarray | None = None  # int64 [items], when ``rows`` were given to ``place``

    def seconds(self, topology: Topology) -> float:
        """Estimated save time: the slowest node's bytes over its bandwidth (nodes write in parallel)."""
        return max(b / bw for b, bw in zip(self.node_bytes, topology.node_bandwidth))


def split_rows(shape: Sequence[int], itemsize: int, max_bytes: int) -> list[tuple[int, int]]:
    """``(start, rows)`` ranges along dim 0 so that each piece is at most ``max_bytes`` (at least one row);
    a single piece for scalars and tensors that already fit."""
    if not shape or max_bytes <= 0:
        return [(0, shape[0] if shape else 1)]
    rows = shape[0]
    row_bytes = itemsize * math.prod(shape[1:])
    total = rows * row_bytes
    if total <= max_bytes or rows <= 1:
        return [(0, rows)]
    per = max(1, max_bytes // max(row_bytes, 1))
    pieces = math.ceil(rows / per)
    # Even pieces rather than full ones plus a remainder: equal sizes place as one block (see module doc).
    per = math.ceil(rows / pieces)
    return [(s, min(per, rows - s)) for s in range(0, rows, per)]


def fill(loads: list[float], speeds: list[float], size: float, count: int) -> list[int]:
    """How many of ``count`` equal items of ``size`` each target gets when each item goes, one at a time, to
    the target whose finish time ``(load + size) / speed`` is least (ties: lower index). ``loads`` is
    updated in place."""
    m = len(loads)
    counts = [0] * m
    if count <= 0:
        return counts
    if m == 1 or size <= 0:
        target = 0 if m == 1 else min(range(m), key=lambda n: (loads[n] / speeds[n], n))
        counts[target] = count
        loads[target] += size * count
        return counts
    if count > 2 * m:
        # The water level T where sum(max(0, T*speed - load)) = count*size. Every finish time below T is
        # among the ``count`` smallest the greedy would pick, so all of them are taken at once (less one
        # per target, a margin for rounding); the rest go through the heap below.
        order = sorted(range(m), key=lambda n: loads[n] / speeds[n])
        sum_load = sum_speed = 0.0
        level = 0.0
        for i, n in enumerate(order):
            sum_load += loads[n]
            sum_speed += speeds[n]
            level = (count * size + sum_load) / sum_speed
            if i + 1 == m or level <= loads[order[i + 1]] / speeds[order[i + 1]]:
                break
        for n in range(m):
            take = max(0, math.floor((level * speeds[n] - loads[n]) / size) - 1)
            counts[n] = take
            loads[n] += take * size
        count -= sum(counts)
    heap = [((loads[n] + size) / speeds[n], n) for n in range(m)]
    heapq.heapify(heap)
    for _ in range(count):
        _, n = heap[0]
        counts[n] += 1
        loads[n] += size
        heapq.heapreplace(heap, ((loads[n] + size) / speeds[n], n))
    return counts


def _place_block(
    items: np.ndarray,
    size: float,
    node_groups: list[tuple[int, list[int]]],
    node_load: list[float],
    rank_load: list[float],
    speeds: Sequence[float],
    writers: np.ndarray,
) -> None:
    """Many items of one size and holder set: counts per node, then per rank within each node, by ``fill``."""
    loads = [node_load[n] for n, _ in node_groups]
    per_node = fill(loads, [speeds[n] for n, _ in node_groups], size, len(items))
    cursor = 0
    for (n, ranks), taken, new_load in zip(node_groups, per_node, loads):
        node_load[n] = new_load
        if not taken:
            continue
        rloads = [rank_load[r] for r in ranks]
        per_rank = fill(rloads, [1.0] * len(ranks), size, taken)
        for r, k, load in zip(ranks, per_rank, rloads):
            rank_load[r] = load
            writers[items[cursor : cursor + k]] = r
            cursor += k


def _class_heaps(
    node_groups: list[tuple[int, list[int]]], node_load: list[float], speeds: Sequence[float]
) -> list[tuple[float, list[tuple[float, int]]]]:
    """One heap of (load, node) per distinct bandwidth among a holder set's nodes: within a class the node
    with the least load finishes first whatever the item's size, so only each class's top is compared."""
    classes: dict[float, list[tuple[float, int]]] = {}
    for n, _ in node_groups:
        classes.setdefault(speeds[n], []).append((node_load[n], n))
    out = []
    for bw, heap in sorted(classes.items()):
        heapq.heapify(heap)
        out.append((bw, heap))
    return out


def _next_node(class_heaps: list[tuple[float, list[tuple[float, int]]]], node_load: list[float], size: float) -> int:
    """Take one item for the node with the least finish time; heap entries whose node gained bytes through
    another holder set since are refreshed first (loads only grow, so a stale entry is never too high)."""
    best: tuple[float, int] | None = None
    best_heap: list[tuple[float, int]] = []
    for bw, heap in class_heaps:
        while True:
            load, n = heap[0]
            current = node_load[n]
            if load == current:
                break
            heapq.heapreplace(heap, (current, n))
        candidate = ((load + size) / bw, n)
        if best is None or candidate < best:
            best, best_heap = candidate, heap
    assert best is not None
    n = best[1]
    node_load[n] += size
    heapq.heapreplace(best_heap, (node_load[n], n))
    return n


def place(
    sizes: Sequence[int] | np.ndarray,
    groups: Sequence[int] | np.ndarray,
    holder_sets: Sequence[Sequence[int]],
    topology: Topology,
    *,
    rows: Sequence[int] | np.ndarray | None = None,
    tolerance: float = 0.002,
) -> Placement:
    """Place items: item ``i`` has ``sizes[i]`` bytes and may be written by any rank of
    ``holder_sets[groups[i]]``. Deterministic: the same input gives the same placement.

    With ``rows`` (rows along dim 0 of each item; 1 = cannot be cut), the greedy result is then evened
    out: list scheduling leaves the nodes apart by up to one item, which matters when a node writes only a
    few dozen chunks. While the earliest and latest node differ by more than ``tolerance`` of the ideal
    time, rows are cut off the tail of a replicated item the latest node writes and handed to a holder on
    the earliest one, sized so that the two finish together.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    groups = np.asarray(groups, dtype=np.int64)
    if sizes.shape != groups.shape:
        raise ValueError(f"sizes and groups differ in length: {sizes.shape} vs {groups.shape}")
    sets = _holder_sets(holder_sets, topology.world_size)
    writers = np.full(len(sizes), -1, dtype=np.int64)
    single = np.array([len(h) == 1 for h in sets] or [False], dtype=bool)
    # 1. Rank-unique items are fixed; count them first.
    rank_load = _place_unique(sizes, groups, sets, single, writers, topology.world_size)
    node_load = [0.0] * topology.num_nodes
    for r, b in enumerate(rank_load):
        node_load[topology.rank_nodes[r]] += b
    # 2. Replicated items, largest first.
    replicated = np.flatnonzero(~single[groups]) if len(sizes) else np.zeros(0, dtype=np.int64)
    _place_replicated(replicated, sizes, groups, sets, topology, rank_load, node_load, writers)
    placement = Placement(writers=writers, rank_bytes=[], node_bytes=[])
    if rows is not None and len(sizes):
        rows = np.asarray(rows, dtype=np.int64)
        evener = _Evener(placement, sizes, rows, groups, sets, topology, rank_load, node_load)
        evener.run(~single[groups], tolerance)
    placement.rank_bytes = [int(round(x)) for x in rank_load]
    placement.node_bytes = [0] * topology.num_nodes
    for r, b in enumerate(placement.rank_bytes):
        placement.node_bytes[topology.rank_nodes[r]] += b
    return placement


def _holder_sets(holder_sets: Sequence[Sequence[int]], world: int) -> list[list[int]]:
    """Each holder set sorted and deduplicated, checked to name ranks of the world."""
    sets = [sorted(set(h)) for h in holder_sets]
    for g, holders in enumerate(sets):
        if not holders:
            raise ValueError(f"holder set {g} is empty")
        if holders[0] < 0 or holders[-1] >= world:
            raise ValueError(f"holder set {g} names rank {holders[-1]}, outside a world of {world}")
    return sets


def _place_unique(
    sizes: np.ndarray, groups: np.ndarray, sets: list[list[int]], single: np.ndarray, writers: np.ndarray, world: int
) -> list[float]:
    """Items only one rank holds go to that rank; the bytes each rank then writes."""
    if not len(sizes):
        return [0.0] * world
    unique_mask = single[groups]
    first = np.array([h[0] for h in sets], dtype=np.int64)
    writers[unique_mask] = first[groups[unique_mask]]
    per_rank = np.bincount(writers[unique_mask], weights=sizes[unique_mask], minlength=world)
    return [float(x) for x in per_rank]


def _place_replicated(
    items: np.ndarray,
    sizes: np.ndarray,
    groups: np.ndarray,
    sets: list[list[int]],
    topology: Topology,
    rank_load: list[float],
    node_load: list[float],
    writers: np.ndarray,
) -> None:
    """Replicated ``items``, largest first (ties by holder set, then item order). A long run of one size and
    holder set goes as a block (``_place_block``), a short one item by item through per-bandwidth heaps."""
    if not len(items):
        return
    # Holders of each set, grouped by node (node order, rank order within).
    by_node = [_holders_by_node(holders, topology.rank_nodes) for holders in sets]
    speeds = topology.node_bandwidth
    heaps: dict[int, list[tuple[float, list[tuple[float, int]]]]] = {}
    order = items[np.lexsort((items, groups[items], -sizes[items]))]
    key_size, key_group = sizes[order], groups[order]
    breaks = np.flatnonzero((np.diff(key_size) != 0) | (np.diff(key_group) != 0)) + 1
    starts = np.concatenate(([0], breaks)).tolist()
    ends = np.concatenate((breaks, [len(order)])).tolist()
    for s, e in zip(starts, ends):
        size = float(key_size[s])
        g = int(key_group[s])
        node_groups = by_node[g]
        if e - s > 2 * len(node_groups):
            _place_block(order[s:e], size, node_groups, node_load, rank_load, speeds, writers)
            continue
        if g not in heaps:
            heaps[g] = _class_heaps(node_groups, node_load, speeds)
        ranks_of = dict(node_groups)
        for i in order[s:e].tolist():
            ranks = ranks_of[_next_node(heaps[g], node_load, size)]
            r = ranks[0] if len(ranks) == 1 else min(ranks, key=lambda x: (rank_load[x], x))
            rank_load[r] += size
            writers[i] = r


def _holders_by_node(holders: list[int], rank_nodes: Sequence[int]) -> list[tuple[int, list[int]]]:
    nodes: dict[int, list[int]] = {}
    for r in holders:
        nodes.setdefault(rank_nodes[r], []).append(r)
    return sorted(nodes.items())


class _Evener:
    """The evening-out pass of ``place``: tail rows moved from the latest node to an earlier one that holds
    the item, until nodes finish within the tolerance or no move helps."""

    def __init__(
        self,
        placement: Placement,
        sizes: np.ndarray,
        rows: np.ndarray,
        groups: np.ndarray,
        sets: list[list[int]],
        topology: Topology,
        rank_load: list[float],
        node_load: list[float],
    ) -> None:
        self.placement, self.sizes, self.rows, self.groups, self.sets = placement, sizes, rows, groups, sets
        self.rank_nodes, self.bw, self.nodes = topology.rank_nodes, topology.node_bandwidth, topology.num_nodes
        self.rank_load, self.node_load = rank_load, node_load
        self.kept = rows.copy()
        placement.kept_rows = self.kept
        self.held_on = [frozenset(self.rank_nodes[r] for r in h) for h in sets]

    def run(self, replicated: np.ndarray, tolerance: float) -> None:
        nodes, bw, node_load = self.nodes, self.bw, self.node_load
        if nodes < 2:
            return
        ideal = sum(node_load) / sum(bw)
        by_node = self._cuttable(replicated)
        stuck: set[tuple[int, int]] = set()
        for _ in range(8 * nodes):
            finish = [node_load[n] / bw[n] for n in range(nodes)]
            hi = max(range(nodes), key=lambda n: (finish[n], -n))
            if finish[hi] - min(finish) <= tolerance * ideal:
                return
            moved = False
            for lo in sorted(range(nodes), key=lambda n: (finish[n], n)):
                if lo == hi or finish[hi] - finish[lo] <= tolerance * ideal or (hi, lo) in stuck:
                    continue
                moved = self._move(by_node[hi], hi, lo)
                if moved:
                    break
                stuck.add((hi, lo))
            if not moved:
                return

    def _cuttable(self, replicated: np.ndarray) -> list[list[int]]:
        """Per node, its cuttable replicated items, largest first: the candidates to take rows from."""
        cuttable = np.flatnonzero(replicated & (self.rows > 1))
        writers = self.placement.writers
        on_node = np.asarray(self.rank_nodes, dtype=np.int64)[writers[cuttable]] if len(cuttable) else cuttable
        by_node = [cuttable[on_node == n] for n in range(self.nodes)]
        return [items[np.argsort(-self.sizes[items], kind="stable")].tolist() for items in by_node]

    def _move(self, candidates: list[int], hi: int, lo: int) -> bool:
        """Cut tail rows off one of ``hi``'s items for a holder on ``lo``, so that the two finish together."""
        bw, node_load, rank_load, kept = self.bw, self.node_load, self.rank_load, self.kept
        # Bytes x that make the two finish together: (L_hi - x) / bw_hi = (L_lo + x) / bw_lo.
        want = (node_load[hi] * bw[lo] - node_load[lo] * bw[hi]) / (bw[lo] + bw[hi])
        for item in candidates[:64]:
            if kept[item] <= 1 or lo not in self.held_on[self.groups[item]]:
                continue
            row_bytes = self.sizes[item] / self.rows[item]
            k = min(int(kept[item]) - 1, int(round(want / row_bytes)))
            if k <= 0:
                continue
            start = int(kept[item]) - k
            holders = (r for r in self.sets[self.groups[item]] if self.rank_nodes[r] == lo)
            target = min(holders, key=lambda r: (rank_load[r], r))
            nbytes = k * row_bytes
            kept[item] = start
            rank_load[int(self.placement.writers[item])] -= nbytes
            rank_load[target] += nbytes
            node_load[hi] -= nbytes
            node_load[lo] += nbytes
            self.placement.cuts.append((int(item), start, k, int(target)))
            return True
        return False
