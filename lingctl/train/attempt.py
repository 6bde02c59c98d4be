"""One attempt at a training step as the loop measures and records it: its batch and figures, this worker's
pace, and the step record an applied attempt becomes."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from lingctl.runs.records import Record
from lingctl.train import losses


@dataclass(kw_only=True, slots=True)
class Attempt:
    """One attempt, from its batch to its verdict."""

    rows: list[int]
    tries: int  # how often these rows were tried before
    began: float  # monotonic
    read: float  # when the batch was read
    n_tokens: int  # the batch's real tokens (fine-tuning's packed rows may end in padding)
    parts: dict[str, Any]  # losses.step_loss's parts
    loss: torch.Tensor  # what backward runs on (drills applied)
    lr: float
    alpha: float  # routing warmup
    loss_value: float = math.nan  # the loss the workers agree on
    paces: Any = None  # [world, 4] every worker's Pace.previous (synchronous workers)
    grad_norm: float = math.nan
    finite: bool = True  # the loss and gradient norm are finite numbers


@dataclass(slots=True)
class Pace:
    """This worker's own pace, for the per-worker throughput rank 0 reports: its last loop iteration's busy
    time (what it waited for the others in lingctl's agreement collectives excluded) and tokens, and of that
    time, reading the batch and computing the step."""

    waited_s: float = 0.0  # in this iteration's collectives so far
    data_s: float = 0.0  # this iteration's batch
    compute_s: float = 0.0  # this iteration's forward, backward and update
    previous: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])  # busy_s, tokens, data_s, compute_s

    def iteration_begins(self) -> None:
        self.waited_s = 0.0

    def iteration_ends(self, busy_s: float, tokens: int) -> None:
        self.previous = [busy_s - self.waited_s, float(tokens), self.data_s, self.compute_s]


def worker_rates(tokens: Any, seconds: Any) -> list[float]:
    """Tokens per second of each worker, from its own tokens and busy time (rank order)."""
    return [round(float(t) / max(float(s), 1e-9), 1) for t, s in zip(tokens, seconds)]


def step_record(a: Attempt, *, step: int, tokens: int, n_tokens: int, num_experts: int, spikes_skipped: int) -> Record:
    """The metrics record of an applied attempt (``n_tokens``: what it trained on, ``tokens``: the run's total)."""
    dt = time.monotonic() - a.began
    parts = a.parts
    return {
        "event": "step",
        "step": step,
        "loss": a.loss_value,
        "lm_loss": round(float(parts["lm_loss"].detach()), 6),
        "balance_loss": round(float(parts["balance_loss"].detach()), 6),
        "z_loss": round(float(parts["z_loss"].detach()), 6),
        "grad_norm": round(a.grad_norm, 6),
        "lr": a.lr,
        "batch_size": len(a.rows),
        "tokens": tokens,
        "tokens_per_s": round(n_tokens / max(dt, 1e-9), 1),
        "step_s": round(dt, 4),
        "routing_alpha": round(a.alpha, 4),
        "expert_load": losses.expert_load(parts["routes"], num_experts),
        "spikes_skipped": spikes_skipped,
        **({"task": {k: round(v, 6) for k, v in parts["extra"].items()}} if parts.get("extra") else {}),
    }


def spike_record(a: Attempt, reason: str, *, step: int, attempt: int, retry_at: int | None) -> Record:
    """The record of an attempt the spike guard skipped: retried at step ``retry_at``, or dropped (None)."""
    record: Record = {
        "event": "spike",
        "step": step,
        "attempt": attempt,
        "loss": a.loss_value,
        "grad_norm": None if math.isnan(a.grad_norm) else a.grad_norm,
        "reason": reason,
    }
    if retry_at is None:
        record["action"] = "dropped"
    else:
        record.update(action="skipped", retry_at_step=retry_at)
    return record
