"""`lingctl pcache plan | status | upload`: thin wrappers over lingctl.pcache."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lingctl.commands.options import JsonOpt
from lingctl.commands.pcache_render import render_plan
from lingctl.commands.pcache_tier import status, upload
from lingctl.core.output import Output, to_jsonable

app = typer.Typer(
    help="Plan and run checkpoint writes spread across nodes, tiered to remote storage.",
    no_args_is_help=True,
    rich_markup_mode=None,
)

_PRESETS = "tiny, small, ling-lite, ling-plus"


@app.command("plan")
def plan(
    nodes: Annotated[int | None, typer.Option("--nodes", metavar="N", help="Number of nodes.")] = None,
    ranks_per_node: Annotated[
        int | None, typer.Option("--ranks-per-node", metavar="N", help="Ranks on each node.")
    ] = None,
    rank_map: Annotated[
        str | None,
        typer.Option(
            "--rank-map",
            metavar="0,0,1,1|FILE.json",
            help="Node of each rank, in rank order (instead of --nodes x --ranks-per-node, numbered node by node).",
        ),
    ] = None,
    node_bandwidth: Annotated[
        str | None,
        typer.Option(
            "--node-bandwidth",
            metavar="GBPS[,GBPS...]",
            help="Write bandwidth in GB/s, one value or one per node (default: 2).",
        ),
    ] = None,
    tp: Annotated[int | None, typer.Option("--tp", metavar="N", help="Tensor-parallel size (default 1).")] = None,
    pp: Annotated[int | None, typer.Option("--pp", metavar="N", help="Pipeline stages (default 1).")] = None,
    dp: Annotated[
        int | None, typer.Option("--dp", metavar="N", help="Data-parallel size (default: world / (tp * pp)).")
    ] = None,
    ep: Annotated[
        int | None, typer.Option("--ep", metavar="N", help="Expert-parallel size, carved out of dp (default 1).")
    ] = None,
    order: Annotated[
        str | None,
        typer.Option("--order", metavar="AXES", help="Rank order, fastest-varying axis first (default tp-ep-dp-pp)."),
    ] = None,
    shard_optimizer: Annotated[
        bool | None,
        typer.Option(
            "--shard-optimizer/--no-shard-optimizer",
            help="Optimizer state cut across data-parallel replicas (ZeRO-1; default: not).",
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            metavar="PRESET|DIR|ORG/NAME[@REV]|TENSORS.json",
            help=f"A preset ({_PRESETS}); a checkpoint directory, or a Hugging Face model id from the Hugging Face "
            "cache (downloaded when missing unless HF_HUB_OFFLINE=1), of which only config.json and the "
            "safetensors headers are read; or a JSON tensor list.",
        ),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option("--dtype", metavar="DTYPE", help="Parameter dtype, e.g. bfloat16 (default: the model's own)."),
    ] = None,
    optimizer: Annotated[
        str | None,
        typer.Option(
            "--optimizer",
            metavar="adamw|sgd|none",
            help="Optimizer state saved with the model: adamw, sgd or none (default adamw).",
        ),
    ] = None,
    chunk_mb: Annotated[
        float | None,
        typer.Option(
            "--chunk-mb",
            metavar="MIB",
            help="The lingctl plan cuts larger items into row ranges of at most this many MiB (default 64).",
        ),
    ] = None,
    buffer_mb: Annotated[
        float | None,
        typer.Option(
            "--buffer-mb", metavar="MIB", help="Staging buffer of the lingctl writer per rank, MiB (default 64)."
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", metavar="FILE.toml", help="Settings from the [pcache] table of a TOML file; flags override it."
        ),
    ] = None,
    items: Annotated[bool, typer.Option("--items", help="Also list every write item and its writers.")] = False,
    json: JsonOpt = False,
) -> None:
    """Who writes which checkpoint bytes: rank-0 writers, DCP's default planner and the lingctl plan,
    against the lower bound, with bytes per rank and node, estimated save time and staging memory."""
    from lingctl.core.config import build  # tomllib and the config layer load only for this command
    from lingctl.pcache.compare import PlanSettings
    from lingctl.pcache.compare import plan as make_plan

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


app.command("status")(status)
app.command("upload")(upload)
