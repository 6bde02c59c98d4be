"""``lingctl pcache plan``: its settings, its report, and the library call that fills the report.

The settings name a cluster (nodes, ranks, bandwidths), a parallel layout and a model; the report holds that
model's write items under the four strategies of ``compare.py``, per strategy, rank and node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lingctl.core.errors import UsageError
from lingctl.pcache.compare import RankRow, StrategySummary, compare
from lingctl.pcache.layout import DEFAULT_ORDER, OPTIMIZERS, Parallelism, param_dtype, write_items
from lingctl.pcache.model_tensors import load_model
from lingctl.pcache.topology import Topology, parse_bandwidth, parse_rank_map

MIB = 2**20
# The plan lists every rank and places every item over its holders in Python: time grows a little faster
# than items x ranks (Ling-plus, pure data parallel: ~4 s at 8,192 ranks, ~90 s at 32,768 on a busy 2-core
# machine). Larger worlds are refused at once rather than left to run for minutes.
MAX_RANKS = 16_384


def _check_world(world: int, what: str) -> None:
    if world > MAX_RANKS:
        raise UsageError(
            f"{what} = {world:,} ranks; plan computes at most {MAX_RANKS:,}",
            hint="plan a smaller world of the same shape (same tp/pp/ep and ranks per node)",
        )


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

    def bandwidth(self) -> list[float] | None:
        """``node_bandwidth`` in bytes/s, one value or one per node; None for the default."""
        if isinstance(self.node_bandwidth, str):
            return parse_bandwidth(self.node_bandwidth)
        if isinstance(self.node_bandwidth, (int, float)):
            return parse_bandwidth(str(self.node_bandwidth))
        if self.node_bandwidth is not None:
            return parse_bandwidth(",".join(str(b) for b in self.node_bandwidth))
        return None

    def topology(self) -> Topology:
        bandwidth = self.bandwidth()
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
