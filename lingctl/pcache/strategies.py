"""Who writes each checkpoint item under three strategies (``compare.py`` sets them side by side):

1. ``rank0``: DCP with ``dedup_save_to_lowest_rank=True``. Each replicated item is written by its lowest
   holder rank, so rank 0 (and the lowest rank of each tp/pp group) writes every replicated byte.
2. ``dcp``: DCP's default planner in torch 2.13, re-implemented from
   ``torch/distributed/checkpoint/_dedup_save_plans.py``. Items are taken in the order they first appear
   scanning rank 0's plan, then rank 1's, ... (every plan lists its items in state-dict order), and each
   goes to the holder with the fewest bytes planned so far (ties: the first holder in the iteration order
   of the Python set of its plan indices, which is the lowest rank for small worlds). An item is charged
   ``tensor_storage_size() or 1``, which is the size of the whole tensor even for a shard of it (the
   ``size`` of a DTensor's ``TensorWriteData`` is the global one); nodes and bandwidths play no part.
3. ``lingctl``: items larger than the chunk size are cut along dim 0 into even row ranges (``split_rows``),
   then placed by ``lingctl.pcache.assign.place`` so that nodes finish together.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lingctl.pcache.assign import Placement, fill, place
from lingctl.pcache.layout import Items
from lingctl.pcache.topology import Topology


@dataclass(kw_only=True, slots=True)
class Chunks:
    parent: np.ndarray  # int64: the item each chunk is cut from (ascending)
    start: np.ndarray  # int64: first row along dim 0 within the item
    rows: np.ndarray  # int64
    sizes: np.ndarray  # int64 bytes


def chunk_items(items: Items, max_bytes: int) -> Chunks:
    """``split_rows`` applied to every item at once: the same row ranges, without a Python call per item."""
    n = len(items)
    sizes = items.sizes
    ndim = np.fromiter((len(s) for s in items.shapes), dtype=np.int64, count=n)
    rows = np.fromiter((s[0] if s else 1 for s in items.shapes), dtype=np.int64, count=n)
    row_bytes = np.where(rows > 0, sizes // np.maximum(rows, 1), 0)
    split = (ndim > 0) & (sizes > max_bytes) & (rows > 1) & (max_bytes > 0)
    per = np.maximum(1, max_bytes // np.maximum(row_bytes, 1))
    # Even pieces, as split_rows cuts them (equal sizes place as one block).
    per = np.maximum(1, -(-rows // np.maximum(1, -(-rows // per))))
    pieces = np.where(split, -(-rows // per), 1)
    parent = np.repeat(np.arange(n, dtype=np.int64), pieces)
    first = np.cumsum(pieces) - pieces
    k = np.arange(len(parent), dtype=np.int64) - first[parent]
    start = np.where(split[parent], k * per[parent], 0)
    chunk_rows = np.where(split[parent], np.minimum(per[parent], rows[parent] - start), rows[parent])
    chunk_sizes = np.where(split[parent], chunk_rows * row_bytes[parent], sizes[parent])
    return Chunks(parent=parent, start=start, rows=chunk_rows, sizes=chunk_sizes)


def lowest_writers(items: Items) -> np.ndarray:
    """``dedup_save_to_lowest_rank=True``: every item to its lowest holder."""
    first = np.array([h[0] for h in items.holder_sets], dtype=np.int64)
    return first[items.groups]


def dcp_writers(items: Items) -> np.ndarray:
    """The writer of each item under torch 2.13's ``dedup_save_plans`` (the default planner)."""
    n = len(items)
    sets = items.holder_sets
    first = np.array([h[0] for h in sets], dtype=np.int64)
    world = max(h[-1] for h in sets) + 1 if sets else 0
    # An item first appears in its lowest holder's plan; plans are scanned in rank order.
    order = np.lexsort((np.arange(n), first[items.groups]))
    weight = np.where(items.tensor_sizes > 0, items.tensor_sizes, 1)[order]  # `tensor_storage_size() or 1`
    groups = items.groups[order]
    writers = np.empty(n, dtype=np.int64)
    if not n:
        return writers
    load = [0] * world
    ties = [_set_order(h) for h in sets]
    # Runs of one holder set and one size: the greedy then only depends on the loads at the run's start.
    change = np.flatnonzero((np.diff(groups) != 0) | (np.diff(weight) != 0)) + 1
    starts = np.concatenate(([0], change)).tolist()
    ends = np.concatenate((change, [n])).tolist()
    for s, e in zip(starts, ends):
        g, size, count = int(groups[s]), int(weight[s]), e - s
        targets = ties[g]
        if len(targets) == 1:
            writers[order[s:e]] = targets[0]
            load[targets[0]] += size * count
        elif count <= 4:
            for i in order[s:e].tolist():
                r = min(targets, key=load.__getitem__)  # min() keeps the first of equals, as torch's does
                load[r] += size
                writers[i] = r
        else:
            writers[order[s:e]] = _greedy_block(targets, load, size, count)
    return writers


