"""Who writes which checkpoint bytes under four strategies, side by side.

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
4. ``bound``: no placement finishes sooner than ``max(total bytes / sum of bandwidths, max over nodes of
   the bytes only that node can write / its bandwidth)``; bytes only a node can write are those of items
   whose holders all sit on it (rank-unique shards among them). The same holds for any set of nodes (the
   bytes of items whose holders all sit in the set, over the set's bandwidth); the node sets of the
   holder sets (one pipeline stage's nodes, say) are checked too, which tightens the bound under pp.

Time model: nodes write in parallel, each at its own bandwidth, ranks of a node share it; a save takes
the slowest node's bytes over its bandwidth. Metadata, fsync and the collective that exchanges plans are
left out, the same for every strategy.

Staging memory model, peak per rank: ``dcp.async_save`` copies the rank's whole local state before
writing, so it stages every byte the rank holds (``async_save`` column, for both DCP strategies); a
synchronous DCP save may clone the item being written, so it needs up to the largest item the rank writes
(``sync``). The lingctl writer streams through a bounded buffer: at most ``min(buffer, largest chunk the
rank writes)`` (contiguous CPU tensors are written without a copy; the bound is what is reported).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np

from lingctl.core.errors import UsageError
from lingctl.pcache.assign import Placement, fill, place
from lingctl.pcache.layout import DEFAULT_ORDER, OPTIMIZERS, Items, Parallelism, param_dtype, write_items
from lingctl.pcache.model_tensors import load_model
from lingctl.pcache.topology import Topology, parse_bandwidth, parse_rank_map

log = logging.getLogger(__name__)

MIB = 2**20
# The plan lists every rank and places every item over its holders in Python: time grows a little faster
# than items x ranks (Ling-plus, pure data parallel: ~4 s at 8,192 ranks, ~90 s at 32,768 on a busy 2-core
# machine). Larger worlds are refused at once rather than left to run for minutes.
MAX_RANKS = 16_384
STRATEGIES = {"rank0": "rank-0 writers", "dcp": "DCP default", "lingctl": "lingctl plan", "bound": "lower bound"}


def _check_world(world: int, what: str) -> None:
    if world > MAX_RANKS:
        raise UsageError(
            f"{what} = {world:,} ranks; plan computes at most {MAX_RANKS:,}",
            hint="plan a smaller world of the same shape (same tp/pp/ep and ranks per node)",
        )


# -- settings --------------------------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class PlanSettings:
    """``lingctl pcache plan`` settings; a ``[pcache]`` TOML table uses the same names."""

    model: str = ""  # preset name, checkpoint directory or tensors .json
    nodes: int | None = None
    ranks_per_node: int | None = None
    rank_map: str | list[int] | None = None  # node of each rank: "0,0,1,1" or a .json file
    node_bandwidth: str | float | list[float] | None = None  # GB/s, one value or one per node
    tp: int = 1
    pp: int = 1
    dp: int | None = None  # default: whatever the world leaves, world / (tp * pp)
    ep: int = 1
    order: str = DEFAULT_ORDER
    shard_optimizer: bool = False
    dtype: str | None = None  # default: the model's own (the preset's, the files')
    optimizer: str = "adamw"
    chunk_mb: float = 64.0  # MiB; the lingctl plan cuts larger items into row ranges of at most this
    buffer_mb: float = 64.0  # MiB; the lingctl writer's staging buffer per rank

    def validate(self) -> None:
        if not self.model:
            raise UsageError(
                "no model given", hint="--model PRESET|DIR|ORG/NAME[@REV]|TENSORS.json, e.g. --model ling-lite"
            )
        if self.optimizer not in OPTIMIZERS:
            raise UsageError(f"unknown optimizer {self.optimizer!r}", hint=f"choose one of {', '.join(OPTIMIZERS)}")
        for name in ("chunk_mb", "buffer_mb"):
            if not getattr(self, name) > 0:
                raise UsageError(f"{name.replace('_', '-')} must be positive, got {getattr(self, name):g}")

    def topology(self) -> Topology:
        if isinstance(self.node_bandwidth, str):
            bandwidth: list[float] | None = parse_bandwidth(self.node_bandwidth)
        elif isinstance(self.node_bandwidth, (int, float)):
            bandwidth = parse_bandwidth(str(self.node_bandwidth))
        elif self.node_bandwidth is not None:
            bandwidth = parse_bandwidth(",".join(str(b) for b in self.node_bandwidth))
        else:
            bandwidth = None
        if self.rank_map is None:
            if self.nodes is None or self.ranks_per_node is None:
                raise UsageError(
                    "give --nodes and --ranks-per-node, or --rank-map", hint="e.g. --nodes 2 --ranks-per-node 8"
                )
            _check_world(
                self.nodes * self.ranks_per_node, f"--nodes {self.nodes} x --ranks-per-node {self.ranks_per_node}"
            )
            return Topology.uniform(self.nodes, self.ranks_per_node, bandwidth)
        rank_nodes = self.rank_map if isinstance(self.rank_map, list) else parse_rank_map(self.rank_map)
        _check_world(len(rank_nodes), "the rank map")
        if (
            self.nodes is not None
            and self.ranks_per_node is not None
            and len(rank_nodes) != self.nodes * self.ranks_per_node
        ):
            raise UsageError(
                f"the rank map lists {len(rank_nodes)} ranks, but {self.nodes} nodes x "
                f"{self.ranks_per_node} ranks per node = {self.nodes * self.ranks_per_node}"
            )
        topology = Topology.from_map(rank_nodes, bandwidth)
        if self.nodes is not None and topology.num_nodes != self.nodes:
            raise UsageError(f"the rank map uses {topology.num_nodes} nodes, but --nodes is {self.nodes}")
        return topology

    def parallelism(self, world: int) -> Parallelism:
        for name in ("tp", "pp", "ep") + (("dp",) if self.dp is not None else ()):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be at least 1, got {getattr(self, name)}")
        dp = self.dp if self.dp is not None else world // (self.tp * self.pp)
        if self.tp * self.pp * dp != world:
            raise UsageError(
                f"the topology has {world} ranks, but tp {self.tp} x pp {self.pp} x dp {dp} = {self.tp * self.pp * dp}",
                hint="world size must equal tp * pp * dp",
            )
        p = Parallelism(
            tp=self.tp, pp=self.pp, dp=dp, ep=self.ep, order=self.order, shard_optimizer=self.shard_optimizer
        )
        p.validate()
        return p


# -- the report ------------------------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class StrategySummary:
    name: str  # rank0, dcp, lingctl, bound
    label: str
    writes: int | None  # write items (lingctl: chunks); None for the bound
    total_bytes: int
    rank_bytes_max: int  # for the bound: the least any placement can put on its busiest rank
    rank_bytes_mean: float
    node_bytes: list[int] | None
    node_ratio: float | None  # busiest node's bytes / the mean node's
    seconds: float  # estimated save time: max over nodes of bytes / bandwidth
    vs_bound: float | None  # seconds / the bound's seconds
    staging_bytes: int | None  # peak per rank: sync DCP save, or the lingctl writer's buffer bound
    staging_async_bytes: int | None  # peak per rank under dcp.async_save (DCP strategies only)


@dataclass(kw_only=True, slots=True)
class RankRow:
    rank: int
    node: int
    held_bytes: int  # every byte the rank holds (what async_save stages)
    bytes: dict[str, int]  # per strategy: bytes the rank writes
    writes: dict[str, int]  # per strategy: items the rank writes
    staging: dict[str, int]  # per strategy: peak staging (rank0/dcp: sync; lingctl: buffer bound)


@dataclass(kw_only=True, slots=True)
class PlanReport:
    model: dict  # source, tensors, parameters
    optimizer: str
    dtype: str | None
    parallelism: Parallelism
    topology: dict  # rank_nodes, node_gbps
    chunk_bytes: int
    buffer_bytes: int
    items: int  # write items (shards and optimizer states)
    chunks: int  # what the lingctl plan writes after cutting items at chunk_bytes
    total_bytes: int
    plan_seconds: float  # time to cut and place the lingctl plan
    strategies: list[StrategySummary]
    ranks: list[RankRow]
    write_items: list[dict] | None = field(default=None)  # only when asked for: every item and its writers

    def strategy(self, name: str) -> StrategySummary:
        return next(s for s in self.strategies if s.name == name)


# -- strategies ------------------------------------------------------------------------------------------
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


def _largest(writers: np.ndarray, sizes: np.ndarray, world: int) -> np.ndarray:
    out = np.zeros(world, dtype=np.int64)
    np.maximum.at(out, writers, sizes)
    return out


def _summary(
    name: str,
    writers: np.ndarray,
    sizes: np.ndarray,
    topology: Topology,
    staging: np.ndarray,
    staging_async: int | None,
) -> tuple[StrategySummary, np.ndarray, np.ndarray]:
    world = topology.world_size
    rank_bytes = np.bincount(writers, weights=sizes, minlength=world).round().astype(np.int64)
    rank_writes = np.bincount(writers, minlength=world)
    node_bytes = (
        np.bincount(np.asarray(topology.rank_nodes), weights=rank_bytes, minlength=topology.num_nodes)
        .round()
        .astype(np.int64)
    )
    total = int(rank_bytes.sum())
    mean_node = total / topology.num_nodes
    seconds = max(b / bw for b, bw in zip(node_bytes.tolist(), topology.node_bandwidth))
    summary = StrategySummary(
        name=name,
        label=STRATEGIES[name],
        writes=len(writers),
        total_bytes=total,
        rank_bytes_max=int(rank_bytes.max()),
        rank_bytes_mean=total / world,
        node_bytes=node_bytes.tolist(),
        node_ratio=float(node_bytes.max() / mean_node) if mean_node else None,
        seconds=seconds,
        vs_bound=None,
        staging_bytes=int(staging.max()),
        staging_async_bytes=staging_async,
    )
    return summary, rank_bytes, rank_writes


def bound(items: Items, topology: Topology) -> StrategySummary:
    """The lower bound on save time (module docstring), and on the busiest rank's bytes."""
    world = topology.world_size
    total = int(items.sizes.sum())
    per_group = np.bincount(items.groups, weights=items.sizes, minlength=len(items.holder_sets))
    # Bytes by the set of nodes that may write them (a bit mask of node indexes).
    by_nodes: dict[int, float] = {}
    rank_only = np.zeros(world)
    for g, holders in enumerate(items.holder_sets):
        mask = 0
        for r in holders:
            mask |= 1 << topology.rank_nodes[r]
        by_nodes[mask] = by_nodes.get(mask, 0.0) + per_group[g]
        if len(holders) == 1:
            rank_only[holders[0]] += per_group[g]
    # Items whose writers all lie within a node set U finish no sooner than their bytes / U's bandwidth.
    # U = all nodes gives total / sum of bandwidths, U = one node the bytes only it can write; the node sets
    # of the holder sets (a pipeline stage's nodes, an expert group's) are checked as well.
    everyone = (1 << topology.num_nodes) - 1
    seconds = 0.0
    for nodes in set(by_nodes) | {everyone}:
        inside = sum(b for m, b in by_nodes.items() if m & ~nodes == 0)
        speed = sum(bw for n, bw in enumerate(topology.node_bandwidth) if nodes >> n & 1)
        seconds = max(seconds, float(inside) / speed)
    return StrategySummary(
        name="bound",
        label=STRATEGIES["bound"],
        writes=None,
        total_bytes=total,
        rank_bytes_max=max(math.ceil(total / world), int(rank_only.max())),
        rank_bytes_mean=total / world,
        node_bytes=None,
        node_ratio=None,
        seconds=seconds,
        vs_bound=1.0,
        staging_bytes=None,
        staging_async_bytes=None,
    )


