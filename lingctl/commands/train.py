"""`lingctl train`: train a Ling MoE on one process or several workers; a thin wrapper over lingctl.train.run."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from lingctl.commands import train_align, train_status
from lingctl.commands.options import (
    DURATION_FORMS,
    EndpointOpt,
    JsonOpt,
    PathStyleOpt,
    ProfileOpt,
    RegionOpt,
    duration,
    s3_options,
)
from lingctl.core.errors import Interrupted, UsageError
from lingctl.core.graceful_stop import GracefulStop, graceful_stop
from lingctl.core.output import Output, to_jsonable
from lingctl.core.units import format_duration
from lingctl.model.presets import PRESETS

if TYPE_CHECKING:
    from lingctl.train.trainer import Record, TrainResult


class ReportTo(str, Enum):  # lingctl.train.config.REPORT_TO (not imported here: it loads torch)
    none = "none"
    tensorboard = "tensorboard"
    wandb = "wandb"


_HUMAN_EVERY_S = 5.0  # off a terminal, one status line per this many seconds (and the first and last step)

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
def train(
    ctx: typer.Context,
    preset: Annotated[str | None, typer.Option("--preset", "-p", help=f"Model shape: {', '.join(PRESETS)}.")] = None,
    data: Annotated[
        list[str] | None,
        typer.Option(
            "--data",
            "-d",
            help="Text files, directories, globs or JSONL ('text' field); repeatable. "
            "Default: the Python standard library's sources.",
        ),
    ] = None,
    out: Annotated[
        str | None,
        typer.Option("--out", "-o", help="Run directory, local or s3://bucket/prefix (default: runs/PRESET-TIME)."),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the run in --out from its last checkpoint.")
    ] = False,
    adopt: Annotated[
        bool,
        typer.Option(
            "--adopt",
            help="Let --out be an existing directory that holds other files: the run adds its own files "
            "(listed in lingctl-run.json) and never overwrites or deletes the others; a name it "
            "needs that is taken is refused.",
        ),
    ] = False,
    cache_dir: Annotated[
        Path | None,
        typer.Option(
            "--cache-dir",
            help="Node-local fast disk for s3:// runs: checkpoints land here and upload in the "
            "background (default: ~/.cache/lingctl/runs).",
        ),
    ] = None,
    steps: Annotated[int | None, typer.Option("--steps", help="Optimizer steps in total.")] = None,
    max_seconds: Annotated[
        float | None,
        typer.Option(
            "--max-seconds",
            parser=duration,
            metavar="DURATION",
            help=f"Stop (with a checkpoint) after this much wall time ({DURATION_FORMS}).",
        ),
    ] = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size", help="Sequences per step.")] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="Tokens per sequence.")] = None,
    lr: Annotated[float | None, typer.Option("--lr", help="Peak learning rate.")] = None,
    seed: Annotated[int | None, typer.Option("--seed")] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            "--tokenizer",
            metavar="FILE|DIR|ORG/NAME[@REV]",
            help="An existing tokenizer: a tokenizer.json, a directory holding one, or a Hub id from the local "
            "Hugging Face cache (default: the --init-from checkpoint's, else a byte-level BPE trained on the "
            "data).",
        ),
    ] = None,
    init_from: Annotated[
        str | None,
        typer.Option(
            "--init-from",
            metavar="DIR|ORG/NAME[@REV]",
            help="Start from this Ling (bailing_moe) checkpoint: lingctl's or the Hub layout, sharded or not, a "
            "directory or a Hub id (Hugging Face cache; downloaded when missing unless HF_HUB_OFFLINE=1). Its "
            "shape, weights and tokenizer are used; --preset then only sets training defaults.",
        ),
    ] = None,
    max_shard_size: Annotated[
        str | None,
        typer.Option(
            "--max-shard-size",
            metavar="SIZE",
            help="Checkpoint weights go into safetensors shards of at most this size, with an index (default 5GB, "
            "as save_pretrained).",
        ),
    ] = None,
    hf_code_repo: Annotated[
        str | None,
        typer.Option(
            "--hf-code-repo",
            metavar="ORG/NAME",
            help="The Hub repository whose Ling code config.json's auto_map names, for transformers' "
            'trust_remote_code (default: the --init-from checkpoint\'s, else inclusionAI/Ling-lite; "" = '
            "code files copied beside the weights).",
        ),
    ] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="float32, or bfloat16 autocast.")] = None,
    dispatch: Annotated[str | None, typer.Option("--dispatch", help="MoE dispatch: naive, sorted, grouped.")] = None,
    eval_every: Annotated[
        int | None, typer.Option("--eval-every", help="Steps between evals (0: only at the end).")
    ] = None,
    save_every: Annotated[
        int | None, typer.Option("--save-every", help="Steps between checkpoints (0: only at the end).")
    ] = None,
    report_to: Annotated[
        ReportTo | None,
        typer.Option(
            "--report-to",
            help="Also send the curves to TensorBoard (event files in RUN/tensorboard) or Weights & Biases "
            "(default none).",
        ),
    ] = None,
    max_consecutive_skips: Annotated[
        int | None,
        typer.Option(
            "--max-consecutive-skips",
            help="End the run (exit 1) after this many skipped steps in a row: it has diverged (default 20).",
        ),
    ] = None,
    nproc: Annotated[
        int,
        typer.Option(
            "--nproc",
            min=1,
            help="Workers on this machine, started by torch.distributed.run (torchrun); on many "
            "machines run 'torchrun ... -m lingctl train' instead.",
        ),
    ] = 1,
    max_restarts: Annotated[
        int | None,
        typer.Option(
            "--max-restarts",
            min=0,
            help="With --nproc: restart all workers from the last checkpoint this many times after one crashes "
            "or the job hangs (never after bad settings or a stop) [default: 3 with the watchdog, else 0].",
        ),
    ] = None,
    watchdog: Annotated[
        bool | None,
        typer.Option(
            "--watchdog/--no-watchdog",
            help="With --nproc: watch the workers' trace rings and restart a job that hangs "
            "[default: on with --nproc > 1].",
            show_default=False,
        ),
    ] = None,
    hang_timeout: Annotated[
        float | None,
        typer.Option(
            "--hang-timeout",
            parser=duration,
            metavar="DURATION",
            help=f"Watchdog: a job with no progress on any worker for this long is hung ({DURATION_FORMS}) "
            "[default: max(25s, 10 x the median step), at least 2 x the longest checkpoint save].",
        ),
    ] = None,
    sync: Annotated[
        str | None, typer.Option("--sync", help="With several workers: ddp (synchronous) or edit (EDiT local SGD).")
    ] = None,
    sync_every: Annotated[int | None, typer.Option("--sync-every", help="edit: local steps between syncs.")] = None,
    sync_every_seconds: Annotated[
        float | None,
        typer.Option(
            "--sync-every-seconds",
            parser=duration,
            metavar="DURATION",
            help=f"edit: sync by time instead ({DURATION_FORMS}); faster workers take more local steps.",
        ),
    ] = None,
    simulate_slow_rank: Annotated[
        int | None, typer.Option("--simulate-slow-rank", help="Fault drill: this worker runs --slowdown times slower.")
    ] = None,
    slowdown: Annotated[float | None, typer.Option("--slowdown", help="Fault drill: how much slower.")] = None,
    simulate_bad_rank: Annotated[
        int | None, typer.Option("--simulate-bad-rank", help="Fault drill: this worker's update is corrupted (x100).")
    ] = None,
    simulate_hang: Annotated[
        str | None,
        typer.Option(
            "--simulate-hang",
            metavar="R:S",
            help="Fault drill: worker R blocks forever at step S (first attempt only); the watchdog restarts the job.",
        ),
    ] = None,
    simulate_nan: Annotated[
        int | None,
        typer.Option(
            "--simulate-nan", metavar="S", help="Fault drill: a non-finite loss at step S (first attempt only)."
        ),
    ] = None,
    simulate_spikes: Annotated[
        str | None,
        typer.Option("--simulate-spikes", metavar="S:N", help="Fault drill: N consecutive loss spikes from step S."),
    ] = None,
    simulate_routing_collapse: Annotated[
        int | None,
        typer.Option(
            "--simulate-routing-collapse",
            metavar="LAYER",
            help="Fault drill: the MoE layer LAYER routes every token to the same experts.",
        ),
    ] = None,
    config: Annotated[Path | None, typer.Option("--config", help="TOML file with a [train] table.")] = None,
    settings: Annotated[
        list[str] | None,
        typer.Option(
            "--set", metavar="KEY=VALUE", help="Any setting, e.g. moe.balance_coef=0.02 or model.num_hidden_layers=2."
        ),
    ] = None,
    endpoint_url: EndpointOpt = None,
    region: RegionOpt = None,
    profile: ProfileOpt = None,
    path_style: PathStyleOpt = None,
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
    if nproc > 1 and "RANK" not in os.environ:
        from lingctl.train.workers import launch

        raise typer.Exit(
            launch(
                nproc,
                max_restarts,
                sys.argv[1:],
                watchdog=watchdog,
                hang_timeout_s=hang_timeout,
                out=out,
                cache_dir=cache_dir,
                preset=preset,
            )
        )
    from lingctl.core.config import parse_override  # the TOML reader too: not needed at start-up
    from lingctl.train.run import train as run_training  # torch loads only when training

    # Several workers: rank 0 speaks for the job; the others print only their errors (lingctl.cli does).
    if os.environ.get("RANK", "0") == "0":
        out_ = Output(json)
    else:
        out_ = Output(json, stdout=open(os.devnull, "w"), stderr=open(os.devnull, "w"))
    overrides: dict[str, Any] = {
        "preset": preset,
        "data.paths": data or None,
        "steps": steps,
        "max_seconds": max_seconds,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "optim.lr": lr,
        "seed": seed,
        "data.tokenizer": tokenizer,
        "init_from": init_from,
        "max_shard_size": max_shard_size,
        "hf_code_repo": hf_code_repo,
        "dtype": dtype,
        "dispatch": dispatch,
        "eval_every": eval_every,
        "save_every": save_every,
        "max_consecutive_skips": max_consecutive_skips,
        "report_to": report_to.value if report_to else None,
        "sync": sync,
        "sync_every": sync_every,
        "sync_every_seconds": sync_every_seconds,
        "simulate_slow_rank": simulate_slow_rank,
        "slowdown": slowdown,
        "simulate_bad_rank": simulate_bad_rank,
        "watchdog": watchdog,  # one process: the in-worker watchdog (under the launcher it passes --set)
        "simulate_hang": simulate_hang,
        "simulate_nan": simulate_nan,
        "simulate_spikes": simulate_spikes,
        "simulate_routing_collapse": simulate_routing_collapse,
    }
    for item in settings or []:
        key, value = parse_override(item)
        overrides[key] = value
    # During start-up a Ctrl-C aborts at once; from the first step on it finishes the step and checkpoints.
    stop = GracefulStop(
        lambda: out_.warn("stopping after this step; saving a checkpoint (interrupt again to abort)"), armed=False
    )
    with graceful_stop(stop), _View(out_, on_start=stop.arm) as view:
        result = run_training(
            out=out,
            resume=resume,
            overrides=overrides,
            config_file=config,
            s3=s3_options(endpoint_url, region, profile, path_style),
            on_record=view.record,
            should_stop=stop,
            cache_dir=cache_dir,
            adopt=adopt,
        )
    out_.result(_result_json(result), lambda c: _summary(result, c))
    if result.stopped == "interrupted":
        raise Interrupted(
            f"interrupted at step {result.steps}; checkpoint saved",
            hint=f"continue with: lingctl train --resume --out {result.run_dir}",
        )


@app.command("plot")
def plot(
    run: Annotated[str, typer.Argument(metavar="RUN", help="A local run directory of lingctl train.")],
    output: Annotated[
        Path | None,
        typer.Option("--out", "-o", metavar="FILE.png", help="Where to write the PNG (default: RUN/loss.png)."),
    ] = None,
    json: JsonOpt = False,
) -> None:
    """Draw a run's curves into a PNG: loss and eval loss, learning rate, expert load (max cv over layers)."""
    from lingctl.runs.records import read_records
    from lingctl.train.plot import PLOT_FILE, plot_metrics
    from lingctl.train.rundir import METRICS

    out_ = Output(json)
    if "://" in run:
        raise UsageError(
            f"lingctl train plot reads local run directories, not {run}",
            hint="copy the run's metrics.jsonl into a directory and plot that",
        )
    target = output or Path(run) / PLOT_FILE
    if output is None:
        _check_plot_is_ours(Path(run), PLOT_FILE)
    try:
        written = plot_metrics(read_records(Path(run) / METRICS), target, title=run)
    except ImportError:
        raise UsageError("lingctl train plot needs matplotlib", hint="pip install matplotlib") from None
    out_.result({"event": "plot", "run": run, "path": str(written)}, lambda c: c.print(str(written), markup=False))


