"""``flood run``: batch file in, OpenAI batch output out, through the engine.

Order of work: validate the whole batch file; find the model directory (a local one, or a Hugging Face model
id's snapshot in the cache: ``lingctl.model.hub``) and open it (config, tokenizer, template); on
``--resume`` read what was already answered; turn the other prompts into token ids; plan memory from the
config alone; then (unless ``--dry-run``) load the weights and run, writing each answer the moment it is final.

Every request is isolated: a request that cannot be rendered, tokenized, sampled or written out gets its own
line in the errors file and the others go on. Only what concerns them all (the model, the files, a template
that does not compile) stops the run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import resource
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lingctl.core.errors import Interrupted, LingctlError, UsageError, os_error
from lingctl.core.names import printable
from lingctl.flood.batch.output import BatchOutput, ResumeState, default_paths, preview_resume
from lingctl.flood.batch.requests import Request, read_batch
from lingctl.flood.engine.loop import (
    Engine,
    EngineConfig,
    EngineStats,
    GenRequest,
    GenResult,
    LocalRunner,
    error_text,
)
from lingctl.flood.engine.options import EngineOptions
from lingctl.flood.engine.plan import MemoryPlan, check_weights_fit, plan_memory
from lingctl.flood.engine.prefix import plan_prefixes
from lingctl.flood.engine.segment_cache import KVPool
from lingctl.flood.engine.threads import ThreadPolicy, stage_threads
from lingctl.flood.text.chat_template import TemplateLimits
from lingctl.flood.text.tokens import PromptError, TextCodec
from lingctl.flood.weights.model_dir import ModelDir
from lingctl.model.checkpoint import parse_dtype
from lingctl.model.hub import parse_repo_id, resolve_model_dir

log = logging.getLogger(__name__)

ENGINE_VERSION = "flood/1"


@dataclass(kw_only=True, slots=True)
class FloodOptions:
    batch: Path
    model: Path | str  # checkpoint directory, or Hugging Face model id ORG/NAME[@REVISION] (from the cache)
    out: Path | None = None
    errors: Path | None = None
    resume: bool = False
    stages: int = 1
    max_batch_tokens: int = 1024
    max_seqs: int = 256
    kv_cache_tokens: int | None = None
    dtype: str = "float32"
    quantize: str | None = None
    prefix_sharing: bool = True
    chat_template: Path | None = None
    threads: int | None = None
    dry_run: bool = False
    chunk: int = 16  # prompt chunk / prefix block; fixes numerics, so it is part of the manifest
    template_limits: TemplateLimits = field(default_factory=TemplateLimits)  # per chat request

    def validate(self) -> None:
        if self.stages < 1:
            raise UsageError(f"--stages must be >= 1, got {self.stages}")
        EngineOptions(
            max_batch_tokens=self.max_batch_tokens,
            max_seqs=self.max_seqs,
            kv_cache_tokens=self.kv_cache_tokens,
            dtype=self.dtype,
            quantize=self.quantize,
            threads=self.threads,
            chunk=self.chunk,
        ).validate()


@dataclass(kw_only=True, slots=True)
class FloodSummary:
    out: str
    errors: str
    requests: int = 0  # lines that parsed into requests
    invalid_lines: int = 0
    already_done: int = 0
    succeeded: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    generated_tokens_per_s: float = 0.0
    prefix_entries: int = 0
    prefix_tokens_saved: int = 0
    steps: int = 0
    preemptions: int = 0
    kv_cache_tokens: int = 0
    kv_peak_tokens: int = 0
    dry_run: bool = False
    plan: MemoryPlan | None = None
    plan_total_bytes: int = 0  # what the plan says the process will hold at its peak
    peak_rss_bytes: int = 0  # what it held at its peak (this process; pipeline stages are other processes)
    load_seconds: float = 0.0
    load_bytes_read: int = 0
    estimated_generated_tokens: int = 0
    interrupted: bool = False
    engine: dict[str, Any] = field(default_factory=dict)
    threads: dict[str, Any] = field(default_factory=dict)  # compute threads: count, how chosen, changes


@dataclass(slots=True)
class _Job:
    req: Request
    ids: list[int]


def _manifest(opts: FloodOptions, md: ModelDir, batch_name: str, template: str | None) -> dict[str, Any]:
    return {
        "engine": ENGINE_VERSION,
        "model": str(md.path),
        "model_fingerprint": md.fingerprint(),
        "dtype": opts.dtype,
        "quantize": opts.quantize,
        "prompt_chunk": opts.chunk,
        "batch": batch_name,
        # The template in effect (--chat-template or the model's): it decides every chat prompt.
        "chat_template_sha256": None if template is None else hashlib.sha256(template.encode()).hexdigest(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        # What changes answers; batch size, stages and cache size do not (outputs are batch-invariant).
        "compare": ["engine", "model_fingerprint", "dtype", "quantize", "prompt_chunk", "chat_template_sha256"],
    }


def _read_template(path: Path) -> str:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise os_error(exc, f"--chat-template {path}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"--chat-template {path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})"
        ) from None


def _body(job: _Job, res: GenResult, codec: TextCodec, model_name: str) -> dict[str, Any]:
    text = res.stop_text if res.stop_text is not None else codec.decode(res.token_ids)
    usage = {
        "prompt_tokens": res.prompt_tokens,
        "completion_tokens": len(res.token_ids),
        "total_tokens": res.prompt_tokens + len(res.token_ids),
        "prompt_tokens_details": {"cached_tokens": res.cached_tokens},
    }
    created = int(time.time())
    model = job.req.model or model_name
    if job.req.is_chat:
        return {
            "id": f"chatcmpl-{secrets.token_hex(12)}",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": res.finish_reason,
                    "logprobs": None,
                    "token_ids": res.token_ids,
                }
            ],
            "usage": usage,
        }
    return {
        "id": f"cmpl-{secrets.token_hex(12)}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "text": text, "finish_reason": res.finish_reason, "logprobs": None, "token_ids": res.token_ids}
        ],
        "usage": usage,
    }


def run_batch(
    opts: FloodOptions,
    *,
    on_progress: Callable[[EngineStats, FloodSummary], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> FloodSummary:
    opts.validate()
    dtype = parse_dtype(opts.dtype)
    batch = read_batch(opts.batch)
    model_dir = resolve_model_dir(opts.model, option="--model")
    md = ModelDir.open(model_dir)  # stages, fingerprint and loading all use this directory, never the id
    check_weights_fit(md.config, dtype=dtype, quantize=opts.quantize)  # before the fingerprint reads a byte
    if not opts.dry_run:
        md.check_weights()
    template = _read_template(opts.chat_template) if opts.chat_template is not None else md.chat_template()
    codec = TextCodec.for_model(
        md.path, chat_template=template, special_tokens=md.special_tokens(), limits=opts.template_limits
    )
    codec.check_template()
    out, errors = default_paths(opts.batch, opts.out, opts.errors)
    summary = FloodSummary(
        out=str(out),
        errors=str(errors),
        requests=len(batch.requests),
        invalid_lines=len(batch.errors),
        dry_run=opts.dry_run,
    )

    output: BatchOutput | None = None
    state = ResumeState()
    if not opts.dry_run:
        output = BatchOutput(out, errors, _manifest(opts, md, opts.batch.name, template), resume=opts.resume)
        state = output.state
    elif opts.resume:  # a dry run changes no file, but plans only what the resume would still answer
        state = preview_resume(out, errors, _manifest(opts, md, opts.batch.name, template))
    done, reported = state.done, state.error_lines
    try:
        if output is not None:
            for err in batch.errors:
                if err.line not in reported:
                    output.write_error(
                        custom_id=err.custom_id,
                        line=err.line,
                        code=err.code,
                        message=err.message,
                        status_code=None if err.custom_id is None else 400,
                    )
        todo = [req for req in batch.requests if req.custom_id not in done]
        summary.already_done = len(batch.requests) - len(todo)
        try:
            jobs = _prompts(codec, todo, output, summary, should_stop)
        finally:
            codec.close()  # the template worker is not needed past here
        plan = _plan(opts, md, jobs, dtype)
        summary.plan = plan
        summary.plan_total_bytes = plan.total_bytes
        summary.kv_cache_tokens = plan.kv_tokens
        summary.estimated_generated_tokens = sum(_max_new(md, j) for j in jobs)
        if opts.dry_run:
            pp = plan_prefixes([j.ids for j in jobs], opts.chunk) if opts.prefix_sharing else None
            summary.prefix_entries = len(pp.entries) if pp else 0
            summary.prefix_tokens_saved = pp.tokens_saved if pp else 0
            summary.prompt_tokens = sum(len(j.ids) for j in jobs)
            return summary
        assert output is not None
        try:
            _generate(opts, md, codec, jobs, plan, dtype, output, summary, on_progress, should_stop)
        finally:
            summary.peak_rss_bytes = peak_rss_bytes()
        return summary
    finally:
        if output is not None:
            output.close()


def _prompts(
    codec: TextCodec,
    requests: list[Request],
    output: BatchOutput | None,
    summary: FloodSummary,
    should_stop: Callable[[], bool] | None,
) -> list[_Job]:
    """Token ids of each request; one that cannot be rendered or tokenized gets its error line at once."""
    jobs: list[_Job] = []
    for req in requests:
        if should_stop is not None and should_stop():
            raise Interrupted(
                "interrupted while preparing prompts; every answer written so far is kept",
                hint="continue with the same command plus --resume",
            )
        try:
            jobs.append(_Job(req, codec.prompt_ids(req)))
            continue
        except PromptError as exc:
            message = str(exc)
        except LingctlError:
            raise  # not this request's fault (the template worker cannot start)
        except Exception as exc:  # the tokenizer failed on this text: this request's problem only
            log.debug("tokenizing request %s failed", printable(req.custom_id), exc_info=True)
            message = f"could not tokenize the prompt: {error_text(exc)}"
        summary.failed += 1
        if output is not None:
            output.write_error(custom_id=req.custom_id, line=req.line, code="invalid_prompt", message=message)
    return jobs


def peak_rss_bytes() -> int:
    """This process's peak resident memory (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _max_new(md: ModelDir, job: _Job) -> int:
    room = md.config.max_position_embeddings - len(job.ids)
    want = job.req.sampling.max_tokens
    return max(0, room if want is None else min(want, room))


