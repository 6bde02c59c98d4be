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
import functools
import hashlib
import logging
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lingctl.core.errors import Interrupted, LingctlError, UsageError, os_error
from lingctl.core.names import printable
from lingctl.flood.batch.answers import answer_body, model_name, request_digest, write_failure
from lingctl.flood.batch.in_order import InOrder
from lingctl.flood.batch.output import BatchOutput, ResumeState, default_paths, preview_resume
from lingctl.flood.batch.requests import Request, RequestError, read_batch
from lingctl.flood.cluster.options import ClusterOptions
from lingctl.flood.engine.loop import EngineStats, GenRequest, GenResult, error_text, max_new_tokens
from lingctl.flood.engine.manifest import output_manifest
from lingctl.flood.engine.options import EngineOptions
from lingctl.flood.engine.plan import MemoryPlan, check_weights_fit
from lingctl.flood.engine.prefix import plan_prefixes
from lingctl.flood.engine.session import EngineSession, Progress, StopRequested, plan_requests
from lingctl.flood.text.tokens import PromptError, TextCodec
from lingctl.flood.weights.model_dir import ModelDir
from lingctl.flood.weights.remote_model import flood_model_dir
from lingctl.model.chat_template import TemplateLimits
from lingctl.model.checkpoint import parse_dtype

if TYPE_CHECKING:
    from lingctl.flood.cluster.engines import ClusterSession

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class FloodOptions:
    batch: Path
    model: Path | str  # checkpoint directory, Hugging Face model id ORG/NAME[@REVISION] (from the cache), or s3://
    out: Path | None = None
    errors: Path | None = None
    resume: bool = False
    stages: int = 1
    engine: EngineOptions = field(default_factory=EngineOptions)
    chat_template: Path | None = None
    dry_run: bool = False
    template_limits: TemplateLimits = field(default_factory=TemplateLimits)  # per chat request
    cluster: ClusterOptions | None = None  # --ray: engines on a Ray cluster instead of this process

    def validate(self) -> None:
        if self.stages < 1:
            raise UsageError(f"--stages must be >= 1, got {self.stages}")
        if self.cluster is not None:
            if self.stages > 1:
                raise UsageError("--stages and --ray do not combine: each cluster engine holds the whole model")
            self.cluster.validate()
        self.engine.validate()


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
    # Prompt tokens computed per second of the steps that had any, and tokens generated per second of the
    # steps that only decoded (a step that mixes the two counts as prompt processing).
    prompt_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
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
    cluster: dict[str, Any] | None = None  # --ray: per engine and per node (engines.ClusterSession.summary)


@dataclass(slots=True)
class _Job:
    req: Request
    ids: list[list[int]]  # each prompt's token ids (one, or a completion's list of prompts)


def _manifest(opts: FloodOptions, md: ModelDir, template: str | None) -> dict[str, Any]:
    own = {
        "batch": opts.batch.name,
        # The template in effect (--chat-template or the model's): it decides every chat prompt.
        "chat_template_sha256": None if template is None else hashlib.sha256(template.encode()).hexdigest(),
    }
    return output_manifest(
        model=str(md.path), fingerprint=md.fingerprint(), engine=opts.engine, own=own, compared=["chat_template_sha256"]
    )


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


def _open_model(opts: FloodOptions) -> tuple[ModelDir, TextCodec, str | None]:
    """The model directory, checked to fit before a weight byte is read, its text codec and chat template."""
    model_dir = flood_model_dir(opts.model, option="--model")
    md = ModelDir.open(model_dir)  # stages, fingerprint and loading all use this directory, never the id
    # A converted checkpoint decides --quantize (the manifest, the plan and the threads then see it).
    opts.engine = dataclasses.replace(
        opts.engine, quantize=md.serving_quantize(opts.engine.quantize, opts.engine.dtype)
    )
    check_weights_fit(
        md.config,
        dtype=parse_dtype(opts.engine.dtype),
        quantize=opts.engine.quantize,
        converted=md.converted is not None,
    )
    if not opts.dry_run:
        md.check_weights()
    template = _read_template(opts.chat_template) if opts.chat_template is not None else md.chat_template()
    codec = TextCodec.for_model(
        md.path, chat_template=template, special_tokens=md.special_tokens(), limits=opts.template_limits
    )
    codec.check_template()
    return md, codec, template


