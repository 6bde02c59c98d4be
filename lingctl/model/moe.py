"""Ling's MoE layer: softmax top-k router, fine-grained routed experts, one always-on shared expert.

Routing is dropless (every token reaches all k of its experts, no capacity factor). Three interchangeable
dispatch strategies compute the same function:

- ``naive``: Ling's own training loop, a boolean mask per expert over the (token x k) copies;
- ``sorted``: sort the (token, slot) pairs by expert once, one gather, one matmul chain per expert on a
  contiguous slice, one weighted scatter-add back (the default);
- ``grouped``: the sorted layout fed to ``torch._grouped_mm`` (one kernel for all experts).

Shape legend: T tokens, D hidden, E experts, K experts per token, N = T*K routed slots, I expert width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from lingctl.model.config import LingConfig
from lingctl.model.layers import MLP

Dispatch = Literal["naive", "sorted", "grouped"]
DISPATCHES: tuple[str, ...] = ("naive", "sorted", "grouped")


@dataclass(slots=True)
class RouterOutput:
    """What a router decided for T tokens; the training losses and expert-load metrics read it."""

    topk_idx_TK: torch.Tensor
    topk_weight_TK: torch.Tensor  # float32
    logits_TE: torch.Tensor  # the learned logits, float32 (z-loss is on these)
    probs_TE: torch.Tensor  # softmax of the logits actually routed on (blended during routing warmup)


class Router(nn.Module):
    """``mlp.gate``: logits = x W^T (W is [E, D], no bias), softmax in float32, top-k, and renormalisation of
    the k weights when ``norm_topk_prob`` and k > 1.

    Stochastic routing warmup (Ling report, training stability): while ``warmup_alpha`` < 1 the logits routed
    on are ``a * learned + (1 - a) * noise``, the noise drawn with the running mean/std of the learned
    logits so it has their scale; the trainer raises ``a`` linearly from 0 to 1. The running statistics
    live outside the state dict (Ling checkpoints have no such tensors); the trainer saves them itself.
    """

    def __init__(self, config: LingConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        nn.init.normal_(self.weight, std=config.initializer_range)
        self.warmup_alpha = 1.0
        self.noise_generator: torch.Generator | None = None
        self.logit_mean: float | None = None
        self.logit_std: float | None = None
        self.stats_momentum = 0.9

    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        logits = F.linear(x_TD, self.weight).to(torch.float32)
        routed = logits
        if self.warmup_alpha < 1.0:
            routed = self._blend(logits)
        probs = routed.softmax(dim=-1)
        weight, idx = torch.topk(probs, k=self.top_k, dim=-1, sorted=False)
        if self.top_k > 1 and self.norm_topk_prob:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        return RouterOutput(idx, weight, logits, probs)

    def _blend(self, logits_TE: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            mean, std = logits_TE.mean().item(), logits_TE.std().item() if logits_TE.numel() > 1 else 0.0
            if self.training:
                m = self.stats_momentum
                self.logit_mean = mean if self.logit_mean is None else m * self.logit_mean + (1 - m) * mean
                self.logit_std = std if self.logit_std is None else m * self.logit_std + (1 - m) * std
            mean = self.logit_mean if self.logit_mean is not None else mean
            std = self.logit_std if self.logit_std is not None else std
            noise = torch.randn(logits_TE.shape, generator=self.noise_generator, dtype=torch.float32)
            noise = noise.to(logits_TE.device) * std + mean
        a = self.warmup_alpha
        return a * logits_TE + (1.0 - a) * noise


def dispatch_naive(
    x_TD: torch.Tensor, idx_TK: torch.Tensor, weight_TK: torch.Tensor, experts: nn.ModuleList
) -> torch.Tensor:
    """Ling's reference training path: each token copied k times, one boolean mask per expert."""
    t, k = idx_TK.shape
    x_ND = x_TD.repeat_interleave(k, dim=0)
    flat_N = idx_TK.reshape(-1)
    y_ND: torch.Tensor | None = None
    for e, expert in enumerate(experts):
        mask = flat_N == e
        if not bool(mask.any()):
            continue
        out = expert(x_ND[mask])
        if y_ND is None:
            y_ND = out.new_zeros(x_ND.shape[0], out.shape[-1])
        y_ND[mask] = out
    assert y_ND is not None
    return (y_ND.view(t, k, -1) * weight_TK.unsqueeze(-1)).sum(dim=1).to(x_TD.dtype)


