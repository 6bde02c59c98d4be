"""Routed experts for inference: all experts of a layer in two grouped matrix products per step.

Training keeps one ``MLP`` per expert (Ling's tensor names, a gradient per expert). For inference the
experts' weights are stacked once, gate and up fused, input-major (``[E, D, 2I]`` and ``[E, I, D]``), and
the experts' own parameters become views of the stack, so memory is not doubled. A decode step of 64 tokens at top-6
over 64 experts is then two ``torch._grouped_mm`` calls per layer instead of 192 small products.

Where flood's native kernels are built (``native/kernels.h``), float32 and bfloat16 experts take them instead:
one call per layer walks every expert in use, each row computed alone, so no padding is needed. Otherwise (and
for a torch fallback) each expert's group is padded with zero rows to at least ``MIN_ROWS``: like plain products, grouped
products of 1-3 rows take other kernels than larger groups, and a token's result must not depend on how
many other tokens chose the same expert (measured: from 4 rows on, a row's result is the same bits for
any group size and position). Only real tokens are routed; padding rows of the step batch are not.

Shape legend: T tokens, K experts per token, N = T*K routed slots, P padded slots, E experts, D hidden,
I expert width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from lingctl.flood.engine.native import kernels
from lingctl.model.moe import SparseMoeBlock, dispatch_sorted, grouped_mm_available

# Up to this many experts in use, one product per expert beats the grouped kernel (measured on 64 experts:
# at batch size 1 the grouped call cost 345 us, six separate products about half of that).
LOOP_MAX_EXPERTS = 12
# Float experts the native kernel computes (int8 ones take their own path).
NATIVE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(slots=True)
class ExpertStack:
    """All routed experts of one MoE layer in two tensors, as a loader builds them: gate and up fused,
    ``gate_up_EXD`` [E, 2I, D] (rows ``[:I]`` gate, ``[I:]`` up) and ``down_EDI`` [E, D, I]. Float weights, or
    int8 with per-output-row scales ``gate_up_scale_EX`` [E, 2I] and ``down_scale_ED`` [E, D] (w = q * scale).
    The experts' own parameters (or ``Int8Linear`` buffers) are views into these, so nothing is held twice."""

    gate_up_EXD: torch.Tensor
    down_EDI: torch.Tensor
    gate_up_scale_EX: torch.Tensor | None = None
    down_scale_ED: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.gate_up_scale_EX is not None


STACK_ATTR = "flood_expert_stack"


def attach_stack(block: SparseMoeBlock, stack: ExpertStack) -> None:
    """Record that ``block``'s experts are views of ``stack`` (a plain attribute, not a module or buffer, so
    the state dict keeps Ling's per-expert names)."""
    object.__setattr__(block, STACK_ATTR, stack)


def stack_of(block: SparseMoeBlock) -> ExpertStack | None:
    """The stack ``block``'s experts are views of, or None: none was attached, or the experts' weights have
    been replaced since (e.g. ``model.to(dtype)``), which leaves the recorded stack stale."""
    stack = getattr(block, STACK_ATTR, None)
    if not isinstance(stack, ExpertStack):
        return None
    first = block.expert(0).gate_proj
    # A quantized expert's projections are Int8Linear modules in the nn.Linear slots, holding weight_q.
    weight = cast(torch.Tensor, first.weight_q) if stack.quantized else first.weight
    if (
        weight.dtype != stack.gate_up_EXD.dtype
        or weight.untyped_storage().data_ptr() != stack.gate_up_EXD.untyped_storage().data_ptr()
    ):
        return None
    return stack