def run_batch(
    opts: FloodOptions,
    *,
    on_progress: Callable[[Progress], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_plan: Callable[[MemoryPlan], None] | None = None,
) -> FloodSummary:
    """Answer the batch (see the module docstring). ``on_plan`` hears the memory plan of a real run before its
    weights load, so a log says what the run will hold before it holds it."""
    opts.validate()
    batch = read_batch(opts.batch)
    md, codec, template = _open_model(opts)
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
        output = BatchOutput(out, errors, _manifest(opts, md, template), resume=opts.resume)
        state = output.state
    elif opts.resume:  # a dry run changes no file, but plans only what the resume would still answer
        state = preview_resume(out, errors, _manifest(opts, md, template))
    try:
        if output is not None:
            _write_invalid_lines(output, batch.errors, state.error_lines)
        todo = [req for req in batch.requests if req.custom_id not in state.done]
        summary.already_done = len(batch.requests) - len(todo)
        try:
            jobs = _prompts(codec, todo, output, summary, should_stop)
        finally:
            codec.close()  # the template worker is not needed past here
        requests = [answer for i, job in enumerate(jobs) for answer in _answers(i, job)]
        plan = _plan(opts, md, requests, summary)
        if output is None:
            return summary
        if on_plan is not None:
            on_plan(plan)
        try:
            _generate(opts, md, codec, jobs, requests, plan, output, summary, on_progress, should_stop)
        finally:
            summary.peak_rss_bytes = peak_rss_bytes()
        return summary
    finally:
        if output is not None:
            output.close()


def _write_invalid_lines(output: BatchOutput, invalid: list[RequestError], reported: set[int]) -> None:
    """An error line for each batch-file line that is not a request, unless an earlier run reported it."""
    for err in invalid:
        if err.line not in reported:
            output.write_error(
                custom_id=err.custom_id,
                line=err.line,
                code=err.code,
                message=err.message,
                status_code=None if err.custom_id is None else 400,
            )


def _answers(index: int, job: _Job) -> list[GenRequest]:
    """The engine requests of one batch request: one per answer it asks for (``n``), keyed (index, answer).
    Answer j > 0 draws from seed + j when the request has a seed (as vLLM seeds the n samples of a request),
    else from a generator of its custom_id and j; greedy answers are all the same. The shared prompt is
    computed once (prefix sharing)."""
    req = job.req
    out = []
    for p, ids in enumerate(job.ids):  # a list of prompts: n answers for each, prompt by prompt
        for j in range(req.n):
            sampling = req.sampling
            if j and sampling.seed is not None:
                sampling = dataclasses.replace(sampling, seed=(sampling.seed + j) % (1 << 64))
            at = p * req.n + j
            seed_key = req.custom_id if at == 0 else f"{req.custom_id}\x00{at}"
            out.append(GenRequest(key=(index, at), prompt_ids=ids, sampling=sampling, seed_key=seed_key))
    return out


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
            others = [dataclasses.replace(req, prompt_text=t, prompt_ids=i) for t, i in req.more_prompts]
            jobs.append(_Job(req, [codec.prompt_ids(r) for r in (req, *others)]))
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
            output.write_error(
                custom_id=req.custom_id,
                line=req.line,
                code="invalid_prompt",
                message=message,
                digest=request_digest(req),
            )
    return jobs


def peak_rss_bytes() -> int:
    """This process's peak resident memory (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _plan(opts: FloodOptions, md: ModelDir, requests: list[GenRequest], summary: FloodSummary) -> MemoryPlan:
    """The memory plan (refused here when the batch cannot fit), and what a dry run reports of the batch."""
    plan = plan_requests(
        md.config, requests, opts.engine, parse_dtype(opts.engine.dtype), converted=md.converted is not None
    )
    summary.plan = plan
    summary.plan_total_bytes = plan.total_bytes
    summary.kv_cache_tokens = plan.kv_tokens
    limit = md.config.max_position_embeddings
    summary.estimated_generated_tokens = sum(max_new_tokens(r, limit) for r in requests)
    if opts.dry_run:
        prompts = [r.prompt_ids for r in requests]
        shared = plan_prefixes(prompts, opts.engine.chunk) if opts.engine.prefix_sharing else None
        summary.prefix_entries = len(shared.entries) if shared else 0
        summary.prefix_tokens_saved = shared.tokens_saved if shared else 0
        summary.prompt_tokens = sum(len(p) for p in prompts)
    return plan


def _generate(
    opts: FloodOptions,
    md: ModelDir,
    codec: TextCodec,
    jobs: list[_Job],
    requests: list[GenRequest],
    plan: MemoryPlan,
    output: BatchOutput,
    summary: FloodSummary,
    on_progress: Callable[[Progress], None] | None,
    should_stop: Callable[[], bool] | None,
) -> None:
    """Run the jobs (``requests[i]`` is ``jobs[i]``) and write each answer the moment it is final."""
    if not jobs:
        return
    stop_check = codec.stop_check if codec.tokenizer is not None else None
    session: EngineSession | ClusterSession
    if opts.cluster is not None:
        from lingctl.flood.cluster.engines import ClusterSession  # Ray is imported there, and only with --ray

        session = ClusterSession(opts.cluster, model=str(opts.model), engine=opts.engine)
    else:
        session = EngineSession(
            md, opts.engine, plan, dtype=parse_dtype(opts.engine.dtype), stages=opts.stages, stop_check=stop_check
        )
    name = model_name(opts.model, md.path)

    def on_step(stats: EngineStats) -> None:
        if on_progress is not None:
            label = "" if isinstance(session, EngineSession) else session.progress_label
            on_progress(Progress(label=label, unit="requests", done=stats.finished, total=stats.requests, stats=stats))

    # A request's answer is written once all its n answers are in (one line, n choices).
    # Lines go out in the batch's order (in_order.py), so the file is the same however the work was split.
    pending: dict[int, list[GenResult | None]] = {}
    in_order = InOrder()
    try:
        for res in session.results(requests, on_step=on_step, should_stop=should_stop):
            index, j = res.key
            req = jobs[index].req
            got = pending.setdefault(index, [None] * (req.n * len(jobs[index].ids)))
            got[j] = res
            if all(r is not None for r in got):
                del pending[index]
                done = [r for r in got if r is not None]
                in_order.put(index, functools.partial(_write_answer, output, req, done, codec, name, summary))
    except (KeyboardInterrupt, StopRequested):
        summary.interrupted = True
    finally:
        _fill(summary, session)
    if summary.interrupted:
        output.close()
        raise Interrupted(
            f"interrupted after {summary.succeeded + summary.failed} answers; every answer written so far is kept",
            hint="continue with the same command plus --resume",
        )


def _write_answer(
    output: BatchOutput, req: Request, results: list[GenResult], codec: TextCodec, model: str, summary: FloodSummary
) -> None:
    """The request's line: its answers as the choices of one body, or its error when any answer failed."""
    body: dict[str, Any] | None = None
    digest = request_digest(req)
    failed = next((r for r in results if r.error is not None), None)
    if failed is None:
        try:
            texts = [r.stop_text if r.stop_text is not None else codec.decode(r.token_ids) for r in results]
            body = answer_body(req, results, texts, model, codec.token_text, answer_id=output.answer_id(digest))
        except Exception as exc:  # detokenizing this answer failed; the others are unaffected
            log.debug("building the answer to %s failed", printable(req.custom_id), exc_info=True)
            failed = results[0]
            failed.error, failed.internal = f"failed while decoding the answer: {error_text(exc)}", True
    if body is None:
        assert failed is not None
        write_failure(output, req, failed)
        summary.failed += 1
        return
    output.write_result(req.custom_id, body, digest=digest)
    summary.succeeded += 1
    firsts = results[:: req.n]  # each prompt's first answer
    summary.prompt_tokens += sum(r.prompt_tokens for r in firsts)
    summary.cached_prompt_tokens += sum(r.cached_tokens for r in firsts)


def _fill(summary: FloodSummary, session: EngineSession | ClusterSession) -> None:
    if not isinstance(session, EngineSession):
        summary.cluster = session.summary()
    stats, seconds = session.stats, session.seconds
    summary.load_seconds, summary.load_bytes_read = session.load_seconds, session.load_bytes_read
    summary.threads = session.threads
    summary.generated_tokens = stats.generated_tokens
    summary.seconds = seconds
    summary.generated_tokens_per_s = stats.generated_tokens / seconds if seconds > 0 else 0.0
    sched = stats.scheduler
    summary.prompt_tokens_per_s = sched.prefill_tokens / stats.prefill_seconds if stats.prefill_seconds > 0 else 0.0
    decode = stats.decode_seconds
    summary.decode_tokens_per_s = stats.decode_step_tokens / decode if decode > 0 else 0.0
    summary.prefix_entries = stats.prefix_entries
    summary.prefix_tokens_saved = stats.prefix_tokens_saved
    summary.steps = stats.scheduler.steps
    summary.preemptions = stats.scheduler.preemptions
    summary.kv_peak_tokens = stats.scheduler.peak_used_slots
    summary.engine = dataclasses.asdict(stats.scheduler)


__all__ = ["FloodOptions", "FloodSummary", "run_batch", "LingctlError"]
