"""Fault drills: faults a run inflicts on itself on purpose, to show that what should handle them does (the
spike guard, the divergence rollback, the launcher's hang detection and restarts, the health warnings).

Each drill is a setting of the run (``--simulate-*``, ``inject_spikes``, ``crash_at_step``: see
``lingctl.runs.train_config``); this module is the one place that acts on them, at the points of a step where
the training loop calls a hook:

==================  ===================================  ============  ==========================================
drill               settings                             hook          what happens
==================  ===================================  ============  ==========================================
routing collapse    simulate_routing_collapse L          on_model      layer L's router sends every token to the
                                                                       same top-k experts
hang                simulate_hang R:S                    before_step   rank R blocks for ever at step S in a
                                                                       receive that nobody sends
injected spikes     inject_spikes, inject_spike_factor   on_loss       the loss of those attempts x the factor
bad rank (ddp)      simulate_bad_rank R                  on_loss       worker R's loss, so its gradient, x100
bad rank (edit)     simulate_bad_rank R                  update_scale  worker R's pseudo-gradient x100
NaN                 simulate_nan S                       on_loss       the loss of step S is NaN (on rank 0, once)
spikes              simulate_spikes S:N                  on_verdict    the guard sees N spikes in a row from S
crash               crash_at_step S, crash_rank R        after_step    worker R kills itself (SIGKILL) after S
slow rank           simulate_slow_rank R, slowdown F     after_step    worker R sleeps (F - 1) x its step time
==================  ===================================  ============  ==========================================

Steps are counted as the loop counts them (``step`` is the number of steps applied before this attempt). The
drills of the first attempt only (hang, NaN, spikes, crash, collapse) are dropped from the settings by a
restart or a resume (``train.run``), so a recovery does not meet them again.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lingctl.core.errors import UsageError
from lingctl.model.moe import SparseMoeBlock
from lingctl.runs.records import Record
from lingctl.runs.train_config import TrainConfig, parse_pair
from lingctl.train.spike import Verdict
from lingctl.train.workers import Workers

log = logging.getLogger(__name__)

BAD_RANK_SCALE = 100.0  # how corrupted the bad rank's update is


@dataclass(frozen=True, slots=True)
class DrillPlan:
    """The drills as they concern this worker, read from the settings once."""

    collapse_layer: int | None = None
    hang_at_step: int | None = None  # this worker blocks at this step (several workers only)
    spike_attempts: frozenset[int] = frozenset()
    spike_factor: float = 1.0
    loss_scale: float = 1.0  # ddp: this worker's loss (and so its gradient) is scaled
    update_scale: float = 1.0  # local SGD: this worker's pseudo-gradient is scaled
    nan_at_step: int | None = None
    spikes: tuple[int, int] | None = None  # (first step, how many)
    crash_after_step: int | None = None
    slowdown: float = 1.0  # this worker's

    @classmethod
    def for_worker(cls, c: TrainConfig, workers: Workers) -> DrillPlan:
        hang = parse_pair(c.simulate_hang, "simulate_hang")
        bad = workers.rank == c.simulate_bad_rank
        return cls(
            collapse_layer=c.simulate_routing_collapse,
            hang_at_step=hang[1] if hang and workers.distributed and workers.rank == hang[0] else None,
            spike_attempts=frozenset(c.inject_spikes),
            spike_factor=c.inject_spike_factor,
            loss_scale=BAD_RANK_SCALE if bad and c.sync == "ddp" else 1.0,
            update_scale=BAD_RANK_SCALE if bad else 1.0,
            nan_at_step=c.simulate_nan if workers.rank == 0 else None,
            spikes=parse_pair(c.simulate_spikes, "simulate_spikes"),
            crash_after_step=c.crash_at_step if workers.rank == c.crash_rank else None,
            slowdown=c.slowdown if workers.rank == c.simulate_slow_rank else 1.0,
        )


class Drills:
    """The hooks the training loop calls; each does nothing unless its drill is set for this worker."""

    def __init__(self, plan: DrillPlan, workers: Workers) -> None:
        self.plan = plan
        self.workers = workers
        self._nan_fired = False
        self._spikes_seen = 0

    @property
    def update_scale(self) -> float:
        return self.plan.update_scale

    def on_model(self, model: Any) -> None:
        """Once the model is built (``LingForCausalLM``)."""
        if self.plan.collapse_layer is not None:
            _collapse_routing(model, self.plan.collapse_layer)

    def before_step(self, step: int) -> None:
        """Before the attempt at step ``step + 1``."""
        if self.plan.hang_at_step == step + 1:
            self._hang_drill(step + 1)

    def on_loss(self, loss: torch.Tensor, *, step: int, attempt: int) -> torch.Tensor:
        """The loss the step goes on with."""
        p = self.plan
        if attempt in p.spike_attempts:
            loss = loss * p.spike_factor
        if p.loss_scale != 1.0:
            loss = loss * p.loss_scale
        if p.nan_at_step == step + 1 and not self._nan_fired:
            self._nan_fired = True  # once: the step after the rollback trains normally
            loss = loss * float("nan")
        return loss

    def on_verdict(self, verdict: Verdict, *, step: int) -> Verdict:
        """The spike guard's verdict on the loss, as the step takes it."""
        spikes = self.plan.spikes
        if spikes is None or step + 1 < spikes[0] or verdict.spike or self._spikes_seen >= spikes[1]:
            return verdict
        self._spikes_seen += 1  # the guard sees a spike, whatever the loss
        return Verdict(True, f"fault drill spike {self._spikes_seen}/{spikes[1]}")

    def after_step(self, record: Record, *, step: int, flush: Callable[[], None]) -> None:
        """After step ``step`` was applied (``record``: its metrics record); ``flush`` writes out the metrics."""
        if self.plan.crash_after_step == step:
            flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if self.plan.slowdown > 1:
            time.sleep(record["step_s"] * (self.plan.slowdown - 1))

    def _hang_drill(self, step: int) -> None:
        """Block for ever inside a point-to-point receive that nobody sends; the other workers wait for this
        one in the step's next collective."""
        import torch.distributed as dist

        rank, world = self.workers.rank, self.workers.world
        log.warning("fault drill: worker %d hangs at step %d", rank, step)
        dist.recv(torch.zeros(1), src=(rank + 1) % world, tag=4242)


def _collapse_routing(model: Any, layer: int) -> None:
    """The router of decoder layer ``layer`` sends every token to the same top-k experts."""
    layers = list(model.model.layers)
    mlp = getattr(layers[layer], "mlp", None) if layer < len(layers) else None
    if not isinstance(mlp, SparseMoeBlock):
        raise UsageError(f"simulate_routing_collapse: layer {layer} is not an MoE layer of this model")

    def collapse(module: torch.nn.Module, inputs: Any, out: Any) -> Any:
        k = out.topk_idx_TK.shape[-1]
        out.topk_idx_TK = torch.arange(k).expand_as(out.topk_idx_TK).contiguous()
        return out

    mlp.gate.register_forward_hook(collapse)
