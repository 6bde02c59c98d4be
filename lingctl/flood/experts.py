"""Routed experts for inference: all experts of a layer in two grouped matrix products per step.

Training keeps one ``MLP`` per expert (Ling's tensor names, a gradient per expert). For inference the
experts' weights are stacked once, gate and up fused, ``[E, 2I, D]`` and ``[E, D, I]``, and the experts'
own parameters become views of the stack, so memory is not doubled. A decode step of 64 tokens at top-6
over 64 experts is then two ``torch._grouped_mm`` calls per layer instead of 192 small products.

Each expert's group is padded with zero rows to at least ``MIN_ROWS``: like plain products, grouped
products of 1-3 rows take other kernels than larger groups, and a token's result must not depend on how
many other tokens chose the same expert (measured: from 4 rows on, a row's result is the same bits for
any group size and position). Only real tokens are routed; padding rows of the step batch are not.

Shape legend: T tokens, K experts per token, N = T*K routed slots, P padded slots, E experts, D hidden,
I expert width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lingctl.model.moe import SparseMoeBlock, dispatch_sorted, grouped_mm_available


# Up to this many experts in use, one product per expert beats the grouped kernel (measured on 64 experts:
# at batch size 1 the grouped call cost 345 us, six separate products about half of that).
LOOP_MAX_EXPERTS = 12


class StackedExperts:
    def __init__(self, block: SparseMoeBlock, min_rows: int) -> None:
        experts = block.experts
        self.num_experts = len(experts)
        self.width = experts[0].gate_proj.out_features
        self.min_rows = min_rows
        with torch.no_grad():
            self.gate_up_EXD = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in experts])
            self.down_EDI = torch.stack([e.down_proj.weight for e in experts])
            i = self.width
            for n, e in enumerate(experts):  # the block's parameters now point into the stacks
                e.gate_proj.weight = nn.Parameter(self.gate_up_EXD[n, :i], requires_grad=False)
                e.up_proj.weight = nn.Parameter(self.gate_up_EXD[n, i:], requires_grad=False)
                e.down_proj.weight = nn.Parameter(self.down_EDI[n], requires_grad=False)

    @staticmethod
    def usable(block: SparseMoeBlock) -> bool:
        """Plain float linear experts on a torch with grouped products (int8 experts keep their loop)."""
        e = block.experts[0]
        return (grouped_mm_available() and all(type(m) is nn.Linear for m in (e.gate_proj, e.up_proj, e.down_proj))
                and e.gate_proj.weight.device.type != "meta")

    def __call__(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weight_TK: torch.Tensor) -> torch.Tensor:
        t, k = idx_TK.shape
        flat_N = idx_TK.reshape(-1)
        order_N = flat_N.argsort(stable=True)
        expert_N = flat_N[order_N]
        counts_E = torch.bincount(flat_N, minlength=self.num_experts)
        padded_E = torch.where(counts_E > 0, counts_E.clamp(min=self.min_rows), counts_E)
        offs_E = padded_E.cumsum(0)
        start_E = offs_E - padded_E
        real_start_E = counts_E.cumsum(0) - counts_E
        # Where each routed slot lands in the padded layout; the other rows read the appended zero row.
        dest_N = start_E[expert_N] + torch.arange(flat_N.numel()) - real_start_E[expert_N]
        src_P = torch.full((int(offs_E[-1]),), t, dtype=torch.long)
        src_P[dest_N] = order_N // k
        x_ext = torch.cat([x_TD, x_TD.new_zeros(1, x_TD.shape[1])])
        xs_PD = x_ext[src_P]
        active = torch.nonzero(counts_E).flatten().tolist()
        if len(active) <= LOOP_MAX_EXPERTS:
            # Few experts in use (small steps, batch size 1): the grouped kernel still walks every group,
            # a product per active expert is faster. Both give the same bits for groups of >= 4 rows.
            bounds = offs_E.tolist()
            ys = []
            for e in active:
                rows = xs_PD[bounds[e] - int(padded_E[e]):bounds[e]]
                h = F.linear(rows, self.gate_up_EXD[e])
                ys.append(F.linear(F.silu(h[:, :self.width]) * h[:, self.width:], self.down_EDI[e]))
            ys_PD = torch.cat(ys)
        else:
            offs = offs_E.to(torch.int32)
            h_PX = torch._grouped_mm(xs_PD, self.gate_up_EXD.transpose(1, 2), offs=offs)
            act_PI = F.silu(h_PX[:, :self.width]) * h_PX[:, self.width:]
            ys_PD = torch._grouped_mm(act_PI, self.down_EDI.transpose(1, 2), offs=offs)
        # The k weighted outputs of a token are summed in float32, in expert order, as the model's MoE does.
        w_N = weight_TK.reshape(-1)[order_N].unsqueeze(-1)
        y_TD = torch.zeros(t, ys_PD.shape[-1], dtype=torch.float32)
        return y_TD.index_add_(0, order_N // k, ys_PD[dest_N].to(torch.float32) * w_N).to(x_TD.dtype)


def routed_experts(block: SparseMoeBlock, stacked: StackedExperts | None, x_TD: torch.Tensor,
                   idx_TK: torch.Tensor, weight_TK: torch.Tensor, min_rows: int) -> torch.Tensor:
    if stacked is not None:
        return stacked(x_TD, idx_TK, weight_TK)
    return dispatch_sorted(x_TD, idx_TK, weight_TK, block.experts, min_rows=min_rows)
