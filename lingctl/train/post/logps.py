"""Log-probabilities of packed rows: one forward, logits only at the trained tokens, sums per block (an
example, or one answer of a pair), and the routers' decisions for real tokens only. The SFT and DPO losses
(``objective.py``) and a DPO run's reference (``reference.py``) are computed from these.

Shape legend: B rows, L tokens per row, T = B*L, N trained tokens, S blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from lingctl.model.moe import RouterOutput
from lingctl.train.post.batch import IGNORE, PackedBatch
from lingctl.train.post.packing import PackedRows


def masked_routes(routes: list[RouterOutput], keep_T: torch.Tensor) -> list[RouterOutput]:
    """The routers' decisions for the kept tokens only: padding never counts in the balance loss, the z-loss
    or the expert-load statistics."""
    if bool(keep_T.all()):
        return routes
    return [
        RouterOutput(r.topk_idx_TK[keep_T], r.topk_weight_TK[keep_T], r.logits_TE[keep_T], r.probs_TE[keep_T])
        for r in routes
    ]


@dataclass(slots=True)
class TokenLogps:
    logp_N: torch.Tensor  # float32: log-probability of each trained token
    block_N: torch.Tensor  # int64: its block
    routes: list[RouterOutput]  # real tokens only


def token_logps(module: torch.nn.Module, batch: PackedBatch, *, bf16: bool = False) -> TokenLogps:
    """One forward of the packed batch; logits only where a loss is taken."""
    targets_T = batch.targets_BL.reshape(-1)
    at_N = (targets_T != IGNORE).nonzero().squeeze(1)
    device_type = batch.input_ids_BL.device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
        out = module(batch.input_ids_BL, batch.positions_BL, batch.blocks, at_N)
        logits_NV = out.logits.to(torch.float32)
    logp_N = -F.cross_entropy(logits_NV, targets_T[at_N], reduction="none")
    return TokenLogps(logp_N, batch.block_BL.reshape(-1)[at_N], masked_routes(out.routes, batch.real_BL.reshape(-1)))


def block_sums(t: TokenLogps, n_blocks: int) -> torch.Tensor:
    """Per block, the summed log-probability of its trained tokens [S]."""
    return torch.zeros(n_blocks, dtype=t.logp_N.dtype).index_add(0, t.block_N, t.logp_N)


@torch.no_grad()
def item_logps(
    model: torch.nn.Module,
    rows: PackedRows,
    *,
    indices: Sequence[int] | None = None,
    batch_rows: int = 1,
    bf16: bool = False,
) -> np.ndarray:
    """Per item of ``rows``, the summed log-probability of its trained tokens: [items, 2] float64 (chosen or
    the example, rejected; 0 where an item has no such side, or its row is not among ``indices``, the rows to
    compute; None: all). The reference of a DPO run, and a check."""
    todo = list(range(len(rows))) if indices is None else list(indices)
    out = np.zeros((rows.n_items, 2), dtype=np.float64)
    for start in range(0, len(todo), batch_rows):
        batch = PackedBatch.of(rows, todo[start : start + batch_rows])
        sums = block_sums(token_logps(model, batch, bf16=bf16), batch.n_blocks).to(torch.float64).numpy()
        out[batch.block_item_S.numpy(), batch.block_side_S.numpy()] = sums
    return out


def example_logps(model: torch.nn.Module, examples: list[Any], *, seq_len: int) -> torch.Tensor:
    """The summed log-probability of each example's trained tokens, computed packed [len(examples)]."""
    from lingctl.runs.train_config import Stage
    from lingctl.train.post.packing import pack

    was = model.training
    model.eval()
    try:
        logps = item_logps(model, pack(examples, [Stage(seq_len, None)]))
    finally:
        model.train(was)
    return torch.from_numpy(logps[:, 0])
