"""Where ranks run and how fast each node writes: the input every checkpoint plan is made for.

A topology is a rank -> node map and one write bandwidth per node. Nodes may differ (a node with a slower
or busier disk, a mix of machine generations, as in the Ling report's heterogeneous clusters); the planner
spreads bytes so that every node finishes at about the same time, not so that every node writes the same
amount.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lingctl.core.errors import UsageError

# Per-node write bandwidth assumed when none is given: a single NVMe drive's sustained write.
DEFAULT_GBPS = 2.0


@dataclass(kw_only=True, slots=True, frozen=True)
class Topology:
    rank_nodes: tuple[int, ...]  # node index of each rank, in rank order
    node_bandwidth: tuple[float, ...]  # bytes per second each node can write

    def __post_init__(self) -> None:
        if not self.rank_nodes:
            raise UsageError("the topology has no ranks")
        nodes = self.num_nodes
        used = set(self.rank_nodes)
        if min(used) < 0:
            raise UsageError(f"node indexes must be >= 0, got {min(used)}")
        missing = sorted(set(range(nodes)) - used)
        if missing:
            raise UsageError(
                f"node {missing[0]} has no ranks in the rank map",
                hint="number nodes 0..N-1 and give each at least one rank",
            )
        if len(self.node_bandwidth) != nodes:
            raise UsageError(
                f"{len(self.node_bandwidth)} bandwidth value(s) for {nodes} node(s)",
                hint="give one value for all nodes, or one per node",
            )
        for i, bw in enumerate(self.node_bandwidth):
            if not bw > 0:
                raise UsageError(f"node {i}: bandwidth must be positive, got {bw:g}")

    @classmethod
    def uniform(cls, nodes: int, ranks_per_node: int, bandwidth: float | list[float] | None = None) -> Topology:
        """``nodes`` x ``ranks_per_node`` ranks, placed node by node (ranks 0..R-1 on node 0, as torchrun
        numbers them); ``bandwidth`` in bytes/s, one value or one per node."""
        if nodes < 1:
            raise UsageError(f"--nodes must be at least 1, got {nodes}")
        if ranks_per_node < 1:
            raise UsageError(f"--ranks-per-node must be at least 1, got {ranks_per_node}")
        rank_nodes = tuple(r // ranks_per_node for r in range(nodes * ranks_per_node))
        return cls(rank_nodes=rank_nodes, node_bandwidth=_bandwidths(bandwidth, nodes))

    @classmethod
    def from_map(cls, rank_nodes: list[int], bandwidth: float | list[float] | None = None) -> Topology:
        nodes = max(rank_nodes) + 1 if rank_nodes else 0
        return cls(rank_nodes=tuple(rank_nodes), node_bandwidth=_bandwidths(bandwidth, nodes))

    @property
    def world_size(self) -> int:
        return len(self.rank_nodes)

    @property
    def num_nodes(self) -> int:
        return max(self.rank_nodes) + 1

    def ranks_on(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.rank_nodes) if n == node]

    def to_dict(self) -> dict:
        return {"rank_nodes": list(self.rank_nodes), "node_bandwidth": list(self.node_bandwidth)}


def _bandwidths(bandwidth: float | list[float] | None, nodes: int) -> tuple[float, ...]:
    if bandwidth is None:
        return (DEFAULT_GBPS * 1e9,) * nodes
    if isinstance(bandwidth, (int, float)):
        return (float(bandwidth),) * nodes
    values = [float(b) for b in bandwidth]
    if len(values) == 1:
        return tuple(values) * nodes
    return tuple(values)


def parse_bandwidth(text: str) -> list[float]:
    """``"2"`` or ``"2,2,1,2"`` (GB/s, decimal) -> bytes/s per node."""
    values = []
    for part in text.split(","):
        part = part.strip()
        try:
            value = float(part)
        except ValueError:
            raise UsageError(
                f"--node-bandwidth: {part!r} is not a number", hint="give GB/s, one value or one per node: 2 or 2,2,1,2"
            ) from None
        if not value > 0:
            raise UsageError(f"--node-bandwidth: values must be positive, got {part}")
        values.append(value * 1e9)
    return values


def parse_rank_map(text: str) -> list[int]:
    """The node of each rank in rank order: ``"0,0,1,1"``, or a JSON file holding such a list."""
    source = text
    path = Path(text)
    if not text.replace(",", "").replace(" ", "").isdigit() and path.suffix == ".json":
        if not path.exists():
            raise UsageError(f"--rank-map: {text} does not exist")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UsageError(f"--rank-map: {text} is not JSON ({exc})") from None
        if not isinstance(data, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in data):
            raise UsageError(f"--rank-map: {text} must hold a list of node indexes, one per rank")
        return data
    try:
        return [int(x) for x in source.split(",") if x.strip() != ""]
    except ValueError:
        raise UsageError(
            f"--rank-map: {text!r} is not a list of node indexes",
            hint="give the node of each rank in rank order, e.g. 0,0,1,1, or a .json file",
        ) from None
