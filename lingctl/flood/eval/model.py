"""Scoring one model on evaluation tasks with flood's engine.

A multiple-choice item becomes one engine request per choice: the prompt is the context's tokens and the
choice's tokens are *forced* (appended one by one, each one's log-probability recorded), so every choice of an
item starts from the same prompt and the engine's prefix sharing computes that context once. Tokenisation
follows lm-evaluation-harness (``_encode_pair``): whitespace that ends the context moves to the start of the
continuation, ``context + choice`` is encoded whole, the context alone, and the choice's tokens are the whole
encoding past the context's length. An empty context is scored after the EOS token, as lm-evaluation-harness
does.

A generation item is one greedy request with its stop strings.

Results do not depend on how requests are batched (flood's batch invariance, see forward.py): the numbers of
an evaluation are the same bits at any ``--max-batch-tokens``, with or without prefix sharing, in any order.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lingctl.core.errors import Interrupted, UsageError
from lingctl.flood.cluster.options import ClusterOptions
from lingctl.flood.engine.loop import EngineStats, GenRequest, GenResult, error_text
from lingctl.flood.engine.options import EngineOptions
from lingctl.flood.engine.plan import check_weights_fit
from lingctl.flood.engine.sampling import SamplingParams
from lingctl.flood.engine.session import EngineSession, StopRequested, plan_requests
from lingctl.flood.eval.report import TaskScore, mean_stderr
from lingctl.flood.eval.tasks import CHOICE, EvalItem, Task, extract_answer
from lingctl.flood.text.tokens import TextCodec
from lingctl.flood.weights.model_dir import ModelDir
from lingctl.model.checkpoint import parse_dtype

if TYPE_CHECKING:
    from lingctl.flood.cluster.engines import ClusterSession

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class ModelRun:
    """What evaluating one model took."""

    seconds: float = 0.0
    load_seconds: float = 0.0
    requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # read from a shared prefix instead of computed
    scored_tokens: int = 0  # forced choice tokens and generated tokens
    tokens_per_s: float = 0.0  # (prompt + scored tokens) / seconds
    truncated_items: int = 0  # contexts cut on the left to fit the model's context
    threads: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class _Pending:
    item: EvalItem
    left: int  # requests of this item not finished yet
    scores: list[float | None]
    tokens: list[int]
    greedy: list[bool]
    text: str = ""
    finish_reason: str = ""
    error: str | None = None
    truncated: bool = False


def open_model(spec: Path, engine: EngineOptions) -> tuple[ModelDir, TextCodec, EngineOptions]:
    """The model, its text codec, and ``engine`` with the --quantize it will run with (a converted checkpoint
    decides it: the manifest, the plan and the threads then see it)."""
    md = ModelDir.open(spec)
    engine = dataclasses.replace(engine, quantize=md.serving_quantize(engine.quantize, engine.dtype))
    converted = md.converted is not None
    check_weights_fit(md.config, dtype=parse_dtype(engine.dtype), quantize=engine.quantize, converted=converted)
    md.check_weights()
    codec = TextCodec.for_model(md.path, chat_template=None, special_tokens=md.special_tokens())
    if codec.tokenizer is None:
        raise UsageError(
            f"{md.path} has no tokenizer.json, and evaluation tasks are text",
            hint="evaluate a checkpoint that carries its tokenizer",
        )
    return md, codec, engine


class ModelEvaluation:
    """Evaluate one model: ``records()`` yields each item's record as it finishes; ``run`` says what it took."""

    def __init__(
        self,
        md: ModelDir,
        codec: TextCodec,
        tasks: list[Task],
        *,
        engine: EngineOptions,
        skip: set[tuple[str, str]] | None = None,
        cluster: ClusterOptions | None = None,
        spec: str | None = None,
    ) -> None:
        self.md, self.codec, self.tasks = md, codec, tasks
        self.opts = engine
        # --ray: the items go to engines on a Ray cluster, which open the model as ``spec`` names it (an s3://
        # model is copied on each node), else at md.path
        self.cluster, self.spec = cluster, spec
        self.run = ModelRun()
        self._requests: list[GenRequest] = []
        self._pending: dict[int, _Pending] = {}
        self._contexts: dict[str, list[int]] = {}
        self._prepare(skip or set())
        self._contexts.clear()

    # -- requests ---------------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        assert self.codec.tokenizer is not None
        return list(self.codec.tokenizer.encode(text, add_special_tokens=False).ids)

    def _prepare(self, skip: set[tuple[str, str]]) -> None:
        for task in self.tasks:
            for item in task.items:
                if (task.name, item.id) in skip:
                    continue
                key = len(self._pending)
                before = task.text_before(item, task.num_fewshot)
                pending = (
                    self._choice(key, item, before) if item.kind == CHOICE else self._generation(key, item, before)
                )
                self._pending[key] = pending
                self.run.truncated_items += pending.truncated

    def _choice(self, key: int, item: EvalItem, before: str) -> _Pending:
        """One request per choice, its tokens forced after the context, which every choice shares."""
        ctx_limit = self.md.config.max_position_embeddings
        pending = _Pending(item, len(item.choices), [None] * len(item.choices), [], [])
        for c, choice in enumerate(item.choices):
            ctx, cont = self._encode_pair(before + item.context, choice, self.md.config.eos_token_id)
            # lm-evaluation-harness keeps the last max_length tokens of context + continuation.
            keep = ctx_limit + 1 - len(cont)
            if 1 <= keep < len(ctx):
                ctx, pending.truncated = ctx[-keep:], True
            pending.tokens.append(len(cont))
            pending.greedy.append(False)
            sampling = SamplingParams(max_tokens=len(cont), temperature=0.0)
            self._requests.append(GenRequest(key=(key, c), prompt_ids=ctx, sampling=sampling, forced_ids=cont))
        return pending

    def _generation(self, key: int, item: EvalItem, before: str) -> _Pending:
        """One greedy request, its prompt cut on the left to leave room for ``max_tokens``."""
        pending = _Pending(item, 1, [], [], [])
        ids = self._encode(before + item.prompt)
        keep = self.md.config.max_position_embeddings - item.max_tokens
        if 1 <= keep < len(ids):
            ids, pending.truncated = ids[-keep:], True
        sampling = SamplingParams(max_tokens=item.max_tokens, temperature=0.0, stop=item.stop)
        self._requests.append(GenRequest(key=(key, 0), prompt_ids=ids, sampling=sampling))
        return pending

    def _encode_pair(self, context: str, continuation: str, eos: int) -> tuple[list[int], list[int]]:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return [eos], self._encode(continuation)
        whole = self._encode(context + continuation)
        ctx = self._contexts.get(context)
        if ctx is None:  # an item's choices share their context (few-shot block included): encode it once
            ctx = self._contexts[context] = self._encode(context)
        return ctx, whole[len(ctx) :]

    @property
    def items(self) -> int:
        return len(self._pending)

    # -- running ----------------------------------------------------------------------------------------
    def records(
        self,
        *,
        should_stop: Callable[[], bool] | None = None,
        on_step: Callable[[EngineStats], None] | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Load the model, run every request, and yield each item's record the moment its last request ends.
        Stops (``Interrupted``) after a step when ``should_stop`` says so; the records yielded are final."""
        if not self._requests:
            return
        dtype = parse_dtype(self.opts.dtype)
        plan = plan_requests(self.md.config, self._requests, self.opts, dtype, converted=self.md.converted is not None)
        session: EngineSession | ClusterSession
        if self.cluster is not None:
            from lingctl.flood.cluster.engines import ClusterSession  # Ray is imported there, and only with --ray

            session = ClusterSession(self.cluster, model=self.spec or str(self.md.path), engine=self.opts)
        else:
            session = EngineSession(self.md, self.opts, plan, dtype=dtype, stop_check=self.codec.stop_check)
        started = time.monotonic()
        try:
            for res in session.results(self._requests, on_step=on_step, should_stop=should_stop):
                record = self._finished(res)
                if record is not None:
                    yield record
        except StopRequested:
            raise Interrupted(
                "interrupted; the items finished so far are kept", hint="run the same command again to continue"
            ) from None
        finally:
            self._took(session)
            log.debug("evaluated %d items in %.1f s", len(self._pending), time.monotonic() - started)

    def _took(self, session: EngineSession | ClusterSession) -> None:
        run, stats = self.run, session.stats
        run.seconds, run.load_seconds, run.threads = session.seconds, session.load_seconds, session.threads
        run.requests = stats.requests
        run.scored_tokens = stats.generated_tokens
        work = run.prompt_tokens - run.cached_prompt_tokens + stats.generated_tokens
        run.tokens_per_s = round(work / run.seconds, 1) if run.seconds > 0 else 0.0

    def _finished(self, res: GenResult) -> dict[str, Any] | None:
        key, choice = res.key
        p = self._pending[key]
        p.left -= 1
        self.run.prompt_tokens += res.prompt_tokens
        self.run.cached_prompt_tokens += res.cached_tokens
        if res.error is not None:
            p.error = p.error or res.error
        elif p.item.kind == CHOICE:
            p.scores[choice] = math.fsum(res.logprobs or [])
            p.greedy[choice] = bool(res.greedy)
        else:
            p.text = res.stop_text if res.stop_text is not None else self.codec.decode(res.token_ids)
            p.finish_reason = res.finish_reason
            p.tokens = [len(res.token_ids)]
        if p.left > 0:
            return None
        del self._pending[key]
        return item_record(p)


def item_record(p: _Pending) -> dict[str, Any]:
    item = p.item
    base: dict[str, Any] = {"task": item.task, "id": item.id, "kind": item.kind}
    if p.error is not None:
        # An item that could not run counts as wrong: leaving it out would flatter the score.
        return {**base, "pred": None, "answer": item.answer, "correct": False, "error": p.error}
    if item.kind == CHOICE:
        scores = [float(s) for s in p.scores if s is not None]
        norm = [s / choice_length(c, item.delimiter) for s, c in zip(scores, item.choices, strict=True)]
        pred, pred_norm = _argmax(scores), _argmax(norm)
        return {
            **base,
            "pred": pred,
            "pred_norm": pred_norm,
            "answer": item.answer,
            "correct": pred == item.answer,
            "correct_norm": pred_norm == item.answer,
            "scores": scores,
            "scores_norm": norm,
            "tokens": p.tokens,
            "greedy": p.greedy,
            **({"truncated": True} if p.truncated else {}),
        }
    if item.match is not None:  # an lm-eval task: its filter and exact_match, on the output as generated
        pred_text = item.match.answer(p.text)
        correct = item.match.normalize(pred_text) == item.match.normalize(str(item.answer))
    else:
        pred_text = extract_answer(p.text, item.regex)
        correct = pred_text == str(item.answer).strip()
    return {
        **base,
        "pred": pred_text,
        "answer": item.answer,
        "correct": correct,
        "text": p.text,
        "finish_reason": p.finish_reason,
        "tokens": p.tokens,
        **({"truncated": True} if p.truncated else {}),
    }


def choice_length(choice: str, delimiter: str | None = None) -> int:
    """What acc_norm divides a choice's log-likelihood by, as lm-evaluation-harness does: its length in
    characters, without the delimiter in front (lm-eval scores ``target_delimiter + choice`` but divides by
    ``len(choice)``; a task converted from lm-eval carries the delimiter in each choice): ``delimiter`` when
    the item says which, else one leading space. At least 1."""
    if delimiter is not None:
        return max(1, len(choice) - len(delimiter))
    return max(1, len(choice) - (1 if choice.startswith(" ") else 0))


def _argmax(values: list[float]) -> int:
    """The first index of the largest value (numpy's argmax, as lm-evaluation-harness uses)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def task_scores(tasks: list[Task], records: list[dict[str, Any]]) -> dict[str, TaskScore]:
    """Accuracy per task (and per-character accuracy for multiple choice), with standard errors."""
    by_task: dict[str, list[dict[str, Any]]] = {t.name: [] for t in tasks}
    for r in records:
        if r["task"] in by_task:
            by_task[r["task"]].append(r)
    out: dict[str, TaskScore] = {}
    for task in tasks:
        rs = by_task[task.name]
        acc, se = mean_stderr([1.0 if r["correct"] else 0.0 for r in rs])
        score = TaskScore(task=task.name, kind=task.kind, items=len(rs), acc=acc, acc_stderr=se)
        if task.kind == CHOICE:
            score.acc_norm, score.acc_norm_stderr = mean_stderr([1.0 if r.get("correct_norm") else 0.0 for r in rs])
        out[task.name] = score
    return out


__all__ = ["ModelEvaluation", "ModelRun", "open_model", "task_scores", "error_text"]