app.command("status")(train_status.status)
app.command("align")(train_align.align)


def _check_plot_is_ours(run: Path, name: str) -> None:
    """RUN/loss.png is overwritten only when the run's manifest lists it (lingctl wrote it)."""
    from lingctl.runs.layout import MANIFEST, Manifest

    if not (run / name).exists():
        return
    try:
        entries = Manifest.parse((run / MANIFEST).read_bytes(), str(run / MANIFEST)).entries
    except OSError:
        entries = set()
    if name not in entries:
        raise UsageError(
            f"{run / name} exists and lingctl did not write it; refusing to overwrite it",
            hint="choose another file with -o FILE.png",
        )


def _result_json(result: TrainResult) -> dict[str, Any]:
    return {"event": "done", **to_jsonable(result)}


def _summary(r: TrainResult, console: Any) -> None:
    loss = f"loss {r.first_loss:.3f} -> {r.last_loss:.3f}" if r.first_loss is not None else "no new steps"
    evals = f", eval loss {r.eval_loss:.3f}" if r.eval_loss is not None else ""
    speed = f", {r.tokens_per_s:,.0f} tok/s" if r.tokens_per_s is not None else ""
    wall = f", wall time {format_duration(r.wall_s)}" if r.wall_s is not None else ""
    console.print(
        f"{r.stopped}: {r.steps}/{r.target_steps} steps, {r.tokens:,} tokens, {loss}{evals}, "
        f"{r.spikes_skipped} spike(s) skipped, {r.elapsed_s:.0f} s{speed}{wall}",
        markup=False,
    )
    if r.checkpoint:
        console.print(f"checkpoint: {r.run_dir}/{r.checkpoint}", markup=False)


