"""`lingctl flood`: `flood run` (offline batch inference), a thin wrapper over lingctl.flood.batch.run, and
`flood eval`; the engine options the two share are built from ``EngineOptions``, where each is declared."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Annotated, Any, Literal, get_type_hints

import typer

from lingctl.commands import flood_eval
from lingctl.commands.flood_render import (
    answers_to_stdout,
    command_output,
    plan_lines,
    progress,
    run_summary,
    stop_after_step,
)
from lingctl.commands.options import JsonOpt
from lingctl.commands.ray_options import (
    RayAddressOpt,
    RayBlockOpt,
    RayCpusOpt,
    RayEnginesOpt,
    RayOpt,
    cluster_options,
)
from lingctl.core.errors import UsageError
from lingctl.core.output import Output, to_jsonable
from lingctl.core.units import format_size
from lingctl.flood.engine.options import EngineOptions, Setting, settings

app = typer.Typer(
    help="Offline batch inference: continuous batching, segment KV cache, prefix sharing, pipeline stages.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


def engine_options(command: Callable[..., None]) -> Callable[..., None]:
    """``command`` with its ``engine: EngineOptions`` parameter turned into one option per engine setting (flag,
    help, default and type from the setting's declaration), gathered back into ``engine`` when it runs."""
    signature = inspect.signature(command, eval_str=True)
    fields = settings(EngineOptions)
    params: list[inspect.Parameter] = []
    for p in signature.parameters.values():
        params += [_option(f.name, f.default, rule, p.kind) for f, rule in fields] if p.name == "engine" else [p]

    @functools.wraps(command)
    def with_engine(**kwargs: Any) -> None:
        command(engine=EngineOptions(**{f.name: kwargs.pop(f.name) for f, _ in fields}), **kwargs)

    setattr(with_engine, "__signature__", signature.replace(parameters=params))  # noqa: B010 (read by Typer)
    with_engine.__annotations__ = {p.name: p.annotation for p in params}
    return with_engine


_ENGINE_TYPES = get_type_hints(EngineOptions)


def _option(name: str, default: Any, rule: Setting, kind: Any) -> inspect.Parameter:
    value_type: Any = Literal[rule.choices] if rule.choices else _ENGINE_TYPES[name]
    if rule.choices and default is None:
        value_type = value_type | None
    option = typer.Option(rule.flag, metavar=rule.metavar, help=rule.help)
    return inspect.Parameter(name, kind, default=default, annotation=Annotated[value_type, option])


app.command("eval")(engine_options(flood_eval.eval_cmd))


BatchArg = Annotated[
    str,
    typer.Argument(
        help='Requests, one JSON object per line (OpenAI batch format or {"custom_id", "prompt"}); a file or '
        "s3://bucket/key."
    ),
]
RunModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        metavar="DIR|ORG/NAME[@REV]|s3://BUCKET/PREFIX",
        help="Checkpoint directory (lingctl or Hugging Face layout), a Hugging Face model id read from the "
        "Hugging Face cache (HF_HOME; downloaded when missing unless HF_HUB_OFFLINE=1), or a checkpoint in S3, "
        "copied once per machine into lingctl's cache.",
    ),
]
RunOutOpt = Annotated[
    str | None,
    typer.Option(
        "--out",
        "-o",
        metavar="FILE",
        help="Output JSONL, a file or s3://bucket/key (default: BATCH.output.jsonl); '-': standard output, as "
        "answers finish (the summary then goes to stderr; nothing to --resume).",
    ),
]
ErrorsOpt = Annotated[
    str | None,
    typer.Option(
        "--errors",
        metavar="FILE",
        help="Errors JSONL, a file or s3://bucket/key (default: beside the output; with '-o -', BATCH.errors.jsonl).",
    ),
]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Continue an interrupted run: skip answered requests.")]
StagesOpt = Annotated[
    int,
    typer.Option("--stages", metavar="N", help="Pipeline stages (processes), each holding a slice of the layers."),
]
ChatTemplateOpt = Annotated[
    Path | None,
    typer.Option(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template file, overriding the model's (default: the model's own); rendered in a "
        "sandbox with per-request time, size and memory limits.",
    ),
]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", "-n", help="Read the config only; print the memory plan.")]


