"""MoE auxiliary losses and expert-load statistics, from the routers' outputs of one forward pass.

Both losses are averaged over the MoE layers, so their size does not grow with depth and the balance loss
equals its coefficient exactly when routing is uniform.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lingctl.model.moe import RouterOutput


def step_loss(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    num_experts: int,
    balance_coef: float,
    z_coef: float,
    bf16: bool = False,
    logits_dtype: torch.dtype = torch.float32,
    batch_balance: bool = False,
) -> dict[str, Any]:
    """The loss of one training step: the forward (under bf16 autocast when asked), cross-entropy on logits in
    ``logits_dtype``, plus the balance loss and the z-loss with their coefficients. The trainer and
    ``train align`` both compute it here, so an alignment checks the loss that training uses."""
    with torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=bf16):
        out = model(inputs)
        logits = out.logits.to(logits_dtype)
    lm = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
    bal = balance_loss(out.routes, num_experts, batch=batch_balance)
    z = z_loss(out.routes)
    loss = lm + balance_coef * bal + z_coef * z
    return {"loss": loss, "lm_loss": lm, "balance_loss": bal, "z_loss": z, "routes": out.routes}


def balance_loss(routes: list[RouterOutput], num_experts: int, *, batch: bool = False) -> torch.Tensor:
    """Switch-style load balance: E * sum_i f_i * P_i per layer, f_i the fraction of the T*k routed slots
    sent to expert i (not differentiable), P_i the mean router probability of expert i. Under uniform routing
    f_i = P_i = 1/E, so the value is 1 and the weighted loss equals its coefficient.

    Each worker counts f_i over its own tokens, as training does. ``batch``: count it over every worker's
    tokens (an all_reduce of the counts, which carry no gradient), so that with equal shards the workers'
    mean is the loss of the whole batch in one process."""
    if not routes:
        return torch.zeros(())
    per_layer = []
    for r in routes:
        idx = r.topk_idx_TK.reshape(-1)
        counts = torch.bincount(idx, minlength=num_experts).to(torch.float32)
        slots = idx.numel()
        if batch:
            import torch.distributed as dist

            dist.all_reduce(counts)
            slots *= dist.get_world_size()
        f_E = counts / slots
        p_E = r.probs_TE.mean(dim=0)
        per_layer.append(num_experts * (f_E.detach() * p_E).sum())
    return torch.stack(per_layer).mean()


def z_loss(routes: list[RouterOutput]) -> torch.Tensor:
    """Router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2, on the learned float32 logits;
    it keeps router logits small so the fp32 softmax stays well conditioned."""
    if not routes:
        return torch.zeros(())
    return torch.stack([torch.logsumexp(r.logits_TE, dim=-1).pow(2).mean() for r in routes]).mean()


def expert_load(routes: list[RouterOutput], num_experts: int) -> list[dict[str, float]]:
    """Per MoE layer: the busiest and idlest expert's load relative to the mean (1.0 = perfectly even),
    and the coefficient of variation of the per-expert token counts."""
    stats = []
    for r in routes:
        counts = torch.bincount(r.topk_idx_TK.reshape(-1), minlength=num_experts).to(torch.float64)
        mean = counts.mean()
        stats.append(
            {
                "max": round(float(counts.max() / mean), 4),
                "min": round(float(counts.min() / mean), 4),
                "cv": round(float(counts.std(unbiased=False) / mean), 4),
            }
        )
    return stats
