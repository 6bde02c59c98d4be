"""`lingctl train plot RUN`: a run's curves drawn from its metrics into a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lingctl.commands.options import JsonOpt
from lingctl.core.errors import UsageError
from lingctl.core.output import Output


def plot(
    run: Annotated[str, typer.Argument(metavar="RUN", help="A local run directory of lingctl train.")],
    output: Annotated[
        Path | None,
        typer.Option("--out", "-o", metavar="FILE.png", help="Where to write the PNG (default: RUN/loss.png)."),
    ] = None,
    json: JsonOpt = False,
) -> None:
    """Draw a run's curves into a PNG: loss and eval loss, learning rate, expert load (max cv over layers)."""
    from lingctl.runs.layout import METRICS, PLOT
    from lingctl.runs.owned import written_by_lingctl
    from lingctl.runs.records import read_records
    from lingctl.train.plot import plot_metrics

    out = Output(json)
    if "://" in run:
        raise UsageError(
            f"lingctl train plot reads local run directories, not {run}",
            hint="copy the run's metrics.jsonl into a directory and plot that",
        )
    target = output or Path(run) / PLOT
    if output is None and target.exists() and not written_by_lingctl(Path(run), PLOT):
        raise UsageError(
            f"{target} exists and lingctl did not write it; refusing to overwrite it",
            hint="choose another file with -o FILE.png",
        )
    try:
        written = plot_metrics(read_records(Path(run) / METRICS), target, title=run)
    except ImportError:
        raise UsageError("lingctl train plot needs matplotlib", hint="pip install matplotlib") from None
    out.result({"event": "plot", "run": run, "path": str(written)}, lambda c: c.print(str(written), markup=False))