@dataclass(kw_only=True, slots=True)
class Comparison:
    strategies: list[StrategySummary]  # rank0, dcp, lingctl, bound
    ranks: list[RankRow]
    chunks: Chunks  # the lingctl plan's write items
    chunk_writers: np.ndarray  # int64: the rank that writes each chunk
    plan_seconds: float  # time to cut and place the lingctl plan
    write_items: list[dict] | None  # every item with its writers, when asked for


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


def compare(
    items: Items, topology: Topology, *, chunk_bytes: int, buffer_bytes: int, list_items: bool = False
) -> Comparison:
    """The four strategies on ``items``."""
    world = topology.world_size
    if max(h[-1] for h in items.holder_sets) >= world:
        raise UsageError(
            f"the items name ranks up to {max(h[-1] for h in items.holder_sets)}, but the topology has {world} ranks"
        )
    held = items.held_bytes(world)
    held_max = int(held.max())
    writers = {"rank0": lowest_writers(items), "dcp": dcp_writers(items)}
    began = time.perf_counter()
    chunks = chunk_items(items, chunk_bytes)
    placement = place(chunks.sizes, items.groups[chunks.parent], items.holder_sets, topology, rows=chunks.rows)
    chunks, chunk_writers = _apply_cuts(chunks, placement)
    plan_seconds = time.perf_counter() - began
    log.debug("lingctl plan: %d chunks placed in %.3f s", len(chunks.sizes), plan_seconds)
    lower = bound(items, topology)
    summaries = []
    per_rank: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for name, w in writers.items():
        largest = _largest(w, items.sizes, world)
        s, rb, rw = _summary(name, w, items.sizes, topology, largest, held_max)
        summaries.append(s)
        per_rank[name] = (rb, rw, largest)
    staged = np.minimum(_largest(chunk_writers, chunks.sizes, world), buffer_bytes)
    s, rb, rw = _summary("lingctl", chunk_writers, chunks.sizes, topology, staged, None)
    summaries.append(s)
    per_rank["lingctl"] = (rb, rw, staged)
    for s in summaries:
        if s.total_bytes != lower.total_bytes:
            raise AssertionError(f"{s.name} writes {s.total_bytes} bytes of {lower.total_bytes}")
        s.vs_bound = s.seconds / lower.seconds if lower.seconds else None
    summaries.append(lower)
    rows = [
        RankRow(
            rank=r,
            node=topology.rank_nodes[r],
            held_bytes=int(held[r]),
            bytes={k: int(v[0][r]) for k, v in per_rank.items()},
            writes={k: int(v[1][r]) for k, v in per_rank.items()},
            staging={k: int(v[2][r]) for k, v in per_rank.items()},
        )
        for r in range(world)
    ]
    listed = _list_items(items, writers, chunks, chunk_writers) if list_items else None
    return Comparison(
        strategies=summaries,
        ranks=rows,
        chunks=chunks,
        chunk_writers=chunk_writers,
        plan_seconds=plan_seconds,
        write_items=listed,
    )