@app.command("run")
@engine_options
def run(
    batch: BatchArg,
    model: RunModelOpt,
    out: RunOutOpt = None,
    errors: ErrorsOpt = None,
    resume: ResumeOpt = False,
    stages: StagesOpt = 1,
    *,
    engine: EngineOptions,
    chat_template: ChatTemplateOpt = None,
    dry_run: DryRunOpt = False,
    ray: RayOpt = False,
    ray_address: RayAddressOpt = None,
    ray_cpus_per_engine: RayCpusOpt = None,
    ray_engines: RayEnginesOpt = None,
    ray_block: RayBlockOpt = None,
    json: JsonOpt = False,
) -> None:
    """Run every request of BATCH through the model; answers are written to the output in BATCH's order.

    Ctrl-C or SIGTERM stops after the current step and exits 130; every answer written so far is kept, and
    --resume continues without repeating any.
    """
    from lingctl.flood.batch.remote_io import StagedOutputs, is_s3
    from lingctl.flood.batch.run import FloodOptions, run_batch  # torch loads only here

    out_, to_stdout = command_output(json, Path(out) if out is not None else None)
    if to_stdout and resume:
        raise UsageError(
            "--resume reads the earlier answers from the output file, and '-o -' has none",
            hint="write to a file (-o FILE) to be able to resume",
        )
    stop = stop_after_step(out_)
    staged: StagedOutputs | None = None
    with ExitStack() as stack:
        batch_file = Path(batch)
        out_file, errors_file = (Path(out) if out is not None else None), (Path(errors) if errors is not None else None)
        if is_s3(batch) or is_s3(out) or is_s3(errors):  # run on local copies, uploaded as the block ends
            staged = stack.enter_context(
                StagedOutputs(batch, out, errors, resume=resume, upload=not dry_run, stdout=to_stdout)
            )
            batch_file, out_file, errors_file = staged.batch, staged.out, staged.errors
        if to_stdout:
            out_file, errors_file = (
                answers_to_stdout(stack, batch_file, errors_file, stop.request) if not dry_run else (None, errors_file)
            )
        opts = FloodOptions(
            batch=batch_file,
            model=model,
            out=out_file,
            errors=errors_file,
            resume=resume,
            stages=stages,
            engine=engine,
            chat_template=chat_template,
            dry_run=dry_run,
            cluster=cluster_options(ray, ray_address, ray_cpus_per_engine, ray_engines, ray_block),
        )
        with progress(out_, stop) as on_progress:
            # The plan is a message, said when it is known (stderr, before the load), not after the run.
            summary = run_batch(
                opts, on_progress=on_progress, should_stop=stop, on_plan=lambda p: out_.info("\n".join(plan_lines(p)))
            )
    if staged is not None:
        summary.out, summary.errors = staged.shown(summary.out), staged.shown(summary.errors)
    if to_stdout:
        summary.out = "stdout"
    out_.result(to_jsonable(summary), run_summary(summary))


@app.command("quantize")
def quantize(
    src: Annotated[
        str,
        typer.Argument(
            metavar="SRC", help="Checkpoint directory (lingctl or Hugging Face layout), or a Hugging Face model id."
        ),
    ],
    dst: Annotated[Path, typer.Argument(metavar="DST", help="New (or empty) directory for the converted checkpoint.")],
    mode: Annotated[
        Literal["int8", "w8a8"],
        typer.Option("--quantize", help="What the conversion is for, as flood run's --quantize."),
    ] = "int8",
    dtype: Annotated[
        Literal["float32", "bfloat16"],
        typer.Option("--dtype", help="The runs' --dtype: scales and float tensors are stored in it."),
    ] = "float32",
    json: JsonOpt = False,
) -> None:
    """Convert a checkpoint once into flood's int8 serving form, so that every later run loads it by plain reads.

    DST is written only when new or empty (an interrupted conversion is redone); a run of DST uses the
    --quantize and --dtype it was converted for. transformers cannot load DST: keep the original.
    """
    from lingctl.flood.weights.converted import convert  # torch loads only here
    from lingctl.flood.weights.model_dir import ModelDir
    from lingctl.model.hub import resolve_model_dir

    out = Output(json)
    md = ModelDir.open(resolve_model_dir(src, option="SRC"), option="SRC")
    report = convert(md, dst, mode=mode, dtype=dtype, on_phase=out.info)
    if report.reused:
        human = f"{dst} already holds this conversion of {md.path}; nothing to do"
    else:
        human = (
            f"converted {md.path} -> {dst} ({mode}, {dtype}): {report.tensors} tensors in {report.files} file(s), "
            f"{format_size(report.bytes_written)}; load {report.load_seconds:.1f} s, write {report.write_seconds:.1f} s"
        )
    out.result(to_jsonable(report), human)