def _sort_by_expert(idx_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    flat_N = idx_TK.reshape(-1)
    order_N = flat_N.argsort(stable=True)
    counts = torch.bincount(flat_N, minlength=num_experts)
    return order_N, counts, counts.tolist()


def _combine(
    ys_ND: torch.Tensor, order_N: torch.Tensor, weight_TK: torch.Tensor, t: int, k: int, dtype: torch.dtype
) -> torch.Tensor:
    # The k weighted expert outputs of a token are summed in float32, as Ling's reference does.
    w_N = weight_TK.reshape(-1)[order_N].unsqueeze(-1)
    y_TD = torch.zeros(t, ys_ND.shape[-1], dtype=torch.float32, device=ys_ND.device)
    return y_TD.index_add_(0, order_N // k, ys_ND.to(torch.float32) * w_N).to(dtype)


def dispatch_sorted(
    x_TD: torch.Tensor, idx_TK: torch.Tensor, weight_TK: torch.Tensor, experts: nn.ModuleList, *, min_rows: int = 1
) -> torch.Tensor:
    """One gather into expert order, one SwiGLU per expert on a contiguous slice, one scatter-add.

    ``min_rows`` pads each expert's slice with zero rows up to that many. CPU BLAS computes a 1-row product
    (gemv) and products of a few rows with other kernels than larger ones, so a token's expert output would
    otherwise depend on how many other tokens picked the same expert; inference pads to make each token's
    result independent of its batch (see flood's forward pass)."""
    t, k = idx_TK.shape
    order_N, _, counts = _sort_by_expert(idx_TK, len(experts))
    xs_ND = x_TD[order_N // k]
    outs = []
    for expert, chunk, n in zip(experts, xs_ND.split(counts), counts):
        if not n:
            continue
        if n < min_rows:
            chunk = torch.cat([chunk, chunk.new_zeros(min_rows - n, chunk.shape[1])])
            outs.append(expert(chunk)[:n])
        else:
            outs.append(expert(chunk))
    return _combine(torch.cat(outs), order_N, weight_TK, t, k, x_TD.dtype)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: grouped_mm's CPU backward rejects
    the zero-stride gradients that reductions such as ``sum()`` produce."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _gmm(a_NX: torch.Tensor, w_EYX: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    return _ContiguousGrad.apply(torch._grouped_mm(a_NX, w_EYX.transpose(1, 2), offs=offs_E))


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


def dispatch_grouped(
    x_TD: torch.Tensor, idx_TK: torch.Tensor, weight_TK: torch.Tensor, experts: nn.ModuleList
) -> torch.Tensor:
    """Sorted layout, all experts in one grouped matmul per projection. The experts keep their own
    parameters (Ling's tensor names); stacking them costs one copy of the expert weights per call."""
    t, k = idx_TK.shape
    order_N, counts_E, _ = _sort_by_expert(idx_TK, len(experts))
    dtype = x_TD.dtype
    if torch.is_autocast_enabled(x_TD.device.type):
        # grouped_mm has no autocast rule; cast explicitly as autocast would for a matmul.
        dtype = torch.get_autocast_dtype(x_TD.device.type)
    with torch.autocast(device_type=x_TD.device.type, enabled=False):
        xs_ND = x_TD[order_N // k].to(dtype)
        mlps = [cast(MLP, e) for e in experts]  # ModuleList items are typed as plain Modules
        gate = torch.stack([e.gate_proj.weight for e in mlps]).to(dtype)
        up = torch.stack([e.up_proj.weight for e in mlps]).to(dtype)
        down = torch.stack([e.down_proj.weight for e in mlps]).to(dtype)
        offs = counts_E.cumsum(0).to(torch.int32)
        h_NI = F.silu(_gmm(xs_ND, gate, offs)) * _gmm(xs_ND, up, offs)
        ys_ND = _gmm(h_NI, down, offs)
    return _combine(ys_ND, order_N, weight_TK, t, k, x_TD.dtype)


_DISPATCH = {"naive": dispatch_naive, "sorted": dispatch_sorted, "grouped": dispatch_grouped}


class SparseMoeBlock(nn.Module):
    """``mlp`` of a MoE layer: routed experts (weighted by the router) plus the shared expert (no gate)."""

    def __init__(self, config: LingConfig, dispatch: Dispatch = "sorted") -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.gate = Router(config)
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)
        )
        self.shared_experts = (
            MLP(config.hidden_size, config.moe_intermediate_size * config.num_shared_experts)
            if config.num_shared_experts > 0
            else None
        )
        self.dispatch: Dispatch = dispatch

    def expert(self, e: int) -> MLP:
        """Routed expert ``e``, typed (a ModuleList's items are typed as plain Modules)."""
        return cast(MLP, self.experts[e])

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, RouterOutput]:
        b, s, d = x_BSD.shape
        x_TD = x_BSD.reshape(b * s, d)
        route = self.gate(x_TD)
        y_TD = _DISPATCH[self.dispatch](x_TD, route.topk_idx_TK, route.topk_weight_TK, self.experts)
        y = y_TD.view(b, s, d)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x_BSD)
        return y, route