def _list_items(items: Items, writers: dict[str, np.ndarray], chunks: Chunks, chunk_writers: np.ndarray) -> list[dict]:
    bounds = np.searchsorted(chunks.parent, np.arange(len(items) + 1)).tolist()
    rank0, dcp = writers["rank0"].tolist(), writers["dcp"].tolist()
    start, rows, by = chunks.start.tolist(), chunks.rows.tolist(), chunk_writers.tolist()
    sizes = items.sizes.tolist()
    return [
        {
            "name": items.names[i],
            "shape": list(items.shapes[i]),
            "bytes": sizes[i],
            "holders": len(items.holder_sets[items.groups[i]]),
            "rank0": rank0[i],
            "dcp": dcp[i],
            "lingctl": [[start[c], rows[c], by[c]] for c in range(bounds[i], bounds[i + 1])],
        }
        for i in range(len(items))
    ]


def plan(settings: PlanSettings, *, list_items: bool = False) -> PlanReport:
    """Everything ``lingctl pcache plan`` shows: the model's write items under the four strategies."""
    settings.validate()
    topology = settings.topology()
    parallelism = settings.parallelism(topology.world_size)
    model = load_model(settings.model)
    items = write_items(model, parallelism, settings.optimizer, settings.dtype)
    chunk_bytes = int(settings.chunk_mb * MIB)
    buffer_bytes = int(settings.buffer_mb * MIB)
    result = compare(items, topology, chunk_bytes=chunk_bytes, buffer_bytes=buffer_bytes, list_items=list_items)
    return PlanReport(
        model={
            "source": model.source,
            "tensors": len(model.tensors),
            "parameters": model.num_parameters,
            "layers": model.num_layers,
            "experts": model.num_experts,
            "dtypes": sorted({param_dtype(t, settings.dtype) for t in model.tensors}),
        },
        optimizer=settings.optimizer,
        dtype=settings.dtype,
        parallelism=parallelism,
        topology={"rank_nodes": list(topology.rank_nodes), "node_gbps": [bw / 1e9 for bw in topology.node_bandwidth]},
        chunk_bytes=chunk_bytes,
        buffer_bytes=buffer_bytes,
        items=len(items),
        chunks=len(result.chunks.sizes),
        total_bytes=int(items.sizes.sum()),
        plan_seconds=result.plan_seconds,
        strategies=result.strategies,
        ranks=result.ranks,
        write_items=result.write_items,
    )
