"""``PCacheSavePlanner``: a ``torch.distributed.checkpoint`` save planner that spreads writes across nodes.

DCP's default planner gives each replicated item to the holder with the fewest bytes so far, sized by the
whole tensor and in state-dict order; it knows nothing of nodes or of their bandwidth (docs: FACTS). This
planner replaces only that step (``_dedup_save_plans``): items that are too large are split into row
chunks, every item is placed by ``assign.place`` (rank-unique bytes first, then replicated items largest
first on the node that finishes earliest), and DCP builds the metadata as usual. The result is a standard
DCP checkpoint: stock ``dcp.load`` reads it, on any world size.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from lingctl.core.errors import UsageError
from lingctl.pcache.assign import Placement, place, split_rows
from lingctl.pcache.topology import Topology

log = logging.getLogger(__name__)

# Replicated tensors larger than this are split into row chunks that different ranks may write. It also
# bounds what the writer has to stage for a non-contiguous or device tensor.
DEFAULT_CHUNK_BYTES = 64 << 20


def _rows(item: WriteItem) -> int:
    """Rows along dim 0 an item could be cut into (1 for scalars and non-tensor values)."""
    data = item.tensor_data
    return data.chunk.sizes[0] if data is not None and data.chunk is not None and len(data.chunk.sizes) else 1


def _row_range(item: WriteItem, start: int, rows: int) -> WriteItem:
    """Rows ``[start, start + rows)`` of a tensor item, as a SHARD item (a sharded tensor's pieces are)."""
    data = item.tensor_data
    assert data is not None and data.chunk is not None
    base, sizes = list(data.chunk.offsets), list(data.chunk.sizes)
    offsets = torch.Size([base[0] + start, *base[1:]])
    chunk = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([rows, *sizes[1:]]))
    return WriteItem(
        index=MetadataIndex(item.index.fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=chunk, properties=data.properties, size=data.size),
    )


def item_bytes(item: WriteItem) -> int:
    """Bytes of what the item writes. (``WriteItem.tensor_storage_size`` counts the whole tensor even for
    one chunk of it, which is how DCP's default planner sizes items.)"""
    data = item.tensor_data
    if data is None or data.chunk is None:
        return 1  # non-tensor values: small pickles, not worth estimating
    return math.prod(data.chunk.sizes) * torch._utils._element_size(data.properties.dtype)


@dataclasses.dataclass(kw_only=True, slots=True)
class PlanSummary:
    """What the coordinator decided, kept for the commit marker, status output and tests."""

    rank_bytes: list[int]
    node_bytes: list[int]
    estimated_s: float
    items: int
    split_items: int
    topology: dict[str, Any]


