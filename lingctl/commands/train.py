"""`lingctl train`: train a Ling MoE on one process or several workers; a thin wrapper over lingctl.train.run."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from lingctl.commands import train_align, train_plot, train_status
from lingctl.commands.options import EndpointOpt, JsonOpt, PathStyleOpt, ProfileOpt, RegionOpt, s3_options
from lingctl.commands.train_options import (
    AdoptOpt,
    CacheDirOpt,
    ConfigOpt,
    HangTimeoutOpt,
    MaxRestartsOpt,
    NprocOpt,
    OutOpt,
    ResumeOpt,
    SetOpt,
    Settings,
    with_settings,
)
from lingctl.commands.train_render import TrainView, render_result, result_json
from lingctl.core.errors import Interrupted
from lingctl.core.graceful_stop import GracefulStop, graceful_stop
from lingctl.core.output import Output, to_jsonable
from lingctl.runs.train_config import TrainConfig

_STOPPING = "stopping after this step; saving a checkpoint (interrupt again to abort)"

# `lingctl train [OPTIONS]` trains; `lingctl train plot RUN` is a subcommand. The training options belong to
# the group itself, so `lingctl train --preset tiny ...` (and the workers' re-executed command line) parse
# as they always did.
app = typer.Typer(
    invoke_without_command=True,
    no_args_is_help=False,
    subcommand_metavar="[COMMAND [ARGS]...]",
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback(invoke_without_command=True)
@with_settings(TrainConfig)
def train(
    ctx: typer.Context,
    *,
    out: OutOpt = None,
    resume: ResumeOpt = False,
    adopt: AdoptOpt = False,
    cache_dir: CacheDirOpt = None,
    settings: Settings,  # an option for each setting of TrainConfig, in this place (with_settings)
    nproc: NprocOpt = 1,
    max_restarts: MaxRestartsOpt = None,
    hang_timeout: HangTimeoutOpt = None,
    config: ConfigOpt = None,
    sets: SetOpt = None,
    endpoint_url: EndpointOpt = None,
    region: RegionOpt = None,
    profile: ProfileOpt = None,
    path_style: PathStyleOpt = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            "-n",
            help="Print the memory plan per worker and whether it fits; start nothing, write nothing.",
        ),
    ] = False,
    json: JsonOpt = False,
) -> None:
    """Train a Ling-style MoE (fine-grained + shared experts, dropless routing), on one process or several workers.

    Balance and z-loss, stochastic routing warmup, NormHead and a loss-spike guard are on by default.
    Checkpoints are Ling checkpoint directories in the Hugging Face layout (config.json with an auto_map,
    sharded safetensors, tokenizer with a chat template) that flood, transformers and vLLM load.

    Ctrl-C or SIGTERM finishes the current step, saves a checkpoint and exits 130; --resume continues exactly.
    `lingctl train plot RUN` draws a run's curves.
    """
    if ctx.invoked_subcommand is not None:
        return
    if dry_run:
        _dry_run(Output(json), settings, sets, config, nproc)
        return
    if nproc > 1 and "RANK" not in os.environ:
        raise typer.Exit(_launch(nproc, max_restarts, hang_timeout, out=out, cache_dir=cache_dir, settings=settings))
    from lingctl.core.config import parse_override  # the TOML reader too: not needed at start-up
    from lingctl.train.run import train as run_training  # torch loads only when training

    # Several workers: rank 0 speaks for the job; the others print only their errors (lingctl.cli does).
    quiet = os.environ.get("RANK", "0") != "0"
    out_ = Output(json, stdout=open(os.devnull, "w"), stderr=open(os.devnull, "w")) if quiet else Output(json)
    overrides = {**settings, **dict(parse_override(item) for item in sets or [])}
    # During start-up a Ctrl-C aborts at once; from the first step on it finishes the step and checkpoints.
    stop = GracefulStop(lambda: out_.warn(_STOPPING), armed=False)
    s3 = s3_options(endpoint_url, region, profile, path_style)
    with graceful_stop(stop), TrainView(out_, on_start=stop.arm) as view:
        result = run_training(
            out=out,
            resume=resume,
            overrides=overrides,
            config_file=config,
            s3=s3,
            on_record=view.record,
            should_stop=stop,
            cache_dir=cache_dir,
            adopt=adopt,
        )
    out_.result(result_json(result), lambda c: render_result(result, c))
    if result.stopped == "interrupted":
        hint = f"continue with: lingctl train --resume --out {result.run_dir}"
        raise Interrupted(f"interrupted at step {result.steps}; checkpoint saved", hint=hint)


def _dry_run(out: Output, settings: Settings, sets: list[str] | None, config: Path | None, nproc: int) -> None:
    """The run's memory plan (as a real run checks it before writing anything); a refusal when it does not fit."""
    from lingctl.core.config import parse_override
    from lingctl.train.run import plan_run

    overrides = {**settings, **dict(parse_override(item) for item in sets or [])}
    plan = plan_run(overrides=overrides, config_file=config, workers=nproc)
    out.result({**to_jsonable(plan), "fits": plan.fits}, "\n".join(plan.lines()))
    if not plan.fits:
        raise plan.refusal()


def _launch(
    nproc: int,
    max_restarts: int | None,
    hang_timeout: float | None,
    *,
    out: str | None,
    cache_dir: Path | None,
    settings: Settings,
) -> int:
    """The job of ``nproc`` workers under lingctl's launcher; its exit code."""
    from lingctl.train.supervise.launch import launch

    return launch(
        nproc,
        max_restarts,
        sys.argv[1:],
        watchdog=settings["watchdog"],
        hang_timeout_s=hang_timeout,
        out=out,
        cache_dir=cache_dir,
        preset=settings["preset"],
    )


app.command("plot")(train_plot.plot)
app.command("status")(train_status.status)
app.command("align")(train_align.align)
