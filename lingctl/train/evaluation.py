"""The eval loss: the task loss (``lm_loss``) on the held-out split, with the learned router (no warmup noise)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from lingctl.model.ling import LingForCausalLM

Forward = Callable[[Any], dict[str, Any]]  # a batch -> the objective's loss parts


@torch.no_grad()
def eval_loss(model: LingForCausalLM, batches: Iterable[tuple[Any, int]], forward: Forward) -> float | None:
    """The mean of ``lm_loss`` over ``batches`` (each with its weight: its rows), None when there are none; the
    model's training mode and routing warmup are left as they were."""
    was_training = model.training
    model.eval()
    saved = [r.warmup_alpha for r in model.routers()]
    for r in model.routers():
        r.warmup_alpha = 1.0  # eval measures the learned router, not the warmup noise
    total, count = 0.0, 0
    try:
        for batch, weight in batches:
            total += float(forward(batch)["lm_loss"]) * weight
            count += weight
    finally:
        for r, alpha in zip(model.routers(), saved):
            r.warmup_alpha = alpha
        model.train(was_training)
    return total / count if count else None
