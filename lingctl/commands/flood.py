"""`lingctl flood run`: offline batch inference; a thin wrapper over lingctl.flood.run."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from lingctl.commands.options import JsonOpt
from lingctl.core.output import Output, to_jsonable
from lingctl.core.units import format_size

if TYPE_CHECKING:
    from lingctl.flood.engine import EngineStats
    from lingctl.flood.run import FloodSummary

app = typer.Typer(help="Offline batch inference: continuous batching, segment KV cache, prefix sharing, "
                       "pipeline stages.", no_args_is_help=True)

_HUMAN_EVERY_S = 5.0


@app.command("run")
def run(
    batch: Annotated[Path, typer.Argument(help="Requests, one JSON object per line (OpenAI batch format or "
                                               "{\"custom_id\", \"prompt\"}).")],
    model: Annotated[str, typer.Option(
        "--model", "-m", metavar="DIR|ORG/NAME[@REV]",
        help="Checkpoint directory (lingctl or Hugging Face layout), or a Hugging Face model id read from the "
             "Hugging Face cache (HF_HOME; downloaded when missing unless HF_HUB_OFFLINE=1).")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Output JSONL (default: BATCH.output.jsonl).")] = None,
    errors: Annotated[Path | None, typer.Option("--errors", help="Errors JSONL (default: beside the output).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue an interrupted run: skip answered requests.")] = False,
    stages: Annotated[int, typer.Option("--stages", help="Pipeline stages (processes), each holding a slice of "
                                                         "the layers.")] = 1,
    max_batch_tokens: Annotated[int, typer.Option("--max-batch-tokens", help="Tokens per engine step.")] = 1024,
    max_seqs: Annotated[int, typer.Option("--max-seqs", help="Requests running at once.")] = 256,
    kv_cache_tokens: Annotated[int | None, typer.Option(
        "--kv-cache-tokens", help="KV cache size in tokens (default: what the batch needs, within 90% of free "
                                  "memory).")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="float32 or bfloat16.")] = "float32",
    quantize: Annotated[str | None, typer.Option("--quantize", help="int8: weight-only int8 linear layers.")] = None,
    prefix_sharing: Annotated[bool, typer.Option(
        "--prefix-sharing/--no-prefix-sharing", help="Compute prompt prefixes shared by several requests once.")] = True,
    chat_template: Annotated[Path | None, typer.Option(
        "--chat-template", help="Jinja chat template file, overriding the model's; rendered in a sandbox with "
                                "per-request time, size and memory limits.")] = None,
    threads: Annotated[int | None, typer.Option(
        "--threads", help="CPU compute threads. Default (or 0): the cores other processes leave free, "
                          "re-measured every few seconds; one thread where results would depend on the count "
                          "(float32 with int8 weights, or without a C compiler for flood's kernels).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Read the config only; print the memory plan.")] = False,
    json: JsonOpt = False,
) -> None:
    """Run every request of BATCH through the model; answers are appended to the output as they finish.

    Ctrl-C or SIGTERM stops after the current step and exits 130; every answer written so far is kept, and
    --resume continues without repeating any.
    """
    from lingctl.flood.run import FloodOptions, run_batch  # torch loads only here

    out_ = Output(json)
    opts = FloodOptions(batch=batch, model=model, out=out, errors=errors, resume=resume, stages=stages,
                        max_batch_tokens=max_batch_tokens, max_seqs=max_seqs, kv_cache_tokens=kv_cache_tokens,
                        dtype=dtype, quantize=quantize, prefix_sharing=prefix_sharing, chat_template=chat_template,
                        threads=threads, dry_run=dry_run)
    stop = {"requested": False}
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def on_signal(signum: int, frame: Any) -> None:
        if stop["requested"]:
            raise KeyboardInterrupt
        stop["requested"] = True
        out_.warn("stopping after this step (interrupt again to abort)")

    view = _View(out_)
    for sig in previous:
        signal.signal(sig, on_signal)
    try:
        with view:
            summary = run_batch(opts, on_progress=view.update, should_stop=lambda: stop["requested"])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    out_.result(to_jsonable(summary), lambda c: _summary(summary, c))


def _summary(s: FloodSummary, console: Any) -> None:
    p = s.plan
    if p is not None:
        quant = ", int8 linears" if p.quantize else ""
        console.print(f"model: {_count(p.params)} parameters ({_count(p.active_params)} active), weights "
                      f"{format_size(p.weights_bytes)} ({p.dtype}{quant}); KV cache {p.kv_tokens:,} tokens "
                      f"= {format_size(p.kv_bytes)} ({format_size(p.kv_bytes_per_token)}/token); activations "
                      f"{format_size(p.activation_bytes)}; {format_size(p.available_bytes)} available",
                      markup=False)
        console.print(f"memory plan: peak {format_size(p.total_bytes)} = runtime {format_size(p.runtime_bytes)} + "
                      f"weights {format_size(p.weights_bytes)} + the larger of load buffers "
                      f"{format_size(p.loader_bytes)} and packed copies {format_size(p.engine_bytes)} + activations "
                      f"+ KV {format_size(p.activation_bytes + p.kv_bytes)}", markup=False)
    if s.dry_run:
        console.print(f"plan: {s.requests} requests ({s.invalid_lines} invalid lines, {s.already_done} already "
                      f"answered), {s.prompt_tokens:,} prompt tokens, up to {s.estimated_generated_tokens:,} "
                      f"generated; {s.prefix_entries} shared prefixes save {s.prefix_tokens_saved:,} prefill "
                      f"tokens; the batch needs at most {p.batch_kv_tokens if p else 0:,} KV tokens", markup=False)
        return
    console.print(f"{s.succeeded} answered, {s.failed + s.invalid_lines} failed, {s.already_done} already done; "
                  f"{s.generated_tokens:,} tokens in {s.seconds:.1f} s = {s.generated_tokens_per_s:,.0f} tok/s; "
                  f"prefix sharing saved {s.prefix_tokens_saved:,} prefill tokens; peak KV "
                  f"{s.kv_peak_tokens:,}/{s.kv_cache_tokens:,} tokens; {s.preemptions} preemptions", markup=False)
    if s.load_seconds:
        console.print(f"load: {format_size(s.load_bytes_read)} read in {s.load_seconds:.1f} s; peak memory "
                      f"{format_size(s.peak_rss_bytes)} against a plan of {format_size(s.plan_total_bytes)} "
                      f"({s.peak_rss_bytes / max(1, s.plan_total_bytes):.0%})", markup=False)
    if s.threads:
        t = s.threads
        changes = f", {len(t['changes'])} changes, ending at {t['final_threads']}" if t.get("changes") else ""
        stage = f", {t['threads_per_stage']} per stage" if t.get("threads_per_stage") else ""
        console.print(f"threads: {t['threads']} ({t['source']}{changes}){stage}", markup=False)
    console.print(f"output: {s.out}\nerrors: {s.errors}", markup=False)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


class _View:
    """Requests done/total, tok/s, KV use, prefix hits and ETA: a Rich bar on a terminal, a status line every
    few seconds otherwise, nothing with --json (the summary is the answer)."""

    def __init__(self, out: Output) -> None:
        self.out = out
        self._cm: Any = None
        self._task: Any = None
        self._last = time.monotonic()

    def __enter__(self) -> _View:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._cm is not None:
            self._cm.__exit__(*exc)

    def update(self, stats: EngineStats, summary: FloodSummary) -> None:
        if self._cm is None:
            self._cm = self.out.progress("flood", total=stats.requests)
            self._task = self._cm.__enter__()
        rate = stats.generated_tokens / stats.seconds if stats.seconds > 0 else 0.0
        kv = 100.0 * stats.kv_used_slots / max(1, stats.kv_slots)
        left = stats.requests - stats.finished
        eta = stats.seconds / stats.finished * left if stats.finished else float("nan")
        text = (f"{stats.finished}/{stats.requests} requests, {rate:,.0f} tok/s, KV {kv:.0f}%, "
                f"prefix hits {stats.prefix_hits}, running {stats.running}, waiting {stats.waiting}")
        self._task.update(description=text, completed=stats.finished)
        if not self.out.progress_enabled and time.monotonic() - self._last >= _HUMAN_EVERY_S:
            self._last = time.monotonic()
            self.out.info(f"{text}, ETA {eta:.0f} s" if eta == eta else text)