def _plan(opts: FloodOptions, md: ModelDir, jobs: list[_Job], dtype: torch.dtype) -> MemoryPlan:
    sizes = [len(j.ids) + _max_new(md, j) for j in jobs]
    largest = max((len(j.ids) + 1 for j in jobs if len(j.ids) < md.config.max_position_embeddings), default=1)
    saved = plan_prefixes([j.ids for j in jobs], opts.chunk).tokens_saved if opts.prefix_sharing and jobs else 0
    # A step never holds more than the batch has: every prompt token plus one decode token per request.
    step_tokens = min(opts.max_batch_tokens, sum(len(j.ids) for j in jobs) + len(jobs))
    return plan_memory(
        md.config,
        dtype=dtype,
        quantize=opts.quantize,
        kv_cache_tokens=opts.kv_cache_tokens,
        max_batch_tokens=step_tokens,
        max_seqs=min(opts.max_seqs, max(1, len(jobs))),
        batch_kv_tokens=max(1, sum(sizes) - saved),
        largest_request_tokens=largest,
    )


def _generate(
    opts: FloodOptions,
    md: ModelDir,
    codec: TextCodec,
    jobs: list[_Job],
    plan: MemoryPlan,
    dtype: torch.dtype,
    output: BatchOutput,
    summary: FloodSummary,
    on_progress: Callable[[EngineStats, FloodSummary], None] | None,
    should_stop: Callable[[], bool] | None,
) -> None:
    if not jobs:
        return
    previous_threads = torch.get_num_threads()
    try:
        _generate_with_threads(opts, md, codec, jobs, plan, dtype, output, summary, on_progress, should_stop)
    finally:
        torch.set_num_threads(previous_threads)  # a library call leaves the process as it found it


