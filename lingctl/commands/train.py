"""`lingctl train`: train a Ling MoE on one process or several workers; a thin wrapper over lingctl.train.run."""

from __future__ import annotations

import typer

from lingctl.commands import train_align, train_plot, train_post, train_status, train_sweep
from lingctl.commands.train_options import RunOptions, Settings, with_run_options, with_settings
from lingctl.commands.train_run import execute
from lingctl.runs.train_config import TrainConfig

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
@with_run_options
def train(ctx: typer.Context, *, run: RunOptions, settings: Settings) -> None:
    """Train a Ling-style MoE (fine-grained + shared experts, dropless routing), on one process or several workers.

    Balance and z-loss, stochastic routing warmup, NormHead and a loss-spike guard are on by default.
    Checkpoints are Ling checkpoint directories in the Hugging Face layout (config.json with an auto_map,
    sharded safetensors, tokenizer with a chat template) that flood, transformers and vLLM load.

    Ctrl-C or SIGTERM finishes the current step, saves a checkpoint and exits 130; --resume continues exactly.
    `lingctl train sft` and `lingctl train dpo` fine-tune; `lingctl train plot RUN` draws a run's curves.
    """
    if ctx.invoked_subcommand is not None:
        return
    execute(run, settings)


app.command("sft")(train_post.sft)
app.command("dpo")(train_post.dpo)
app.command("sweep")(train_sweep.sweep)
app.command("fit")(train_sweep.fit)
app.command("plot")(train_plot.plot)
app.command("status")(train_status.status)
app.command("align")(train_align.align)
