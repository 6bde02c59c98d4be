"""`lingctl flood run`: offline batch inference; a thin wrapper over lingctl.flood.batch.run."""

from __future__ import annotations

import sys
import tempfile
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from lingctl.commands import flood_eval
from lingctl.commands.options import (
    STDOUT,
    DtypeOpt,
    JsonOpt,
    KvCacheTokensOpt,
    MaxBatchTokensOpt,
    MaxSeqsOpt,
    PrefixSharingOpt,
    QuantizeOpt,
    ThreadsOpt,
)
from lingctl.commands.status_view import StatusView
from lingctl.core.errors import UsageError
from lingctl.core.graceful_stop import GracefulStop, graceful_stop
from lingctl.core.output import Output, to_jsonable
from lingctl.core.units import format_size

if TYPE_CHECKING:
    from lingctl.flood.batch.run import FloodSummary
    from lingctl.flood.engine.loop import EngineStats

app = typer.Typer(
    help="Offline batch inference: continuous batching, segment KV cache, prefix sharing, pipeline stages.",
    no_args_is_help=True,
    rich_markup_mode=None,
)

app.command("eval")(flood_eval.eval_cmd)


@app.command("run")
def run(
    batch: Annotated[
        Path,
        typer.Argument(help='Requests, one JSON object per line (OpenAI batch format or {"custom_id", "prompt"}).'),
    ],
    model: Annotated[
        str,
        typer.Option(
            "--model",
            "-m",
            metavar="DIR|ORG/NAME[@REV]",
            help="Checkpoint directory (lingctl or Hugging Face layout), or a Hugging Face model id read from the "
            "Hugging Face cache (HF_HOME; downloaded when missing unless HF_HUB_OFFLINE=1).",
        ),
    ],
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            metavar="FILE",
            help="Output JSONL (default: BATCH.output.jsonl); '-': standard output, as "
            "answers finish (the summary then goes to stderr; nothing to --resume).",
        ),
    ] = None,
    errors: Annotated[
        Path | None,
        typer.Option(
            "--errors",
            metavar="FILE",
            help="Errors JSONL (default: beside the output; with '-o -', BATCH.errors.jsonl).",
        ),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue an interrupted run: skip answered requests.")
    ] = False,
    stages: Annotated[
        int,
        typer.Option("--stages", metavar="N", help="Pipeline stages (processes), each holding a slice of the layers."),
    ] = 1,
    max_batch_tokens: MaxBatchTokensOpt = 1024,
    max_seqs: MaxSeqsOpt = 256,
    kv_cache_tokens: KvCacheTokensOpt = None,
    dtype: DtypeOpt = "float32",
    quantize: QuantizeOpt = None,
    prefix_sharing: PrefixSharingOpt = True,
    chat_template: Annotated[
        Path | None,
        typer.Option(
            "--chat-template",
            metavar="FILE",
            help="Jinja chat template file, overriding the model's (default: the "
            "model's own); rendered in a sandbox with per-request time, size "
            "and memory limits.",
        ),
    ] = None,
    threads: ThreadsOpt = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", "-n", help="Read the config only; print the memory plan.")
    ] = False,
    json: JsonOpt = False,
) -> None:
    """Run every request of BATCH through the model; answers are appended to the output as they finish.

    Ctrl-C or SIGTERM stops after the current step and exits 130; every answer written so far is kept, and
    --resume continues without repeating any.
    """
    from lingctl.flood.batch.run import FloodOptions, run_batch  # torch loads only here

    to_stdout = out is not None and str(out) == STDOUT
    if to_stdout and resume:
        raise UsageError(
            "--resume reads the earlier answers from the output file, and '-o -' has none",
            hint="write to a file (-o FILE) to be able to resume",
        )
    # With the answers on stdout, the summary (human or JSON) goes to stderr so stdout stays pure JSONL.
    out_ = Output(json, stdout=sys.stderr) if to_stdout else Output(json)
    # Ctrl-C / SIGTERM finish the current step and stop (the output so far is kept; --resume continues).
    stop = GracefulStop(lambda: out_.warn("stopping after this step (interrupt again to abort)"))
    with ExitStack() as stack:
        if to_stdout and not dry_run:
            # The run writes its usual files into a private directory; a thread copies each finished answer line
            # from there to stdout as it lands, so a pipe sees answers as they finish.
            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lingctl-flood-")))
            out = scratch / f"{batch.stem}.output.jsonl"
            errors = errors if errors is not None else batch.with_name(f"{batch.stem}.errors.jsonl")
            stack.enter_context(_StdoutTail(out, on_broken_pipe=stop.request))
        elif to_stdout:
            out = None  # a dry run writes nothing: plan against the default names
        opts = FloodOptions(
            batch=batch,
            model=model,
            out=out,
            errors=errors,
            resume=resume,
            stages=stages,
            max_batch_tokens=max_batch_tokens,
            max_seqs=max_seqs,
            kv_cache_tokens=kv_cache_tokens,
            dtype=dtype,
            quantize=quantize,
            prefix_sharing=prefix_sharing,
            chat_template=chat_template,
            threads=threads,
            dry_run=dry_run,
        )
        summary = _run(out_, opts, run_batch, stop)
    if to_stdout:
        summary.out = "stdout"
    out_.result(to_jsonable(summary), lambda c: _summary(summary, c))


def _run(out_: Output, opts: Any, run_batch: Any, stop: GracefulStop) -> FloodSummary:
    """``run_batch`` with Ctrl-C / SIGTERM turned into a stop after the current step."""
    with graceful_stop(stop), StatusView(out_) as view:
        return run_batch(opts, on_progress=lambda stats, _summary: _show_progress(view, stats), should_stop=stop)