def _generate_with_threads(
    opts: FloodOptions,
    md: ModelDir,
    codec: TextCodec,
    jobs: list[_Job],
    plan: MemoryPlan,
    dtype: torch.dtype,
    output: BatchOutput,
    summary: FloodSummary,
    on_progress: Callable[[EngineStats, FloodSummary], None] | None,
    should_stop: Callable[[], bool] | None,
) -> None:
    # --threads N fixes the count; otherwise it is the cores other processes leave free (flood/threads.py).
    # With stages, the stage processes compute; this one only schedules and samples, on one thread.
    policy = ThreadPolicy.for_run(opts.threads if opts.stages == 1 else 1, opts.dtype, opts.quantize)
    policy.prepare()
    config = EngineConfig(
        kv_cache_tokens=plan.kv_tokens,
        max_batch_tokens=opts.max_batch_tokens,
        max_seqs=opts.max_seqs,
        chunk=opts.chunk,
        prefix_sharing=opts.prefix_sharing,
        stages=opts.stages,
    )
    stage_n = 0
    if opts.stages > 1:
        from lingctl.flood.engine.pipeline import PipelineRunner

        stage_n = opts.threads or stage_threads(opts.stages, opts.dtype, opts.quantize)
        runner: Any = PipelineRunner(
            md.path,
            stages=opts.stages,
            dtype=dtype,
            quantize=opts.quantize,
            kv_cache_tokens=plan.kv_tokens,
            threads_per_stage=stage_n,
        )
    else:
        model, load = md.load_with_stats(dtype=dtype, quantize=opts.quantize)
        summary.load_seconds, summary.load_bytes_read = load.seconds, load.bytes_read
        c = md.config
        runner = LocalRunner(
            model, KVPool(c.num_hidden_layers, plan.kv_tokens + 1, c.num_key_value_heads, c.head_dim, dtype)
        )
    engine = Engine(
        config,
        model_config=md.config,
        runner=runner,
        eos_ids=md.eos_ids(),
        stop_check=codec.stop_check if codec.tokenizer is not None else None,
    )
    by_key = {id(j): j for j in jobs}
    requests = [
        GenRequest(key=id(j), prompt_ids=j.ids, sampling=j.req.sampling, seed_key=j.req.custom_id) for j in jobs
    ]
    model_name = _model_name(opts.model, md.path)
    policy.start()
    summary.threads = dataclasses.asdict(policy.report) if policy.report is not None else {}
    if stage_n:
        summary.threads["threads_per_stage"] = stage_n

    def on_step(stats: EngineStats) -> None:
        policy.between_steps()  # between steps: results never see a count change mid-step
        _progress(stats, summary, on_progress, should_stop)

    started = time.monotonic()
    try:
        for res in engine.generate(requests, on_step=on_step):
            job = by_key[res.key]
            body: dict[str, Any] | None = None
            if res.error is None:
                try:
                    body = _body(job, res, codec, model_name)
                except Exception as exc:  # detokenizing this answer failed; the others are unaffected
                    log.debug("building the answer to %s failed", printable(job.req.custom_id), exc_info=True)
                    res.error, res.internal = f"failed while decoding the answer: {error_text(exc)}", True
            if body is None:
                _write_failure(output, job, res)
                summary.failed += 1
            else:
                output.write_result(job.req.custom_id, body)
                summary.succeeded += 1
                summary.prompt_tokens += res.prompt_tokens
                summary.cached_prompt_tokens += res.cached_tokens
            if should_stop is not None and should_stop():
                summary.interrupted = True
                break
    except (KeyboardInterrupt, _StopRequested):
        summary.interrupted = True
    finally:
        engine.close()
        _fill(summary, engine.stats, time.monotonic() - started)
        if policy.report is not None:
            summary.threads = {**summary.threads, **dataclasses.asdict(policy.report)}
    if summary.interrupted:
        output.close()
        raise Interrupted(
            f"interrupted after {summary.succeeded + summary.failed} answers; every answer written so far is kept",
            hint="continue with the same command plus --resume",
        )


