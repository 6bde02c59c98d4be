"""What every training command does with its options: a memory plan (``--dry-run``), the launcher of several
workers (``--nproc``), or the run itself in this process, with its live view and its result."""

from __future__ import annotations

import os
import sys
from typing import Any

import typer

from lingctl.commands.options import s3_options
from lingctl.commands.train_options import RunOptions, Settings
from lingctl.commands.train_render import TrainView, render_result, result_json
from lingctl.core.errors import Interrupted
from lingctl.core.graceful_stop import GracefulStop, graceful_stop
from lingctl.core.output import Output, to_jsonable

_STOPPING = "stopping after this step; saving a checkpoint (interrupt again to abort)"


def execute(run: RunOptions, settings: Settings, *, command: str = "train") -> None:
    """``settings``: the given training settings (dotted names, None: not given); ``command``: how to resume."""
    if run.dry_run:
        _dry_run(Output(run.json), run, settings)
        return
    if run.nproc > 1 and "RANK" not in os.environ:
        raise typer.Exit(_launch(run, settings))
    from lingctl.core.config import parse_override  # the TOML reader too: not needed at start-up
    from lingctl.train.run import train as run_training  # torch loads only when training

    # Several workers: rank 0 speaks for the job; the others print only their errors (lingctl.cli does).
    quiet = os.environ.get("RANK", "0") != "0"
    out_ = Output(run.json, stdout=open(os.devnull, "w"), stderr=open(os.devnull, "w")) if quiet else Output(run.json)
    overrides = {**settings, **dict(parse_override(item) for item in run.sets or [])}
    # During start-up a Ctrl-C aborts at once; from the first step on it finishes the step and checkpoints.
    stop = GracefulStop(lambda: out_.warn(_STOPPING), armed=False)
    s3 = s3_options(run.endpoint_url, run.region, run.profile, run.path_style)
    with graceful_stop(stop), TrainView(out_, on_start=stop.arm) as view:
        result = run_training(
            out=run.out,
            resume=run.resume,
            overrides=overrides,
            config_file=run.config,
            s3=s3,
            on_record=view.record,
            should_stop=stop,
            cache_dir=run.cache_dir,
            adopt=run.adopt,
        )
    out_.result(result_json(result), lambda c: render_result(result, c))
    if result.stopped == "interrupted":
        hint = f"continue with: lingctl {command} --resume --out {result.run_dir}"
        raise Interrupted(f"interrupted at step {result.steps}; checkpoint saved", hint=hint)


def _dry_run(out: Output, run: RunOptions, settings: Settings) -> None:
    """The run's memory plan (as a real run checks it before writing anything); a refusal when it does not fit."""
    from lingctl.core.config import parse_override
    from lingctl.train.run import plan_run

    overrides: dict[str, Any] = {**settings, **dict(parse_override(item) for item in run.sets or [])}
    plan = plan_run(overrides=overrides, config_file=run.config, workers=run.nproc)
    out.result({**to_jsonable(plan), "fits": plan.fits}, "\n".join(plan.lines()))
    if not plan.fits:
        raise plan.refusal()


def _launch(run: RunOptions, settings: Settings) -> int:
    """The job of ``nproc`` workers under lingctl's launcher (each re-runs this command line); its exit code."""
    from lingctl.train.supervise.launch import launch

    return launch(
        run.nproc,
        run.max_restarts,
        sys.argv[1:],
        watchdog=settings["watchdog"],
        hang_timeout_s=run.hang_timeout,
        out=run.out,
        cache_dir=run.cache_dir,
        preset=settings["preset"],
    )
