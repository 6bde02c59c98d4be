"""`lingctl flood eval`: score a model, or every checkpoint of a training run, on task files; a thin wrapper
over lingctl.flood.eval.run (registered by lingctl.commands.flood, which adds the engine options)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lingctl.commands.flood_render import (
    command_output,
    eval_json,
    eval_summary,
    progress,
    stop_after_step,
    write_records,
)
from lingctl.commands.options import DURATION_FORMS, JsonOpt, at_least, duration
from lingctl.commands.ray_options import (
    RayAddressOpt,
    RayBlockOpt,
    RayCpusOpt,
    RayEnginesOpt,
    RayOpt,
    cluster_options,
)
from lingctl.flood.engine.options import EngineOptions

TasksArg = Annotated[
    list[Path],
    typer.Argument(
        metavar="TASKS...",
        help='Task files, one item per line: multiple choice {"id", "context", "choices", "answer"} or '
        'generation {"id", "prompt", "answer", "stop", "max_tokens"}; a task is named by its file. Also '
        "lm-evaluation-harness task files (.yaml, .yml) over local data files.",
    ),
]
EvalModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        metavar="DIR|ORG/NAME[@REV]|s3://BUCKET/PREFIX|RUN_DIR",
        help="A checkpoint directory, a Hugging Face model id (from the cache), a checkpoint in S3 (copied once "
        "per machine), or a lingctl training run directory: then every checkpoint of the run is evaluated.",
    ),
]
EvalOutOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        "-o",
        "--output",
        metavar="PATH",
        help="A model: the per-item results JSONL (default: TASKS.eval.jsonl beside the first task file; '-': "
        "standard output). A run: a directory (default: RUN_DIR.eval beside the run).",
    ),
]
NumFewshotOpt = Annotated[
    int | None,
    typer.Option(
        "--num-fewshot",
        "-k",
        metavar="K",
        help='Solved examples before each item, from the items marked "fewshot": true, else the first K '
        "other items of its file (an lm-eval task file: its few-shot split). Default: an lm-eval task file's "
        "num_fewshot, else 0.",
    ),
]
RegexOpt = Annotated[
    str | None,
    typer.Option(
        "--regex",
        metavar="PATTERN",
        help="Generation tasks: the answer is the first group of this pattern's first match in the output "
        '(an item\'s own "regex" wins); default: the whole stripped output.',
    ),
]
FollowOpt = Annotated[
    bool,
    typer.Option("--follow", "-f", help="A run: evaluate new checkpoints as they appear, until the run ends."),
]
PollOpt = Annotated[
    float,
    typer.Option(
        "--poll",
        metavar="DURATION",
        parser=duration,
        help=f"With --follow: how often to look for a new checkpoint ({DURATION_FORMS}).",
    ),
]
DropKOpt = Annotated[
    float,
    typer.Option(
        "--drop-k",
        metavar="K",
        help="A run: flag a checkpoint whose score fell by more than K standard errors of the difference.",
    ),
]


def eval_cmd(
    tasks: TasksArg,
    model: EvalModelOpt,
    out: EvalOutOpt = None,
    num_fewshot: NumFewshotOpt = None,
    regex: RegexOpt = None,
    follow: FollowOpt = False,
    poll: PollOpt = 5.0,
    drop_k: DropKOpt = 2.0,
    *,
    engine: EngineOptions,
    ray: RayOpt = False,
    ray_address: RayAddressOpt = None,
    ray_cpus_per_engine: RayCpusOpt = None,
    ray_engines: RayEnginesOpt = None,
    ray_block: RayBlockOpt = None,
    json: JsonOpt = False,
) -> None:
    """Score a model on task files: multiple choice by the log-likelihood of each choice's text, generation by
    its greedy answer. Prints each task's accuracy with its standard error.

    The numbers do not depend on --max-batch-tokens, --max-seqs, --threads or prefix sharing: two evaluations of
    one checkpoint give the same bits. A rerun reuses an output written with the same settings, and continues an
    interrupted one; Ctrl-C stops after the current step (exit 130) and keeps what is done.
    """
    from lingctl.flood.eval.run import EvalOptions, run_eval  # torch loads only here

    at_least("--poll", poll, 0.1)
    out_, to_stdout = command_output(json, out)
    opts = EvalOptions(
        tasks=tasks,
        model=model,
        out=out,
        num_fewshot=num_fewshot,
        regex=regex,
        follow=follow,
        drop_k=drop_k,
        poll_s=poll,
        engine=engine,
        cluster=cluster_options(ray, ray_address, ray_cpus_per_engine, ray_engines, ray_block),
    )
    stop = stop_after_step(out_)
    with progress(out_, stop) as on_progress:
        summary = run_eval(opts, should_stop=stop, on_progress=on_progress)
    if to_stdout:
        write_records(summary.results[0].records)
    out_.result(eval_json(summary), eval_summary(summary))
