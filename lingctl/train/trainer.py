"""The training loop: data, model, AdamW, MoE losses, spike guard, eval and checkpoints; one worker, or
several taking synchronous steps through DistributedDataParallel (local SGD is ``local_sgd.py``).

The trainer runs the loop and its steps, and delegates the rest: checkpoints to ``checkpointing.py``, what to
do about a run that goes wrong (divergence, rollbacks, health warnings, incident records) to ``recovery.py``,
fault drills to ``drills.py``, metrics.jsonl to ``metrics_log.py``.

Every source of randomness is either a pure function of (seed, step) (batch order, routing-warmup noise,
schedules) or saved in the checkpoint (optimizer, spike guard, router statistics, torch RNG), so a resumed
run reproduces the loss sequence of an uninterrupted one exactly.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lingctl.runs.layout import METRICS, checkpoint_name
from lingctl.runs.records import Record
from lingctl.runs.train_config import TrainConfig
from lingctl.train import schedule
from lingctl.train.attempt import Attempt, Pace, spike_record, step_record, worker_rates
from lingctl.train.checkpointing import CheckpointManager, ModelFiles
from lingctl.train.dataset import PreparedData
from lingctl.train.drills import DrillPlan, Drills
from lingctl.train.evaluation import eval_loss
from lingctl.train.metrics_log import MetricsLog
from lingctl.train.objective import objective_for
from lingctl.train.position import DataPosition
from lingctl.train.post.dataset import PostData
from lingctl.train.recovery import At, Divergence, Recovery
from lingctl.train.resolved import resolve
from lingctl.train.rundir import RunDir
from lingctl.train.sources import InitSource
from lingctl.train.spike import SpikeGuard, Verdict
from lingctl.train.start import adamw, data_parallel, initial_model, open_run, shared_data
from lingctl.train.workers import Workers

log = logging.getLogger(__name__)


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
class _Losses:
    """The losses a run reports: its first and last step's, and its last eval's."""

    first: float | None = None
    last: float | None = None
    eval: float | None = None

    def seen(self, loss: float) -> None:
        self.first = loss if self.first is None else self.first
        self.last = loss


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
        self.resume, self.restart = resume, restart
        self.on_record = on_record or (lambda record: None)
        self.should_stop = should_stop or (lambda: False)
        self.announce_setup = announce_setup
        self.res = resolve(config)
        self.step = self.attempt = self.tokens = 0
        self.position = DataPosition()
        self.guard = SpikeGuard(config=config.spike)
        self.elapsed_before = 0.0
        self.resumed_from: int | None = None
        self.init = init
        # Metrics are written by rank 0; the other workers' records go nowhere (their figures reach rank 0
        # through the sync records).
        self.metrics = MetricsLog(run.local / METRICS if self.workers.is_main else None)
        self.recovery = Recovery(config, run, self.workers, emit=self._emit, synchronous=self._synchronous)
        self.drills = Drills(DrillPlan.for_worker(config, self.workers), self.workers)
        self._loop_start = time.monotonic()
        self.pace = Pace()

    # -- setup ----------------------------------------------------------------------------------------
    def setup(self) -> None:
        start = open_run(self.config, self.run, self.workers, init=self.init, resume=self.resume, restart=self.restart)
        # A new run is checked by now; reading and tokenizing the data and building the model take a while.
        # (A resume verifies its checkpoint only after that, so it says nothing here: its error comes first.)
        if self.announce_setup and start.latest is None:
            self._emit({"event": "preparing", "run_dir": self.run.describe()}, metric=False)
        self.data: PreparedData | PostData = shared_data(start, self.config, self.res, self.run, self.workers)
        self.files = ModelFiles(
            tokenizer_json=self.data.tokenizer.to_str(),
            tokenizer_config=start.tokenizer_config,
            code_repo=start.code_repo,
        )
        self._build_model(start.latest)
        self._start_from(start.latest)

    def _build_model(self, latest: dict[str, Any] | None) -> None:
        """The model a run starts with, AdamW, a step's loss and the checkpoint manager."""
        c = self.config
        init = self.init if latest is None else None  # a resume's weights come from its checkpoint
        self.model = initial_model(self.data.model_config, c, init=init)
        self.optimizer = adamw(self.model, c.optim, self.res.lr)
        # What a step's loss is, of a module: the wrapped model in steps, the bare one in evals (rank 0
        # evaluates alone, and a DDP forward may start a collective).
        self.objective = objective_for(c, self.data, self.model)
        self.order = self.objective.order(c.seed)
        self.objective.start(
            self.model, self.run, self.workers, fingerprint=self.data.fingerprint, resume=latest is not None
        )
        self.checkpoints = CheckpointManager(
            run=self.run, workers=self.workers, config=c, model=self.model, optimizer=self.optimizer, owner=self
        )

    def _start_from(self, latest: dict[str, Any] | None) -> None:
        """The checkpoint's state when resuming (with the rollbacks recorded since it), else empty metrics."""
        abandoned: list[Record] = []
        if latest is not None:
            abandoned = self._load_state(latest)
        else:
            self.metrics.start_new()
        self.wrapped = data_parallel(self.model, self.workers, self.config.sync)
        self.recovery.start(self.model, abandoned=abandoned)
        if latest is not None:
            lr_factor, cursor = self.recovery.reapply(self.checkpoint_step())
            self.guard.lr_scale *= lr_factor
            self.position.cursor = max(self.position.cursor, cursor)
            if self.workers.is_main:
                self.recovery.publish()  # what the launcher recorded about the attempt that ended
        self.drills.on_model(self.model)

    # -- checkpoints ----------------------------------------------------------------------------------
    def _load_state(self, latest: dict[str, Any]) -> list[Record]:
        """The checkpoint ``latest`` into the model, optimizer and position; returns the step records of
        metrics.jsonl that came after it (now removed from the file)."""
        self.checkpoints.load(latest)
        abandoned = self.metrics.cut_back(self.step)
        log.info("resumed %s at step %d", self.run.describe(), self.step)
        return abandoned

    def _save(self) -> str:
        self._emit(self.checkpoints.save(self.checkpoint_step(), self.files, flush=self.metrics.flush))
        return checkpoint_name(self.checkpoint_step())

    def progress(self) -> dict[str, Any]:
        """What a checkpoint holds of the loop (``checkpointing.TrainingState``)."""
        return {
            "step": self.step,
            "attempt": self.attempt,
            "tokens": self.tokens,
            **self.position.state_dict(),
            "guard": self.guard.state_dict(),
            "router_stats": [(r.logit_mean, r.logit_std) for r in self.model.routers()],
            "fingerprint": self.data.fingerprint,
            "elapsed_s": self.elapsed_before + time.monotonic() - self._loop_start,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Position, guard, router statistics and RNG from a checkpoint's training state."""
        self.data.check_unchanged(state["fingerprint"])
        self.guard.load_state_dict(state["guard"])
        for router, (mean, std) in zip(self.model.routers(), state["router_stats"]):
            router.logit_mean, router.logit_std = mean, std
        torch.set_rng_state(state["rng"])
        self.step, self.attempt, self.tokens = state["step"], state["attempt"], state["tokens"]
        self.position = DataPosition.from_state(state)
        self.elapsed_before = state["elapsed_s"]
        self.resumed_from = self.step

    def extra_state(self) -> dict[str, Any]:
        """What a training mode adds to the checkpoint (the local-SGD outer optimizer)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def checkpoint_step(self) -> int:
        """The step a checkpoint is named after: optimizer steps here; synchronous-step equivalents when
        workers step on their own."""
        return self.step

    # -- the loop -------------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        """The one training loop. Before each step it asks :meth:`_boundary` whether to evaluate,
        checkpoint or stop; a step is :meth:`_step`. Synchronous training and local SGD differ only in
        those two hooks and the schedule's notion of progress (:meth:`schedule_step`)."""
        self._loop_start = time.monotonic()
        self._emit(self._start_record(), metric=False)
        if self._finished():  # resumed a finished run: nothing to do, nothing to rewrite
            return self._result(_Losses(), checkpoint_name(self.checkpoint_step()), "completed")
        self.metrics.open()
        self._loop_starts()
        try:
            seen, checkpoint, stopped = self._loop()
            if stopped != "completed":
                # Why the records end here, for `train status` (a resume drops it with the other records of
                # its checkpoint's step); not a record the live view or --json shows.
                record = {"event": "stop", "step": self.checkpoint_step(), "reason": stopped}
                self.metrics.write({**record, "time": round(time.time(), 3)})
        finally:
            self.metrics.close()
            if self.workers.is_main:
                self.run.wait_uploads()
                self.run.publish([METRICS])
                self.recovery.publish()
        return self._result(seen, checkpoint, stopped)

    def _loop(self) -> tuple[_Losses, str | None, str]:
        seen, checkpoint = _Losses(), None
        while True:
            boundary = self._boundary(self._loop_start)
            if boundary.eval:
                seen.eval = self._eval()
            if boundary.save:
                checkpoint = self._save()
            if boundary.stop is not None:
                return seen, checkpoint, boundary.stop
            self._boundary_done()
            # The pace a worker reports is its step alone: evals, saves and stop checks are not in it.
            began, tokens_before = time.monotonic(), self.tokens
            self.pace.iteration_begins()
            self.drills.before_step(self.step)
            try:
                record = self._step()
            except Divergence as diverged:
                self._roll_back(diverged)
                continue
            if record is not None:
                self.drills.after_step(record, step=self.step, flush=self.metrics.flush)
                seen.seen(record["loss"])
            self.pace.iteration_ends(time.monotonic() - began, self._local_tokens(self.tokens - tokens_before))

    def _start_record(self) -> Record:
        """What a live view shows before the first step (not a metric: metrics.jsonl does not get it)."""
        cfg = self.model.config
        return {
            "event": "start",
            "run_dir": self.run.describe(),
            "preset": self.config.preset,
            "parameters": cfg.num_parameters(),
            "active_parameters": cfg.num_parameters(active=True),
            "train_sequences": self.objective.n_rows,
            "task": self.config.task,
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

    def _roll_back(self, div: Divergence) -> None:
        """Back to the last checkpoint, with the learning rate times ``watchdog_config.lr_factor`` and the
        data since that checkpoint skipped (the window is recorded, so the run stays reproducible); the
        abandoned steps' records move from metrics.jsonl into the incident. ``Recovery`` decides, and ends the
        run when there is no checkpoint or the rollback budget is spent."""
        rollback = self.recovery.begin_rollback(div, self._at())
        self.metrics.close()
        # As at a resume: the optimizer holds state only for what the checkpoint has (an expert that first got
        # tokens after it has none there).
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.state.clear()
        abandoned = self._load_state(rollback.latest)
        self.metrics.open()
        self.guard.lr_scale *= self.config.watchdog_config.lr_factor
        window = self.position.skip_to(rollback.cursor, self.workers.world)
        self._evaluated_at = self._saved_at = self.step
        self.recovery.end_rollback(
            rollback, restored_step=self.step, lr_scale=self.guard.lr_scale, window=window, abandoned=abandoned
        )

    def _result(self, seen: _Losses, checkpoint: str | None, stopped: str) -> TrainResult:
        c = self.config
        return TrainResult(
            run_dir=self.run.describe(),
            steps=self.checkpoint_step(),
            target_steps=c.steps,
            tokens=self.tokens,
            parameters=self.model.config.num_parameters(),
            active_parameters=self.model.config.num_parameters(active=True),
            first_loss=seen.first,
            last_loss=seen.last,
            eval_loss=seen.eval,
            spikes_skipped=self.guard.total_spikes,
            lr_drops=self.guard.lr_drops,
            checkpoint=checkpoint,
            elapsed_s=round(self.elapsed_before + time.monotonic() - self._loop_start, 3),
            stopped=stopped,
            resumed_from=self.resumed_from,
        )

    # -- a step ---------------------------------------------------------------------------------------
    def _attempt(self) -> Record | None:
        """One forward/backward; returns the step record when the update was applied, None when skipped."""
        attempt = self._forward_batch()
        verdict = self._judge(attempt)
        if verdict.spike:
            self._skip(attempt, verdict)
            return None
        return self._apply(attempt)

    def _forward_batch(self) -> Attempt:
        """The next batch through the model at this step's learning rate, and the loss the workers agree on."""
        began = time.monotonic()
        rows, tries = self._next_batch()
        alpha, lr = self._schedule()
        if not math.isfinite(lr):
            self.recovery.diverged(f"the learning rate is {lr}", self._at())
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        batch = self.objective.batch(rows)
        read = time.monotonic()
        self.pace.data_s = read - began  # this worker's pace, by part: reading the batch ...
        parts = self.objective.loss(self.wrapped, batch)
        loss = self.drills.on_loss(parts["loss"], step=self.step, attempt=self.attempt)
        n_tokens = self.objective.n_tokens(batch)
        attempt = Attempt(
            rows=rows,
            tries=tries,
            began=began,
            read=read,
            n_tokens=n_tokens,
            parts=parts,
            loss=loss,
            lr=lr,
            alpha=alpha,
        )
        attempt.loss_value, attempt.paces = self._agreed_loss(float(loss.detach()))
        return attempt

    def _agreed_loss(self, loss_value: float) -> tuple[float, Any]:
        """Synchronous workers decide on the mean loss, so all of them skip or apply the same steps; the same
        collective brings rank 0 every worker's pace in its previous iteration (None without it)."""
        if not self._synchronous():
            return loss_value, None
        t_wait = time.monotonic()
        gathered = self.workers.gather([loss_value, *self.pace.previous])
        self.pace.waited_s += time.monotonic() - t_wait
        return float(gathered[:, 0].sum()) / self.workers.world, gathered[:, 1:]

    def _judge(self, a: Attempt) -> Verdict:
        """The spike guard's verdict on the loss, then, when it passes, on the gradient norm after backward."""
        verdict = self.drills.on_verdict(self.guard.check_loss(a.loss_value), step=self.step)
        a.finite = math.isfinite(a.loss_value)
        if verdict.spike:
            return verdict
        a.loss.backward()
        self._after_backward()
        clip = self.config.optim.grad_clip if self.config.optim.grad_clip > 0 else math.inf
        a.grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        a.finite = math.isfinite(a.grad_norm)
        return self.guard.check_grad(a.grad_norm)

    def _skip(self, a: Attempt, verdict: Verdict) -> None:
        """A spike: the update is not applied, its batch is retried later (or dropped), repeated spikes lower
        the learning rate, and spikes that go on are a divergence."""
        self.optimizer.zero_grad(set_to_none=True)
        due = self.position.put_back(a.rows, a.tries, self.step, self.config.spike)
        self._emit(spike_record(a, verdict.reason, step=self.step, attempt=self.attempt, retry_at=due))
        if self.guard.record_spike(self.step):
            self._emit({"event": "lr_drop", "step": self.step, "lr_scale": self.guard.lr_scale})
        self.attempt += 1
        self.recovery.skipped(
            verdict.reason, self._at(), finite=a.finite, began=a.began, parameters_finite=self._parameters_finite
        )

    def _apply(self, a: Attempt) -> Record:
        """The update, then the step record (and the health watch's look at it)."""
        self.recovery.applied()
        self.optimizer.step()
        # ... and computing it (forward, backward, update), the wait for the other workers excluded.
        self.pace.compute_s = time.monotonic() - a.read - self.pace.waited_s
        self.optimizer.zero_grad(set_to_none=True)
        self.guard.accept(a.loss_value, a.grad_norm)
        self.step += 1
        self.attempt += 1
        # A synchronous step consumed every worker's batch; a local step only this worker's.
        n_tokens = a.n_tokens * (self.workers.world if self._synchronous() else 1)
        self.tokens += n_tokens
        record = step_record(
            a,
            step=self.step,
            tokens=self.tokens,
            n_tokens=n_tokens,
            num_experts=self.model.config.num_experts,
            spikes_skipped=self.guard.total_spikes,
        )
        if a.paces is not None and self.workers.world > 1 and (a.paces[:, 0] > 0).all():
            record["worker_tokens_per_s"] = worker_rates(a.paces[:, 1], a.paces[:, 0])
            self.recovery.observe_paces(a.paces)
        if a.tries:
            record["retried"] = True
        self._emit(record)
        self.recovery.observe_routing(a.parts["routes"])
        return record

    def _at(self) -> At:
        return At(
            step=self.step, attempt=self.attempt, checkpoint_step=self.checkpoint_step(), cursor=self.position.cursor
        )

    def _parameters_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

    def _next_batch(self) -> tuple[list[int], int]:
        """Rows for this attempt and how often they were tried before: a due retry first, else fresh data."""
        c = self.config
        size = schedule.batch_size(
            self.step, target=self.res.batch_size, start=c.batch_start, warmup_steps=c.batch_warmup_steps
        )
        return self.position.next_batch(self.step, size, self.order, self.workers)

    def schedule_step(self) -> int:
        """Progress as the learning-rate schedule counts it: optimizer steps here; with local SGD, the
        synchronous-step equivalent of all workers' steps."""
        return self.step

    def _schedule(self) -> tuple[float, float]:
        """This attempt's routing warmup (set on the routers) and learning rate."""
        c, o = self.config, self.config.optim
        alpha = schedule.routing_alpha(self.step, c.moe.routing_warmup_steps)
        schedule.set_routing_warmup(self.model.routers(), alpha, seed=c.seed, attempt=self.attempt)
        lr = schedule.learning_rate(
            self.schedule_step(),
            peak=self.res.lr,
            warmup_steps=o.warmup_steps,
            total_steps=c.steps,
            min_ratio=o.min_lr_ratio,
        )
        return alpha, lr * self.guard.lr_scale

    def _eval(self) -> float | None:
        if not self.workers.is_main:  # workers hold the same model here: rank 0 evaluates
            return None
        batches = self.objective.eval_batches(self.res.batch_size, self.config.eval_batches)
        value = eval_loss(self.model, batches, functools.partial(self.objective.loss, self.model))
        if value is None:
            return None
        self._emit({"event": "eval", "step": self.checkpoint_step(), "eval_loss": round(value, 6)})
        return value

    def _emit(self, record: Record, *, metric: bool = True) -> None:
        """To metrics.jsonl (``metric``; while the loop runs) and to ``on_record``."""
        # Wall-clock time of every record (Unix seconds): lines up the metrics with logs and other runs.
        record["time"] = round(time.time(), 3)
        if metric:
            self.metrics.write(record)
        self.on_record(record)
