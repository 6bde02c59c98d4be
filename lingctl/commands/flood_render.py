"""What `lingctl flood run` and `lingctl flood eval` show, and where: human text drawn from the library's
records (``Progress``, ``FloodSummary``, ``EvalSummary``: the library counts, this module writes), progress
while the work runs, and the results on stdout for ``-o -`` (the summary then goes to stderr)."""

from __future__ import annotations

import json
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lingctl.commands.options import STDOUT
from lingctl.commands.status_view import StatusView
from lingctl.core.graceful_stop import GracefulStop, graceful_stop
from lingctl.core.output import Output, to_jsonable
from lingctl.core.units import format_params, format_size

if TYPE_CHECKING:
    from lingctl.flood.batch.run import FloodSummary
    from lingctl.flood.engine.plan import MemoryPlan
    from lingctl.flood.engine.session import Progress
    from lingctl.flood.eval.run import EvalSummary, ModelResult


def command_output(json: bool, out: Path | None) -> tuple[Output, bool]:
    """The output layer, and whether the results themselves go to stdout (``-o -``): the summary (human or
    JSON) then goes to stderr, so stdout stays pure JSONL."""
    to_stdout = out is not None and str(out) == STDOUT
    return (Output(json, stdout=sys.stderr) if to_stdout else Output(json)), to_stdout


def stop_after_step(out: Output) -> GracefulStop:
    """Ctrl-C / SIGTERM finish the current step and stop; what is written so far is kept."""
    return GracefulStop(lambda: out.warn("stopping after this step (interrupt again to abort)"))


@contextmanager
def progress(out: Output, stop: GracefulStop) -> Iterator[Callable[[Progress], None]]:
    """While the work runs: signals handled by ``stop``, and a callback that shows each ``Progress``."""
    with graceful_stop(stop), StatusView(out) as view:
        yield lambda p: show_progress(view, p)


def show_progress(view: StatusView, p: Progress) -> None:
    """Units done of the total, tok/s, KV use, prefix hits, running and waiting requests, and (in log lines)
    the ETA; one bar per model evaluated."""
    stats = p.stats
    rate = stats.generated_tokens / stats.seconds if stats.seconds > 0 else 0.0
    kv = 100.0 * stats.kv_used_slots / max(1, stats.kv_slots)
    who = f"{p.label}: " if p.label else ""
    text = (
        f"{who}{p.done}/{p.total} {p.unit}, {rate:,.0f} tok/s, KV {kv:.0f}%, prefix hits {stats.prefix_hits}, "
        f"running {stats.running}, waiting {stats.waiting}"
    )
    # From the engine's own counts: units done by an earlier, resumed run took no time here.
    left = stats.requests - stats.finished
    line = f"{text}, ETA {stats.seconds / stats.finished * left:.0f} s" if stats.finished else text
    view.show(p.label or "flood", text, completed=p.done, total=p.total, line=line)


# -- flood run ------------------------------------------------------------------------------------------


def run_summary(s: FloodSummary) -> str:
    """A dry run's memory plan and plan of the batch, or what the run did and where it went (a real run said
    its memory plan on stderr when it started)."""
    lines = plan_lines(s.plan) if s.plan is not None and s.dry_run else []
    if s.dry_run:
        lines.append(
            f"plan: {s.requests} requests ({s.invalid_lines} invalid lines, {s.already_done} already "
            f"answered), {s.prompt_tokens:,} prompt tokens, up to {s.estimated_generated_tokens:,} "
            f"generated; {s.prefix_entries} shared prefixes save {s.prefix_tokens_saved:,} prefill "
            f"tokens; the batch needs at most {s.plan.batch_kv_tokens if s.plan else 0:,} KV tokens"
        )
        return "\n".join(lines)
    lines.append(
        f"{s.succeeded} answered, {s.failed + s.invalid_lines} failed, {s.already_done} already done; "
        f"{s.generated_tokens:,} tokens in {s.seconds:.1f} s = {s.generated_tokens_per_s:,.0f} tok/s "
        f"(prompt {s.prompt_tokens_per_s:,.1f} tok/s, decode {s.decode_tokens_per_s:,.1f} tok/s); "
        f"prefix sharing saved {s.prefix_tokens_saved:,} prefill tokens; peak KV "
        f"{s.kv_peak_tokens:,}/{s.kv_cache_tokens:,} tokens; {s.preemptions} preemptions"
    )
    if s.load_seconds:
        lines.append(
            f"load: {format_size(s.load_bytes_read)} read in {s.load_seconds:.1f} s; peak memory "
            f"{format_size(s.peak_rss_bytes)} against a plan of {format_size(s.plan_total_bytes)} "
            f"({s.peak_rss_bytes / max(1, s.plan_total_bytes):.0%})"
        )
    if s.threads:
        t = s.threads
        changes = f", {len(t['changes'])} changes, ending at {t['final_threads']}" if t.get("changes") else ""
        stage = f", {t['threads_per_stage']} per stage" if t.get("threads_per_stage") else ""
        lines.append(f"threads: {t['threads']} ({t['source']}{changes}){stage}")
    lines.append(f"output: {s.out}\nerrors: {s.errors}")
    return "\n".join(lines)


