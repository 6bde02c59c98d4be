"""`lingctl train sft` and `lingctl train dpo`: fine-tune a checkpoint on chat or preference data; every
training option of `lingctl train` applies (resume, --nproc, the watchdog, --report-to)."""

from __future__ import annotations

from typing import Annotated

import typer

from lingctl.commands.train_options import RunOptions, Settings, with_run_options, with_settings
from lingctl.commands.train_run import execute
from lingctl.runs.train_config import LOSS_ON, TrainConfig

ScheduleOpt = Annotated[
    str | None,
    typer.Option(
        "--seq-len-schedule",
        metavar="LEN[,LEN@FRACTION...]",
        help="Length curriculum, e.g. 4096,16384@0.05: first the examples that fit 4,096 tokens, then rows of "
        "16,384 where the longer examples are 5% of the examples (default: one stage of --seq-len).",
    ),
]


def _settings(settings: Settings, task: str, schedule: str | None, **post: object) -> Settings:
    given = {f"post.{name}": value for name, value in post.items() if value is not None}
    return {**settings, "task": task, "post.seq_len_schedule": schedule, **given}


@with_settings(TrainConfig)
@with_run_options
def sft(
    *,
    run: RunOptions,
    settings: Settings,
    loss_on: Annotated[
        str | None,
        typer.Option(
            "--loss-on",
            metavar="|".join(LOSS_ON),
            help="Tokens the loss is taken on: the assistant turns, every token, or the last assistant turn "
            "[default: assistant].",
        ),
    ] = None,
    seq_len_schedule: ScheduleOpt = None,
) -> None:
    """Supervised fine-tuning of --init-from on --data: JSONL lines of {"messages": [...]} or {"prompt",
    "completion"}, rendered with the checkpoint's chat template.

    Every line is checked before training (a bad one: FILE:LINE and nothing trained). Examples are packed into
    rows of --seq-len with attention kept inside each example; the learning rate defaults to 2e-5.
    """
    execute(run, _settings(settings, "sft", seq_len_schedule, loss_on=loss_on), command="train sft")


@with_settings(TrainConfig)
@with_run_options
def dpo(
    *,
    run: RunOptions,
    settings: Settings,
    beta: Annotated[
        float | None,
        typer.Option("--beta", min=0.0, help="How strongly the policy is held to the reference [default: 0.1]."),
    ] = None,
    nll_weight: Annotated[
        float | None,
        typer.Option(
            "--nll-weight",
            min=0.0,
            help="Weight of an NLL term on the chosen answers (TRL's rpo_alpha; Ling used 0.05) [default: 0].",
        ),
    ] = None,
    seq_len_schedule: ScheduleOpt = None,
) -> None:
    """Direct preference optimisation of --init-from on --data: JSONL lines of {"prompt" or "messages",
    "chosen", "rejected"}, optionally "chosen_mask"/"rejected_mask" (character spans left out of the loss).

    The reference is the starting checkpoint: its log-probabilities are computed once and kept in the run
    directory. Pairs are packed, both answers of a pair in one row; the learning rate defaults to 1e-6.
    """
    execute(run, _settings(settings, "dpo", seq_len_schedule, beta=beta, nll_weight=nll_weight), command="train dpo")
