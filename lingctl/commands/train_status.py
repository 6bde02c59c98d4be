"""`lingctl train status RUN`: a run's progress, incidents, last checkpoint and current throughput."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lingctl.commands.options import JsonOpt
from lingctl.commands.train_render import render_status
from lingctl.core.errors import UsageError
from lingctl.core.output import Output, to_jsonable


def status(
    run: Annotated[str, typer.Argument(metavar="RUN", help="A local run directory of lingctl train.")],
    json: JsonOpt = False,
) -> None:
    """Summarise a run from its files: progress, incidents (incidents.jsonl), last checkpoint, throughput."""
    from lingctl.runs.status import run_status

    out = Output(json)
    if "://" in run:
        raise UsageError(
            f"lingctl train status reads local run directories, not {run}",
            hint="on the training machine, give the run's staging directory (--cache-dir)",
        )
    s = run_status(Path(run))
    out.result(to_jsonable(s), lambda c: render_status(s, c))
