"""The engine loop: schedule a step, run it on the stages, sample, retire finished requests, repeat.

``Engine.generate`` takes token-id requests and yields each result the moment its request finishes, so the
caller can write it out at once. With one stage the step runs in this process; with several, micro-batches
flow through stage processes (pipeline.py) and up to ``stages`` of them are in flight at a time.

A failure that belongs to one request (sampling it, checking its stop strings) ends that request with an
error result and the others go on; a failed forward pass ends the whole run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from lingctl.flood.engine.forward import StageModel, StepBatch
from lingctl.flood.engine.prefix import PrefixPlan, plan_prefixes
from lingctl.flood.engine.sampling import SamplingParams, request_generator, sample
from lingctl.flood.engine.scheduler import Scheduler, SchedulerStats, Sequence, Step
from lingctl.flood.engine.segment_cache import KVPool, SegmentAllocator
from lingctl.model.ling import LingForCausalLM

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    kv_cache_tokens: int  # slots in the KV pool of every layer
    max_batch_tokens: int = 1024  # tokens per step: decode tokens, prompt chunks, replays
    max_seqs: int = 256  # requests running at once
    chunk: int = 16  # prompt chunk and prefix block, in tokens (fixed: part of what makes outputs batch-free)
    prefix_sharing: bool = True
    output_reserve: int = 256  # output slots reserved up front; more are added in place or appended
    growth: int = 64  # slots added at a time when a request outgrows its reservation
    stages: int = 1

    def validate(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")
        if self.max_batch_tokens < self.chunk:
            raise ValueError(
                f"max_batch_tokens ({self.max_batch_tokens}) must be at least the prompt chunk ({self.chunk})"
            )
        if self.kv_cache_tokens < 1 or self.max_seqs < 1 or self.stages < 1:
            raise ValueError("kv_cache_tokens, max_seqs and stages must be >= 1")


@dataclass(kw_only=True, slots=True)
class GenRequest:
    key: Any
    prompt_ids: list[int]
    sampling: SamplingParams
    seed_key: str = ""  # what an unseeded request's generator is derived from (its custom_id)
    # Scoring instead of generating: these tokens are appended one by one whatever the logits say, and the
    # log-probability of each is recorded (an evaluation's answer options, as lm-evaluation-harness scores them).
    forced_ids: list[int] | None = None


@dataclass(kw_only=True, slots=True)
class GenResult:
    key: Any
    token_ids: list[int]
    finish_reason: str  # "stop", "length" or "error"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens read from a shared prefix instead of computed
    error: str | None = None
    internal: bool = False  # the error is a failure while running the request, not a problem with the request
    stop_text: str | None = None  # text up to (excluding) the stop string that ended it
    logprobs: list[float] | None = None  # forced requests: natural-log probability of each forced token
    greedy: bool | None = None  # forced requests: every forced token was the argmax of its logits
    # Requests with sampling.logprobs: per generated token, its log-probability and the top ones (id, logprob),
    # from the model's own distribution (the raw logits, as vLLM's default logprobs mode)
    token_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass(slots=True)
class _Forced:
    """A forced request's per-sequence state (in place of a sampling generator)."""

    ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    greedy: bool = True


@dataclass(kw_only=True, slots=True)
class EngineStats:
    requests: int = 0
    finished: int = 0
    generated_tokens: int = 0
    prefix_entries: int = 0
    prefix_hits: int = 0
    prefix_tokens_saved: int = 0
    kv_slots: int = 0
    kv_used_slots: int = 0
    running: int = 0
    waiting: int = 0
    seconds: float = 0.0
    # Time of the steps that computed prompt tokens, and of those that only decoded (one token per running
    # request): prompt processing and generation speed, as vLLM's logs and llama.cpp's benchmarks split them.
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_step_tokens: int = 0  # tokens sampled in those decode-only steps
    scheduler: SchedulerStats = field(default_factory=SchedulerStats)


class StageRunner(Protocol):
    depth: int  # steps that may be in flight at once

    def submit(self, batch: StepBatch) -> None: ...

    def result(self) -> torch.Tensor: ...  # logits of the oldest submitted step

    def close(self) -> None: ...


class LocalRunner:
    """All layers in this process; a step runs when its result is asked for."""

    depth = 1

    def __init__(self, model: LingForCausalLM, pool: KVPool) -> None:
        self.stage = StageModel(model, pool, 0, model.config.num_hidden_layers)
        self._pending: list[StepBatch] = []

    def submit(self, batch: StepBatch) -> None:
        self._pending.append(batch)

    def result(self) -> torch.Tensor:
        return self.stage.run(self._pending.pop(0))

    def close(self) -> None:
        pass