class StackedExperts:
    """The experts of one layer stacked *input-major* for inference: gate|up as ``[E, D, 2I]`` and down as
    ``[E, I, D]``, both contiguous, so every product reads its weight row-major ("x @ W"). Measured on
    this CPU with weights that are not in cache (a decode step reads each expert once): 1.5x faster than
    the ``[out, in]`` layout of ``nn.Linear``, bit for bit the same results in the shapes measured. The experts' own parameters (or int8
    buffers) are re-pointed at views of the stacks, so nothing is held twice. A loader that already built
    the stacks in this layout (``attach_stack``) costs no copy at all."""

    def __init__(self, block: SparseMoeBlock, min_rows: int) -> None:
        experts = block.experts
        self.num_experts = len(experts)
        self.min_rows = min_rows
        stack = stack_of(block)
        with torch.no_grad():
            if stack is None:
                stack = _stack_float(block)
            self.quantized = stack.quantized
            self.width = stack.down_EDI.shape[2]
            gate_up_EDX = stack.gate_up_EXD.transpose(1, 2)
            down_EID = stack.down_EDI.transpose(1, 2)
            # int8 stacks stay output-major, as the loader built them: the native kernel reads a weight row
            # per output (one copy of the model, no transpose at load); float ones become input-major.
            keep = self.quantized and stack.gate_up_EXD.is_contiguous() and stack.down_EDI.is_contiguous()
            if not keep and not (gate_up_EDX.is_contiguous() and down_EID.is_contiguous()):
                gate_up_EDX, down_EID = gate_up_EDX.contiguous(), down_EID.contiguous()
                _repoint(block, gate_up_EDX, down_EID, stack)
        self.gate_up_EDX = gate_up_EDX
        self.down_EID = down_EID
        self.gate_up_scale_EX = stack.gate_up_scale_EX
        self.down_scale_ED = stack.down_scale_ED
        # w8a8 (the experts' Int8Linear modules say so): activations quantized to int8 in the kernel too.
        self.act_int8 = bool(getattr(block.expert(0).gate_proj, "act_int8", False))
        # The kernel's operands for int8 weights: output-major stacks and float32 scales (a few MB per layer).
        self.native_q8: tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None
        if keep and stack.gate_up_scale_EX is not None and stack.down_scale_ED is not None:
            self.native_q8 = (
                stack.gate_up_EXD,
                stack.down_EDI,
                (stack.gate_up_scale_EX.float().contiguous(), stack.down_scale_ED.float().contiguous()),
            )

    @staticmethod
    def usable(block: SparseMoeBlock) -> bool:
        """Plain float linear experts, or int8 experts whose stacks a loader attached."""
        e = block.expert(0)
        if stack_of(block) is not None:
            return True
        return (
            all(type(m) is nn.Linear for m in (e.gate_proj, e.up_proj, e.down_proj))
            and e.gate_proj.weight.device.type != "meta"
        )

    def _product_of(self, e: int, rows_PD: torch.Tensor) -> torch.Tensor:
        """One expert's SwiGLU on its rows; int8 weights are widened one expert at a time (the scales
        multiply the product's columns, as ``Int8Linear`` does)."""
        i = self.width
        if self.quantized:
            assert self.gate_up_scale_EX is not None and self.down_scale_ED is not None
            dtype = rows_PD.dtype
            h = torch.mm(rows_PD, self.gate_up_EDX[e].to(dtype)) * self.gate_up_scale_EX[e].to(dtype)
            act = F.silu(h[:, :i]) * h[:, i:]
            return torch.mm(act, self.down_EID[e].to(dtype)) * self.down_scale_ED[e].to(dtype)
        h = torch.mm(rows_PD, self.gate_up_EDX[e])
        return torch.mm(F.silu(h[:, :i]) * h[:, i:], self.down_EID[e])

    def __call__(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, weight_TK: torch.Tensor) -> torch.Tensor:
        if self.native_q8 is not None and x_TD.dtype == torch.float32 and x_TD.device.type == "cpu":
            native_q8 = kernels()
            if native_q8 is not None:
                # int8 experts, float32 activations: the weights are read once per step for all rows routed to
                # them and widened in registers.
                gate_up, down, scales = self.native_q8
                return native_q8.moe(x_TD, idx_TK, weight_TK, gate_up, down, scales, act_int8=self.act_int8)
        native = kernels() if not self.quantized and x_TD.dtype in NATIVE_DTYPES else None
        if (
            native is not None
            and self.gate_up_EDX.dtype == x_TD.dtype
            and native.moe_supported(self.gate_up_EDX.shape[1], self.width, idx_TK.shape[1])
        ):
            # One call walks every expert in use; a row's result depends on that row alone, so float32 and
            # bfloat16 steps (decode and prompt alike) all take this path and stay batch-invariant without
            # padding. bfloat16 sums are float32, rounded once here, as torch's bf16 products round theirs.
            return native.moe(x_TD, idx_TK, weight_TK, self.gate_up_EDX, self.down_EID).to(x_TD.dtype)
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
        # index_select rather than x_ext[src_P]: the same rows, several times faster on CPU
        xs_PD = x_ext.index_select(0, src_P)
        active = torch.nonzero(counts_E).flatten().tolist()
        if self.quantized or len(active) <= LOOP_MAX_EXPERTS or not grouped_mm_available():
            # Few experts in use (small steps, batch size 1): the grouped kernel still walks every group,
            # a product per active expert is faster. Both give the same bits for groups of >= 4 rows.
            # int8 experts always take this path: only the experts in use are widened.
            bounds = offs_E.tolist()
            ys_PD = torch.cat([self._product_of(e, xs_PD[bounds[e] - int(padded_E[e]) : bounds[e]]) for e in active])
        else:
            offs = offs_E.to(torch.int32)
            h_PX = torch._grouped_mm(xs_PD, self.gate_up_EDX, offs=offs)
            act_PI = F.silu(h_PX[:, : self.width]) * h_PX[:, self.width :]
            ys_PD = torch._grouped_mm(act_PI, self.down_EID, offs=offs)
        # The k weighted outputs of a token are summed in float32, in expert order, as the model's MoE does.
        w_N = weight_TK.reshape(-1)[order_N].unsqueeze(-1)
        y_TD = torch.zeros(t, ys_PD.shape[-1], dtype=torch.float32)
        return y_TD.index_add_(0, order_N // k, ys_PD.index_select(0, dest_N).to(torch.float32) * w_N).to(x_TD.dtype)


def _stack_float(block: SparseMoeBlock) -> ExpertStack:
    """Stacks of a model built in memory (not by a loader), already input-major: the transposes below are
    views of contiguous ``[E, D, 2I]`` / ``[E, I, D]`` tensors."""
    experts = block.experts
    e0 = block.expert(0)
    i, d = e0.gate_proj.out_features, e0.gate_proj.in_features
    dtype = e0.gate_proj.weight.dtype
    gate_up_EDX = torch.empty(len(experts), d, 2 * i, dtype=dtype)
    down_EID = torch.empty(len(experts), i, d, dtype=dtype)
    for n in range(len(experts)):
        e = block.expert(n)
        gate_up_EDX[n, :, :i] = e.gate_proj.weight.t()
        gate_up_EDX[n, :, i:] = e.up_proj.weight.t()
        down_EID[n] = e.down_proj.weight.t()
    stack = ExpertStack(gate_up_EXD=gate_up_EDX.transpose(1, 2), down_EDI=down_EID.transpose(1, 2))
    _repoint(block, gate_up_EDX, down_EID, stack)
    return stack


def _repoint(block: SparseMoeBlock, gate_up_EDX: torch.Tensor, down_EID: torch.Tensor, stack: ExpertStack) -> None:
    """Make each expert's weights views of the input-major stacks (the old tensors are freed)."""
    i = down_EID.shape[1]
    for n, e in enumerate(block.experts):
        views = {
            "gate_proj": gate_up_EDX[n, :, :i].t(),
            "up_proj": gate_up_EDX[n, :, i:].t(),
            "down_proj": down_EID[n].t(),
        }
        for name, view in views.items():
            linear = getattr(e, name)
            if stack.quantized:
                linear.weight_q = view  # a registered buffer: plain assignment replaces it
            else:
                linear.weight = nn.Parameter(view, requires_grad=False)
    attach_stack(
        block,
        ExpertStack(
            gate_up_EXD=gate_up_EDX.transpose(1, 2),
            down_EDI=down_EID.transpose(1, 2),
            gate_up_scale_EX=stack.gate_up_scale_EX,
            down_scale_ED=stack.down_scale_ED,
        ),
    )


def routed_experts(
    block: SparseMoeBlock,
    stacked: StackedExperts | None,
    x_TD: torch.Tensor,
    idx_TK: torch.Tensor,
    weight_TK: torch.Tensor,
    min_rows: int,
) -> torch.Tensor:
    if stacked is not None:
        return stacked(x_TD, idx_TK, weight_TK)
    return dispatch_sorted(x_TD, idx_TK, weight_TK, block.experts, min_rows=min_rows)
