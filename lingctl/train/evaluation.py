"""The eval loss: the language-model loss on the held-out split, with the learned router (no warmup noise)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lingctl.model.ling import LingForCausalLM
from lingctl.train.data import batch_tensors

Forward = Callable[[torch.Tensor, torch.Tensor], dict[str, Any]]  # (inputs, targets) -> losses.step_loss's parts


@torch.no_grad()
def eval_loss(model: LingForCausalLM, data: np.ndarray, forward: Forward, *, batch_size: int, batches: int) -> float:
    """The mean LM loss over the first ``batches`` batches of ``data`` (eval rows); the model's training mode
    and routing warmup are left as they were."""
    n = min(len(data), batches * batch_size)
    was_training = model.training
    model.eval()
    saved = [r.warmup_alpha for r in model.routers()]
    for r in model.routers():
        r.warmup_alpha = 1.0  # eval measures the learned router, not the warmup noise
    total, count = 0.0, 0
    for start in range(0, n, batch_size):
        rows = list(range(start, min(n, start + batch_size)))
        inputs, targets = batch_tensors(data, rows)
        total += float(forward(inputs, targets)["lm_loss"]) * len(rows)
        count += len(rows)
    for r, alpha in zip(model.routers(), saved):
        r.warmup_alpha = alpha
    model.train(was_training)
    return total / count
