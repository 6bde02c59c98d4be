"""The fine-tuning losses on packed batches: SFT (mean negative log-likelihood of the trained tokens) and
DPO (sigmoid loss on the policy's and the reference's log-probability ratios, plus an NLL term on the chosen
answers), each with the MoE balance loss and z-loss over the real tokens of the batch.

Both are defined as TRL defines them, so the numbers compare: SFT as ``SFTTrainer`` with completion-only loss
(the mean over every trained token of the batch), DPO as ``DPOTrainer``'s ``loss_type="sigmoid"``, with
``rpo_alpha`` as the NLL weight (Ling's robustness phase uses 0.05): the mean over pairs of
-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), pi and ref the summed log-probabilities of an answer's
trained tokens, plus the weight times the mean NLL of the chosen answers' trained tokens.

Shape legend: B rows, L tokens per row, T = B*L, N trained tokens, S blocks, P pairs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lingctl.train import losses
from lingctl.train.data import BatchOrder
from lingctl.train.post.batch import PackedBatch
from lingctl.train.post.logps import TokenLogps, block_sums, token_logps
from lingctl.train.post.packing import PackedRows, StagedOrder
from lingctl.train.post.reference import reference_logps
from lingctl.train.rundir import RunDir
from lingctl.train.workers import Workers


def sft_loss(t: TokenLogps) -> torch.Tensor:
    return -t.logp_N.mean()


@dataclass(slots=True)
class DpoTerms:
    loss: torch.Tensor  # the preference loss plus the NLL term
    figures: dict[str, float]


def dpo_loss(
    t: TokenLogps, batch: PackedBatch, reference_P2: torch.Tensor, *, beta: float, nll_weight: float
) -> DpoTerms:
    """``reference_P2``: the reference model's summed log-probabilities (chosen, rejected) of the batch's pairs,
    in the order of their chosen blocks."""
    sums_S = block_sums(t, batch.n_blocks)
    chosen = batch.block_side_S == 0
    pi_c, pi_r = sums_S[chosen], sums_S[~chosen]
    ref = reference_P2.to(sums_S.dtype)
    reward_c, reward_r = beta * (pi_c - ref[:, 0]), beta * (pi_r - ref[:, 1])
    preference = -F.logsigmoid(reward_c - reward_r).mean()
    chosen_N = chosen[t.block_N]
    nll = -t.logp_N[chosen_N].mean()
    loss = preference + nll_weight * nll if nll_weight else preference
    with torch.no_grad():
        figures = {
            "rewards_chosen": float(reward_c.mean()),
            "rewards_rejected": float(reward_r.mean()),
            "reward_margin": float((reward_c - reward_r).mean()),
            "reward_accuracy": float((reward_c > reward_r).float().mean()),
            "preference_loss": float(preference),
            "chosen_nll": float(nll),
        }
    return DpoTerms(loss, figures)


class Finetuning:
    """The trainer's objective for ``train sft`` and ``train dpo`` (``lingctl.train.objective``)."""

    def __init__(
        self,
        kind: str,
        train: PackedRows,
        eval_rows: PackedRows | None,
        *,
        num_experts: int,
        balance_coef: float,
        z_coef: float,
        bf16: bool,
        beta: float = 0.1,
        nll_weight: float = 0.0,
    ) -> None:
        self.kind = kind
        self.train, self.eval_rows = train, eval_rows
        self.num_experts, self.balance_coef, self.z_coef, self.bf16 = num_experts, balance_coef, z_coef, bf16
        self.beta, self.nll_weight = beta, nll_weight
        # Per item of each split, the reference's summed log-probabilities (chosen, rejected): DPO only.
        self.reference: dict[str, torch.Tensor] = {}

    @property
    def n_rows(self) -> int:
        return len(self.train)

    def start(self, model: torch.nn.Module, run: RunDir, workers: Workers, *, fingerprint: str, resume: bool) -> None:
        """Before the first step: a DPO run's reference log-probabilities, from the starting weights (a resume
        reads what the new run computed)."""
        if self.kind != "dpo":
            return
        splits = {"train": self.train, **({"eval": self.eval_rows} if self.eval_rows is not None else {})}
        self.reference = reference_logps(
            splits, model, run, workers, fingerprint=fingerprint, resume=resume, bf16=self.bf16
        )

    def order(self, seed: int) -> BatchOrder | StagedOrder:
        if len(self.train.stage_rows) > 1:
            return StagedOrder(self.train.stage_rows, seed)
        return BatchOrder(self.n_rows, seed)

    def batch(self, rows: list[int]) -> PackedBatch:
        return PackedBatch.of(self.train, rows)

    def n_tokens(self, batch: PackedBatch) -> int:
        return batch.n_tokens

    def loss(self, module: torch.nn.Module, batch: PackedBatch) -> dict[str, Any]:
        t = token_logps(module, batch, bf16=self.bf16)
        extra: dict[str, float] = {}
        if self.kind == "dpo":
            pairs = batch.block_item_S[batch.block_side_S == 0]
            terms = dpo_loss(t, batch, self.reference[batch.split][pairs], beta=self.beta, nll_weight=self.nll_weight)
            task, extra = terms.loss, terms.figures
        else:
            task = sft_loss(t)
        bal = losses.balance_loss(t.routes, self.num_experts)
        z = losses.z_loss(t.routes)
        loss = task + self.balance_coef * bal + self.z_coef * z
        return {"loss": loss, "lm_loss": task, "balance_loss": bal, "z_loss": z, "routes": t.routes, "extra": extra}

    def eval_batches(self, batch_size: int, batches: int) -> Iterator[tuple[PackedBatch, int]]:
        rows = self.eval_rows
        if rows is None or len(rows) == 0:
            return
        n = min(len(rows), batches * batch_size)
        for start in range(0, n, batch_size):
            idx = list(range(start, min(n, start + batch_size)))
            yield PackedBatch.of(rows, idx, "eval"), len(idx)