class _View:
    """The live view: a Rich bar with loss, tokens/s and expert balance on a terminal; JSON lines with
    --json; a status line every few seconds otherwise (logs, CI)."""

    def __init__(self, out: Output, *, on_start: Callable[[], None] = lambda: None) -> None:
        self.out = out
        self._on_start = on_start  # the run has reached its first step
        self._cm: Any = None
        self._task: Any = None
        self._last = 0.0
        self._total = 0
        self._first: tuple[int, float] | None = None  # (step, time) of this process's first step record

    def __enter__(self) -> _View:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._cm is not None:
            self._cm.__exit__(*exc)

    def _start(self, r: Record) -> None:
        workers = f", {r['workers']} workers ({r['sync']})" if r.get("workers", 1) > 1 else ""
        self.out.info(
            f"run {r['run_dir']}: {r['preset']}, {r['parameters'] / 1e6:.1f}M parameters "
            f"({r['active_parameters'] / 1e6:.1f}M active), {r['train_sequences']} training sequences of "
            f"{r['seq_len']} tokens{workers}"
        )
        self._total = r["steps"]
        self._cm = self.out.progress("training", total=r["steps"])
        self._task = self._cm.__enter__()
        self._task.update(total=r["steps"])
        if r["step"]:
            self._task.advance(r["step"])

    def record(self, record: Record) -> None:
        if record["event"] == "start":
            self._on_start()
        if self.out.json_mode:
            self.out.record(record)
            return
        event = record["event"]
        if event == "start":
            self._start(record)
        elif event == "preparing":
            where = f"; {record['report_to']} files in {record['report_dir']}" if "report_dir" in record else ""
            self.out.info(f"preparing run {record['run_dir']}: tokenizing data, building the model{where}")
        elif event == "step":
            load = record["expert_load"]
            cv = max((x["cv"] for x in load), default=0.0)
            paces = record.get("worker_tokens_per_s")
            per_worker = f" ({'/'.join(f'{x:,.0f}' for x in paces)} per worker)" if paces else ""
            text = (
                f"loss {record['loss']:.3f} lr {record['lr']:.2e} "
                f"{record['tokens_per_s']:,.0f} tok/s{per_worker} expert cv {cv:.2f}"
            )
            self._task.update(description=f"step {record['step']} {text}")
            self._task.advance(1)
            if self._first is None:
                self._first = (record["step"], record["time"])
            last = record["step"] >= self._total
            if not self.out.progress_enabled and (
                self._first[0] == record["step"] or last or time.monotonic() - self._last >= _HUMAN_EVERY_S
            ):
                self._last = time.monotonic()
                self.out.info(f"step {record['step']}/{self._total} {text}{self._eta(record)}")
        elif event == "eval":
            self.out.info(f"step {record['step']} eval loss {record['eval_loss']:.3f}")
        elif event == "spike":
            self.out.warn(f"step {record['step']}: loss spike skipped ({record['reason']}), {record['action']}")
        elif event == "incident":
            where = f", back to step {record['restored_step']}" if record.get("restored_step") is not None else ""
            self.out.warn(f"watchdog: {record['kind']}, {record['action']}{where}: {record['reason']}")
        elif event == "lr_drop":
            self.out.warn(f"step {record['step']}: repeated spikes, learning rate scaled to {record['lr_scale']:g}")
        elif event == "checkpoint" and not self.out.progress_enabled:
            self.out.info(f"step {record['step']} checkpoint {record['path']}")

    def _eta(self, record: Record) -> str:
        """ " ETA 4m12s" from this process's average time per step so far (none before its second step)."""
        assert self._first is not None
        done = record["step"] - self._first[0]
        if done < 1:
            return ""
        per_step = (record["time"] - self._first[1]) / done
        return f" ETA {format_duration(per_step * max(self._total - record['step'], 0))}"
