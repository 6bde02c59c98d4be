"""`lingctl flood eval`: score a model, or every checkpoint of a training run, on task files; a thin wrapper
over lingctl.flood.eval.run."""

from __future__ import annotations

import json as jsonlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from lingctl.commands.options import (
    DURATION_FORMS,
    STDOUT,
    DtypeOpt,
    JsonOpt,
    KvCacheTokensOpt,
    MaxBatchTokensOpt,
    MaxSeqsOpt,
    PrefixSharingOpt,
    QuantizeOpt,
    ThreadsOpt,
    at_least,
    duration,
)
from lingctl.commands.status_view import StatusView
from lingctl.core.graceful_stop import GracefulStop, graceful_stop
from lingctl.core.output import Output, to_jsonable

if TYPE_CHECKING:
    from lingctl.flood.eval.run import EvalSummary, Progress


def eval_cmd(
    tasks: Annotated[
        list[Path],
        typer.Argument(
            metavar="TASKS.jsonl...",
            help='Task files, one item per line: multiple choice {"id", "context", "choices", "answer"} or '
            'generation {"id", "prompt", "answer", "stop", "max_tokens"}; a task is named by its file.',
        ),
    ],
    model: Annotated[
        str,
        typer.Option(
            "--model",
            "-m",
            metavar="DIR|ORG/NAME[@REV]|RUN_DIR",
            help="A checkpoint directory, a Hugging Face model id (from the cache), or a lingctl training run "
            "directory: then every checkpoint of the run is evaluated.",
        ),
    ],
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            "--output",
            metavar="PATH",
            help="A model: the per-item results JSONL (default: TASKS.eval.jsonl beside the first task file; '-': "
            "standard output). A run: a directory (default: RUN_DIR.eval beside the run).",
        ),
    ] = None,
    num_fewshot: Annotated[
        int,
        typer.Option(
            "--num-fewshot",
            "-k",
            metavar="K",
            help='Solved examples before each item, from the items marked "fewshot": true, else the first K '
            "other items of its file.",
        ),
    ] = 0,
    regex: Annotated[
        str | None,
        typer.Option(
            "--regex",
            metavar="PATTERN",
            help="Generation tasks: the answer is the first group of this pattern's first match in the output "
            '(an item\'s own "regex" wins); default: the whole stripped output.',
        ),
    ] = None,
    follow: Annotated[
        bool,
        typer.Option("--follow", "-f", help="A run: evaluate new checkpoints as they appear, until the run ends."),
    ] = False,
    poll: Annotated[
        float,
        typer.Option(
            "--poll",
            metavar="DURATION",
            parser=duration,
            help=f"With --follow: how often to look for a new checkpoint ({DURATION_FORMS}).",
        ),
    ] = 5.0,
    drop_k: Annotated[
        float,
        typer.Option(
            "--drop-k",
            metavar="K",
            help="A run: flag a checkpoint whose score fell by more than K standard errors of the difference.",
        ),
    ] = 2.0,
    max_batch_tokens: MaxBatchTokensOpt = 1024,
    max_seqs: MaxSeqsOpt = 256,
    kv_cache_tokens: KvCacheTokensOpt = None,
    dtype: DtypeOpt = "float32",
    quantize: QuantizeOpt = None,
    threads: ThreadsOpt = None,
    prefix_sharing: PrefixSharingOpt = True,
    json: JsonOpt = False,
) -> None:
    """Score a model on task files: multiple choice by the log-likelihood of each choice's text, generation by
    its greedy answer. Prints each task's accuracy with its standard error.

    The numbers do not depend on --max-batch-tokens, --max-seqs, --threads or prefix sharing: two evaluations of
    one checkpoint give the same bits. A rerun reuses an output written with the same settings, and continues an
    interrupted one; Ctrl-C stops after the current step (exit 130) and keeps what is done.
    """
    from lingctl.flood.engine.options import EngineOptions
    from lingctl.flood.eval.run import EvalOptions, run_eval  # torch loads only here

    at_least("--poll", poll, 0.1)
    to_stdout = out is not None and str(out) == STDOUT
    out_ = Output(json, stdout=sys.stderr) if to_stdout else Output(json)
    opts = EvalOptions(
        tasks=tasks,
        model=model,
        out=out,
        num_fewshot=num_fewshot,
        regex=regex,
        follow=follow,
        drop_k=drop_k,
        poll_s=poll,
        engine=EngineOptions(
            max_batch_tokens=max_batch_tokens,
            max_seqs=max_seqs,
            kv_cache_tokens=kv_cache_tokens,
            dtype=dtype,
            quantize=quantize,
            threads=threads,
            prefix_sharing=prefix_sharing,
        ),
    )
    stop = GracefulStop(lambda: out_.warn("stopping after this step (interrupt again to abort)"))
    with graceful_stop(stop), StatusView(out_) as view:
        summary = run_eval(opts, should_stop=stop, on_progress=lambda p: _show_progress(view, p))
    if to_stdout:
        for record in summary.results[0].records:
            sys.stdout.write(jsonlib.dumps(record, ensure_ascii=False) + "\n")
        sys.stdout.flush()
    out_.result(_public(summary), lambda c: _render(summary, c))


def _public(s: EvalSummary) -> dict[str, Any]:
    data = to_jsonable(s)
    for r in data["results"]:
        r.pop("records", None)
    data["tasks"] = to_jsonable(s.tasks)
    return data


def _render(s: EvalSummary, console: Any) -> None:
    from lingctl.flood.eval.report import drop_lines

    for r in s.results:
        where = r.model if r.step is None else f"step {r.step}" + (f" ({r.tokens:,} tokens)" if r.tokens else "")
        how = "reused" if r.reused else f"{r.seconds:.1f} s, {r.tokens_per_s:,.0f} tok/s"
        console.print(f"{where}: {r.items} items ({how})", markup=False)
        for t in r.tasks.values():
            line = f"  {t.task} ({t.kind}, {t.items}): acc {t.acc:.4f} ± {t.acc_stderr:.4f}"
            if t.acc_norm is not None and t.acc_norm_stderr is not None:
                line += f", acc_norm {t.acc_norm:.4f} ± {t.acc_norm_stderr:.4f}"
            console.print(line, markup=False)
        if r.errors:
            console.print(f"  {r.errors} items could not run and count as wrong (see 'error' in {r.out})", markup=False)
    for line in drop_lines(s.drops):
        console.print(f"flagged: {line}", markup=False)
    if s.mode == "run":
        console.print(f"table: {s.table}\nplot: {s.plot}", markup=False)
    console.print(f"output: {s.out}; {s.seconds:.1f} s in all", markup=False)


def _show_progress(view: StatusView, p: Progress) -> None:
    """Items done/total and scored tokens/s of the model being evaluated."""
    stats = p.stats
    rate = stats.generated_tokens / stats.seconds if stats is not None and stats.seconds > 0 else 0.0
    text = f"{p.label}: {p.items_done}/{p.items} items, {rate:,.0f} scored tok/s"
    view.show(f"eval {p.label}", text, completed=p.items_done, total=p.items)