def _summary(s: FloodSummary, console: Any) -> None:
    p = s.plan
    if p is not None:
        quant = ", int8 linears" if p.quantize else ""
        console.print(
            f"model: {_count(p.params)} parameters ({_count(p.active_params)} active), weights "
            f"{format_size(p.weights_bytes)} ({p.dtype}{quant}); KV cache {p.kv_tokens:,} tokens "
            f"= {format_size(p.kv_bytes)} ({format_size(p.kv_bytes_per_token)}/token); activations "
            f"{format_size(p.activation_bytes)}; {format_size(p.available_bytes)} available",
            markup=False,
        )
        console.print(
            f"memory plan: peak {format_size(p.total_bytes)} = runtime {format_size(p.runtime_bytes)} + "
            f"weights {format_size(p.weights_bytes)} + the larger of load buffers "
            f"{format_size(p.loader_bytes)} and packed copies {format_size(p.engine_bytes)} + activations "
            f"+ KV {format_size(p.activation_bytes + p.kv_bytes)}",
            markup=False,
        )
    if s.dry_run:
        console.print(
            f"plan: {s.requests} requests ({s.invalid_lines} invalid lines, {s.already_done} already "
            f"answered), {s.prompt_tokens:,} prompt tokens, up to {s.estimated_generated_tokens:,} "
            f"generated; {s.prefix_entries} shared prefixes save {s.prefix_tokens_saved:,} prefill "
            f"tokens; the batch needs at most {p.batch_kv_tokens if p else 0:,} KV tokens",
            markup=False,
        )
        return
    console.print(
        f"{s.succeeded} answered, {s.failed + s.invalid_lines} failed, {s.already_done} already done; "
        f"{s.generated_tokens:,} tokens in {s.seconds:.1f} s = {s.generated_tokens_per_s:,.0f} tok/s; "
        f"prefix sharing saved {s.prefix_tokens_saved:,} prefill tokens; peak KV "
        f"{s.kv_peak_tokens:,}/{s.kv_cache_tokens:,} tokens; {s.preemptions} preemptions",
        markup=False,
    )
    if s.load_seconds:
        console.print(
            f"load: {format_size(s.load_bytes_read)} read in {s.load_seconds:.1f} s; peak memory "
            f"{format_size(s.peak_rss_bytes)} against a plan of {format_size(s.plan_total_bytes)} "
            f"({s.peak_rss_bytes / max(1, s.plan_total_bytes):.0%})",
            markup=False,
        )
    if s.threads:
        t = s.threads
        changes = f", {len(t['changes'])} changes, ending at {t['final_threads']}" if t.get("changes") else ""
        stage = f", {t['threads_per_stage']} per stage" if t.get("threads_per_stage") else ""
        console.print(f"threads: {t['threads']} ({t['source']}{changes}){stage}", markup=False)
    console.print(f"output: {s.out}\nerrors: {s.errors}", markup=False)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _show_progress(view: StatusView, stats: EngineStats) -> None:
    """Requests done/total, tok/s, KV use, prefix hits and (in log lines) the ETA."""
    rate = stats.generated_tokens / stats.seconds if stats.seconds > 0 else 0.0
    kv = 100.0 * stats.kv_used_slots / max(1, stats.kv_slots)
    left = stats.requests - stats.finished
    eta = stats.seconds / stats.finished * left if stats.finished else float("nan")
    text = (
        f"{stats.finished}/{stats.requests} requests, {rate:,.0f} tok/s, KV {kv:.0f}%, "
        f"prefix hits {stats.prefix_hits}, running {stats.running}, waiting {stats.waiting}"
    )
    line = f"{text}, ETA {eta:.0f} s" if eta == eta else text
    view.show("flood", text, completed=stats.finished, total=stats.requests, line=line)


class _StdoutTail:
    """Copies complete lines of a growing file to stdout while a block runs, then the rest at its end.

    The answers file is written a whole line at a time (and flushed), so a copy never splits a record. A reader
    that goes away (``| head``) asks the run to stop, and the block then ends with BrokenPipeError, which the
    CLI turns into a quiet exit."""

    _POLL_S = 0.2

    def __init__(self, path: Path, *, on_broken_pipe: Any) -> None:
        self.path = path
        self._on_broken_pipe = on_broken_pipe
        self._pos = 0
        self._broken = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lingctl-flood-stdout", daemon=True)

    def __enter__(self) -> _StdoutTail:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join()
        self._copy(final=True)
        if self._broken:
            raise BrokenPipeError("standard output closed")

    def _loop(self) -> None:
        while not self._done.wait(self._POLL_S):
            self._copy(final=False)

    def _copy(self, *, final: bool) -> None:
        if self._broken:
            return
        try:
            with open(self.path, "rb") as f:
                f.seek(self._pos)
                data = f.read()
        except FileNotFoundError:  # not created yet (the model is still loading)
            return
        if not final:
            data = data[: data.rfind(b"\n") + 1]  # whole lines only; the rest comes next time
        if not data:
            return
        try:
            stream = getattr(sys.stdout, "buffer", None)  # a test's captured stdout is text only
            if stream is not None:
                stream.write(data)
                stream.flush()
            else:
                sys.stdout.write(data.decode("utf-8"))
                sys.stdout.flush()
        except BrokenPipeError:
            self._broken = True
            self._on_broken_pipe()
            return
        self._pos += len(data)