def local_runner(model: LingForCausalLM, kv_cache_tokens: int, dtype: torch.dtype) -> LocalRunner:
    """All layers of ``model`` in this process, over a KV pool of ``kv_cache_tokens`` slots plus one scratch
    slot (where padding rows write)."""
    c = model.config
    pool = KVPool(c.num_hidden_layers, kv_cache_tokens + 1, c.num_key_value_heads, c.head_dim, dtype)
    return LocalRunner(model, pool)


def max_new_tokens(req: GenRequest, max_positions: int) -> int:
    """The most tokens ``req`` can add: its forced tokens, or ``max_tokens`` within the context left."""
    if req.forced_ids is not None:
        return len(req.forced_ids)
    room = max(0, max_positions - len(req.prompt_ids))
    want = req.sampling.max_tokens
    return room if want is None else min(want, room)


# Text-side hooks: stop strings need the tokenizer, which the engine itself does not know about.
StopCheck = Callable[[list[int], list[str]], str | None]


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        model_config: Any,
        runner: StageRunner,
        eos_ids: Iterable[int] = (),
        stop_check: StopCheck | None = None,
    ) -> None:
        config.validate()
        self.config = config
        self.model_config = model_config
        self.runner = runner
        self.eos_ids = set(eos_ids)
        self.stop_check = stop_check
        # Requests that asked for log-probabilities: theirs so far, by id of the request (until it finishes)
        self._logprobs: dict[int, list[tuple[float, list[tuple[int, float]]]]] = {}
        self.max_positions = model_config.max_position_embeddings
        self.stats = EngineStats(kv_slots=config.kv_cache_tokens)
        self.alloc = SegmentAllocator(config.kv_cache_tokens)

    @staticmethod
    def local(
        model: LingForCausalLM, config: EngineConfig, *, dtype: torch.dtype | None = None, **kwargs: Any
    ) -> Engine:
        """A one-process engine around a loaded model."""
        runner = local_runner(model, config.kv_cache_tokens, dtype or model.model.word_embeddings.weight.dtype)
        return Engine(config, model_config=model.config, runner=runner, **kwargs)

    # -- admission checks ------------------------------------------------------------------------
    def _reject(self, req: GenRequest) -> str | None:
        n = len(req.prompt_ids)
        if n == 0:
            return "prompt is empty"
        if n >= self.max_positions and req.forced_ids is None:
            return (
                f"prompt has {n} tokens; the model's context is {self.max_positions} "
                "(max_position_embeddings), leaving no room for output"
            )
        if any(t < 0 or t >= self.model_config.vocab_size for t in req.prompt_ids):
            return f"prompt has token ids outside the vocabulary [0, {self.model_config.vocab_size})"
        if req.forced_ids is not None:
            if not req.forced_ids:
                return "nothing to score (no forced tokens)"
            # The last forced token is scored but never fed back, so it needs no position of its own.
            if n + len(req.forced_ids) - 1 > self.max_positions:
                return (
                    f"prompt ({n} tokens) and scored tokens ({len(req.forced_ids)}) exceed the model's context "
                    f"of {self.max_positions}"
                )
            if any(t < 0 or t >= self.model_config.vocab_size for t in req.forced_ids):
                return f"scored token ids outside the vocabulary [0, {self.model_config.vocab_size})"
        need = n + 1
        if need > self.config.kv_cache_tokens:
            return f"prompt needs {need} KV cache slots; the cache holds {self.config.kv_cache_tokens}"
        return None

    def _admit(self, req: GenRequest) -> torch.Generator | _Forced | GenResult:
        """The request's per-sequence state (its sampling generator, or its forced tokens), or, when it cannot
        run, its error result."""
        reason = self._reject(req)
        if reason is not None:
            return self._failure(req, reason)
        try:
            if req.forced_ids is not None:
                return _Forced(list(req.forced_ids))
            return request_generator(req.sampling.seed, req.seed_key or str(req.key))
        except Exception as exc:
            return self._failure(req, error_text(exc), internal=True)

    def _failure(
        self,
        req: GenRequest,
        error: str,
        *,
        internal: bool = False,
        generated: list[int] | None = None,
        cached: int = 0,
    ) -> GenResult:
        """The error result that ends ``req`` (which counts as finished)."""
        self.stats.finished += 1
        self._logprobs.pop(id(req), None)
        return GenResult(
            key=req.key,
            token_ids=generated or [],
            finish_reason="error",
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=cached,
            error=error,
            internal=internal,
        )

    # -- the loop -----------------------------------------------------------------------------------
    def generate(
        self, requests: Iterable[GenRequest], on_step: Callable[[EngineStats], None] | None = None
    ) -> Iterator[GenResult]:
        """Run every request; yield each result as soon as it is final (completion order)."""
        started = time.monotonic()
        accepted: list[tuple[GenRequest, torch.Generator | _Forced]] = []
        for req in requests:
            self.stats.requests += 1
            state = self._admit(req)
            if isinstance(state, GenResult):
                yield state
            else:
                accepted.append((req, state))
        sched = self._scheduler(accepted)
        try:
            yield from self._steps(sched, started, on_step)
        finally:
            self._update_stats(sched, started)

    def _scheduler(self, accepted: list[tuple[GenRequest, torch.Generator | _Forced]]) -> Scheduler:
        """A scheduler holding every accepted request, with the prompt prefixes they share."""
        prompts = [req.prompt_ids for req, _ in accepted]
        plan = (
            plan_prefixes(prompts, self.config.chunk)
            if self.config.prefix_sharing
            else PrefixPlan(of_request=[None] * len(accepted))
        )
        self.stats.prefix_entries = len(plan.entries)
        self.stats.prefix_tokens_saved = plan.tokens_saved
        sched = Scheduler(
            self.alloc,
            scratch_slot=self.config.kv_cache_tokens,
            chunk=self.config.chunk,
            max_batch_tokens=self.config.max_batch_tokens,
            max_seqs=self.config.max_seqs,
            output_reserve=self.config.output_reserve,
            growth=self.config.growth,
            prefixes=plan,
        )
        self.stats.scheduler = sched.stats
        for i, (req, state) in enumerate(accepted):
            seq = Sequence(
                index=i,
                key=req,
                tokens=list(req.prompt_ids),
                prompt_len=len(req.prompt_ids),
                sampling=req.sampling,
                max_new=max_new_tokens(req, self.max_positions),
                prefix=plan.of_request[i],
            )
            seq.state = state
            if seq.prefix is not None:
                self.stats.prefix_hits += 1
            sched.add(seq)
        return sched

    def _steps(
        self, sched: Scheduler, started: float, on_step: Callable[[EngineStats], None] | None
    ) -> Iterator[GenResult]:
        """Keep up to ``runner.depth`` steps in flight; finish the oldest, yield what it finished, repeat."""
        done: list[GenResult] = []
        in_flight: list[tuple[Step, bool]] = []  # with whether it computes prompt tokens
        last = time.monotonic()
        while sched.has_work or in_flight:
            while len(in_flight) < self.runner.depth:
                prompt_before = sched.stats.prefill_tokens
                step = sched.schedule()
                if step is None:
                    break
                self.runner.submit(step.batch)
                in_flight.append((step, sched.stats.prefill_tokens > prompt_before))
            if not in_flight:
                if not sched.preempt():
                    yield from self._fail_unschedulable(sched)
                continue
            step, prefill = in_flight.pop(0)
            self._complete(sched, step, done)
            now = time.monotonic()
            if prefill:
                self.stats.prefill_seconds += now - last
            else:
                self.stats.decode_seconds += now - last
                self.stats.decode_step_tokens += len(step.sampled)
            last = now
            yield from done
            done.clear()
            self._update_stats(sched, started)
            if on_step is not None:
                on_step(self.stats)

    def _complete(self, sched: Scheduler, step: Step, done: list[GenResult]) -> None:
        """Sample every row of ``step`` from its logits (the oldest step in flight)."""
        logits = self.runner.result()
        # Greedy rows' tokens in one call instead of one per row: argmax takes the first maximum
        # either way, so the tokens are the same.
        firsts = logits.argmax(dim=-1).tolist() if logits.shape[0] else []

        def on_row(seq: Sequence, row: int) -> None:
            forced = isinstance(seq.state, _Forced)
            # the argmax of the raw logits is the answer unless a penalty or min_tokens changes the logits
            greedy = forced or (seq.sampling.greedy and not seq.sampling.penalised and not self._blocked(seq))
            self._on_sample(sched, seq, logits[row], done, greedy_token=firsts[row] if greedy else None)

        sched.complete(step, on_row)

    def _on_sample(
        self,
        sched: Scheduler,
        seq: Sequence,
        logits_V: torch.Tensor,
        done: list[GenResult],
        *,
        greedy_token: int | None = None,
    ) -> None:
        reason: str | None = None
        stop_text: str | None = None
        forced = seq.state if isinstance(seq.state, _Forced) else None
        try:
            if forced is not None:
                self._score(seq, forced, logits_V, greedy_token)
                if seq.generated >= len(forced.ids):
                    self._finish(sched, seq, done, "length")
                return
            if greedy_token is not None:
                token = greedy_token
            else:
                prompt, output = seq.tokens[: seq.prompt_len], seq.tokens[seq.prompt_len :]
                token = sample(
                    logits_V, seq.sampling, seq.state, prompt=prompt, output=output, blocked=self._blocked(seq)
                )
            seq.tokens.append(token)
            self.stats.generated_tokens += 1
            if seq.sampling.logprobs is not None:
                self._record_logprobs(seq, logits_V, token)
            early = seq.generated < seq.sampling.min_tokens  # (counting this token)
            if token in self.eos_ids and not seq.sampling.ignore_eos:
                reason = "stop"
            elif seq.sampling.stop and self.stop_check is not None and not early:
                stop_text = self.stop_check(seq.tokens[seq.prompt_len :], seq.sampling.stop)
                if stop_text is not None:
                    reason = "stop"
        except Exception as exc:
            # This request's own values or text broke (e.g. a NaN row, a decoder error): it ends here, the
            # step's other rows are independent of it.
            log.debug("a request failed while sampling", exc_info=True)
            sched.release(seq)
            error = f"failed while sampling: {error_text(exc)}"
            generated = seq.tokens[seq.prompt_len :]
            done.append(self._failure(seq.key, error, internal=True, generated=generated, cached=seq.shared_len))
            return
        if reason is None and (seq.generated >= seq.max_new or len(seq.tokens) >= self.max_positions):
            reason = "length"
        if reason is None:
            return
        self._finish(sched, seq, done, reason, stop_text=stop_text)

    def _record_logprobs(self, seq: Sequence, logits_V: torch.Tensor, token: int) -> None:
        """The chosen token's log-probability and the ``sampling.logprobs`` most likely tokens' (highest first,
        ties by id), kept until the request finishes."""
        lp = torch.log_softmax(logits_V.float(), dim=-1)
        k = min(int(seq.sampling.logprobs or 0), lp.shape[-1])
        top: list[tuple[int, float]] = []
        if k:
            values, ids = torch.topk(lp, k)
            top = [(int(i), float(v)) for v, i in zip(values.tolist(), ids.tolist(), strict=True)]
        self._logprobs.setdefault(id(seq.key), []).append((float(lp[token]), top))

    def _blocked(self, seq: Sequence) -> list[int]:
        """The end-of-sequence ids while a request has fewer new tokens than its min_tokens (none when it ignores
        them anyway), as vLLM's min-tokens processor."""
        if seq.generated >= seq.sampling.min_tokens or seq.sampling.ignore_eos:
            return []
        return sorted(self.eos_ids)

    def _score(self, seq: Sequence, forced: _Forced, logits_V: torch.Tensor, argmax: int | None) -> None:
        """Append the next forced token and record its log-probability under these logits."""
        token = forced.ids[seq.generated]
        # float64 for the normalisation: the sum over a large vocabulary loses least there.
        forced.logprobs.append(float(torch.log_softmax(logits_V.double(), dim=-1)[token]))
        forced.greedy = forced.greedy and argmax == token
        seq.tokens.append(token)
        self.stats.generated_tokens += 1

    def _finish(
        self, sched: Scheduler, seq: Sequence, done: list[GenResult], reason: str, *, stop_text: str | None = None
    ) -> None:
        sched.release(seq)
        self.stats.finished += 1
        req: GenRequest = seq.key
        forced = seq.state if isinstance(seq.state, _Forced) else None
        done.append(
            GenResult(
                key=req.key,
                token_ids=seq.tokens[seq.prompt_len :],
                finish_reason=reason,
                prompt_tokens=seq.prompt_len,
                cached_tokens=seq.shared_len,
                stop_text=stop_text,
                logprobs=None if forced is None else forced.logprobs,
                greedy=None if forced is None else forced.greedy,
                token_logprobs=self._logprobs.pop(id(req), None) if req.sampling.logprobs is not None else None,
            )
        )

    def _fail_unschedulable(self, sched: Scheduler) -> Iterator[GenResult]:
        """Nothing runs and nothing can be preempted: the head request cannot fit even in an empty cache
        (prefixes held for other requests included). Fail it rather than spin."""
        seq = sched.waiting.popleft()
        sched.release(seq)
        error = (
            f"request does not fit in the KV cache ({self.config.kv_cache_tokens} slots, {self.alloc.free_slots} free)"
        )
        yield self._failure(seq.key, error, generated=seq.tokens[seq.prompt_len :])

    def _update_stats(self, sched: Scheduler, started: float) -> None:
        self.stats.kv_used_slots = self.alloc.used_slots
        self.stats.running = sum(1 for s in sched.running if not s.is_prefix)
        self.stats.waiting = len(sched.waiting)
        self.stats.seconds = time.monotonic() - started

    def close(self) -> None:
        self.runner.close()


def error_text(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line, cut to ``limit`` characters: a request's error record."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
