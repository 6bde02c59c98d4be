"""What a run trains on and the loss it takes: the trainer's loop is the same for pre-training and for
fine-tuning (``post/objective.py``), which differ only in their rows, batches, loss and eval.

An objective turns row indices (from its batch order) into a batch, a batch into the step's loss parts
(``loss``, ``lm_loss``, ``balance_loss``, ``z_loss``, ``routes`` and, for fine-tuning, ``extra`` figures for
the step record), and yields the eval batches.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lingctl.model.ling import LingForCausalLM
from lingctl.runs.train_config import TrainConfig
from lingctl.train import losses
from lingctl.train.data import BatchOrder, Order, TokenData, batch_tensors
from lingctl.train.dataset import PreparedData
from lingctl.train.post.dataset import PostData
from lingctl.train.post.objective import Finetuning
from lingctl.train.rundir import RunDir
from lingctl.train.workers import Workers


class Objective(Protocol):
    kind: str  # "pretrain", "sft", "dpo"

    @property
    def n_rows(self) -> int: ...

    def order(self, seed: int) -> Order: ...

    def start(self, model: torch.nn.Module, run: RunDir, workers: Workers, *, fingerprint: str, resume: bool) -> None:
        """Before the first step of this process (a DPO run's reference)."""

    def batch(self, rows: list[int]) -> Any: ...

    def n_tokens(self, batch: Any) -> int: ...

    def loss(self, module: torch.nn.Module, batch: Any) -> dict[str, Any]: ...

    def eval_batches(self, batch_size: int, batches: int) -> Iterator[tuple[Any, int]]: ...


@dataclass(slots=True)
class LmBatch:
    inputs: torch.Tensor  # [B, seq_len]
    targets: torch.Tensor


class LanguageModeling:
    """Pre-training: rows of ``seq_len + 1`` tokens, next-token loss on every position."""

    kind = "pretrain"

    def __init__(self, tokens: TokenData, *, num_experts: int, balance_coef: float, z_coef: float, bf16: bool):
        self.data = tokens
        self._loss = functools.partial(
            losses.step_loss, num_experts=num_experts, balance_coef=balance_coef, z_coef=z_coef, bf16=bf16
        )

    @property
    def n_rows(self) -> int:
        return len(self.data.train)

    def order(self, seed: int) -> BatchOrder:
        return BatchOrder(self.n_rows, seed)

    def start(self, model: torch.nn.Module, run: RunDir, workers: Workers, *, fingerprint: str, resume: bool) -> None:
        pass

    def batch(self, rows: list[int]) -> LmBatch:
        return LmBatch(*batch_tensors(self.data.train, rows))

    def n_tokens(self, batch: LmBatch) -> int:
        return batch.inputs.numel()

    def loss(self, module: torch.nn.Module, batch: LmBatch) -> dict[str, Any]:
        return self._loss(module, batch.inputs, batch.targets)

    def eval_batches(self, batch_size: int, batches: int) -> Iterator[tuple[LmBatch, int]]:
        data = self.data.eval
        n = min(len(data), batches * batch_size)
        for start in range(0, n, batch_size):
            rows = list(range(start, min(n, start + batch_size)))
            yield LmBatch(*batch_tensors(data, rows)), len(rows)


def objective_for(config: TrainConfig, data: PreparedData | PostData, model: LingForCausalLM) -> Objective:
    """The run's objective: pre-training on token rows, or fine-tuning on packed examples."""
    c = config
    e, bal, z, bf16 = model.config.num_experts, c.moe.balance_coef, c.moe.z_coef, c.dtype == "bfloat16"
    if isinstance(data, PostData):
        post = c.post
        return Finetuning(
            c.task, data.train, data.eval, num_experts=e, balance_coef=bal, z_coef=z, bf16=bf16, beta=post.beta,
            nll_weight=post.nll_weight,
        )  # fmt: skip
    return LanguageModeling(data.tokens, num_experts=e, balance_coef=bal, z_coef=z, bf16=bf16)
