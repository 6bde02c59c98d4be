"""Learning-rate, batch-size and routing-warmup schedules, pure functions of the optimizer step (so resuming
needs no state)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch


def learning_rate(step: int, *, peak: float, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warmup to ``peak`` over ``warmup_steps``, then cosine decay to ``min_ratio * peak`` at
    ``total_steps``. ``step`` counts from 0 (the first update uses step 0)."""
    if warmup_steps > 0 and step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / decay_steps))
    floor = peak * min_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def batch_size(step: int, *, target: int, start: int, warmup_steps: int) -> int:
    """Batch-size warmup: rises linearly from ``start`` sequences to ``target`` over ``warmup_steps``;
    small early batches make the first, noisiest updates cheap (Ling report, training stability)."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return target
    start = max(1, min(start, target))
    return max(1, min(target, round(start + (target - start) * step / warmup_steps)))


def routing_alpha(step: int, warmup_steps: int) -> float:
    """Weight of the learned router logits during stochastic routing warmup: 0 -> 1 linearly."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return 1.0
    return step / warmup_steps


def set_routing_warmup(routers: Iterable[Any], alpha: float, *, seed: int, attempt: int) -> None:
    """Route on ``alpha`` x learned + (1 - alpha) x noise; the noise of each router is keyed by (seed, attempt,
    layer), so it is identical after a resume with no generator state to save."""
    for i, router in enumerate(routers):
        router.warmup_alpha = alpha
        router.noise_generator = _generator((seed * 1_000_003 + attempt) * 1_009 + i) if alpha < 1.0 else None


def _generator(seed: int) -> Any:

    return torch.Generator().manual_seed(seed)
