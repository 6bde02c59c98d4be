"""`lingctl train status RUN`: a run's progress, incidents, last checkpoint and current throughput."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from lingctl.commands.options import JsonOpt
from lingctl.core.errors import UsageError
from lingctl.core.output import Output, to_jsonable


def status(
    run: Annotated[str, typer.Argument(metavar="RUN", help="A local run directory of lingctl train.")],
    json: JsonOpt = False,
) -> None:
    """Summarise a run from its files: progress, incidents (incidents.jsonl), last checkpoint, throughput."""
    from lingctl.train.status import run_status

    out = Output(json)
    if "://" in run:
        raise UsageError(
            f"lingctl train status reads local run directories, not {run}",
            hint="on the training machine, give the run's staging directory (--cache-dir)",
        )
    s = run_status(Path(run))
    out.result(to_jsonable(s), lambda c: _render(s, c))


def _render(s: Any, console: Any) -> None:
    target = f"/{s.target_steps}" if s.target_steps else ""
    state = (
        "finished"
        if s.finished
        else f"last record {s.last_record_age_s:.0f} s ago"
        if s.last_record_age_s is not None
        else "no records"
    )
    loss = f", loss {s.last_loss:.3f}" if s.last_loss is not None else ""
    evals = f", eval loss {s.eval_loss:.3f}" if s.eval_loss is not None else ""
    speed = f", {s.tokens_per_s:,.0f} tok/s over the last steps" if s.tokens_per_s is not None else ""
    lines = [
        f"{s.run_dir}: step {s.step}{target} ({state}), {s.tokens:,} tokens{loss}{evals}{speed}",
        f"checkpoint: {s.checkpoint} (step {s.checkpoint_step})" if s.checkpoint else "checkpoint: none yet",
    ]
    if s.incidents:
        counts = ", ".join(f"{n} {kind}" for kind, n in sorted(s.incidents.items()))
        lines.append(f"incidents: {counts}")
        for r in s.recent_incidents:
            back = f" to step {r['restored_step']}" if r.get("restored_step") is not None else ""
            lines.append(
                f"  {r['kind']}: {r['action']}{back}, detected after {r['detected_after_s']} s (attempt {r['attempt']})"
            )
    else:
        lines.append("incidents: none")
    for line in lines:
        console.print(line, markup=False)
