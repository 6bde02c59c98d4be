"""One model served by the engine for a command (``flood run``, ``flood eval``): the memory plan of its
requests, the runner (this process, or pipeline stages), the engine and the thread policy around them."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from lingctl.flood.engine.loop import (
    Engine,
    EngineConfig,
    EngineStats,
    GenRequest,
    GenResult,
    StageRunner,
    StopCheck,
    local_runner,
    max_new_tokens,
)
from lingctl.flood.engine.options import EngineOptions
from lingctl.flood.engine.plan import MemoryPlan, plan_memory
from lingctl.flood.engine.prefix import plan_prefixes
from lingctl.flood.engine.threads import ThreadPolicy, stage_threads
from lingctl.flood.weights.model_dir import ModelDir
from lingctl.model.ling import LingForCausalLM


@dataclass(kw_only=True, slots=True)
class Progress:
    """What a command shows while the engine works: ``done`` of ``total`` units, and the engine's counters."""

    label: str  # what is worked on: "" for a batch, the model or checkpoint of an evaluation
    unit: str  # what is counted: "requests", "items"
    done: int
    total: int
    stats: EngineStats


class StopRequested(Exception):
    """``should_stop`` said so: raised after a whole step, or after the caller took a result."""


def plan_requests(
    model_config: Any, requests: list[GenRequest], opts: EngineOptions, dtype: torch.dtype, *, converted: bool = False
) -> MemoryPlan:
    """The memory plan for running ``requests`` (see ``plan_memory``), from the config alone (``converted``: the
    checkpoint is ``flood quantize``'s, loaded without conversion temporaries)."""
    limit = model_config.max_position_embeddings
    prompts = [r.prompt_ids for r in requests]
    prompt_tokens = sum(len(p) for p in prompts)
    new_tokens = sum(max_new_tokens(r, limit) for r in requests)
    saved = plan_prefixes(prompts, opts.chunk).tokens_saved if opts.prefix_sharing and requests else 0
    # The largest request the engine admits (a prompt with no room left for output is refused, not cached).
    largest = max(
        (len(r.prompt_ids) + 1 for r in requests if r.forced_ids is not None or len(r.prompt_ids) < limit), default=1
    )
    return plan_memory(
        model_config,
        dtype=dtype,
        quantize=opts.quantize,
        converted=converted,
        kv_cache_tokens=opts.kv_cache_tokens,
        # A step never holds more than the work has: every prompt token plus one decode token per request.
        max_batch_tokens=min(opts.max_batch_tokens, prompt_tokens + len(requests)),
        max_seqs=min(opts.max_seqs, max(1, len(requests))),
        batch_kv_tokens=max(1, prompt_tokens + new_tokens - saved),
        largest_request_tokens=largest,
    )


class EngineSession:
    """Loads the model of ``md`` and runs requests through the engine under the thread policy of ``opts``
    (``ThreadPolicy``), leaving torch's thread count as it found it. Once ``results`` has ended, ``stats``,
    ``seconds``, ``load_seconds``, ``load_bytes_read`` and ``threads`` say what it took."""

    def __init__(
        self,
        md: ModelDir,
        opts: EngineOptions,
        plan: MemoryPlan,
        *,
        dtype: torch.dtype,
        stages: int = 1,
        stop_check: StopCheck | None = None,
    ) -> None:
        self.md, self.opts, self.plan, self.dtype = md, opts, plan, dtype
        self.stages = stages
        self.stop_check = stop_check
        self.stats = EngineStats()
        self.seconds = 0.0  # from the first step on: the load is not included
        self.load_seconds = 0.0
        self.load_bytes_read = 0
        self.threads: dict[str, Any] = {}  # compute threads: count, how chosen, changes
        # Loaded on the first ``results`` and kept: a cluster engine answers many blocks with one load. Each
        # call gets a fresh KV pool sized by ``plan`` as it is then.
        self._model: LingForCausalLM | None = None
        self.max_threads: int | None = None  # a cap on chosen threads (a cluster engine's cores)

    def results(
        self,
        requests: list[GenRequest],
        *,
        on_step: Callable[[EngineStats], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> Iterator[GenResult]:
        """Each request's result the moment it is final. ``StopRequested`` once ``should_stop`` says so."""
        previous_threads = torch.get_num_threads()
        # --threads N fixes the count; otherwise it is the cores other processes leave free (threads.py).
        # With stages, the stage processes compute; this one only schedules and samples, on one thread.
        opts = self.opts
        policy = ThreadPolicy.for_run(
            opts.threads if self.stages == 1 else 1, opts.dtype, opts.quantize, max_threads=self.max_threads
        )
        policy.prepare()
        try:
            yield from self._run(policy, requests, on_step, should_stop)
        finally:
            torch.set_num_threads(previous_threads)  # a library call leaves the process as it found it
            if policy.report is not None:
                self.threads = {**self.threads, **dataclasses.asdict(policy.report)}

    def _run(
        self,
        policy: ThreadPolicy,
        requests: list[GenRequest],
        on_step: Callable[[EngineStats], None] | None,
        should_stop: Callable[[], bool] | None,
    ) -> Iterator[GenResult]:
        engine = Engine(
            EngineConfig(
                kv_cache_tokens=self.plan.kv_tokens,
                max_batch_tokens=self.opts.max_batch_tokens,
                max_seqs=self.opts.max_seqs,
                chunk=self.opts.chunk,
                prefix_sharing=self.opts.prefix_sharing,
                stages=self.stages,
            ),
            model_config=self.md.config,
            runner=self._runner(),
            eos_ids=self.md.eos_ids(),
            stop_check=self.stop_check,
        )
        policy.start()
        if policy.report is not None:
            self.threads = {**dataclasses.asdict(policy.report), **self.threads}
        started = time.monotonic()

        def step(stats: EngineStats) -> None:
            policy.between_steps()  # between steps: results never see a count change mid-step
            if on_step is not None:
                on_step(stats)
            # Checked after every step, not only when a request finishes: a long prefill must stop promptly too.
            _check(should_stop)

        try:
            for result in engine.generate(requests, on_step=step):
                yield result
                _check(should_stop)
        finally:
            engine.close()
            self.stats = engine.stats
            self.seconds = time.monotonic() - started

    def _runner(self) -> StageRunner:
        """All layers in this process, or pipeline stages (each loads its own slice of the layers)."""
        opts = self.opts
        if self.stages > 1:
            from lingctl.flood.engine.pipeline import PipelineRunner

            per_stage = opts.threads or stage_threads(self.stages, opts.dtype, opts.quantize)
            self.threads["threads_per_stage"] = per_stage
            return PipelineRunner(
                self.md.path,
                stages=self.stages,
                dtype=self.dtype,
                quantize=opts.quantize,
                kv_cache_tokens=self.plan.kv_tokens,
                threads_per_stage=per_stage,
            )
        return local_runner(self.load(), self.plan.kv_tokens, self.dtype)

    def load(self) -> LingForCausalLM:
        """The model, loaded on the first call (a cluster engine loads it before its first block, so that the
        load is not counted as answering)."""
        if self._model is None:
            self._model, load = self.md.load_with_stats(dtype=self.dtype, quantize=self.opts.quantize)
            self.load_seconds, self.load_bytes_read = load.seconds, load.bytes_read
        return self._model


def _check(should_stop: Callable[[], bool] | None) -> None:
    if should_stop is not None and should_stop():
        raise StopRequested
