"""Human views of ``lingctl pcache`` results: the plan's tables, the tier status table, the upload line.

The library returns records (``PlanReport``, ``CheckpointStatus``, ``UploadResult``); drawing them is the
commands' job. Rich is imported inside the functions so that ``--json`` runs never load it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lingctl.core.units import format_duration, format_size

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from lingctl.pcache.plan import PlanReport
    from lingctl.pcache.tier import UploadResult
    from lingctl.pcache.tier_status import CheckpointStatus

# More nodes than this are summed up in one line; --json lists them all.
_MAX_NODE_ROWS = 32


def render_plan(report: PlanReport, console: Console) -> None:
    """What was planned, the strategies side by side, bytes per node and, when listed, every write item."""
    p, m = report.parallelism, report.model
    gbps = report.topology["node_gbps"]
    nodes = len(gbps)
    world = len(report.topology["rank_nodes"])
    speed = f"{gbps[0]:g} GB/s each" if len(set(gbps)) == 1 else f"{min(gbps):g}-{max(gbps):g} GB/s"
    optimizer = report.optimizer + (", sharded over dp" if p.shard_optimizer and report.optimizer != "none" else "")
    console.print(
        f"model {m['source']}: {_count(m['parameters'])} parameters ({'/'.join(m['dtypes'])}) in "
        f"{m['tensors']:,} tensors, {m['layers']} layers, {m['experts']} experts; optimizer {optimizer}",
        markup=False,
    )
    console.print(
        f"{world} ranks on {nodes} nodes ({speed}); tp {p.tp} x pp {p.pp} x dp {p.dp}, ep {p.ep}, order {p.order}",
        markup=False,
    )
    console.print(
        f"{report.items:,} write items, {format_size(report.total_bytes)}; the lingctl plan cuts them "
        f"into {report.chunks:,} chunks of <= {format_size(report.chunk_bytes)} "
        f"(planned in {report.plan_seconds:.2f} s)",
        markup=False,
    )
    console.print(_strategies_table(report))
    console.print(_nodes_table(report))
    if nodes > _MAX_NODE_ROWS:
        console.print(f"... {nodes - _MAX_NODE_ROWS} more nodes (all of them with --json)", markup=False)
    if report.write_items is not None:
        console.print(_items_table(report.write_items))


def _strategies_table(report: PlanReport) -> Table:
    from rich.table import Table

    table = Table(show_edge=False, pad_edge=False)
    for title in (
        "strategy",
        "writes",
        "max/rank",
        "mean/rank",
        "busiest node",
        "node/mean",
        "est. time",
        "x bound",
        "staging",
        "async_save",
    ):
        table.add_column(title, justify="left" if title == "strategy" else "right")
    for s in report.strategies:
        table.add_row(
            s.label,
            _or_dash(s.writes, "{:,}"),
            format_size(s.rank_bytes_max),
            format_size(s.rank_bytes_mean),
            format_size(max(s.node_bytes)) if s.node_bytes else "-",
            _or_dash(s.node_ratio, "{:.2f}x"),
            format_duration(s.seconds),
            _or_dash(s.vs_bound, "{:.2f}x"),
            format_size(s.staging_bytes) if s.staging_bytes is not None else "-",
            format_size(s.staging_async_bytes) if s.staging_async_bytes is not None else "-",
        )
    return table


def _nodes_table(report: PlanReport) -> Table:
    from rich.table import Table

    gbps = report.topology["node_gbps"]
    rank_nodes = report.topology["rank_nodes"]
    table = Table(show_edge=False, pad_edge=False, title="bytes per node", title_justify="left")
    for title in ("node", "ranks", "GB/s", "rank-0", "DCP", "lingctl", "lingctl time"):
        table.add_column(title, justify="right")
    counts = [0] * len(gbps)
    for n in rank_nodes:
        counts[n] += 1
    r0, dcp, ours = (report.strategy(n).node_bytes or [] for n in ("rank0", "dcp", "lingctl"))
    for n in range(min(len(gbps), _MAX_NODE_ROWS)):
        table.add_row(
            str(n),
            str(counts[n]),
            f"{gbps[n]:g}",
            format_size(r0[n]),
            format_size(dcp[n]),
            format_size(ours[n]),
            format_duration(ours[n] / (gbps[n] * 1e9)),
        )
    return table


def _items_table(write_items: list[dict]) -> Table:
    from rich.table import Table

    table = Table(show_edge=False, pad_edge=False, title="write items", title_justify="left")
    for title in ("item", "bytes", "holders", "rank-0", "DCP", "lingctl (rows->rank)"):
        table.add_column(title, justify="left" if title == "item" else "right")
    for it in write_items:
        table.add_row(
            it["name"],
            format_size(it["bytes"]),
            str(it["holders"]),
            str(it["rank0"]),
            str(it["dcp"]),
            " ".join(f"{a}:{a + b}->{r}" for a, b, r in it["lingctl"]),
        )
    return table


def render_status(path: Path, rows: Sequence[CheckpointStatus], console: Console) -> None:
    """One line per checkpoint (state, files, bytes local and uploaded), then each one's problems."""
    if not rows:
        console.print(f"no checkpoints under {path}", markup=False)
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for column in ("name", "state", "files", "size", "uploaded"):
        table.add_column(column, justify="right" if column in ("files", "size", "uploaded") else "left")
    for r in rows:
        table.add_row(r.name, r.state, str(r.files), format_size(r.bytes), format_size(r.uploaded_bytes))
    console.print(table)
    for r in rows:
        for problem in r.problems:
            console.print(f"{r.name}: {problem}", markup=False)


def upload_line(r: UploadResult) -> str:
    """The one line ``pcache upload`` prints: where it went, what was copied and what was there already."""
    return (
        f"{r.local_dir} -> {r.remote}: durable; copied {r.copied} file(s) "
        f"({format_size(r.copied_bytes)}), {r.skipped} already there; {r.seconds:.1f} s"
    )


def _or_dash(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return str(n)