class PCacheSavePlanner(DefaultSavePlanner):
    """Save planner that balances checkpoint writes across nodes.

    Give the topology one of three ways: ``topology=Topology(...)``; ``ranks_per_node=R`` (ranks numbered
    node by node, as torchrun does) with an optional ``node_bandwidth`` (bytes/s, one value or one per
    node); or ``rank_nodes=[...]``. With none, ``LOCAL_WORLD_SIZE`` (set by torchrun) is the number of
    ranks per node, else all ranks count as one node.
    """

    def __init__(
        self,
        *,
        topology: Topology | None = None,
        ranks_per_node: int | None = None,
        rank_nodes: list[int] | None = None,
        node_bandwidth: float | list[float] | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._topology = topology
        self._ranks_per_node = ranks_per_node
        self._rank_nodes = rank_nodes
        self._bandwidth = node_bandwidth
        self.chunk_bytes = chunk_bytes
        self.summary: PlanSummary | None = None
        self._sources: dict[MetadataIndex, tuple[MetadataIndex, int]] = {}

    def topology_for(self, world_size: int) -> Topology:
        if self._topology is not None:
            topo = self._topology
        elif self._rank_nodes is not None:
            topo = Topology.from_map(list(self._rank_nodes), self._bandwidth)
        else:
            per_node = self._ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or world_size
            if world_size % per_node:
                raise UsageError(
                    f"{world_size} ranks do not fill nodes of {per_node} ranks each",
                    hint="give ranks_per_node that divides the world size, or rank_nodes",
                )
            topo = Topology.uniform(world_size // per_node, per_node, self._bandwidth)
        if topo.world_size != world_size:
            raise UsageError(f"the topology has {topo.world_size} ranks but the checkpoint is saved by {world_size}")
        return topo

    # -- coordinator ---------------------------------------------------------------------------------
    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        topology = self.topology_for(len(all_plans))
        items: list[WriteItem] = []
        holders: list[list[int]] = []
        position: dict[MetadataIndex, int] = {}
        for rank, plan in enumerate(all_plans):
            for item in plan.items:
                at = position.get(item.index)
                if at is None:
                    position[item.index] = len(items)
                    items.append(item)
                    holders.append([rank])
                else:
                    holders[at].append(rank)
        pieces: list[WriteItem] = []
        piece_holders: list[int] = []
        set_ids: dict[tuple[int, ...], int] = {}
        split = 0
        for item, ranks in zip(items, holders):
            group = set_ids.setdefault(tuple(ranks), len(set_ids))
            chunks = self._split(item)
            split += len(chunks) > 1
            pieces.extend(chunks)
            piece_holders.extend([group] * len(chunks))
        sizes = np.fromiter((item_bytes(p) for p in pieces), dtype=np.int64, count=len(pieces))
        rows = np.fromiter((_rows(p) for p in pieces), dtype=np.int64, count=len(pieces))
        placement: Placement = place(sizes, piece_holders, list(set_ids), topology, rows=rows)
        per_rank: list[list[WriteItem]] = [[] for _ in all_plans]
        kept = placement.kept_rows if placement.kept_rows is not None else rows
        for piece, writer, n_rows, n_kept in zip(pieces, placement.writers.tolist(), rows.tolist(), kept.tolist()):
            per_rank[writer].append(piece if n_kept == n_rows else _row_range(piece, 0, n_kept))
        for index, start, count, writer in placement.cuts:
            per_rank[writer].append(_row_range(pieces[index], start, count))
        self.summary = PlanSummary(
            rank_bytes=placement.rank_bytes,
            node_bytes=placement.node_bytes,
            estimated_s=placement.seconds(topology),
            items=len(pieces) + len(placement.cuts),
            split_items=split,
            topology=topology.to_dict(),
        )
        log.debug("pcache plan: %d items (%d split), bytes per node %s", len(pieces), split, placement.node_bytes)
        return [dataclasses.replace(plan, items=mine) for plan, mine in zip(all_plans, per_rank)]

    def _split(self, item: WriteItem) -> list[WriteItem]:
        """Row chunks of a large tensor item (SHARD items, as a sharded tensor's pieces are), or the item."""
        data = item.tensor_data
        if data is None or data.chunk is None or item_bytes(item) <= self.chunk_bytes:
            return [item]
        sizes = list(data.chunk.sizes)
        itemsize = torch._utils._element_size(data.properties.dtype)
        ranges = split_rows(sizes, itemsize, self.chunk_bytes)
        if len(ranges) == 1:
            return [item]
        return [_row_range(item, start, rows) for start, rows in ranges]

    # -- every rank ----------------------------------------------------------------------------------
    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """Remember, for each chunk this rank must write, which of its own items holds the rows."""
        local = {item.index: item for item in self.plan.items if item.tensor_data is not None}
        by_fqn: dict[str, list[WriteItem]] = {}
        for item in local.values():
            by_fqn.setdefault(item.index.fqn, []).append(item)
        self._sources = {}
        for item in new_plan.items:
            if item.tensor_data is None:
                continue
            chunk = item.tensor_data.chunk
            same = local.get(item.index)
            if same is not None and same.tensor_data.chunk.sizes == chunk.sizes:  # type: ignore[union-attr]
                continue  # one of this rank's own items, whole
            for own in by_fqn.get(item.index.fqn, []):
                o = own.tensor_data.chunk  # type: ignore[union-attr]
                if (
                    all(o.offsets[d] == chunk.offsets[d] for d in range(1, len(o.offsets)))
                    and o.offsets[0] <= chunk.offsets[0]
                    and chunk.offsets[0] + chunk.sizes[0] <= o.offsets[0] + o.sizes[0]
                ):
                    self._sources[item.index] = (own.index, chunk.offsets[0] - o.offsets[0])
                    break
            else:
                raise ValueError(f"{item.index.fqn}: this rank was asked to write rows it does not hold")
        return super().finish_plan(new_plan)

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | Any:
        source = self._sources.get(write_item.index)
        if source is None:
            return super().resolve_data(write_item)
        index, row = source
        tensor = self.lookup_object(index)
        if isinstance(tensor, torch.Tensor) and hasattr(tensor, "to_local"):
            tensor = tensor.to_local()
        return tensor.narrow(0, row, write_item.tensor_data.chunk.sizes[0])  # type: ignore[union-attr]