def _set_order(holders: tuple[int, ...]) -> list[int]:
    """Holders in the iteration order of the set torch builds by adding plan indices in rank order: its
    ``min(..., key=size)`` breaks ties by that order."""
    plans: set[int] = set()
    for r in holders:
        plans.add(r)
    return list(plans)


def _greedy_block(targets: list[int], load: list[int], size: int, count: int) -> np.ndarray:
    """The ranks ``count`` equal items go to, one at a time to the least-loaded target (ties: first in
    ``targets``). ``fill`` gives how many each target takes; the k-th item a target takes is chosen at
    load ``start + k * size``, so the picks in order are those loads sorted, ties by target position."""
    start = [float(load[r]) for r in targets]
    counts = fill(list(start), [1.0] * len(targets), float(size), count)
    pos = np.repeat(np.arange(len(targets), dtype=np.int64), counts)
    first = np.cumsum(counts) - counts
    k = np.arange(count, dtype=np.int64) - first[pos]
    level = np.array([load[r] for r in targets], dtype=np.int64)[pos] + k * size
    picks = pos[np.lexsort((pos, level))]
    for r, c in zip(targets, counts):
        load[r] += c * size
    return np.asarray(targets, dtype=np.int64)[picks]


def lingctl_writers(items: Items, topology: Topology, chunk_bytes: int) -> tuple[Chunks, np.ndarray]:
    """The pieces the lingctl plan writes (items cut at ``chunk_bytes``, then the tails its evening-out pass
    cut off) and the rank that writes each."""
    chunks = chunk_items(items, chunk_bytes)
    placement = place(chunks.sizes, items.groups[chunks.parent], items.holder_sets, topology, rows=chunks.rows)
    return _apply_cuts(chunks, placement)


def _apply_cuts(chunks: Chunks, placement: Placement) -> tuple[Chunks, np.ndarray]:
    """The pieces the planner really writes: each chunk less the tail rows its evening-out pass cut off,
    plus those tails (``place(..., rows=)``), ordered by item and row as ``Chunks`` are."""
    kept = placement.kept_rows if placement.kept_rows is not None else chunks.rows
    row_bytes = chunks.sizes // np.maximum(chunks.rows, 1)
    sizes = np.where(kept == chunks.rows, chunks.sizes, kept * row_bytes)
    parent, start, rows, writers = [chunks.parent], [chunks.start], [kept], [placement.writers]
    if placement.cuts:
        cut = np.asarray(placement.cuts, dtype=np.int64)  # (chunk, first row, rows, writer)
        parent.append(chunks.parent[cut[:, 0]])
        start.append(chunks.start[cut[:, 0]] + cut[:, 1])
        rows.append(cut[:, 2])
        writers.append(cut[:, 3])
        sizes = np.concatenate([sizes, cut[:, 2] * row_bytes[cut[:, 0]]])
    parent_a, start_a = np.concatenate(parent), np.concatenate(start)
    order = np.lexsort((start_a, parent_a))
    out = Chunks(parent=parent_a[order], start=start_a[order], rows=np.concatenate(rows)[order], sizes=sizes[order])
    return out, np.concatenate(writers)[order]
