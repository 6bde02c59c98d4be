"""`lingctl pcache plan`: who writes which checkpoint bytes, a thin wrapper over lingctl.pcache.plan."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lingctl.commands.options import JsonOpt
from lingctl.commands.pcache_render import render_plan
from lingctl.core.output import Output, to_jsonable
from lingctl.core.units import parse_size

_PRESETS = "tiny, small, ling-lite, ling-plus"

# Every setting defaults to None here, so that a --config file's value stands unless the flag is given.
NodesOpt = Annotated[int | None, typer.Option("--nodes", metavar="N", help="Number of nodes.")]
RanksPerNodeOpt = Annotated[int | None, typer.Option("--ranks-per-node", metavar="N", help="Ranks on each node.")]
RankMapOpt = Annotated[
    str | None,
    typer.Option(
        "--rank-map",
        metavar="0,0,1,1|FILE.json",
        help="Node of each rank, in rank order (instead of --nodes x --ranks-per-node, numbered node by node).",
    ),
]
NodeBandwidthOpt = Annotated[
    str | None,
    typer.Option(
        "--node-bandwidth",
        metavar="GBPS[,GBPS...]",
        help="Write bandwidth in GB/s, one value or one per node (default: 2).",
    ),
]
TpOpt = Annotated[int | None, typer.Option("--tp", metavar="N", help="Tensor-parallel size (default 1).")]
PpOpt = Annotated[int | None, typer.Option("--pp", metavar="N", help="Pipeline stages (default 1).")]
DpOpt = Annotated[
    int | None, typer.Option("--dp", metavar="N", help="Data-parallel size (default: world / (tp * pp)).")
]
EpOpt = Annotated[
    int | None, typer.Option("--ep", metavar="N", help="Expert-parallel size, carved out of dp (default 1).")
]
OrderOpt = Annotated[
    str | None,
    typer.Option("--order", metavar="AXES", help="Rank order, fastest-varying axis first (default tp-ep-dp-pp)."),
]
ShardOptimizerOpt = Annotated[
    bool | None,
    typer.Option(
        "--shard-optimizer/--no-shard-optimizer",
        help="Optimizer state cut across data-parallel replicas (ZeRO-1; default: not).",
    ),
]
ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        metavar="PRESET|DIR|ORG/NAME[@REV]|TENSORS.json",
        help=f"A preset ({_PRESETS}); a checkpoint directory, or a Hugging Face model id from the Hugging Face "
        "cache (downloaded when missing unless HF_HUB_OFFLINE=1), of which only config.json and the "
        "safetensors headers are read; or a JSON tensor list.",
    ),
]
DtypeOpt = Annotated[
    str | None,
    typer.Option("--dtype", metavar="DTYPE", help="Parameter dtype, e.g. bfloat16 (default: the model's own)."),
]
OptimizerOpt = Annotated[
    str | None,
    typer.Option(
        "--optimizer",
        metavar="adamw|sgd|none",
        help="Optimizer state saved with the model: adamw, sgd or none (default adamw).",
    ),
]


def _mib(text: str) -> float:
    """MiB from a bare number (MiB, as the option's name says) or a size with its unit (64MiB, 1G, 500MB), as
    lingctl's other size options take them."""
    try:
        return float(text)
    except ValueError:
        return parse_size(text) / 2**20


ChunkMbOpt = Annotated[
    float | None,
    typer.Option(
        "--chunk-mb",
        metavar="SIZE",
        parser=_mib,
        help="The lingctl plan cuts larger items into row ranges of at most this size: MiB, or a size with its unit "
        "such as 64MiB or 1G (default 64).",
    ),
]
BufferMbOpt = Annotated[
    float | None,
    typer.Option(
        "--buffer-mb",
        metavar="SIZE",
        parser=_mib,
        help="Staging buffer of the lingctl writer per rank: MiB, or a size with its unit (default 64).",
    ),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config", metavar="FILE.toml", help="Settings from the [pcache] table of a TOML file; flags override it."
    ),
]
ItemsOpt = Annotated[bool, typer.Option("--items", help="Also list every write item and its writers.")]


def plan(
    nodes: NodesOpt = None,
    ranks_per_node: RanksPerNodeOpt = None,
    rank_map: RankMapOpt = None,
    node_bandwidth: NodeBandwidthOpt = None,
    tp: TpOpt = None,
    pp: PpOpt = None,
    dp: DpOpt = None,
    ep: EpOpt = None,
    order: OrderOpt = None,
    shard_optimizer: ShardOptimizerOpt = None,
    model: ModelOpt = None,
    dtype: DtypeOpt = None,
    optimizer: OptimizerOpt = None,
    chunk_mb: ChunkMbOpt = None,
    buffer_mb: BufferMbOpt = None,
    config: ConfigOpt = None,
    items: ItemsOpt = False,
    json: JsonOpt = False,
) -> None:
    """Who writes which checkpoint bytes: rank-0 writers, DCP's default planner and the lingctl plan,
    against the lower bound, with bytes per rank and node, estimated save time and staging memory."""
    from lingctl.core.config import build  # tomllib and the config layer load only for this command
    from lingctl.pcache.plan import PlanSettings
    from lingctl.pcache.plan import plan as make_plan

    overrides = {
        "model": model,
        "nodes": nodes,
        "ranks_per_node": ranks_per_node,
        "rank_map": rank_map,
        "node_bandwidth": node_bandwidth,
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "ep": ep,
        "order": order,
        "shard_optimizer": shard_optimizer,
        "dtype": dtype,
        "optimizer": optimizer,
        "chunk_mb": chunk_mb,
        "buffer_mb": buffer_mb,
    }
    settings = build(PlanSettings, file=config, section="pcache" if config is not None else None, overrides=overrides)
    report = make_plan(settings, list_items=items)
    Output(json).result(to_jsonable(report), lambda console: render_plan(report, console))
