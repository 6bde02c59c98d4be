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
from dataclasses import asdict, dataclass, field
from typing import Any, NoReturn

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

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
from lingctl.model.moe import SparseMoeBlock
from lingctl.model.safetensors_io import load_safetensors
from lingctl.model.tokenizer import save_tokenizer
from lingctl.pcache.checkpoint import load as pcache_load
from lingctl.pcache.checkpoint import save as pcache_save
from lingctl.pcache.checkpoint import saved_keys
from lingctl.pcache.tier import read_marker
from lingctl.runs import records as metrics_file
from lingctl.train import losses, schedule
from lingctl.train.config import TrainConfig, parse_pair, resolve
from lingctl.train.data import BatchOrder, batch_tensors
from lingctl.train.dataset import PreparedData, prepare_data
from lingctl.train.rundir import METRICS, RunDir, checkpoint_name
from lingctl.train.sources import InitSource, default_code_repo, read_json_object, tokenizer_source
from lingctl.train.spike import SpikeGuard, Verdict
from lingctl.train.supervise import divergence
from lingctl.train.supervise.health import RoutingHealth, StragglerWatch
from lingctl.train.supervise.incidents import INCIDENT_DIR, INCIDENTS, Incident
from lingctl.train.supervise.incidents import append as append_incident
from lingctl.train.supervise.incidents import read as read_incidents
from lingctl.train.workers import Workers, strided_rows

log = logging.getLogger(__name__)

Record = dict[str, Any]


class TrainingDiverged(LingctlError):
    """The run stopped because it could not go on usefully: every recent step was skipped, or a value the
    update needs is not a finite number. Nothing is saved after the last good checkpoint."""