def _model_name(spec: Path | str, path: Path) -> str:
    """The ``model`` field of answers to requests that name none: a Hub id as given (``org/name``, as vLLM
    serves it), not its snapshot's commit hash; a local directory by its name."""
    hub_id = None if Path(spec).exists() else parse_repo_id(str(spec))
    return hub_id.repo_id if hub_id is not None else path.name


def _write_failure(output: BatchOutput, job: _Job, res: GenResult) -> None:
    """A request the engine refused (code invalid_request, status 400) or that failed while running (code
    internal_error, status 500, as the Batch API reports a server-side failure of one request)."""
    message = res.error or "failed"
    if res.internal:
        log.warning("request %s failed: %s", printable(job.req.custom_id), message)
        output.write_error(
            custom_id=job.req.custom_id, line=job.req.line, code="internal_error", message=message, status_code=500
        )
    else:
        output.write_error(custom_id=job.req.custom_id, line=job.req.line, code="invalid_request", message=message)


class _StopRequested(Exception):
    """Raised from the step callback to leave the engine loop after a whole step."""


def _progress(
    stats: EngineStats,
    summary: FloodSummary,
    on_progress: Callable[[EngineStats, FloodSummary], None] | None,
    should_stop: Callable[[], bool] | None,
) -> None:
    if on_progress is not None:
        on_progress(stats, summary)
    # Checked after every step, not only when a request finishes: a long prefill must stop promptly too.
    if should_stop is not None and should_stop():
        raise _StopRequested


def _fill(summary: FloodSummary, stats: EngineStats, seconds: float) -> None:
    summary.generated_tokens = stats.generated_tokens
    summary.seconds = seconds
    summary.generated_tokens_per_s = stats.generated_tokens / seconds if seconds > 0 else 0.0
    summary.prefix_entries = stats.prefix_entries
    summary.prefix_tokens_saved = stats.prefix_tokens_saved
    summary.steps = stats.scheduler.steps
    summary.preemptions = stats.scheduler.preemptions
    summary.kv_peak_tokens = stats.scheduler.peak_used_slots
    summary.engine = dataclasses.asdict(stats.scheduler)


__all__ = ["FloodOptions", "FloodSummary", "run_batch", "LingctlError"]
