"""What the workers do about a run that goes wrong: divergence (skipped steps that mean the run is lost), the
rollback or the end it leads to, the health warnings, and the incident records of all of these.

Divergence is a non-finite loss or gradient norm with rollbacks on, spikes that persist (``watchdog_config``),
``--max-consecutive-skips`` skipped steps in a row, a learning rate or parameters that are not finite. Then,
with rollbacks on (the ``watchdog`` setting) and every worker deciding at the same step (one worker, or
synchronous steps), the run goes back to its last checkpoint with a lower learning rate and the data since
skipped (the trainer reloads; :meth:`Recovery.begin_rollback` and :meth:`Recovery.end_rollback` decide and
record); a worker of local SGD that diverged alone ends its attempt for the launcher to restart the job with
the rollback applied; otherwise the run ends (exit 1). See ``supervise/divergence.py`` for the launcher's side.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, NoReturn

from lingctl.core.errors import LingctlError
from lingctl.model.ling import LingForCausalLM
from lingctl.model.moe import SparseMoeBlock
from lingctl.runs import incidents
from lingctl.runs.incidents import Incident
from lingctl.runs.layout import INCIDENTS
from lingctl.runs.records import Record
from lingctl.runs.train_config import TrainConfig
from lingctl.train.rundir import RunDir
from lingctl.train.supervise import divergence
from lingctl.train.supervise.health import RoutingHealth, StragglerWatch
from lingctl.train.workers import Workers

log = logging.getLogger(__name__)


class TrainingDiverged(LingctlError):
    """The run stopped because it could not go on usefully: every recent step was skipped, or a value the
    update needs is not a finite number. Nothing is saved after the last good checkpoint."""


class Divergence(Exception):
    """Raised inside the loop when the run rolls back instead of ending."""

    def __init__(self, reason: str, onset: float) -> None:
        super().__init__(reason)
        self.reason = reason
        self.onset = onset  # monotonic time of the first bad step


@dataclass(frozen=True, slots=True)
class At:
    """Where the loop is when something goes wrong."""

    step: int  # optimizer steps applied
    attempt: int
    checkpoint_step: int  # the step a checkpoint taken now would be named after
    cursor: int  # this worker's position in its stride of the batch order


@dataclass(kw_only=True, slots=True)
class Rollback:
    """A rollback decided, before the trainer reloads the checkpoint."""

    latest: dict[str, Any]  # the checkpoint to go back to (latest.json's record)
    reason: str
    diverged_at: int  # the step the run had reached
    cursor: int  # this worker's data position when it diverged: the data up to it is skipped
    detected_after_s: float
    decided: float = field(default_factory=time.monotonic)


class Recovery:
    def __init__(
        self,
        config: TrainConfig,
        run: RunDir,
        workers: Workers,
        *,
        emit: Callable[..., None],
        synchronous: Callable[[], bool],
    ) -> None:
        """``emit(record, metric=...)``: the trainer's records; ``synchronous()``: whether the workers take the
        current step together (and so decide together)."""
        self.config = config
        self.health = config.watchdog_config
        self.run = run
        self.workers = workers
        self._emit = emit
        self._synchronous = synchronous
        # Rollbacks (None: on with several workers). Only where every worker takes the same decision at the same
        # step (one worker, or synchronous steps); local SGD leaves it to the launcher's restart.
        self.enabled = config.watchdog if config.watchdog is not None else workers.world > 1
        self.rollbacks = 0
        self.skipped_in_a_row = 0  # attempts since the last applied step
        self._recent_spikes: list[tuple[int, float]] = []  # (step, monotonic time) of skipped spikes
        self._routing: RoutingHealth | None = None
        self._stragglers: StragglerWatch | None = None

    # -- start of a run ---------------------------------------------------------------------------------
    def start(self, model: LingForCausalLM, *, abandoned: list[Record]) -> None:
        """Rank 0 lists the incident files as the run's, keeps the step records a restart abandoned
        (``abandoned``) and watches the routing of the MoE layers and, with several workers, their pace."""
        if not self.workers.is_main:
            return
        self.run.claim_incident_files()
        if abandoned and self.workers.restarts > 0:
            self._keep_abandoned(abandoned)
        moe_layers = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
        self._routing = RoutingHealth(self.health, moe_layers, model.config.num_experts)
        if self.workers.world > 1:
            self._stragglers = StragglerWatch(self.health, self.workers.world)

    def reapply(self, checkpoint_step: int) -> tuple[float, int]:
        """A resume from the checkpoint a rollback went back to applies that rollback again (its lower learning
        rate and skipped data are not in the checkpoint, which predates it); later checkpoints hold them.
        Returns (the factor on the learning rate, the data position this worker goes on from at least)."""
        w = self.workers
        found = w.broadcast(incidents.read(self.run.local) if w.is_main else None) or []
        rollbacks = [r for r in found if r.get("kind") == "divergence" and r.get("action") in ("rollback", "restart")]
        self.rollbacks = len(rollbacks)
        factor, cursor = 1.0, 0
        for r in rollbacks:
            if r.get("restored_step") == checkpoint_step:
                d = r.get("details") or {}
                factor *= float(d.get("lr_factor", 1.0))
                cursor = max(cursor, int(d["skipped_window"][1]) // w.world)
        return factor, cursor

    # -- each attempt -----------------------------------------------------------------------------------
    def applied(self) -> None:
        self.skipped_in_a_row = 0

    def skipped(
        self, reason: str, at: At, *, finite: bool, began: float, parameters_finite: Callable[[], bool]
    ) -> None:
        """A skipped attempt (``began``: when it started): raises when it means the run diverged."""
        self.skipped_in_a_row += 1
        now = time.monotonic()
        window = self.health.window_steps
        self._recent_spikes = [(s, t) for s, t in self._recent_spikes if s > at.step - window]
        self._recent_spikes.append((at.step, now))
        onset = self._recent_spikes[0][1]
        if not finite and self.enabled:
            self.diverged(f"{reason} at step {at.step + 1}", at, onset=began)
        if not finite and not parameters_finite():
            self.diverged(f"the model's parameters are no longer finite ({reason})", at, onset=now)
        if self.skipped_in_a_row >= self.config.max_consecutive_skips:
            self.diverged(f"{self.skipped_in_a_row} steps in a row were skipped (last: {reason})", at, onset=onset)
        if self.enabled and len(self._recent_spikes) >= self.health.spikes:
            self.diverged(f"{len(self._recent_spikes)} spikes within {window} steps (last: {reason})", at, onset=onset)

    def diverged(self, why: str, at: At, *, onset: float | None = None) -> NoReturn:
        """A metrics record saying why; then a rollback (``Divergence``, which the loop catches), or the end of
        the attempt or of the run with one line for the user (exit 1). Nothing is saved, so the last checkpoint
        stays the last good state. A divergence incident records the decision, which the launcher reads."""
        self._emit({"event": "diverged", "step": at.step, "attempt": at.attempt, "reason": why})
        if self.enabled and (self.workers.world == 1 or self._synchronous()):
            raise Divergence(why, time.monotonic() if onset is None else onset)
        detected = round(time.monotonic() - (onset or time.monotonic()), 3)
        # Local SGD: this worker diverged on its own, and the others cannot roll back with it. Its attempt
        # ends; the launcher restarts the job from the last checkpoint, where this record has the lower
        # learning rate and the skipped data applied (:meth:`reapply`).
        latest = self._latest_or_give_up(why, at, detected)
        self.incident(
            "divergence",
            "restart",
            anyone=True,
            ranks=[self.workers.rank],
            detected_after_s=detected,
            restored_step=int(latest["step"]),
            lost_steps=max(0, at.checkpoint_step - int(latest["step"])),
            details={
                "reason": why,
                "lr_factor": self.health.lr_factor,
                # From the checkpoint's position (known at the restart) to where this worker stopped.
                "skipped_window": [None, at.cursor * self.workers.world],
                "rollback": self.rollbacks + 1,
            },
        )
        raise TrainingDiverged(
            f"worker {self.workers.rank} diverged after step {at.step}: {why}",
            hint=f"the job restarts from step {latest['step']} with a lower learning rate (watchdog)",
        )

    def begin_rollback(self, div: Divergence, at: At) -> Rollback:
        """The rollback the loop is to make; ends the run (exit 1, a give_up incident) when there is no
        checkpoint or the rollback budget is spent."""
        detected = round(time.monotonic() - div.onset, 3)
        latest = self._latest_or_give_up(div.reason, at, detected)
        return Rollback(
            latest=latest, reason=div.reason, diverged_at=at.step, cursor=at.cursor, detected_after_s=detected
        )

    def end_rollback(
        self, rb: Rollback, *, restored_step: int, lr_scale: float, window: list[int], abandoned: list[Record]
    ) -> None:
        """The checkpoint is back (at ``restored_step``, with the learning rate scale now ``lr_scale`` and the
        data ``window`` skipped): the incident, with the abandoned steps' records."""
        self.rollbacks += 1
        self.skipped_in_a_row = 0
        self._recent_spikes = []
        if self._routing is not None:
            self._routing.reset()
        self.incident(
            "divergence",
            "rollback",
            ranks=list(range(self.workers.world)),
            detected_after_s=rb.detected_after_s,
            restored_step=restored_step,
            lost_steps=rb.diverged_at - restored_step,
            recovery_s=round(time.monotonic() - rb.decided, 3),
            details={
                "reason": rb.reason,
                "lr_factor": self.health.lr_factor,
                "lr_scale": lr_scale,
                # Positions in the run's batch order (BatchOrder) whose sequences are not trained on.
                "skipped_window": window,
                "rollback": self.rollbacks,
                "abandoned_records": abandoned,
            },
        )
        log.info(
            "diverged after step %d (%s): rolled back to step %d, learning rate x%g, data window %s skipped",
            rb.diverged_at,
            rb.reason,
            restored_step,
            self.health.lr_factor,
            window,
        )

    def _latest_or_give_up(self, reason: str, at: At, detected: float) -> dict[str, Any]:
        """The checkpoint to go back to; ends the run when there is none or the rollback budget is spent."""
        latest = self.run.latest() if self.enabled else None
        stop = divergence.give_up_reason(
            watchdog=self.enabled, latest=latest, rollbacks=self.rollbacks, budget=self.health.max_rollbacks
        )
        if stop is not None or latest is None:
            self._give_up(reason, stop or "", at, detected)
        return latest

    def _give_up(self, reason: str, why: str, at: At, detected: float) -> NoReturn:
        """End the run (exit 1) with a give_up incident, from rank 0 for the job, or with local SGD from the
        worker that diverged alone."""
        w = self.workers
        alone = w.distributed and not self._synchronous()
        self.incident(
            "divergence",
            "give_up",
            anyone=alone,
            ranks=[w.rank] if alone else list(range(w.world)),
            detected_after_s=detected,
            details={"reason": reason, "why": why},
        )
        raise TrainingDiverged(
            f"{f'worker {w.rank}' if alone else 'training'} diverged after step {at.step}: {reason}; {why}",
            hint="start a new run with a lower --lr; the last checkpoint, if any, predates this step",
        )

    # -- health ---------------------------------------------------------------------------------------
    def observe_routing(self, routes: list[Any]) -> None:
        """One applied step's routing decisions; a routing incident for each layer that turns unhealthy."""
        if self._routing is None:
            return
        for warning in self._routing.observe(time.monotonic(), routes):
            self.incident(
                "routing",
                "warn",
                ranks=[self.workers.rank],
                detected_after_s=warning.window_s,
                details={"reason": warning.reason(), **asdict(warning)},
            )

    def observe_paces(self, paces: Any) -> None:
        """Every worker's busy time, data and compute time in its last step ([world, 4]: busy, tokens, data,
        compute); a straggler incident for each worker that turns slow."""
        if self._stragglers is None:
            return
        for slow in self._stragglers.observe(time.monotonic(), paces[:, 0], paces[:, 2], paces[:, 3]):
            self.incident(
                "straggler",
                "warn",
                ranks=[slow.rank],
                detected_after_s=slow.window_s,
                details={"reason": slow.reason(), **asdict(slow)},
            )

    # -- records --------------------------------------------------------------------------------------
    def incident(self, kind: str, action: str, *, anyone: bool = False, **fields: Any) -> None:
        """Rank 0 records for the job (``anyone``: this worker, for what only it knows): a line in
        incidents.jsonl, and a record for the live view."""
        w = self.workers
        if not (w.is_main or anyone):
            return
        record = incidents.append(self.run.local, Incident(kind=kind, action=action, attempt=w.restarts, **fields))
        if w.is_main:
            self.run.publish([INCIDENTS])
        view = {k: v for k, v in record.items() if k != "details"}
        view["reason"] = record["details"].get("reason", "")
        self._emit({"event": "incident", **view}, metric=False)

    def publish(self) -> None:
        """To the store of an s3:// run: incidents.jsonl and the files under incidents/ (the launcher writes
        the hang verdicts into the local staging directory); a no-op for local runs."""
        self.run.publish(incidents.files(self.run.local))

    def _keep_abandoned(self, records: list[Record]) -> None:
        """A restarted attempt's metrics lose the steps taken after the checkpoint; they go beside the
        incident the launcher records (``incidents/attempt-K-abandoned.jsonl``, K the attempt that ended)."""
        stem = incidents.ABANDONED.format(attempt=self.workers.restarts - 1)
        data = "".join(json.dumps(r) + "\n" for r in records).encode()
        incidents.write_file(self.run.local, stem, ".jsonl", data)