def plan_lines(p: MemoryPlan) -> list[str]:
    """The model's size and the memory plan, part by part."""
    quant = ", int8 linears" if p.quantize else ""
    return [
        f"model: {format_params(p.params)} parameters ({format_params(p.active_params)} active), weights "
        f"{format_size(p.weights_bytes)} ({p.dtype}{quant}); KV cache {p.kv_tokens:,} tokens "
        f"= {format_size(p.kv_bytes)} ({format_size(p.kv_bytes_per_token)}/token); activations "
        f"{format_size(p.activation_bytes)}; {format_size(p.available_bytes)} available",
        f"memory plan: peak {format_size(p.total_bytes)} = runtime {format_size(p.runtime_bytes)} + "
        f"weights {format_size(p.weights_bytes)} + the larger of load buffers "
        f"{format_size(p.loader_bytes)} and packed copies {format_size(p.engine_bytes)} + activations "
        f"+ KV {format_size(p.activation_bytes + p.kv_bytes)}",
    ]


def answers_to_stdout(
    stack: ExitStack, batch: Path, errors: Path | None, on_broken_pipe: Callable[[], Any]
) -> tuple[Path, Path]:
    """The output and errors files of a run whose answers go to stdout (``-o -``): it writes its usual files
    into a private directory, and a thread copies each finished answer line from there to stdout as it lands,
    so a pipe sees answers as they finish. Both last as long as ``stack``."""
    scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lingctl-flood-")))
    out = scratch / f"{batch.stem}.output.jsonl"
    stack.enter_context(StdoutTail(out, on_broken_pipe=on_broken_pipe))
    return out, errors if errors is not None else batch.with_name(f"{batch.stem}.errors.jsonl")


class StdoutTail:
    """Copies complete lines of a growing file to stdout while a block runs, then the rest at its end.

    The answers file is written a whole line at a time (and flushed), so a copy never splits a record. A reader
    that goes away (``| head``) asks the run to stop, and the block then ends with BrokenPipeError, which the
    CLI turns into a quiet exit."""

    _POLL_S = 0.2

    def __init__(self, path: Path, *, on_broken_pipe: Callable[[], Any]) -> None:
        self.path = path
        self._on_broken_pipe = on_broken_pipe
        self._pos = 0
        self._broken = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lingctl-flood-stdout", daemon=True)

    def __enter__(self) -> StdoutTail:
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
            _write_stdout(data)
        except BrokenPipeError:
            self._broken = True
            self._on_broken_pipe()
            return
        self._pos += len(data)


def _write_stdout(data: bytes) -> None:
    stream = getattr(sys.stdout, "buffer", None)  # a test's captured stdout is text only
    if stream is not None:
        stream.write(data)
        stream.flush()
    else:
        sys.stdout.write(data.decode("utf-8"))
        sys.stdout.flush()


# -- flood eval -----------------------------------------------------------------------------------------


def eval_json(s: EvalSummary) -> dict[str, Any]:
    """The summary for --json: the per-item records stay in their files."""
    data = to_jsonable(s)
    for r in data["results"]:
        r.pop("records", None)
    data["tasks"] = to_jsonable(s.tasks)
    return data


def write_records(records: list[dict[str, Any]]) -> None:
    """One model's per-item records to stdout, one JSON object per line (``-o -``)."""
    for record in records:
        sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def eval_summary(s: EvalSummary) -> str:
    """Each model's (or checkpoint's) task scores, the flagged drops, and where the results went."""
    from lingctl.flood.eval.report import drop_lines

    lines = [line for r in s.results for line in _model_lines(r)]
    lines += [f"flagged: {line}" for line in drop_lines(s.drops)]
    if s.mode == "run":
        lines.append(f"table: {s.table}\nplot: {s.plot}")
    lines.append(f"output: {s.out}; {s.seconds:.1f} s in all")
    return "\n".join(lines)


def _model_lines(r: ModelResult) -> list[str]:
    where = r.model if r.step is None else f"step {r.step}" + (f" ({r.tokens:,} tokens)" if r.tokens else "")
    how = "reused" if r.reused else f"{r.seconds:.1f} s, {r.tokens_per_s:,.0f} tok/s"
    lines = [f"{where}: {r.items} items ({how})"]
    for t in r.tasks.values():
        line = f"  {t.task} ({t.kind}, {t.items}): acc {t.acc:.4f} ± {t.acc_stderr:.4f}"
        if t.acc_norm is not None and t.acc_norm_stderr is not None:
            line += f", acc_norm {t.acc_norm:.4f} ± {t.acc_norm_stderr:.4f}"
        lines.append(line)
    if r.errors:
        lines.append(f"  {r.errors} items could not run and count as wrong (see 'error' in {r.out})")
    return lines
