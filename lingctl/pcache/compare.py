"""The four strategies of ``strategies.py`` side by side: bytes per rank and node, save time, staging memory.

``rank0``, ``dcp`` and ``lingctl`` are the writer rules of ``strategies.py``; the fourth, ``bound``, is what no
placement can beat: ``max(total bytes / sum of bandwidths, max over nodes of the bytes only that node can
write / its bandwidth)``; bytes only a node can write are those of items whose holders all sit on it
(rank-unique shards among them). The same holds for any set of nodes (the bytes of items whose holders all
sit in the set, over the set's bandwidth); the node sets of the holder sets (one pipeline stage's nodes, say)
are checked too, which tightens the bound under pp.

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
from dataclasses import dataclass

import numpy as np

from lingctl.core.errors import UsageError
from lingctl.pcache.layout import Items
from lingctl.pcache.strategies import Chunks, dcp_writers, lingctl_writers, lowest_writers
from lingctl.pcache.topology import Topology

log = logging.getLogger(__name__)

STRATEGIES = {"rank0": "rank-0 writers", "dcp": "DCP default", "lingctl": "lingctl plan", "bound": "lower bound"}


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
class Comparison:
    strategies: list[StrategySummary]  # rank0, dcp, lingctl, bound
    ranks: list[RankRow]
    chunks: Chunks  # the lingctl plan's write items
    chunk_writers: np.ndarray  # int64: the rank that writes each chunk
    plan_seconds: float  # time to cut and place the lingctl plan
    write_items: list[dict] | None  # every item with its writers, when asked for


@dataclass(kw_only=True, slots=True)
class _PerRank:
    """One strategy's figures per rank, for the ``RankRow``s."""

    bytes: np.ndarray
    writes: np.ndarray
    staging: np.ndarray


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
) -> tuple[StrategySummary, _PerRank]:
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
    return summary, _PerRank(bytes=rank_bytes, writes=rank_writes, staging=staging)


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
    chunks, chunk_writers = lingctl_writers(items, topology, chunk_bytes)
    plan_seconds = time.perf_counter() - began
    log.debug("lingctl plan: %d chunks placed in %.3f s", len(chunks.sizes), plan_seconds)
    summaries = []
    per_rank: dict[str, _PerRank] = {}
    for name, w in writers.items():
        summary, per_rank[name] = _summary(name, w, items.sizes, topology, _largest(w, items.sizes, world), held_max)
        summaries.append(summary)
    staged = np.minimum(_largest(chunk_writers, chunks.sizes, world), buffer_bytes)
    summary, per_rank["lingctl"] = _summary("lingctl", chunk_writers, chunks.sizes, topology, staged, None)
    summaries.append(summary)
    summaries.append(_against_bound(summaries, bound(items, topology)))
    return Comparison(
        strategies=summaries,
        ranks=_rank_rows(topology, held, per_rank),
        chunks=chunks,
        chunk_writers=chunk_writers,
        plan_seconds=plan_seconds,
        write_items=_list_items(items, writers, chunks, chunk_writers) if list_items else None,
    )


def _against_bound(summaries: list[StrategySummary], lower: StrategySummary) -> StrategySummary:
    """Each strategy's time over the bound's (every strategy writes every byte exactly once); the bound."""
    for s in summaries:
        if s.total_bytes != lower.total_bytes:
            raise AssertionError(f"{s.name} writes {s.total_bytes} bytes of {lower.total_bytes}")
        s.vs_bound = s.seconds / lower.seconds if lower.seconds else None
    return lower


def _rank_rows(topology: Topology, held: np.ndarray, per_rank: dict[str, _PerRank]) -> list[RankRow]:
    return [
        RankRow(
            rank=r,
            node=topology.rank_nodes[r],
            held_bytes=int(held[r]),
            bytes={k: int(v.bytes[r]) for k, v in per_rank.items()},
            writes={k: int(v.writes[r]) for k, v in per_rank.items()},
            staging={k: int(v.staging[r]) for k, v in per_rank.items()},
        )
        for r in range(topology.world_size)
    ]


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
