"""The training loop: data, model, AdamW, MoE losses, spike guard, eval and checkpoints; one worker, or
several taking synchronous steps through DistributedDataParallel (local SGD is ``local_sgd.py``).

Every source of randomness is either a pure function of (seed, step) (batch order, routing-warmup noise,
schedules) or saved in the checkpoint (optimizer, spike guard, router statistics, torch RNG), so a resumed
run reproduces the loss sequence of an uninterrupted one exactly.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from lingctl.core.atomic import atomic_write
from lingctl.core.config import to_dict
from lingctl.core.errors import LingctlError, NotFoundError, UsageError, VerificationError
from lingctl.core.names import join_under
from lingctl.model.checkpoint import load_config, load_weights_into, save_checkpoint
from lingctl.model.checkpoint_files import (
    CONFIG,
    LEGACY_TRAIN_STATE,
    STATE_DIR,
    TOKENIZER,
    TOKENIZER_CONFIG,
    TRAIN_CONFIG,
    WEIGHTS,
)
from lingctl.model.config import LingConfig
from lingctl.model.hf_files import LING_CODE_REPO, code_repo_of
from lingctl.model.ling import LingForCausalLM
from lingctl.model.safetensors_io import load_safetensors
from lingctl.model.tokenizer import save_tokenizer
from lingctl.pcache.checkpoint import load as pcache_load
from lingctl.pcache.checkpoint import save as pcache_save
from lingctl.pcache.tier import read_marker
from lingctl.train import losses, schedule
from lingctl.train.config import TrainConfig, resolve
from lingctl.train.data import BatchOrder, batch_tensors
from lingctl.train.dataset import PreparedData, prepare_data
from lingctl.train.rundir import METRICS, RunDir, checkpoint_name
from lingctl.train.sources import InitSource, default_code_repo, read_json_object, tokenizer_source
from lingctl.train.spike import SpikeGuard
from lingctl.train.workers import Workers, strided_rows

log = logging.getLogger(__name__)

Record = dict[str, Any]


class TrainingDiverged(LingctlError):
    """The run stopped because it could not go on usefully: every recent step was skipped, or a value the
    update needs is not a finite number. Nothing is saved after the last good checkpoint."""


@dataclass(kw_only=True, slots=True)
class TrainResult:
    run_dir: str
    steps: int
    target_steps: int
    tokens: int
    parameters: int
    active_parameters: int
    first_loss: float | None
    last_loss: float | None
    eval_loss: float | None
    spikes_skipped: int
    lr_drops: int
    checkpoint: str | None
    elapsed_s: float
    stopped: str  # "completed", "time limit", "interrupted"
    resumed_from: int | None = None
    wall_s: float | None = None  # this process, start-up included
    tokens_per_s: float | None = None  # tokens trained by this process / its time in the training loop


@dataclass(kw_only=True, slots=True)
class Boundary:
    """What the loop does before its next step: evaluate, checkpoint (in that order), end the run."""

    eval: bool = False
    save: bool = False
    stop: str | None = None  # why the run ends here ("completed", "time limit", "interrupted"); None: go on


@dataclass(slots=True)
class _Retry:
    due: int
    rows: list[int]
    tries: int


@dataclass(slots=True)
class _Position:
    """Where the data stream is: sequences consumed so far, and spiking batches waiting to be retried."""

    cursor: int = 0
    retries: list[_Retry] = field(default_factory=list)


def worker_rates(tokens: Any, seconds: Any) -> list[float]:
    """Tokens per second of each worker, from its own tokens and busy time (rank order)."""
    return [round(float(t) / max(float(s), 1e-9), 1) for t, s in zip(tokens, seconds)]


class Trainer:
    def __init__(
        self,
        config: TrainConfig,
        run: RunDir,
        *,
        resume: bool = False,
        restart: bool = False,
        on_record: Callable[[Record], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        workers: Workers | None = None,
        init: InitSource | None = None,
        announce_setup: bool = False,
    ) -> None:
        """``resume``: continue from the run's committed checkpoint. ``restart``: the run directory may hold
        a run that never reached a checkpoint; start it over (otherwise an existing run is refused).
        ``workers``: this process's place among several (one worker when None). ``init``: the checkpoint a
        new run starts from (``--init-from``). ``should_stop``: polled before each step (a Ctrl-C turned
        into a request): the run then checkpoints and stops, on every worker together. ``announce_setup``:
        ``setup`` of a new run emits a ``preparing`` record before its slow part, for a live view (not a
        metric: metrics.jsonl does not get it)."""
        self.config = config
        self.workers = workers or Workers()
        self.run = run
        self.resume = resume
        self.restart = restart
        self.on_record = on_record or (lambda record: None)
        self.should_stop = should_stop or (lambda: False)
        self.res = resolve(config)
        self.step = 0
        self.attempt = 0
        self.tokens = 0
        self.position = _Position()
        self.guard = SpikeGuard(config=config.spike)
        self.elapsed_before = 0.0
        self.resumed_from: int | None = None
        self.skipped_in_a_row = 0  # attempts since the last applied step
        self.init = init
        # The tokenizer_config.json the run's checkpoints carry (chat template, special tokens): the one that
        # came with the tokenizer or the starting checkpoint; None = lingctl's own.
        self.tokenizer_config: dict[str, Any] | None = None
        # Where the checkpoints' config.json auto_map sends transformers for Ling's code.
        self.code_repo = default_code_repo(config.hf_code_repo, init)
        self._metrics: Any = None  # metrics.jsonl while train() runs; records before it reach on_record only
        # This worker's own pace, for the per-worker throughput rank 0 reports: time spent in its last loop
        # iteration minus what it waited for the others in lingctl's agreement collectives, and its tokens.
        self._waited_s = 0.0
        self._busy_s = 0.0
        self._busy_tokens = 0
        self.announce_setup = announce_setup

    # -- setup ----------------------------------------------------------------------------------------
    def setup(self) -> None:
        c = self.config
        w = self.workers
        latest = self.run.latest() if self.resume else None
        if latest is not None:
            if w.local_rank == 0:  # one copy per node
                self.run.fetch_for_resume(latest, last_step=c.steps, main=w.is_main)
            w.barrier()
        elif self.run.has_content() and not self.restart:
            raise UsageError(
                f"{self.run.describe()} already holds a training run",
                hint="pass --resume to continue it, or choose another --out",
            )
        else:
            # Before the data is read and before anything is written: a directory holding files lingctl did
            # not write is refused (or, adopted, its names are kept out of the run's way).
            self.run.check_fresh(restart=self.restart, last_step=c.steps)
        tokenizer_path = self.run.local / TOKENIZER if latest is not None else None
        init_shape = self._init_shape(latest)
        if latest is None and c.data.tokenizer:
            self.tokenizer_config = tokenizer_source(c.data.tokenizer)[1]
        elif latest is None and self.init is not None:
            tokenizer_path = self.init.tokenizer
            self.tokenizer_config = self.init.tokenizer_config
            if tokenizer_path is None:
                raise NotFoundError(
                    f"{self.init.directory} has no {TOKENIZER}",
                    hint="pass --tokenizer with the tokenizer the checkpoint was trained with",
                )
        # A new run is checked by now; reading and tokenizing the data and building the model take a while.
        # (A resume verifies its checkpoint only after that, so it says nothing here: its error comes first.)
        if self.announce_setup and latest is None:
            self._emit({"event": "preparing", "run_dir": self.run.describe()}, metric=False)
        if latest is None and not w.is_main:
            # Workers use rank 0's tokenizer, sent over the process group: no shared directory is needed.
            tokenizer_path = self._received_tokenizer(w.broadcast(None))
        self.data: PreparedData = prepare_data(c, self.res, tokenizer_path=tokenizer_path, init=init_shape)
        if latest is None and w.is_main:
            # Only now that the data is usable: a bad --data leaves no empty run directory behind.
            self.run.prepare_fresh()
            save_tokenizer(self.data.tokenizer, self.run.local / TOKENIZER)
            self.run.publish([TOKENIZER])
            w.broadcast(self.data.tokenizer.to_str())
        w.barrier()
        self.order = BatchOrder(len(self.data.tokens.train), c.seed)
        torch.manual_seed(c.seed)
        self.model = LingForCausalLM(self.data.model_config, c.dispatch)
        if latest is None and self.init is not None:
            read = load_weights_into(self.model, self.init.directory)
            log.info("started from %s (%.2f GB of weights)", self.init.spec, read / 1e9)
        else:
            self.model.init_weights(torch.Generator().manual_seed(c.seed))
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        o = c.optim
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.res.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
        )
        # Metrics are written by rank 0; the other workers' records go nowhere (their figures reach rank 0
        # through the sync records).
        self.metrics_path = self.run.local / METRICS if self.workers.is_main else None
        if latest is not None:
            self._load_state(latest)
        elif self.metrics_path is not None:
            self.metrics_path.write_text("")
        self.wrapped = self._wrap(self.model)

    def _init_shape(self, latest: dict[str, Any] | None) -> LingConfig | None:
        """The model shape of a run started from a checkpoint: the starting checkpoint's, or on resume the
        run's own last checkpoint's (so the starting one need not exist any more). Its tokenizer_config.json
        comes along."""
        if latest is None:
            return self.init.config if self.init is not None else None
        ckpt = join_under(self.run.local, latest["path"], what="latest.json path")
        self.tokenizer_config = read_json_object(ckpt / TOKENIZER_CONFIG)
        if self.config.hf_code_repo == LING_CODE_REPO:  # unchanged: keep what the run's checkpoints name
            self.code_repo = code_repo_of(read_json_object(ckpt / CONFIG) or {}, None) or self.code_repo
        if not self.config.init_from:
            return None
        return load_config(ckpt)

    def _wrap(self, model: LingForCausalLM) -> torch.nn.Module:
        """What the forward runs through: DistributedDataParallel with several synchronous workers."""
        if not self.workers.distributed or self.config.sync != "ddp":
            return model
        from torch.nn.parallel import DistributedDataParallel

        # Experts no token was routed to in a step get no gradient: DDP must look for unused parameters.
        return DistributedDataParallel(model, find_unused_parameters=True)

    def _received_tokenizer(self, text: str) -> Any:
        import tempfile

        fd, name = tempfile.mkstemp(prefix="lingctl-tokenizer-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return name

    def _load_state(self, latest: dict[str, Any]) -> None:
        ckpt = join_under(self.run.local, latest["path"], what="latest.json path")
        if (ckpt / STATE_DIR).is_dir():
            state = self._load_pcache_state(ckpt / STATE_DIR)
        else:
            weights = load_safetensors(ckpt / WEIGHTS)
            if self.model.config.tie_word_embeddings:
                weights["lm_head.weight"] = weights["model.word_embeddings.weight"]
            self.model.load_state_dict(weights, strict=True)
            state = torch.load(ckpt / LEGACY_TRAIN_STATE, weights_only=True)
            self.optimizer.load_state_dict(state["optimizer"])
        try:
            self._restore(state)
        except (KeyError, TypeError, ValueError) as exc:
            raise VerificationError(
                f"{ckpt}: the saved training state is damaged ({type(exc).__name__}: {exc})",
                hint="resume from another checkpoint, or start a new run",
            ) from None
        if self.metrics_path is not None:
            self._truncate_metrics(self.step)
        log.info("resumed %s at step %d", self.run.describe(), self.step)

    def _restore(self, state: dict[str, Any]) -> None:
        """Position, guard, router statistics and RNG from a checkpoint's training state."""
        if state["fingerprint"] != self.data.fingerprint:
            raise LingctlError(
                "the training data changed since this run was checkpointed "
                f"(fingerprint {state['fingerprint']} -> {self.data.fingerprint})",
                hint="resume with the same --data, or start a new run with another --out",
            )
        self.guard.load_state_dict(state["guard"])
        for router, (mean, std) in zip(self.model.routers(), state["router_stats"]):
            router.logit_mean, router.logit_std = mean, std
        torch.set_rng_state(state["rng"])
        self.step, self.attempt, self.tokens = state["step"], state["attempt"], state["tokens"]
        self.position = _Position(state["cursor"], [_Retry(**r) for r in state["retries"]])
        self.elapsed_before = state["elapsed_s"]
        self.resumed_from = self.step

    def _load_pcache_state(self, directory: Any) -> dict[str, Any]:
        """Model and optimizer from the run's pcache checkpoint; returns the rest of the training state."""
        marker = read_marker(directory)  # one line and exit 4 when it is not a pcache marker
        if marker is None:
            raise NotFoundError(
                f"{directory}: the checkpoint has no commit marker (its save did not finish)",
                hint="resume from a complete checkpoint",
            )
        saved = marker.get("world_size", 1)
        if not isinstance(saved, int) or isinstance(saved, bool) or saved < 1:
            raise VerificationError(
                f"{directory}: the commit marker's world_size {saved!r} is not a worker count",
                hint="the checkpoint is damaged; resume from another one",
            )
        if saved != self.workers.world:
            raise UsageError(
                f"the run was checkpointed by {saved} worker(s); this job has {self.workers.world}",
                hint=f"resume with --nproc {saved}",
            )
        train_key, optim_key = self._keys()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        template = {
            "model": model_sd,
            optim_key: optim_sd,
            train_key: {"meta": "", "rng": torch.get_rng_state()},
            **self._extra_state(),
        }
        pcache_load(template, directory)
        set_state_dict(
            self.model, self.optimizer, model_state_dict=template["model"], optim_state_dict=template[optim_key]
        )
        self._load_extra_state(template)
        state = json.loads(template[train_key]["meta"])
        state["rng"] = template[train_key]["rng"]
        return state

    def _truncate_metrics(self, step: int) -> None:
        """Drop records written after the checkpoint (and a torn last line), so the resumed run's records
        continue the file as if there had been no interruption."""
        path = self.metrics_path
        if path is None:  # this process writes no metrics (a worker other than the first)
            return
        kept = []
        if path.exists():
            for line in path.read_text(errors="replace").splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if not isinstance(record, dict):
                    continue
                if record.get("step", 0) <= step and not (record.get("event") == "done"):
                    if record.get("step") == step and record.get("event") not in ("step", "eval", "checkpoint"):
                        continue
                    kept.append(line)
        with atomic_write(path) as (_, f):
            f.write("".join(k + "\n" for k in kept).encode())

    # -- the loop -------------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        """The one training loop. Before each step it asks :meth:`_boundary` whether to evaluate,
        checkpoint or stop; a step is :meth:`_step`. Synchronous training and local SGD differ only in
        those two hooks and the schedule's notion of progress (:meth:`schedule_step`)."""
        start = time.monotonic()
        first_loss = last_loss = eval_loss = None
        checkpoint: str | None = None
        self._emit(self._start_record(), metric=False)
        if self._finished():  # resumed a finished run: nothing to do, nothing to rewrite
            return self._result(None, None, None, checkpoint_name(self.checkpoint_step()), start, "completed")
        self._metrics = open(self.metrics_path, "a", encoding="utf-8") if self.metrics_path else None
        self._loop_starts()
        stopped = "completed"
        try:
            while True:
                boundary = self._boundary(start)
                if boundary.eval:
                    eval_loss = self._eval()
                if boundary.save:
                    checkpoint = self._save(start)
                if boundary.stop is not None:
                    stopped = boundary.stop
                    break
                self._boundary_done()
                # The pace a worker reports is its step alone: evals, saves and stop checks are not in it.
                began, self._waited_s, tokens_before = time.monotonic(), 0.0, self.tokens
                record = self._step()
                if record is not None:
                    self._drills(record)
                    first_loss = record["loss"] if first_loss is None else first_loss
                    last_loss = record["loss"]
                self._busy_s = time.monotonic() - began - self._waited_s
                self._busy_tokens = self._local_tokens(self.tokens - tokens_before)
        finally:
            if self._metrics is not None:
                self._metrics.close()
            if self.workers.is_main:
                self.run.wait_uploads()
                self.run.publish([METRICS])
        return self._result(first_loss, last_loss, eval_loss, checkpoint, start, stopped)

    def _start_record(self) -> Record:
        """What a live view shows before the first step (not a metric: metrics.jsonl does not get it)."""
        cfg = self.model.config
        return {
            "event": "start",
            "run_dir": self.run.describe(),
            "preset": self.config.preset,
            "parameters": cfg.num_parameters(),
            "active_parameters": cfg.num_parameters(active=True),
            "train_sequences": len(self.data.tokens.train),
            "seq_len": self.res.seq_len,
            "step": self.checkpoint_step(),
            "steps": self.config.steps,
            "workers": self.workers.world,
            "sync": self.config.sync if self.workers.world > 1 else None,
            "resumed_from": self.resumed_from,
        }

    def _finished(self) -> bool:
        return self.step >= self.config.steps

    def _loop_starts(self) -> None:
        """Steps taken before this process started count as evaluated and saved (the checkpoint holds them)."""
        self._evaluated_at = self._saved_at = self.step

    def _boundary(self, start: float) -> Boundary:
        """Synchronous steps: evaluate and save on their multiples of the step count, and at the end."""
        c = self.config
        stop = "completed" if self.step >= c.steps else self._agreed_stop(start)
        final = stop is not None
        boundary = Boundary(
            eval=self.step > self._evaluated_at and (final or bool(c.eval_every and self.step % c.eval_every == 0)),
            save=self.step > self._saved_at and (final or bool(c.save_every and self.step % c.save_every == 0)),
            stop=stop,
        )
        if boundary.eval:
            self._evaluated_at = self.step
        if boundary.save:
            self._saved_at = self.step
        return boundary

    def _boundary_done(self) -> None:
        """Called when the boundary's work is done and the next step begins (local SGD restarts its clock)."""

    def _step(self) -> Record | None:
        """One attempt: the step record, or None when it was skipped."""
        return self._attempt()

    def _local_tokens(self, counted: int) -> int:
        """This worker's share of tokens the step counted (a synchronous step counts every worker's)."""
        return counted // self.workers.world if self._synchronous() else counted

    def _synchronous(self) -> bool:
        """Do workers take this step together (and so must agree on skipping it)?"""
        return self.workers.distributed and self.config.sync == "ddp"

    def _after_backward(self) -> None:
        """Gradients are complete here; DDP has averaged them already."""

    def _agreed_stop(self, start: float) -> str | None:
        """Why to stop before the next step, the same on every worker (one tiny all-reduce when several)."""
        c = self.config
        if self.workers.any(self.should_stop()):
            return "interrupted"
        out_of_time = c.max_seconds is not None and time.monotonic() - start >= c.max_seconds
        if self.workers.any(out_of_time):
            return "time limit"
        return None

    def _drills(self, record: Record) -> None:
        """Fault drills: a worker that dies (SIGKILL) right after a step, a worker that runs slower."""
        c = self.config
        if c.crash_at_step == self.step and self.workers.rank == c.crash_rank:
            if self._metrics is not None:
                self._metrics.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if self.workers.rank == c.simulate_slow_rank and c.slowdown > 1:
            time.sleep(record["step_s"] * (c.slowdown - 1))

    def _result(
        self,
        first_loss: float | None,
        last_loss: float | None,
        eval_loss: float | None,
        checkpoint: str | None,
        start: float,
        stopped: str,
    ) -> TrainResult:
        c = self.config
        return TrainResult(
            run_dir=self.run.describe(),
            steps=self.checkpoint_step(),
            target_steps=c.steps,
            tokens=self.tokens,
            parameters=self.model.config.num_parameters(),
            active_parameters=self.model.config.num_parameters(active=True),
            first_loss=first_loss,
            last_loss=last_loss,
            eval_loss=eval_loss,
            spikes_skipped=self.guard.total_spikes,
            lr_drops=self.guard.lr_drops,
            checkpoint=checkpoint,
            elapsed_s=round(self.elapsed_before + time.monotonic() - start, 3),
            stopped=stopped,
            resumed_from=self.resumed_from,
        )

    def _next_batch(self) -> tuple[list[int], int]:
        """Rows for this attempt and how often they were tried before: a due retry first, else fresh data."""
        retries = self.position.retries
        if retries and retries[0].due <= self.step:
            r = retries.pop(0)
            return r.rows, r.tries
        n = schedule.batch_size(
            self.step,
            target=self.res.batch_size,
            start=self.config.batch_start,
            warmup_steps=self.config.batch_warmup_steps,
        )
        rows = strided_rows(self.order.indices, self.position.cursor, n, self.workers.rank, self.workers.world)
        self.position.cursor += n
        return rows, 0

    def _set_routing_warmup(self) -> float:
        alpha = schedule.routing_alpha(self.step, self.config.moe.routing_warmup_steps)
        for i, router in enumerate(self.model.routers()):
            router.warmup_alpha = alpha
            # Noise keyed by (seed, attempt, layer): identical after a resume, no generator state to save.
            router.noise_generator = (
                torch.Generator().manual_seed((self.config.seed * 1_000_003 + self.attempt) * 1_009 + i)
                if alpha < 1.0
                else None
            )
        return alpha

    def schedule_step(self) -> int:
        """Progress as the learning-rate schedule counts it: optimizer steps here; with local SGD, the
        synchronous-step equivalent of all workers' steps."""
        return self.step

    def _lr(self) -> float:
        o = self.config.optim
        base = schedule.learning_rate(
            self.schedule_step(),
            peak=self.res.lr,
            warmup_steps=o.warmup_steps,
            total_steps=self.config.steps,
            min_ratio=o.min_lr_ratio,
        )
        return base * self.guard.lr_scale

    def _forward(
        self, inputs: torch.Tensor, targets: torch.Tensor, module: torch.nn.Module | None = None
    ) -> dict[str, Any]:
        c = self.config
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=c.dtype == "bfloat16"):
            out = (module or self.wrapped)(inputs)
            logits = out.logits.float()
        lm = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        cfg = self.model.config
        bal = losses.balance_loss(out.routes, cfg.num_experts)
        z = losses.z_loss(out.routes)
        loss = lm + c.moe.balance_coef * bal + c.moe.z_coef * z
        return {"loss": loss, "lm_loss": lm, "balance_loss": bal, "z_loss": z, "routes": out.routes}

    def _attempt(self) -> Record | None:
        """One forward/backward; returns the step record when the update was applied, None when skipped."""
        c = self.config
        t0 = time.monotonic()
        rows, tries = self._next_batch()
        alpha = self._set_routing_warmup()
        lr = self._lr()
        if not math.isfinite(lr):
            self._diverged(f"the learning rate is {lr}")
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        inputs, targets = batch_tensors(self.data.tokens.train, rows)
        parts = self._forward(inputs, targets)
        loss = parts["loss"]
        if self.attempt in c.inject_spikes:
            loss = loss * c.inject_spike_factor
        if self.workers.rank == c.simulate_bad_rank and c.sync == "ddp":
            loss = loss * 100.0  # fault drill: this worker's gradient is 100 times too large
        # Synchronous workers decide on the mean loss, so all of them skip or apply the same steps; the same
        # collective brings rank 0 every worker's pace in its previous iteration.
        loss_value = float(loss.detach())
        paces = None
        if self._synchronous():
            t_wait = time.monotonic()
            gathered = self.workers.gather([loss_value, self._busy_s, float(self._busy_tokens)])
            self._waited_s += time.monotonic() - t_wait
            loss_value = float(gathered[:, 0].sum()) / self.workers.world
            paces = gathered[:, 1:]
        grad_norm = float("nan")
        verdict = self.guard.check_loss(loss_value)
        finite = math.isfinite(loss_value)
        if not verdict.spike:
            loss.backward()
            self._after_backward()
            clip = c.optim.grad_clip if c.optim.grad_clip > 0 else math.inf
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
            finite = math.isfinite(grad_norm)
            verdict = self.guard.check_grad(grad_norm)
        if verdict.spike:
            self.optimizer.zero_grad(set_to_none=True)
            self._on_spike(rows, tries, loss_value, grad_norm, verdict.reason)
            self.attempt += 1
            self.skipped_in_a_row += 1
            if not finite and not self._parameters_finite():
                self._diverged(f"the model's parameters are no longer finite ({verdict.reason})")
            if self.skipped_in_a_row >= c.max_consecutive_skips:
                self._diverged(f"{self.skipped_in_a_row} steps in a row were skipped (last: {verdict.reason})")
            return None
        self.skipped_in_a_row = 0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.guard.accept(loss_value, grad_norm)
        self.step += 1
        self.attempt += 1
        # A synchronous step consumed every worker's batch; a local step only this worker's.
        n_tokens = inputs.numel() * (self.workers.world if self._synchronous() else 1)
        self.tokens += n_tokens
        dt = time.monotonic() - t0
        record: Record = {
            "event": "step",
            "step": self.step,
            "loss": loss_value,
            "lm_loss": round(float(parts["lm_loss"].detach()), 6),
            "balance_loss": round(float(parts["balance_loss"].detach()), 6),
            "z_loss": round(float(parts["z_loss"].detach()), 6),
            "grad_norm": round(grad_norm, 6),
            "lr": lr,
            "batch_size": len(rows),
            "tokens": self.tokens,
            "tokens_per_s": round(n_tokens / max(dt, 1e-9), 1),
            "step_s": round(dt, 4),
            "routing_alpha": round(alpha, 4),
            "expert_load": losses.expert_load(parts["routes"], self.model.config.num_experts),
            "spikes_skipped": self.guard.total_spikes,
        }
        if paces is not None and self.workers.world > 1 and (paces[:, 0] > 0).all():
            record["worker_tokens_per_s"] = worker_rates(paces[:, 1], paces[:, 0])
        if tries:
            record["retried"] = True
        self._emit(record)
        return record

    def _parameters_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

    def _diverged(self, why: str) -> None:
        """End the run: a metrics record saying why, then one line for the user (exit 1). Nothing is saved,
        so the last checkpoint stays the last good state."""
        message = f"training diverged after step {self.step}: {why}"
        self._emit({"event": "diverged", "step": self.step, "attempt": self.attempt, "reason": why})
        raise TrainingDiverged(
            message, hint="start a new run with a lower --lr; the last checkpoint, if any, predates this step"
        )

    def _on_spike(self, rows: list[int], tries: int, loss: float, grad_norm: float, reason: str) -> None:
        c = self.config.spike
        record: Record = {
            "event": "spike",
            "step": self.step,
            "attempt": self.attempt,
            "loss": loss,
            "grad_norm": None if math.isnan(grad_norm) else grad_norm,
            "reason": reason,
        }
        if tries < c.max_retries:
            due = self.step + c.retry_after_steps
            self.position.retries.append(_Retry(due, rows, tries + 1))
            self.position.retries.sort(key=lambda r: r.due)
            record.update(action="skipped", retry_at_step=due)
        else:
            record.update(action="dropped")
        self._emit(record)
        if self.guard.record_spike(self.step):
            self._emit({"event": "lr_drop", "step": self.step, "lr_scale": self.guard.lr_scale})

    @torch.no_grad()
    def _eval(self) -> float | None:
        data = self.data.tokens.eval
        if len(data) == 0 or not self.workers.is_main:  # workers hold the same model here: rank 0 evaluates
            return None
        n = min(len(data), self.config.eval_batches * self.res.batch_size)
        self.model.eval()
        saved = [r.warmup_alpha for r in self.model.routers()]
        for r in self.model.routers():
            r.warmup_alpha = 1.0  # eval measures the learned router, not the warmup noise
        total, count = 0.0, 0
        for start in range(0, n, self.res.batch_size):
            rows = list(range(start, min(n, start + self.res.batch_size)))
            inputs, targets = batch_tensors(data, rows)
            # The bare model: rank 0 evaluates alone, and a DDP forward may start a collective.
            total += float(self._forward(inputs, targets, self.model)["lm_loss"]) * len(rows)
            count += len(rows)
        for r, a in zip(self.model.routers(), saved):
            r.warmup_alpha = a
        value = total / count
        self._emit({"event": "eval", "step": self.checkpoint_step(), "eval_loss": round(value, 6)})
        return value

    def checkpoint_step(self) -> int:
        """The step a checkpoint is named after: optimizer steps here; synchronous-step equivalents when
        workers step on their own."""
        return self.step

    def _save(self, start: float) -> str:
        rel = checkpoint_name(self.checkpoint_step())
        directory = self.run.local / rel
        if self.workers.local_rank == 0:  # listed as lingctl's before any worker writes into it
            self.run.claim_checkpoint(rel, main=self.workers.is_main)
        self.workers.barrier()
        if self.workers.is_main:
            save_checkpoint(
                self.model,
                directory,
                tokenizer_json=self.data.tokenizer.to_str(),
                tokenizer_config=self.tokenizer_config,
                max_shard_size=self.config.max_shard_size,
                code_repo=self.code_repo,
            )
        meta = {
            "step": self.step,
            "attempt": self.attempt,
            "tokens": self.tokens,
            "cursor": self.position.cursor,
            "retries": [{"due": r.due, "rows": r.rows, "tries": r.tries} for r in self.position.retries],
            "guard": self.guard.state_dict(),
            "router_stats": [(r.logit_mean, r.logit_std) for r in self.model.routers()],
            "fingerprint": self.data.fingerprint,
            "elapsed_s": self.elapsed_before + time.monotonic() - start,
        }
        # Model, optimizer and position in one pcache checkpoint: planned across ranks, streamed through a
        # bounded buffer, committed by its marker; the HF-format files beside it are what flood loads.
        pcache_save(self._state(meta), directory / STATE_DIR, extra={"step": self.step})
        if self.workers.is_main:
            with atomic_write(directory / TRAIN_CONFIG) as (_, f):
                f.write(json.dumps(to_dict(self.config), indent=2).encode())
            if self._metrics is not None:
                self._metrics.flush()
            files = sorted(p.relative_to(self.run.local).as_posix() for p in directory.iterdir() if p.is_file())
            # Weights first, config.json last: a half-uploaded checkpoint has no config.
            files.sort(key=lambda name: name.endswith("/config.json"))
            self.run.publish_checkpoint(self.checkpoint_step(), rel, files + [METRICS])
            self.run.prune(self.config.keep_checkpoints, rel)
        self.workers.barrier()
        self._emit({"event": "checkpoint", "step": self.checkpoint_step(), "path": f"{self.run.describe()}/{rel}"})
        return rel

    def _keys(self) -> tuple[str, str]:
        """State-dict keys of what differs between workers: DCP writes one copy of a key that every rank
        holds, so a worker's own position (and, with local SGD, its own optimizer) gets a key of its own."""
        w = self.workers
        own = "" if w.world == 1 else f".rank{w.rank}"
        return "train" + own, "optimizer" + (own if self.config.sync != "ddp" else "")

    def _state(self, meta: dict[str, Any]) -> dict[str, Any]:
        train_key, optim_key = self._keys()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_sd,
            optim_key: optim_sd,
            train_key: {"meta": json.dumps(meta), "rng": torch.get_rng_state()},
            **self._extra_state(),
        }

    def _extra_state(self) -> dict[str, Any]:
        """What a training mode adds to the checkpoint (the local-SGD outer optimizer)."""
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def _emit(self, record: Record, *, metric: bool = True) -> None:
        """To metrics.jsonl (``metric``; while the loop runs) and to ``on_record``."""
        # Wall-clock time of every record (Unix seconds): lines up the metrics with logs and other runs.
        record["time"] = round(time.time(), 3)
        if metric and self._metrics is not None:
            self._metrics.write(json.dumps(record) + "\n")
            self._metrics.flush()
        self.on_record(record)