class _Divergence(Exception):
    """Raised inside the loop when the watchdog may roll the run back instead of ending it."""

    def __init__(self, reason: str, onset: float) -> None:
        super().__init__(reason)
        self.reason = reason
        self.onset = onset  # monotonic time of the first bad step


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
        self._data_s = self._compute_s = self._pace_data_s = self._pace_compute_s = 0.0
        # The watchdog's part inside the workers (None: on with several workers): a diverged run goes back to
        # its last checkpoint with a lower learning rate instead of ending. Only where every worker takes the
        # same decision at the same step (one worker, or synchronous steps); local SGD leaves it to the
        # launcher's restart.
        self.watchdog = config.watchdog if config.watchdog is not None else self.workers.world > 1
        self.rollbacks = 0
        self._recent_spikes: list[tuple[int, float]] = []  # (step, monotonic time) of skipped spikes
        self._drill_spikes = 0
        self._nan_fired = False
        self._routing: RoutingHealth | None = None
        self._stragglers: StragglerWatch | None = None
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
        abandoned: list[Record] = []
        if latest is not None:
            abandoned = self._load_state(latest)
        elif self.metrics_path is not None:
            self.metrics_path.write_text("")
        self.wrapped = self._wrap(self.model)
        if self.workers.is_main:
            self.run.claim_watchdog_files()
            if abandoned and self.workers.restarts > 0:
                self._keep_abandoned(abandoned)
            layers = [i for i, layer in enumerate(self.model.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
            self._routing = RoutingHealth(c.watchdog_config, layers, self.model.config.num_experts)
            if self.workers.world > 1:
                self._stragglers = StragglerWatch(c.watchdog_config, self.workers.world)
        if latest is not None:
            self._reapply_rollbacks()
            if self.workers.is_main:
                self._publish_incidents()  # what the launcher recorded about the attempt that ended
        self._collapse_drill()

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

    def _load_state(self, latest: dict[str, Any]) -> list[Record]:
        """The checkpoint ``latest`` into the model, optimizer and position; returns the step records of
        metrics.jsonl that came after it (now removed from the file)."""
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
        abandoned = self._truncate_metrics(self.step) if self.metrics_path is not None else []
        log.info("resumed %s at step %d", self.run.describe(), self.step)
        return abandoned

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
        # Only the optimizer state the checkpoint has: a parameter that had no gradient before the save (an
        # expert no token reached) has none there, and keeps none, as in the run that saved it.
        saved = saved_keys(directory)
        states: dict[str, Any] = optim_sd["state"]  # type: ignore[assignment]
        optim_sd["state"] = {fqn: st for fqn, st in states.items() if f"{optim_key}.state.{fqn}.step" in saved}
        template = {
            "model": model_sd,
            optim_key: optim_sd,
            train_key: {"meta": "", "rng": torch.get_rng_state()},
            **self._extra_state(),
        }
        pcache_load(template, directory)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=template["model"],
            optim_state_dict=template[optim_key],
            options=StateDictOptions(strict=False),
        )
        self._load_extra_state(template)
        state = json.loads(template[train_key]["meta"])
        state["rng"] = template[train_key]["rng"]
        return state

    def _truncate_metrics(self, step: int) -> list[Record]:
        """Cut metrics.jsonl back to the checkpoint of ``step`` (``metrics_file.cut_back``); the dropped step
        records. A worker other than the first writes no metrics."""
        return metrics_file.cut_back(self.metrics_path, step) if self.metrics_path is not None else []

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
                self._hang_drill()
                try:
                    record = self._step()
                except _Divergence as diverged:
                    self._roll_back(diverged)
                    continue
                if record is not None:
                    self._drills(record)
                    first_loss = record["loss"] if first_loss is None else first_loss
                    last_loss = record["loss"]
                self._busy_s = time.monotonic() - began - self._waited_s
                self._busy_tokens = self._local_tokens(self.tokens - tokens_before)
                self._pace_data_s, self._pace_compute_s = self._data_s, self._compute_s
        finally:
            if self._metrics is not None:
                self._metrics.close()
            if self.workers.is_main:
                self.run.wait_uploads()
                self.run.publish([METRICS])
                self._publish_incidents()
        return self._result(first_loss, last_loss, eval_loss, checkpoint, start, stopped)

    def _keep_abandoned(self, records: list[Record]) -> None:
        """A restarted attempt's metrics lose the steps taken after the checkpoint; they go beside the
        incident the launcher records (``incidents/attempt-K-abandoned.jsonl``, K the attempt that ended)."""
        folder = self.run.local / INCIDENT_DIR
        folder.mkdir(exist_ok=True)
        base = f"attempt-{self.workers.restarts - 1}-abandoned"
        for n in range(1, 100):
            path = folder / (f"{base}.jsonl" if n == 1 else f"{base}-{n}.jsonl")
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            except FileExistsError:
                continue  # a resumed job counts its attempts from 0 again
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write("".join(json.dumps(r) + "\n" for r in records))
            return

    def _publish_incidents(self) -> None:
        """To the store of an s3:// run: incidents.jsonl and the hang verdicts, which the launcher writes
        into the local staging directory (a no-op for local runs)."""
        names = [INCIDENTS] if (self.run.local / INCIDENTS).is_file() else []
        if (self.run.local / INCIDENT_DIR).is_dir():
            names += sorted(
                f"{INCIDENT_DIR}/{p.name}" for p in (self.run.local / INCIDENT_DIR).iterdir() if p.is_file()
            )
        self.run.publish(names)

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
        return losses.step_loss(
            module or self.wrapped,
            inputs,
            targets,
            num_experts=self.model.config.num_experts,
            balance_coef=c.moe.balance_coef,
            z_coef=c.moe.z_coef,
            bf16=c.dtype == "bfloat16",
        )

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
        t_data = time.monotonic()
        self._data_s = t_data - t0  # this worker's pace, by part: reading the batch ...
        parts = self._forward(inputs, targets)
        loss = parts["loss"]
        if self.attempt in c.inject_spikes:
            loss = loss * c.inject_spike_factor
        if self.workers.rank == c.simulate_bad_rank and c.sync == "ddp":
            loss = loss * 100.0  # fault drill: this worker's gradient is 100 times too large
        if c.simulate_nan == self.step + 1 and not self._nan_fired and self.workers.rank == 0:
            self._nan_fired = True  # once: the step after the rollback trains normally
            loss = loss * float("nan")  # fault drill: a non-finite loss
        # Synchronous workers decide on the mean loss, so all of them skip or apply the same steps; the same
        # collective brings rank 0 every worker's pace in its previous iteration.
        loss_value = float(loss.detach())
        paces = None
        if self._synchronous():
            t_wait = time.monotonic()
            gathered = self.workers.gather(
                [loss_value, self._busy_s, float(self._busy_tokens), self._pace_data_s, self._pace_compute_s]
            )
            self._waited_s += time.monotonic() - t_wait
            loss_value = float(gathered[:, 0].sum()) / self.workers.world
            paces = gathered[:, 1:]
        grad_norm = float("nan")
        verdict = self.guard.check_loss(loss_value)
        spikes_drill = parse_pair(c.simulate_spikes, "simulate_spikes")
        if spikes_drill and self.step + 1 >= spikes_drill[0] and not verdict.spike:
            if self._drill_spikes < spikes_drill[1]:  # fault drill: the guard sees a spike, whatever the loss
                self._drill_spikes += 1
                verdict = Verdict(True, f"fault drill spike {self._drill_spikes}/{spikes_drill[1]}")
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
            now = time.monotonic()
            window = c.watchdog_config.window_steps
            self._recent_spikes = [(s, t) for s, t in self._recent_spikes if s > self.step - window]
            self._recent_spikes.append((self.step, now))
            onset = self._recent_spikes[0][1]
            if not finite and self.watchdog:
                self._diverged(f"{verdict.reason} at step {self.step + 1}", onset=t0)
            if not finite and not self._parameters_finite():
                self._diverged(f"the model's parameters are no longer finite ({verdict.reason})", onset=now)
            if self.skipped_in_a_row >= c.max_consecutive_skips:
                self._diverged(
                    f"{self.skipped_in_a_row} steps in a row were skipped (last: {verdict.reason})", onset=onset
                )
            if self.watchdog and len(self._recent_spikes) >= c.watchdog_config.spikes:
                self._diverged(
                    f"{len(self._recent_spikes)} spikes within {window} steps (last: {verdict.reason})", onset=onset
                )
            return None
        self.skipped_in_a_row = 0
        self.optimizer.step()
        # ... and computing it (forward, backward, update), the wait for the other workers excluded.
        self._compute_s = time.monotonic() - t_data - self._waited_s
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
            if self._stragglers is not None:
                for slow in self._stragglers.observe(time.monotonic(), paces[:, 0], paces[:, 2], paces[:, 3]):
                    self._incident(
                        "straggler",
                        "warn",
                        ranks=[slow.rank],
                        detected_after_s=slow.window_s,
                        details={"reason": slow.reason(), **asdict(slow)},
                    )
        if tries:
            record["retried"] = True
        self._emit(record)
        if self._routing is not None:
            for warning in self._routing.observe(time.monotonic(), parts["routes"]):
                self._incident(
                    "routing",
                    "warn",
                    ranks=[self.workers.rank],
                    detected_after_s=warning.window_s,
                    details={"reason": warning.reason(), **asdict(warning)},
                )
        return record

    def _parameters_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

    def _diverged(self, why: str, *, onset: float | None = None) -> None:
        """A metrics record saying why; then the watchdog rolls back (:meth:`_roll_back`), or the run ends
        with one line for the user (exit 1). Nothing is saved, so the last checkpoint stays the last good
        state. A divergence incident records the decision, which the launcher reads (``divergence.py``)."""
        self._emit({"event": "diverged", "step": self.step, "attempt": self.attempt, "reason": why})
        if self._may_roll_back():
            raise _Divergence(why, time.monotonic() if onset is None else onset)
        detected, wc = round(time.monotonic() - (onset or time.monotonic()), 3), self.config.watchdog_config
        # Local SGD: this worker diverged on its own, and the others cannot roll back with it. Its attempt
        # ends; the launcher restarts the job from the last checkpoint, where this record has the lower
        # learning rate and the skipped data applied (:meth:`_reapply_rollbacks`).
        latest = self.run.latest() if self.watchdog else None
        stop = divergence.give_up_reason(
            watchdog=self.watchdog, latest=latest, rollbacks=self.rollbacks, budget=wc.max_rollbacks
        )
        if stop is not None or latest is None:
            self._give_up(why, stop or "", detected)
        self._incident(
            "divergence",
            "restart",
            anyone=True,
            ranks=[self.workers.rank],
            detected_after_s=detected,
            restored_step=int(latest["step"]),
            lost_steps=max(0, self.checkpoint_step() - int(latest["step"])),
            details={
                "reason": why,
                "lr_factor": wc.lr_factor,
                # From the checkpoint's position (known at the restart) to where this worker stopped.
                "skipped_window": [None, self.position.cursor * self.workers.world],
                "rollback": self.rollbacks + 1,
            },
        )
        raise TrainingDiverged(
            f"worker {self.workers.rank} diverged after step {self.step}: {why}",
            hint=f"the job restarts from step {latest['step']} with a lower learning rate (watchdog)",
        )

    def _give_up(self, reason: str, why: str, detected: float) -> NoReturn:
        """End the run (exit 1) with a give_up incident, from rank 0 for the job, or with local SGD from the
        worker that diverged alone."""
        alone = self.workers.distributed and not self._synchronous()
        self._incident(
            "divergence",
            "give_up",
            anyone=alone,
            ranks=[self.workers.rank] if alone else list(range(self.workers.world)),
            detected_after_s=detected,
            details={"reason": reason, "why": why},
        )
        raise TrainingDiverged(
            f"{f'worker {self.workers.rank}' if alone else 'training'} diverged after step {self.step}: {reason}; {why}",
            hint="start a new run with a lower --lr; the last checkpoint, if any, predates this step",
        )

    # -- the watchdog inside the workers ------------------------------------------------------------------
    def _may_roll_back(self) -> bool:
        """Every worker must take the decision at the same step: one worker, or synchronous steps."""
        return self.watchdog and (self.workers.world == 1 or self._synchronous())

    def _roll_back(self, div: _Divergence) -> None:
        """Back to the last checkpoint, with the learning rate times ``watchdog_config.lr_factor`` and the
        data since that checkpoint skipped (the window is recorded, so the run stays reproducible); the
        abandoned steps' records move from metrics.jsonl into the incident. Ends the run (exit 1, a give_up
        incident) when there is no checkpoint or the rollback budget is spent."""
        verdict_at = time.monotonic()
        wc = self.config.watchdog_config
        latest = self.run.latest()
        detected = round(verdict_at - div.onset, 3)
        stop = divergence.give_up_reason(
            watchdog=True, latest=latest, rollbacks=self.rollbacks, budget=wc.max_rollbacks
        )
        if stop is not None or latest is None:
            self._give_up(div.reason, stop or "", detected)
        diverged_at, cursor = self.step, self.position.cursor
        if self._metrics is not None:
            self._metrics.close()
        # As at a resume: the optimizer holds state only for what the checkpoint has (an expert that first got
        # tokens after it has none there).
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.state.clear()
        abandoned = self._load_state(latest)
        if self.metrics_path is not None:
            self._metrics = open(self.metrics_path, "a", encoding="utf-8")
        self.guard.lr_scale *= wc.lr_factor
        window = [self.position.cursor * self.workers.world, cursor * self.workers.world]
        self.position.cursor = max(self.position.cursor, cursor)
        self.rollbacks += 1
        self.skipped_in_a_row = 0
        self._recent_spikes = []
        self._evaluated_at = self._saved_at = self.step
        if self._routing is not None:
            self._routing.reset()
        self._incident(
            "divergence",
            "rollback",
            ranks=list(range(self.workers.world)),
            detected_after_s=detected,
            restored_step=self.step,
            lost_steps=diverged_at - self.step,
            recovery_s=round(time.monotonic() - verdict_at, 3),
            details={
                "reason": div.reason,
                "lr_factor": wc.lr_factor,
                "lr_scale": self.guard.lr_scale,
                # Positions in the run's batch order (BatchOrder) whose sequences are not trained on.
                "skipped_window": window,
                "rollback": self.rollbacks,
                "abandoned_records": abandoned,
            },
        )
        log.info(
            "diverged after step %d (%s): rolled back to step %d, learning rate x%g, data window %s skipped",
            diverged_at,
            div.reason,
            self.step,
            wc.lr_factor,
            window,
        )

    def _reapply_rollbacks(self) -> None:
        """A resume from the checkpoint a rollback went back to applies that rollback again (its lower learning
        rate and skipped data are not in the checkpoint, which predates it); later checkpoints hold them."""
        found = self.workers.broadcast(read_incidents(self.run.local) if self.workers.is_main else None) or []
        rollbacks = [r for r in found if r.get("kind") == "divergence" and r.get("action") in ("rollback", "restart")]
        self.rollbacks = len(rollbacks)
        for r in rollbacks:
            if r.get("restored_step") == self.checkpoint_step():
                d = r.get("details") or {}
                self.guard.lr_scale *= float(d.get("lr_factor", 1.0))
                self.position.cursor = max(self.position.cursor, int(d["skipped_window"][1]) // self.workers.world)

    def _incident(self, kind: str, action: str, *, anyone: bool = False, **fields: Any) -> None:
        """Rank 0 records for the job (``anyone``: this worker, for what only it knows): a line in
        incidents.jsonl, and a record for the live view."""
        if not (self.workers.is_main or anyone):
            return
        record = append_incident(
            self.run.local, Incident(kind=kind, action=action, attempt=self.workers.restarts, **fields)
        )
        if self.workers.is_main:
            self.run.publish([INCIDENTS])
        view = {k: v for k, v in record.items() if k != "details"}
        view["reason"] = record["details"].get("reason", "")
        self._emit({"event": "incident", **view}, metric=False)

    def _hang_drill(self) -> None:
        """Fault drill: rank R blocks for ever at step S inside a point-to-point receive that nobody sends;
        the others wait for it in the step's next collective (first attempt only)."""
        hang = parse_pair(self.config.simulate_hang, "simulate_hang")
        if hang is None or not self.workers.distributed:
            return
        rank, step = hang
        if self.workers.rank == rank and self.step + 1 == step:
            import torch.distributed as dist

            log.warning("fault drill: worker %d hangs at step %d", rank, step)
            dist.recv(torch.zeros(1), src=(rank + 1) % self.workers.world, tag=4242)

    def _collapse_drill(self) -> None:
        """Fault drill: the router of decoder layer L sends every token to the same top-k experts."""
        layer = self.config.simulate_routing_collapse
        if layer is None:
            return
        layers = list(self.model.model.layers)
        mlp = getattr(layers[layer], "mlp", None) if layer < len(layers) else None
        if not isinstance(mlp, SparseMoeBlock):
            raise UsageError(f"simulate_routing_collapse: layer {layer} is not an MoE layer of this model")
        gate = mlp.gate

        def collapse(module: torch.nn.Module, inputs: Any, out: Any) -> Any:
            k = out.topk_idx_TK.shape[-1]
            out.topk_idx_TK = torch.arange(k).expand_as(out.topk_idx_TK).contiguous()
            return out

        gate.register_forward_hook(collapse)

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
        began = time.monotonic()
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
        # save_s: the launcher's hang timeout must outlast the longest save (no collective runs during one).
        self._emit(
            {
                "event": "checkpoint",
                "step": self.checkpoint_step(),
                "tokens": self.tokens,
                "path": f"{self.run.describe()}/{rel}",
                "save_s": round(time.monotonic() - began, 3),
            }
        )
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
